"""The draft context cache: writes land at absolute positions, only the counted rows."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from draft_testing import hf_params, jit_apply, random_draft, rel_err, tiny_config

from dspark_jax.cache import context_mask, fill_context, init_context_cache, write_context


def test_write_context_writes_counted_rows_at_their_positions_and_drops_the_rest():
    cfg = tiny_config()
    cache = init_context_cache(cfg, batch=3, capacity=6)
    rng = np.random.default_rng(0)
    shape = (cfg.num_hidden_layers, 3, 4, cfg.num_key_value_heads, cfg.head_dim)
    k, v = rng.standard_normal(shape), rng.standard_normal(shape)
    start, count = np.array([0, 2, 4]), np.array([4, 1, 4])  # row 2 runs past capacity
    out = write_context(cache, jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), start, count)
    want_k = np.zeros((cfg.num_hidden_layers, 3, 6, cfg.num_key_value_heads, cfg.head_dim))
    want_v = np.zeros_like(want_k)
    for b in range(3):
        for i in range(count[b]):
            if start[b] + i < 6:
                want_k[:, b, start[b] + i] = k[:, b, i]
                want_v[:, b, start[b] + i] = v[:, b, i]
    np.testing.assert_allclose(out.k, want_k, rtol=1e-6)
    np.testing.assert_allclose(out.v, want_v, rtol=1e-6)


def test_context_mask_marks_positions_before_the_prefix_length():
    mask = context_mask(jnp.array([0, 3, 5]), 5)
    np.testing.assert_array_equal(mask, np.arange(5)[None] < np.array([[0], [3], [5]]))


def test_context_mask_takes_a_list_and_refuses_lengths_that_are_not_integers():
    np.testing.assert_array_equal(context_mask([0, 2], 3), [[False, False, False], [True, True, False]])
    for lengths, dtype in ((np.array([1.7, 2.2]), "float64"), (jnp.array([1.7, 2.2]), "float32"), ([True], "bool")):
        with pytest.raises(TypeError, match=rf"prefix_lens has dtype {dtype}: expected an integer dtype"):
            context_mask(lengths, 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_the_default_context_cache_takes_the_drafts_compute_dtype(dtype):
    """``init_context_cache`` and the Proposer without a ``cache_dtype`` keep the context in
    the draft's ``dtype`` (a bf16 draft got a float32 cache: twice the memory)."""
    from dspark_jax.proposer import Proposer

    cfg = tiny_config(dtype=dtype, param_dtype=dtype)
    cache = init_context_cache(cfg, batch=2, capacity=6)
    assert cache.k.dtype == cache.v.dtype == jnp.dtype(dtype)
    draft = random_draft(cfg, seed=0)
    proposer = Proposer(draft, max_batch=2, capacity=6, executable_store=False, free_bytes=1 << 40)
    assert proposer.cache_dtype == jnp.dtype(dtype)


def test_a_float64_cache_is_refused_without_x64_mode():
    """jax would make it float32 with only a UserWarning."""
    assert not jax.config.jax_enable_x64
    with pytest.raises(ValueError, match=r"dtype=float64 is invalid while jax's x64 mode is off .*: must be float32"):
        init_context_cache(tiny_config(), batch=2, capacity=6, dtype="float64")
    with jax.enable_x64(True):
        assert init_context_cache(tiny_config(), batch=2, capacity=6, dtype="float64").k.dtype == jnp.float64


def test_fill_context_stores_the_reference_context_keys_and_values():
    cfg = tiny_config()
    draft = random_draft(cfg, seed=1)
    feats = np.random.default_rng(2).standard_normal((2, 5, cfg.num_fused_layers * cfg.hidden_size))
    cache = init_context_cache(cfg, batch=2, capacity=12)
    start = np.array([2, 7])
    with jax.default_matmul_precision("highest"):
        out = jit_apply(
            lambda d, c, f, s: fill_context(d, c, f, s, jnp.array([5, 5])),
            draft,
            cache,
            jnp.asarray(feats, jnp.float32),
            jnp.asarray(start),
        )
    positions = start[:, None] + np.arange(5)
    k_ref, v_ref = ref.context_kv(feats, positions, hf_params(draft), cfg)
    for b in range(2):
        sl = slice(start[b], start[b] + 5)
        assert rel_err(out.k[:, b, sl], np.stack(k_ref)[:, b]) <= 1e-5
        assert rel_err(out.v[:, b, sl], np.stack(v_ref)[:, b]) <= 1e-5


