"""Accepted length τ on held-out text, and the DSpark vs DFlash-style ablation (``dspark-jax eval``).

Prompts are windows of the held-out split of the standard-library corpus (files never
used in training, :mod:`dspark_jax.corpus`), tokenized with the target's
``tokenizer.json``. Each draft generates continuations with speculative decoding
(:func:`~dspark_jax.generation.speculative_generate`) greedily and at temperature 1 (no
top-k / top-p), and τ is the mean number of tokens committed per round (accepted drafts
plus the target's bonus token).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from dspark_jax.bundled import DRAFT_DIRS, TARGET_DIR
from dspark_jax.cli import SEED_MAX, check_checkpoint, check_output_file, loading, number_flag
from dspark_jax.config import check_seed, positive_int
from dspark_jax.decode_requests import MAX_NEW_TOKENS, MAX_TEMPERATURE

if TYPE_CHECKING:
    from dspark_jax.draft import DSparkDraft
    from dspark_jax.target import Target
    from dspark_jax.tokenizer import Tokenizer


def heldout_prompts(tokenizer: Tokenizer, *, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of ``length`` tokens from the held-out corpus, each starting at a line start.

    Args:
      tokenizer: the target's tokenizer.
      count: number of prompts.
      length: tokens per prompt.
      seed: which windows.

    Returns:
      Token id lists.
    """
    from dspark_jax.corpus import encode_documents, load_corpus

    positive_int("count", count), positive_int("length", length)
    stream = encode_documents(tokenizer, load_corpus().texts("heldout"))
    if stream.size < length + 1:
        raise ValueError(f"the held-out corpus has {stream.size} tokens, fewer than length={length}")
    # Start right after a token that ends with a newline, so prompts open on a fresh line.
    newline = np.array(["\n" in tokenizer.decode([i]) for i in range(tokenizer.vocab_size)])
    starts = np.flatnonzero(newline[stream[:-length]]) + 1
    if starts.size == 0:
        starts = np.arange(stream.size - length)
    rng = np.random.default_rng(seed)
    chosen = np.sort(rng.choice(starts, size=count, replace=starts.size < count))
    return [stream[s : s + length].tolist() for s in chosen]


def measure_tau(
    target: Target,
    draft: DSparkDraft,
    prompts: Sequence[Sequence[int]],
    *,
    temperature: float,
    max_new_tokens: int,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
) -> dict[str, Any]:
    """τ and acceptance by position of one draft at one temperature.

    Returns:
      ``tau`` (overall), ``acceptance_by_position [γ]``, ``confidence_by_position [γ]``
      (the draft's own prediction of it; empty without a confidence head), ``rounds``,
      ``tokens`` (generated count) and ``seconds`` (compilation included).
    """
    from dspark_jax.generation import speculative_generate

    check_seed("seed", seed)
    result = speculative_generate(
        target,
        draft,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        stop_tokens=stop_tokens,
        key=jax.random.key(seed),
    )
    return {
        "tau": result.tau_overall,
        "acceptance_by_position": result.acceptance_by_position,
        "confidence_by_position": result.confidence_by_position,
        "rounds": result.rounds,
        "tokens": sum(len(t) for t in result.tokens),
        "seconds": result.seconds,
    }


