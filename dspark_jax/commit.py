"""Committing target features into the draft's context cache.

Shape legend: B batch, T = γ + 1 verify positions, S prompt length, K fused target
layers, H hidden.

After a verify, the first ``commit_len = correct_len + 1`` verify positions (the old
bonus and the accepted drafts) become context: their fused target features are
projected through the draft and written at positions ``prefix_len + 0..commit_len−1``,
and ``prefix_len`` advances by ``commit_len``. The features of rejected drafts are never
written. :func:`prefill` writes a prompt's features the same way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

from dspark_jax.cache import ContextCache, fill_context

if TYPE_CHECKING:
    from dspark_jax.draft import DSparkDraft


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
    """
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
    """
    start = jnp.zeros_like(lengths, dtype=jnp.int32)
    return fill_context(draft, cache, features, start, lengths.astype(jnp.int32))
