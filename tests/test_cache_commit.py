"""Committing target features into the draft's context cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.cache import commit, fill_context, init_context_cache, prefill
from dspark_jax.config import DraftConfig
from dspark_jax.draft import DSparkDraft

CFG = DraftConfig(
    hidden_size=16,
    intermediate_size=24,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=12,
    block_size=3,
    mask_token_id=11,
    target_layer_ids=(0, 1),
    markov_rank=4,
)
B, C, T, F = 4, 16, CFG.gamma + 1, 2 * 16


def _random_cache(seed):
    cache = init_context_cache(CFG, B, C)
    k1, k2 = jax.random.split(jax.random.key(seed))
    return type(cache)(k=jax.random.normal(k1, cache.k.shape), v=jax.random.normal(k2, cache.v.shape))


@jax.jit
def _context_kv(draft, features, positions):
    return draft.context_kv(features, positions)


def test_commit_writes_exactly_the_committed_positions():
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    cache = _random_cache(1)
    features = jax.random.normal(jax.random.key(2), (B, T, F))
    prefix = np.array([0, 5, 9, 12])
    correct = np.array([3, 0, 2, 1])
    active = np.array([True, True, True, False])
    new, new_prefix = jax.jit(commit)(
        draft, cache, features, jnp.asarray(prefix), jnp.asarray(correct), active=jnp.asarray(active)
    )
    np.testing.assert_array_equal(new_prefix, np.where(active, prefix + correct + 1, prefix))
    positions = jnp.asarray(prefix)[:, None] + jnp.arange(T)
    k_ref, v_ref = map(np.asarray, _context_kv(draft, features, positions))  # [L, B, T, KVH, D]
    new, cache = jax.tree.map(np.asarray, (new, cache))
    for b in range(B):
        n = correct[b] + 1 if active[b] else 0
        written = slice(prefix[b], prefix[b] + n)
        np.testing.assert_allclose(new.k[:, b, written], k_ref[:, b, :n], atol=1e-6)
        np.testing.assert_allclose(new.v[:, b, written], v_ref[:, b, :n], atol=1e-6)
        untouched = np.ones(C, bool)
        untouched[written] = False
        np.testing.assert_array_equal(new.k[:, b, untouched], cache.k[:, b, untouched])
        np.testing.assert_array_equal(new.v[:, b, untouched], cache.v[:, b, untouched])


def test_prefill_writes_only_the_prompt_positions():
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    cache = _random_cache(3)
    features = jax.random.normal(jax.random.key(4), (B, 8, F))
    lengths = np.array([1, 8, 3, 5])
    new = jax.jit(prefill)(draft, cache, features, jnp.asarray(lengths))
    k_ref = np.asarray(_context_kv(draft, features, jnp.broadcast_to(jnp.arange(8), (B, 8)))[0])
    new, cache = jax.tree.map(np.asarray, (new, cache))
    for b in range(B):
        n = lengths[b]
        np.testing.assert_allclose(new.k[:, b, :n], k_ref[:, b, :n], atol=1e-6)
        np.testing.assert_array_equal(new.k[:, b, n:], cache.k[:, b, n:])


@pytest.mark.parametrize(
    ("features", "rows", "message"),
    [
        ((B, T, F + 1), {}, r"features has shape \(4, 4, 33\): expected \[B, N, K·H\] with B=4 .* K·H=32"),
        ((B - 1, T, F), {}, r"features has shape \(3, 4, 32\): expected \[B, N, K·H\] with B=4"),
        (
            (B, T, F),
            {"correct_len": np.zeros(B - 1, np.int32)},
            r"correct_len has shape \(3,\): expected \[B\] = \(4,\)",
        ),
        ((B, T, F), {"active": np.ones((B, 1), bool)}, r"active has shape \(4, 1\): expected \[B\] = \(4,\)"),
    ],
)
def test_commit_refuses_mismatched_shapes_while_tracing(features, rows, message):
    """The shapes are static: a mismatch names its field instead of failing inside the projection."""
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    args = {"prefix_lens": np.zeros(B, np.int32), "correct_len": np.zeros(B, np.int32), **rows}
    active = args.pop("active", None)
    with pytest.raises(ValueError, match=message):
        jax.jit(commit)(draft, _random_cache(1), jnp.zeros(features), *map(jnp.asarray, args.values()), active=active)


@pytest.mark.parametrize("rows", [T - 2, T + 1])
def test_commit_refuses_features_that_are_not_gamma_plus_one_rows_while_tracing(rows):
    """With fewer rows, prefix_len still moved by correct_len + 1, over positions never written
    that the context mask then treated as context."""
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    zeros = jnp.zeros(B, jnp.int32)
    message = rf"features has shape \(4, {rows}, 32\): expected \[B, T, K·H\] with T = γ \+ 1 = {T}"
    with pytest.raises(ValueError, match=message):
        jax.jit(commit)(draft, _random_cache(1), jnp.zeros((B, rows, F)), zeros, jnp.full(B, CFG.gamma, jnp.int32))


def test_prefill_refuses_lengths_of_another_batch():
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"lengths has shape \(2,\): expected \[B\] = \(4,\)"):
        prefill(draft, _random_cache(1), jnp.zeros((B, 5, F)), jnp.asarray([3, 4]))


@pytest.mark.parametrize(
    ("write", "rows", "message"),
    [
        ("prefill", {"lengths": np.array([2.7, 5.0, 1.0, 3.0], np.float32)}, "lengths has dtype float32"),
        ("prefill", {"lengths": np.ones(B, bool)}, "lengths has dtype bool"),
        ("commit", {"correct_len": np.array([1.9, 0.0, 1.0, 2.0], np.float32)}, "correct_len has dtype float32"),
        ("commit", {"prefix_lens": np.ones(B, bool)}, "prefix_lens has dtype bool"),
        ("fill_context", {"start": np.zeros(B, np.float32)}, "start has dtype float32"),
        ("fill_context", {"count": np.ones(B, bool)}, "count has dtype bool"),
    ],
)
def test_cache_writes_refuse_float_and_bool_rows_while_tracing(write, rows, message):
    """Positions, counts and lengths are cast to int32 inside the write: a float or bool one
    would be truncated silently (2.7 rows -> 2, True -> 1), so its dtype is refused."""
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    zeros = np.zeros(B, np.int32)
    fn, names = {
        "prefill": (prefill, ("lengths",)),
        "commit": (commit, ("prefix_lens", "correct_len")),
        "fill_context": (fill_context, ("start", "count")),
    }[write]
    args = [jnp.asarray(rows.get(name, zeros)) for name in names]
    with pytest.raises(TypeError, match=rf"{message}: expected an integer dtype"):
        jax.jit(fn)(draft, _random_cache(1), jnp.zeros((B, T, F)), *args)


def test_commit_refuses_an_active_mask_that_is_not_bool_while_tracing():
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    zeros = jnp.zeros(B, jnp.int32)
    with pytest.raises(TypeError, match=r"active has dtype int32: expected bool"):
        jax.jit(commit)(draft, _random_cache(1), jnp.zeros((B, T, F)), zeros, zeros, active=jnp.array([2, 0, 1, 1]))


@pytest.mark.parametrize("write", ["commit", "prefill", "fill_context"])
@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_cache_writes_refuse_features_that_are_not_floating_while_tracing(write, dtype):
    """The draft projects the features: int or bool ones were cast without a word."""
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    fn, rows = {"commit": (commit, 2), "prefill": (prefill, 1), "fill_context": (fill_context, 2)}[write]
    features = jnp.ones((B, T, F), dtype)
    with pytest.raises(TypeError, match=rf"features has dtype {jnp.dtype(dtype)}: expected a floating dtype"):
        jax.jit(fn)(draft, _random_cache(1), features, *[jnp.zeros(B, jnp.int32)] * rows)


def test_commit_refuses_string_features_by_name():
    """A str array failed inside NumPy, naming nothing."""
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    zeros = np.zeros(B, np.int32)
    with pytest.raises(TypeError, match=r"features has dtype <U1: expected a floating dtype"):
        commit(draft, _random_cache(1), np.full((B, T, F), "a"), zeros, zeros)


def test_cache_writes_refuse_a_draft_or_cache_of_the_wrong_type():
    """A dict in place of the cache, or the config in place of the draft, failed on a missing attribute."""
    draft = DSparkDraft(CFG, rngs=nnx.Rngs(0))
    cache, features, zeros = _random_cache(1), jnp.zeros((B, T, F)), jnp.zeros(B, jnp.int32)
    with pytest.raises(TypeError, match=r"cache has type dict: expected a ContextCache"):
        jax.jit(commit)(draft, {"k": cache.k, "v": cache.v}, features, zeros, zeros)
    with pytest.raises(TypeError, match=r"draft must be a DSparkDraft, got DraftConfig"):
        prefill(CFG, cache, features, zeros)
    with pytest.raises(TypeError, match=r"draft must be a DSparkDraft, got NoneType"):
        fill_context(None, cache, features, zeros, zeros)