def compare_drafts(
    target: Target,
    drafts: dict[str, Any],
    prompts: Sequence[Sequence[int]],
    *,
    temperatures: Sequence[float] = (0.0, 1.0),
    max_new_tokens: int = 128,
    seed: int = 0,
    stop_tokens: Sequence[int] | None = None,
) -> dict[str, dict[float, dict[str, Any]]]:
    """:func:`measure_tau` for every draft and temperature: ``results[name][temperature]``.

    Raises:
      TypeError: ``drafts`` is not a dict of names to drafts, or ``temperatures`` not a
        sequence of numbers.
      ValueError: no draft, no temperature, or a temperature given twice (its results
        would be merged); and as :func:`measure_tau`.
    """
    if not isinstance(drafts, dict):
        raise TypeError(f"drafts must be a dict of names to drafts, got {type(drafts).__name__}")
    if not drafts:
        raise ValueError("drafts={} is invalid: give at least one draft to measure")
    if isinstance(temperatures, (str, bytes)) or not isinstance(temperatures, Sequence):
        raise TypeError(f"temperatures={temperatures!r} is invalid: expected a sequence of numbers, e.g. (0.0, 1.0)")
    if not temperatures:
        raise ValueError("temperatures=() is invalid: give at least one temperature")
    repeated = sorted({t for t in temperatures if list(temperatures).count(t) > 1})
    if repeated:
        raise ValueError(f"temperatures={tuple(temperatures)!r} is invalid: {repeated} given more than once")
    return {
        name: {
            t: measure_tau(
                target,
                draft,
                prompts,
                temperature=t,
                max_new_tokens=max_new_tokens,
                seed=seed,
                stop_tokens=stop_tokens,
            )
            for t in temperatures
        }
        for name, draft in drafts.items()
    }


def format_tables(results: dict[str, dict[float, dict[str, Any]]]) -> str:
    """Markdown tables: τ per draft and temperature (with the ratio to the last draft), then
    acceptance by position, each draft with a confidence head followed by its prediction."""
    names = list(results)
    temps = list(next(iter(results.values())))
    label = {t: "greedy" if t == 0 else f"T = {t:g}" for t in temps}
    lines = ["| draft | " + " | ".join(f"τ {label[t]}" for t in temps) + " |", "|---" * (len(temps) + 1) + "|"]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{results[name][t]['tau']:.3f}" for t in temps) + " |")
    if len(names) > 1:
        base = names[-1]
        for name in names[:-1]:
            ratios = " | ".join(f"{results[name][t]['tau'] / results[base][t]['tau']:.3f}×" for t in temps)
            lines.append(f"| {name} / {base} | {ratios} |")
    for t in temps:
        gamma = len(results[names[0]][t]["acceptance_by_position"])
        lines += ["", f"Acceptance by draft position, {label[t]}:", ""]
        lines.append("| draft | " + " | ".join(str(k) for k in range(1, gamma + 1)) + " |")
        lines.append("|---" * (gamma + 1) + "|")
        for name in names:
            acc = results[name][t]["acceptance_by_position"]
            lines.append(f"| {name} | " + " | ".join(f"{a:.2f}" for a in acc) + " |")
            predicted = results[name][t].get("confidence_by_position")
            if predicted:
                lines.append(f"| {name}, predicted | " + " | ".join(f"{a:.2f}" for a in predicted) + " |")
    return "\n".join(lines)


