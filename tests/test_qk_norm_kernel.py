"""The q/k norm + RoPE kernel (Pallas interpreter on the CPU) against the XLA path and a float64 reference."""

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from draft_testing import hf_params, random_draft, rel_err, tiny_config

from dspark_jax.layers import rope_angles
from dspark_jax.qk_norm_kernel import project_qkv, qk_norm_rope, rotary_table

BF16_ULP = 2.0**-7  # one unit in the last place of a bfloat16 value in [1, 2)


def _layer_inputs(heads, kv_heads, head_dim, seed=1):
    cfg = tiny_config(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, dtype="bfloat16")
    draft = random_draft(cfg, seed=seed)
    x = jax.random.normal(jax.random.key(seed + 1), (3, 7, cfg.hidden_size)).astype(jnp.bfloat16)
    positions = jnp.arange(21, dtype=jnp.int32).reshape(3, 7) * 37 + 5
    return cfg, draft, x, positions


# 6 and 40 query heads, 3 key/value heads: padded (masked) head tiles
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (6, 2, 16), (6, 3, 16), (40, 8, 64)])
def test_kernel_matches_the_xla_projection_and_the_float64_reference(heads, kv_heads, head_dim):
    cfg, draft, x, positions = _layer_inputs(heads, kv_heads, head_dim)
    attn = draft.layers[0].self_attn
    got = project_qkv(attn, x, positions, interpret=True)
    want = jax.jit(lambda: (attn.query(x, positions), *attn.key_value(x, positions)))()
    np_want = ref.project_qkv(np.asarray(x, np.float64), np.asarray(positions), hf_params(draft), 0, cfg)
    for name, g, w, r in zip("qkv", got, want, np_want, strict=True):
        assert g.shape == w.shape and g.dtype == jnp.bfloat16, name
        # the XLA path may keep excess precision inside its program: agree to bfloat16 rounding
        assert rel_err(g, w) <= BF16_ULP, name
        # against float64: the bfloat16 projection and outputs, a few units in the last place
        assert rel_err(g, r) <= 4 * BF16_ULP, name
    # values are copied from the fused projection the kernel reads (XLA's separate v product may
    # round differently: jax 0.11 on the CPU differs in one element by one bfloat16 step)
    qkv = np.asarray(attn.qkv(x))
    v = qkv[..., (heads + kv_heads) * head_dim :].reshape(*qkv.shape[:2], kv_heads, head_dim)
    np.testing.assert_array_equal(np.asarray(got[2]), v)


def test_bad_shapes_name_what_was_given():
    qkv = jnp.zeros((2, 3, (4 + 2 * 2) * 16), jnp.bfloat16)
    rotary = rotary_table(jnp.zeros((2, 3), jnp.int32), 16, 10_000.0)
    w = jnp.ones((16,), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"qkv \(2, 3, 128\), rotary \(2, 3, 16\).*for 4 query and 3 key/value heads"):
        qk_norm_rope(qkv, w, w, rotary, num_heads=4, num_kv_heads=3, eps=1e-6, interpret=True)
    with pytest.raises(ValueError, match=r"rotary \(2, 3, 8\)"):
        qk_norm_rope(qkv, w, w, rotary[..., :8], num_heads=4, num_kv_heads=2, eps=1e-6, interpret=True)


def test_rotary_table_is_rope_angles_side_by_side():
    positions = jnp.array([[0, 5, 1031]], jnp.int32)
    table = rotary_table(positions, 16, 1e6)
    cos, sin = rope_angles(positions, 16, 1e6)
    assert table.shape == (1, 3, 16) and table.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(table[..., :8]), np.asarray(cos))
    np.testing.assert_array_equal(np.asarray(table[..., 8:]), np.asarray(sin))
    angles = np.asarray(positions, np.float64)[..., None] * 1e6 ** (-np.arange(0, 16, 2) / 16)  # from the equations
    np.testing.assert_allclose(np.asarray(table), np.concatenate([np.cos(angles), np.sin(angles)], -1), atol=1e-4)


