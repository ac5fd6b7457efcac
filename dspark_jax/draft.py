"""The DSpark draft model (Flax NNX).

Shape legend: B batch, R query rows (γ or γ+1), γ draft slots, C context capacity,
N context tokens, K fused target layers, H hidden, V vocabulary, L draft layers,
KVH key/value heads, D head dim, r Markov rank.

The draft borrows ``embed_tokens [V, H]`` and ``lm_head [V, H]`` from the target; they
are held as :class:`Borrowed` variables so training filters them out and a target
that shares them keeps one copy in memory.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.attention_kernel import attend_block, use_kernel
from dspark_jax.config import DraftConfig
from dspark_jax.layers import DecoderLayer, RMSNorm
from dspark_jax.markov import MarkovHead, make_markov_head
from dspark_jax.mlp_kernel import mlp_forward, use_mlp_kernel
from dspark_jax.qk_norm_kernel import project_qkv
from dspark_jax.sampling import check_dtypes


class Borrowed(nnx.Variable):
    """A tensor the draft uses but does not own or train (target embedding / lm_head)."""


class Calibration(nnx.Variable):
    """A fitted, non-trained constant (the STS confidence temperature)."""


class ConfidenceHead(nnx.Module):
    """``sigmoid(proj([h ; markov_w1[prev]]) / sts_temperature)``, float32 parameters."""

    def __init__(self, cfg: DraftConfig, *, rngs: nnx.Rngs):
        din = cfg.hidden_size + (cfg.markov_rank if cfg.confidence_head_with_markov else 0)
        self.proj = nnx.Linear(
            din,
            1,
            use_bias=True,
            dtype=jnp.float32,
            param_dtype=jnp.float32,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.sts_temperature = Calibration(jnp.ones((cfg.gamma,), jnp.float32))
        self.with_markov = cfg.confidence_head_with_markov

    def logits(self, hidden: jax.Array, prev_embed: jax.Array | None) -> jax.Array:
        """Raw scores ``[B, γ]`` (before the temperature and the sigmoid)."""
        x = hidden.astype(jnp.float32)
        if self.with_markov:
            x = jnp.concatenate([x, prev_embed.astype(jnp.float32)], axis=-1)
        return self.proj(x)[..., 0]

    def __call__(self, hidden: jax.Array, prev_embed: jax.Array | None) -> jax.Array:
        """Acceptance probability per slot.

        Args:
          hidden: ``[B, γ, H]``.
          prev_embed: ``[B, γ, r]`` ``markov_w1`` rows of each slot's previous token
            (only read when the head takes the Markov input).

        Returns:
          ``[B, γ]`` float32 in ``[0, 1]``.
        """
        return jax.nn.sigmoid(self.logits(hidden, prev_embed) / self.sts_temperature[...])


def check_finite_table(where: str, table: Any) -> None:
    """Refuses a concrete borrowed ``[V', H]`` table holding NaN or inf, naming ``where``.

    NaN draft logits would not only lower acceptance: the sampled acceptance ratio
    ``min(1, p / q)`` would be NaN. The check reads the table once (on the host for NumPy,
    on the device for ``jax.Array``); traced and abstract tables are skipped.
    """
    if isinstance(table, (jax.core.Tracer, jax.ShapeDtypeStruct)):
        return
    xp = np if isinstance(table, np.ndarray) else jnp
    with jax.ensure_compile_time_eval():  # a concrete table inside a trace (nnx.eval_shape) too
        finite = bool(xp.isfinite(table).all())
    if not finite:
        raise ValueError(
            f"{where} holds NaN or inf: expected a finite [V', H] table (the draft's embeddings and logits "
            "would be NaN)"
        )


class DSparkDraft(nnx.Module):
    """DFlash-style block drafter with a Markov head and an optional confidence head."""

    def __init__(
        self,
        cfg: DraftConfig,
        *,
        rngs: nnx.Rngs,
        embed_tokens: jax.Array | None = None,
        lm_head: jax.Array | None = None,
    ):
        """Builds the draft.

        Args:
          cfg: the draft config.
          rngs: initialisation keys.
          embed_tokens: the target's ``[V', H]`` embedding (``V' >= vocab_size``); a random
            one when omitted (tests, fresh training runs with a random target).
          lm_head: the target's ``[V', H]`` output projection; ``embed_tokens`` (tied)
            when omitted.

        Raises:
          TypeError: ``embed_tokens`` or ``lm_head`` is not floating point.
          ValueError: ``embed_tokens`` or ``lm_head`` is not ``[V', H]`` with ``V' >= vocab_size``,
            or holds NaN or inf (checked once here, not for traced tables).
        """
        self.cfg = cfg
        h = cfg.hidden_size
        if embed_tokens is None:
            embed_tokens = nnx.initializers.normal(0.02)(rngs.params(), (cfg.vocab_size, h), cfg.jnp_param_dtype)
        if lm_head is None:
            lm_head = embed_tokens
        check_dtypes({"embed_tokens": (embed_tokens, jnp.floating), "lm_head": (lm_head, jnp.floating)})
        for name, table in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
            if table.ndim != 2 or table.shape[1] != h or table.shape[0] < cfg.vocab_size:
                raise ValueError(
                    f"{name} has shape {tuple(table.shape)}: expected [V, {h}] with V >= vocab_size={cfg.vocab_size}"
                )
            check_finite_table(name, table)
        self.embed_tokens = Borrowed(embed_tokens)
        self.lm_head = Borrowed(lm_head)
        self.fc = nnx.Linear(
            cfg.num_fused_layers * h,
            h,
            use_bias=False,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_param_dtype,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )
        self.hidden_norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(h, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        self.markov_head: MarkovHead | None = make_markov_head(cfg, rngs=rngs)
        self.confidence_head = ConfidenceHead(cfg, rngs=rngs) if cfg.enable_confidence_head else None

    # ------------------------------------------------------------------ inputs
    def embed(self, input_ids: jax.Array) -> jax.Array:
        """In-graph lookup in the borrowed target embedding: ``[B, S]`` → ``[B, S, H]``."""
        return jnp.take(self.embed_tokens[...], input_ids, axis=0).astype(self.cfg.jnp_dtype)

    def inputs(self, input_ids: jax.Array | None, input_embeds: jax.Array | None) -> jax.Array:
        """The residual stream entering layer 0: ``input_embeds [B, R, H]`` when given, else
        the in-graph embedding of ``input_ids [B, R]``.

        The checks read static shapes and dtypes only (they work on tracers and add
        nothing to the compiled program).

        Raises:
          ValueError: both are None, ``input_embeds`` is not ``[B, R, H]`` with the draft's
            ``H``, or ``input_ids`` (when used) is not ``[B, R]``.
          TypeError: ``input_embeds`` is not floating point, or ``input_ids`` (when used) is
            not integer.
        """
        if input_embeds is not None:
            h = self.cfg.hidden_size
            shape = tuple(jnp.shape(input_embeds))
            if len(shape) != 3 or shape[-1] != h:
                raise ValueError(f"input_embeds has shape {shape}: expected [B, R, H] with H = hidden_size={h}")
            check_dtypes({"input_embeds": (input_embeds, jnp.floating)})
            return input_embeds.astype(self.cfg.jnp_dtype)
        if input_ids is None:
            raise ValueError("DSparkDraft needs input_ids or input_embeds; both are None")
        shape = tuple(jnp.shape(input_ids))
        if len(shape) != 2:
            raise ValueError(f"input_ids has shape {shape}: expected [B, R] block token ids")
        check_dtypes({"input_ids": (input_ids, jnp.integer)})
        return self.embed(input_ids)

    def block_ids(self, bonus: jax.Array) -> jax.Array:
        """``[B]`` bonus tokens → ``[B, R]`` block ids ``[bonus, MASK, …]``."""
        masks = jnp.full((bonus.shape[0], self.cfg.num_query_rows - 1), self.cfg.mask_token_id, jnp.int32)
        return jnp.concatenate([bonus.astype(jnp.int32)[:, None], masks], axis=1)

    def block_positions(self, prefix_lens: jax.Array) -> jax.Array:
        """``[B]`` → ``[B, R]`` positions ``prefix_len + 0..R−1``."""
        return prefix_lens.astype(jnp.int32)[:, None] + jnp.arange(self.cfg.num_query_rows, dtype=jnp.int32)

    # ----------------------------------------------------------------- context
    def fuse_context(self, features: jax.Array) -> jax.Array:
        """``hidden_norm(fc(x))``: ``[B, N, K·H]`` target features → ``[B, N, H]``."""
        return self.hidden_norm(self.fc(features.astype(self.cfg.jnp_dtype)))

    def context_kv(self, features: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Per-layer context keys and values of fused target features.

        Args:
          features: ``[B, N, K·H]``.
          positions: ``[B, N]`` absolute positions of those tokens.

        Returns:
          ``(k, v)``, each ``[L, B, N, KVH, D]``.
        """
        ctx = self.fuse_context(features)
        ks, vs = zip(*(layer.self_attn.key_value(ctx, positions) for layer in self.layers), strict=True)
        return jnp.stack(ks), jnp.stack(vs)

    # ----------------------------------------------------------------- forward
    def __call__(
        self,
        input_ids: jax.Array | None = None,
        *,
        positions: jax.Array,
        ctx_k: jax.Array,
        ctx_v: jax.Array,
        ctx_mask: jax.Array,
        input_embeds: jax.Array | None = None,
        prefix_lens: jax.Array | None = None,
        slots: jax.Array | None = None,
    ) -> jax.Array:
        """Runs the backbone over one block.

        Args:
          input_ids: ``[B, R]`` block token ids, embedded in-graph.
          positions: ``[B, R]``.
          ctx_k, ctx_v: ``[L, B, C, KVH, D]`` context keys/values.
          ctx_mask: ``[B, C]`` True for context positions the block may see.
          input_embeds: ``[B, R, H]``; used instead of ``input_ids`` when given.
          prefix_lens: ``[B]`` context lengths, when ``ctx_mask`` is ``arange(C) < prefix_lens``
            (the cache of a proposal); lets the GPU kernel
            (:mod:`dspark_jax.attention_kernel`) read the cache in place and skip the
            positions past ``prefix_len``.
          slots: ``[B]`` the cache slot of each row when ``ctx_k``/``ctx_v`` hold more slots
            than rows (``[L, N, C, KVH, D]``); the kernel reads them in place, the XLA path
            gathers them. Default: row ``b`` is slot ``b``.

        Returns:
          ``[B, R, H]`` hidden states after the final norm.
        """
        x = self.run_layers(
            self.inputs(input_ids, input_embeds),
            positions=positions,
            ctx_k=ctx_k,
            ctx_v=ctx_v,
            ctx_mask=ctx_mask,
            prefix_lens=prefix_lens,
            slots=slots,
        )
        return self.norm(x)

    def run_layers(
        self,
        x: jax.Array,
        *,
        positions: jax.Array,
        ctx_k: jax.Array,
        ctx_v: jax.Array,
        ctx_mask: jax.Array,
        prefix_lens: jax.Array | None = None,
        slots: jax.Array | None = None,
        start: int = 0,
        stop: int | None = None,
    ) -> jax.Array:
        """Runs layers ``start … stop − 1`` over the block's residual stream (no final norm).

        ``__call__`` runs all of them; a round dispatched in pieces
        (:class:`dspark_jax.split_round.SplitRound`) runs them in ranges.

        Args:
          x: ``[B, R, H]`` residual stream entering layer ``start``.
          positions, ctx_k, ctx_v, ctx_mask, prefix_lens, slots: as in :meth:`__call__`.
          start, stop: the layer range, ``0 <= start <= stop <= L`` (``stop`` default ``L``).

        Returns:
          ``[B, R, H]`` the residual stream leaving layer ``stop − 1``.
        """
        num_layers = len(self.layers)
        stop = num_layers if stop is None else stop
        if not 0 <= start <= stop <= num_layers:
            raise ValueError(
                f"layer range start={start}, stop={stop} is invalid: must satisfy 0 <= start <= stop <= {num_layers}"
            )
        # Non-causal: every block row sees every valid context key and the whole block.
        kernel, interpret = False, False
        if prefix_lens is not None and ctx_k.dtype == x.dtype:
            kernel, interpret = use_kernel(ctx_k.dtype, self.cfg.head_dim, ctx_k.shape[2])
        if kernel and slots is None:  # one iota for all layers (each kernel would get its own)
            slots = jnp.arange(x.shape[0], dtype=jnp.int32)
        cfg = self.cfg
        mlp_kernel, mlp_interpret = use_mlp_kernel(
            x.dtype, x.shape[0] * x.shape[1], cfg.hidden_size, cfg.intermediate_size
        )
        # with few rows, the gate and up projections and SwiGLU run as one kernel
        mlp_fn = functools.partial(mlp_forward, interpret=mlp_interpret) if mlp_kernel else None
        for i in range(start, stop):
            layer = self.layers[i]
            if kernel:
                attend = functools.partial(
                    attend_block,
                    cache_k=ctx_k,
                    cache_v=ctx_v,
                    prefix_lens=prefix_lens,
                    layer=i,
                    slots=slots,
                    interpret=interpret,
                )
                # with the attention kernels, the q/k norms and RoPE run as one kernel too
                project = functools.partial(project_qkv, interpret=interpret)
                x = layer.with_attention(x, positions, attend, project_fn=project, mlp_fn=mlp_fn)
            else:
                k, v = ctx_k[i], ctx_v[i]  # [N, C, KVH, D]
                if slots is not None:
                    k, v = k[slots], v[slots]  # [B, C, KVH, D]
                x = layer.with_context(x, positions, k.astype(x.dtype), v.astype(x.dtype), ctx_mask, mlp_fn=mlp_fn)
        return x

    def slots(self, hidden: jax.Array) -> jax.Array:
        """``[B, R, H]`` → ``[B, γ, H]``: drops the anchor row in the DFlash layout."""
        return hidden if self.cfg.sample_from_anchor else hidden[:, 1:]

    def base_logits(self, hidden: jax.Array) -> jax.Array:
        """``[B, γ, H]`` → ``[B, γ, V]`` through the borrowed lm_head, cropped to ``V``."""
        w = self.lm_head[...][: self.cfg.vocab_size].astype(self.cfg.jnp_dtype)
        return jnp.einsum("bgh,vh->bgv", hidden.astype(self.cfg.jnp_dtype), w)

    def confidence(self, hidden: jax.Array, prev: jax.Array) -> jax.Array:
        """``[B, γ, H]``, previous tokens ``[B, γ]`` → acceptance probability ``[B, γ]``."""
        if self.confidence_head is None:
            raise ValueError("this draft has no confidence head (enable_confidence_head=False)")
        prev_embed = self.markov_head.embed_prev(prev) if self.cfg.confidence_head_with_markov else None
        return self.confidence_head(hidden, prev_embed)

    def corrected_logits(self, hidden: jax.Array, prev: jax.Array) -> jax.Array:
        """Teacher-forced Markov-corrected logits ``[B, γ, V]`` float32 (training).

        Args:
          hidden: ``[B, γ, H]`` slot hidden states.
          prev: ``[B, γ]`` ``[anchor, gold_1 … gold_{γ−1}]``.
        """
        base = self.base_logits(hidden).astype(jnp.float32)
        if self.markov_head is None:
            return base
        return base + self.markov_head.block(prev, hidden).astype(jnp.float32)


def check_draft(draft: Any) -> None:
    """Raises ``TypeError`` unless ``draft`` is a :class:`DSparkDraft` (a draft config, say,
    would fail later on a missing attribute)."""
    if not isinstance(draft, DSparkDraft):
        raise TypeError(f"draft must be a DSparkDraft, got {type(draft).__name__}")


def check_models(target: Any, *draft: Any) -> None:
    """Raises ``TypeError`` unless ``target`` is an NNX target and the ``draft``, when one
    is passed, a :class:`DSparkDraft`, naming a swapped pair as such."""
    if isinstance(target, DSparkDraft):
        swapped = " (the target and the draft are swapped: the target comes first)" if draft else ""
        raise TypeError(f"target must be a target model, got a DSparkDraft{swapped}")
    if not (
        isinstance(target, nnx.Module) and hasattr(target, "config") and callable(getattr(target, "init_cache", None))
    ):
        raise TypeError(
            f"target must be an NNX module with config and init_cache (dspark_jax.Target), got {type(target).__name__}"
        )
    if draft:
        check_draft(draft[0])
