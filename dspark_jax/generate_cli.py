"""``dspark-jax generate``: speculative generation from a target and a draft checkpoint.

The target folder is a Hugging Face Qwen3 checkpoint with a ``tokenizer.json``; the
draft folder is a DSpark checkpoint (γ is the draft's ``block_size``). Prints each
completion, then τ, acceptance by draft position and rounds; ``--compare`` also times
plain decoding with the target alone (both compiled first, then timed).
``--verify-schedule RULE`` first measures a steps-per-second table for this batch on this
device (:func:`~dspark_jax.generation.measure_verify_schedule`) and verifies by it
(``DSPARK_SPEC.md`` §5; the draft needs a confidence head).
"""

from __future__ import annotations

import argparse
import os

import jax

from dspark_jax.checkpoint import load_draft
from dspark_jax.cli import SEED_MAX, check_checkpoint, check_prompts, loading, number_flag
from dspark_jax.config import is_integer, read_json_file
from dspark_jax.decode_requests import MAX_NEW_TOKENS, MAX_TEMPERATURE, VERIFY_RULES
from dspark_jax.generation import (
    GenerationResult,
    generate,
    measure_verify_schedule,
    speculative_generate,
)
from dspark_jax.sampling import TOP_K_MAX
from dspark_jax.target import check_pair, load_target
from dspark_jax.tokenizer import load_tokenizer

MEASURED_ROUNDS = 10  # timed rounds per verify width behind --verify-schedule


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax generate`` flags."""
    parser.add_argument("--target", required=True, help="Hugging Face Qwen3 checkpoint folder with tokenizer.json")
    parser.add_argument("--draft", required=True, help="DSpark draft checkpoint folder")
    parser.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    parser.add_argument("--tokenizer", help="tokenizer.json or its folder (default: the target folder)")
    parser.add_argument(
        "--max-new-tokens",
        type=number_flag(int, 1, MAX_NEW_TOKENS),
        default=64,
        help="new tokens per prompt (default 64)",
    )
    parser.add_argument("--temperature", type=number_flag(float, 0, MAX_TEMPERATURE), default=0.0, help="0 = greedy")
    parser.add_argument(
        "--top-k", type=number_flag(int, 1, TOP_K_MAX), default=None, help="default: no top-k; 1 = greedy"
    )
    parser.add_argument(
        "--top-p",
        type=number_flag(float, 0, 1, open_low=True),
        default=1.0,
        help="the target's nucleus, in (0, 1] (default 1: no top-p)",
    )
    parser.add_argument("--seed", type=number_flag(int, 0, SEED_MAX), default=0, help="PRNG seed (default 0)")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="run both models in this dtype (default: the target in its config's dtype, the draft in float32)",
    )
    parser.add_argument(
        "--no-stop",
        action="store_true",
        help="do not stop at the end-of-sequence tokens (the --target's eos_token_id and the tokenizer's end of text)",
    )
    parser.add_argument("--compare", action="store_true", help="also time plain decoding with the target alone")
    parser.add_argument(
        "--device-loop", action="store_true", help="run all rounds in one compiled while_loop (no host sync per round)"
    )
    parser.add_argument(
        "--verify-schedule",
        choices=VERIFY_RULES,
        default=None,
        help="verify by confidence with this rule, from a table measured first (the draft needs a confidence head)",
    )


def checkpoint_stop_ids(folder: str, vocab_size: int) -> list[int]:
    """The end-of-sequence ids a Hugging Face checkpoint folder names, where transformers'
    ``generate`` reads them: ``eos_token_id`` (an id or a list) of ``generation_config.json``,
    else of ``config.json`` (Qwen3 chat models end a turn with ``<|im_end|>``, listed there
    beside ``<|endoftext|>``); ``[]`` where neither file names one.

    Raises:
      ValueError: the field holds anything but ids in ``[0, vocab_size)``, naming the file.
    """
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(folder, name)
        data = read_json_file(path) if os.path.isfile(path) else None
        value = data.get("eos_token_id") if isinstance(data, dict) else None
        if value is None:
            continue
        ids = value if isinstance(value, list) else [value]
        if not ids or not all(is_integer(i) and 0 <= i < vocab_size for i in ids):
            raise ValueError(
                f"{path!r}: eos_token_id={value!r} is invalid: must be a token id or a list of ids in "
                f"[0, {vocab_size}) (the target's vocabulary)"
            )
        return [int(i) for i in ids]
    return []


def _eos_id(tokenizer) -> int | None:
    """The tokenizer's end-of-text id, if it has one."""
    try:
        return tokenizer.eos_id
    except (AttributeError, ValueError):
        return None


def _tokens_per_second(result: GenerationResult) -> float:
    return sum(len(t) for t in result.tokens) / result.seconds


def check_tokenizer_size(args: argparse.Namespace, vocab_size: int, tokenizer_size: int) -> None:
    """Refuses a tokenizer with more ids than the target's vocabulary: the target would emit
    ids it decodes as other text, or a stop id it never emits, and prompts could encode past
    it (a tokenizer no larger encodes only ids below it).

    Raises:
      ValueError: naming the tokenizer's flag and path and both sizes.
    """
    flag, path = ("--tokenizer", args.tokenizer) if args.tokenizer else ("--target", args.target)
    if tokenizer_size > vocab_size:
        raise ValueError(
            f"the tokenizer of {flag} {path!r} has {tokenizer_size} ids, more than the --target's vocabulary of "
            f"{vocab_size}: give the tokenizer the target was trained with"
        )


