"""``dspark-jax bench``: latency of the folded proposal against its floors and PyTorch.

Builds a draft with random weights at the released Qwen3-8B draft's shapes (or tiny
shapes that run on a CPU in seconds), fills a context cache with ``context`` tokens
per request and measures, per batch bucket and sampling mode:

* the median latency of ``propose`` (folded: one compiled call; eager: step by step);
* the floor of a round: the bytes it must move over the measured bandwidth of a jitted
  elementwise pass (``floor_copy``: of a jitted device copy) and its FLOPs over the
  measured matmul rate, whichever is larger;
* compile time per bucket, cold and from the persistent compilation cache (in fresh
  subprocesses, so nothing in this process's caches helps);
* peak device memory against the memory gate's prediction;
* the same round in PyTorch, eager and as a CUDA graph (``--no-torch`` skips it);
* with ``--e2e``, plain against speculative decoding of a Qwen3-8B-shaped target with
  accepted lengths forced to a chosen mean;
* with ``--walk``, the Markov walk alone per batch, mode and sampler
  (:mod:`dspark_jax.bench_walk`).

Timing (:func:`time_call`): after a warm-up, each call is dispatched and waited for
(``block_until_ready``) on its own; the tables give the median over ``--iters`` calls,
plus the host dispatch time and the per-call time of calls dispatched back to back.

Shape legend: B batch, γ draft slots, V vocabulary, H hidden, C context capacity,
L draft layers, T verify width (γ + 1).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.attention_kernel import ATTENTION_CHOICES, ATTENTION_ENV, attention_choice, use_kernel
from dspark_jax.cache import ContextCache, fill_context
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.cpu_awake import CpuAwake, host_cpus
from dspark_jax.draft import DSparkDraft
from dspark_jax.gpu_power import PowerSampler
from dspark_jax.greedy_kernel import GREEDY_CHOICES, GREEDY_ENV, greedy_choice, use_greedy_kernel
from dspark_jax.mlp_kernel import MLP_CHOICES, MLP_ENV, mlp_choice, use_mlp_kernel
from dspark_jax.presets import load_preset
from dspark_jax.race_kernel import RACE_CHOICES, RACE_ENV, RaceTuning, race_choice, use_race_kernel
from dspark_jax.ready import spin_until_ready
from dspark_jax.split_round import (
    BACKBONE_GEMM_CHOICES,
    BACKBONE_GEMM_ENV,
    backbone_compile_options,
    backbone_gemm_choice,
)
from dspark_jax.target import KVCache, Qwen3Target
from dspark_jax.tile_race_kernel import TILE_RACE_CHOICES, TILE_RACE_ENV, tile_race_choice, use_tile_race_kernel

MODES = ("greedy", "mixed", "sampling")
PATHS = ("folded_greedy", "folded", "split_greedy", "split", "jit_static", "proposer", "proposer_device", "eager")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchShapes:
    """Model shapes and measurement sizes of one benchmark preset.

    ``preset`` names a draft config in ``configs/`` (read with ``dtype`` for weights and
    compute); the target shares the draft's hidden size, heads, intermediate size and
    vocabulary and has the preset's ``num_target_layers`` layers.
    """

    name: str
    preset: str
    dtype: str
    context: int
    ceiling_bytes: int
    matmul_size: int
    batches: tuple[int, ...]
    iters: int
    e2e_steps: int


SHAPES = {
    # The released dspark_qwen3_8b_block7 draft (bf16, vanilla head, confidence head).
    "8b": BenchShapes(
        name="8b",
        preset="dspark_qwen3_8b_block7",
        dtype="bfloat16",
        context=1024,
        ceiling_bytes=2 << 30,
        matmul_size=8192,
        batches=(1, 8, 32, 128),
        iters=50,
        e2e_steps=32,
    ),
    # Seconds on a CPU: the CI smoke run.
    "tiny": BenchShapes(
        name="tiny",
        preset="tiny",
        dtype="float32",
        context=32,
        ceiling_bytes=8 << 20,
        matmul_size=128,
        batches=(1, 4),
        iters=3,
        e2e_steps=4,
    ),
}


def draft_config(shapes: BenchShapes) -> DraftConfig:
    """The benchmark draft's config."""
    return load_preset(shapes.preset, dtype=shapes.dtype, param_dtype=shapes.dtype)


def target_config(shapes: BenchShapes, num_layers: int | None = None) -> TargetConfig:
    """A Qwen3 target of the draft's width with ``num_layers`` (default the preset's) layers."""
    d = draft_config(shapes)
    return TargetConfig(
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=num_layers or d.num_target_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        vocab_size=d.vocab_size,
        dtype=d.dtype,
        param_dtype=d.param_dtype,
    )


