"""``dspark-jax bench``: latency of the folded proposal against its floors and PyTorch.

Builds a draft with random weights at the released Qwen3-8B draft's shapes (or tiny
shapes that run on a CPU in seconds), fills a context cache with ``context`` tokens
per request and measures, per batch bucket and sampling mode:

* the median latency of ``propose`` (folded: one compiled call; eager: step by step);
* the floor of a round: the bytes it must move over the measured bandwidth of a jitted
  elementwise pass (``floor_copy``: of a jitted device copy) and its FLOPs over the
  measured matmul rate, whichever is larger (:mod:`dspark_jax.bench_workload`);
* compile time per bucket, cold and from the persistent compilation cache (in fresh
  subprocesses, so nothing in this process's caches helps), and peak device memory against
  the memory gate's prediction (:mod:`dspark_jax.bench_compile`);
* the same round in PyTorch, eager and as a CUDA graph (``--no-torch`` skips it;
  :mod:`dspark_jax.bench_torch`);
* with ``--e2e``, plain against speculative decoding of a Qwen3-8B-shaped target with
  accepted lengths forced to a chosen mean (:mod:`dspark_jax.bench_e2e`);
* with ``--walk``, the Markov walk alone per batch, mode and sampler
  (:mod:`dspark_jax.bench_walk`).

This module times the propose paths (:func:`bench_propose`) and runs the stages (the command
line, ``--processes``). Timing (:mod:`dspark_jax.bench_timing`): after a warm-up, each call is
dispatched and waited for (``block_until_ready``) on its own; the tables
(:mod:`dspark_jax.bench_report`) give the median over ``--iters`` calls, plus the host
dispatch time and the per-call time of calls dispatched back to back.

Shape legend: B batch, γ draft slots, V vocabulary, H hidden, C context capacity,
L draft layers, T verify width (γ + 1).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.attention_kernel import ATTENTION_CHOICES, ATTENTION_ENV, attention_choice, use_kernel
from dspark_jax.bench_compile import bench_compile, memory_stat
from dspark_jax.bench_e2e import bench_e2e
from dspark_jax.bench_report import format_table
from dspark_jax.bench_timing import environment, measure_ceilings, pool_samples, profile_call, time_call, time_calls
from dspark_jax.bench_walk import bench_walk
from dspark_jax.bench_workload import (
    MODES,
    SHAPES,
    BenchShapes,
    build_draft,
    draft_config,
    floor_ms,
    jit_split,
    mode_sampling_rows,
    random_inputs,
    round_cost,
    sampling_params,
)
from dspark_jax.cache import ContextCache
from dspark_jax.cli import check_output_file
from dspark_jax.config import DraftConfig
from dspark_jax.cpu_awake import CpuAwake, host_cpus
from dspark_jax.gpu_power import PowerSampler
from dspark_jax.greedy_kernel import GREEDY_CHOICES, GREEDY_ENV, greedy_choice, use_greedy_kernel
from dspark_jax.mlp_kernel import MLP_CHOICES, MLP_ENV, mlp_choice, use_mlp_kernel
from dspark_jax.race_kernel import RACE_CHOICES, RACE_ENV, RaceTuning, race_choice, use_race_kernel
from dspark_jax.split_round import (
    BACKBONE_GEMM_CHOICES,
    BACKBONE_GEMM_ENV,
    backbone_compile_options,
    backbone_gemm_choice,
)
from dspark_jax.tile_race_kernel import TILE_RACE_CHOICES, TILE_RACE_ENV, tile_race_choice, use_tile_race_kernel

E2E_TAU = 6.17
"""``--tau``'s default: the mean accepted length forced in ``--e2e``."""

PATHS = ("folded_greedy", "folded", "split_greedy", "split", "jit_static", "proposer", "proposer_device", "eager")


