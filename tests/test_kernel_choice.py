"""kernel_choice: what each DSPARK_JAX_* value picks, on a GPU with and without Pallas's Triton
backend (jax 0.11 deprecates it), the backend faked on this CPU."""

import dataclasses
import importlib.util
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import kernel_choice
from dspark_jax.greedy_kernel import GREEDY_AUTO_MAX_BATCH, GREEDY_ENV, use_greedy_kernel
from dspark_jax.kernel_choice import check_tile_layout, kernel_mode, triton_available
from dspark_jax.mlp_kernel import MLP_AUTO_MAX_ROWS, MLP_ENV, use_mlp_kernel
from dspark_jax.tile_race_kernel import TILE_RACE_AUTO_BATCHES, TILE_RACE_ENV, use_tile_race_kernel

VARIABLE = "DSPARK_JAX_TEST_KERNEL"


@pytest.fixture
def fake_gpu(monkeypatch):
    """Makes ``kernel_mode`` see a GPU backend; returns a setter for Triton's availability."""
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "gpu")

    def set_triton(available: bool) -> None:
        monkeypatch.setattr(kernel_choice, "triton_available", lambda: available)

    kernel_choice._warn_no_triton.cache_clear()
    yield set_triton
    kernel_choice._warn_no_triton.cache_clear()


def test_triton_available_follows_the_module():
    expected = importlib.util.find_spec("jax.experimental.pallas.triton") is not None
    assert triton_available() is expected


@pytest.mark.parametrize(
    "choice, supported, expected",
    [
        ("auto", True, (True, False)),
        ("pallas", True, (True, False)),
        ("xla", True, (False, False)),
        ("auto", False, (False, False)),
    ],
)
def test_gpu_with_triton(fake_gpu, monkeypatch, choice, supported, expected):
    fake_gpu(True)
    monkeypatch.setenv(VARIABLE, choice)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_mode(VARIABLE, supported) == expected


