"""``dspark-jax eval`` on the bundled pair (small scale) and its pieces."""

import json
import os
import re

import numpy as np
import pytest

from dspark_jax.bundled import DRAFT_DIRS, TARGET_DIR
from dspark_jax.cli import main
from dspark_jax.corpus import load_corpus
from dspark_jax.evaluate import draft_labels, format_tables, heldout_prompts
from dspark_jax.tokenizer import load_tokenizer


def test_eval_reports_tau_for_both_drafts(tmp_path, capsys):
    path = tmp_path / "eval.json"
    argv = ["eval", "--prompts", "2", "--prompt-len", "16", "--max-new", "16", "--temperatures", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| DSpark / DFlash-style |" in out
    results = json.loads(path.read_text())["results"]
    assert set(results) == {"DSpark", "DFlash-style"}
    for per_temperature in results.values():
        r = per_temperature["1.0"]
        assert 1.0 <= r["tau"] <= 8.0  # at least the bonus, at most γ + 1
        acc = r["acceptance_by_position"]
        assert len(acc) == 7 and all(a >= b for a, b in zip(acc, acc[1:], strict=False))
    for name in results:  # both bundled drafts have a confidence head: its prediction follows their row
        predicted = results[name]["1.0"]["confidence_by_position"]
        assert len(predicted) == 7 and all(1 >= a >= b > 0 for a, b in zip(predicted, predicted[1:], strict=False))
        assert f"| {name}, predicted | " + " | ".join(f"{a:.2f}" for a in predicted) + " |" in out


def test_heldout_prompts_come_from_heldout_files_only():
    tok = load_tokenizer(TARGET_DIR)
    prompts = heldout_prompts(tok, count=4, length=24, seed=3)
    assert [len(p) for p in prompts] == [24] * 4
    heldout = "".join(load_corpus().texts("heldout"))
    for p in prompts:
        assert tok.decode(p) in heldout
    with pytest.raises(ValueError, match="count"):
        heldout_prompts(tok, count=0, length=8)


def test_tables_show_ratio_against_the_baseline():
    def entry(tau):
        return {"tau": tau, "acceptance_by_position": list(np.linspace(0.5, 0.1, 7))}

    results = {"A": {0.0: entry(3.0), 1.0: entry(2.2)}, "B": {0.0: entry(2.0), 1.0: entry(2.0)}}
    results["A"][0.0]["confidence_by_position"] = [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]
    results["B"][0.0]["confidence_by_position"] = []  # no confidence head: no prediction row
    text = format_tables(results)
    assert "| A / B | 1.500× | 1.100× |" in text
    assert "| A | 3.000 | 2.200 |" in text
    assert text.count("| A, predicted | 0.90 | 0.80 | 0.70 | 0.60 | 0.50 | 0.40 | 0.30 |") == 1
    assert "| B, predicted |" not in text


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--prompts", "0"], "argument --prompts: '0' is invalid: must be >= 1"),
        (["--max-new", "-3"], "argument --max-new: '-3' is invalid: must be in [1, 2147483647]"),
        (
            ["--temperatures", "nan"],
            "argument --temperatures: 'nan' is invalid: must be in [0, 3.4028234663852886e+38]",
        ),
        (["--seed", "-1"], "argument --seed: '-1' is invalid: must be in [0, 4294967295]"),
        (["--seed", "99999999999999999999999"], "argument --seed: '99999999999999999999999' is invalid"),
        # the round reads max_new_tokens as int32 and temperatures as float32 (were refused after loading)
        (["--max-new", "2147483648"], "argument --max-new: '2147483648' is invalid: must be in [1, 2147483647]"),
        (
            ["--temperatures", "1e39"],
            "argument --temperatures: '1e39' is invalid: must be in [0, 3.4028234663852886e+38]",
        ),
    ],
)
def test_eval_flags_out_of_range_are_refused_by_argparse(flags, says, capsys):
    """Before, these failed after loading, naming internal fields (``count=0``, ``temperature[0]``)."""
    with pytest.raises(SystemExit) as exit_:
        main(["eval", *flags])
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_eval_refuses_bad_settings_before_reading_the_held_out_text(tmp_path, capsys):
    """Repeated temperatures were merged into fewer columns; a --json in a missing folder failed
    after the whole evaluation; prompts too long for the models failed after encoding; an empty
    --baseline-draft was taken for 'none'. Each is
    one line naming the flag, exit status 2."""

    def refused(argv: list[str], says: str) -> None:
        assert main(["eval", *argv]) == 2
        err = capsys.readouterr().err
        assert re.fullmatch(f"dspark-jax eval: error: {says}\n", err), err

    refused(["--temperatures", "0", "0", "1"], r"--temperatures \[0.0, 0.0, 1.0\] is invalid: each temperature once")
    for path in (tmp_path / "missing" / "x.json", tmp_path):
        refused(["--json", str(path)], "--json=.* is invalid: must be a file path in an existing folder")
    refused(["--baseline-draft", ""], "--baseline-draft '' is invalid: give a draft checkpoint folder, or 'none' .*")
    refused(["--prompt-len", "500"], r"--prompt-len 500 \+ --max-new 128 .* exceed the models' max_position.*")


