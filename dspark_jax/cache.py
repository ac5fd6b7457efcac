"""The draft's context cache: per-layer keys and values of committed target features.

Shape legend: L draft layers, B request slots, C capacity (positions), KVH key/value
heads, D head dim, N new tokens, K fused target layers, H hidden.

Cache index = absolute token position, so a request's context is the first
``prefix_len`` entries of its slot. :func:`write_context` is the single write path:
prefill writes the prompt's features and commit writes the accepted verify positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from dspark_jax.config import DraftConfig


@struct.dataclass
class ContextCache:
    """Context keys and values, each ``[L, B, C, KVH, D]``."""

    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        return self.k.shape[1]


def init_context_cache(cfg: DraftConfig, batch: int, capacity: int, dtype=None) -> ContextCache:
    """An empty cache of ``batch`` request slots with ``capacity`` positions each."""
    for name, value in (("batch", batch), ("capacity", capacity)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
    shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
    dtype = dtype or cfg.jnp_dtype
    return ContextCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_context(cache: ContextCache, k: jax.Array, v: jax.Array, start: jax.Array, count: jax.Array) -> ContextCache:
    """Writes the first ``count[b]`` of ``N`` new entries at positions ``start[b] + i``.

    Entries at ``i >= count[b]`` and positions past the capacity are dropped, so the
    rows outside the committed range are never touched.

    Args:
      cache: the cache.
      k, v: ``[L, B, N, KVH, D]`` new keys / values.
      start: ``[B]`` first position to write.
      count: ``[B]`` number of entries to write (``0 <= count <= N``).

    Returns:
      The updated cache.
    """
    n = k.shape[2]
    idx = start.astype(jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, N]
    keep = jnp.arange(n)[None, :] < count[:, None]
    idx = jnp.where(keep, idx, cache.capacity)  # out of range -> dropped
    rows = jnp.arange(cache.batch)[:, None]

    def put(buf, new):
        return buf.at[:, rows, idx].set(new.astype(buf.dtype), mode="drop")

    return ContextCache(k=put(cache.k, k), v=put(cache.v, v))


def context_mask(prefix_lens: jax.Array, capacity: int) -> jax.Array:
    """``[B]`` → ``[B, C]`` True at positions ``< prefix_len``."""
    return jnp.arange(capacity, dtype=jnp.int32)[None, :] < prefix_lens.astype(jnp.int32)[:, None]


def fill_context(draft, cache: ContextCache, features: jax.Array, start: jax.Array, count: jax.Array) -> ContextCache:
    """Projects target features through the draft and writes them into the cache.

    Args:
      draft: a :class:`~dspark_jax.draft.DSparkDraft`.
      cache: the context cache.
      features: ``[B, N, K·H]`` fused target features of tokens at ``start + 0..N−1``.
      start: ``[B]`` position of the first feature row.
      count: ``[B]`` rows to commit.

    Returns:
      The updated cache.
    """
    n = features.shape[1]
    positions = start.astype(jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)
    k, v = draft.context_kv(features, positions)
    return write_context(cache, k, v, start, count)
