"""A layer's q/k RMS norms and RoPE as one Pallas (Triton) kernel on GPUs.

Shape legend: B batch, S block rows, NH query heads, KVH key/value heads, D head dim,
Hq = NH + 2·KVH heads of the fused projection, P a head count padded to a power of two.

XLA runs a draft layer's query and key preparation (:meth:`dspark_jax.layers.Attention.query`
and ``key_value``: the per-head RMS norm, then the neox rotary embedding) as five small
kernels per layer on the H200 (each norm, each rotation's concatenate, the values' slice),
every one reading the fused q/k/v product. :func:`project_qkv` runs the product once
(:meth:`~dspark_jax.layers.Attention.qkv`) and hands it to one kernel: program ``(b, s)``
loads row ``s`` of request ``b`` (all ``Hq`` heads, each as its two halves), normalises the
query and key heads, rotates them and stores queries, keys and values. The rotary cosines and
sines come in one array (:func:`rotary_table`): XLA computes them in one kernel (at batch 1 on
the H200 it ran the cosine and the sine as two, README note 69).

Same operations in the same order as :class:`~dspark_jax.layers.RMSNorm` and
:func:`~dspark_jax.layers.rope` (float32 statistics, the normalised value rounded to the
model dtype before the weight multiplies it, the rotation in float32, rounded once). Inside
one jitted program XLA may skip some of those roundings (excess precision: a quarter of the
bfloat16 outputs of the XLA path differ by one unit in the last place between eager and
jitted execution), so the kernel and the XLA path agree to bfloat16 rounding, not bit for
bit (tested against both and a float64 reference).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _load, _store, _whole
from dspark_jax.kernel_choice import pow2_ceil, triton_params
from dspark_jax.layers import Attention, rope_angles


def _heads(b, s, first: int, count: int, half: int, upper: bool):
    """Index and mask of heads ``[first, first + count)`` of row ``(b, s)``, one half of ``D``,
    padded to ``P`` heads (the padding masked: nothing read or written there)."""
    padded = pow2_ceil(count)
    idx = (b, s, pl.ds(first, padded), pl.ds(half if upper else 0, half))
    if padded == count:
        return idx, None
    return idx, jax.lax.broadcasted_iota(jnp.int32, (padded, half), 0) < count


def _kernel(qkv_ref, qw_ref, kw_ref, rot_ref, q_ref, k_ref, v_ref, *, nh, kvh, eps):
    """Program ``(b, s)``: ``qkv_ref [B, S, Hq, D]``, the norms' weights ``[D]``, the rotary table
    ``[B, S, D]`` (cosines, then sines) → ``q_ref [B, S, NH, D]``, ``k_ref``/``v_ref [B, S, KVH, D]``."""
    b, s = pl.program_id(0), pl.program_id(1)
    dim = qkv_ref.shape[-1]
    half = dim // 2
    cos = rot_ref[b, s, pl.ds(0, half)][None, :]  # [1, D/2] float32
    sin = rot_ref[b, s, pl.ds(half, half)][None, :]
    dtype = q_ref.dtype

    def norm_rope(first, count, w_ref, out_ref):
        (lo_idx, mask), (hi_idx, _) = (_heads(b, s, first, count, half, upper) for upper in (False, True))
        lo = _load(qkv_ref, lo_idx, mask).astype(jnp.float32)  # [P, D/2]
        hi = _load(qkv_ref, hi_idx, mask).astype(jnp.float32)
        mean = (jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1)) / dim  # [P]
        inv = jax.lax.rsqrt(mean + eps)[:, None]
        w_lo = w_ref[pl.ds(0, half)].astype(dtype)[None, :]
        w_hi = w_ref[pl.ds(half, half)].astype(dtype)[None, :]
        x1 = (w_lo * (lo * inv).astype(dtype)).astype(jnp.float32)  # RMSNorm's rounding order
        x2 = (w_hi * (hi * inv).astype(dtype)).astype(jnp.float32)
        out_lo, out_hi = (x1 * cos - x2 * sin).astype(dtype), (x2 * cos + x1 * sin).astype(dtype)
        for upper, value in ((False, out_lo), (True, out_hi)):
            idx, out_mask = _heads(b, s, 0, count, half, upper)
            _store(out_ref, idx, value, out_mask)

    norm_rope(0, nh, qw_ref, q_ref)
    norm_rope(nh, kvh, kw_ref, k_ref)
    for upper in (False, True):  # the values, copied
        idx, mask = _heads(b, s, nh + kvh, kvh, half, upper)
        out_idx, _ = _heads(b, s, 0, kvh, half, upper)
        _store(v_ref, out_idx, _load(qkv_ref, idx, mask), mask)


@functools.partial(jax.jit, static_argnames=("num_heads", "num_kv_heads", "eps", "interpret"))
def qk_norm_rope(
    qkv: jax.Array,
    q_weight: jax.Array,
    k_weight: jax.Array,
    rotary: jax.Array,
    *,
    num_heads: int,
    num_kv_heads: int,
    eps: float,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Normed, roped queries and keys, and the values, from the fused q/k/v product.

    Args:
      qkv: ``[B, S, Hq·D]`` the raw projections side by side (queries, keys, values).
      q_weight, k_weight: ``[D]`` the q and k RMS norms' weights.
      rotary: ``[B, S, D]`` float32, the rows' rotary cosines then sines (:func:`rotary_table`).
      num_heads, num_kv_heads: ``NH`` and ``KVH``.
      eps: the norms' epsilon.
      interpret: run through the Pallas interpreter (any backend).

    Returns:
      ``(q [B, S, NH, D], k [B, S, KVH, D], v [B, S, KVH, D])`` in ``qkv.dtype``.

    Raises:
      ValueError: the shapes do not fit together.
    """
    b, s, width = qkv.shape
    heads = num_heads + 2 * num_kv_heads
    dim = width // heads
    if width != heads * dim or dim % 2 or rotary.shape != (b, s, dim):
        raise ValueError(
            f"qk_norm_rope got qkv {tuple(qkv.shape)}, rotary {tuple(rotary.shape)} for "
            f"{num_heads} query and {num_kv_heads} key/value heads: expected qkv [B, S, (NH + 2·KVH)·D] with D "
            "even and rotary [B, S, D]"
        )
    qkv4 = qkv.reshape(b, s, heads, dim)
    room = num_heads + num_kv_heads + pow2_ceil(num_kv_heads)  # the values' padded tile must lie inside
    if room > heads:  # KVH not a power of two: zero heads appended (the padding is masked anyway)
        qkv4 = jnp.pad(qkv4, ((0, 0), (0, 0), (0, room - heads), (0, 0)))
    out_shape = [
        jax.ShapeDtypeStruct((b, s, num_heads, dim), qkv.dtype),
        jax.ShapeDtypeStruct((b, s, num_kv_heads, dim), qkv.dtype),
        jax.ShapeDtypeStruct((b, s, num_kv_heads, dim), qkv.dtype),
    ]
    return pl.pallas_call(
        functools.partial(_kernel, nh=num_heads, kvh=num_kv_heads, eps=eps),
        grid=(b, s),
        in_specs=[_whole(qkv4.shape), _whole((dim,)), _whole((dim,)), _whole(rotary.shape)],
        out_specs=[_whole(o.shape) for o in out_shape],
        out_shape=out_shape,
        interpret=interpret,
        name="dspark_qk_norm_rope",
        **triton_params(4, 1, interpret),
    )(qkv4, q_weight, k_weight, rotary.astype(jnp.float32))


def rotary_table(positions: jax.Array, head_dim: int, theta: float) -> jax.Array:
    """``[B, S, D]`` float32: :func:`~dspark_jax.layers.rope_angles`' cosines then sines side by side,
    for :func:`qk_norm_rope` (one array, so that XLA computes both in one kernel)."""
    return jnp.concatenate(rope_angles(positions, head_dim, theta), axis=-1)


def project_qkv(
    attn: Attention, x: jax.Array, positions: jax.Array, *, interpret: bool = False
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """:meth:`~dspark_jax.layers.Attention.query` and ``key_value`` of ``x [B, S, H]`` through
    :func:`qk_norm_rope` (a ``project_fn`` of :meth:`~dspark_jax.layers.DecoderLayer.with_attention`).

    Returns:
      ``(q [B, S, NH, D], k [B, S, KVH, D], v [B, S, KVH, D])``.
    """
    return qk_norm_rope(
        attn.qkv(x),
        attn.q_norm.weight[...],
        attn.k_norm.weight[...],
        rotary_table(positions, attn.head_dim, attn.rope_theta),
        num_heads=attn.num_heads,
        num_kv_heads=attn.num_kv_heads,
        eps=attn.q_norm.eps,
        interpret=interpret,
    )