# --------------------------------------------------------------------------- inputs
def build_draft(
    cfg: DraftConfig, seed: int = 0, *, embed_tokens: jax.Array | None = None, lm_head: jax.Array | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """A draft with random weights created on the default device.

    Returns:
      ``(graphdef, state)`` of the split module.
    """
    draft = DSparkDraft(cfg, rngs=nnx.Rngs(seed), embed_tokens=embed_tokens, lm_head=lm_head)
    return nnx.split(draft)


def jit_split(
    fn: Callable[..., Any], graphdef: nnx.GraphDef, state: nnx.State, **jit_kwargs: Any
) -> tuple[Callable[..., Any], list[jax.Array]]:
    """``jax.jit`` of ``fn(graphdef, state, *args)`` called as ``(leaves, *args)``.

    The graphdef is closed over and the state passed as a plain list of leaves. Passing an
    NNX ``GraphDef`` as a static argument makes every call hash it (measured on a 2-core
    CPU: 0.9 ms for the 5-layer draft, 6.1 ms for a 36-layer target), and flattening an
    ``nnx.State`` costs 0.1–0.7 ms a call; this form pays neither.

    Returns:
      ``(jitted, leaves)``: call ``jitted(leaves, *args, **kwargs)``.
    """
    leaves, treedef = jax.tree.flatten(state)

    def call(leaves, *args, **kwargs):
        return fn(graphdef, jax.tree.unflatten(treedef, leaves), *args, **kwargs)

    return jax.jit(call, **jit_kwargs), leaves


def random_context(cfg: DraftConfig, batch: int, capacity: int, key: jax.Array) -> ContextCache:
    """A context cache ``[L, B, C, KVH, D]`` filled with random keys and values.

    Random entries stand in for ``fill_context`` of a 1024-token prompt: the proposal
    reads them the same way, and building them costs no backbone pass.
    """
    shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
    kk, kv = jax.random.split(key)
    make = jax.jit(lambda k: jax.random.normal(k, shape, cfg.jnp_dtype))
    return ContextCache(k=make(kk), v=make(kv))


def _mode_sampling_rows(batch: int, mode: str) -> np.ndarray:
    """``[B]`` bool: the rows that sample in a benchmark batch of ``mode`` (see :func:`sampling_params`)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
    n_sample = {"greedy": 0, "mixed": max(1, batch // 2), "sampling": batch}[mode]
    return np.arange(batch) < n_sample


def sampling_params(batch: int, mode: str) -> tuple[jax.Array, jax.Array]:
    """Per-row ``(temperatures [B], top_k [B])`` of a benchmark batch.

    ``greedy``: every row greedy; ``sampling``: every row samples at T = 1 over the whole
    vocabulary; ``mixed``: the first ``max(1, B // 2)`` rows sample, the rest are greedy.
    """
    from dspark_jax.sampling import TOP_K_ALL

    sample = _mode_sampling_rows(batch, mode)
    temps = np.where(sample, 1.0, 0.0).astype(np.float32)
    top_k = np.where(sample, TOP_K_ALL, 1).astype(np.int32)
    return jnp.asarray(temps), jnp.asarray(top_k)


# --------------------------------------------------------------------------- floors
def round_cost(cfg: DraftConfig, batch: int, context: int, *, folded_sampling: bool) -> dict[str, float]:
    """Bytes a draft round must move and the FLOPs it must do.

    Counted: the layer weights, the lm_head and the embedding rows once; ``markov_w2``
    once per walk step (78 MB at the 8B shapes, more than an H200's 60 MB L2, and each
    step needs the previous step's token); the context keys and values of ``context``
    positions per request; the corrected logits ``[B, γ, V]`` (model dtype) written when the
    round folds sampling. Norms, RoPE and the confidence head are negligible.

    Returns:
      ``bytes``, ``flops`` and the parts of each.
    """
    item = jnp.dtype(cfg.jnp_param_dtype).itemsize
    act = jnp.dtype(cfg.jnp_dtype).itemsize
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, kvh, v, r, g = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.markov_rank, cfg.gamma
    rows = batch * cfg.num_query_rows
    layer_params = h * nh * d * 2 + h * kvh * d * 2 + 3 * h * i
    parts_bytes = {
        "layers": cfg.num_hidden_layers * layer_params * item,
        "lm_head": v * h * item,
        "markov_w2": g * v * r * item,
        "context_kv": 2 * cfg.num_hidden_layers * batch * context * kvh * d * act,
        "embed_rows": rows * h * item,
        "corrected_logits": batch * g * v * act if folded_sampling else 0,
    }
    keys = context + cfg.num_query_rows
    parts_flops = {
        "layers": 2 * rows * cfg.num_hidden_layers * layer_params,
        "attention": 2 * 2 * rows * cfg.num_hidden_layers * nh * d * keys,
        "lm_head": 2 * batch * g * v * h,
        "markov": 2 * batch * g * v * r,
    }
    return {
        "bytes": float(sum(parts_bytes.values())),
        "flops": float(sum(parts_flops.values())),
        "bytes_parts": parts_bytes,
        "flops_parts": parts_flops,
    }


def floor_ms(cost: dict[str, float], bandwidth: float, flop_rate: float) -> tuple[float, str]:
    """``max(bytes / bandwidth, flops / flop_rate)`` in ms and which term bounds it."""
    t_bytes = cost["bytes"] / bandwidth * 1e3
    t_flops = cost["flops"] / flop_rate * 1e3
    return (t_bytes, "bytes") if t_bytes >= t_flops else (t_flops, "flops")


# --------------------------------------------------------------------------- timing
def _time_samples(fn: Callable[[], Any], *, iters: int, warmup: int, idle_s: float = 0.0) -> dict[str, list[float]]:
    """Raw wall times (ms) of ``fn()`` for :func:`time_call`: ``latency`` and ``dispatch`` per
    call waited for on its own, ``pipelined`` one total over ``iters`` calls dispatched back to
    back (``pipelined_calls`` of them), ``released`` and ``spin`` per call, and with ``idle_s``
    > 0 ``idle`` per call waited for after ``idle_s`` seconds of sleep.

    Raises:
      ValueError: ``idle_s`` is negative (or NaN).
    """
    if not idle_s >= 0:
        raise ValueError(f"idle_s={idle_s!r} is invalid: must be a number of seconds >= 0")
    out = None
    for _ in range(warmup):
        # the previous result held during each call, as in the waited loop next: XLA records
        # each program's CUDA graphs for that allocation pattern here, not in the loop's first
        # calls (README note 93: two graph updates, 0.1-0.3 ms each, at its second and third)
        out = jax.block_until_ready(fn())
    times, dispatch = [], []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) * 1e3)
        dispatch.append((t1 - t0) * 1e3)
    t0 = time.perf_counter()
    for _ in range(iters):
        out = fn()  # in-order execution: the last result ready means all are done
    jax.block_until_ready(out)
    pipelined = (time.perf_counter() - t0) * 1e3
    released = []
    for _ in range(iters):
        out = None  # nothing of the previous call is alive during this one
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        released.append((time.perf_counter() - t0) * 1e3)
    spin = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = spin_until_ready(fn())
        spin.append((time.perf_counter() - t0) * 1e3)
    idle = []
    for _ in range(iters if idle_s > 0 else 0):
        time.sleep(idle_s)  # the device idles too: its clock recovers from the power cap (README note 84)
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn())
        idle.append((time.perf_counter() - t0) * 1e3)
    del out
    return {
        "latency": times,
        "dispatch": dispatch,
        "pipelined": [pipelined],
        "pipelined_calls": [iters],
        "released": released,
        "spin": spin,
        **({"idle": idle} if idle else {}),
    }


def _summary(samples: dict[str, list[float]]) -> dict[str, float]:
    """:func:`time_call`'s statistics from (possibly merged) :func:`_time_samples`."""
    p10, med, p90 = np.percentile(samples["latency"], [10, 50, 90])
    return {
        "median_ms": float(med),
        "p10_ms": float(p10),
        "p90_ms": float(p90),
        "dispatch_ms": float(np.median(samples["dispatch"])),
        "pipelined_ms": sum(samples["pipelined"]) / sum(samples["pipelined_calls"]),
        "released_median_ms": float(np.median(samples["released"])),
        "spin_median_ms": float(np.median(samples["spin"])),
        **({"idle_median_ms": float(np.median(samples["idle"]))} if samples.get("idle") else {}),
        "iters": len(samples["latency"]),
    }


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """Sets the environment variables ``values`` for the ``with`` block (then restores them).

    The kernel choices (``DSPARK_JAX_*``) are read while a program is traced, so a program
    first called inside the block keeps the choices of the block.
    """
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def time_call(
    fn: Callable[[], Any], *, iters: int, warmup: int = 3, idle_s: float = 0.0, samples: bool = False
) -> dict[str, Any]:
    """Wall time (ms) of ``fn()``: each call alone, and back to back.

    Returns:
      ``median_ms``, ``p10_ms``, ``p90_ms`` over ``iters`` calls each waited for on its
      own (latency as a caller that needs the result sees it); ``dispatch_ms``, the
      median time until the call returns, before its result is ready (host work); and
      ``pipelined_ms``, the mean time per call over ``iters`` calls dispatched back to
      back with one wait at the end (host work overlapping device work, as in a serving
      loop that does not read every result at once); ``released_median_ms``, the median
      when the previous call's result is dropped before each call (a loop that frees each
      block once verified: XLA then need not update the program's CUDA graph for new output
      addresses); ``spin_median_ms``, the median when each call is waited for by polling
      (:func:`~dspark_jax.ready.spin_until_ready`, the way ``torch.cuda.synchronize`` waits
      by default) instead of ``jax.block_until_ready``; with ``idle_s`` > 0,
      ``idle_median_ms``, the median of calls each made after ``idle_s`` seconds of sleep (the
      device idle too, so that its clock is not held down by the board's power cap, README note
      84); ``iters``; with ``samples``, ``samples``: the raw wall times behind them
      (:func:`pool_samples` merges several processes' rows).
    """
    raw = _time_samples(fn, iters=iters, warmup=warmup, idle_s=idle_s)
    return {**_summary(raw), **({"samples": raw} if samples else {})}


def time_calls(
    calls: dict[Any, Callable[[], Any]], *, iters: int, rounds: int = 3, idle_s: float = 0.0, samples: bool = False
) -> dict[Any, dict[str, Any]]:
    """:func:`time_call` for several calls, interleaved so that drift hits them alike.

    Each of ``rounds`` rounds times every call in turn for ``⌈iters / rounds⌉`` calls of each
    of :func:`time_call`'s loops (3 warm-up calls in every round: the other calls'
    allocations may have made the CUDA graphs of this call's programs stale, and on the H200 a
    split round with twin programs updated them in its first 3 calls, README note 93), and the
    statistics come from all rounds' samples together. Why: on the H200 the same batch-128
    round measured 5.91 and 6.05 ms (greedy), 6.71 and 6.35 ms (mixed) a minute apart in one
    process, so modes timed one after the other compared drift as much as the modes.

    Returns:
      ``{name: time_call's dict}`` (with ``samples``, each with its raw wall times), ``iters``
      per call rounded up to a multiple of ``rounds``.
    """
    if rounds < 1 or iters < 1:
        raise ValueError(f"time_calls needs rounds >= 1 and iters >= 1, got rounds={rounds}, iters={iters}")
    per_round = -(-iters // rounds)
    merged: dict[Any, dict[str, list[float]]] = {name: {} for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            for key, values in _time_samples(fn, iters=per_round, warmup=3, idle_s=idle_s).items():
                merged[name].setdefault(key, []).extend(values)
    return {name: {**_summary(raw), **({"samples": raw} if samples else {})} for name, raw in merged.items()}


def pool_samples(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One process's timing rows with every process's raw samples pooled (``--processes``).

    Args:
      runs: per process, its :func:`bench_propose` rows (the same ``(batch, mode, path)``
        rows in each; the timed ones with their ``samples``).

    Returns:
      The first process's rows, each timed row's statistics recomputed over all processes'
      samples (:func:`time_call`'s keys), its ``samples`` dropped and ``processes`` added: per
      process its own ``median_ms``, ``dispatch_ms`` and ``pipelined_ms``.

    Raises:
      ValueError: a process lacks a row the first one has, or a timed row its samples.
    """
    pooled_rows = []
    for row in runs[0]:
        key = (row["batch"], row["mode"], row["path"])
        same = []
        for i, rows in enumerate(runs):
            match = [r for r in rows if (r["batch"], r["mode"], r["path"]) == key]
            if len(match) != 1:
                raise ValueError(f"process {i} has {len(match)} rows for batch, mode, path {key}: expected 1")
            same.append(match[0])
        if "median_ms" not in row:  # not timed (a failed path's row, say)
            pooled_rows.append(row)
            continue
        if any("samples" not in r for r in same):
            raise ValueError(f"the rows for batch, mode, path {key} lack their samples: time them with samples=True")
        pooled: dict[str, list[float]] = {}
        for r in same:
            for name, values in r["samples"].items():
                pooled.setdefault(name, []).extend(values)
        processes = [{k: r[k] for k in ("median_ms", "dispatch_ms", "pipelined_ms")} for r in same]
        rest = {k: v for k, v in row.items() if k != "samples"}
        pooled_rows.append({**rest, **_summary(pooled), "processes": processes})
    return pooled_rows


def measure_ceilings(nbytes: int, matmul_size: int, iters: int) -> dict[str, float]:
    """Measured memory bandwidth and bf16 matmul rate of the default device.

    ``elementwise``: a jitted ``x * 2 + 1`` over ``nbytes`` of float32 (bytes read plus
    written); ``copy``: a jitted device copy of the same buffer (read plus written);
    ``matmul``: an ``n×n×n`` bf16 product on random data; ``host``: how long a jitted
    ``x + 1`` over 8 floats takes from the call to its result being ready (median), and
    until the call returns: the host's share of every latency, which moves between hosts
    and runs (so each run's medians can be read against it); and the matmul's median waited
    for against its time back to back (``matmul_waited_ms``, ``matmul_pipelined_ms``): what a
    one-kernel program of about a draft round's device time pays on top of it when each call
    is waited for (README note 68).
    """
    n = nbytes // 4
    x = jax.jit(lambda k: jax.random.normal(k, (n,), jnp.float32))(jax.random.key(1))
    elementwise = jax.jit(lambda a: a * 2.0 + 1.0)
    copy = jax.jit(lambda a: jnp.copy(a))
    t_elem = time_call(lambda: elementwise(x), iters=iters)["pipelined_ms"]
    t_copy = time_call(lambda: copy(x), iters=iters)["pipelined_ms"]
    m = matmul_size
    ka, kb = jax.random.split(jax.random.key(2))
    a = jax.random.normal(ka, (m, m), jnp.bfloat16)
    b = jax.random.normal(kb, (m, m), jnp.bfloat16)
    matmul = jax.jit(lambda p, q: p @ q)
    mm = time_call(lambda: matmul(a, b), iters=iters)
    t_mm = mm["pipelined_ms"]
    tiny = jnp.zeros((8,), jnp.float32)
    trivial = jax.jit(lambda t: t + 1.0)
    host = time_call(lambda: trivial(tiny), iters=max(100, iters))
    return {
        "host_roundtrip_ms": host["median_ms"],
        "host_dispatch_ms": host["dispatch_ms"],
        "matmul_waited_ms": mm["median_ms"],
        "matmul_pipelined_ms": t_mm,
        "elementwise_bytes_per_s": 2 * nbytes / (t_elem * 1e-3),
        "copy_bytes_per_s": 2 * nbytes / (t_copy * 1e-3),
        "matmul_flops_per_s": 2 * m**3 / (t_mm * 1e-3),
        "buffer_bytes": nbytes,
        "matmul_size": m,
    }


def profile_kernels(fn: Callable[[], Any], *, iters: int, top: int = 80) -> dict[str, Any]:
    """Device time per kernel over ``iters`` calls, from a ``jax.profiler`` trace.

    The trace runs without the profiler's Python tracer: only device events are read, and
    the tracer slows the host's Python several-fold (README notes 65 and 82).

    Returns:
      ``{"calls", "device_busy_ms" (per call, summed over kernels), "launches_per_call",
      "kernels": [{name,
      ms_per_call, count_per_call}]}``, the kernels sorted by time; empty kernels when the
      backend records no device plane (the CPU).
    """
    jax.block_until_ready(fn())
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # device events only are read
    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp, profiler_options=options)
        for _ in range(iters):
            jax.block_until_ready(fn())
        jax.profiler.stop_trace()
        paths = [os.path.join(dp, f) for dp, _, fs in os.walk(tmp) for f in fs if f.endswith(".xplane.pb")]
        totals: dict[str, list[float]] = {}
        for path in paths:
            for plane in jax.profiler.ProfileData.from_file(path).planes:
                if not plane.name.startswith("/device:GPU"):
                    continue
                for line in plane.lines:
                    if not line.name.startswith("Stream"):
                        continue
                    for event in line.events:
                        acc = totals.setdefault(event.name, [0.0, 0])
                        acc[0] += event.duration_ns * 1e-6
                        acc[1] += 1
    kernels = sorted(totals.items(), key=lambda kv: -kv[1][0])
    return {
        "calls": iters,
        "device_busy_ms": sum(t for t, _ in totals.values()) / iters,
        "launches_per_call": sum(c for _, c in totals.values()) / iters,
        "kernels": [
            {"name": name[:120], "ms_per_call": t / iters, "count_per_call": c / iters}
            for name, (t, c) in kernels[:top]
        ],
    }


def profile_call(call: Callable[[], Any], iters: int) -> dict[str, Any]:
    """:func:`profile_kernels` over ``min(iters, 10)`` calls, or ``{"error": repr}`` when the
    profiler fails (a missing profiler must not stop the timing)."""
    try:
        return profile_kernels(call, iters=min(iters, 10))
    except Exception as err:  # noqa: BLE001
        return {"error": repr(err)}


# --------------------------------------------------------------------------- propose
def _inputs(cfg: DraftConfig, batch: int, context: int, capacity: int, seed: int) -> dict[str, Any]:
    key = jax.random.key(seed)
    k_cache, k_bonus = jax.random.split(key)
    return {
        "cache": random_context(cfg, batch, capacity, k_cache),
        "bonus": jax.random.randint(k_bonus, (batch,), 0, cfg.vocab_size, jnp.int32),
        "prefix_lens": jnp.full((batch,), context, jnp.int32),
    }


def _parity_note(row: dict[str, Any]) -> str:
    """The table's note on a row's differing tokens: the greedy rows' logit gap and the
    number of differing sampling rows, where known."""
    notes = [f"logit gap {row['tokens_logit_gap']:.3g} in greedy rows"] if "tokens_logit_gap" in row else []
    n = row.get("tokens_differ_sampling_rows", 0)
    notes += [f"{n} sampling row{'s' if n > 1 else ''}"] if n else []
    return f" ({'; '.join(notes)})" if notes else ""


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
    sample = _mode_sampling_rows(tokens.shape[0], mode)
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
        shared = _inputs(cfg, max(batches), context, capacity, seed=0)["cache"]  # the Proposer's slots
    key = jax.random.key(7)
    bandwidth = ceilings["elementwise_bytes_per_s"]
    rows, memory = [], []
    for batch in sorted(batches):
        inp = _inputs(cfg, batch, context, capacity, seed=batch)
        host = {k: np.asarray(inp[k]) for k in ("bonus", "prefix_lens")}
        mem_row: dict[str, Any] = {"batch": batch, "in_use_before_bytes": _memory_stat("bytes_in_use")}
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
        mem_row["peak_after_first_calls_bytes"] = _memory_stat("peak_bytes_in_use")
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
        mem_row["peak_after_timing_bytes"] = _memory_stat("peak_bytes_in_use")
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


def _memory_stat(name: str) -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get(name)


def _allocate(nbytes: int) -> jax.Array:
    return jax.block_until_ready(jnp.zeros((nbytes,), jnp.uint8))


MEMORY_REPEATS = 3
"""Rounds per mode whose programs' own peaks are measured (the least of each program counts)."""


def round_peaks(peaks: dict[str, list[int | None]], *, programs: int) -> dict[str, int | None]:
    """A round's peak from its programs' own peaks, and what folding sampling adds to it.

    ``peaks[mode]`` lists the own peak (:func:`_own_peak`) of each of the round's
    ``programs`` programs, round after round. Each program's least measurement counts: the
    device's allocator only ever adds to a request (it hands out a free block up to twice
    the size asked for, and counts all of it in use, when the rest is under 128 MiB), so the
    least is the nearest to what the program asks for. A round's peak is its largest
    program's (the programs run one after another; what passes between them is the same in
    both modes).

    Returns:
      ``{mode}_round_peak_bytes`` per mode and ``sampling_extra_bytes`` (None where a peak is
      unknown).
    """
    out: dict[str, int | None] = {}
    for mode, own in peaks.items():
        if not own or None in own or len(own) % programs:
            out[f"{mode}_round_peak_bytes"] = None
            continue
        least = [min(own[i::programs]) for i in range(programs)]
        out[f"{mode}_round_peak_bytes"] = max(least)
    pair = out.get("sampling_round_peak_bytes"), out.get("greedy_round_peak_bytes")
    out["sampling_extra_bytes"] = None if None in pair else pair[0] - pair[1]
    return out


def _own_peak(
    call: Callable[[], Any], ballast: list[Any], allocate: Callable[[int], Any] = _allocate
) -> tuple[int | None, list[Any]]:
    """How far one call raises the device's memory above what is in use when it starts.

    The device's ``peak_bytes_in_use`` never resets: an earlier, larger transient (building
    the draft, say) would hide the call's own peak. So ballast first fills the gap between
    the bytes in use and the peak; the peak then grows by the call's own need (plus any
    slack the allocator adds, see :func:`round_peaks`).

    Returns:
      The bytes (None where the backend reports no memory statistics; the call is made
      anyway) and the ballast kept (it must stay allocated while later calls are measured).
    """
    in_use, peak = _memory_stat("bytes_in_use"), _memory_stat("peak_bytes_in_use")
    if in_use is None or peak is None:
        jax.block_until_ready(call())
        return None, ballast
    if peak > in_use:
        ballast = [*ballast, allocate(peak - in_use)]
        in_use, peak = _memory_stat("bytes_in_use"), _memory_stat("peak_bytes_in_use")
    jax.block_until_ready(call())
    return _memory_stat("peak_bytes_in_use") - max(in_use, peak), ballast


# --------------------------------------------------------------------------- compile
@contextlib.contextmanager
def _cache_every_entry() -> Iterator[None]:
    """jax's persistent cache keeps every entry inside the block (the compile worker's
    setting), and the previous thresholds after it: a worker run in-process (the tests) must
    not change jax's configuration, which the executable store's keys include."""
    every = {"jax_persistent_cache_min_compile_time_secs": 0.0, "jax_persistent_cache_min_entry_size_bytes": 0}
    previous = {name: getattr(jax.config, name) for name in every}
    for name, value in every.items():
        jax.config.update(name, value)
    try:
        yield
    finally:
        for name, value in previous.items():
            jax.config.update(name, value)


def _compile_worker(shapes: BenchShapes, max_batch: int, *, workers: int, measure_memory: bool) -> dict[str, Any]:
    """Times :meth:`~dspark_jax.proposer.Proposer.precompile`; optionally measures peak memory.

    Runs in a fresh subprocess (see :func:`bench_compile`); the persistent compilation
    cache directory comes from ``JAX_COMPILATION_CACHE_DIR``. With one worker each
    (bucket, mode) executable is first built on its own (timed), then ``precompile()``
    adds what is left (the gate's refinement and the unpadding slicers); with more,
    ``precompile(workers=...)`` is timed as a whole. Without ``measure_memory`` the draft
    is abstract (``nnx.eval_shape``), so only compilation is measured.

    With ``measure_memory``, the draft has real random weights and, after
    ``precompile()``, one greedy and one all-sampling call at ``max_batch`` are run;
    the device's peak memory after each is compared with the gate's prediction.
    """
    from dspark_jax.packed_inputs import host_inputs
    from dspark_jax.proposer import Proposer

    with _cache_every_entry():
        cfg = draft_config(shapes)
        capacity = shapes.context + 2 * cfg.num_query_rows
        if measure_memory:
            draft = nnx.merge(*build_draft(cfg))
        else:
            draft = nnx.eval_shape(lambda: DSparkDraft(cfg, rngs=nnx.Rngs(0)))
        proposer = Proposer(draft, max_batch=max_batch, capacity=capacity, folded_sampling="force")
        buckets = []
        t_all = time.perf_counter()
        for bucket in proposer.buckets if workers == 1 else ():
            for sampling in (False, True):
                t0 = time.perf_counter()
                proposer._compile_folded(bucket, sampling)
                buckets.append({"batch": bucket, "fold_sampling": sampling, "seconds": time.perf_counter() - t0})
        t0 = time.perf_counter()
        gate = proposer.precompile(workers=workers)
        rest = time.perf_counter() - t0
        out = {
            "workers": workers,
            "buckets": buckets,
            "rest_seconds": rest,
            "total_seconds": time.perf_counter() - t_all,
            # programs loaded from / saved to the executable store (traced, lowered and compiled: none / all)
            "store": None if proposer.store is None else {"hits": proposer.store.hits, "saves": proposer.store.saves},
            "gate": {
                "closed_form_bytes": gate.closed_form_bytes,
                "compiled_bytes": gate.compiled_bytes,
                "needed_bytes": gate.needed_bytes,
                "enabled": gate.enabled,
            },
        }
        if measure_memory:
            inp = _inputs(cfg, max_batch, shapes.context, capacity, seed=0)
            host = {k: np.asarray(inp[k]) for k in ("bonus", "prefix_lens")}
            key = jax.random.key(0)
            jax.block_until_ready(inp["cache"])
            out["memory"] = {"batch": max_batch, "in_use_before_bytes": _memory_stat("bytes_in_use")}
            ballast, peaks = [], {}

            def measured(mode: str, program: Callable[..., Any], *args: Any) -> Any:
                nonlocal ballast
                result = []
                own, ballast = _own_peak(lambda: result.append(program(*args)) or result[0], ballast)
                peaks.setdefault(mode, []).append(own)
                return result[0]

            for _ in range(MEMORY_REPEATS):
                for mode in ("greedy", "sampling"):
                    temps, top_k = (np.asarray(a) for a in sampling_params(max_batch, mode))
                    _, ints, temps = host_inputs(host["bonus"], host["prefix_lens"], temps, top_k, None)
                    packed, packed_key = proposer._pack_inputs(max_batch, ints, temps, key)
                    run = functools.partial(measured, mode)
                    proposer._folded_round(max_batch, inp["cache"], packed, packed_key, mode == "sampling", run=run)
            out["memory"] |= {f"{mode}_program_peaks_bytes": own for mode, own in peaks.items()}
            out["memory"] |= round_peaks(peaks, programs=len(proposer._split.ranges) + 1)
        return out


def _gate_error(predicted: int, mem: dict[str, Any]) -> str:
    """The gate's prediction against the measured growth of the peak, as a signed percentage."""
    measured = mem["sampling_extra_bytes"]
    if measured <= 0:
        return "measured growth 0"
    return f"{100 * (predicted / measured - 1):+.1f} % of the measured"


def bench_compile(shapes: BenchShapes, max_batch: int, cache_dir: str, workers: int = 1) -> dict[str, Any]:
    """Precompile time of every bucket and mode, cold and from the persistent cache (jax's
    and, inside it, the :class:`~dspark_jax.executable_store.ExecutableStore`).

    Runs :func:`_compile_worker` twice in fresh subprocesses sharing the persistent
    compilation cache ``cache_dir`` (empty at the start): the first run fills it, the
    second reads it and then measures peak memory against the gate's prediction.
    ``workers`` programs compile at once (``Proposer.precompile(workers=...)``).
    """
    env = dict(os.environ, JAX_COMPILATION_CACHE_DIR=cache_dir, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    cmd = [sys.executable, "-m", "dspark_jax.bench", "--compile-worker", "--shapes", shapes.name]
    cmd += ["--max-batch", str(max_batch), "--compile-workers", str(workers)]
    out = {}
    for run, extra in (("cold", []), ("cached", ["--measure-memory"])):
        t0 = time.perf_counter()
        proc = subprocess.run(cmd + extra, env=env, capture_output=True, text=True, check=False)
        wall = time.perf_counter() - t0
        if proc.returncode:
            out[run] = {"error": proc.stderr[-3000:]}
            continue
        out[run] = {**json.loads(proc.stdout.strip().splitlines()[-1]), "process_seconds": wall}
    return out


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


# --------------------------------------------------------------------------- end to end
def forced_accept_probs(mean_accepted: float, gamma: int) -> np.ndarray:
    """A fixed distribution of ``correct_len`` over ``0..γ`` with mean ``mean_accepted − 1``.

    ``P(c) ∝ exp(λ·c)`` with ``λ`` found by bisection; ``mean_accepted`` counts the bonus
    token, like the paper's τ.

    Returns:
      ``[γ + 1]`` float64 probabilities.
    """
    want = mean_accepted - 1.0
    if not 0.0 < want < gamma:
        raise ValueError(f"tau={mean_accepted!r} is invalid: must lie strictly between 1 and gamma + 1 = {gamma + 1}")
    c = np.arange(gamma + 1, dtype=np.float64)

    def probs(lam):
        w = np.exp(lam * c - np.max(lam * c))
        return w / w.sum()

    lo, hi = -60.0, 60.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if probs(mid) @ c < want else (lo, mid)
    return probs(0.5 * (lo + hi))


def _spec_round(t_graphdef, t_state, d_graphdef, d_state, kv, ctx, bonus, prefix_lens, key, accept_probs):
    """Greedy propose → verify → forced accept → commit, one compiled round."""
    from dspark_jax.proposal import propose

    target = nnx.merge(t_graphdef, t_state)
    draft = nnx.merge(d_graphdef, d_state)
    cfg = draft.cfg
    batch = bonus.shape[0]
    k_prop, k_acc = jax.random.split(key)
    zeros = jnp.zeros((batch,), jnp.float32)
    ones = jnp.ones((batch,), jnp.int32)
    block = propose(d_graphdef, d_state, ctx, bonus, prefix_lens, zeros, ones, k_prop, fold_sampling=False)
    tokens = jnp.concatenate([bonus[:, None], block.draft_tokens], axis=1)  # [B, T]
    positions = prefix_lens[:, None] + jnp.arange(cfg.gamma + 1, dtype=jnp.int32)  # [B, T]
    logits, features, kv = target(tokens, positions, kv, feature_layers=cfg.target_layer_ids)
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    # Benchmark only: accepted lengths drawn from a fixed distribution, not from pred.
    correct = jax.random.choice(k_acc, cfg.gamma + 1, (batch,), p=accept_probs).astype(jnp.int32)
    new_bonus = jnp.take_along_axis(pred, correct[:, None], axis=1)[:, 0]
    ctx = fill_context(draft, ctx, features, prefix_lens, correct + 1)
    return kv, ctx, new_bonus, prefix_lens + correct + 1, correct


def _plain_step(graphdef, state, kv, tokens, positions):
    """One greedy decode step of the target: ``[B]`` tokens at ``[B]`` positions."""
    target = nnx.merge(graphdef, state)
    logits, _, kv = target(tokens[:, None], positions[:, None], kv)
    return kv, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), positions + 1


def _verify(graphdef, state, kv, tokens, positions, feature_layers):
    target = nnx.merge(graphdef, state)
    logits, features, kv = target(tokens, positions, kv, feature_layers=feature_layers)
    return kv, logits, features


def bench_e2e(
    shapes: BenchShapes, *, target_layers: int, tau: float, rounds: int, seed: int = 0, batch: int = 1
) -> dict[str, Any]:
    """Plain against speculative decoding with accepted lengths forced to mean ``tau``.

    Both decode greedily from a ``context``-token prefix held in random caches; every
    step or round is waited for before the next (as a server streaming tokens does).
    The ideal speed-up from measured parts is ``τ · t_plain_step / (t_propose + t_verify)``.
    """
    from dspark_jax.proposal import propose

    dcfg = draft_config(shapes)
    tcfg = target_config(shapes, target_layers)
    if tcfg.num_hidden_layers <= dcfg.target_layer_ids[-1]:
        dcfg = dataclasses.replace(
            dcfg,
            target_layer_ids=tuple(np.linspace(0, tcfg.num_hidden_layers - 1, dcfg.num_fused_layers).astype(int)),
            num_target_layers=tcfg.num_hidden_layers,
        )
    target = Qwen3Target(tcfg, rngs=nnx.Rngs(seed))
    t_graphdef, t_state = nnx.split(target)
    d_graphdef, d_state = build_draft(dcfg, seed + 1, embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    t = dcfg.gamma + 1
    context = shapes.context
    capacity = context + (rounds + 8) * t
    keys = jax.random.split(jax.random.key(seed + 2), 4)
    kv_shape = (tcfg.num_hidden_layers, batch, capacity, tcfg.num_key_value_heads, tcfg.head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, kv_shape, tcfg.jnp_dtype))
    start = jnp.full((batch,), context, jnp.int32)
    first = jax.random.randint(keys[2], (batch,), 0, tcfg.vocab_size, jnp.int32)
    probs = jnp.asarray(forced_accept_probs(tau, dcfg.gamma), jnp.float32)

    # Plain decoding.
    plain, t_leaves = jit_split(_plain_step, t_graphdef, t_state, donate_argnums=1)
    kv = KVCache(k=make(keys[0]), v=make(keys[1]))
    tok, pos = first, start
    plain_ms = []
    for i in range(rounds * 2 + 3):
        t0 = time.perf_counter()
        kv, tok, pos = jax.block_until_ready(plain(t_leaves, kv, tok, pos))
        if i >= 3:
            plain_ms.append((time.perf_counter() - t0) * 1e3)

    # The parts: greedy propose and the γ + 1 verify forward, each alone.
    ctx = random_context(dcfg, batch, capacity, keys[3])
    folded, d_leaves = jit_split(propose, d_graphdef, d_state, static_argnames="fold_sampling")
    zeros, ones = jnp.zeros((batch,), jnp.float32), jnp.ones((batch,), jnp.int32)
    t_propose = time_call(
        lambda: folded(d_leaves, ctx, first, start, zeros, ones, keys[0], fold_sampling=False), iters=rounds
    )["median_ms"]
    verify, _ = jit_split(_verify, t_graphdef, t_state, static_argnums=4, donate_argnums=1)
    vtokens = jnp.broadcast_to(first[:, None], (batch, t))
    vpos = start[:, None] + jnp.arange(t, dtype=jnp.int32)
    verify_ms = []
    for i in range(rounds + 3):
        t0 = time.perf_counter()
        kv, *_ = jax.block_until_ready(verify(t_leaves, kv, vtokens, vpos, dcfg.target_layer_ids))
        if i >= 3:
            verify_ms.append((time.perf_counter() - t0) * 1e3)
    t_verify = float(np.median(verify_ms))

    # Speculative decoding: one compiled round, both graphdefs closed over.
    d_tree = jax.tree.structure(d_state)
    t_tree = jax.tree.structure(t_state)

    def round_fn(t_leaves, d_leaves, *args):
        t_st, d_st = jax.tree.unflatten(t_tree, t_leaves), jax.tree.unflatten(d_tree, d_leaves)
        return _spec_round(t_graphdef, t_st, d_graphdef, d_st, *args)

    spec = jax.jit(round_fn, donate_argnums=(2, 3))
    bonus, prefix = first, start
    round_ms, accepted = [], []
    round_keys = list(jax.random.split(jax.random.key(seed + 3), rounds + 3))
    for i in range(rounds + 3):
        t0 = time.perf_counter()
        kv, ctx, bonus, prefix, correct = jax.block_until_ready(
            spec(t_leaves, d_leaves, kv, ctx, bonus, prefix, round_keys[i], probs)
        )
        if i >= 3:
            round_ms.append((time.perf_counter() - t0) * 1e3)
            accepted.append(np.asarray(correct) + 1)
    t_plain = float(np.median(plain_ms))
    tau_measured = float(np.mean(accepted))
    plain_tps = batch * 1e3 / float(np.mean(plain_ms))
    spec_tps = float(np.sum(accepted)) * 1e3 / float(np.sum(round_ms))
    ideal = tau_measured * t_plain / (t_propose + t_verify)
    achieved = spec_tps / plain_tps
    return {
        "batch": batch,
        "target_layers": tcfg.num_hidden_layers,
        "context": context,
        "rounds": rounds,
        "tau_forced_mean": tau,
        "tau_measured": tau_measured,
        "plain_step_ms": t_plain,
        "propose_ms": t_propose,
        "verify_ms": t_verify,
        "round_ms": float(np.median(round_ms)),
        "plain_tokens_per_s": plain_tps,
        "spec_tokens_per_s": spec_tps,
        "speedup": achieved,
        "ideal_speedup": ideal,
        "fraction_of_ideal": achieved / ideal,
    }


# --------------------------------------------------------------------------- report
def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _process_range(row: dict[str, Any]) -> str:
    """``lo–hi`` of a pooled row's per-process medians (``-`` for a row timed in one process)."""
    medians = [p["median_ms"] for p in row.get("processes", [])]
    return f"{min(medians):.3f}–{max(medians):.3f}" if medians else "-"


def _board_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per batch on what the GPU board did while that batch was timed (rows' ``board``)."""
    lines, seen = [], set()
    for r in rows:
        board = r.get("board")
        if board is None or r["batch"] in seen:
            continue
        seen.add(r["batch"])
        limit = f" of its {board['power_limit_w']:.0f} W limit" if board.get("power_limit_w") else ""
        slowdowns = "".join(
            f", {name} in {board[key]:.0%}"
            for key, name in (("thermal_share", "thermal slowdown"), ("hw_slowdown_share", "hardware slowdown"))
            if board.get(key)
        )
        lines.append(
            f"board while batch {r['batch']} was timed: SM clock median {board['sm_clock_mhz_median']:.0f} MHz "
            f"(p10 {board['sm_clock_mhz_p10']:.0f}), power median {board['power_w_median']:.0f} W{limit}, "
            f"held at the power cap in {board['power_capped_share']:.0%} of {board['samples']} samples{slowdowns}"
        )
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The printed summary of a :func:`main` result."""
    lines = []
    ceil = result.get("ceilings")
    if ceil:
        lines.append(
            f"ceilings: elementwise {ceil['elementwise_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s "
            "(floor = max(bytes / elementwise bandwidth, FLOPs / matmul rate); floor_copy uses the copy bandwidth)"
        )
        if "host_roundtrip_ms" in ceil:
            lines.append(
                f"host: a trivial jitted op is ready {ceil['host_roundtrip_ms']:.3f} ms after the call "
                f"(the call returns after {ceil['host_dispatch_ms']:.3f} ms)"
            )
        if "matmul_waited_ms" in ceil:
            lines.append(
                f"host: the {ceil['matmul_size']}³ product, one kernel, is ready {ceil['matmul_waited_ms']:.3f} ms "
                f"after the call and takes {ceil['matmul_pipelined_ms']:.3f} ms per call back to back: "
                f"{ceil['matmul_waited_ms'] - ceil['matmul_pipelined_ms']:+.3f} ms waited"
            )
    meta = result.get("meta", {})
    if meta.get("awake_spinners"):
        lines.append(f"host: timed with {meta['awake_spinners']} spinners at nice 19 keeping the CPUs awake (--awake)")
    if meta.get("processes", 1) > 1:
        lines.append(
            f"timed in {meta['processes']} fresh processes one after another, every call's samples pooled "
            "(--processes; each process's own medians: the JSON rows' processes)"
        )
    if "attention" in meta:
        kernel = "fused Pallas kernel" if meta.get("attention_kernel") else "XLA"
        lines.append(f"draft context attention: {kernel} ({ATTENTION_ENV}={meta['attention']})")
    if "race" in meta:
        race = "race Pallas kernel per step" if meta.get("race_kernel") else "XLA"
        on = meta.get("tile_race_kernel") or []
        kernel = f"two tiled Pallas kernels per step at batches {on}, {race} at the others" if on else race
        choices = f"{TILE_RACE_ENV}={meta.get('tile_race', '-')}, {RACE_ENV}={meta['race']}"
        lines.append(f"folded walk's sampling step: {kernel} ({choices})")
    if "greedy" in meta:
        on = meta.get("greedy_kernel") or []
        kernel = f"two Pallas kernels per step at batches {on}, XLA at the others" if on else "XLA"
        lines.append(f"greedy-only walk's step: {kernel} ({GREEDY_ENV}={meta['greedy']})")
    if "mlp" in meta:
        on = meta.get("mlp_kernel") or []
        kernel = f"one Pallas kernel per layer at batches {on}, XLA at the others" if on else "XLA"
        lines.append(f"draft MLP's gate/up projections and SwiGLU: {kernel} ({MLP_ENV}={meta['mlp']})")
    if "backbone_gemm" in meta:
        on = meta.get("backbone_cublas") or []
        gemms = f"cuBLAS at batches {on}, XLA's choice at the others" if on else "XLA's choice"
        lines.append(f"split round's backbone GEMMs: {gemms} ({BACKBONE_GEMM_ENV}={meta['backbone_gemm']})")
    torch_rows = {(r["batch"], r["mode"], r["path"]): r["median_ms"] for r in result.get("torch", {}).get("rows", [])}
    width = max([15] + [len(r["path"]) for r in result.get("propose", [])])  # the path column
    pooled = any("processes" in r for r in result.get("propose", []))  # --processes: their medians' range
    header = (
        f"{'batch':>5} {'mode':<8} {'path':<{width}} {'median':>8} {'p90':>8} {'dispatch':>8} {'pipelined':>9} "
        f"{'released':>8} {'spin':>7} {'idle':>7} "
        f"{'floor':>7} {'bound':<5} {'x floor':>7} {'floor_copy':>10} {'torch eager':>11} {'torch graph':>11} "
        f"{'graph/jax':>9} {'graph/spin':>10}" + (f" {'per process':>13}" if pooled else "")
    )
    lines += [
        "propose latency, ms: median and p90 of calls waited for one by one; dispatch = host time per call; "
        "pipelined = per call when dispatched back to back; released = median when the previous result is "
        "dropped before each call; spin = median when each call is waited for by polling, as "
        "torch.cuda.synchronize waits (graph/spin compares the two on that footing); idle = median when the "
        "device idles --idle-ms before each call (its clock not held down by the board's power cap)"
        + ("; per process = the range of the timing processes' own medians (--processes)" if pooled else ""),
        header,
        "-" * len(header),
    ]
    for r in result.get("propose", []):
        key = (r["batch"], r["mode"])
        # PyTorch runs a greedy-only program for greedy batches, the full one otherwise.
        paired = r["path"] in (("folded_greedy", "split_greedy") if r["mode"] == "greedy" else ("folded", "split"))
        graph = torch_rows.get((*key, "graph")) if paired else None
        lines.append(
            f"{r['batch']:>5} {r['mode']:<8} {r['path']:<{width}} {r['median_ms']:>8.3f} {r['p90_ms']:>8.3f} "
            f"{r['dispatch_ms']:>8.3f} {r['pipelined_ms']:>9.3f} {_fmt(r.get('released_median_ms')):>8} "
            f"{_fmt(r.get('spin_median_ms')):>7} {_fmt(r.get('idle_median_ms')):>7} "
            f"{_fmt(r.get('floor_ms')):>7} "
            f"{r.get('floor_bound', '-'):<5} "
            f"{_fmt(r['median_ms'] / r['floor_ms'] if r.get('floor_ms') else None, '.2f'):>7} "
            f"{_fmt(r.get('floor_copy_ms')):>10} "
            f"{_fmt(torch_rows.get((*key, 'eager')) if paired else None):>11} "
            f"{_fmt(graph):>11} {_fmt(graph / r['median_ms'] if graph else None, '.2f'):>9} "
            f"{_fmt(graph / r['spin_median_ms'] if graph and r.get('spin_median_ms') else None, '.2f'):>10}"
            + (f" {_process_range(r):>13}" if pooled else "")
        )
    lines += _board_lines(result.get("propose", []))
    compared = [r for r in result.get("propose", []) if r.get("tokens_compared")]
    differing = [r for r in compared if r["tokens_differ"]]
    if differing:
        lines.append(
            "draft tokens DIFFER from the first path of the same batch and mode (same inputs and key): "
            + "; ".join(
                f"batch {r['batch']} {r['mode']} {r['path']}: {r['tokens_differ']} of {r['tokens_compared']} "
                f"against {r['tokens_reference']}" + _parity_note(r)
                for r in differing
            )
        )
        if any("tokens_logit_gap" in r for r in differing):
            lines.append(
                "  logit gap: the largest |logit(own token) - logit(reference's token)| in the path's own corrected "
                "logits at each differing greedy row's first differing step (about one bf16 step: a near-tie)"
            )
        if any("tokens_differ_sampling_rows" in r for r in differing):
            lines.append(
                "  sampling rows: each token wins the race of its logits and its noise, so the logits alone cannot "
                "tell a near-tie from a disagreement"
            )
    elif compared:
        lines.append(
            f"draft tokens: every path picks the same tokens as the first path of its batch and mode "
            f"(same inputs and key; {len(compared)} rows)"
        )
    if "error" in result.get("torch", {}):
        lines.append(f"torch baseline failed: {result['torch']['error'].strip().splitlines()[-1]}")
    comp = result.get("compile")
    if comp:
        for run in ("cold", "cached"):
            c = comp.get(run, {})
            if "error" in c:
                lines.append(f"precompile ({run}): failed: {c['error'].strip().splitlines()[-1]}")
            elif c:
                per = ", ".join(
                    f"{b['batch']}{'s' if b['fold_sampling'] else 'g'} {b['seconds']:.1f}" for b in c["buckets"]
                )
                per = f"per bucket, s = sampling folded, g = greedy-only: {per}; the rest" if per else "precompile()"
                store = c.get("store")
                store = f"; executable store: {store['hits']} loaded, {store['saves']} saved" if store else ""
                lines.append(
                    f"precompile ({run}, {c.get('workers', 1)} worker(s)): {c['total_seconds']:.1f} s "
                    f"(process {c['process_seconds']:.1f} s); {per} {c['rest_seconds']:.1f} s{store}"
                )
        mem = comp.get("cached", {}).get("memory")
        if mem and mem.get("sampling_extra_bytes") is not None:
            gate = comp["cached"]["gate"]
            lines.append(
                f"memory gate at batch {mem['batch']}: folded sampling adds {mem['sampling_extra_bytes'] / 1e9:.3f} GB "
                f"to the measured peak (the largest own peak of a round's programs, each the least of "
                f"{MEMORY_REPEATS} rounds: greedy "
                f"{_gb(mem['greedy_round_peak_bytes']):.3f} GB, "
                f"sampling {_gb(mem['sampling_round_peak_bytes']):.3f} GB; "
                f"in use before {_gb(mem['in_use_before_bytes']):.2f} GB); "
                f"gate predicts {_gb(gate['needed_bytes']):.3f} GB ({_gate_error(gate['needed_bytes'], mem)}; "
                f"closed form {_gb(gate['closed_form_bytes']):.3f} GB, XLA's estimate "
                f"{_fmt(_gb(gate['compiled_bytes']))} GB)"
            )
    for m in result.get("memory", []):
        peaks = [v for k, v in m.items() if k.startswith("peak_after_") and v is not None]
        lines.append(
            f"memory batch {m['batch']}: in use before {_fmt(_gb(m.get('in_use_before_bytes')), '.2f')} GB, "
            f"device peak after it {_fmt(_gb(max(peaks)) if peaks else None, '.2f')} GB"
        )
    if result.get("walk"):
        from dspark_jax.bench_walk import format_walk  # it imports this module

        lines.extend(format_walk(result["walk"]))
    e2e = result.get("e2e")
    if e2e and "error" in e2e:
        lines.append(f"e2e failed: {e2e['error']}")
    elif e2e:
        lines.append(
            f"e2e batch {e2e['batch']} ({e2e['target_layers']}-layer target, context {e2e['context']}): "
            f"plain {e2e['plain_tokens_per_s']:.1f} tok/s ({e2e['plain_step_ms']:.2f} ms/step), "
            f"speculative {e2e['spec_tokens_per_s']:.1f} tok/s ({e2e['round_ms']:.2f} ms/round, "
            f"tau {e2e['tau_measured']:.2f}); speed-up {e2e['speedup']:.2f}x against ideal "
            f"{e2e['ideal_speedup']:.2f}x (propose {e2e['propose_ms']:.2f} + verify {e2e['verify_ms']:.2f} ms) "
            f"= {100 * e2e['fraction_of_ideal']:.0f}% of ideal"
        )
    return "\n".join(lines)


def _gb(value: int | None) -> float | None:
    return None if value is None else value / 1e9


# --------------------------------------------------------------------------- command line
def _batches(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batches={text!r} is invalid: expected comma-separated integers") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--batches={text!r} is invalid: every batch must be >= 1")
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


def _choices(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    def parse(text: str) -> tuple[str, ...]:
        values = tuple(v for v in text.split(",") if v)
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r} is invalid: expected a comma-separated subset of {allowed}")
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
    parser.add_argument("--tau", type=float, default=6.17, help="forced mean accepted length in --e2e")
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
    parser.add_argument("--compile-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--measure-memory", action="store_true", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark described by parsed ``args``; prints the table, writes JSON."""
    if args.xla_flags:
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {args.xla_flags}".strip()
    for flag, _, variable, _ in ENV_FLAGS:
        if getattr(args, flag):
            os.environ[variable] = getattr(args, flag)  # the compile subprocesses inherit it
    shapes = SHAPES[args.shapes]
    batches = args.batches or shapes.batches
    iters = args.iters or shapes.iters
    eager_iters = max(2, iters // 10) if args.eager_iters is None else args.eager_iters
    for name, value in (
        ("--iters", iters),
        ("--max-batch", args.max_batch or 1),
        ("--compile-workers", args.compile_workers),
        ("--processes", args.processes),
    ):
        if value < 1:
            raise ValueError(f"{name}={value} is invalid: must be >= 1")
    if not 0 <= args.idle_ms <= 1000:
        raise ValueError(f"--idle-ms={args.idle_ms} is invalid: must be in [0, 1000] milliseconds")
    for name in ("cuts", "versus"):
        if getattr(args, name) and not {"split_greedy", "split"} & set(args.paths):
            raise ValueError(f"--{name} times the split paths: add split_greedy or split to --paths, or drop --{name}")
    if args.race_tunings and not args.walk:
        raise ValueError("--race-tunings is only used with --walk: add --walk, or drop --race-tunings")
    if args.timing_child is not None:  # one of --processes' timing processes
        return _timing_child(args, shapes, batches, iters, eager_iters)
    if args.compile_worker:
        worker = _compile_worker(
            shapes, args.max_batch or max(batches), workers=args.compile_workers, measure_memory=args.measure_memory
        )
        print(json.dumps(worker))
        return 0
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
    return 0


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
        from dspark_jax.bench_walk import bench_walk  # it imports this module

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


if __name__ == "__main__":
    raise SystemExit(main())
