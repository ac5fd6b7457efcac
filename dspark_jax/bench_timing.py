"""How ``dspark-jax bench`` times a call: waited for one by one, back to back, released,
polled and after idle (:func:`time_call`); several calls interleaved (:func:`time_calls`);
samples pooled over processes (:func:`pool_samples`); the device's ceilings
(:func:`measure_ceilings`) and its time per kernel (:func:`profile_kernels`).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.ready import spin_until_ready


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
      runs: per process, its :func:`dspark_jax.bench.bench_propose` rows (the same ``(batch, mode, path)``
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
