"""The draft's context cache: per-layer keys and values of committed target features.

Shape legend: L draft layers, B request slots, C capacity (positions), KVH key/value
heads, D head dim, N new tokens, K fused target layers, H hidden.

Cache index = absolute token position, so a request's context is the first
``prefix_len`` entries of its slot. :func:`write_context` is the single write path:
:func:`prefill` writes the prompt's features and :func:`commit` the accepted verify positions.

After a verify, the first ``commit_len = correct_len + 1`` verify positions (the old
bonus and the accepted drafts) become context: their fused target features are
projected through the draft and written at positions ``prefix_len + 0..commit_len−1``,
and ``prefix_len`` advances by ``commit_len``. The features of rejected drafts are never
written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspark_jax.config import DraftConfig

if TYPE_CHECKING:
    from dspark_jax.draft import DSparkDraft


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

    Raises:
      ValueError: a shape does not match (checked while tracing: every shape is static).
    """
    _check_features(draft.cfg, cache, features, {"start": start, "count": count})
    n = features.shape[1]
    positions = start.astype(jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)
    k, v = draft.context_kv(features, positions)
    return write_context(cache, k, v, start, count)


def _check_features(cfg, cache: ContextCache, features: Any, rows: dict[str, Any]) -> None:
    """``features`` must be ``[B, N, K·H]`` for the cache's ``B`` slots and the draft's ``K·H``,
    and each of ``rows`` ``[B]``; raises ``ValueError`` naming the field otherwise."""
    width = cfg.num_fused_layers * cfg.hidden_size
    shape = tuple(np.shape(features))
    if len(shape) != 3 or shape[0] != cache.batch or shape[2] != width:
        raise ValueError(
            f"features has shape {shape}: expected [B, N, K·H] with B={cache.batch} (the cache's request slots) and "
            f"K·H={width} ({cfg.num_fused_layers} target layers × hidden size {cfg.hidden_size})"
        )
    for name, value in rows.items():
        if tuple(np.shape(value)) != (cache.batch,):
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}: expected [B] = ({cache.batch},)")


def commit(
    draft: DSparkDraft,
    cache: ContextCache,
    features: jax.Array,
    prefix_lens: jax.Array,
    correct_len: jax.Array,
    *,
    active: jax.Array | None = None,
) -> tuple[ContextCache, jax.Array]:
    """Writes the committed verify positions' context K/V. Jittable.

    Args:
      draft: the :class:`~dspark_jax.draft.DSparkDraft` (merged module).
      cache: the draft context cache.
      features: ``[B, T, K·H]`` target features of the verified ``[bonus, d_1 … d_γ]``.
      prefix_lens: ``[B]`` position of the bonus (context length before this round).
      correct_len: ``[B]`` accepted drafts per row, ``0 <= correct_len <= γ``.
      active: ``[B]`` bool; rows where it is False (finished requests) are left
        unchanged. All rows when omitted.

    Returns:
      ``(cache, new_prefix_lens [B] int32)``.

    Raises:
      ValueError: a shape does not match (checked while tracing).
    """
    rows = {
        "prefix_lens": prefix_lens,
        "correct_len": correct_len,
        **({"active": active} if active is not None else {}),
    }
    _check_features(draft.cfg, cache, features, rows)
    count = correct_len.astype(jnp.int32) + 1  # [B] commit_len
    if active is not None:
        count = jnp.where(active, count, 0)
    cache = fill_context(draft, cache, features, prefix_lens.astype(jnp.int32), count)
    return cache, prefix_lens.astype(jnp.int32) + count


def prefill(draft: DSparkDraft, cache: ContextCache, features: jax.Array, lengths: jax.Array) -> ContextCache:
    """Writes the prompt's context K/V at positions ``0..length−1``. Jittable.

    Args:
      draft: the :class:`~dspark_jax.draft.DSparkDraft`.
      cache: the draft context cache.
      features: ``[B, S, K·H]`` target features of the right-padded prompts.
      lengths: ``[B]`` prompt lengths; padding rows past them are not written.

    Returns:
      The cache; the requests' ``prefix_lens`` are ``lengths``.

    Raises:
      ValueError: a shape does not match (checked while tracing).
    """
    _check_features(draft.cfg, cache, features, {"lengths": lengths})
    start = jnp.zeros_like(lengths, dtype=jnp.int32)
    return fill_context(draft, cache, features, start, lengths.astype(jnp.int32))
