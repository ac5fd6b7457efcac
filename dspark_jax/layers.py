"""Transformer building blocks shared by the draft and the target (Flax NNX).

Shape legend:
  B  batch             S  query rows          L  key positions
  H  hidden size       NH query heads         KVH key/value heads
  D  head dim          G  NH // KVH           I  intermediate size
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import is_real
from dspark_jax.sampling import check_dtypes


def _check_arrays(fn: str, arrays: dict[str, Any]) -> None:
    """Raises ``TypeError`` naming the first of ``arrays`` (``name: value``) that is not a JAX or
    NumPy array (a list has no static shape to check; a tracer is a ``jax.Array``)."""
    for name, value in arrays.items():
        if not isinstance(value, (jax.Array, np.ndarray)):
            raise TypeError(f"{fn}: {name} has type {type(value).__name__}: expected a jax.Array or numpy.ndarray")


def _check_theta(theta: Any) -> None:
    """``theta`` must be a finite number > 0: a Python or NumPy real (checked), or a scalar
    ``jax.Array`` (its value checked when concrete, a tracer's not)."""
    if is_real(theta):
        value = float(theta)
    elif isinstance(theta, jax.Array) and theta.ndim == 0 and not jnp.issubdtype(theta.dtype, jnp.bool_):
        if isinstance(theta, jax.core.Tracer):
            return
        value = float(theta)
    else:
        raise TypeError(f"rope: theta={theta!r} has type {type(theta).__name__}: expected a finite number > 0")
    if not 0 < value < math.inf:
        raise ValueError(f"rope: theta={theta!r} is invalid: must be a finite number > 0")


class RMSNorm(nnx.Module):
    """Root-mean-square norm over the last axis.

    The statistics are computed in float32; the normalised activations are cast back
    to the input dtype before the weight multiplies them (the Hugging Face Qwen3
    rounding order, so bfloat16 outputs match the PyTorch reference bit for bit more
    often). The weight is stored in ``param_dtype``.
    """

    def __init__(self, dim: int, *, eps: float, param_dtype=jnp.float32, rngs: nnx.Rngs | None = None):
        del rngs
        self.weight = nnx.Param(jnp.ones((dim,), param_dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        """``[..., dim]`` → ``[..., dim]`` in ``x.dtype``."""
        x32 = x.astype(jnp.float32)
        normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)).astype(x.dtype)
        return self.weight[...].astype(x.dtype) * normed


def rope_angles(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)``, each ``[B, S, D/2]`` float32, of the rotary angles at ``positions [B, S]``."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim))  # [D/2]
    angles = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, D/2]
    return jnp.cos(angles), jnp.sin(angles)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Neox-style rotary embedding over the whole head dim.

    Args:
      x: ``[B, S, heads, D]``.
      positions: ``[B, S]`` integer positions.
      theta: ``rope_theta``.

    Returns:
      ``[B, S, heads, D]`` in ``x.dtype``.

    Raises:
      ValueError: ``x`` is not 4-D with an even ``D``, ``positions`` is not ``[B, S]``
        (checked on static shapes: nothing is added to a traced program), or ``theta`` is not
        a finite number > 0 (a concrete one; a traced scalar is not read).
      TypeError: ``x`` or ``positions`` is not an array (a list), ``x`` is not of a floating
        dtype, ``positions`` not of an integer one (a float position would be rotated as is,
        not as the integer the model saw), or ``theta`` is not a number.
    """
    _check_arrays("rope", {"x": x, "positions": positions})
    check_dtypes({"rope: x": (x, jnp.floating), "rope: positions": (positions, jnp.integer)})
    _check_theta(theta)
    if x.ndim != 4 or x.shape[-1] % 2:
        raise ValueError(f"rope: x has shape {tuple(x.shape)}: expected [B, S, heads, D] with an even D")
    if tuple(positions.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"rope: positions has shape {tuple(positions.shape)}: expected [B, S] = {tuple(x.shape[:2])} like x"
        )
    d = x.shape[-1]
    cos, sin = rope_angles(positions, d, theta)
    cos, sin = cos[:, :, None, :], sin[:, :, None, :]  # [B, S, 1, D/2]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., : d // 2], x32[..., d // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Grouped-query attention with a boolean mask; softmax in float32.

    Args:
      q: ``[B, S, NH, D]``.
      k, v: ``[B, L, KVH, D]``.
      mask: ``[B, S, L]``, True where a query may see a key.

    Returns:
      ``[B, S, NH * D]`` in ``v.dtype``.

    Raises:
      ValueError: the shapes do not fit together as above, or ``NH`` is not a multiple
        of ``KVH >= 1`` (static shapes only: nothing is added to a traced program).
      TypeError: an argument is not an array (a list), or ``mask`` is not bool (a float mask
        would be read as truthiness).
    """
    _check_arrays("attend", {"q": q, "k": k, "v": v, "mask": mask})
    check_dtypes({"attend: mask": (mask, jnp.bool_)})
    if q.ndim != 4 or k.ndim != 4 or tuple(k.shape) != tuple(v.shape):
        raise ValueError(
            f"attend: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: expected q [B, S, NH, D] "
            "and k, v of one shape [B, L, KVH, D]"
        )
    b, s, nh, d = q.shape
    kvh = k.shape[2]
    if k.shape[0] != b or k.shape[3] != d or kvh < 1 or nh % kvh:
        raise ValueError(
            f"attend: q {tuple(q.shape)} and k {tuple(k.shape)} do not fit: same B and D, and NH={nh} a "
            f"multiple of KVH={kvh} >= 1"
        )
    if tuple(mask.shape) != (b, s, k.shape[1]):
        raise ValueError(f"attend: mask has shape {tuple(mask.shape)}: expected [B, S, L] = {(b, s, k.shape[1])}")
    qg = q.reshape(b, s, kvh, nh // kvh, d)  # [B, S, KVH, G, D]
    scores = jnp.einsum("bskgd,blkd->bkgsl", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5)
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # A query with no visible key (a padded row) gets zeros, not NaN.
    probs = jnp.where(mask[:, None, None], probs, 0.0).astype(v.dtype)
    out = jnp.einsum("bkgsl,blkd->bskgd", probs, v)  # [B, S, KVH, G, D]
    return out.reshape(b, s, nh * d)


def attend_with_context(
    q: jax.Array,
    ctx_k: jax.Array,
    ctx_v: jax.Array,
    ctx_mask: jax.Array,
    k: jax.Array,
    v: jax.Array,
) -> jax.Array:
    """Block queries over context keys plus the block's own keys, without concatenating them.

    Equals ``attend(q, [ctx_k ; k], [ctx_v ; v], mask)`` with every block key visible, but
    never copies the context: its two matmuls read the cache in its own ``[B, C, KVH·D]``
    layout, each query head meeting only its KV head's columns through a block-diagonal
    query (KVH times the arithmetic of the context part, which is bandwidth-bound; a
    grouped einsum would first transpose the whole context to ``[B, KVH, C, D]``). The
    context and block scores share one float32 softmax.

    Args:
      q: ``[B, S, NH, D]``.
      ctx_k, ctx_v: ``[B, C, KVH, D]``.
      ctx_mask: ``[B, C]``, True where a query may see a context key.
      k, v: ``[B, S, KVH, D]`` the block's own keys and values (always visible).

    Returns:
      ``[B, S, NH * D]`` in ``q.dtype``.

    Raises:
      ValueError: the shapes do not fit together as above (``C`` and ``S`` at least 1, ``NH``
        a multiple of ``KVH >= 1``); static shapes only, nothing is added to a traced program.
      TypeError: an argument is not an array (a list), ``ctx_mask`` is not bool (it would be
        read as truthiness), or ``q``, ``ctx_k``, ``ctx_v``, ``k`` or ``v`` is not of a
        floating dtype.
    """
    _check_context_inputs(q, ctx_k, ctx_v, ctx_mask, k, v)
    b, s, nh, d = q.shape
    c, kvh = ctx_k.shape[1], ctx_k.shape[2]
    g = nh // kvh
    scale = d**-0.5
    qg = q.reshape(b, s, kvh, g, d).transpose(0, 2, 3, 1, 4)  # [B, KVH, G, S, D]
    eye = jnp.eye(kvh, dtype=q.dtype)
    q_diag = qg[:, :, :, :, None, :] * eye[None, :, None, None, :, None]  # [B, KVH, G, S, KVH, D]
    q_diag = q_diag.reshape(b, kvh * g * s, kvh * d)
    ctx_scores = jnp.einsum(
        "bqe,bce->bqc",
        q_diag,
        ctx_k.reshape(b, c, kvh * d),
        preferred_element_type=jnp.float32,
    ).reshape(b, kvh, g, s, c)  # [B, KVH, G, S, C]
    ctx_scores = jnp.where(ctx_mask[:, None, None, None, :], ctx_scores * scale, -jnp.inf)
    own_scores = jnp.einsum("bkgsd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale  # [B, KVH, G, S, S]
    top = jnp.maximum(ctx_scores.max(-1), own_scores.max(-1))[..., None]  # finite: the block is visible
    ctx_p = jnp.exp(ctx_scores - top)
    own_p = jnp.exp(own_scores - top)
    denom = ctx_p.sum(-1) + own_p.sum(-1)  # [B, KVH, G, S]
    ctx_out = jnp.einsum(
        "bqc,bce->bqe",
        ctx_p.reshape(b, kvh * g * s, c).astype(ctx_v.dtype),
        ctx_v.reshape(b, c, kvh * d),
        preferred_element_type=jnp.float32,
    ).reshape(b, kvh, g, s, kvh, d)
    ctx_out = jnp.einsum("bkgsjd,kj->bkgsd", ctx_out, eye.astype(jnp.float32))  # each head's own KV head
    own_out = jnp.einsum(
        "bkgst,btkd->bkgsd",
        own_p.astype(v.dtype),
        v,
        preferred_element_type=jnp.float32,
    )
    out = (ctx_out + own_out) / denom[..., None]  # [B, KVH, G, S, D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, nh * d).astype(q.dtype)


def _check_context_inputs(q: Any, ctx_k: Any, ctx_v: Any, ctx_mask: Any, k: Any, v: Any) -> None:
    """The static checks of :func:`attend_with_context` (see there)."""
    fn = "attend_with_context"
    arrays = {"q": q, "ctx_k": ctx_k, "ctx_v": ctx_v, "ctx_mask": ctx_mask, "k": k, "v": v}
    _check_arrays(fn, arrays)
    if q.ndim != 4 or ctx_k.ndim != 4 or q.shape[1] < 1:
        raise ValueError(
            f"{fn}: q {tuple(q.shape)} and ctx_k {tuple(ctx_k.shape)}: expected q [B, S, NH, D] with S >= 1 "
            "and ctx_k [B, C, KVH, D]"
        )
    b, s, nh, d = q.shape
    c, kvh = ctx_k.shape[1], ctx_k.shape[2]
    if ctx_k.shape[0] != b or ctx_k.shape[3] != d or c < 1 or kvh < 1 or nh % kvh:
        raise ValueError(
            f"{fn}: q {tuple(q.shape)} and ctx_k {tuple(ctx_k.shape)} do not fit: same B and D, C >= 1, and "
            f"NH={nh} a multiple of KVH={kvh} >= 1"
        )
    if tuple(ctx_v.shape) != tuple(ctx_k.shape):
        raise ValueError(f"{fn}: ctx_v has shape {tuple(ctx_v.shape)}: expected ctx_k's {tuple(ctx_k.shape)}")
    if tuple(ctx_mask.shape) != (b, c):
        raise ValueError(f"{fn}: ctx_mask has shape {tuple(ctx_mask.shape)}: expected [B, C] = {(b, c)}")
    own = (b, s, kvh, d)
    for name, value in (("k", k), ("v", v)):
        if tuple(value.shape) != own:
            raise ValueError(f"{fn}: {name} has shape {tuple(value.shape)}: expected [B, S, KVH, D] = {own}")
    check_dtypes({f"{fn}: ctx_mask": (ctx_mask, jnp.bool_)})
    check_dtypes({f"{fn}: {name}": (value, jnp.floating) for name, value in arrays.items() if name != "ctx_mask"})


def _linear(din: int, dout: int, *, bias: bool, cfg, rngs: nnx.Rngs) -> nnx.Linear:
    return nnx.Linear(
        din,
        dout,
        use_bias=bias,
        dtype=cfg.jnp_dtype,
        param_dtype=cfg.jnp_param_dtype,
        kernel_init=nnx.initializers.normal(0.02),
        rngs=rngs,
    )


class Attention(nnx.Module):
    """Qwen3 attention projections: q/k/v/o, per-head q/k RMSNorm, RoPE.

    The caller supplies the keys to attend over, so the same module serves the
    draft (block queries over context plus block keys) and the causal target.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h, nh, kvh, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = _linear(h, nh * d, bias=bias, cfg=cfg, rngs=rngs)
        self.k_proj = _linear(h, kvh * d, bias=bias, cfg=cfg, rngs=rngs)
        self.v_proj = _linear(h, kvh * d, bias=bias, cfg=cfg, rngs=rngs)
        # Hugging Face Qwen3 gives o_proj a bias exactly when q/k/v have one.
        self.o_proj = _linear(nh * d, h, bias=bias, cfg=cfg, rngs=rngs)
        self.q_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.k_norm = RMSNorm(d, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = nh, kvh, d
        self.rope_theta = cfg.rope_theta

    def query(self, x: jax.Array, positions: jax.Array) -> jax.Array:
        """``[B, S, H]`` → roped, normed queries ``[B, S, NH, D]``."""
        b, s, _ = x.shape
        q = self.q_proj(x).reshape(b, s, self.num_heads, self.head_dim)
        return rope(self.q_norm(q), positions, self.rope_theta)

    def qkv(self, x: jax.Array) -> jax.Array:
        """``[B, S, H]`` → the raw q, k and v projections side by side, ``[B, S, (NH + 2·KVH)·D]``
        (XLA merges the three products; with the kernels as slices of one array, nothing is copied)."""
        return jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)

    def key_value(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``[B, S, H]`` → roped, normed keys and values, each ``[B, S, KVH, D]``."""
        b, s, _ = x.shape
        k = self.k_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(b, s, self.num_kv_heads, self.head_dim)
        return rope(self.k_norm(k), positions, self.rope_theta), v


class MLP(nnx.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = _linear(h, i, bias=False, cfg=cfg, rngs=rngs)
        self.up_proj = _linear(h, i, bias=False, cfg=cfg, rngs=rngs)
        self.down_proj = _linear(i, h, bias=False, cfg=cfg, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nnx.Module):
    """Pre-norm Qwen3 decoder layer; attention keys are supplied by the caller."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.self_attn = Attention(cfg, rngs=rngs)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(self, x: jax.Array, positions: jax.Array, kv_fn) -> jax.Array:
        """Runs the layer.

        Args:
          x: ``[B, S, H]`` residual stream.
          positions: ``[B, S]``.
          kv_fn: ``(k, v) -> (keys [B, L, KVH, D], values [B, L, KVH, D], mask [B, S, L])``:
            given this layer's own roped keys and values for the ``S`` rows, returns what
            the queries attend over (the draft prepends context; the target writes its
            cache and reads it back).

        Returns:
          ``[B, S, H]``.
        """
        a = self.input_layernorm(x)
        q = self.self_attn.query(a, positions)
        k, v = self.self_attn.key_value(a, positions)
        keys, values, mask = kv_fn(k, v)
        return self._residual(x, attend(q, keys, values, mask))

    def with_context(
        self,
        x: jax.Array,
        positions: jax.Array,
        ctx_k: jax.Array,
        ctx_v: jax.Array,
        ctx_mask: jax.Array,
        mlp_fn: Callable[[MLP, jax.Array], jax.Array] | None = None,
    ) -> jax.Array:
        """Runs the layer for block rows over context keys and the whole block (the draft).

        Same as :meth:`__call__` with a ``kv_fn`` that prepends the context, without
        copying the context (:func:`attend_with_context`).

        Args:
          x: ``[B, S, H]`` residual stream.
          positions: ``[B, S]``.
          ctx_k, ctx_v: ``[B, C, KVH, D]`` this layer's context keys and values.
          ctx_mask: ``[B, C]`` True for visible context positions.
          mlp_fn: as in :meth:`with_attention`.

        Returns:
          ``[B, S, H]``.
        """
        return self.with_attention(
            x, positions, lambda q, k, v: attend_with_context(q, ctx_k, ctx_v, ctx_mask, k, v), mlp_fn=mlp_fn
        )

    def with_attention(
        self,
        x: jax.Array,
        positions: jax.Array,
        attend_fn: Callable[[jax.Array, jax.Array, jax.Array], jax.Array],
        project_fn: Callable[[Attention, jax.Array, jax.Array], tuple[jax.Array, jax.Array, jax.Array]] | None = None,
        mlp_fn: Callable[[MLP, jax.Array], jax.Array] | None = None,
    ) -> jax.Array:
        """Runs the layer with a caller-supplied attention over the block's own keys and more.

        Args:
          x: ``[B, S, H]`` residual stream.
          positions: ``[B, S]``.
          attend_fn: ``(q [B, S, NH, D], k, v [B, S, KVH, D]) -> [B, S, NH·D]``, given this
            layer's roped queries and the block's own roped keys and values.
          project_fn: ``(attention module, normed x, positions) -> (q, k, v)`` as
            ``query``/``key_value`` compute them (e.g. one kernel,
            :func:`dspark_jax.qk_norm_kernel.project_qkv`); default those two methods.
          mlp_fn: ``(MLP module, normed x [B, S, H]) -> [B, S, H]`` as the module computes it
            (e.g. :func:`dspark_jax.mlp_kernel.mlp_forward`); default the module.

        Returns:
          ``[B, S, H]``.
        """
        a = self.input_layernorm(x)
        if project_fn is not None:
            q, k, v = project_fn(self.self_attn, a, positions)
        else:
            q = self.self_attn.query(a, positions)
            k, v = self.self_attn.key_value(a, positions)
        return self._residual(x, attend_fn(q, k, v), mlp_fn)

    def _residual(self, x: jax.Array, attn: jax.Array, mlp_fn=None) -> jax.Array:
        x = x + self.self_attn.o_proj(attn)
        a = self.post_attention_layernorm(x)
        return x + (self.mlp(a) if mlp_fn is None else mlp_fn(self.mlp, a))
