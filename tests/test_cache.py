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