def test_eval_checkpoint_flags_are_checked_by_name_before_loading(tmp_path, capsys):
    """A missing checkpoint was reported by the loader (``target path ... has no config.json``)
    after the flags before it had loaded."""
    (tmp_path / "file").write_text("")
    for flag, path, says in (
        (
            "--target",
            tmp_path / "none",
            "does not exist: expected a checkpoint folder with config.json and tokenizer.json",
        ),
        ("--draft", tmp_path, "has no config.json: expected a checkpoint folder with config.json"),
        ("--baseline-draft", tmp_path / "file", "is not a folder: expected a checkpoint folder with config.json"),
    ):
        assert main(["eval", flag, str(path)]) == 2
        assert capsys.readouterr().err == f"dspark-jax eval: error: {flag} {str(path)!r} {says}\n"


def test_eval_refuses_a_json_path_it_cannot_write_before_evaluating(tmp_path, capsys, monkeypatch):
    """A --json under a read-only folder printed the results, then failed with a traceback.
    The folder is read-only to ``os.access`` (chmod does not bind root, who runs CI boxes)."""
    locked = str(tmp_path / "locked")
    os.mkdir(locked)
    real = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: False if str(path) == locked else real(path, mode))
    assert main(["eval", "--json", os.path.join(locked, "out.json")]) == 2
    assert "--json=" in (err := capsys.readouterr().err) and "cannot be written" in err, err


def test_drafts_are_labelled_by_their_markov_head_not_by_flag_position():
    """``--draft`` was always "DSpark" and ``--baseline-draft`` "DFlash-style", even swapped."""
    assert draft_labels([4, 0]) == ["DSpark", "DFlash-style"]
    assert draft_labels([0, 4]) == ["DFlash-style", "DSpark"]
    assert draft_labels([0]) == ["DFlash-style"]
    assert draft_labels([2, 4]) == ["DSpark (--draft)", "DSpark (--baseline-draft)"]
    assert draft_labels([0, 0]) == ["DFlash-style (--draft)", "DFlash-style (--baseline-draft)"]


def test_eval_with_the_bundled_drafts_swapped_names_each_by_its_kind(tmp_path, capsys):
    path = tmp_path / "eval.json"
    argv = ["eval", "--prompts", "1", "--prompt-len", "8", "--max-new", "4", "--temperatures", "0"]
    swapped = ["--draft", DRAFT_DIRS["dflash"], "--baseline-draft", DRAFT_DIRS["dspark"]]
    assert main([*argv, *swapped, "--json", str(path)]) == 0
    assert "| DFlash-style / DSpark |" in capsys.readouterr().out
    assert list(json.loads(path.read_text())["results"]) == ["DFlash-style", "DSpark"]