def run(args: argparse.Namespace) -> int:
    """``dspark-jax generate``: prints each completion, τ, acceptance by position and rounds
    (and, with ``--compare``, the speed against plain decoding); returns 0.

    Raises:
      ValueError: a bad ``--target``, ``--draft`` or ``--tokenizer``, a draft that does not fit
        the target, a prompt too long for the models, or ``--verify-schedule`` with a draft
        without a confidence head or too few positions to measure.
    """
    if args.tokenizer == "":
        raise ValueError("--tokenizer '' is invalid: give a tokenizer.json or its folder, or leave the flag out")
    check_checkpoint("--target", args.target, tokenizer=args.tokenizer is None)
    check_checkpoint("--draft", args.draft)
    with loading("--tokenizer" if args.tokenizer else "--target", args.tokenizer or args.target):
        tokenizer = load_tokenizer(args.tokenizer or args.target)
    with loading("--target", args.target):
        target = load_target(args.target, dtype=args.dtype)
    with loading("--draft", args.draft):
        draft = load_draft(args.draft, target=target, dtype=args.dtype)
    check_pair(draft.cfg, target.config)
    check_tokenizer_size(args, target.config.vocab_size, tokenizer.vocab_size)
    prompts = [tokenizer.encode(text) for text in args.prompt]
    limits = {"target": target.config.max_position_embeddings, "draft": draft.cfg.max_position_embeddings}
    check_prompts(
        prompts,
        [f"--prompt {text!r}" for text in args.prompt],
        max_new=("--max-new-tokens", args.max_new_tokens),
        gamma=draft.cfg.gamma,
        limits=limits,
    )
    stops = None
    if not args.no_stop:  # the target's end-of-sequence ids and the tokenizer's end of text
        eos = _eos_id(tokenizer)
        found = checkpoint_stop_ids(args.target, target.config.vocab_size)
        stops = sorted({*found, *([] if eos is None else [eos])}) or None
    options = dict(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        stop_tokens=stops,
        key=jax.random.key(args.seed),
    )
    options["device_loop"] = args.device_loop
    schedule = {}  # speculative decoding's alone
    if args.verify_schedule:
        flag = f"--verify-schedule {args.verify_schedule}"
        if not draft.cfg.enable_confidence_head:
            raise ValueError(
                f"{flag} needs a --draft with a confidence head (enable_confidence_head=True): the schedule ranks "
                "drafts by their confidence; drop --verify-schedule, or give such a --draft"
            )
        # Measured at the longest prompt's context, shortened to leave the timed rounds room.
        gamma = draft.cfg.gamma
        limit = min(n for n in limits.values() if n)
        room = limit - (MEASURED_ROUNDS + 1) * (gamma + 1) - gamma
        if room < 1:
            raise ValueError(
                f"{flag} measures {MEASURED_ROUNDS} timed rounds, which need {limit - room + 1} positions "
                f"((rounds + 1)·(γ + 1) + γ + 1, γ = {gamma}), past the models' max_position_embeddings={limit}: "
                "drop --verify-schedule, or give a --target and --draft with more positions"
            )
        table = measure_verify_schedule(
            target,
            draft,
            len(prompts),
            prompt_len=max(1, min(max(map(len, prompts)), room)),
            rounds=MEASURED_ROUNDS,
            temperature=args.temperature,
            seed=args.seed,
        )
        schedule = dict(verify_schedule=table, verify_rule=args.verify_schedule)
    spec = speculative_generate(target, draft, prompts, **options, **schedule)
    for text, tokens in zip(args.prompt, spec.tokens, strict=True):
        print(f"--- {text!r}")
        print(text + tokenizer.decode(tokens))
    gamma = draft.cfg.gamma
    print(f"\ndraft: {os.path.basename(os.path.normpath(args.draft))}, gamma={gamma}, batch={len(prompts)}")
    print(f"tau (committed tokens per round): {spec.tau_overall:.3f}")
    if len(prompts) > 1:
        print("tau per request: " + ", ".join(f"{t:.2f}" for t in spec.tau))
    print("acceptance by draft position: " + " ".join(f"{a:.2f}" for a in spec.acceptance_by_position))
    print(f"rounds: {spec.rounds}, new tokens: {sum(len(t) for t in spec.tokens)}")
    if args.verify_schedule:
        request_rounds = sum(spec.verify_length_counts)
        counts = " ".join(map(str, spec.verify_length_counts))
        print(
            f"verified per request-round: {spec.verified_tokens / request_rounds:.2f} "
            f"(request-rounds verifying 1 … {gamma + 1} tokens: {counts})"
        )
    if args.compare:
        spec = speculative_generate(target, draft, prompts, **options, **schedule)  # the first call compiled it
        generate(target, prompts, **options)
        plain = generate(target, prompts, **options)
        speed_spec, speed_plain = _tokens_per_second(spec), _tokens_per_second(plain)
        print(
            f"tokens/s (compiled): speculative {speed_spec:.1f}, plain {speed_plain:.1f}, "
            f"speed-up {speed_spec / speed_plain:.2f}x"
        )
        if args.temperature == 0 or args.top_k == 1:
            same = spec.tokens == plain.tokens
            print(f"greedy outputs identical to plain decoding: {same}")
    return 0