def test_gpu_without_triton_auto_takes_xla_and_warns_once(fake_gpu, monkeypatch):
    fake_gpu(False)
    monkeypatch.setenv(VARIABLE, "auto")
    with pytest.warns(RuntimeWarning, match=r"no Pallas Triton backend: dspark_jax runs its XLA paths"):
        assert kernel_mode(VARIABLE, True) == (False, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert kernel_mode(VARIABLE, True) == (False, False)  # once per process
        monkeypatch.setenv(VARIABLE, "xla")
        assert kernel_mode(VARIABLE, True) == (False, False)


def test_gpu_without_triton_refuses_pallas(fake_gpu, monkeypatch):
    fake_gpu(False)
    monkeypatch.setenv(VARIABLE, "pallas")
    with pytest.raises(
        ValueError, match=rf"{VARIABLE}='pallas' is invalid with jax .*no Pallas Triton backend.*'auto' or 'xla'"
    ):
        kernel_mode(VARIABLE, True)
    assert kernel_mode(VARIABLE, False) == (False, False)  # a kernel that does not apply asks nothing


def test_off_gpu_pallas_runs_the_interpreter_whatever_triton(monkeypatch):
    monkeypatch.setattr(kernel_choice.jax, "default_backend", lambda: "cpu")
    monkeypatch.setattr(kernel_choice, "triton_available", lambda: False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        monkeypatch.setenv(VARIABLE, "pallas")
        assert kernel_mode(VARIABLE, True) == (True, True)
        monkeypatch.setenv(VARIABLE, "auto")
        assert kernel_mode(VARIABLE, True) == (False, False)


def test_check_tile_layout_wants_integers_and_bool_flags():
    """``4.0 in (1, 2, 4, 8)`` is true: a float warp count was accepted; NumPy integers are
    integers (stored back as ints); a flag is a bool, not ``1``."""

    @dataclasses.dataclass(frozen=True)
    class Layout:
        tile: object = 64
        warps: object = None
        stages: object = 2
        flag: object = True

    def check(**kw):
        layout = Layout(**kw)
        check_tile_layout(layout, ("tile",), (1, 2, 4, 8), flags=("flag",))
        return layout

    assert check(tile=np.int64(64), warps=np.int32(4), stages=np.uint8(2)) == Layout(tile=64, warps=4, stages=2)
    assert type(check(tile=np.int64(64)).tile) is int
    for kw, message in (
        ({"warps": 4.0}, "warps=4.0 is invalid: must be None or one of"),
        ({"warps": True}, "warps=True is invalid"),
        ({"tile": 64.0}, "tile=64.0 is invalid: must be a power of two >= 16"),
        ({"tile": np.int64(48)}, r"tile=np.int64\(48\) is invalid: must be a power of two >= 16"),
        ({"stages": 2.0}, r"stages=2.0 is invalid: must be an integer in \[1, 8\]"),
    ):
        with pytest.raises(ValueError, match=message):
            check(**kw)
    with pytest.raises(TypeError, match="flag=1 is invalid: must be True or False"):
        check(flag=1)


@pytest.mark.parametrize(("stages", "ok"), [(0, False), (1, True), (8, True), (9, False)])
def test_check_tile_layout_takes_one_to_eight_pipeline_stages(stages, ok):
    """The docstring's range: ``stages`` an integer in [1, 8], both ends included."""

    @dataclasses.dataclass(frozen=True)
    class Layout:
        tile: object = 64
        warps: object = None
        stages: object = 2

    if ok:
        check_tile_layout(Layout(stages=stages), ("tile",), (4,))
    else:
        with pytest.raises(ValueError, match=rf"^stages={stages} is invalid: must be an integer in \[1, 8\]$"):
            check_tile_layout(Layout(stages=stages), ("tile",), (4,))


def test_pow2_ceil_is_the_smallest_power_of_two_at_least_n():
    """Brute force: the first of 1, 2, 4, … that is >= n (an exact power is kept: 16 → 16)."""

    def reference(n: int) -> int:
        p = 1
        while p < n:
            p *= 2
        return p

    for n in range(1, 2001):
        assert kernel_choice.pow2_ceil(n) == reference(n), n


def test_auto_runs_each_kernel_up_to_and_including_its_bound_on_a_gpu(fake_gpu, monkeypatch):
    """On a GPU with Triton, ``auto`` takes the greedy kernels up to
    :data:`~dspark_jax.greedy_kernel.GREEDY_AUTO_MAX_BATCH` rows, the tiled race kernels for
    batches in :data:`~dspark_jax.tile_race_kernel.TILE_RACE_AUTO_BATCHES` (both ends included)
    and the SwiGLU kernel up to :data:`~dspark_jax.mlp_kernel.MLP_AUTO_MAX_ROWS` rows, and
    none of them one past its bound. (On the CPU ``auto`` never takes a kernel, so the kernel
    files' own choice tests cannot see these bounds.)"""
    fake_gpu(True)
    for variable in (GREEDY_ENV, TILE_RACE_ENV, MLP_ENV):
        monkeypatch.delenv(variable, raising=False)
    bf16, vocab = jnp.bfloat16, 151936
    assert use_greedy_kernel(256, bf16, GREEDY_AUTO_MAX_BATCH) == (True, False)
    assert use_greedy_kernel(256, bf16, GREEDY_AUTO_MAX_BATCH + 1) == (False, False)
    first, last = TILE_RACE_AUTO_BATCHES
    assert use_tile_race_kernel(256, bf16, vocab, first) == (True, False)
    assert use_tile_race_kernel(256, bf16, vocab, last) == (True, False)
    assert use_tile_race_kernel(256, bf16, vocab, last + 1) == (False, False)
    assert use_mlp_kernel(bf16, MLP_AUTO_MAX_ROWS, 4096, 12288) == (True, False)
    assert use_mlp_kernel(bf16, MLP_AUTO_MAX_ROWS + 1, 4096, 12288) == (False, False)
