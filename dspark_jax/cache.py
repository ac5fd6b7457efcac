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

Per-row values (positions, counts, lengths) are not range-checked: the writes are jittable,
so a value cannot raise. What out-of-range values do is stated on each function; their
shapes and dtypes are static and checked while tracing.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspark_jax.config import DraftConfig, positive_int
from dspark_jax.draft import DSparkDraft, check_draft
from dspark_jax.sampling import check_dtypes, check_values


@struct.dataclass
class ContextCache:
    """Context keys and values, each ``[L, B, C, KVH, D]``."""

    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        """``C``: positions per slot."""
        return self.k.shape[2]

    @property
    def batch(self) -> int:
        """``B``: request slots."""
        return self.k.shape[1]


def resolve_cache_dtype(cfg: DraftConfig, dtype: Any = None, *, name: str = "dtype") -> jnp.dtype:
    """The context cache's dtype: ``dtype``, or the draft's compute dtype when None.

    Raises:
      TypeError: ``dtype`` is not a floating dtype (the message names ``name``).
      ValueError: ``dtype`` is float64 while jax's x64 mode is off (jax would make the
        cache float32 instead).
    """
    if dtype is None:
        return jnp.dtype(cfg.jnp_dtype)
    try:
        resolved = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"{name}={dtype!r} is invalid: must be a floating dtype (float32, bfloat16, …)") from None
    if not jnp.issubdtype(resolved, jnp.floating):
        raise TypeError(
            f"{name}={resolved} is invalid: must be a floating dtype (float32, bfloat16, …) for the draft's context "
            "keys and values"
        )
    if resolved.itemsize > 4 and not jax.config.jax_enable_x64:
        raise ValueError(
            f"{name}={resolved} is invalid while jax's x64 mode is off (the cache would be float32): must be "
            "float32, bfloat16 or float16, or enable x64 (jax.config.update('jax_enable_x64', True))"
        )
    return resolved


def init_context_cache(cfg: DraftConfig, batch: int, capacity: int, dtype: Any = None) -> ContextCache:
    """An empty cache of ``batch`` request slots with ``capacity`` positions each.

    Args:
      cfg: the draft config.
      batch: request slots (a Python or NumPy integer >= 1).
      capacity: positions per slot (a Python or NumPy integer >= 1).
      dtype: a floating dtype; default the draft's compute dtype.

    Returns:
      The zero-filled :class:`ContextCache`, ``[L, batch, capacity, KVH, D]``.

    Raises:
      TypeError: ``cfg`` is not a :class:`~dspark_jax.config.DraftConfig`, or ``dtype`` is not a
        floating dtype.
      ValueError: ``batch`` or ``capacity`` is not an integer >= 1.
    """
    if not isinstance(cfg, DraftConfig):
        raise TypeError(f"cfg must be a DraftConfig, got {type(cfg).__name__}")
    batch, capacity = positive_int("batch", batch), positive_int("capacity", capacity)
    dtype = resolve_cache_dtype(cfg, dtype)
    shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
    return ContextCache(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype))


def write_context(cache: ContextCache, k: jax.Array, v: jax.Array, start: jax.Array, count: jax.Array) -> ContextCache:
    """Writes the first ``count[b]`` of ``N`` new entries at positions ``start[b] + i``.

    Entries at ``i >= count[b]`` and positions past the capacity are dropped, so the
    rows outside the committed range are never touched. Values are not checked (jittable):
    ``count <= 0`` writes nothing, ``count > N`` writes all ``N``, and a negative position
    counts from the end of the slot as in NumPy indexing (``start`` must be ``>= 0``).

    Args:
      cache: the cache.
      k, v: ``[L, B, N, KVH, D]`` new keys / values (``L``, ``B``, ``KVH``, ``D`` the cache's).
      start: ``[B]`` int first position to write.
      count: ``[B]`` int number of entries to write (``0 <= count <= N``).

    Returns:
      The updated cache.

    Raises:
      ValueError: a shape does not match the cache (checked while tracing).
      TypeError: ``cache`` is not a :class:`ContextCache`, or ``start`` or ``count`` is not of an
        integer dtype (bool and float are refused: they would be truncated silently).
    """
    _check_cache(cache)
    _check_kv(cache, k, v)
    _check_rows(cache, {"start": start, "count": count})
    n = k.shape[2]
    idx = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)  # [B, N]
    keep = jnp.arange(n)[None, :] < jnp.asarray(count)[:, None]
    idx = jnp.where(keep, idx, cache.capacity)  # out of range -> dropped
    rows = jnp.arange(cache.batch)[:, None]

    def put(buf, new):
        return buf.at[:, rows, idx].set(new.astype(buf.dtype), mode="drop")

    return ContextCache(k=put(cache.k, k), v=put(cache.v, v))