def test_heldout_prompts_open_right_after_a_newline_token():
    """Each prompt starts at a token that follows one ending a line (a start one token early,
    at the newline itself, passed the test above)."""
    from dspark_jax.corpus import encode_documents

    tok = load_tokenizer(TARGET_DIR)
    stream = encode_documents(tok, load_corpus().texts("heldout"))
    for p in heldout_prompts(tok, count=4, length=24, seed=3):
        first = np.flatnonzero(stream[: stream.size - len(p) + 1] == p[0])
        starts = [s for s in first if stream[s : s + len(p)].tolist() == p]
        assert starts and any(s > 0 and "\n" in tok.decode([int(stream[s - 1])]) for s in starts), p[:4]


def test_measure_tau_decodes_at_the_temperature_it_is_given():
    """``measure_tau`` at T = 1 is ``speculative_generate`` at T = 1 with the seed's key (an
    ``eval`` whose T = 1 column decoded greedily passed every other test)."""
    import jax

    from dspark_jax.bundled import load_bundled
    from dspark_jax.evaluate import measure_tau
    from dspark_jax.generation import speculative_generate

    target, draft, tok = load_bundled("dspark")
    prompts = [tok.encode("def add(a, b):\n"), tok.encode("import os\n\n\n")]
    got = {t: measure_tau(target, draft, prompts, temperature=t, max_new_tokens=16, seed=4) for t in (0.0, 1.0)}
    want = speculative_generate(target, draft, prompts, max_new_tokens=16, temperature=1.0, key=jax.random.key(4))
    assert got[1.0]["tau"] == want.tau_overall
    assert got[1.0]["acceptance_by_position"] == want.acceptance_by_position
    assert got[0.0]["acceptance_by_position"] != got[1.0]["acceptance_by_position"]


class _NewlineTokenizer:
    """Token 0 decodes to a newline, every other id to a letter."""

    vocab_size = 20

    def decode(self, ids):
        return "".join("\n" if i == 0 else chr(ord("a") + i) for i in ids)


def test_heldout_prompts_never_repeat_a_window_when_there_are_enough_starts(monkeypatch):
    """With exactly ``count`` line starts, the ``count`` prompts are those windows, each once
    (drawn without replacement), whatever the seed."""
    import types

    from dspark_jax import corpus

    count, length = 5, 2
    # 0 (newline) then a distinct 2-token window, five times, then one trailing token.
    stream = np.array([t for k in range(1, count + 1) for t in (0, k, 10 + k)] + [19], np.int32)
    monkeypatch.setattr(corpus, "load_corpus", lambda: types.SimpleNamespace(texts=lambda split: ["unused"]))
    monkeypatch.setattr(corpus, "encode_documents", lambda tok, texts: stream)
    windows = sorted([k, 10 + k] for k in range(1, count + 1))
    for seed in range(10):
        prompts = heldout_prompts(_NewlineTokenizer(), count=count, length=length, seed=seed)
        assert sorted(prompts) == windows, seed


def test_compare_drafts_measures_every_draft_with_the_stop_tokens_it_is_given(monkeypatch):
    from dspark_jax import evaluate

    calls = []

    def spy(target, draft, prompts, **kwargs):
        calls.append((draft, kwargs))
        return {"tau": 1.0}

    monkeypatch.setattr(evaluate, "measure_tau", spy)
    prompts = [[1, 2, 3]]
    out = evaluate.compare_drafts(
        "target", {"a": "draft-a", "b": "draft-b"}, prompts, temperatures=(0.0, 1.0), max_new_tokens=8, stop_tokens=[7]
    )
    assert out == {name: {0.0: {"tau": 1.0}, 1.0: {"tau": 1.0}} for name in ("a", "b")}
    assert [(draft, kw["temperature"]) for draft, kw in calls] == [
        ("draft-a", 0.0),
        ("draft-a", 1.0),
        ("draft-b", 0.0),
        ("draft-b", 1.0),
    ]
    for _, kw in calls:
        assert kw["stop_tokens"] == [7] and kw["max_new_tokens"] == 8 and kw["seed"] == 0
