"""Fused context attention for the draft block: one Pallas (Triton) kernel per layer on GPUs.

Shape legend: B batch, S block rows, NH query heads, KVH key/value heads, G = NH / KVH,
D head dim, C cache capacity, L draft layers, M = G·S query rows per KV head padded to a
power of two (at least 16, the smallest tile a tensor-core product takes).

The draft's block queries attend over each request's first ``prefix_len`` context keys and
over the block's own keys, under one softmax. :func:`context_attention` does the context
part in one kernel launch per layer: program ``(b, h, p)`` holds the ``M`` query rows of KV
head ``h`` of request ``b`` and walks key range ``p`` of that request's context (split-K:
small batches split each context into :func:`num_splits` ranges so that the layer runs
enough programs to fill the GPU) in chunks of ``block_c`` keys with an online (flash)
softmax, reading the cache where it lies (``[L, N, C, KVH, D]``, slot ``slots[b]``: no
gather, no copy, no transpose, no ``[B, NH, S, C]`` score tensor in memory) and stopping
at ``prefix_len``, so unused capacity is never read; :func:`merge_splits` combines the
ranges' partial softmaxes. It returns the unnormalised output with its running max and
sum; :func:`merge_own_keys` adds the block's own keys (``S`` of them, always visible) and
normalises, in float32.

Chunks never read past the capacity: chunk ``j`` loads keys ``[min(j·c, C − c), … + c)`` and
masks out every position below ``j·c`` (already counted) or at or past ``prefix_len``.

:func:`kernel_supported` says when the kernel applies (a bfloat16/float16 cache, ``D`` a
power of two ≥ 16, ``C`` ≥ 16) and :func:`use_kernel` whether this trace uses it (by default
on GPU backends only); elsewhere :func:`dspark_jax.layers.attend_with_context` computes the same
attention with XLA (float32 caches, the CPU). ``interpret=True`` runs the kernel through the Pallas interpreter on any
backend (the CPU tests do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.kernel_choice import KERNEL_CHOICES, env_choice, kernel_mode

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


def kernel_supported(dtype, head_dim: int, capacity: int) -> bool:
    """True when the kernel applies: a 16-bit float cache (tensor-core products; a float32
    product in Triton would round through tf32), ``head_dim`` a power of two ≥ 16 and
    ``capacity`` ≥ 16."""
    sixteen_bit = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return sixteen_bit and head_dim >= 16 and head_dim & (head_dim - 1) == 0 and capacity >= 16


def use_kernel(dtype, head_dim: int, capacity: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`attention_choice`."""
    return kernel_mode(ATTENTION_ENV, kernel_supported(dtype, head_dim, capacity))


def _padded_rows(rows: int) -> int:
    return max(16, 1 << (rows - 1).bit_length())


def _block_c(capacity: int) -> int:
    """Keys per chunk: 64, or the largest power of two ≤ ``capacity`` below that."""
    return min(64, 1 << (capacity.bit_length() - 1))


TARGET_PROGRAMS = 256
"""Programs a layer's kernel aims for (about two per SM of an H100/H200): when ``B · KVH``
falls short, each request's context is split into that many key ranges (split-K)."""