@pytest.mark.parametrize(("batch", "capacity"), [(0, 4), (2, 0), (2, 1.5)])
def test_init_context_cache_rejects_bad_sizes(batch, capacity):
    with pytest.raises(ValueError, match="is invalid: must be an integer >= 1"):
        init_context_cache(tiny_config(), batch=batch, capacity=capacity)


def test_init_context_cache_takes_numpy_integer_sizes():
    cache = init_context_cache(tiny_config(), batch=np.int64(2), capacity=np.int32(6))
    assert cache.k.shape[1:3] == (2, 6) and type(cache.batch) is int


@pytest.mark.parametrize(
    ("dtype", "message"),
    [
        (jnp.int32, r"dtype=int32 is invalid: must be a floating dtype"),
        (np.bool_, r"dtype=bool is invalid: must be a floating dtype"),
        ("float33", r"dtype='float33' is invalid: must be a floating dtype"),
    ],
)
def test_init_context_cache_refuses_a_non_floating_dtype(dtype, message):
    """An integer cache would make every later round draft meaningless tokens without a word."""
    with pytest.raises(TypeError, match=message):
        init_context_cache(tiny_config(), batch=2, capacity=6, dtype=dtype)


def test_init_context_cache_refuses_a_config_of_the_wrong_type():
    with pytest.raises(TypeError, match=r"cfg must be a DraftConfig, got NoneType"):
        init_context_cache(None, batch=2, capacity=6)


KV = (2, 2, 3, 2, 8)  # [L, B, N, KVH, D] for tiny_config() and a 2-slot cache


@pytest.mark.parametrize(
    ("k_shape", "v_shape", "rows", "message"),
    [
        # one layer would be broadcast into both of the cache's layers
        (
            (1, 2, 3, 2, 8),
            (1, 2, 3, 2, 8),
            2,
            r"k has shape \(1, 2, 3, 2, 8\): expected \[L, B, N, KVH, D\] with the cache's L=2, B=2, KVH=2, D=8",
        ),
        ((2, 3, 3, 2, 8), (2, 3, 3, 2, 8), 2, r"k has shape \(2, 3, 3, 2, 8\): expected \[L, B, N, KVH, D\]"),
        (KV, (2, 2, 4, 2, 8), 2, r"k has shape \(2, 2, 3, 2, 8\) and v \(2, 2, 4, 2, 8\): expected the same shape"),
        (KV, KV, 3, r"start has shape \(3,\): expected \[B\] = \(2,\)"),
    ],
)
def test_write_context_refuses_shapes_that_do_not_match_the_cache_while_tracing(k_shape, v_shape, rows, message):
    cache = init_context_cache(tiny_config(), batch=2, capacity=6)
    with pytest.raises(ValueError, match=message):
        jax.jit(write_context)(cache, jnp.ones(k_shape), jnp.ones(v_shape), jnp.zeros(rows, jnp.int32), jnp.full(2, 3))


@pytest.mark.parametrize(
    ("start", "count", "message"),
    [
        (np.array([0.0, 1.5], np.float32), np.array([3, 3]), "start has dtype float32"),
        (np.array([0, 1]), np.array([2.7, 3.0], np.float32), "count has dtype float32"),
        (np.array([0, 1]), np.array([True, True]), "count has dtype bool"),
    ],
)
def test_write_context_refuses_float_and_bool_rows_while_tracing(start, count, message):
    """A float or bool position or count would be truncated silently by the write."""
    cache = init_context_cache(tiny_config(), batch=2, capacity=6)
    with pytest.raises(TypeError, match=rf"{message}: expected an integer dtype"):
        jax.jit(write_context)(cache, jnp.ones(KV), jnp.ones(KV), jnp.asarray(start), jnp.asarray(count))


def test_write_context_refuses_a_cache_of_the_wrong_type():
    cache = init_context_cache(tiny_config(), batch=2, capacity=6)
    rows = (jnp.zeros(2, jnp.int32), jnp.full(2, 3))
    with pytest.raises(TypeError, match=r"cache has type dict: expected a ContextCache"):
        write_context({"k": cache.k, "v": cache.v}, jnp.ones(KV), jnp.ones(KV), *rows)
