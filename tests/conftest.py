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
worker process per CPU, at most ``MAX_WORKERS``, each file whole in one worker
(``--dist loadfile``, so module fixtures are built once); on a machine with an accelerator it
runs them in this process, the one that owns the device.
"""

import importlib.metadata
import os


def _cpu_only() -> bool:
    """True when jax will run on the CPU alone: ``JAX_PLATFORMS`` says so, or no accelerator
    plugin (CUDA, ROCm, TPU) is installed. Decided before jax starts a backend."""
    platforms = os.environ.get("JAX_PLATFORMS", "").strip()
    if platforms:
        return platforms.split(",")[0].strip() == "cpu"
    accelerators = ("jax-cuda", "jax_cuda", "jax-rocm", "jax_rocm", "libtpu")
    names = (dist.metadata["Name"] or "" for dist in importlib.metadata.distributions())
    return not any(name.lower().startswith(accelerators) for name in names)


MAX_WORKERS = 4  # each worker compiles its own programs (up to ~3 GB); the longest file bounds the wall time


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for ``-n auto``: one per CPU this process may run on, at most ``MAX_WORKERS``,
    and none (the tests run in this process) where an accelerator would be shared."""
    if not _cpu_only():
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return min(cpus, MAX_WORKERS)


if _cpu_only():  # before jax reads XLA_FLAGS (when its first backend starts)
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
