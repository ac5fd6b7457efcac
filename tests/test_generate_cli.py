"""``dspark-jax generate`` end to end on a tiny saved target, tokenizer and draft."""

from __future__ import annotations

import re

import pytest
from flax import nnx

from dspark_jax.checkpoint import save_draft
from dspark_jax.cli import main
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.target import Qwen3Target, save_target
from dspark_jax.tokenizer import train_bpe


def _save_pair(tmp_path, **draft_fields) -> list[str]:
    """A tiny target (with its tokenizer) and draft saved under ``tmp_path``; returns the
    ``generate`` command's checkpoint flags."""
    tokenizer = train_bpe(["the cat sat on the mat. the cat ate the rat."] * 3, vocab_size=270)
    vocab = tokenizer.vocab_size
    target = Qwen3Target(
        TargetConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=8,
            vocab_size=vocab,
        ),
        rngs=nnx.Rngs(0),
    )
    save_target(target, tmp_path / "target")
    tokenizer.save(tmp_path / "target")
    draft_cfg = DraftConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=vocab,
        block_size=3,
        mask_token_id=tokenizer.mask_id,
        target_layer_ids=(0, 1),
        markov_rank=8,
        **draft_fields,
    )
    draft = DSparkDraft(draft_cfg, rngs=nnx.Rngs(1), embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    save_draft(draft, tmp_path / "draft")
    return ["generate", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]


def test_generate_command_prints_text_and_statistics(tmp_path, capsys):
    argv = _save_pair(tmp_path)
    argv += ["--prompt", "the cat", "--prompt", "a rat", "--max-new-tokens", "6", "--no-stop", "--device-loop"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert out.startswith("--- 'the cat'\nthe cat")
    assert re.search(r"tau \(committed tokens per round\): \d+\.\d+", out)
    assert re.search(r"acceptance by draft position: (\d\.\d\d ?){3}\n", out)
    assert "\n--- 'a rat'\na rat" in out
    assert re.search(r"tau per request: \d+\.\d\d, \d+\.\d\d\n", out)
    assert re.search(r"rounds: \d+, new tokens: 12\n", out)
    assert "verified per request-round" not in out


def test_generate_with_a_measured_verify_schedule_prints_verify_lengths(tmp_path, capsys):
    argv = _save_pair(tmp_path, enable_confidence_head=True)
    argv += ["--prompt", "the cat", "--prompt", "a rat", "--max-new-tokens", "6", "--no-stop"]
    assert main([*argv, "--verify-schedule", "uniform", "--compare"]) == 0
    out = capsys.readouterr().out
    lengths = re.search(
        r"verified per request-round: (\d\.\d\d) \(request-rounds verifying 1 … 4 tokens: ([\d ]+)\)", out
    )
    counts = [int(c) for c in lengths.group(2).split()]
    assert len(counts) == 4 and counts[2] == 0 and sum(counts) > 0  # the uniform rule: widths 1, 2, 4
    mean = sum((j + 1) * c for j, c in enumerate(counts)) / sum(counts)
    assert abs(mean - float(lengths.group(1))) < 0.006
    assert "greedy outputs identical to plain decoding: True" in out


def test_generate_measures_its_schedule_at_a_shorter_context_where_the_prompt_leaves_no_room(tmp_path, capsys):
    """64 positions, γ = 3: the 10 timed rounds need 47, so the 37-token prompt is measured at 17."""
    argv = _save_pair(tmp_path, enable_confidence_head=True, max_position_embeddings=64)
    prompt = "the cat sat on the mat. " * 4
    argv += ["--prompt", prompt, "--max-new-tokens", "6", "--no-stop", "--verify-schedule", "uniform"]
    assert main(argv) == 0
    assert re.search(r"verified per request-round: \d\.\d\d", capsys.readouterr().out)


def test_generate_refuses_a_verify_schedule_without_a_confidence_head(tmp_path, capsys):
    argv = _save_pair(tmp_path) + ["--prompt", "the cat", "--verify-schedule", "per_request"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "dspark-jax generate: error: --verify-schedule per_request needs a --draft with a confidence head" in err


def test_generate_refuses_a_verify_schedule_the_models_have_no_room_to_measure(tmp_path, capsys):
    """The message named the library's arguments: ``lower prompt_len or rounds``."""
    argv = _save_pair(tmp_path, enable_confidence_head=True, max_position_embeddings=40)
    assert main([*argv, "--prompt", "the cat", "--max-new-tokens", "4", "--verify-schedule", "per_request"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(
        r"dspark-jax generate: error: --verify-schedule per_request measures 10 timed rounds, which need 48 "
        r"positions .* max_position_embeddings=40: drop --verify-schedule, or give a --target and --draft with "
        r"more positions\n",
        err,
    ), err


def test_generate_names_the_prompt_and_max_new_tokens_flags_of_a_prompt_that_does_not_fit(tmp_path, capsys):
    """The messages named ``prompts[0]`` and ``max_new_tokens[0]``."""
    argv = _save_pair(tmp_path, max_position_embeddings=40)
    assert main([*argv, "--prompt", "", "--max-new-tokens", "4"]) == 2
    assert "error: --prompt '' encodes to no tokens: every prompt needs >= 1 token" in capsys.readouterr().err
    assert main([*argv, "--prompt", "the cat", "--max-new-tokens", "40"]) == 2
    err = capsys.readouterr().err
    assert re.search(
        r"error: --prompt 'the cat' has \d+ tokens: with --max-new-tokens 40 .* past the draft's "
        r"max_position_embeddings=40: shorten the prompt or lower --max-new-tokens\n",
        err,
    ), err


def test_out_of_range_sampling_flags_are_refused_by_name_before_loading(tmp_path, capsys):
    """Bad numbers are refused by argparse, naming the flag, before any checkpoint is read
    (the folders here do not exist)."""
    base = ["generate", "--target", str(tmp_path / "none"), "--draft", str(tmp_path / "none"), "--prompt", "x"]
    for flag, value, says in (
        ("--top-k", "0", "must be in [1, 2147483647]"),
        ("--temperature", "nan", "must be in [0, 3.4028234663852886e+38]"),
        ("--temperature", "-0.5", "must be in [0, 3.4028234663852886e+38]"),
        ("--top-p", "0", "must be in (0, 1]"),
        ("--top-p", "1.5", "must be in (0, 1]"),
        ("--max-new-tokens", "0", "must be in [1, 2147483647]"),
        ("--top-k", "2.5", "is not an integer"),
        # the round reads top_k and max_new_tokens as int32 and temperatures as float32
        ("--top-k", "2147483648", "must be in [1, 2147483647]"),
        ("--max-new-tokens", "2147483648", "must be in [1, 2147483647]"),
        ("--temperature", "1e39", "must be in [0, 3.4028234663852886e+38]"),
    ):
        try:
            main([*base, flag, value])
        except SystemExit as exit_:
            assert exit_.code == 2
        else:
            raise AssertionError(f"{flag} {value} was accepted")
        err = capsys.readouterr().err
        assert f"argument {flag}: '{value}' " in err and says in err, err


def test_checkpoint_flags_are_refused_by_name_before_loading(tmp_path, capsys):
    """``--target /nonexistent`` was reported by the tokenizer loader (``tokenizer path ...
    does not exist``); each path flag is now checked, naming the flag, before anything loads."""
    (tmp_path / "config.json").write_text("{}")
    none = str(tmp_path / "none")
    for argv, says in (
        (
            ["--target", none, "--draft", none],
            f"--target {none!r} does not exist: expected a checkpoint folder with config.json and tokenizer.json",
        ),
        (
            ["--target", str(tmp_path), "--draft", none],
            f"--target {str(tmp_path)!r} has no tokenizer.json: "
            "expected a checkpoint folder with config.json and tokenizer.json",
        ),
        (
            ["--target", str(tmp_path), "--draft", none, "--tokenizer", none],
            f"--draft {none!r} does not exist: expected a checkpoint folder with config.json",
        ),
        (
            ["--target", str(tmp_path), "--draft", str(tmp_path), "--tokenizer", none],
            f"--tokenizer {none!r}: tokenizer path {none!r} does not exist: expected a tokenizer.json or its folder",
        ),
    ):
        assert main(["generate", *argv, "--prompt", "x"]) == 2
        assert capsys.readouterr().err == f"dspark-jax generate: error: {says}\n"


def test_a_tokenizer_with_ids_past_the_target_vocabulary_is_named(tmp_path, capsys):
    argv = _save_pair(tmp_path)
    big = train_bpe(["zebra quokka axolotl narwhal " * 4] * 3, vocab_size=400)
    big.save(tmp_path / "big")
    assert big.vocab_size > 270
    text = "zebra quokka"
    ids = big.encode(text)
    assert max(ids) >= 270  # a merge the target's vocabulary does not hold
    for prompt in (text, "the cat"):  # ids past the vocabulary or not: the tokenizer itself is wrong
        code = main([*argv, "--tokenizer", str(tmp_path / "big"), "--prompt", prompt, "--max-new-tokens", "2"])
        assert code == 2
        err = capsys.readouterr().err
        want = f"the tokenizer of --tokenizer {str(tmp_path / 'big')!r} has {big.vocab_size} ids, more than the "
        assert want + "--target's vocabulary of 270" in err, err
    assert main([*argv, "--tokenizer", "", "--prompt", text]) == 2
    assert "--tokenizer '' is invalid: give a tokenizer.json or its folder" in capsys.readouterr().err


def test_generate_compares_every_new_token_per_second_and_measures_at_the_longest_prompt(tmp_path, capsys, monkeypatch):
    """With stand-in generations: ``--compare``'s tok/s are all new tokens over the run's seconds
    (the second, compiled, runs), the speed-up speculative / plain; the verify schedule is
    measured at the longest prompt's length; verified per request-round is verified tokens over
    request-rounds; ``--no-stop`` passes no stop token, its absence the tokenizer's end of text."""
    import types

    from dspark_jax import generate_cli
    from dspark_jax.tokenizer import load_tokenizer

    argv = _save_pair(tmp_path, enable_confidence_head=True)

    def result(tokens, seconds):
        return types.SimpleNamespace(
            tokens=tokens,
            seconds=seconds,
            tau=[2.0, 1.0],
            tau_overall=1.5,
            acceptance_by_position=[0.5, 0.25, 0.0],
            rounds=4,
            verify_length_counts=[1, 2, 0, 3],
            verified_tokens=15,
        )

    specs = iter([result([[1, 2, 3], [4, 5]], 9.0), result([[1, 2, 3], [4, 5]], 0.5)])
    plains = iter([result([[1, 2, 3], [4, 5, 6, 7]], 9.0), result([[1, 2, 3], [4, 5, 6, 7]], 2.0)])
    stops = []

    def speculative(*args, **kwargs):
        stops.append(kwargs["stop_tokens"])
        return next(specs)

    monkeypatch.setattr(generate_cli, "speculative_generate", speculative)
    monkeypatch.setattr(generate_cli, "generate", lambda *args, **kwargs: next(plains))
    asked = {}

    def measured(target, draft, batch, **kwargs):
        asked.update(kwargs, batch=batch)
        return {"stand-in": True}

    monkeypatch.setattr(generate_cli, "measure_verify_schedule", measured)
    prompts = ["the cat", "the cat sat on the mat. the cat ate"]
    flags = ["--max-new-tokens", "4", "--no-stop", "--verify-schedule", "uniform", "--compare"]
    assert main([*argv, "--prompt", prompts[0], "--prompt", prompts[1], *flags]) == 0
    out = capsys.readouterr().out
    tokenizer = load_tokenizer(str(tmp_path / "target"))
    assert asked["batch"] == 2 and asked["prompt_len"] == max(len(tokenizer.encode(p)) for p in prompts)
    assert f"verified per request-round: {15 / 6:.2f} (request-rounds verifying 1 … 4 tokens: 1 2 0 3)" in out
    speed_spec, speed_plain = 5 / 0.5, 7 / 2.0
    assert (
        f"tokens/s (compiled): speculative {speed_spec:.1f}, plain {speed_plain:.1f}, "
        f"speed-up {speed_spec / speed_plain:.2f}x"
    ) in out
    assert "greedy outputs identical to plain decoding: False" in out
    tokenizer_eos = tokenizer.eos_id
    specs = iter([result([[1, 2, 3], [4, 5]], 1.0)])
    assert main([*argv, "--prompt", prompts[0], "--prompt", prompts[1], "--max-new-tokens", "4"]) == 0
    assert stops == [None, None, [tokenizer_eos]]  # --no-stop: no stop token; else the tokenizer's end of text


def test_checkpoint_stop_ids_read_eos_token_id_where_transformers_does(tmp_path):
    """``generation_config.json``'s ``eos_token_id`` (an id or a list, as Qwen3 chat models list
    ``<|im_end|>`` and ``<|endoftext|>``), else ``config.json``'s, else none; anything but ids
    below the vocabulary is refused naming the file and the field."""
    import json

    from dspark_jax.generate_cli import checkpoint_stop_ids

    def write(name, data):
        with open(tmp_path / name, "w") as f:
            json.dump(data, f)

    assert checkpoint_stop_ids(str(tmp_path), 100) == []
    write("config.json", {"hidden_size": 8})
    assert checkpoint_stop_ids(str(tmp_path), 100) == []
    write("config.json", {"eos_token_id": 7})
    assert checkpoint_stop_ids(str(tmp_path), 100) == [7]
    write("generation_config.json", {"eos_token_id": [99, 3]})  # the generation config wins
    assert checkpoint_stop_ids(str(tmp_path), 100) == [99, 3]
    write("generation_config.json", {"do_sample": True})  # names none: config.json's
    assert checkpoint_stop_ids(str(tmp_path), 100) == [7]
    for bad in (100, -1, [3, 100], [], True, "7", [2.0]):
        write("generation_config.json", {"eos_token_id": bad})
        want = (
            f"generation_config.json': eos_token_id={bad!r} is invalid: must be a token id or a list of ids in [0, 100)"
        )
        with pytest.raises(ValueError, match=re.escape(want)):
            checkpoint_stop_ids(str(tmp_path), 100)


def test_generate_stops_at_the_targets_eos_ids_and_the_tokenizers_end_of_text(tmp_path, monkeypatch):
    """Without ``--no-stop`` the command stops at the union of the ``--target`` folder's
    ``eos_token_id`` and the tokenizer's end of text (sorted, each once); a bad id is refused
    before generating, naming the file (exit 2)."""
    import json
    import types

    from dspark_jax import generate_cli
    from dspark_jax.tokenizer import load_tokenizer

    argv = _save_pair(tmp_path)
    eos = load_tokenizer(str(tmp_path / "target")).eos_id
    stops = []

    def speculative(*args, **kwargs):
        stops.append(kwargs["stop_tokens"])
        return types.SimpleNamespace(
            tokens=[[1]], seconds=1.0, tau=[1.0], tau_overall=1.0, acceptance_by_position=[0.0, 0.0],
            rounds=1, verify_length_counts=[1, 0, 0], verified_tokens=1,
        )  # fmt: skip

    monkeypatch.setattr(generate_cli, "speculative_generate", speculative)
    with open(tmp_path / "target" / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": [12, eos, 5]}, f)
    assert main([*argv, "--prompt", "the cat", "--max-new-tokens", "2"]) == 0
    assert stops == [sorted({12, eos, 5})]
    with open(tmp_path / "target" / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": 100_000}, f)
    assert main([*argv, "--prompt", "the cat", "--max-new-tokens", "2"]) == 2
    assert len(stops) == 1