def num_splits(batch: int, kv_heads: int, capacity: int) -> int:
    """Key ranges per ``(request, KV head)``: enough to reach :data:`TARGET_PROGRAMS`.

    With one program per ``(b, h)`` a batch-1 layer runs 8 programs, each walking the whole
    context: the kernel is latency-bound. Split ``P`` ways, program ``(b, h, p)`` walks
    chunks ``[p · n, (p + 1) · n)`` only and the ``P`` partial softmaxes are merged after it.
    ``P`` never exceeds the number of chunks, and no range is left empty.
    """
    chunks = -(-capacity // _block_c(capacity))
    want = min(chunks, max(1, -(-TARGET_PROGRAMS // (batch * kv_heads))))
    per = -(-chunks // want)  # chunks per range
    return -(-chunks // per)


def _kernel(lens_ref, rows_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, block_c, capacity, per, scale):
    """Program ``(b, h, p)``: ``q_ref [M, D]``, ``k_ref``/``v_ref [slots, C, D]`` → ``o [M, D]``, ``m``/``l [M]``.

    Walks chunks ``[p · per, (p + 1) · per)`` of request ``b``'s visible context (none when
    the range starts past ``prefix_len``).
    """
    b = pl.program_id(0)
    first = pl.program_id(2) * per
    row = rows_ref[b]  # the cache slot holding request b's context
    prefix = jnp.minimum(lens_ref[b], capacity)
    q = q_ref[...]  # [M, D]
    rows, dim = q.shape

    def body(j, carry):
        o, m, l = carry
        start = jnp.minimum(j * block_c, capacity - block_c)
        pos = start + jnp.arange(block_c, dtype=jnp.int32)  # [c]
        visible = (pos >= j * block_c) & (pos < prefix)
        k = k_ref[row, pl.ds(start, block_c), :]  # [c, D]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        s = jnp.where(visible[None, :], s, _NEG)  # [M, c]
        m_new = jnp.maximum(m, s.max(axis=-1))
        p = jnp.exp(s - m_new[:, None])
        fix = jnp.exp(m - m_new)
        v = v_ref[row, pl.ds(start, block_c), :]  # [c, D]
        pv = jax.lax.dot_general(p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
        return fix[:, None] * o + pv, m_new, fix * l + p.sum(axis=-1)

    init = (
        jnp.zeros((rows, dim), jnp.float32),
        jnp.full((rows,), _NEG, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
    last = jnp.minimum(first + per, pl.cdiv(prefix, block_c))
    o, m, l = jax.lax.fori_loop(first, last, body, init)  # no iteration when last <= first
    o_ref[...] = o
    m_ref[...] = m
    l_ref[...] = l


def merge_splits(o: jax.Array, m: jax.Array, l: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Merges ``P`` partial softmaxes over disjoint key ranges (float32).

    Args:
      o: ``[B, KVH, P, M, D]``; m, l: ``[B, KVH, P, M]``, as each range's kernel program wrote them.

    Returns:
      ``(o [B, KVH, M, D], m [B, KVH, M], l [B, KVH, M])`` over the union of the ranges.
    """
    top = m.max(axis=2)  # [B, KVH, M]
    w = jnp.exp(m - top[:, :, None])  # [B, KVH, P, M]; 0 for empty ranges next to a visible one
    return (o * w[..., None]).sum(axis=2), top, (l * w).sum(axis=2)


@functools.partial(jax.jit, static_argnames=("layer", "interpret", "splits"))
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
      q: ``[B, KVH, M, D]`` queries grouped by KV head (pre-scaled by nothing; the kernel
        applies ``D**-0.5``), ``M`` a power of two ≥ 16.
      cache_k, cache_v: ``[L, N, C, KVH, D]`` the whole context cache of ``N`` slots (read
        in place).
      prefix_lens: ``[B]`` int32 context lengths (values past ``C`` read all of ``C``).
      slots: ``[B]`` int32 cache slot of each request (default: request ``b`` in slot ``b``,
        which needs ``N == B``); the kernel reads those slots without gathering them.
      layer: which of the ``L`` layers.
      interpret: run through the Pallas interpreter (any backend).
      splits: key ranges per ``(request, KV head)`` (default :func:`num_splits`); ranges
        are whole chunks, so more than the chunk count gives the chunk count.

    Returns:
      ``(o [B, KVH, M, D], m [B, KVH, M], l [B, KVH, M])`` float32: ``o = Σ exp(s − m)·v``
      and ``l = Σ exp(s − m)`` over the visible context keys, ``m`` their running max
      (a large negative finite number and ``o = l = 0`` when none is visible).
    """
    b, kvh, rows, d = q.shape
    n_slots, capacity = cache_k.shape[1], cache_k.shape[2]
    if slots is None:
        slots = jnp.arange(b, dtype=jnp.int32)
    block_c = _block_c(capacity)
    chunks = -(-capacity // block_c)
    if splits is None:
        splits = num_splits(b, kvh, capacity)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise ValueError(f"splits={splits!r} is invalid: must be an integer >= 1")
    per = -(-chunks // splits)
    splits = -(-chunks // per)  # no empty range
    kernel = functools.partial(_kernel, block_c=block_c, capacity=capacity, per=per, scale=d**-0.5)
    kv_spec = pl.BlockSpec((None, n_slots, capacity, None, d), lambda i, h, p: (layer, 0, 0, h, 0))
    row_spec = pl.BlockSpec((None, None, None, rows), lambda i, h, p: (i, h, p, 0))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params["compiler_params"] = plgpu.CompilerParams(num_warps=4, num_stages=2)
    o, m, l = pl.pallas_call(
        kernel,
        grid=(b, kvh, splits),
        in_specs=[
            pl.BlockSpec((b,), lambda i, h, p: (0,)),
            pl.BlockSpec((b,), lambda i, h, p: (0,)),
            pl.BlockSpec((None, None, rows, d), lambda i, h, p: (i, h, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[pl.BlockSpec((None, None, None, rows, d), lambda i, h, p: (i, h, p, 0, 0)), row_spec, row_spec],
        out_shape=[
            jax.ShapeDtypeStruct((b, kvh, splits, rows, d), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
            jax.ShapeDtypeStruct((b, kvh, splits, rows), jnp.float32),
        ],
        interpret=interpret,
        name="dspark_context_attention",
        **params,
    )(prefix_lens.astype(jnp.int32), slots.astype(jnp.int32), q, cache_k, cache_v)
    if splits == 1:
        return o[:, :, 0], m[:, :, 0], l[:, :, 0]
    return merge_splits(o, m, l)


def merge_own_keys(qg: jax.Array, o: jax.Array, m: jax.Array, l: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    """Adds the block's own keys to the context part and normalises (float32).

    Args:
      qg: ``[B, KVH, M, D]`` the grouped queries given to :func:`context_attention`.
      o, m, l: its outputs.
      k, v: ``[B, S, KVH, D]`` the block's own keys and values (always visible).

    Returns:
      ``[B, KVH, M, D]`` float32 attention output.
    """
    scale = qg.shape[-1] ** -0.5
    own = jnp.einsum("bkmd,btkd->bkmt", qg, k, preferred_element_type=jnp.float32) * scale  # [B, KVH, M, S]
    top = jnp.maximum(m, own.max(-1))  # [B, KVH, M]
    ctx_w = jnp.exp(m - top)
    own_p = jnp.exp(own - top[..., None])
    own_o = jnp.einsum("bkmt,btkd->bkmd", own_p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    denom = l * ctx_w + own_p.sum(-1)
    return (o * ctx_w[..., None] + own_o) / denom[..., None]


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
    """Block attention over context (kernel) plus own keys: ``[B, S, NH, D]`` → ``[B, S, NH·D]``.

    Same function as :func:`dspark_jax.layers.attend_with_context` with
    ``ctx_mask = arange(C) < prefix_len``.

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
    """
    b, s, nh, d = q.shape
    kvh = k.shape[2]
    g = nh // kvh
    rows = _padded_rows(g * s)
    qg = q.reshape(b, s, kvh, g, d).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * s, d)  # [B, KVH, G·S, D]
    qg = jnp.pad(qg, ((0, 0), (0, 0), (0, rows - g * s), (0, 0))).astype(cache_k.dtype)
    o, m, l = context_attention(
        qg, cache_k, cache_v, prefix_lens, slots, layer=layer, interpret=interpret, splits=splits
    )
    out = merge_own_keys(qg, o, m, l, k.astype(qg.dtype), v.astype(qg.dtype))[:, :, : g * s]
    return out.reshape(b, kvh, g, s, d).transpose(0, 3, 1, 2, 4).reshape(b, s, nh * d).astype(q.dtype)