def context_mask(prefix_lens: jax.Array, capacity: int) -> jax.Array:
    """``[B]`` → ``[B, C]`` True at positions ``< prefix_len``.

    Args:
      prefix_lens: ``[B]`` context lengths, of an integer dtype (an array, or a list of ints).
      capacity: ``C``, the cache's positions.

    Raises:
      TypeError: ``prefix_lens`` is not of an integer dtype (a float or bool length would be
        truncated silently).
      ValueError: ``prefix_lens`` is not ``[B]``, (when concrete) holds a value outside int32,
        or ``capacity`` is not an integer ``>= 1``.
    """
    check_dtypes({"prefix_lens": (prefix_lens, jnp.integer)})
    capacity = positive_int("capacity", capacity)
    if np.ndim(prefix_lens) != 1:
        raise ValueError(f"prefix_lens has shape {tuple(np.shape(prefix_lens))}: expected [B], one length per request")
    int32 = np.iinfo(np.int32)
    check_values({"prefix_lens": (prefix_lens, (lambda n: (n >= int32.min) & (n <= int32.max), "must fit int32"))})
    return jnp.arange(capacity, dtype=jnp.int32)[None, :] < jnp.asarray(prefix_lens, jnp.int32)[:, None]


def fill_context(
    draft: DSparkDraft, cache: ContextCache, features: jax.Array, start: jax.Array, count: jax.Array
) -> ContextCache:
    """Projects target features through the draft and writes them into the cache.

    Args:
      draft: a :class:`~dspark_jax.draft.DSparkDraft`.
      cache: the context cache.
      features: ``[B, N, K·H]`` fused target features of tokens at ``start + 0..N−1``.
      start: ``[B]`` int position of the first feature row.
      count: ``[B]`` int rows to commit; out-of-range values as in :func:`write_context`.

    Returns:
      The updated cache.

    Raises:
      ValueError: a shape does not match (checked while tracing: every shape is static).
      TypeError: ``draft`` or ``cache`` is of the wrong type, ``features`` not of a floating
        dtype, or ``start`` or ``count`` not of an integer dtype.
    """
    _check_features(draft, cache, features, {"start": start, "count": count})
    n = features.shape[1]
    positions = jnp.asarray(start, jnp.int32)[:, None] + jnp.arange(n, dtype=jnp.int32)
    k, v = draft.context_kv(features, positions)
    return write_context(cache, k, v, start, count)


def _check_features(
    draft: Any, cache: Any, features: Any, rows: dict[str, Any], masks: dict[str, Any] | None = None
) -> None:
    """``draft`` must be a draft, ``cache`` a :class:`ContextCache`, ``features`` ``[B, N, K·H]``
    of a floating dtype for the cache's ``B`` slots and the draft's ``K·H``, and ``rows`` and
    ``masks`` as :func:`_check_rows` says; raises naming the argument otherwise."""
    check_draft(draft)
    cfg = draft.cfg
    _check_cache(cache)
    _check_cache_fits(cfg, cache)
    width = cfg.num_fused_layers * cfg.hidden_size
    shape = tuple(np.shape(features))
    if len(shape) != 3 or shape[0] != cache.batch or shape[2] != width:
        raise ValueError(
            f"features has shape {shape}: expected [B, N, K·H] with B={cache.batch} (the cache's request slots) and "
            f"K·H={width} ({cfg.num_fused_layers} target layers × hidden size {cfg.hidden_size})"
        )
    # the draft projects them: int or bool features would be cast silently, strings fail inside NumPy
    check_dtypes({"features": (features, jnp.floating)})
    _check_rows(cache, rows, masks)


def _check_cache(cache: Any) -> None:
    """Raises ``TypeError`` unless ``cache`` is a :class:`ContextCache` of floating ``k`` and
    ``v``, and ``ValueError`` unless they are one ``[L, B, C, KVH, D]`` shape (an integer cache
    would truncate every projected key and value it is written)."""
    if not isinstance(cache, ContextCache):
        raise TypeError(f"cache has type {type(cache).__name__}: expected a ContextCache")
    check_dtypes({"cache.k": (cache.k, jnp.floating), "cache.v": (cache.v, jnp.floating)})
    if np.ndim(cache.k) != 5 or np.shape(cache.k) != np.shape(cache.v):
        raise ValueError(
            f"cache.k has shape {tuple(np.shape(cache.k))} and cache.v {tuple(np.shape(cache.v))}: expected one "
            "[L, B, C, KVH, D] shape (init_context_cache builds it)"
        )


def _check_cache_fits(cfg: DraftConfig, cache: ContextCache) -> None:
    """Raises ``ValueError`` unless the cache's ``L``, ``KVH`` and ``D`` are the draft's."""
    layers, _, _, heads, dim = cache.k.shape
    want = (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
    if (layers, heads, dim) != want:
        raise ValueError(
            f"cache has L={layers} layers, KVH={heads} heads of D={dim}: this draft needs L={want[0]}, KVH={want[1]}, "
            f"D={want[2]} (a cache built for another draft config; init_context_cache(draft.cfg, …) builds one)"
        )


def _check_rows(cache: ContextCache, rows: dict[str, Any], masks: dict[str, Any] | None = None) -> None:
    """Each of ``rows`` must be ``[B]`` of an integer dtype, each of ``masks`` ``[B]`` bool (``B``
    the cache's slots); raises ``ValueError`` (shape) or ``TypeError`` (dtype) naming the field."""
    masks = masks or {}
    for name, value in (*rows.items(), *masks.items()):
        if tuple(np.shape(value)) != (cache.batch,):
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}: expected [B] = ({cache.batch},)")
    # a float or bool position or count would be truncated silently by the write
    check_dtypes({name: (value, jnp.integer) for name, value in rows.items()})
    check_dtypes({name: (value, jnp.bool_) for name, value in masks.items()})


