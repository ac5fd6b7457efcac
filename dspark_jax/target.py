"""A reference dense Qwen3 target (Flax NNX) with a KV cache and feature taps.

Shape legend: B batch, S new tokens, C cache capacity, L layers, KVH key/value heads,
D head dim, H hidden, V vocabulary, K tapped layers.

The KV cache is indexed by absolute position. A forward writes the new tokens' keys
and values at their positions, then each query attends causally over cache entries at
positions ``<=`` its own; entries left behind by rejected drafts lie past every live
query and are overwritten before they can be seen.

Any model can serve as a target if it follows :class:`Target`.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct

from dspark_jax.config import TargetConfig
from dspark_jax.layers import DecoderLayer, RMSNorm


@struct.dataclass
class KVCache:
    """Target keys and values, each ``[L, B, C, KVH, D]``."""

    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        return self.k.shape[2]


class Target(Protocol):
    """What dspark_jax needs of a target model.

    Attributes:
      config: exposes ``hidden_size``, ``vocab_size`` and ``num_hidden_layers``.
      embed_tokens: the ``[V, H]`` embedding the draft borrows.
      lm_head: the ``[V, H]`` output projection the draft borrows.
    """

    config: TargetConfig

    @property
    def embed_tokens(self) -> jax.Array: ...

    @property
    def lm_head(self) -> jax.Array: ...

    def init_cache(self, batch: int, capacity: int) -> KVCache: ...

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        *,
        valid: jax.Array | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """``tokens [B, S]`` at ``positions [B, S]`` → ``(logits [B, S, V] float32,
        features [B, S, K·H], cache)``; rows where ``valid`` is False are not cached."""
        ...


class Qwen3Target(nnx.Module):
    """Dense Qwen3 causal LM. Tied embeddings share one ``Param``."""

    def __init__(self, cfg: TargetConfig, *, rngs: nnx.Rngs):
        self.config = cfg
        init = nnx.initializers.normal(0.02)
        self.embed = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.jnp_param_dtype))
        self.layers = nnx.List([DecoderLayer(cfg, rngs=rngs) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, param_dtype=cfg.jnp_param_dtype)
        if cfg.tie_word_embeddings:
            self.head = None
        else:
            self.head = nnx.Param(init(rngs.params(), (cfg.vocab_size, cfg.hidden_size), cfg.jnp_param_dtype))

    @property
    def embed_tokens(self) -> jax.Array:
        return self.embed.value

    @property
    def lm_head(self) -> jax.Array:
        return self.embed.value if self.head is None else self.head.value

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        cfg = self.config
        shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
        return KVCache(k=jnp.zeros(shape, cfg.jnp_dtype), v=jnp.zeros(shape, cfg.jnp_dtype))

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        cache: KVCache,
        *,
        valid: jax.Array | None = None,
        feature_layers: tuple[int, ...] = (),
    ) -> tuple[jax.Array, jax.Array, KVCache]:
        """Causal forward of new tokens against the cache.

        Args:
          tokens: ``[B, S]`` token ids.
          positions: ``[B, S]`` their absolute positions.
          cache: the KV cache.
          valid: ``[B, S]``; False rows (padding) are neither cached nor seen.
          feature_layers: target layer ids to tap (``-1`` = embedding output).

        Returns:
          ``(logits [B, S, V] float32, features [B, S, K·H], new cache)``.
        """
        cfg = self.config
        b, s = tokens.shape
        if valid is None:
            valid = jnp.ones((b, s), bool)
        positions = positions.astype(jnp.int32)
        write_idx = jnp.where(valid, positions, cache.capacity)  # [B, S]; invalid -> dropped
        rows = jnp.arange(b)[:, None]
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, S, C]
        x = jnp.take(self.embed.value, tokens, axis=0).astype(cfg.jnp_dtype)
        taps = {-1: x}
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):

            def kv_fn(k, v, i=i):
                ck = cache.k[i].at[rows, write_idx].set(k.astype(cache.k.dtype), mode="drop")
                cv = cache.v[i].at[rows, write_idx].set(v.astype(cache.v.dtype), mode="drop")
                new_k.append(ck)
                new_v.append(cv)
                return ck, cv, mask

            x = layer(x, positions, kv_fn)
            taps[i] = x
        for i in feature_layers:
            if i not in taps:
                raise ValueError(
                    f"feature layer {i} is outside the target's depth: -1 <= id < {cfg.num_hidden_layers}"
                )
        features = (
            jnp.concatenate([taps[i] for i in feature_layers], axis=-1)
            if feature_layers
            else jnp.zeros((b, s, 0), x.dtype)
        )
        h = self.norm(x)
        logits = jnp.einsum("bsh,vh->bsv", h, self.lm_head.astype(cfg.jnp_dtype), preferred_element_type=jnp.float32)
        return logits, features, KVCache(k=jnp.stack(new_k), v=jnp.stack(new_v))
