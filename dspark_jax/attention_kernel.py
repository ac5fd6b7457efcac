"""Fused block attention for the draft: one or two Pallas (Triton) kernels per layer on GPUs.

Shape legend: B batch, S block rows, NH query heads, KVH key/value heads, G = NH / KVH,
D head dim, C cache capacity, L draft layers, N cache slots; R and Gp are S and G padded
(:func:`row_layout`), M = R·Gp query rows per program, P key ranges, T own keys padded.

The draft's block queries attend over each request's first ``prefix_len`` context keys and
over the block's own keys, under one softmax. :func:`attend_block` hands the kernels the
queries as ``[B, S, KVH, G, D]`` (a reshape of ``[B, S, NH, D]``: no transpose, no pad)
and the block's keys and values as they are; each program loads its ``[R, Gp, D]`` query
tile and ``[T, D]`` own-key tile with the padding rows and heads masked (zeros, nothing
read) and stores only the real rows of the ``[B, S, KVH, G, D]`` output, so between the
q/k/v projections and the output projection only the norms and RoPE run (one kernel too,
:mod:`dspark_jax.qk_norm_kernel`):

* one key range per request (batches from 32 up at the 8B shapes): program ``(b, h)``
  holds the ``M`` query rows of KV head ``h`` of request ``b``, walks the visible context in
  chunks of ``block_c`` keys with an online (flash) softmax, reading the cache where it lies
  (``[L, N, C, KVH, D]``, slot ``slots[b]``: no gather, no copy, no ``[B, NH, S, C]`` score
  tensor in memory) and stopping at ``prefix_len``, then adds the block's own keys as one
  more tile, normalises and stores its rows;
* split-K (smaller batches, :func:`num_splits`): program ``(b, h, p)`` walks key range ``p``
  only and stores its partial softmax; a second kernel, program ``(b, h, r)`` per real query
  row, loads the ``P`` partials at once, merges them, adds the own keys and normalises.

:func:`context_attention` is the context part alone (unnormalised, ranges merged by
:func:`merge_splits`), for tests and callers that add their own keys.

Chunks never read past the capacity: chunk ``j`` loads keys ``[min(j·c, C − c), … + c)`` and
masks out every position below ``j·c`` (already counted) or at or past ``prefix_len``.

:func:`kernel_supported` says when the kernels apply (a bfloat16/float16 cache, ``D`` a
power of two ≥ 16, ``C`` ≥ 16) and :func:`use_kernel` whether this trace uses them (by
default on GPU backends only); elsewhere :func:`dspark_jax.layers.attend_with_context`
computes the same attention with XLA (float32 caches, the CPU). ``interpret=True`` runs the
kernels through the Pallas interpreter on any backend (the CPU tests do).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dspark_jax.config import check_flag, is_integer
from dspark_jax.kernel_choice import KERNEL_CHOICES, env_choice, kernel_mode, triton_params
from dspark_jax.sampling import check_dtypes

if TYPE_CHECKING:
    from jax.typing import DTypeLike

ATTENTION_ENV = "DSPARK_JAX_ATTENTION"
"""Environment variable choosing the draft's context attention: ``auto`` (default: the
kernel on GPUs when :func:`kernel_supported`), ``xla`` (never the kernel) or ``pallas``
(the kernel wherever supported, the Pallas interpreter off GPUs)."""

ATTENTION_CHOICES = KERNEL_CHOICES

_NEG = -0.7 * float(jnp.finfo(jnp.float32).max)  # finite "minus infinity": exp(_NEG - m) == 0, never NaN


def attention_choice() -> str:
    """The value of :data:`ATTENTION_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(ATTENTION_ENV)


def kernel_supported(dtype: DTypeLike, head_dim: int, capacity: int) -> bool:
    """True when the kernel applies: a 16-bit float cache (tensor-core products; a float32
    product in Triton would round through tf32), ``head_dim`` a power of two ≥ 16 and
    ``capacity`` ≥ 16."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return sixteen_bit and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and capacity >= 16


def use_kernel(dtype: DTypeLike, head_dim: int, capacity: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`attention_choice`."""
    return kernel_mode(ATTENTION_ENV, kernel_supported(dtype, head_dim, capacity))


def row_layout(rows: int, group: int) -> tuple[int, int]:
    """``(R, Gp)``: a request's query rows and query heads per KV head, padded for the kernels.

    Both are powers of two (Triton tiles), ``R ≥ rows``, ``Gp ≥ group`` and ``R · Gp ≥ 16``
    (the smallest tile a tensor-core product takes). The 8B draft (7 block rows, 4 query
    heads per KV head) gets ``(8, 4)``: 32 query rows per program.
    """
    g_pad = 1 << (group - 1).bit_length()
    return max(1 << (rows - 1).bit_length(), -(-16 // g_pad)), g_pad


def _block_c(capacity: int) -> int:
    """Keys per chunk: 64, or the largest power of two ≤ ``capacity`` below that."""
    return min(64, 1 << (capacity.bit_length() - 1))


CONTEXT_KERNEL_PARAMS = (4, 3)
"""``(warps, pipeline stages)`` of the kernels that walk the context. Three stages keep a
third 64-key chunk in flight: on the H200 a layer's walk took 22.0 / 39.3 / 143.2 µs at
batches 8 / 32 / 128 against 25.6 / 44.1 / 154.9 with two (README note 55)."""

MERGE_KERNEL_PARAMS = (1, 1)
"""``(warps, pipeline stages)`` of the kernel that merges the key ranges (split-K batches)
when a row's heads are too few for tensor-core tiles (every preset): one program per query
row holds a ``[Gp, D]`` tile, too little for more warps (README note 57)."""

MERGE_TILE_KERNEL_PARAMS = (4, 2)
"""The merge kernel's ``(warps, pipeline stages)`` when a row's ``Gp >= 16`` heads take
tensor-core tiles (not measured with fewer warps)."""


def merge_kernel_params(group: int) -> tuple[int, int]:
    """The merge kernel's ``(warps, pipeline stages)`` for ``group`` (``Gp``) heads per row."""
    return MERGE_KERNEL_PARAMS if group < 16 else MERGE_TILE_KERNEL_PARAMS


TARGET_PROGRAMS = 256
"""Programs a layer's kernel aims for (about two per SM of an H100/H200): when ``B · KVH``
falls short, each request's context is split into that many key ranges (split-K)."""


def _pow2_floor(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def num_splits(batch: int, kv_heads: int, capacity: int) -> int:
    """Key ranges per ``(request, KV head)``: enough to reach :data:`TARGET_PROGRAMS`.

    With one program per ``(b, h)`` a batch-1 layer runs 8 programs, each walking the whole
    context: the kernel is latency-bound. Split ``P`` ways, program ``(b, h, p)`` walks
    chunks ``[⌊p·n/P⌋, ⌊(p + 1)·n/P⌋)`` of the ``n`` only, and a second kernel merges the
    ``P`` partial softmaxes. ``P`` is a power of two (the merge loads all ranges as one
    tile) and never exceeds ``n``, so no range is empty.
    """
    chunks = -(-capacity // _block_c(capacity))
    return _pow2_floor(min(chunks, max(1, -(-TARGET_PROGRAMS // (batch * kv_heads)))))


def _resolve_splits(splits: int | None, batch: int, kv_heads: int, capacity: int) -> int:
    """``P`` for a requested range count (default :func:`num_splits`): rounded down to a
    power of two, at most the chunk count.

    Raises:
      ValueError: ``splits`` is not an integer >= 1.
    """
    if splits is None:
        return num_splits(batch, kv_heads, capacity)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits={splits!r} is invalid: must be an integer >= 1")
    return _pow2_floor(min(splits, -(-capacity // _block_c(capacity))))


def _load(ref, idx, mask):
    """``ref[idx]``; with a mask, a masked load (zeros where it is False, nothing read there)."""
    if mask is None:
        return ref[idx]
    from jax.experimental.pallas import triton as plgpu

    return plgpu.load(ref.at[idx], mask=mask, other=0)


def _store(ref, idx, value, mask) -> None:
    """``ref[idx] = value``; with a mask, only where it is True."""
    if mask is None:
        ref[idx] = value
        return
    from jax.experimental.pallas import triton as plgpu

    plgpu.store(ref.at[idx], value, mask=mask)


def _tile_mask(shape: tuple[int, ...], real: tuple[int, ...]):
    """Mask of a tile ``shape`` whose leading dims hold ``real`` valid entries each
    (``None`` when all do): the padding rows and heads are masked in the kernels, not
    padded in memory."""
    if all(n == r for n, r in zip(shape, real, strict=False)):
        return None
    mask = jnp.ones(shape, jnp.bool_)
    for axis, r in enumerate(real):
        ids = jax.lax.broadcasted_iota(jnp.int32, shape, axis)
        mask = mask & (ids < r)
    return mask


def _row_tile(ref, b, h, rows: int, group: int):
    """Index and mask of request ``b``'s ``[R, Gp, D]`` tile of KV head ``h`` in a
    ``[B, S, KVH, G, D]`` ref (the queries, the output): rows ``≥ S`` and heads ``≥ G`` masked."""
    _, s, _, g, d = ref.shape
    return (b, pl.ds(0, rows), h, pl.ds(0, group), slice(None)), _tile_mask((rows, group, d), (s, g))


def _query_tile(q_ref, b, h, rows: int, group: int) -> jax.Array:
    """Request ``b``'s queries of KV head ``h`` from ``q_ref [B, S, KVH, G, D]`` as ``[M, D]``,
    ``M = R·Gp`` rows ordered ``(r, g)``; rows ``≥ S`` and heads ``≥ G`` are zeros."""
    return _load(q_ref, *_row_tile(q_ref, b, h, rows, group)).reshape(rows * group, q_ref.shape[-1])


def _walk_context(q, ck_ref, cv_ref, row, prefix, first, last, *, block_c, capacity, scale):
    """Online softmax of ``q [M, D]`` over chunks ``[first, last)`` of cache slot ``row``'s keys.

    Returns:
      ``(o [M, D], m [M], l [M])`` float32, unnormalised (``o = l = 0`` and ``m`` a large
      negative finite number when no chunk is walked).
    """
    rows, dim = q.shape

    def body(j, carry):
        o, m, l = carry
        start = jnp.minimum(j * block_c, capacity - block_c)
        pos = start + jnp.arange(block_c, dtype=jnp.int32)  # [c]
        visible = (pos >= j * block_c) & (pos < prefix)
        k = ck_ref[row, pl.ds(start, block_c), :]  # [c, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible[None, :], s, _NEG)  # [M, c]
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        fix = jnp.exp(m - m_new)
        v = cv_ref[row, pl.ds(start, block_c), :]  # [c, D]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return fix[:, None] * o + pv, m_new, fix * l + p.sum(axis=-1)

    init = (
        jnp.zeros((rows, dim), jnp.float32),
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    return jax.lax.fori_loop(first, last, body, init)  # no iteration when last <= first


def _finish(q, o, m, l, k_ref, v_ref, b, h, *, keys, scale) -> jax.Array:
    """Adds the block's own keys to ``(o, m, l)`` and normalises → ``[M, D]`` float32.

    ``q [M, D]``; ``k_ref``/``v_ref [B, S, KVH, D]`` the block's keys and values (all ``S``
    visible to every row). With ``M ≥ 16`` request ``b``'s keys of KV head ``h`` are one
    more tile of tensor-core products (``keys`` rows, the ``S`` real ones loaded, the rest
    masked; scores and probabilities rounded as the context's); fewer rows (the merge
    kernel's) read them one by one in float32.
    """
    own = k_ref.shape[1]
    if q.shape[0] >= 16:
        idx = (b, pl.ds(0, keys), h, slice(None))
        mask = _tile_mask((keys, q.shape[1]), (own,))
        k, v = _load(k_ref, idx, mask), _load(v_ref, idx, mask)  # [T, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(jnp.arange(keys)[None, :] < own, s, _NEG)  # [M, T]
        top = jnp.maximum(m, s.max(axis=-1))  # finite: the block is visible
        p = jnp.exp(s - top[:, None])
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        fix = jnp.exp(m - top)
        o, l = o * fix[:, None] + pv, l * fix + p.sum(axis=-1)
    else:
        q32 = q.astype(jnp.float32)
        scores = [jnp.sum(q32 * k_ref[b, t, h, :].astype(jnp.float32)[None, :], axis=1) * scale for t in range(own)]
        top = functools.reduce(jnp.maximum, scores, m)  # [M]; finite: the block is visible
        fix = jnp.exp(m - top)
        o, l = o * fix[:, None], l * fix
        for t, st in enumerate(scores):
            p = jnp.exp(st - top)  # [M]
            o = o + p[:, None] * v_ref[b, t, h, :].astype(jnp.float32)[None, :]
            l = l + p
    return o / l[:, None]


def _slot(slots_ref, ck_ref, b) -> jax.Array:
    """Request ``b``'s cache slot, clamped into ``[0, N)`` of ``ck_ref [N, C, D]``: a jitted
    caller's slots cannot be checked on the host, and an index past the cache would read
    other memory (the XLA path's gather clamps alike; ``validate_proposal_inputs`` refuses
    such slots on the host)."""
    return jnp.clip(slots_ref[b], 0, ck_ref.shape[0] - 1)


def _partials_kernel(lens_ref, slots_ref, q_ref, ck_ref, cv_ref, o_ref, m_ref, l_ref, *, splits, rows, group, **walk):
    """Program ``(b, h, p)``: chunks ``[⌊p·n/P⌋, ⌊(p + 1)·n/P⌋)`` of request ``b``'s visible context.

    ``q_ref [B, S, KVH, G, D]``, ``ck_ref``/``cv_ref [N, C, D]`` (KV head ``h`` of every
    slot) → ``o_ref [M, D]``, ``m_ref``/``l_ref [M]``.
    """
    b, h, p = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    chunks = -(-walk["capacity"] // walk["block_c"])
    first = p * chunks // splits
    prefix = jnp.minimum(lens_ref[b], walk["capacity"])
    last = jnp.minimum((p + 1) * chunks // splits, pl.cdiv(prefix, walk["block_c"]))
    q = _query_tile(q_ref, b, h, rows, group)
    o, m, l = _walk_context(q, ck_ref, cv_ref, _slot(slots_ref, ck_ref, b), prefix, first, last, **walk)
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def _whole_kernel(lens_ref, slots_ref, q_ref, ck_ref, cv_ref, k_ref, v_ref, out_ref, *, rows, group, keys, **walk):
    """Program ``(b, h)``: the whole visible context, then the block's own keys → request
    ``b``'s rows of KV head ``h`` in ``out_ref [B, S, KVH, G, D]``."""
    b, h = pl.program_id(0), pl.program_id(1)
    prefix = jnp.minimum(lens_ref[b], walk["capacity"])
    q = _query_tile(q_ref, b, h, rows, group)
    row = _slot(slots_ref, ck_ref, b)
    o, m, l = _walk_context(q, ck_ref, cv_ref, row, prefix, 0, pl.cdiv(prefix, walk["block_c"]), **walk)
    out = _finish(q, o, m, l, k_ref, v_ref, b, h, keys=keys, scale=walk["scale"])
    idx, mask = _row_tile(out_ref, b, h, rows, group)
    _store(out_ref, idx, out.reshape(rows, group, -1).astype(out_ref.dtype), mask)


def _merge_kernel(q_ref, o_ref, m_ref, l_ref, k_ref, v_ref, out_ref, *, group, keys, scale):
    """Program ``(b, h, r)``: query row ``r``'s heads. Merges the ``P`` ranges' partial
    softmaxes (``o_ref [P, Gp, D]``, ``m_ref``/``l_ref [P, Gp]``, all loaded at once), then
    adds the block's own keys → row ``r`` of ``out_ref [B, S, KVH, G, D]``."""
    b, h, r = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    g, d = q_ref.shape[3], q_ref.shape[4]
    idx = (b, r, h, pl.ds(0, group), slice(None))
    mask = _tile_mask((group, d), (g,))
    o, m, l = merge_splits(o_ref[...], m_ref[...], l_ref[...], axis=0)
    out = _finish(_load(q_ref, idx, mask), o, m, l, k_ref, v_ref, b, h, keys=keys, scale=scale)
    _store(out_ref, idx, out.astype(out_ref.dtype), mask)


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array, *, axis: int = 2) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merges ``P`` partial softmaxes over disjoint key ranges (float32; also inside a kernel).

    Args:
      o: ``[B, KVH, P, M, D]``; m, l: ``[B, KVH, P, M]``, as each range's kernel program
        wrote them (the ranges on ``axis``, which must not be the last axis of ``m``).
      axis: the ranges' axis.

    Returns:
      ``(o [B, KVH, M, D], m [B, KVH, M], l [B, KVH, M])`` over the union of the ranges.
    """
    top = m.max(axis=axis)  # [B, KVH, M]
    w = jnp.exp(m - jnp.expand_dims(top, axis))  # [B, KVH, P, M]; 0 for empty ranges next to a visible one
    return (o * w[..., None]).sum(axis=axis), top, (l * w).sum(axis=axis)


def _check_query_layout(q: jax.Array) -> None:
    """``q [B, R, KVH, Gp, D]``: ``R`` and ``Gp`` powers of two, ``R · Gp ≥ 16``."""
    rows, group = (q.shape[1], q.shape[3]) if q.ndim == 5 else (0, 0)
    pow2 = all(n >= 1 and n & (n - 1) == 0 for n in (rows, group))
    if not pow2 or rows * group < 16:
        raise ValueError(
            f"q has shape {tuple(q.shape)}: expected [B, R, KVH, G, D] with R and G powers of two and R·G >= 16 "
            "(see row_layout)"
        )


def _check_arrays(arrays: dict[str, Any]) -> None:
    """``TypeError`` naming the first of ``arrays`` (None skipped) that is no JAX or NumPy array."""
    for name, value in arrays.items():
        if value is not None and not isinstance(value, (jax.Array, np.ndarray)):
            raise TypeError(f"{name} has type {type(value).__name__}: expected a jax.Array or numpy.ndarray")


def _check_context_args(
    cache_k: Any, cache_v: Any, prefix_lens: Any, slots: Any, *, batch: int, heads: tuple[int, int], layer: Any
) -> int:
    """The checks :func:`attend_block` and :func:`context_attention` share; returns ``layer`` as an int.

    Static ones: the cache ``[L, N, C, KVH, D]`` of one floating dtype for both halves, with the
    queries' ``(KVH, D)`` = ``heads``; ``prefix_lens`` and ``slots`` ``[B]`` (``B = batch``) of an
    integer dtype, ``N == B`` without ``slots``; ``layer`` an integer in ``[0, L)`` (a Python or
    NumPy int: it picks the cache block, and an index past ``L`` would read another layer). When
    concrete (a tracer is not read), ``slots`` in ``[0, N)`` and ``prefix_lens >= 0``.

    Raises:
      ValueError: a shape, ``layer`` or a concrete value is out of line, naming it.
      TypeError: an argument is not an array or is of the wrong dtype.
    """
    _check_arrays({"cache_k": cache_k, "cache_v": cache_v, "prefix_lens": prefix_lens, "slots": slots})
    if cache_k.ndim != 5 or 0 in cache_k.shape:
        raise ValueError(f"cache_k has shape {tuple(cache_k.shape)}: expected [L, N, C, KVH, D], none of them 0")
    if tuple(cache_v.shape) != tuple(cache_k.shape):
        raise ValueError(f"cache_v has shape {tuple(cache_v.shape)}: expected cache_k's {tuple(cache_k.shape)}")
    layers, n_slots, _, kvh, d = cache_k.shape
    if (kvh, d) != heads:
        raise ValueError(
            f"the queries' (KVH, D) = {heads} do not fit the cache's (KVH, D) = {(kvh, d)} (cache_k "
            f"{tuple(cache_k.shape)} is [L, N, C, KVH, D])"
        )
    # the kernel attends over them: integer keys and values give meaningless scores
    check_dtypes({"cache_k": (cache_k, jnp.floating), "cache_v": (cache_v, jnp.floating)})
    if cache_v.dtype != cache_k.dtype:
        raise TypeError(f"cache_v has dtype {cache_v.dtype}: expected cache_k's {cache_k.dtype}")
    for name, value in (("prefix_lens", prefix_lens), ("slots", slots)):
        if value is not None and tuple(value.shape) != (batch,):
            raise ValueError(f"{name} has shape {tuple(value.shape)}: expected [B] = ({batch},) like q")
    if slots is None and n_slots != batch:
        raise ValueError(
            f"the cache has N={n_slots} slots and q B={batch} requests: without slots, N must equal B "
            "(request b in slot b)"
        )
    # a float length or slot would be truncated silently
    check_dtypes({"prefix_lens": (prefix_lens, jnp.integer), "slots": (slots, jnp.integer)})
    if not is_integer(layer) or not 0 <= layer < layers:
        raise ValueError(f"layer={layer!r} is invalid: must be an integer in [0, {layers}) (the cache's L)")
    _check_concrete("slots", slots, 0, n_slots - 1, f"cache slot ids in [0, {n_slots})")
    _check_concrete("prefix_lens", prefix_lens, 0, None, ">= 0 (past C reads all of C)")
    return int(layer)


def _check_concrete(name: str, value: Any, lo: int, hi: int | None, allowed: str) -> None:
    """``ValueError`` for the first entry of a concrete ``value`` outside ``[lo, hi]``; None and
    tracers are skipped (nothing is added to a traced program; the kernel clamps such slots)."""
    if value is None or isinstance(value, jax.core.Tracer):
        return
    values = np.asarray(value)
    bad = (values < lo) | (values > hi) if hi is not None else values < lo
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}]={int(values[i])} is out of range: must be {allowed}")


def _whole(shape: tuple[int, ...]) -> pl.BlockSpec:
    """The whole array for every program (each indexes its own part)."""
    return pl.BlockSpec(shape, lambda *_: (0,) * len(shape))


def _context_inputs(q: jax.Array, cache_k: jax.Array, layer: int) -> tuple[dict, list[pl.BlockSpec]]:
    """The walk's parameters and the specs of ``(prefix_lens, slots, q, cache_k, cache_v)``
    for a grid ``(b, h, …)``: ``q [B, S, KVH, G, D]`` whole (each program loads its
    ``[R, Gp, D]`` tile, padding masked), the cache's KV head ``h`` of every slot of layer
    ``layer`` read in place."""
    b, s, _, g, d = q.shape
    n_slots, capacity = cache_k.shape[1], cache_k.shape[2]
    rows, group = row_layout(s, g)
    walk = {"block_c": _block_c(capacity), "capacity": capacity, "scale": d**-0.5, "rows": rows, "group": group}
    cache_spec = pl.BlockSpec((None, n_slots, capacity, None, d), lambda i, h, *_: (layer, 0, 0, h, 0))
    per_request = pl.BlockSpec((b,), lambda i, h, *_: (0,))
    return walk, [per_request, per_request, _whole(q.shape), cache_spec, cache_spec]


def _partials(q, cache_k, cache_v, prefix_lens, slots, *, layer, splits, interpret):
    """The partial-softmax kernel over ``q [B, S, KVH, G, D]``: ``(o [B, KVH, P, M, D], m, l [B, KVH, P, M])``."""
    b, _, kvh, _, d = q.shape
    walk, in_specs = _context_inputs(q, cache_k, layer)
    m_rows = walk["rows"] * walk["group"]
    row_spec = pl.BlockSpec((None, None, None, m_rows), lambda i, h, p: (i, h, p, 0))
    return pl.pallas_call(
        functools.partial(_partials_kernel, splits=splits, **walk),
        grid=(b, kvh, splits),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec((None, None, None, m_rows, d), lambda i, h, p: (i, h, p, 0, 0)), row_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, splits, m_rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, m_rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, m_rows), jnp.float32),
        ],
        interpret=interpret,
        name="dspark_context_attention",
        **triton_params(*CONTEXT_KERNEL_PARAMS, interpret),
    )(prefix_lens.astype(jnp.int32), slots.astype(jnp.int32), q, cache_k, cache_v)


def context_attention(
    q: jax.Array,
    cache_k: jax.Array,
    cache_v: jax.Array,
    prefix_lens: jax.Array,
    slots: jax.Array | None = None,
    *,
    layer: int,
    interpret: bool = False,
    splits: int | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block queries over layer ``layer``'s context keys ``< prefix_len``, unnormalised.

    Args:
      q: ``[B, R, KVH, G, D]`` each request's ``R`` query rows of the ``G`` query heads
        of each KV head (``R`` and ``G`` powers of two, ``R·G ≥ 16``: pad with
        :func:`row_layout`; the kernel applies ``D**-0.5``).
      cache_k, cache_v: ``[L, N, C, KVH, D]`` the whole context cache of ``N`` slots (read
        in place).
      prefix_lens: ``[B]`` int32 context lengths (values past ``C`` read all of ``C``).
      slots: ``[B]`` int32 cache slot of each request (default: request ``b`` in slot ``b``,
        which needs ``N == B``); the kernel reads those slots without gathering them.
      layer: which of the ``L`` layers.
      interpret: run through the Pallas interpreter (any backend).
      splits: key ranges per ``(request, KV head)`` (default :func:`num_splits`), rounded
        down to a power of two and to at most the chunk count (ranges are whole chunks).

    Returns:
      ``(o [B, KVH, M, D], m [B, KVH, M], l [B, KVH, M])`` float32 with ``M = R·G`` rows
      ordered ``(r, g)``: ``o = Σ exp(s − m)·v`` and ``l = Σ exp(s − m)`` over the visible
      context keys, ``m`` their running max (a large negative finite number and
      ``o = l = 0`` when none is visible).

    Raises:
      ValueError: ``q``'s layout or ``splits`` is invalid, the shapes do not fit together as
        above, ``layer`` is not an integer in ``[0, L)``, or (concrete values) a slot is outside
        ``[0, N)`` or a length negative.
      TypeError: an argument is not an array, ``q`` or the cache is not of a floating dtype
        (``cache_v`` not of ``cache_k``'s), ``prefix_lens`` or ``slots`` not of an integer one,
        or ``interpret`` is not a bool.
    """
    check_flag("interpret", interpret)
    _check_arrays({"q": q})
    _check_query_layout(q)
    check_dtypes({"q": (q, jnp.floating)})
    b, _, kvh, _, d = q.shape
    layer = _check_context_args(cache_k, cache_v, prefix_lens, slots, batch=b, heads=(kvh, d), layer=layer)
    splits = _resolve_splits(splits, b, kvh, cache_k.shape[2])
    return _context_attention(q, cache_k, cache_v, prefix_lens, slots, layer=layer, interpret=interpret, splits=splits)


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "splits"))
def _context_attention(q, cache_k, cache_v, prefix_lens, slots, *, layer, interpret, splits):
    """:func:`context_attention` on checked inputs, ``splits`` resolved."""
    slots = jnp.arange(q.shape[0], dtype=jnp.int32) if slots is None else slots
    o, m, l = _partials(q, cache_k, cache_v, prefix_lens, slots, layer=layer, splits=splits, interpret=interpret)
    if splits == 1:
        return o[:, :, 0], m[:, :, 0], l[:, :, 0]
    return merge_splits(o, m, l)


def attend_block(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    cache_k: jax.Array,
    cache_v: jax.Array,
    prefix_lens: jax.Array,
    layer: int,
    slots: jax.Array | None = None,
    interpret: bool = False,
    splits: int | None = None,
) -> jax.Array:
    """Block attention over context plus own keys: ``[B, S, NH, D]`` → ``[B, S, NH·D]``.

    Same function as :func:`dspark_jax.layers.attend_with_context` with
    ``ctx_mask = arange(C) < prefix_len``. With one key range per request (batches from 32
    up at the 8B shapes) it is one kernel: program ``(b, h)`` walks the context, adds the
    block's own keys, normalises and writes its rows of the output. With split-K, the
    ranges' kernel is followed by one that merges them and does the rest.

    Args:
      q: ``[B, S, NH, D]`` roped, normed queries.
      k, v: ``[B, S, KVH, D]`` the block's own keys and values.
      cache_k, cache_v: ``[L, N, C, KVH, D]``.
      prefix_lens: ``[B]``.
      layer: the layer's index into the cache.
      slots: ``[B]`` cache slot of each request (default ``b``).
      interpret, splits: see :func:`context_attention`.

    Returns:
      ``[B, S, NH·D]`` in ``q.dtype``.

    Raises:
      ValueError: the shapes do not fit together as above (``NH`` a multiple of the cache's
        ``KVH``), ``layer`` is not an integer in ``[0, L)``, ``splits`` is invalid, or (concrete
        values) a slot is outside ``[0, N)`` or a length negative.
      TypeError: an argument is not an array, ``q``, ``k``, ``v`` or the cache is not of a
        floating dtype (``cache_v`` not of ``cache_k``'s), ``prefix_lens`` or ``slots`` not of
        an integer one, or ``interpret`` is not a bool.
    """
    check_flag("interpret", interpret)
    _check_arrays({"q": q, "k": k, "v": v})
    if q.ndim != 4 or q.shape[1] < 1 or k.ndim != 4 or k.shape[2] < 1 or q.shape[2] % k.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)}: expected q [B, S, NH, D] with S >= 1 and k "
            "[B, S, KVH, D] with NH a multiple of KVH >= 1"
        )
    b, s, nh, d = q.shape
    kvh = k.shape[2]
    for name, value in (("k", k), ("v", v)):
        if tuple(value.shape) != (b, s, kvh, d):
            raise ValueError(f"{name} has shape {tuple(value.shape)}: expected [B, S, KVH, D] = {(b, s, kvh, d)}")
    # cast to the cache's dtype below: integer queries or keys would be taken as they are
    check_dtypes({"q": (q, jnp.floating), "k": (k, jnp.floating), "v": (v, jnp.floating)})
    layer = _check_context_args(cache_k, cache_v, prefix_lens, slots, batch=b, heads=(kvh, d), layer=layer)
    g = nh // kvh
    capacity = cache_k.shape[2]
    q5 = q.reshape(b, s, kvh, g, d).astype(cache_k.dtype)  # [B, S, KVH, G, D]: a reshape, no copy
    k, v = k.astype(cache_k.dtype), v.astype(cache_k.dtype)
    slots = jnp.arange(b, dtype=jnp.int32) if slots is None else slots.astype(jnp.int32)
    splits = _resolve_splits(splits, b, kvh, capacity)
    out_shape = jax.ShapeDtypeStruct(q5.shape, q.dtype)
    keys = max(16, 1 << (s - 1).bit_length())  # own keys as one tensor-core tile
    if splits == 1:
        walk, in_specs = _context_inputs(q5, cache_k, layer)
        out = pl.pallas_call(
            functools.partial(_whole_kernel, keys=keys, **walk),
            grid=(b, kvh),
            in_specs=[*in_specs, _whole(k.shape), _whole(v.shape)],
            out_specs=_whole(out_shape.shape),
            out_shape=out_shape,
            interpret=interpret,
            name="dspark_block_attention",
            **triton_params(*CONTEXT_KERNEL_PARAMS, interpret),
        )(prefix_lens.astype(jnp.int32), slots, q5, cache_k, cache_v, k, v)
    else:
        o, m, l = _partials(q5, cache_k, cache_v, prefix_lens, slots, layer=layer, splits=splits, interpret=interpret)
        group = row_layout(s, g)[1]
        part_spec = pl.BlockSpec((None, None, splits, group), lambda i, h, r: (i, h, 0, r))  # [P, Gp]
        out = pl.pallas_call(
            functools.partial(_merge_kernel, group=group, keys=keys, scale=d**-0.5),
            grid=(b, kvh, s),  # the real rows only
            in_specs=[
                _whole(q5.shape),
                pl.BlockSpec((None, None, splits, group, d), lambda i, h, r: (i, h, 0, r, 0)),  # [P, Gp, D]
                part_spec,
                part_spec,
                _whole(k.shape),
                _whole(v.shape),
            ],
            out_specs=_whole(out_shape.shape),
            out_shape=out_shape,
            interpret=interpret,
            name="dspark_merge_attention",
            **triton_params(*merge_kernel_params(group), interpret),
        )(q5, o, m, l, k, v)
    return out.reshape(b, s, nh * d)
