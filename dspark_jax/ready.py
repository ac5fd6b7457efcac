"""Waiting for a result by polling instead of blocking.

``jax.block_until_ready`` sleeps until the runtime wakes the calling thread.
:func:`spin_until_ready` polls ``jax.Array.is_ready`` on the calling thread instead,
burning one CPU core while it waits, which is how ``torch.cuda.synchronize`` waits by
default (CUDA's automatic schedule spins when the process has fewer contexts than CPU
cores). The benchmark times both waits so that its PyTorch comparison can be read on the
same footing. Measured on the H200 host (split round, 8B draft, 2026-11-29): a scratch A/B
saw the spin-waited batch-1 median 0.05–0.15 ms lower, but in the two benchmark runs that
followed it was within ±0.2 ms of the blocking wait and not consistently lower: polling keeps
one CPU awake, but the runtime's own threads (the completion, the next dispatch) still run on
CPUs that halt while the device works. :class:`dspark_jax.CpuAwake` keeps all of them awake,
which took the batch-1 median from 1.37 to 1.18 ms (README note 74). A loop that hands the
result to the next device computation needs no wait at all.
"""

from __future__ import annotations

import time
from typing import Any

import jax

from dspark_jax.config import is_real


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
      ValueError: ``timeout_s`` is not None or a number > 0 (a Python or NumPy real; not a bool,
        not NaN).
      TimeoutError: the arrays were not ready within ``timeout_s``.
    """
    if timeout_s is not None:
        if not is_real(timeout_s) or not timeout_s > 0:
            raise ValueError(
                f"timeout_s={timeout_s!r} (type {type(timeout_s).__name__}) is invalid: must be None or a number "
                "of seconds > 0 (a Python or NumPy real)"
            )
        timeout_s = float(timeout_s)
    deadline = None if timeout_s is None else time.perf_counter() + timeout_s
    for leaf in jax.tree.leaves(tree):
        if not isinstance(leaf, jax.Array):
            continue
        while not leaf.is_ready():
            if deadline is not None and time.perf_counter() > deadline:
                raise TimeoutError(f"an array of shape {leaf.shape} was not ready after {timeout_s} s")
    return jax.block_until_ready(tree)