def _check_kv(cache: ContextCache, k: Any, v: Any) -> None:
    """``k`` and ``v`` must be the same ``[L, B, N, KVH, D]`` with the cache's ``L``, ``B``, ``KVH``
    and ``D`` (a smaller ``L`` or ``B`` would otherwise be broadcast over the cache silently)."""
    layers, batch, _, heads, dim = cache.k.shape
    for name, value in (("k", k), ("v", v)):
        shape = tuple(np.shape(value))
        if len(shape) != 5 or shape[:2] != (layers, batch) or shape[3:] != (heads, dim):
            raise ValueError(
                f"{name} has shape {shape}: expected [L, B, N, KVH, D] with the cache's L={layers}, B={batch}, "
                f"KVH={heads}, D={dim}"
            )
    if np.shape(k) != np.shape(v):
        raise ValueError(f"k has shape {tuple(np.shape(k))} and v {tuple(np.shape(v))}: expected the same shape")
    check_dtypes({"k": (k, jnp.floating), "v": (v, jnp.floating)})  # written into a floating cache


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
      features: ``[B, T, K·H]`` target features of the verified ``[bonus, d_1 … d_γ]``
        (``T = γ + 1``).
      prefix_lens: ``[B]`` int position of the bonus (context length before this round).
      correct_len: ``[B]`` int accepted drafts per row, ``0 <= correct_len <= γ``.
      active: ``[B]`` bool; rows where it is False (finished requests) are left
        unchanged. All rows when omitted.

    Values are not checked (jittable). ``new_prefix_lens = prefix_lens + correct_len + 1`` on
    active rows whatever the values: positions at or past the capacity are not written (the
    returned length may then exceed the capacity; :func:`~dspark_jax.proposal.propose`
    needs ``prefix_len <= capacity − γ``), ``correct_len > T − 1`` writes the ``T`` features,
    and a negative ``correct_len`` writes nothing and moves the length back by
    ``−(correct_len + 1)``.

    Returns:
      ``(cache, new_prefix_lens [B] int32)``.

    Raises:
      ValueError: a shape does not match (checked while tracing), ``features`` among them
        when its ``T`` is not ``γ + 1``.
      TypeError: ``draft`` is not a draft or ``cache`` not a :class:`ContextCache`, ``features``
        is not of a floating dtype, ``prefix_lens`` or ``correct_len`` not of an integer dtype
        (bool and float are refused: they would be truncated silently), or ``active`` not bool.
    """
    masks = {"active": active} if active is not None else {}
    _check_features(draft, cache, features, {"prefix_lens": prefix_lens, "correct_len": correct_len}, masks)
    rows = draft.cfg.gamma + 1
    if np.shape(features)[1] != rows:
        # fewer rows would still move prefix_len by correct_len + 1 over positions never written
        raise ValueError(
            f"features has shape {tuple(np.shape(features))}: expected [B, T, K·H] with T = γ + 1 = {rows} (the bonus "
            f"and the draft's γ={draft.cfg.gamma} tokens, verified)"
        )
    count = jnp.asarray(correct_len, jnp.int32) + 1  # [B] commit_len
    if active is not None:
        count = jnp.where(active, count, 0)
    prefix_lens = jnp.asarray(prefix_lens, jnp.int32)
    cache = fill_context(draft, cache, features, prefix_lens, count)
    return cache, prefix_lens + count


def prefill(draft: DSparkDraft, cache: ContextCache, features: jax.Array, lengths: jax.Array) -> ContextCache:
    """Writes the prompt's context K/V at positions ``0..length−1``. Jittable.

    Args:
      draft: the :class:`~dspark_jax.draft.DSparkDraft`.
      cache: the draft context cache.
      features: ``[B, S, K·H]`` target features of the right-padded prompts.
      lengths: ``[B]`` int prompt lengths; padding rows past them are not written.
        Values are not checked (jittable): a length above ``S`` writes the ``S`` rows,
        positions past the capacity are dropped, a negative length writes nothing.

    Returns:
      The cache; the requests' ``prefix_lens`` are ``lengths``.

    Raises:
      ValueError: a shape does not match (checked while tracing).
      TypeError: ``draft`` is not a draft or ``cache`` not a :class:`ContextCache`, ``features``
        is not of a floating dtype, or ``lengths`` not of an integer dtype (bool and float are
        refused: they would be truncated silently).
    """
    _check_features(draft, cache, features, {"lengths": lengths})
    lengths = jnp.asarray(lengths, jnp.int32)
    return fill_context(draft, cache, features, jnp.zeros_like(lengths), lengths)
