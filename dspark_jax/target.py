"""A reference dense Qwen3 target (Flax NNX) with a KV cache, feature taps and HF checkpoints.

Shape legend: B batch, S new tokens, C cache capacity, L layers, KVH key/value heads,
D head dim, H hidden, V vocabulary, K tapped layers.

The KV cache is indexed by absolute position. A forward writes the new tokens' keys
and values at their positions, then each query attends causally over cache entries at
positions ``<=`` its own; entries left behind by rejected drafts lie past every live
query and are overwritten before they can be seen.

Checkpoints use the Hugging Face ``Qwen3ForCausalLM`` layout: ``config.json`` plus one
``model.safetensors`` or shards listed in ``model.safetensors.index.json``; linear
weights are stored ``[out, in]`` and transposed on load (:func:`load_target`,
:func:`save_target`). :func:`check_pair` says whether a draft fits a target.

Any model can serve as a target if it follows :class:`Target`.
"""

from __future__ import annotations

import os
from typing import Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspark_jax.config import DTYPES, DraftConfig, TargetConfig, is_integer, positive_int, read_json_file
from dspark_jax.layers import DecoderLayer, RMSNorm
from dspark_jax.safetensors_io import (
    INDEX_NAME,
    WEIGHTS_NAME,
    cast_weight,
    finish_interrupted_save,
    folder_path,
    open_safetensors,
    read_index,
    write_tensors,
)
from dspark_jax.sampling import check_dtypes


@struct.dataclass
class KVCache:
    """Target keys and values, each ``[L, B, C, KVH, D]``."""

    k: jax.Array
    v: jax.Array

    @property
    def capacity(self) -> int:
        """``C``: positions per row."""
        return self.k.shape[2]


