"""Keeping the host's CPUs from halting while the device works, so that a waited call ends sooner.

On a virtual machine, a CPU with nothing to run halts, and the hypervisor may then take the
virtual CPU off its physical core; waking it again (when the GPU's completion arrives, or the
next call's dispatch starts) costs tens to hundreds of microseconds. On the H200 hosts this
project measures on, a jitted bf16 product of ~1 ms device time was ready 0.21–0.43 ms after
its device time when each call was waited for (README notes 68 and 74), and the split draft
round paid the same. With a spinner of the lowest priority on every CPU, none of them halts
and the same product was ready within 0.02 ms of it (README note 74; +0.12 ms on one machine).

:class:`CpuAwake` starts those spinners: one process per CPU the caller may run on, each
pinned to its CPU at nice 19 (it yields to any other work there at once) and looping until
stopped or until its parent exits. They cost a CPU core each while they run, and nothing on
the device. Use them on a host dedicated to serving, around the latency-critical loop::

    from dspark_jax import CpuAwake

    with CpuAwake():
        block = split(cache, bonus, prefix_lens, temps, top_k, key, fold_sampling=False)

``dspark-jax bench --awake`` times everything (PyTorch included) with them running.

Not for a container whose CPU time is capped by a quota (cgroup ``cpu.max``) rather than by
its CPU set: the spinners would spend the quota, and the scheduler then throttles the caller
too. Nice levels order tasks within a CPU, not against a quota.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

SPINNER_NICE = 19
"""The spinners' niceness (the lowest priority of the normal scheduler)."""

# The spinner: pins itself, lowers its priority, then loops, checking every few milliseconds that
# its parent is still alive (so that a parent killed without cleanup leaves no spinner behind).
_SPINNER = """
import os, sys
cpu, nice, parent = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if cpu >= 0:  # -1: the parent found no affinity call
    os.sched_setaffinity(0, {cpu})
os.nice(nice)
sys.stdout.write("ready\\n")
sys.stdout.flush()
while os.getppid() == parent:
    for _ in range(200000):
        pass
"""


def host_cpus() -> list[int]:
    """The CPUs this process may run on (all of them where affinity is not supported)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


class CpuAwake:
    """Spinner processes that keep the host's CPUs from halting (module docstring).

    Args:
      cpus: how many spinners, pinned to the first ``cpus`` of :func:`host_cpus` (None: one
        on each of them).
      nice: their niceness, an integer in [0, 19] (19, the default, yields to everything).

    Raises:
      TypeError: ``cpus`` or ``nice`` is not an integer (``cpus`` may be None).
      ValueError: ``cpus`` is not in [1, len(host_cpus())], or ``nice`` is not in [0, 19].

    Use as a context manager, or call :meth:`start` and :meth:`stop`. :attr:`pids` lists the
    running spinners' process ids.
    """

    def __init__(self, cpus: int | None = None, *, nice: int = SPINNER_NICE):
        available = host_cpus()
        if cpus is not None:
            if isinstance(cpus, bool) or not isinstance(cpus, int):
                raise TypeError(f"cpus={cpus!r} is invalid: must be an integer or None")
            if not 1 <= cpus <= len(available):
                raise ValueError(f"cpus={cpus!r} is invalid: must be in [1, {len(available)}] (this host's CPUs)")
        if isinstance(nice, bool) or not isinstance(nice, int):
            raise TypeError(f"nice={nice!r} is invalid: must be an integer")
        if not 0 <= nice <= 19:
            raise ValueError(f"nice={nice!r} is invalid: must be in [0, 19]")
        self.cpus = available if cpus is None else available[:cpus]
        self.nice = nice
        self._procs: list[subprocess.Popen] = []

    @property
    def pids(self) -> list[int]:
        """The process ids of the running spinners (empty when stopped)."""
        return [p.pid for p in self._procs]

    def start(self) -> CpuAwake:
        """Starts one spinner per CPU and waits until each is pinned and running.

        Raises:
          RuntimeError: already started, or a spinner exited before it was ready.
        """
        if self._procs:
            raise RuntimeError("CpuAwake.start: the spinners are already running")
        pinned = hasattr(os, "sched_setaffinity")
        try:
            for cpu in self.cpus:
                args = [sys.executable, "-c", _SPINNER, str(cpu if pinned else -1), str(self.nice), str(os.getpid())]
                self._procs.append(
                    subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
                )
            for proc in self._procs:
                if proc.stdout.readline().strip() != b"ready":
                    raise RuntimeError(f"CpuAwake.start: spinner {proc.pid} exited with {proc.wait()} before it ran")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stops the spinners (a no-op when none runs) and waits for them to exit."""
        procs, self._procs = self._procs, []
        for proc in procs:
            proc.terminate()
        deadline = time.monotonic() + 5.0
        for proc in procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    def __enter__(self) -> CpuAwake:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
