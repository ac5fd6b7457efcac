"""``dspark-jax demo`` runs on the bundled pair and reports τ > 1."""

import re

import pytest

from dspark_jax.bundled import TARGET_DIR, load_bundled
from dspark_jax.cli import main

# Two prompts and 16 new tokens: the same shapes as the notebooks' and the eval test's
# generation calls, so the compiled rounds are shared within one test session.
PROMPTS = ['def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n', "import sys\n\n\ndef main(argv):\n"]


def test_demo_prints_tau_above_one_and_matches_plain_greedy(capsys):
    assert main(["demo", "--max-new", "16", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    out = capsys.readouterr().out
    taus = {m.group(1): float(m.group(2)) for m in re.finditer(r"^τ \((greedy|temperature 1)\) = ([0-9.]+)", out, re.M)}
    assert set(taus) == {"greedy", "temperature 1"}, out
    assert all(t > 1.0 for t in taus.values()), taus
    assert "greedy output identical to plain decoding: yes" in out
    assert len(re.findall(r"^acceptance by position 1\.\.7: ", out, re.M)) == 2
    predicted = re.findall(r"^predicted by its confidence head:  ((?:[01]\.\d\d ?){7})$", out, re.M)
    assert len(predicted) == 2, out
    for line in predicted:  # survival: never increases along the block
        values = [float(v) for v in line.split()]
        assert all(a >= b for a, b in zip(values, values[1:], strict=False)) and values[0] > 0
    assert len(re.findall(r"^speed: .* ratio [0-9.]+×", out, re.M)) == 2


def test_demo_flags_out_of_range_and_unknown_commands_are_refused(capsys):
    for flags, says in (
        (["--max-new", "0"], "argument --max-new: '0' is invalid"),
        (["--max-new", "2147483648"], "argument --max-new: '2147483648' is invalid: must be in [1, 2147483647]"),
        (["--seed", "-2"], "--seed"),
    ):
        try:
            main(["demo", *flags])
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{flags} was accepted")
        assert says in capsys.readouterr().err
    assert main(["bogus"]) == 2
    assert "unknown command 'bogus': choose one of demo, generate" in capsys.readouterr().err


def test_demo_names_its_flags_for_an_empty_or_too_long_prompt(capsys):
    """The messages named ``prompts[0]`` and ``max_new_tokens[0]`` instead of the flags."""
    assert main(["demo", "--prompt", ""]) == 2
    assert "dspark-jax demo: error: --prompt '' encodes to no tokens" in capsys.readouterr().err
    assert main(["demo", "--max-new", "100000"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"error: built-in prompt 1 has \d+ tokens: with --max-new 100000 .* lower --max-new\n", err), err


def test_demo_checkpoint_flags_are_refused_by_name(tmp_path, capsys):
    """A missing draft was refused only after the target had loaded, and a target folder given
    as the draft as ``draft config is missing the required field 'mask_token_id'``, naming
    neither the flag nor the folder."""
    assert main(["demo", "--draft", str(tmp_path / "none")]) == 2
    says = f"--draft {str(tmp_path / 'none')!r} does not exist: expected a checkpoint folder with config.json"
    assert capsys.readouterr().err == f"dspark-jax demo: error: {says}\n"
    assert main(["demo", "--target", str(tmp_path)]) == 2
    assert "error: --target " + repr(str(tmp_path)) + " has no config.json or tokenizer.json" in capsys.readouterr().err
    assert main(["demo", "--draft", TARGET_DIR]) == 2
    says = f"--draft {TARGET_DIR!r}: draft config is missing the required field 'mask_token_id'"
    assert capsys.readouterr().err == f"dspark-jax demo: error: {says}\n"


def test_load_bundled_refuses_a_draft_or_dtype_it_cannot_name():
    """``dtype=None`` loaded the target in float16 and the draft in float32; a list as the
    draft's name failed as an unhashable type."""
    with pytest.raises(TypeError, match="dtype=None is invalid: must be a dtype name"):
        load_bundled(dtype=None)
    with pytest.raises(ValueError, match=r"draft=\['dspark'\] is invalid: must be one of \['dflash', 'dspark'\]"):
        load_bundled(["dspark"])
    target, draft, tokenizer = load_bundled("dflash", dtype="bfloat16")
    assert draft.cfg.markov_rank == 0 and tokenizer.vocab_size == target.config.vocab_size


def test_demo_says_no_when_plain_greedy_decoding_differs(capsys, monkeypatch):
    """The demo's losslessness line compares the two outputs: plain decoding made to differ in
    one token must print NO (a line hard-wired to yes passed the test above)."""
    import dataclasses

    from dspark_jax import generation

    real = generation.generate

    def one_token_off(*args, **kwargs):
        result = real(*args, **kwargs)
        first = [result.tokens[0][0] + 1, *result.tokens[0][1:]]
        return dataclasses.replace(result, tokens=[first, *result.tokens[1:]])

    monkeypatch.setattr(generation, "generate", one_token_off)
    assert main(["demo", "--max-new", "16", "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]]) == 0
    assert "greedy output identical to plain decoding: NO" in capsys.readouterr().out


def test_demo_speed_line_is_each_runs_new_tokens_over_its_seconds(capsys, monkeypatch):
    """The speed line from stand-in generations and timings: speculative and plain tok/s are all
    new tokens of all prompts over that run's timed seconds, the ratio speculative / plain."""
    import types

    from dspark_jax import demo, generation

    spec = types.SimpleNamespace(
        tokens=[[5, 6, 7], [8, 9]],
        tau=[2.0, 1.5],
        tau_overall=1.8,
        rounds=3,
        acceptance_by_position=[0.5] * 7,
        confidence_by_position=[],
    )
    plain = types.SimpleNamespace(tokens=[[5, 6, 7, 1], [8, 9, 2]])
    monkeypatch.setattr(generation, "speculative_generate", lambda *args, **kwargs: spec)
    monkeypatch.setattr(generation, "generate", lambda *args, **kwargs: plain)
    seconds = iter([0.5, 2.0, 0.25, 1.75])  # speculative then plain, greedy then temperature 1
    monkeypatch.setattr(demo, "_timed", lambda fn: (fn(), next(seconds)))
    assert main(["demo", "--max-new", "4", "--prompt", "def f():", "--prompt", "x = 1"]) == 0
    out = capsys.readouterr().out
    speeds = re.findall(r"^speed: speculative ([\d.]+) tok/s, plain ([\d.]+) tok/s, ratio ([\d.]+)×", out, re.M)
    want = [(5 / 0.5, 7 / 2.0), (5 / 0.25, 7 / 1.75)]
    assert speeds == [(f"{s:.1f}", f"{p:.1f}", f"{s / p:.2f}") for s, p in want], out
    assert "greedy output identical to plain decoding: NO" in out
