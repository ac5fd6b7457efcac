"""spin_until_ready: waits by polling, returns the tree, surfaces bad arguments."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import spin_until_ready


def test_returns_the_tree_with_every_array_ready():
    x = jnp.arange(12.0).reshape(3, 4)
    tree = {"a": jax.jit(lambda v: v @ v.T)(x), "b": (jnp.ones(3) * 2, "not an array", None)}
    out = spin_until_ready(tree)
    assert out is tree
    assert all(leaf.is_ready() for leaf in jax.tree.leaves(out) if isinstance(leaf, jax.Array))
    np.testing.assert_allclose(np.asarray(out["a"]), np.asarray(x) @ np.asarray(x).T)


def test_a_generous_timeout_waits_normally():
    y = spin_until_ready(jax.jit(jnp.cumsum)(jnp.ones(1000)), timeout_s=60.0)
    assert float(y[-1]) == 1000.0


@pytest.mark.parametrize("bad", [0, -1.0, float("nan"), True, "1", np.float32("nan"), np.int64(0)])
def test_bad_timeout_names_the_field(bad):
    with pytest.raises(ValueError, match="timeout_s"):
        spin_until_ready(jnp.ones(2), timeout_s=bad)


def test_a_numpy_timeout_is_a_number_and_a_wrong_type_is_named():
    """``np.float32(1.0)`` was refused as "not a positive number"."""
    for timeout in (np.float32(1.0), np.int64(5), np.float64(0.5)):
        assert float(spin_until_ready(jnp.ones(2), timeout_s=timeout)[0]) == 1.0
    with pytest.raises(ValueError, match=r"timeout_s='1' \(type str\) is invalid: must be None or a number"):
        spin_until_ready(jnp.ones(2), timeout_s="1")


def test_polls_until_ready_and_times_out_only_after_the_timeout(monkeypatch):
    """With an array that reports not ready a few times: it polls until ready (a generous timeout
    does not fire); one never ready raises TimeoutError only once ``timeout_s`` seconds passed."""
    import time

    x = jnp.ones(3)
    polls = []

    def not_ready_thrice(self):
        polls.append(1)
        return len(polls) > 3

    monkeypatch.setattr(type(x), "is_ready", not_ready_thrice)
    assert spin_until_ready(x, timeout_s=30.0) is x and len(polls) == 4
    monkeypatch.setattr(type(x), "is_ready", lambda self: False)
    start = time.perf_counter()
    with pytest.raises(TimeoutError, match=r"an array of shape \(3,\) was not ready after 0.2 s"):
        spin_until_ready(x, timeout_s=0.2)
    assert time.perf_counter() - start >= 0.2
