"""The ``dspark-jax`` command line: one subcommand per job, each defined in its module.

A subcommand module exposes ``add_arguments(parser)`` and ``run(args) -> int``; it is
imported only when chosen, so ``dspark-jax demo`` never pays for the benchmark's imports.
Before a command runs, :func:`check_environment` refuses a bad ``DSPARK_JAX_*`` variable. A
``ValueError`` or ``TypeError`` from its ``run`` (a bad flag or input, named by the message)
is printed as one line, ``dspark-jax COMMAND: error: MESSAGE``, with exit status 2, as
argparse reports a bad flag; any other exception is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import math
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator

SEED_MAX = 2**32 - 1
"""The largest ``--seed`` (NumPy's generators and ``jax.random.key`` take it)."""


def add_save_dtype(parser: argparse.ArgumentParser, what: str) -> None:
    """``--save-dtype {float32,bfloat16,float16}`` (default float16): the dtype ``what`` is saved in."""
    parser.add_argument(
        "--save-dtype",
        default="float16",
        choices=["float32", "bfloat16", "float16"],
        help=f"dtype of the saved {what} (default float16)",
    )


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
        if not ((kind is int or math.isfinite(value)) and inside):  # a 400-digit int has no float
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be {'in ' if high < math.inf else ''}{bounds}")
        return value

    return parse


def check_environment() -> None:
    """Checks every ``DSPARK_JAX_*`` variable dspark_jax reads, before anything loads or compiles:
    a kernel reads its variable only when a program using it is traced, so a bad value would
    otherwise fail late, or pass unread where no such program is traced.

    Raises:
      ValueError: naming the first bad variable, its value and the allowed values.
    """
    from dspark_jax.attention_kernel import ATTENTION_CHOICES, ATTENTION_ENV
    from dspark_jax.greedy_kernel import GREEDY_CHOICES, GREEDY_ENV
    from dspark_jax.kernel_choice import env_choice
    from dspark_jax.memory_gate import FoldedSampling
    from dspark_jax.mlp_kernel import MLP_CHOICES, MLP_ENV
    from dspark_jax.race_kernel import RACE_CHOICES, RACE_ENV
    from dspark_jax.split_round import BACKBONE_GEMM_CHOICES, BACKBONE_GEMM_ENV
    from dspark_jax.tile_race_kernel import TILE_RACE_CHOICES, TILE_RACE_ENV

    for variable, choices in (
        (ATTENTION_ENV, ATTENTION_CHOICES),
        (TILE_RACE_ENV, TILE_RACE_CHOICES),
        (RACE_ENV, RACE_CHOICES),
        (GREEDY_ENV, GREEDY_CHOICES),
        (MLP_ENV, MLP_CHOICES),
        (BACKBONE_GEMM_ENV, BACKBONE_GEMM_CHOICES),
    ):
        env_choice(variable, choices)
    FoldedSampling.resolve()  # reads DSPARK_JAX_FOLDED_SAMPLING


def check_output_file(flag: str, path: str | None) -> None:
    """Refuses an output file flag's ``path`` that could not be written (None: not given), so
    that the run does not fail at its end.

    Raises:
      ValueError: ``path`` is empty or a folder, its folder does not exist or is not
        writable, or it is an existing file that is not writable (naming ``flag``).
    """
    if path is None:
        return
    if not path:
        raise ValueError(f"{flag}={path!r} is invalid: must be a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise ValueError(f"{flag}={path!r} is invalid: must be a file path in an existing folder")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag}={path!r} cannot be written: {folder!r} or the file is not writable")


def check_checkpoint(flag: str, path: str, *, tokenizer: bool = False) -> None:
    """Refuses a checkpoint flag's ``path`` that is not a folder holding ``config.json`` (and
    ``tokenizer.json`` with ``tokenizer``), before anything loads; the loaders check the contents.

    Raises:
      ValueError: naming ``flag``, ``path``, what is wrong and what was expected.
    """
    files = ("config.json", "tokenizer.json") if tokenizer else ("config.json",)
    if os.path.isdir(path):  # a save cut short while moving its files may hold config.json back
        from dspark_jax.safetensors_io import finish_interrupted_save

        with loading(flag, path):
            finish_interrupted_save(path)
    if not os.path.exists(path):
        problem = "does not exist"
    elif not os.path.isdir(path):
        problem = "is not a folder"
    else:
        missing = [name for name in files if not os.path.isfile(os.path.join(path, name))]
        problem = f"has no {' or '.join(missing)}" if missing else ""
    if problem:
        raise ValueError(f"{flag} {path!r} {problem}: expected a checkpoint folder with {' and '.join(files)}")


def check_prompts(
    prompts: list[list[int]], names: list[str], *, max_new: tuple[str, int], gamma: int, limits: dict[str, int | None]
) -> None:
    """Refuses a prompt that encodes to no tokens, or that with ``max_new`` new tokens (and the
    ``gamma - 1`` positions the last round verifies) runs past a model's positions, naming the
    flags, before anything compiles.

    Args:
      prompts: token ids per prompt.
      names: how the messages name each prompt (``--prompt 'text'``).
      max_new: the new-token flag as typed and its value.
      gamma: the draft's block size.
      limits: ``max_position_embeddings`` by model name (``None`` where a config has none).

    Raises:
      ValueError: naming the prompt, the flags and the limit.
    """
    flag, value = max_new
    for ids, name in zip(prompts, names, strict=True):
        if not ids:
            raise ValueError(f"{name} encodes to no tokens: every prompt needs >= 1 token")
        need = len(ids) + value + gamma - 1
        for model, limit in limits.items():
            if limit is not None and need > limit:
                raise ValueError(
                    f"{name} has {len(ids)} tokens: with {flag} {value} (+ gamma - 1 = {gamma - 1} positions the last "
                    f"round verifies) it needs {need} positions, past the {model}'s max_position_embeddings={limit}: "
                    f"shorten the prompt or lower {flag}"
                )


@contextlib.contextmanager
def loading(flag: str, path: str) -> Iterator[None]:
    """Prefixes a ``ValueError`` raised while loading ``path`` with the flag that named it."""
    try:
        yield
    except ValueError as err:
        raise ValueError(f"{flag} {path!r}: {err}") from err


@contextlib.contextmanager
def as_flags(flags: dict[str, str]) -> Iterator[None]:
    """Rewrites ``field=value`` in a ``ValueError`` raised inside as ``--flag value``, for the
    fields that ``flags`` maps to the options that set them (an error naming none is re-raised)."""
    try:
        yield
    except ValueError as err:
        text = re.sub(rf"\b({'|'.join(map(re.escape, flags))})=", lambda m: f"{flags[m.group(1)]} ", str(err))
        if text == str(err):
            raise
        raise ValueError(text) from err


# name -> (module, one-line help)
COMMANDS = {
    "demo": ("dspark_jax.demo", "generate with the bundled trained pair and report τ and speed"),
    "generate": ("dspark_jax.generate_cli", "speculative generation from a target and a draft checkpoint"),
    "train-target": ("dspark_jax.target_training", "train the small Qwen3-style target on the bundled corpus"),
    "train-draft": ("dspark_jax.draft_training", "train a DSpark draft against a frozen target"),
    "eval": ("dspark_jax.evaluate", "measure τ on held-out text; DSpark vs DFlash-style ablation"),
    "calibrate": ("dspark_jax.calibrate_cli", "fit a draft's confidence temperature (STS) on held-out text"),
    "bench": ("dspark_jax.bench", "benchmark the folded proposal (and the PyTorch baseline)"),
}


def main(argv: list[str] | None = None) -> int:
    """Runs ``dspark-jax COMMAND [FLAGS]`` (``argv`` default ``sys.argv[1:]``).

    Returns:
      The exit status: the command's, 2 for an unknown command or a ``ValueError`` /
      ``TypeError`` it raised (printed as one line), 0 after printing the help.
    """
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
    args = cmd_parser.parse_args(argv[1:])
    with warnings.catch_warnings():  # restores the way warnings show once the command returns
        warnings.showwarning = functools.partial(_show_warning, cmd_parser.prog)
        try:
            check_environment()
            return int(module.run(args) or 0)
        except (ValueError, TypeError) as err:
            print(f"{cmd_parser.prog}: error: {err}", file=sys.stderr)
            return 2


def _show_warning(prog: str, message: Warning | str, category: type[Warning], *args: object, **kwargs: object) -> None:
    """A warning raised while a command runs, as one line like its errors (``dspark-jax generate:
    warning: …``) rather than Python's source path, line number and code line."""
    print(f"{prog}: warning: {message}", file=sys.stderr)


if __name__ == "__main__":
    raise SystemExit(main())