def draft_labels(markov_ranks: Sequence[int]) -> list[str]:
    """Names for the drafts of ``--draft`` then ``--baseline-draft``, from their configs: DSpark
    with a Markov head (``markov_rank > 0``), DFlash-style without; when two are the same kind,
    each also names its flag.

    Args:
      markov_ranks: each draft's ``markov_rank``, in flag order.
    """
    kinds = ["DSpark" if rank > 0 else "DFlash-style" for rank in markov_ranks]
    if len(set(kinds)) == len(kinds):
        return kinds
    return [f"{kind} ({flag})" for kind, flag in zip(kinds, ("--draft", "--baseline-draft"), strict=False)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax eval`` flags."""
    parser.add_argument("--target", default=TARGET_DIR, help="target folder with tokenizer.json (default: bundled)")
    parser.add_argument(
        "--draft", default=DRAFT_DIRS["dspark"], help="draft checkpoint (default: bundled DSpark draft)"
    )
    parser.add_argument(
        "--baseline-draft",
        default=DRAFT_DIRS["dflash"],
        help="second draft for the ablation (default: bundled DFlash-style draft); 'none' to skip",
    )
    parser.add_argument("--prompts", type=number_flag(int, 1), default=32, help="held-out prompts")
    parser.add_argument("--prompt-len", type=number_flag(int, 1), default=64, help="tokens per prompt")
    parser.add_argument(
        "--max-new", type=number_flag(int, 1, MAX_NEW_TOKENS), default=128, help="new tokens per prompt"
    )
    parser.add_argument(
        "--temperatures",
        type=number_flag(float, 0, MAX_TEMPERATURE),
        nargs="+",
        default=[0.0, 1.0],
        help="temperatures to evaluate at, 0 = greedy (default 0 1)",
    )
    parser.add_argument(
        "--seed", type=number_flag(int, 0, SEED_MAX), default=0, help="prompt and PRNG seed (default 0)"
    )
    parser.add_argument("--json", help="also write the results to this file (its folder must exist)")


def run(args: argparse.Namespace) -> int:
    """``dspark-jax eval``: τ of the draft (and the baseline draft) on held-out prompts at each
    temperature, printed as tables and optionally written to ``--json``; returns 0.

    Raises:
      ValueError: a temperature given twice, a bad ``--json``, ``--target`` or draft folder, or
        prompts and new tokens past the models' positions (checked before the corpus is read).
    """
    from dspark_jax.checkpoint import load_draft
    from dspark_jax.target import load_target
    from dspark_jax.tokenizer import load_tokenizer

    if len(set(args.temperatures)) != len(args.temperatures):
        raise ValueError(f"--temperatures {args.temperatures} is invalid: each temperature once")
    check_output_file("--json", args.json)
    if not args.baseline_draft:
        raise ValueError("--baseline-draft '' is invalid: give a draft checkpoint folder, or 'none' to skip it")
    baseline = args.baseline_draft if args.baseline_draft.lower() != "none" else None
    check_checkpoint("--target", args.target, tokenizer=True)
    for flag, path in (("--draft", args.draft), ("--baseline-draft", baseline)):
        if path is not None:
            check_checkpoint(flag, path)
    t0 = time.perf_counter()
    with loading("--target", args.target):
        target = load_target(args.target, dtype="float32")
        tokenizer = load_tokenizer(args.target)
    with loading("--draft", args.draft):
        loaded = [load_draft(args.draft, target=target)]
    if baseline is not None:
        with loading("--baseline-draft", baseline):
            loaded.append(load_draft(baseline, target=target))
    drafts = dict(zip(draft_labels([d.cfg.markov_rank for d in loaded]), loaded, strict=True))
    limit = min(target.config.max_position_embeddings, *(d.cfg.max_position_embeddings for d in drafts.values()))
    need = args.prompt_len + args.max_new + max(d.cfg.gamma for d in drafts.values()) - 1
    if need > limit:  # before the held-out text is read and encoded
        raise ValueError(
            f"--prompt-len {args.prompt_len} + --max-new {args.max_new} (+ gamma - 1 that the last round verifies) "
            f"= {need} positions exceed the models' max_position_embeddings={limit}"
        )
    prompts = heldout_prompts(tokenizer, count=args.prompts, length=args.prompt_len, seed=args.seed)
    results = compare_drafts(
        target,
        drafts,
        prompts,
        temperatures=tuple(args.temperatures),
        max_new_tokens=args.max_new,
        seed=args.seed,
        stop_tokens=[tokenizer.eos_id],
    )
    gammas = {name: d.cfg.gamma for name, d in drafts.items()}
    print(
        f"held-out prompts: {args.prompts} × {args.prompt_len} tokens, {args.max_new} new tokens each; "
        f"γ = {gammas}; device {jax.devices()[0].platform}"
    )
    print(format_tables(results))
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.json:
        payload = {
            "settings": {k: v for k, v in vars(args).items() if k != "json"},
            "gamma": gammas,
            "device": str(jax.devices()[0]),
            "results": {n: {str(t): r for t, r in per.items()} for n, per in results.items()},
        }
        with open(args.json, "w") as f:
            json.dump(payload, f, indent=2)
    return 0