class Target(Protocol):
    """What dspark_jax needs of a target model, so users can plug in their own.

    A target is an NNX module (it is split with ``nnx.split`` and merged again inside
    the compiled round, so everything that changes per call must be an argument)
    with:

    * ``config``: exposes ``hidden_size``, ``vocab_size`` and ``num_hidden_layers``
      (:func:`check_pair` reads them).
    * ``embed_tokens`` / ``lm_head``: the ``[V, H]`` tables the draft borrows; pass them
      to ``DSparkDraft(..., embed_tokens=target.embed_tokens, lm_head=target.lm_head)``
      so both models reference the same buffers.
    * ``init_cache(batch, capacity)``: an empty KV cache (any pytree) indexed by absolute
      position.
    * ``__call__(tokens, positions, cache, *, valid, feature_layers)``: a causal forward
      of ``S`` new tokens per row at arbitrary per-row positions that writes the new
      keys/values of rows where ``valid`` is True and returns float32 logits, the hidden
      states after the layers in ``feature_layers`` (``-1`` = embedding output)
      concatenated on the last axis, and the new cache. Rows with ``valid`` False must
      leave the cache unchanged; queries must not see cache entries at positions past
      their own (stale entries of rejected drafts live there).
    """

    config: TargetConfig

    @property
    def embed_tokens(self) -> jax.Array:
        """The ``[V, H]`` input embedding table."""
        ...

    @property
    def lm_head(self) -> jax.Array:
        """The ``[V, H]`` output projection (the embedding table when tied)."""
        ...

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An empty cache of ``capacity`` positions for ``batch`` rows."""
        ...

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
        """The ``[V, H]`` input embedding table."""
        return self.embed.get_value()

    @property
    def lm_head(self) -> jax.Array:
        """The ``[V, H]`` output projection: the embedding table when tied."""
        return self.embed.get_value() if self.head is None else self.head.get_value()

    def init_cache(self, batch: int, capacity: int) -> KVCache:
        """An all-zero cache of ``capacity`` positions for ``batch`` rows.

        Raises:
          ValueError: ``batch`` or ``capacity`` is not an integer >= 1.
        """
        batch, capacity = positive_int("batch", batch), positive_int("capacity", capacity)
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

        Shapes and dtypes are checked while tracing. Values are checked only when the
        arrays are concrete (an eager call), and only where ``valid`` is True; under
        ``jax.jit`` nothing raises: an id outside ``[-V, V)`` embeds as NaN and makes
        its row's logits NaN (ids in ``[-V, 0)`` wrap, NumPy-style), a position
        ``>= C`` is not cached and its query sees the whole cache but not itself, and a
        negative position wraps its write and sees nothing.

        Args:
          tokens: ``[B, S]`` integer token ids in ``[0, V)`` (arrays, NumPy or lists).
          positions: ``[B, S]`` integer absolute positions in ``[0, C)``.
          cache: the KV cache, ``[L, B, C, KVH, D]`` as :meth:`init_cache` makes it.
          valid: ``[B, S]`` bool; False rows (padding) are neither cached nor seen.
          feature_layers: tuple of target layer ids to tap, ``-1 <= id < L``
            (``-1`` = embedding output; id ``i`` = decoder layer ``i``'s output, before the
            final norm even for ``i = L − 1``, as serving stacks capture the residual stream;
            HF's ``hidden_states[L]`` comes after the norm. No released draft taps ``L − 1``).

        Returns:
          ``(logits [B, S, V] float32, features [B, S, K·H], new cache)``.

        Raises:
          TypeError: ``tokens``, ``positions`` or ``valid`` has the wrong dtype, or
            ``feature_layers`` is not a tuple (or list) of integers.
          ValueError: a shape does not fit (cache layout or batch included), a layer
            id is outside the target's depth, or (concrete arrays) a token id or
            position is out of range.
        """
        cfg = self.config
        tokens, positions, valid = self._check_inputs(tokens, positions, cache, valid, feature_layers)
        b, s = tokens.shape
        positions = positions.astype(jnp.int32)
        write_idx = jnp.where(valid, positions, cache.capacity)  # [B, S]; invalid -> dropped
        rows = jnp.arange(b)[:, None]
        key_pos = jnp.arange(cache.capacity, dtype=jnp.int32)
        mask = key_pos[None, None, :] <= positions[:, :, None]  # [B, S, C]
        x = jnp.take(self.embed.get_value(), tokens, axis=0).astype(cfg.jnp_dtype)
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
        features = (
            jnp.concatenate([taps[i] for i in feature_layers], axis=-1)
            if feature_layers
            else jnp.zeros((b, s, 0), x.dtype)
        )
        h = self.norm(x)
        logits = jnp.einsum("bsh,vh->bsv", h, self.lm_head.astype(cfg.jnp_dtype), preferred_element_type=jnp.float32)
        return logits, features, KVCache(k=jnp.stack(new_k), v=jnp.stack(new_v))

    def _check_inputs(self, tokens, positions, cache, valid, feature_layers):
        """Static checks of :meth:`__call__`'s inputs, plus value checks when concrete.

        Returns:
          ``(tokens, positions, valid)`` as arrays, ``valid`` all True when omitted.
        """
        cfg = self.config
        tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
        if tokens.ndim != 2:
            raise ValueError(f"tokens has shape {tokens.shape}: expected [batch, new tokens]")
        check_dtypes({"tokens": (tokens, jnp.integer), "positions": (positions, jnp.integer)})
        if positions.shape != tokens.shape:
            raise ValueError(f"positions has shape {positions.shape}: expected tokens' shape {tokens.shape}")
        b = tokens.shape[0]
        want = (cfg.num_hidden_layers, b, cache.capacity, cfg.num_key_value_heads, cfg.head_dim)
        if cache.k.shape != want or cache.v.shape != want or cache.capacity < 1:
            raise ValueError(
                f"cache has k {cache.k.shape}, v {cache.v.shape}: expected [L, B, C, KVH, D] = {want} with "
                f"capacity C >= 1 for tokens of batch B={b} (use init_cache({b}, capacity))"
            )
        if valid is None:
            valid = jnp.ones(tokens.shape, bool)
        valid = jnp.asarray(valid)
        if valid.shape != tokens.shape:
            raise ValueError(f"valid has shape {valid.shape}: expected tokens' shape {tokens.shape}")
        check_dtypes({"valid": (valid, jnp.bool_)})
        if not isinstance(feature_layers, tuple | list) or not all(is_integer(i) for i in feature_layers):
            raise TypeError(f"feature_layers={feature_layers!r} is invalid: expected a tuple of integer layer ids")
        bad = [i for i in feature_layers if not -1 <= i < cfg.num_hidden_layers]
        if bad:
            raise ValueError(
                f"feature_layers={tuple(feature_layers)!r}: ids {bad} are outside the target's depth: "
                f"-1 <= id < {cfg.num_hidden_layers}"
            )
        if not any(isinstance(x, jax.core.Tracer) for x in (tokens, positions, valid)):
            live = np.asarray(valid)
            ids, pos = np.asarray(tokens)[live], np.asarray(positions)[live]
            if ids.size and not (ids.min() >= 0 and ids.max() < cfg.vocab_size):
                raise ValueError(
                    f"tokens hold ids {ids.min()}..{ids.max()}: expected 0 <= id < vocab_size={cfg.vocab_size}"
                )
            if pos.size and not (pos.min() >= 0 and pos.max() < cache.capacity):
                raise ValueError(
                    f"positions hold {pos.min()}..{pos.max()}: expected 0 <= position < cache capacity={cache.capacity}"
                )
        return tokens, positions, valid