# --------------------------------------------------------------------------- propose
def _token_parity(reference: dict[str, tuple[str, np.ndarray]], mode: str, path: str, block: Any) -> dict[str, Any]:
    """A path's draft tokens against the first path of its batch and mode (same inputs and key).

    Args:
      reference: ``mode -> (path, tokens [B, γ])`` of this batch; the first call per mode sets it.
      mode, path: the row's.
      block: the path's :class:`~dspark_jax.proposal.DraftBlock`.

    Returns:
      The row's ``tokens_reference`` (that path), ``tokens_differ`` and ``tokens_compared``;
      where greedy rows differ and the block has corrected logits, also ``tokens_logit_gap``:
      the largest ``|logit(own token) − logit(reference's token)|`` in this path's corrected
      logits at each differing greedy row's first differing step (a bf16 step or so: a
      near-tie that summation order flips; a large gap: a real disagreement); where
      sampling rows differ, ``tokens_differ_sampling_rows``, their count (a sampling row's
      token wins the race of its logits and its noise, so its logits alone cannot tell a
      near-tie from a disagreement).
    """
    tokens = np.asarray(block.draft_tokens)
    ref_path, ref = reference.setdefault(mode, (path, tokens))
    differ = tokens != ref
    out = {"tokens_reference": ref_path, "tokens_differ": int(differ.sum()), "tokens_compared": tokens.size}
    sample = mode_sampling_rows(tokens.shape[0], mode)
    if (differ.any(axis=1) & sample).any():
        out["tokens_differ_sampling_rows"] = int((differ.any(axis=1) & sample).sum())
    logits = getattr(block, "corrected_logits", None)
    if (differ.any(axis=1) & ~sample).any() and logits is not None and logits.shape[-1]:
        rows = np.flatnonzero(differ.any(axis=1) & ~sample)
        steps = differ[rows].argmax(axis=1)  # each row's first differing step
        own = np.asarray(logits[rows, steps], np.float32)  # [rows, V]
        at = np.arange(len(rows))
        out["tokens_logit_gap"] = float(np.abs(own[at, tokens[rows, steps]] - own[at, ref[rows, steps]]).max())
    return out


