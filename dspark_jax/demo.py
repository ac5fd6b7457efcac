"""``dspark-jax demo``: speculative decoding with the bundled trained pair, on CPU or GPU.

Generates from a few Python prompts greedily and at temperature 1 with the bundled
target (a small Qwen3 trained on the Python standard library) and its DSpark draft,
then prints the text, τ (tokens committed per round), acceptance by draft position and
the speed against plain decoding with the target alone. Each generation runs twice:
the first call compiles, the second is timed.
"""

from __future__ import annotations

import argparse
import time

import jax

from dspark_jax.bundled import DRAFT_DIRS, TARGET_DIR
from dspark_jax.cli import SEED_MAX, check_checkpoint, check_prompts, loading, number_flag
from dspark_jax.decode_requests import MAX_NEW_TOKENS

PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "import os\nimport sys\n\n\ndef main(argv):\n",
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n',
)


def _timed(fn):
    fn()  # compile
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax demo`` flags."""
    parser.add_argument("--target", default=TARGET_DIR, help="target folder with tokenizer.json (default: bundled)")
    parser.add_argument(
        "--draft", default=DRAFT_DIRS["dspark"], help="draft checkpoint (default: bundled DSpark draft)"
    )
    parser.add_argument("--prompt", action="append", help="a prompt (repeat for several; default: three built-in)")
    parser.add_argument("--max-new", type=number_flag(int, 1, MAX_NEW_TOKENS), default=96, help="new tokens per prompt")
    parser.add_argument(
        "--seed", type=number_flag(int, 0, SEED_MAX), default=0, help="PRNG seed of the sampled runs (default 0)"
    )


def run(args: argparse.Namespace) -> int:
    """``dspark-jax demo``: loads the pair, generates greedily and at temperature 1, prints
    the texts, τ, acceptance by position and the speed against plain decoding; returns 0.

    Raises:
      ValueError: a bad ``--target`` or ``--draft`` folder, or a prompt too long for the models.
    """
    from dspark_jax.checkpoint import load_draft
    from dspark_jax.generation import generate, speculative_generate
    from dspark_jax.target import load_target
    from dspark_jax.tokenizer import load_tokenizer

    check_checkpoint("--target", args.target, tokenizer=True)
    check_checkpoint("--draft", args.draft)
    started = time.perf_counter()
    with loading("--target", args.target):
        target = load_target(args.target, dtype="float32")
        tokenizer = load_tokenizer(args.target)
    with loading("--draft", args.draft):
        draft = load_draft(args.draft, target=target)
    texts = args.prompt or list(PROMPTS)
    prompts = [tokenizer.encode(t) for t in texts]
    check_prompts(
        prompts,
        [f"--prompt {t!r}" if args.prompt else f"built-in prompt {i + 1}" for i, t in enumerate(texts)],
        max_new=("--max-new", args.max_new),
        gamma=draft.cfg.gamma,
        limits={"target": target.config.max_position_embeddings, "draft": draft.cfg.max_position_embeddings},
    )
    key = jax.random.key(args.seed)
    print(
        f"dspark-jax demo on {jax.devices()[0].platform}: target {target.config.num_hidden_layers} layers × "
        f"{target.config.hidden_size}, draft {draft.cfg.num_hidden_layers} layers, γ = {draft.cfg.gamma}, "
        f"Markov rank {draft.cfg.markov_rank}, {len(prompts)} prompts × {args.max_new} new tokens"
    )
    for temperature in (0.0, 1.0):
        common = dict(max_new_tokens=args.max_new, temperature=temperature, key=key)
        spec, spec_s = _timed(lambda common=common: speculative_generate(target, draft, prompts, **common))
        plain, plain_s = _timed(lambda common=common: generate(target, prompts, **common))
        label = "greedy" if temperature == 0 else f"temperature {temperature:g}"
        print(f"\n=== {label} ===")
        for text, tokens, tau in zip(texts, spec.tokens, spec.tau, strict=True):
            print(f"--- prompt (τ = {tau:.2f}) ---")
            print(text + "▶" + tokenizer.decode(tokens))
        acc = " ".join(f"{a:.2f}" for a in spec.acceptance_by_position)
        n_spec = sum(len(t) for t in spec.tokens)
        n_plain = sum(len(t) for t in plain.tokens)
        print(f"τ ({label}) = {spec.tau_overall:.3f} tokens per round over {spec.rounds} rounds")
        print(f"acceptance by position 1..{draft.cfg.gamma}: {acc}")
        if spec.confidence_by_position:  # the draft's own prediction of the line above
            predicted = " ".join(f"{a:.2f}" for a in spec.confidence_by_position)
            print(f"predicted by its confidence head:  {predicted}")
        print(
            f"speed: speculative {n_spec / spec_s:.1f} tok/s, plain {n_plain / plain_s:.1f} tok/s, "
            f"ratio {(n_spec / spec_s) / (n_plain / plain_s):.2f}× (compiled; second call timed)"
        )
        if temperature == 0:
            same = spec.tokens == plain.tokens
            print(f"greedy output identical to plain decoding: {'yes' if same else 'NO'}")
    print(f"\n({time.perf_counter() - started:.1f} s in all, compilation included)")
    return 0