def test_zero_and_tiny_heads_are_normalised_with_eps():
    """The RMS norm divides by ``sqrt(mean(x²) + eps)``: a query head of zeros comes out as
    zeros (not NaN from ``0 · rsqrt(0)``), and a key head of values near 1e-4 (``mean(x²)``
    about 1e-8, a hundredth of ``eps = 1e-6``) comes out about ten times smaller than
    ``eps = 0`` would make it. Each head against the float64 reference (:func:`np_reference.rms_norm`,
    then :func:`np_reference.rope`) within 4 bfloat16 units of the head's largest value."""
    heads, kv_heads, dim, eps, theta = 4, 2, 16, 1e-6, 10_000.0
    rng = np.random.default_rng(3)
    qkv = rng.normal(size=(2, 3, heads + 2 * kv_heads, dim))
    qkv[:, :, 1] = 0.0  # query head 1
    qkv[:, :, heads] *= 1e-4  # key head 0
    qkv = jnp.asarray(qkv.reshape(2, 3, -1), jnp.bfloat16)
    q_weight = jnp.asarray(1.0 + 0.3 * rng.normal(size=dim), jnp.bfloat16)
    k_weight = jnp.asarray(1.0 + 0.3 * rng.normal(size=dim), jnp.bfloat16)
    positions = jnp.arange(6, dtype=jnp.int32).reshape(2, 3) * 11 + 2
    rotary = rotary_table(positions, dim, theta)
    q, k, _ = qk_norm_rope(
        qkv, q_weight, k_weight, rotary, num_heads=heads, num_kv_heads=kv_heads, eps=eps, interpret=True
    )
    x = np.asarray(qkv, np.float64).reshape(2, 3, heads + 2 * kv_heads, dim)
    want_q = ref.rope(ref.rms_norm(x[:, :, :heads], np.asarray(q_weight), eps), np.asarray(positions), theta)
    want_k = ref.rope(
        ref.rms_norm(x[:, :, heads : heads + kv_heads], np.asarray(k_weight), eps), np.asarray(positions), theta
    )
    assert not np.asarray(q[:, :, 1], np.float64).any()  # the zero head: zeros, no NaN
    for got, want in ((q, want_q), (k, want_k)):
        for h in range(got.shape[2]):
            if h == 1 and got is q:
                continue
            assert rel_err(got[:, :, h], want[:, :, h]) <= 4 * BF16_ULP, h


def _off_midpoint(y, margin=0.01):
    """Where ``y`` lies farther than ``margin`` of a bfloat16 step from a rounding midpoint (so
    float32 rounding on the way cannot change its bfloat16 rounding)."""
    y = np.abs(y)
    step = 2.0 ** (np.floor(np.log2(np.where(y > 0, y, 1.0))) - 7)
    frac = y / step - np.floor(y / step)
    return (y > 0) & (np.abs(frac - 0.5) > margin)


def test_the_normalised_value_is_rounded_before_the_weight_multiplies_it():
    """RMSNorm's rounding order: ``bf16(w · bf16(x · rsqrt(mean(x²) + eps)))``. At position 0 the
    rotation is exact (cos 1, sin 0), so each output is that value; checked against the float64
    equation at every element where neither rounding is near a midpoint (there, float32
    arithmetic cannot move the result), and some of those elements differ from ``bf16(w · x ·
    rsqrt(…))`` rounded once (checked), so skipping the inner rounding fails."""
    heads, kv_heads, dim, eps = 4, 2, 16, 1e-6
    rng = np.random.default_rng(4)
    qkv = jnp.asarray(rng.normal(size=(2, 3, (heads + 2 * kv_heads) * dim)), jnp.bfloat16)
    q_weight, k_weight = (jnp.asarray(1.0 + 0.3 * rng.normal(size=dim), jnp.bfloat16) for _ in range(2))
    rotary = rotary_table(jnp.zeros((2, 3), jnp.int32), dim, 10_000.0)
    q, k, _ = qk_norm_rope(
        qkv, q_weight, k_weight, rotary, num_heads=heads, num_kv_heads=kv_heads, eps=eps, interpret=True
    )

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)

    x = np.asarray(qkv, np.float64).reshape(2, 3, heads + 2 * kv_heads, dim)
    for got, part, weight in ((q, x[:, :, :heads], q_weight), (k, x[:, :, heads : heads + kv_heads], k_weight)):
        n = part / np.sqrt(np.mean(part * part, axis=-1, keepdims=True) + eps)
        w = np.asarray(weight, np.float64)
        want = bf16(w * bf16(n))
        safe = _off_midpoint(n) & _off_midpoint(w * bf16(n)) & _off_midpoint(w * n)
        assert safe.mean() > 0.9
        np.testing.assert_array_equal(np.asarray(got, np.float64)[safe], want[safe])
        assert (bf16(w * n)[safe] != want[safe]).any()  # the test can tell
