"""layers.rope / attend / attend_with_context refuse bad input, naming the argument, instead of
raising raw errors deep inside or returning quietly wrong output (NaN, a broadcast mask)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.layers import attend, attend_with_context, rope

B, S, NH, KVH, D, C = 2, 3, 4, 2, 8, 5


def _f(*shape):
    return jnp.ones(shape, jnp.float32)


def _context_inputs():
    return dict(
        q=_f(B, S, NH, D),
        ctx_k=_f(B, C, KVH, D),
        ctx_v=_f(B, C, KVH, D),
        ctx_mask=jnp.ones((B, C), bool),
        k=_f(B, S, KVH, D),
        v=_f(B, S, KVH, D),
    )


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"ctx_mask": jnp.ones((C,), bool)}, ValueError, r"ctx_mask has shape \(5,\): expected \[B, C\] = \(2, 5\)"),
        ({"ctx_mask": jnp.ones((1, C), bool)}, ValueError, r"ctx_mask has shape \(1, 5\)"),  # was broadcast
        ({"ctx_mask": jnp.ones((B, C), jnp.float32)}, TypeError, "ctx_mask has dtype float32: expected bool"),
        ({"ctx_k": _f(1, C, KVH, D), "ctx_v": _f(1, C, KVH, D)}, ValueError, "do not fit: same B and D"),
        ({"ctx_k": _f(B, C, KVH, 4), "ctx_v": _f(B, C, KVH, 4)}, ValueError, "do not fit: same B and D"),
        ({"q": _f(B, S, 3, D)}, ValueError, "NH=3 a multiple of KVH=2"),
        ({"ctx_v": _f(B, C - 1, KVH, D)}, ValueError, r"ctx_v has shape \(2, 4, 2, 8\): expected ctx_k's"),
        ({"v": _f(B, S, KVH, 4)}, ValueError, r"v has shape \(2, 3, 2, 4\): expected \[B, S, KVH, D\]"),
        ({"k": _f(B, S - 1, KVH, D)}, ValueError, r"k has shape \(2, 2, 2, 8\)"),  # was accepted
        ({"q": _f(S, NH, D)}, ValueError, r"expected q \[B, S, NH, D\]"),
        ({"q": np.ones((B, S, NH, D)).tolist()}, TypeError, "q has type list"),
        ({"ctx_k": jnp.ones((B, C, KVH, D), jnp.int32)}, TypeError, "ctx_k has dtype int32: expected a floating"),
    ],
)
def test_attend_with_context_refuses_inputs_that_do_not_fit(change, error, message):
    with pytest.raises(error, match="^attend_with_context: .*" + message):
        attend_with_context(**{**_context_inputs(), **change})


def test_attend_with_context_checks_cost_nothing_under_jit():
    inputs = _context_inputs()
    want = attend_with_context(**inputs)
    got = jax.jit(attend_with_context)(**inputs)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6)


def test_attend_refuses_zero_kv_heads_a_float_mask_and_lists():
    q, mask = _f(B, S, NH, D), jnp.ones((B, S, C), bool)
    with pytest.raises(ValueError, match="^attend: .*NH=4 a multiple of KVH=0 >= 1"):
        attend(q, _f(B, C, 0, D), _f(B, C, 0, D), mask)
    with pytest.raises(TypeError, match="^attend: mask has dtype float32: expected bool"):
        attend(q, _f(B, C, KVH, D), _f(B, C, KVH, D), jnp.full((B, S, C), 0.5))
    with pytest.raises(TypeError, match="^attend: q has type list"):
        attend(np.ones((B, S, NH, D)).tolist(), _f(B, C, KVH, D), _f(B, C, KVH, D), mask)


@pytest.mark.parametrize("theta", [0.0, -1.0, float("nan"), float("inf"), np.float32(0.0)])
def test_rope_refuses_a_theta_that_gives_nan(theta):
    with pytest.raises(ValueError, match="^rope: theta=.* is invalid: must be a finite number > 0"):
        rope(_f(B, S, NH, D), jnp.zeros((B, S), jnp.int32), theta)


def test_rope_refuses_float_positions_lists_and_a_string_theta():
    x, pos = _f(B, S, NH, D), jnp.zeros((B, S), jnp.int32)
    with pytest.raises(TypeError, match="^rope: positions has dtype float32: expected an integer dtype"):
        rope(x, jnp.full((B, S), 0.5), 1e4)
    with pytest.raises(TypeError, match="^rope: positions has type list"):
        rope(x, [[0] * S] * B, 1e4)
    with pytest.raises(TypeError, match="^rope: x has type list"):
        rope(np.asarray(x).tolist(), pos, 1e4)
    with pytest.raises(TypeError, match="^rope: theta='1e4' has type str"):
        rope(x, pos, "1e4")


def test_rope_takes_numpy_inputs_and_a_traced_theta():
    x, pos = np.ones((B, S, NH, D), np.float32), np.arange(B * S).reshape(B, S)
    want = rope(jnp.asarray(x), jnp.asarray(pos), 1e4)
    np.testing.assert_allclose(np.asarray(rope(x, pos, np.float64(1e4))), np.asarray(want), rtol=1e-6)
    traced = jax.jit(lambda theta: rope(x, pos, theta))(jnp.float32(1e4))
    np.testing.assert_allclose(np.asarray(traced), np.asarray(want), rtol=1e-6)
