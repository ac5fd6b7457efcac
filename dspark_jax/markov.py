"""Markov heads: a low-rank bias on each draft slot from the token before it.

Shape legend: B batch, γ draft slots, V vocabulary, H hidden, r Markov rank.

``e = markov_w1[prev]`` (``[V, r]`` table) and ``proj(z) = z @ markov_w2ᵀ``
(``markov_w2`` is ``[V, r]``) are shared by the three heads:

* ``vanilla``: ``bias = proj(e)``;
* ``gated``: ``bias = proj(sigmoid(gate_proj([h ; e])) ⊙ e)``;
* ``rnn``: ``g, c, o = joint_proj([s ; e ; h])``,
  ``s' = σ(g)·s + (1 − σ(g))·tanh(c)``, ``bias = proj(tanh(o))``; the state carries
  across the γ steps of a block.

Every head exposes ``step(state, prev, h) -> (state, bias)`` for the sequential walk
and ``block(prev, h) -> bias`` for teacher-forced training; :func:`markov_walk` runs
the walk with a caller-supplied token picker under ``jax.lax.scan``.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import DraftConfig
from dspark_jax.sampling import check_dtypes


class MarkovHead(nnx.Module):
    """Base class: the two shared ``[V, r]`` tables and the walk/block plumbing."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v, r = cfg.vocab_size, cfg.markov_rank
        init = nnx.initializers.normal(0.02)
        self.markov_w1 = nnx.Param(init(rngs.params(), (v, r), cfg.jnp_param_dtype))
        self.markov_w2 = nnx.Param(init(rngs.params(), (v, r), cfg.jnp_param_dtype))
        self.rank = r
        self.dtype = cfg.jnp_dtype

    def embed_prev(self, prev: jax.Array, *, clip: bool = False) -> jax.Array:
        """``[...]`` token ids → ``[..., r]`` rows of ``markov_w1``.

        Without ``clip``, ids follow ``jnp.take``: a negative id in ``[-V, 0)`` wraps to
        row ``id + V`` (``-1`` is the last row), any other out-of-range id (``>= V`` or
        ``< -V``) gives a NaN row. With ``clip``, every out-of-range id takes the nearest
        row (a negative id row 0, an id ``>= V`` row ``V - 1``). The walk
        (:meth:`step`) clips: its ids are the anchor, range-checked on the host and embedded
        by the backbone too (an out-of-range anchor already makes the whole block NaN), and
        the walk's own picks, in range by construction; a clipped lookup is one gather,
        where the NaN fill cost XLA up to two more kernels per walk step on the H200.
        """
        return jnp.take(self.markov_w1[...], prev, axis=0, mode="clip" if clip else None).astype(self.dtype)

    def project(self, z: jax.Array) -> jax.Array:
        """``[..., r]`` → ``[..., V]`` bias (``z @ markov_w2ᵀ``)."""
        return jnp.einsum("...r,vr->...v", z.astype(self.dtype), self.markov_w2[...].astype(self.dtype))

    def init_state(self, batch: int) -> jax.Array:
        """Recurrent state ``[B, r]`` (zeros; stateless heads ignore it)."""
        return jnp.zeros((batch, self.rank), jnp.float32)

    def step(self, state: jax.Array, prev: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """One walk step.

        Args:
          state: ``[B, r]``.
          prev: ``[B]`` previous token ids.
          h: ``[B, H]`` draft hidden state of this slot.

        Returns:
          ``(state [B, r], bias [B, V])``.
        """
        z, state = self.latent(state, self.embed_prev(prev, clip=True), h)
        return state, self.project(z)

    def latent(self, state: jax.Array, e: jax.Array, h: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The step's latent from the embedded previous token.

        Args:
          state: ``[B, r]``.
          e: ``[B, r]`` rows of ``markov_w1`` (:meth:`embed_prev`) in the head's dtype.
          h: ``[B, H]`` draft hidden state of this slot.

        Returns:
          ``(z [B, r], state [B, r])``: the bias is ``project(z)``.
        """
        return self._latent(state, e, h)

    def block(self, prev: jax.Array, h: jax.Array) -> jax.Array:
        """Teacher-forced bias for a whole block.

        Args:
          prev: ``[B, γ]`` previous tokens ``[anchor, gold_1 … gold_{γ−1}]``.
          h: ``[B, γ, H]``.

        Returns:
          ``[B, γ, V]``.
        """
        e = self.embed_prev(prev)  # [B, γ, r]

        def body(state, inputs):
            e_k, h_k = inputs
            z, state = self._latent(state, e_k, h_k)
            return state, z

        _, z = jax.lax.scan(body, self.init_state(prev.shape[0]), (e.swapaxes(0, 1), h.swapaxes(0, 1)))
        return self.project(z.swapaxes(0, 1))

    def _latent(self, state, e, h):
        """Returns ``(z [B, r], new_state [B, r])`` whose projection is the bias."""
        raise NotImplementedError


class VanillaMarkovHead(MarkovHead):
    """``bias = proj(markov_w1[prev])``: the previous token alone (no state, no hidden)."""

    def _latent(self, state, e, h):
        return e, state


class GatedMarkovHead(MarkovHead):
    """``bias = proj(sigmoid(gate_proj([h ; e])) ⊙ e)``: the slot's hidden ``h [B, H]`` gates
    the previous token's ``e [B, r]`` (``gate_proj``: ``H + r → r`` with bias, hidden first)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.gate_proj = nnx.Linear(
            cfg.hidden_size + cfg.markov_rank,
            cfg.markov_rank,
            use_bias=True,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_param_dtype,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

    def _latent(self, state, e, h):
        g = jax.nn.sigmoid(self.gate_proj(jnp.concatenate([h.astype(self.dtype), e], axis=-1)))
        return g * e, state


class RNNMarkovHead(MarkovHead):
    """A gated recurrent state ``s [B, r]`` across the block's γ steps, from 0:
    ``g, c, o = joint_proj([s ; e ; h])`` (``2r + H → 3r`` with bias, chunks in that order),
    ``s' = σ(g)·s + (1 − σ(g))·tanh(c)``, ``bias = proj(tanh(o))``; the state in float32."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        r = cfg.markov_rank
        self.joint_proj = nnx.Linear(
            2 * r + cfg.hidden_size,
            3 * r,
            use_bias=True,
            dtype=cfg.jnp_dtype,
            param_dtype=cfg.jnp_param_dtype,
            kernel_init=nnx.initializers.normal(0.02),
            rngs=rngs,
        )

    def _latent(self, state, e, h):
        x = jnp.concatenate([state.astype(self.dtype), e, h.astype(self.dtype)], axis=-1)
        g, c, o = jnp.split(self.joint_proj(x).astype(jnp.float32), 3, axis=-1)
        sg = jax.nn.sigmoid(g)
        state = sg * state + (1.0 - sg) * jnp.tanh(c)
        return jnp.tanh(o), state


MARKOV_HEADS = {"vanilla": VanillaMarkovHead, "gated": GatedMarkovHead, "rnn": RNNMarkovHead}


def make_markov_head(cfg: DraftConfig, *, rngs: nnx.Rngs) -> MarkovHead | None:
    """The head ``cfg`` asks for, or ``None`` when ``markov_rank == 0``.

    Raises:
      TypeError: ``cfg`` is not a :class:`~dspark_jax.config.DraftConfig`.
    """
    if not isinstance(cfg, DraftConfig):
        raise TypeError(f"cfg must be a DraftConfig, got {type(cfg).__name__}")
    if cfg.markov_rank == 0:
        return None
    return MARKOV_HEADS[cfg.markov_head_type](cfg, rngs=rngs)


# pick(step_index, step_logits [B, V] float32) -> tokens [B] int32
TokenPicker = Callable[[jax.Array, jax.Array], jax.Array]


def markov_walk(
    head: MarkovHead | None,
    base_logits: jax.Array,
    hidden: jax.Array,
    bonus: jax.Array,
    pick: TokenPicker,
    *,
    keep_dtype: jnp.dtype = jnp.float32,
) -> tuple[jax.Array, jax.Array]:
    """Walks the block left to right, adding each slot's Markov bias, then picking.

    Args:
      head: the Markov head, or ``None`` (DFlash-style: the bias is zero).
      base_logits: ``[B, γ, V]``.
      hidden: ``[B, γ, H]`` draft hidden states.
      bonus: ``[B]`` the anchor token (``prev`` of step 0).
      pick: chooses step ``k``'s tokens from its corrected float32 logits.
      keep_dtype: the dtype the corrected logits are returned in (rounded from float32).

    Returns:
      ``(tokens [B, γ] int32, corrected [B, γ, V] keep_dtype)``.

    Raises:
      TypeError: ``head`` is not a Markov head or None, ``bonus`` not of an integer dtype,
        ``base_logits`` or ``hidden`` not of a floating one, or ``keep_dtype`` not a
        floating dtype.
      ValueError: the shapes disagree (``base_logits [B, γ, V]`` with the head's ``V``,
        ``hidden [B, γ, H]``, ``bonus [B]``), or a concrete ``bonus`` lies outside ``[0, V)``
        (the walk's lookup would clip it silently).
    """
    _check_walk_inputs(head, base_logits, hidden, bonus, keep_dtype)
    batch = base_logits.shape[0]
    if head is None:
        logits = base_logits.astype(jnp.float32)
        steps = jnp.arange(logits.shape[1])
        tokens = jax.vmap(pick, in_axes=(0, 1), out_axes=1)(steps, logits)
        return tokens.astype(jnp.int32), logits.astype(keep_dtype)

    def body(carry, inputs):
        state, prev = carry
        k, base_k, h_k = inputs
        state, bias = head.step(state, prev, h_k)
        logits = base_k.astype(jnp.float32) + bias.astype(jnp.float32)  # [B, V]
        tok = pick(k, logits).astype(jnp.int32)
        return (state, tok), (tok, logits.astype(keep_dtype))

    steps = jnp.arange(base_logits.shape[1])
    # Unrolled: γ is small; XLA then fuses across steps and runs no device-side loop.
    _, (tokens, corrected) = jax.lax.scan(
        body,
        (head.init_state(batch), bonus.astype(jnp.int32)),
        (steps, base_logits.swapaxes(0, 1), hidden.swapaxes(0, 1)),
        unroll=True,
    )
    return tokens.swapaxes(0, 1), corrected.swapaxes(0, 1)


def _check_walk_inputs(head, base_logits, hidden, bonus, keep_dtype) -> None:
    """The checks of :func:`markov_walk` (static, and ``bonus``'s range when concrete)."""
    if head is not None and not isinstance(head, MarkovHead):
        raise TypeError(f"head must be a MarkovHead or None, got {type(head).__name__}")
    shapes = {name: tuple(np.shape(x)) for name, x in (("base_logits", base_logits), ("hidden", hidden))}
    if any(len(shape) != 3 for shape in shapes.values()) or shapes["base_logits"][:2] != shapes["hidden"][:2]:
        raise ValueError(
            f"base_logits has shape {shapes['base_logits']} and hidden {shapes['hidden']}: expected [B, γ, V] and "
            "[B, γ, H] of one B and γ"
        )
    batch, _, vocab = shapes["base_logits"]
    if head is not None and vocab != head.markov_w2.shape[0]:
        raise ValueError(f"base_logits has V={vocab}: the Markov head's tables have {head.markov_w2.shape[0]} rows (V)")
    if tuple(np.shape(bonus)) != (batch,):
        raise ValueError(f"bonus has shape {tuple(np.shape(bonus))}: expected [B] = ({batch},)")
    arrays = {
        "base_logits": (base_logits, jnp.floating),
        "hidden": (hidden, jnp.floating),
        "bonus": (bonus, jnp.integer),
    }
    for name, (value, _) in arrays.items():
        if not hasattr(value, "dtype"):
            raise TypeError(f"{name} is a {type(value).__name__}: expected an array")
    check_dtypes(arrays)
    if not jnp.issubdtype(jnp.dtype(keep_dtype), jnp.floating):
        raise TypeError(f"keep_dtype={keep_dtype!r} is invalid: must be a floating dtype")
    if not isinstance(bonus, jax.core.Tracer):
        ids = np.asarray(bonus)
        outside = (ids < 0) | (ids >= vocab)
        if outside.any():
            i = int(np.argmax(outside))
            raise ValueError(f"bonus[{i}]={int(ids[i])} is outside the vocabulary: 0 <= id < {vocab}")
