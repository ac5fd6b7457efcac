"""kernel_choice: what each DSPARK_JAX_* value picks, on a GPU with and without Pallas's Triton
backend (jax 0.11 deprecates it), the backend faked on this CPU."""

import importlib.util
import warnings

import pytest

from dspark_jax import kernel_choice
from dspark_jax.kernel_choice import kernel_mode, triton_available

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
