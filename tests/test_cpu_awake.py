"""CpuAwake: spinner processes pinned one per CPU at low priority, stopped on exit."""

import os
import subprocess
import sys
import time

import pytest

from dspark_jax import CpuAwake
from dspark_jax.cpu_awake import SPINNER_NICE, host_cpus


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


needs_linux = pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc (Linux)")


@needs_linux
def test_spinners_run_pinned_at_lowest_priority_and_stop_on_exit():
    cpus = host_cpus()[:2]
    with CpuAwake(len(cpus)) as awake:
        pids = awake.pids
        assert len(pids) == len(cpus)
        assert [os.sched_getaffinity(pid) for pid in pids] == [{cpu} for cpu in cpus]
        assert all(os.getpriority(os.PRIO_PROCESS, pid) == SPINNER_NICE for pid in pids)
        assert all(_state(pid) in "RS" for pid in pids)  # running (or just preempted), not exited
    assert awake.pids == []
    assert not any(_alive(pid) for pid in pids)


@needs_linux
def test_spinners_stop_when_the_block_raises():
    with pytest.raises(KeyError), CpuAwake(1, nice=10) as awake:
        pid = awake.pids[0]
        assert os.getpriority(os.PRIO_PROCESS, pid) == 10
        raise KeyError("boom")
    assert not _alive(pid)


def test_default_is_one_spinner_per_cpu_and_start_twice_is_refused():
    awake = CpuAwake()
    assert awake.cpus == host_cpus()
    awake = CpuAwake(1).start()
    try:
        with pytest.raises(RuntimeError, match="already running"):
            awake.start()
    finally:
        awake.stop()
    awake.stop()  # a second stop is a no-op
    assert awake.pids == []


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"cpus": 0}, ValueError, r"cpus=0 is invalid: must be in \[1, "),
        ({"cpus": 10_000}, ValueError, "cpus=10000 is invalid"),
        ({"cpus": 1.5}, TypeError, "cpus=1.5 is invalid: must be an integer or None"),
        ({"cpus": True}, TypeError, "cpus=True is invalid"),
        ({"nice": 20}, ValueError, r"nice=20 is invalid: must be in \[0, 19\]"),
        ({"nice": -1}, ValueError, "nice=-1 is invalid"),
        ({"nice": "19"}, TypeError, "nice='19' is invalid: must be an integer"),
    ],
)
def test_bad_arguments_name_the_field(kwargs, error, match):
    with pytest.raises(error, match=match):
        CpuAwake(**kwargs)


@needs_linux
def test_spinners_exit_when_their_parent_dies_without_stopping_them():
    code = "import os; from dspark_jax import CpuAwake; print(CpuAwake(1).start().pids[0], flush=True); os._exit(0)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    pid = int(out.stdout.split()[0])
    deadline = time.monotonic() + 10
    while _alive(pid) and _state(pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(pid) or _state(pid) == "Z"  # exited (a zombie until its new parent reaps it)


def test_a_count_of_spinners_takes_the_first_cpus_and_nice_zero_is_allowed():
    """``CpuAwake(n)`` pins to the first ``n`` of :func:`host_cpus` (documented); nice 0, the
    bottom of [0, 19], is a valid niceness. Nothing is started."""
    cpus = host_cpus()
    for n in range(1, len(cpus) + 1):
        assert CpuAwake(n).cpus == cpus[:n]
    assert CpuAwake(1, nice=0).nice == 0
