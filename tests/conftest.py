"""Settings for the whole suite, and fixtures shared by several modules.

Float32 products at full precision on every backend: on GPUs XLA multiplies float32
matrices through TF32 by default (about 1e-3 relative error), which the comparisons with
NumPy references would report as bugs; on the CPU (CI) this changes nothing.

Where jax can only run on the CPU (CI), XLA compiles the suite's programs without LLVM's
optimisation passes: the suite compiles hundreds of tiny programs and runs each a few
times, so compiling dominates (measured on a 2-core CPU: the race-kernel and split-round
modules 131 s → 97 s). With jaxlib 0.10 it also emits fusions through XLA's older LLVM
emitters, which compile sooner than its MLIR fusion emitters (the split-round module 55 s →
41 s on the same CPU; other jaxlib versions may no longer have the flag, so it is set for
0.10 only). Same maths: XLA's CPU backend does not relax floating point at any level, and
every comparison is between programs compiled alike or against NumPy with a tolerance. On
GPU machines the programs are compiled as the library compiles them.

``-n auto`` (the README's test command, through pytest-xdist) runs the test files in one
worker process per CPU, each file whole in one worker (``--dist loadfile``, so module fixtures
are built once): at most ``MAX_WORKERS`` where jax runs on the CPU alone, at most
``GPU_WORKERS`` on a GPU, which the workers share (each then allocates device memory as it
goes, ``XLA_PYTHON_CLIENT_PREALLOCATE=false``, instead of taking 75 % of it at its start), and
never more than the host's memory holds (``WORKER_BYTES`` each). A TPU, which one process
owns, runs them in this process.
"""

import importlib.metadata
import os


def _platform() -> str:
    """``"cpu"``, ``"gpu"``, ``"tpu"`` or ``"other"``: where jax will run, as ``JAX_PLATFORMS``
    says or else as the installed accelerator plugins (CUDA, ROCm, TPU) say. Decided before
    jax starts a backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        first = platforms.split(",")[0].strip().lower()
        return {"cpu": "cpu", "cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "tpu": "tpu"}.get(first, "other")
    names = [(dist.metadata["Name"] or "").lower() for dist in importlib.metadata.distributions()]
    if any(name.startswith("libtpu") for name in names):
        return "tpu"
    gpu_plugins = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm")
    return "gpu" if any(name.startswith(gpu_plugins) for name in names) else "cpu"


PLATFORM = _platform()


# Each worker compiles its own programs (up to ~3 GB of host memory); the longest file bounds
# the wall time. Measured: 2 CPUs, 558 s in one process, 277-339 s with two workers; an H100
# host of 16 CPUs, about 1 s a test in one process (the GPU calls of stops 52-55: ~23 min), 8 workers 99 % of
# the suite in 570 s, 12 workers all but 4 tests in 500 s (2026-12-05).
MAX_WORKERS = 4
GPU_WORKERS = 12
WORKER_BYTES = 4 * 2**30


def _host_memory_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):  # no sysconf (Windows) or no such name
        return None


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto``: one per CPU this process may run on, at most ``MAX_WORKERS``
    on the CPU and ``GPU_WORKERS`` on a GPU, at most one per ``WORKER_BYTES`` of host memory,
    and none (the tests run in this process) on a TPU or an unknown platform."""
    if PLATFORM not in ("cpu", "gpu"):
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    memory = _host_memory_bytes()
    by_memory = cpus if memory is None else max(1, memory // WORKER_BYTES)
    return min(cpus, by_memory, MAX_WORKERS if PLATFORM == "cpu" else GPU_WORKERS)


if "PYTEST_XDIST_WORKER" in os.environ and PLATFORM == "gpu":
    # Workers share the GPU: each takes device memory as it needs it (set before jax starts).
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


if PLATFORM == "cpu":  # before jax reads XLA_FLAGS (when its first backend starts)
    fast_compile = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    if importlib.metadata.version("jaxlib").startswith("0.10."):
        fast_compile += " --xla_cpu_use_fusion_emitters=false"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {fast_compile}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402
from proposer_testing import build_forced  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


@pytest.fixture(scope="session")
def forced_session(tmp_path_factory):
    """``(draft, proposer, cache, store)``: a precompiled FORCE proposer (``proposer_testing``)
    that saved its programs in the executable store ``store``, built once for the Proposer's
    and the executable store's tests."""
    store = tmp_path_factory.mktemp("executable_store")
    return (*build_forced(store), store)