# ---------------------------------------------------------------------- checkpoints
def _hf_variables(target: Qwen3Target) -> dict[str, tuple[nnx.Variable, bool]]:
    """HF tensor name → (the variable holding it, whether HF stores it transposed)."""
    out = {"model.embed_tokens.weight": (target.embed, False), "model.norm.weight": (target.norm.weight, False)}
    if target.head is not None:
        out["lm_head.weight"] = (target.head, False)
    for i, layer in enumerate(target.layers):
        prefix = f"model.layers.{i}."
        linears = [(f"self_attn.{n}", getattr(layer.self_attn, n)) for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        linears += [(f"mlp.{n}", getattr(layer.mlp, n)) for n in ("gate_proj", "up_proj", "down_proj")]
        for name, linear in linears:
            out[f"{prefix}{name}.weight"] = (linear.kernel, True)  # HF [out, in]; ours [in, out]
            if linear.bias is not None:
                out[f"{prefix}{name}.bias"] = (linear.bias, False)
        norms = {
            "self_attn.q_norm": layer.self_attn.q_norm,
            "self_attn.k_norm": layer.self_attn.k_norm,
            "input_layernorm": layer.input_layernorm,
            "post_attention_layernorm": layer.post_attention_layernorm,
        }
        for name, norm in norms.items():
            out[f"{prefix}{name}.weight"] = (norm.weight, False)
    return out


def _read_tensors(path: str) -> dict[str, np.ndarray]:
    """All tensors of a single-file or sharded safetensors checkpoint folder."""
    shards = read_index(path)
    if shards is None:
        if not os.path.isfile(os.path.join(path, WEIGHTS_NAME)):
            raise ValueError(f"checkpoint folder {path!r} has neither {WEIGHTS_NAME} nor {INDEX_NAME}")
        shards = {os.path.join(path, WEIGHTS_NAME): None}
    tensors: dict[str, np.ndarray] = {}
    for shard, listed in shards.items():
        with open_safetensors(shard) as f:
            loaded = {key: f.get_tensor(key) for key in list(f.keys())}
        for key, value in loaded.items():
            if key in tensors:
                raise ValueError(f"tensor {key!r} appears in more than one shard of {path!r}")
            if listed is not None and key not in listed:
                raise ValueError(
                    f"tensor {key!r} is in shard {os.path.basename(shard)!r} but the index does not map it there"
                )
            tensors[key] = value
        absent = sorted(set(listed or ()) - set(loaded))
        if absent:
            raise ValueError(
                f"tensor {absent[0]!r} is listed for {os.path.basename(shard)!r} by {INDEX_NAME} of {path!r} but not "
                "stored in it"
            )
    return tensors


def load_target(path: str | os.PathLike, *, dtype: str | None = None) -> Qwen3Target:
    """Loads a Hugging Face Qwen3 checkpoint folder.

    Args:
      path: folder with ``config.json`` and ``model.safetensors`` (or shards listed in
        ``model.safetensors.index.json``).
      dtype: compute and parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
        default: the checkpoint's ``torch_dtype`` (or ``dtype``) when it is one of those,
        else float32.

    Returns:
      The target with the checkpoint's weights.

    Raises:
      ValueError: ``config.json`` or the index is not a JSON object, the config asks for
        something the reference target does not implement (``model_type`` other than
        ``"qwen3"``, ``hidden_act`` other than ``"silu"``, ``use_sliding_window``, RoPE
        scaling in ``rope_scaling`` or ``rope_parameters``), or a field is missing or
        invalid (named with the file's path), a safetensors file is unreadable, or a tensor is missing, has
        the wrong shape, is not floating point, is not finite after the cast to
        ``dtype``, or is not part of the model.
    """
    path = folder_path(path)
    if os.path.isdir(path):
        finish_interrupted_save(path)  # a save cut short while moving its files
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise ValueError(f"target path {path!r} has no config.json: expected a Hugging Face checkpoint folder")
    hf = read_json_file(config_path)
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path!r} holds a JSON {type(hf).__name__}: expected an object of config fields")
    if dtype is None:
        stored = hf.get("torch_dtype", hf.get("dtype"))
        dtype = stored if isinstance(stored, str) and stored in DTYPES else "float32"
    try:  # also refuses what the reference target does not implement (sliding window, RoPE scaling …)
        cfg = TargetConfig.from_hf_config(hf, dtype=dtype, param_dtype=dtype)
    except ValueError as e:
        raise ValueError(f"{config_path!r}: {e}") from e
    # Build the module abstractly: no random initialisation of weights that get replaced.
    target = nnx.eval_shape(lambda: Qwen3Target(cfg, rngs=nnx.Rngs(0)))
    tensors = _read_tensors(path)
    if cfg.tie_word_embeddings and "lm_head.weight" in tensors:
        # Some tied exports store a copy of the embedding; accept it only if it is one.
        head = tensors.pop("lm_head.weight")
        if not np.array_equal(head, tensors.get("model.embed_tokens.weight")):
            raise ValueError(
                f"{path!r}: tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight"
            )
    expected = _hf_variables(target)
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path!r} does not match the Qwen3 config: missing tensors {missing[:8]}"
            f"{' …' if len(missing) > 8 else ''}, unexpected tensors {unexpected[:8]}"
            f"{' …' if len(unexpected) > 8 else ''}"
        )
    for name, (variable, transposed) in expected.items():
        value = tensors[name].T if transposed else tensors[name]
        want = variable.get_value().shape
        if value.shape != want:
            stored = tuple(reversed(want)) if transposed else want
            raise ValueError(f"tensor {name!r} has shape {tuple(tensors[name].shape)}: expected {stored}")
        variable.set_value(cast_weight(name, value, cfg.jnp_param_dtype, path))
    unset = [leaf for leaf in jax.tree.leaves(nnx.state(target)) if isinstance(leaf, jax.ShapeDtypeStruct)]
    if unset:
        raise ValueError(f"Qwen3Target has {len(unset)} parameters without a Hugging Face tensor name")
    return target