def bench_propose(
    cfg: DraftConfig,
    graphdef: nnx.GraphDef,
    state: nnx.State,
    *,
    batches: tuple[int, ...],
    context: int,
    iters: int,
    eager_iters: int,
    ceilings: dict[str, float],
    profile: bool,
    modes: tuple[str, ...] = MODES,
    paths: tuple[str, ...] = PATHS,
    cuts: tuple[int | tuple[int, ...], ...] = (),
    versus: tuple[tuple[str, str], ...] = (),
    idle_ms: float = 0.0,
    samples: bool = False,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Times ``propose`` per batch, mode and path; records peak memory per batch.

    Paths: ``folded`` (``jax.jit(propose)`` through :func:`jit_split`, sampling folded
    in: the program every mode runs), ``folded_greedy`` (``fold_sampling=False``, greedy
    batches only), ``jit_static`` (greedy-only again, jitted the plain way with the
    graphdef as a static argument, to show what that costs per call), ``split_greedy`` and
    ``split`` (the same two programs dispatched as :class:`~dspark_jax.split_round.SplitRound`
    pieces, greedy-only and sampling folded), ``proposer``
    (:class:`~dspark_jax.proposer.Proposer`: host-side checks and padding, the slot
    gather, the folded round; inputs on the host as a server holds them),
    ``proposer_device`` (the same Proposer given int32 / float32 inputs already on the device
    and the mode, as a serving loop holds them after verification: packed on the device by
    the first backbone piece, which the first call per bucket compiles, checked after the
    launch, README notes 59 and 62) and ``eager``
    (:func:`~dspark_jax.proposal.propose_eager`). Each of ``cuts`` (a
    :class:`~dspark_jax.split_round.SplitRound` ``piece_layers``) adds the split paths once more
    with the backbone cut that way, named by the pieces' layer counts (``split_greedy@1|4``),
    timed in the same interleaved rounds (README note 64). Each of ``versus`` (a kernel-choice
    flag of :data:`ENV_FLAGS` and one of its choices, e.g. ``("mlp", "xla")``) adds them once
    more, traced with that choice's variable set (``split_greedy@mlp=xla``): an A/B of a kernel
    choice against the run's own, same inputs, same process, interleaved.

    Every row also compares the path's draft tokens with those of the first path timed for
    its batch and mode, from the same inputs and key (:func:`_token_parity`); the Proposer
    reads its own cache slots, so both its paths are compared with the split round run on
    those slots. With ``idle_ms`` > 0 every path is also timed with that much idle before each
    call (``idle_median_ms``, :func:`time_call`). Where the GPU's driver answers NVML, each
    row's ``board`` says what the board did while its batch was timed
    (:meth:`~dspark_jax.gpu_power.PowerSampler.summary`: SM clock, power, power-cap share).
    With ``samples`` every timed row keeps its raw wall times (``samples``, for
    :func:`pool_samples`).

    Returns:
      ``(rows, memory)``: one timing row per (batch, mode, path) with its floor, and one
      memory row per batch. Batches run in ascending order so the device's peak memory
      after a batch is that batch's peak.
    """
    from dspark_jax.proposal import propose, propose_eager
    from dspark_jax.proposer import Proposer
    from dspark_jax.split_round import SplitRound

    folded, leaves = jit_split(propose, graphdef, state, static_argnames="fold_sampling")
    static = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")
    draft = nnx.merge(graphdef, state)
    split = SplitRound(draft)
    # path suffix ("@1|4") -> the split round of each extra backbone cut, timed beside the default
    # and the kernel-choice variables each extra round is traced with ({} for a cut)
    extra_rounds: dict[str, tuple[SplitRound, dict[str, str]]] = {}
    for cut in cuts:
        extra = SplitRound(draft, piece_layers=cut)
        extra_rounds.setdefault("@" + "|".join(str(stop - start) for start, stop in extra.ranges), (extra, {}))
    variables = {flag: variable for flag, _, variable, _ in ENV_FLAGS}
    for flag, choice in versus:
        extra_rounds.setdefault(f"@{flag}={choice}", (SplitRound(draft), {variables[flag]: choice}))
    capacity = context + 2 * cfg.num_query_rows
    if {"proposer", "proposer_device"} & set(paths):
        proposer = Proposer(draft, max_batch=max(batches), capacity=capacity, folded_sampling="force")
        shared = random_inputs(cfg, max(batches), context, capacity, seed=0)["cache"]  # the Proposer's slots
    key = jax.random.key(7)
    bandwidth = ceilings["elementwise_bytes_per_s"]
    rows, memory = [], []
    for batch in sorted(batches):
        inp = random_inputs(cfg, batch, context, capacity, seed=batch)
        host = {k: np.asarray(inp[k]) for k in ("bonus", "prefix_lens")}
        mem_row: dict[str, Any] = {"batch": batch, "in_use_before_bytes": memory_stat("bytes_in_use")}
        pending: list[tuple[dict[str, Any], Callable[[], Any]]] = []  # (row so far, its call)
        reference: dict[str, tuple[str, np.ndarray]] = {}  # mode -> first path's tokens (_token_parity)
        proposer_blocks: dict[tuple[str, str], Any] = {}  # (path, mode) -> the Proposer's first DraftBlock
        variants = [
            ("folded_greedy", False, ("greedy",), None, {}),
            ("folded", True, MODES, None, {}),
            ("split_greedy", False, ("greedy",), split, {}),
            ("split", True, MODES, split, {}),
            ("jit_static", False, ("greedy",), None, {}),
        ]
        split_variants = [v for v in variants if v[3] is split]
        variants += [
            (p + label, f, m, extra, env)
            for label, (extra, env) in extra_rounds.items()
            for p, f, m, _, _ in split_variants
        ]
        for path, fold_sampling, path_modes, split_of_path, env in variants:
            path_modes = [m for m in path_modes if m in modes] if path.split("@")[0] in paths else []
            cost = round_cost(cfg, batch, context, folded_sampling=fold_sampling)
            floor, bound = floor_ms(cost, bandwidth, ceilings["matmul_flops_per_s"])
            floor_copy, _ = floor_ms(cost, ceilings["copy_bytes_per_s"], ceilings["matmul_flops_per_s"])
            for mode in path_modes:
                temps, top_k = sampling_params(batch, mode)
                args = (inp["cache"], inp["bonus"], inp["prefix_lens"], temps, top_k, key)
                if path == "jit_static":
                    fn, args = static, (graphdef, state, *args)
                elif split_of_path is not None:
                    fn = split_of_path
                else:
                    fn, args = folded, (leaves, *args)

                def call(args=args, fold_sampling=fold_sampling, fn=fn):
                    return fn(*args, fold_sampling=fold_sampling)

                t0 = time.perf_counter()
                with environment(env):  # read while the first call traces and compiles
                    first = jax.block_until_ready(call())
                row = {
                    "batch": batch,
                    "mode": mode,
                    "path": path,
                    "first_call_ms": (time.perf_counter() - t0) * 1e3,
                    "bytes": cost["bytes"],
                    "flops": cost["flops"],
                    "floor_ms": floor,
                    "floor_bound": bound,
                    "floor_copy_ms": floor_copy,
                    **({"traced_with": env} if env else {}),
                    **_token_parity(reference, mode, path, first),
                }
                pending.append((row, call))
        for path, mode in [(p, m) for p in ("proposer", "proposer_device") if p in paths for m in modes]:
            temps, top_k = (np.asarray(a) for a in sampling_params(batch, mode))
            if path == "proposer":
                call_proposer = functools.partial(
                    proposer, shared, host["bonus"], host["prefix_lens"], temps, top_k, key
                )
            else:  # int32 / float32 on the device, the mode known: what a serving loop passes
                bonus, lens, k = (jnp.asarray(a, jnp.int32) for a in (host["bonus"], host["prefix_lens"], top_k))
                on_device = (bonus, lens, jnp.asarray(temps, jnp.float32), k)
                call_proposer = functools.partial(proposer, shared, *on_device, key, sampling=mode != "greedy")
            proposer_blocks[path, mode] = jax.block_until_ready(call_proposer())
            pending.append(({"batch": batch, "mode": mode, "path": path}, call_proposer))
        mem_row["peak_after_first_calls_bytes"] = memory_stat("peak_bytes_in_use")
        # every path and mode of this batch timed in interleaved rounds (time_calls)
        with PowerSampler() as sampler:
            timings = time_calls(
                {i: call for i, (_, call) in enumerate(pending)},
                iters=iters,
                rounds=min(3, iters),
                idle_s=idle_ms / 1e3,
                samples=samples,
            )
        board = sampler.summary()
        for i, (row, call) in enumerate(pending):
            row.update(timings[i])
            if board is not None:
                row["board"] = board
            if profile and not row["path"].startswith("proposer"):  # every mode: sampling rounds differ too
                row["profile"] = profile_call(call, iters)
            rows.append(row)
        mem_row["peak_after_timing_bytes"] = memory_stat("peak_bytes_in_use")
        if proposer_blocks:  # the split round on the Proposer's slots 0..B-1
            slots = ContextCache(k=shared.k[:, :batch], v=shared.v[:, :batch])
            for row, _ in pending:
                if row["path"].startswith("proposer"):
                    temps, top_k = sampling_params(batch, row["mode"])
                    on_slots = split(slots, inp["bonus"], inp["prefix_lens"], temps, top_k, key, fold_sampling=True)
                    own = {row["mode"]: ("split (the Proposer's slots)", np.asarray(on_slots.draft_tokens))}
                    block = proposer_blocks[row["path"], row["mode"]]
                    row.update(_token_parity(own, row["mode"], row["path"], block))
            del slots
        for mode in modes if "eager" in paths and eager_iters else ():
            temps, top_k = sampling_params(batch, mode)

            def call_eager(temps=temps, top_k=top_k, inp=inp):
                return propose_eager(draft, inp["cache"], inp["bonus"], inp["prefix_lens"], temps, top_k, key)

            parity = _token_parity(reference, mode, "eager", call_eager())
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "path": "eager",
                    **time_call(call_eager, iters=eager_iters, samples=samples),
                    **parity,
                }
            )
        memory.append(mem_row)
        inp.clear()  # frees this batch's cache before the next batch's is built
    return rows, memory


# --------------------------------------------------------------------------- torch
def bench_torch(shapes: BenchShapes, batches: tuple[int, ...], iters: int) -> dict[str, Any]:
    """Runs :mod:`dspark_jax.bench_torch` in a subprocess (PyTorch stays out of this process).

    Returns:
      Its JSON result, or ``{"error": ...}`` when PyTorch or CUDA is missing or it fails.
    """
    cmd = [
        sys.executable,
        "-m",
        "dspark_jax.bench_torch",
        "--shapes",
        shapes.name,
        "--batches",
        ",".join(map(str, batches)),
        "--iters",
        str(iters),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- command line
def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches={text!r} is invalid: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--batches={text!r} is invalid: every batch must be >= 1")
    _once(text, values)
    return values


def _cuts(text: str) -> tuple[tuple[int, ...], ...]:
    """``--cuts``: ``:``-separated cuts, each a comma-separated :class:`SplitRound` ``piece_layers``."""
    try:
        cuts = tuple(tuple(int(n) for n in cut.split(",")) for cut in text.split(":"))
    except ValueError:
        cuts = None
    if not cuts or any(not cut or min(cut) < 1 for cut in cuts):
        raise argparse.ArgumentTypeError(
            f"--cuts={text!r} is invalid: must be ':'-separated cuts of comma-separated layer counts >= 1, e.g. 1:1,1,1"
        )
    return cuts


def _race_tunings(text: str) -> tuple[RaceTuning, ...]:
    """``--race-tunings``: comma-separated ``P:W:K`` (:meth:`RaceTuning.parse`)."""
    try:
        return tuple(RaceTuning.parse(part) for part in text.split(",") if part.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _once(text: str, values: tuple) -> None:
    """Refuses a list flag naming a value twice (a batch would be timed twice, a mode's rows doubled)."""
    twice = sorted({v for v in values if values.count(v) > 1}, key=values.index)
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: {', '.join(map(repr, twice))} given more than once")


def _choices(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v for v in text.split(",") if v)
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a comma-separated subset of {allowed}")
        _once(text, values)
        return values

    return parse


ENV_FLAGS = (
    ("attention", ATTENTION_CHOICES, ATTENTION_ENV, "the draft's context attention"),
    ("tile_race", TILE_RACE_CHOICES, TILE_RACE_ENV, "the folded walk's tiled kernels"),
    ("race", RACE_CHOICES, RACE_ENV, "the folded walk's race kernel where the tiled ones do not run"),
    ("greedy", GREEDY_CHOICES, GREEDY_ENV, "the greedy-only walk's step"),
    ("mlp", MLP_CHOICES, MLP_ENV, "the draft MLP's gate/up projections and SwiGLU"),
    ("gemm", BACKBONE_GEMM_CHOICES, BACKBONE_GEMM_ENV, "the split round's backbone GEMMs"),
)
"""The kernel-choice flags: ``(flag, its choices, the environment variable it sets, what it chooses)``."""


def _versus(text: str) -> tuple[tuple[str, str], ...]:
    """``--versus``: comma-separated ``FLAG=CHOICE`` items, each a kernel-choice flag of
    :data:`ENV_FLAGS` and one of its choices."""
    choices = {flag: flag_choices for flag, flag_choices, _, _ in ENV_FLAGS}
    items = []
    for item in text.split(","):
        flag, _, choice = item.strip().partition("=")
        flag = flag.strip().replace("-", "_")
        if flag not in choices or choice.strip() not in choices[flag]:
            allowed = "; ".join(f"{f}={'|'.join(c)}" for f, c in choices.items())
            raise argparse.ArgumentTypeError(
                f"--versus={text!r} is invalid: {item.strip()!r} is not FLAG=CHOICE with one of {allowed}"
            )
        items.append((flag, choice.strip()))
    return tuple(items)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax bench`` flags."""
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="8b", help="model shapes (default 8b)")
    parser.add_argument("--batches", type=_batches, default=None, help="comma-separated batch sizes")
    parser.add_argument("--iters", type=int, default=None, help="timed calls per measurement")
    parser.add_argument("--eager-iters", type=int, default=None, help="timed eager calls (0 skips eager)")
    parser.add_argument("--modes", type=_choices(MODES), default=MODES, help=f"comma-separated subset of {MODES}")
    parser.add_argument("--paths", type=_choices(PATHS), default=PATHS, help=f"comma-separated subset of {PATHS}")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    parser.add_argument("--no-compile", action="store_true", help="skip the compile-time subprocesses")
    parser.add_argument("--max-batch", type=int, default=None, help="largest precompiled bucket (default max batch)")
    parser.add_argument("--compile-workers", type=int, default=1, help="programs precompiled at once (default 1)")
    parser.add_argument("--profile", action="store_true", help="record device time per kernel (GPU)")
    parser.add_argument("--e2e", action="store_true", help="also run plain vs speculative decoding")
    parser.add_argument(
        "--walk", action="store_true", help="also time the Markov walk alone per batch, mode and sampler"
    )
    parser.add_argument(
        "--race-tunings",
        type=_race_tunings,
        default=(),
        help="with --walk: race-kernel layouts P:W:K (blocks per program, warps, pick warps) timed besides the default",
    )
    parser.add_argument(
        "--cuts",
        type=_cuts,
        default=(),
        help="backbone cuts timed beside the default, as the split paths: pieces' layer counts but the last's, "
        "e.g. 1:1,1,1 (1 | 4 and 1 | 1 | 1 | 2 for five layers)",
    )
    parser.add_argument(
        "--versus",
        type=_versus,
        default=(),
        help="kernel choices timed beside the run's own, as the split paths traced with each, e.g. "
        "mlp=xla,tile_race=xla (paths split_greedy@mlp=xla, …)",
    )
    parser.add_argument("--e2e-layers", type=int, default=None, help="target layers in --e2e (default the preset's)")
    parser.add_argument(
        "--tau", type=float, default=None, help=f"forced mean accepted length in --e2e (default {E2E_TAU})"
    )
    parser.add_argument("--xla-flags", default=None, help="appended to XLA_FLAGS before the backend starts")
    for flag, choices, variable, what in ENV_FLAGS:
        parser.add_argument(
            f"--{flag.replace('_', '-')}",
            choices=choices,
            default=None,
            help=f"{what} (sets {variable}; default: the environment's, else auto)",
        )
    parser.add_argument(
        "--awake",
        action="store_true",
        help="time with a lowest-priority spinner on every CPU, so that none halts while the device works "
        "(dspark_jax.CpuAwake; PyTorch included, the compile stage not)",
    )
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=0.0,
        help="also time each path with this many ms of idle before each call (column idle; default 0: not timed): "
        "the latency when the board's power cap does not hold its clock down",
    )
    parser.add_argument(
        "--processes",
        type=int,
        default=1,
        help="time the propose paths in this many fresh processes one after another and pool every call's "
        "samples (default 1: in this process); the host's speed can differ for one path from process to "
        "process (README note 94); e2e, --walk and the profiles run in the first",
    )
    parser.add_argument("--out", default=None, help="write the JSON result here")
    parser.add_argument("--timing-child", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--timing-out", default=None, help=argparse.SUPPRESS)


def _xla_refusal(flags: str) -> str | None:
    """XLA's reason for refusing ``XLA_FLAGS=flags`` (its first error line), or None: tried in a
    child process on the CPU backend, which takes no accelerator memory."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    child = subprocess.run(
        [sys.executable, "-c", "import jax; jax.devices()"], env=env, capture_output=True, text=True, check=False
    )
    if child.returncode == 0:
        return None
    logged = [line.split("] ", 1)[-1] for line in child.stderr.splitlines() if re.match(r"[EF]\d{4} ", line)]
    return logged[0] if logged else f"exit status {child.returncode}"


def check_xla_flags(flags: str) -> None:
    """Refuses ``--xla-flags`` that XLA would abort the process on, naming the flag.

    XLA reads ``XLA_FLAGS`` when the first backend starts and aborts on a name it does not
    know or a value it cannot read; a child process tries them first (about 3 s).

    Raises:
      ValueError: XLA refused the flags, with XLA's own reason; the environment's
        ``XLA_FLAGS`` is named instead where XLA refuses it alone.
    """
    inherited = os.environ.get("XLA_FLAGS", "").strip()
    said = _xla_refusal(f"{inherited} {flags}".strip())
    if said is None:
        return
    if inherited and (alone := _xla_refusal(inherited)) is not None:
        raise ValueError(f"the XLA_FLAGS environment variable {inherited!r}: XLA refuses it ({alone})")
    raise ValueError(f"--xla-flags {flags!r}: XLA refuses it ({said})")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark described by parsed ``args``; prints the table, writes JSON. Returns 1
    when the e2e stage failed (the table names the error), else 0."""
    if args.xla_flags:
        check_xla_flags(args.xla_flags)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    for flag, _, variable, _ in ENV_FLAGS:
        if getattr(args, flag):
            os.environ[variable] = getattr(args, flag)  # the compile subprocesses inherit it
    shapes = SHAPES[args.shapes]
    batches = args.batches or shapes.batches
    iters = shapes.iters if args.iters is None else args.iters
    eager_iters = max(2, iters // 10) if args.eager_iters is None else args.eager_iters
    for name, value in (
        ("--iters", iters),
        ("--max-batch", args.max_batch),
        ("--compile-workers", args.compile_workers),
        ("--processes", args.processes),
        ("--e2e-layers", args.e2e_layers),
    ):
        if value is not None and value < 1:  # None: the preset's
            raise ValueError(f"{name}={value} is invalid: must be >= 1")
    if eager_iters < 0:
        raise ValueError(f"--eager-iters={eager_iters} is invalid: must be >= 0 (0 skips eager)")
    gamma = draft_config(shapes).gamma
    for name, value in (("--tau", args.tau), ("--e2e-layers", args.e2e_layers)):
        if value is not None and not args.e2e:
            raise ValueError(f"{name} is only used with --e2e: add --e2e, or drop {name}")
    fused = draft_config(shapes).num_fused_layers
    if args.e2e and args.e2e_layers is not None and args.e2e_layers < fused - 1:
        raise ValueError(
            f"--e2e-layers={args.e2e_layers} is invalid: must be >= {fused - 1} (the {shapes.name} draft fuses "
            f"{fused} target layers, the embedding output counting as one)"
        )
    args.tau = E2E_TAU if args.tau is None else args.tau
    if args.e2e and not 1 < args.tau < gamma + 1:
        raise ValueError(f"--tau={args.tau} is invalid: must lie strictly between 1 and gamma + 1 = {gamma + 1}")
    if not 0 <= args.idle_ms <= 1000:
        raise ValueError(f"--idle-ms={args.idle_ms} is invalid: must be in [0, 1000] milliseconds")
    for name in ("cuts", "versus"):
        if getattr(args, name) and not {"split_greedy", "split"} & set(args.paths):
            raise ValueError(f"--{name} times the split paths: add split_greedy or split to --paths, or drop --{name}")
    if args.race_tunings and not args.walk:
        raise ValueError("--race-tunings is only used with --walk: add --walk, or drop --race-tunings")
    check_output_file("--out", args.out)
    if args.timing_child is not None:  # one of --processes' timing processes
        return _timing_child(args, shapes, batches, iters, eager_iters)
    result: dict[str, Any] = {
        "meta": {
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": "dspark-jax bench " + " ".join(_bench_argv(args)),
            "shapes": shapes.name,
            "draft": draft_config(shapes).to_hf_config(),
            "context": shapes.context,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "jax": jax.__version__,
            "awake_spinners": len(host_cpus()) if args.awake else 0,
            "idle_ms": args.idle_ms,
            "processes": args.processes,
        }
    }

    def awake():  # the timed stages' host (README note 74)
        return CpuAwake() if args.awake else contextlib.nullcontext()

    # Subprocesses first: this process's device allocator must not hold the memory yet.
    if not args.no_torch:
        with awake():
            result["torch"] = bench_torch(shapes, batches, iters)
        _save(args.out, result)
    cache_dir = tempfile.mkdtemp(prefix="dspark_bench_cache_")
    previous = jax.config.jax_compilation_cache_dir
    try:
        if not args.no_compile:
            result["compile"] = bench_compile(shapes, args.max_batch or max(batches), cache_dir, args.compile_workers)
            _save(args.out, result)
            # The timed programs below load what the compile runs stored.
            jax.config.update("jax_compilation_cache_dir", cache_dir)
        if args.processes > 1:
            _measure_in_processes(args, cache_dir, result)
        else:
            with awake():
                _measure(args, shapes, batches, iters, eager_iters, result)
    finally:
        jax.config.update("jax_compilation_cache_dir", previous)
        shutil.rmtree(cache_dir, ignore_errors=True)
    print(format_table(result))
    _save(args.out, result)
    return 1 if "error" in result.get("e2e", {}) else 0  # the table says "e2e failed: …"


def _bench_argv(args: argparse.Namespace) -> list[str]:
    """The flags this run was given: from :func:`main`, or after ``bench`` in ``dspark-jax bench …``."""
    if getattr(args, "argv", None) is not None:
        return args.argv
    return sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]


def _save(path: str | None, result: dict[str, Any]) -> None:
    """Writes the result so far (so a later stage's failure keeps the earlier numbers)."""
    if path:
        with open(path, "w") as f:
            json.dump(result, f, indent=1)


def _timing_child(args, shapes, batches, iters, eager_iters) -> int:
    """One of ``--processes``' processes: the timed stage alone (the first also runs e2e, the
    walk and the profiles), written to ``--timing-out`` with every call's samples."""
    first = args.timing_child == 0
    args.e2e, args.walk, args.profile = (args.e2e and first, args.walk and first, args.profile and first)
    args.out = None  # the parent's file: this process writes --timing-out only
    result: dict[str, Any] = {"meta": {}}
    with CpuAwake() if args.awake else contextlib.nullcontext():
        _measure(args, shapes, batches, iters, eager_iters, result, samples=True)
    with open(args.timing_out, "w") as f:
        json.dump(result, f)
    return 0


def _measure_in_processes(args, cache_dir: str, result: dict[str, Any]) -> None:
    """``--processes N``: the timed stage in ``N`` fresh processes one after another (sharing the
    persistent compilation cache), their samples pooled (:func:`pool_samples`); everything else
    (ceilings, memory, e2e, the walk, the profiles, the kernel choices) from the first."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="dspark_bench_timing_") as tmp:
        for i in range(args.processes):
            out = os.path.join(tmp, f"process_{i}.json")
            cmd = [sys.executable, "-m", "dspark_jax.bench", *_bench_argv(args), "--timing-child", str(i)]
            env = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir}
            proc = subprocess.run([*cmd, "--timing-out", out], env=env, capture_output=True, text=True, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"timing process {i} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
            with open(out) as f:
                runs.append(json.load(f))
    first = runs[0]
    result["meta"].update(first["meta"])
    result.update({k: v for k, v in first.items() if k not in ("meta", "propose")})
    result["propose"] = pool_samples([run["propose"] for run in runs])


def _measure(args, shapes, batches, iters, eager_iters, result, samples: bool = False) -> None:
    device = jax.devices()[0]
    cfg = draft_config(shapes)
    result["meta"].update(
        backend=jax.default_backend(),
        device=device.device_kind,
        attention=attention_choice(),
        attention_kernel=use_kernel(cfg.jnp_dtype, cfg.head_dim, shapes.context + 2 * cfg.num_query_rows)[0],
        tile_race=tile_race_choice(),
        tile_race_kernel=[
            b for b in batches if use_tile_race_kernel(cfg.markov_rank, cfg.jnp_dtype, cfg.vocab_size, b)[0]
        ],
        race=race_choice(),
        race_kernel=use_race_kernel(cfg.vocab_size)[0],
        greedy=greedy_choice(),
        greedy_kernel=[b for b in batches if use_greedy_kernel(cfg.markov_rank, cfg.jnp_dtype, b)[0]],
        mlp=mlp_choice(),
        mlp_kernel=[
            b
            for b in batches
            if use_mlp_kernel(cfg.jnp_dtype, b * cfg.num_query_rows, cfg.hidden_size, cfg.intermediate_size)[0]
        ],
        backbone_gemm=backbone_gemm_choice(),
        backbone_cublas=[b for b in batches if backbone_compile_options(b)],
    )
    result["ceilings"] = measure_ceilings(shapes.ceiling_bytes, shapes.matmul_size, iters=max(5, iters // 5))
    _save(args.out, result)
    graphdef, state = build_draft(cfg)
    result["propose"], result["memory"] = bench_propose(
        cfg,
        graphdef,
        state,
        batches=batches,
        context=shapes.context,
        iters=iters,
        eager_iters=eager_iters,
        ceilings=result["ceilings"],
        profile=args.profile,
        modes=args.modes,
        paths=args.paths,
        cuts=args.cuts,
        versus=args.versus,
        idle_ms=args.idle_ms,
        samples=samples,
    )
    _save(args.out, result)
    if args.walk:
        result["walk"] = bench_walk(
            nnx.merge(graphdef, state),
            batches=batches,
            modes=args.modes,
            iters=iters,
            tunings=args.race_tunings,
            profile=args.profile,
        )
        _save(args.out, result)
    del graphdef, state
    if args.e2e:
        try:
            result["e2e"] = bench_e2e(
                shapes,
                target_layers=args.e2e_layers or draft_config(shapes).num_target_layers,
                tau=args.tau,
                rounds=shapes.e2e_steps,
            )
        except Exception as err:  # noqa: BLE001 - keep the measurements above when the e2e stage fails
            result["e2e"] = {"error": repr(err)}


def main(argv: list[str] | None = None) -> int:
    """Entry point: ``python -m dspark_jax.bench`` or ``dspark-jax bench``."""
    parser = argparse.ArgumentParser(prog="dspark-jax bench", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":  # as `dspark-jax bench`: environment checked, a bad flag one line
    from dspark_jax.cli import main as cli_main

    raise SystemExit(cli_main(["bench", *sys.argv[1:]]))
