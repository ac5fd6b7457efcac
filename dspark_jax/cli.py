"""The ``dspark-jax`` command line: one subcommand per job, each defined in its module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is
imported only when chosen, so ``dspark-jax demo`` never pays for the benchmark's imports.
"""

from __future__ import annotations

import argparse
import importlib
import math
import sys
from collections.abc import Callable

SEED_MAX = 2**32 - 1
"""The largest ``--seed`` (NumPy's generators and ``jax.random.key`` take it)."""


def number_flag(kind: type, low: float, high: float = math.inf, *, open_low: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` number in ``[low, high]`` (``(low, high]`` with
    ``open_low``), so that a bad flag is refused by name before any checkpoint loads."""
    bounds = f"{'(' if open_low else '['}{low}, {high}]" if high < math.inf else f"{'>' if open_low else '>='} {low}"

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a{'n integer' if kind is int else ' number'}") from None
        inside = (value > low if open_low else value >= low) and value <= high
        if not (math.isfinite(value) and inside):
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {'in ' if high < math.inf else ''}{bounds}")
        return value

    return parse


# name -> (module, one-line help)
COMMANDS = {
    "demo": ("dspark_jax.demo", "generate with the bundled trained pair and report τ and speed"),
    "generate": ("dspark_jax.generate_cli", "speculative generation from a target and a draft checkpoint"),
    "train-target": ("dspark_jax.target_training", "train the small Qwen3-style target on the bundled corpus"),
    "train-draft": ("dspark_jax.train", "train a DSpark draft against a frozen target"),
    "eval": ("dspark_jax.evaluate", "measure τ on held-out text; DSpark vs DFlash-style ablation"),
    "bench": ("dspark_jax.bench", "benchmark the folded proposal (and the PyTorch baseline)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="dspark-jax", description="DSpark speculative decoding in JAX")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        parser.print_help()
        if argv and argv[0] not in ("-h", "--help"):
            print(f"dspark-jax: unknown command {argv[0]!r}: choose one of {', '.join(COMMANDS)}", file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    cmd_parser = argparse.ArgumentParser(prog=f"dspark-jax {argv[0]}", description=COMMANDS[argv[0]][1])
    module.add_arguments(cmd_parser)
    return int(module.run(cmd_parser.parse_args(argv[1:])) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
