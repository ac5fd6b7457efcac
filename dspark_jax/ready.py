"""Waiting for a result by polling instead of blocking.

``jax.block_until_ready`` sleeps until the runtime wakes the calling thread; on the H200
host that wake-up added about 0.05–0.15 ms to a batch-1 round's measured latency (split
round, `scratch`-style A/B, 2026-11-29). :func:`spin_until_ready` polls
``jax.Array.is_ready`` on the calling thread instead, burning one CPU core while it waits,
which is what ``torch.cuda.synchronize`` does by default (CUDA's automatic schedule spins
when the process has fewer contexts than CPU cores). A loop that needs every result on the
host as soon as the device has it (a latency benchmark, a host-driven decode loop) may use
it; a loop that hands the result to the next device computation needs no wait at all.
"""

from __future__ import annotations

import time
from typing import Any

import jax


def spin_until_ready(tree: Any, *, timeout_s: float | None = None) -> Any:
    """Polls until every array in ``tree`` is ready, then returns ``tree``.

    Errors of the computation surface as with ``jax.block_until_ready`` (which is called
    once at the end and returns at once).

    Args:
      tree: a pytree; leaves that are not ``jax.Array`` are ignored.
      timeout_s: give up after this many seconds (default: wait as long as it takes).

    Returns:
      ``tree``.

    Raises:
      ValueError: ``timeout_s`` is not a positive number.
      TimeoutError: the arrays were not ready within ``timeout_s``.
    """
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0
    ):
        raise ValueError(f"timeout_s={timeout_s!r} is invalid: must be a positive number of seconds or None")
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        while not leaf.is_ready():
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError(f"an array of shape {leaf.shape} was not ready after {timeout_s} s")
    return jax.block_until_ready(tree)
