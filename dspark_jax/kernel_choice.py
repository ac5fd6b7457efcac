"""Choosing, per trace, between a Pallas kernel and the XLA path, from an environment variable.

Each kernel module (:mod:`dspark_jax.attention_kernel`, :mod:`dspark_jax.race_kernel`,
:mod:`dspark_jax.greedy_kernel`) names its variable; the values are the same for all:
``auto`` (default: the kernel on GPU backends where the kernel module says it applies),
``xla`` (never the kernel) or ``pallas`` (the kernel wherever it applies, through the
Pallas interpreter off GPUs).

Every GPU kernel here is Pallas on Triton, a backend jax 0.11 deprecates. Where a jax no
longer ships it, ``auto`` takes the XLA paths (with one warning) and ``pallas`` on a GPU is
refused, naming the variable.
"""

from __future__ import annotations

import functools
import importlib
import os
import warnings

import jax

from dspark_jax.config import check_flag, is_integer

KERNEL_CHOICES = ("auto", "xla", "pallas")


def env_choice(variable: str, choices: tuple[str, ...] = KERNEL_CHOICES) -> str:
    """The value of environment variable ``variable`` (``auto`` when unset or empty; any case).

    Raises:
      ValueError: the variable holds something not in ``choices``.
    """
    value = os.environ.get(variable, "auto").strip().lower() or "auto"
    if value not in choices:
        raise ValueError(f"{variable}={value!r} is invalid: must be one of {choices}")
    return value


def pow2_ceil(n: int) -> int:
    """The smallest power of two >= ``n`` (``n`` >= 1): the padded size of a Triton block."""
    return 1 << (n - 1).bit_length()


def triton_params(warps: int, stages: int, interpret: bool) -> dict:
    """``pallas_call`` keyword arguments for a Triton kernel of ``warps`` warps and ``stages``
    pipeline stages (none through the interpreter, which takes no compiler parameters)."""
    if interpret:
        return {}
    from jax.experimental.pallas import triton as plgpu

    return {"compiler_params": plgpu.CompilerParams(num_warps=warps, num_stages=stages)}


@functools.cache
def triton_available() -> bool:
    """Whether this jax ships Pallas's Triton backend (``jax.experimental.pallas.triton``),
    which every GPU kernel here lowers through."""
    try:
        importlib.import_module("jax.experimental.pallas.triton")
    except ImportError:
        return False
    return True


@functools.cache
def _warn_no_triton() -> None:
    warnings.warn(
        f"jax {jax.__version__} has no Pallas Triton backend: dspark_jax runs its XLA paths "
        "instead of its GPU kernels (correct, slower; see README, Performance)",
        RuntimeWarning,
        stacklevel=3,
    )


def kernel_mode(variable: str, supported: bool) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace.

    Args:
      variable: the environment variable read by :func:`env_choice`.
      supported: whether the kernel applies to this trace's shapes and dtypes.

    Raises:
      ValueError: the variable asks for ``pallas`` on a GPU and this jax has no Pallas
        Triton backend.
    """
    choice = env_choice(variable)
    if choice == "xla" or not supported:
        return False, False
    on_gpu = jax.default_backend() == "gpu"
    if on_gpu and not triton_available():
        if choice == "pallas":
            raise ValueError(
                f"{variable}='pallas' is invalid with jax {jax.__version__}: it has no Pallas Triton "
                "backend for the GPU kernels; use 'auto' or 'xla'"
            )
        _warn_no_triton()
        return False, False
    if choice == "auto":
        return on_gpu, False
    return True, not on_gpu


def check_tile_layout(
    layout: object, powers: tuple[str, ...], warp_counts: tuple[int, ...], flags: tuple[str, ...] = ()
) -> None:
    """Checks a tiled kernel's layout (a tuning dataclass): its fields ``powers`` powers of two of
    at least 16, its ``warps`` None or one of ``warp_counts``, its ``stages`` an integer in [1, 8],
    its fields ``flags`` bools.

    The numbers must be integers, Python or NumPy (a float such as ``4.0`` or a bool is refused);
    NumPy ones are stored back as Python ints (the dataclass is frozen, hence
    ``object.__setattr__``), so the kernels' index arithmetic sees plain ints.

    Raises:
      ValueError: naming the first numeric field that is not so, its value and what is allowed.
      TypeError: naming a flag that is not a bool and its value.
    """
    for name in flags:
        check_flag(name, getattr(layout, name))

    def integer(name: str, ok, allowed: str) -> None:
        value = getattr(layout, name)
        if not is_integer(value) or not ok(int(value)):
            raise ValueError(f"{name}={value!r} is invalid: must be {allowed}")
        object.__setattr__(layout, name, int(value))

    for name in powers:
        integer(name, lambda n: n >= 16 and not n & (n - 1), "a power of two >= 16")
    if layout.warps is not None:
        integer("warps", lambda n: n in warp_counts, f"None or one of {warp_counts}")
    integer("stages", lambda n: 1 <= n <= 8, "an integer in [1, 8]")