def save_target(target: Qwen3Target, path: str | os.PathLike, *, max_shard_bytes: int | None = None) -> None:
    """Writes ``target`` as a Hugging Face Qwen3 checkpoint that :func:`load_target` reads.

    The checkpoint files already in the folder are replaced only once every new file is
    written: a failed save leaves the old checkpoint loadable
    (:func:`~dspark_jax.safetensors_io.write_tensors`).

    Args:
      target: the model.
      path: output folder (created if needed).
      max_shard_bytes: split the weights into shards of at most about this size, with a
        ``model.safetensors.index.json``; one ``model.safetensors`` when omitted.

    Raises:
      TypeError: ``target`` is not a :class:`Qwen3Target`, or ``path`` not a path.
      ValueError: ``path`` exists and is not a folder, or ``max_shard_bytes`` is invalid.
    """
    if not isinstance(target, Qwen3Target):
        raise TypeError(f"target must be a Qwen3Target, got {type(target).__name__}")
    path = folder_path(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(
            f"target path {path!r} exists and is not a folder: expected a folder to write the checkpoint in"
        )
    tensors = {}
    for name, (variable, transposed) in _hf_variables(target).items():
        value = np.asarray(variable.get_value())
        tensors[name] = np.ascontiguousarray(value.T if transposed else value)
    write_tensors(
        path, tensors, max_shard_bytes=max_shard_bytes, json_files={"config.json": target.config.to_hf_config()}
    )


def check_pair(draft_cfg: DraftConfig, target_cfg: TargetConfig) -> None:
    """Raises ``ValueError`` unless a draft built from ``draft_cfg`` can serve this target.

    The draft borrows the target's embedding and lm_head (same hidden size, same
    vocabulary) and reads the target layers in ``target_layer_ids``.

    Raises:
      TypeError: ``draft_cfg`` is not a :class:`DraftConfig` or ``target_cfg`` not a
        :class:`TargetConfig`.
      ValueError: the draft does not fit the target, naming the field.
    """
    for name, value, cls in (("draft_cfg", draft_cfg, DraftConfig), ("target_cfg", target_cfg, TargetConfig)):
        if not isinstance(value, cls):
            raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
    if draft_cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"draft hidden_size={draft_cfg.hidden_size} does not fit the target: must equal the target's "
            f"hidden_size={target_cfg.hidden_size} (the draft borrows its embedding and lm_head)"
        )
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ValueError(
            f"draft vocab_size={draft_cfg.vocab_size} does not fit the target: must equal the target's "
            f"vocab_size={target_cfg.vocab_size}"
            + (
                " (a draft of a smaller vocabulary can load and propose, the lm_head cropped, but speculative "
                "decoding verifies over the target's whole vocabulary)"
                if draft_cfg.vocab_size < target_cfg.vocab_size
                else ""
            )
        )
    depth = target_cfg.num_hidden_layers
    if draft_cfg.num_target_layers is not None and draft_cfg.num_target_layers != depth:
        raise ValueError(
            f"draft num_target_layers={draft_cfg.num_target_layers} does not fit the target: it has "
            f"num_hidden_layers={depth}"
        )
    bad = [i for i in draft_cfg.target_layer_ids if not -1 <= i < depth]
    if bad:
        raise ValueError(
            f"draft target_layer_ids={list(draft_cfg.target_layer_ids)} do not fit the target: ids {bad} are "
            f"outside -1 <= id < num_hidden_layers={depth}"
        )
