"""Precompile time of every bucket and mode, cold and from the persistent cache, and the
round's peak device memory against the memory gate's prediction (``dspark-jax bench``'s
compile stage, run in fresh subprocesses: ``python -m dspark_jax.bench_compile``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.bench_workload import SHAPES, BenchShapes, build_draft, draft_config, random_inputs, sampling_params
from dspark_jax.draft import DSparkDraft


def memory_stat(name: str) -> int | None:
    """The first device's memory statistic ``name`` (``"bytes_in_use"``, ``"peak_bytes_in_use"``:
    bytes), or ``None`` where the backend does not report it (CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get(name)


def _allocate(nbytes: int) -> jax.Array:
    return jax.block_until_ready(jnp.zeros((nbytes,), jnp.uint8))


MEMORY_REPEATS = 3
"""Rounds per mode whose programs' own peaks are measured (the least of each program counts)."""


def round_peaks(peaks: dict[str, list[int | None]], *, programs: int) -> dict[str, int | None]:
    """A round's peak from its programs' own peaks, and what folding sampling adds to it.

    ``peaks[mode]`` lists the own peak (:func:`own_peak`) of each of the round's
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


def own_peak(
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
    in_use, peak = memory_stat("bytes_in_use"), memory_stat("peak_bytes_in_use")
    if in_use is None or peak is None:
        jax.block_until_ready(call())
        return None, ballast
    if peak > in_use:
        ballast = [*ballast, allocate(peak - in_use)]
        in_use, peak = memory_stat("bytes_in_use"), memory_stat("peak_bytes_in_use")
    jax.block_until_ready(call())
    return memory_stat("peak_bytes_in_use") - max(in_use, peak), ballast


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
            inp = random_inputs(cfg, max_batch, shapes.context, capacity, seed=0)
            host = {k: np.asarray(inp[k]) for k in ("bonus", "prefix_lens")}
            key = jax.random.key(0)
            jax.block_until_ready(inp["cache"])
            out["memory"] = {"batch": max_batch, "in_use_before_bytes": memory_stat("bytes_in_use")}
            ballast, peaks = [], {}

            def measured(mode: str, program: Callable[..., Any], *args: Any) -> Any:
                nonlocal ballast
                result = []
                own, ballast = own_peak(lambda: result.append(program(*args)) or result[0], ballast)
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


def gate_error(predicted: int, mem: dict[str, Any]) -> str:
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
    cmd = [sys.executable, "-m", "dspark_jax.bench_compile", "--shapes", shapes.name]
    cmd += ["--max-batch", str(max_batch), "--workers", str(workers)]
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


def main(argv: list[str] | None = None) -> int:
    """One precompile run (:func:`_compile_worker`) for :func:`bench_compile`; prints its JSON."""
    parser = argparse.ArgumentParser(prog="python -m dspark_jax.bench_compile", description=main.__doc__)
    parser.add_argument("--shapes", choices=sorted(SHAPES), required=True)
    parser.add_argument("--max-batch", type=int, required=True)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--measure-memory", action="store_true")
    args = parser.parse_args(argv)
    out = _compile_worker(SHAPES[args.shapes], args.max_batch, workers=args.workers, measure_memory=args.measure_memory)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
