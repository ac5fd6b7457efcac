"""The benchmark's workload: its shapes, the draft and target configs, random weights and inputs,
the sampling modes, and the bytes and FLOPs a draft round must move (its floor).

Shape legend: B batch, γ draft slots, V vocabulary, H hidden, C context capacity,
L draft layers, KVH key/value heads, D head dim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.cache import ContextCache
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.presets import load_preset

MODES = ("greedy", "mixed", "sampling")


@dataclasses.dataclass(frozen=True, kw_only=True)
class BenchShapes:
    """Model shapes and measurement sizes of one benchmark preset.

    ``preset`` names a draft config in ``configs/`` (read with ``dtype`` for weights and
    compute); the target shares the draft's hidden size, heads, intermediate size and
    vocabulary and has the preset's ``num_target_layers`` layers.
    """

    name: str
    preset: str
    dtype: str
    context: int
    ceiling_bytes: int
    matmul_size: int
    batches: tuple[int, ...]
    iters: int
    e2e_steps: int


SHAPES = {
    # The released dspark_qwen3_8b_block7 draft (bf16, vanilla head, confidence head).
    "8b": BenchShapes(
        name="8b",
        preset="dspark_qwen3_8b_block7",
        dtype="bfloat16",
        context=1024,
        ceiling_bytes=2 << 30,
        matmul_size=8192,
        batches=(1, 8, 32, 128),
        iters=50,
        e2e_steps=32,
    ),
    # Seconds on a CPU: the CI smoke run.
    "tiny": BenchShapes(
        name="tiny",
        preset="tiny",
        dtype="float32",
        context=32,
        ceiling_bytes=8 << 20,
        matmul_size=128,
        batches=(1, 4),
        iters=3,
        e2e_steps=4,
    ),
}


def draft_config(shapes: BenchShapes) -> DraftConfig:
    """The benchmark draft's config."""
    return load_preset(shapes.preset, dtype=shapes.dtype, param_dtype=shapes.dtype)


def target_config(shapes: BenchShapes, num_layers: int | None = None) -> TargetConfig:
    """A Qwen3 target of the draft's width with ``num_layers`` (default the preset's) layers."""
    d = draft_config(shapes)
    return TargetConfig(
        hidden_size=d.hidden_size,
        intermediate_size=d.intermediate_size,
        num_hidden_layers=num_layers or d.num_target_layers,
        num_attention_heads=d.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads,
        head_dim=d.head_dim,
        vocab_size=d.vocab_size,
        dtype=d.dtype,
        param_dtype=d.param_dtype,
    )


# --------------------------------------------------------------------------- inputs
def build_draft(
    cfg: DraftConfig, seed: int = 0, *, embed_tokens: jax.Array | None = None, lm_head: jax.Array | None = None
) -> tuple[nnx.GraphDef, nnx.State]:
    """A draft with random weights created on the default device.

    Returns:
      ``(graphdef, state)`` of the split module.
    """
    draft = DSparkDraft(cfg, rngs=nnx.Rngs(seed), embed_tokens=embed_tokens, lm_head=lm_head)
    return nnx.split(draft)


def jit_split(
    fn: Callable[..., Any], graphdef: nnx.GraphDef, state: nnx.State, **jit_kwargs: Any
) -> tuple[Callable[..., Any], list[jax.Array]]:
    """``jax.jit`` of ``fn(graphdef, state, *args)`` called as ``(leaves, *args)``.

    The graphdef is closed over and the state passed as a plain list of leaves. Passing an
    NNX ``GraphDef`` as a static argument makes every call hash it (measured on a 2-core
    CPU: 0.9 ms for the 5-layer draft, 6.1 ms for a 36-layer target), and flattening an
    ``nnx.State`` costs 0.1–0.7 ms a call; this form pays neither.

    Returns:
      ``(jitted, leaves)``: call ``jitted(leaves, *args, **kwargs)``.
    """
    leaves, treedef = jax.tree.flatten(state)

    def call(leaves, *args, **kwargs):
        return fn(graphdef, jax.tree.unflatten(treedef, leaves), *args, **kwargs)

    return jax.jit(call, **jit_kwargs), leaves


def random_context(cfg: DraftConfig, batch: int, capacity: int, key: jax.Array) -> ContextCache:
    """A context cache ``[L, B, C, KVH, D]`` filled with random keys and values.

    Random entries stand in for ``fill_context`` of a 1024-token prompt: the proposal
    reads them the same way, and building them costs no backbone pass.
    """
    shape = (cfg.num_hidden_layers, batch, capacity, cfg.num_key_value_heads, cfg.head_dim)
    kk, kv = jax.random.split(key)
    make = jax.jit(lambda k: jax.random.normal(k, shape, cfg.jnp_dtype))
    return ContextCache(k=make(kk), v=make(kv))


def mode_sampling_rows(batch: int, mode: str) -> np.ndarray:
    """``[B]`` bool: the rows that sample in a benchmark batch of ``mode`` (see :func:`sampling_params`)."""
    if mode not in MODES:
        raise ValueError(f"mode={mode!r} is invalid: must be one of {MODES}")
    n_sample = {"greedy": 0, "mixed": max(1, batch // 2), "sampling": batch}[mode]
    return np.arange(batch) < n_sample


def sampling_params(batch: int, mode: str) -> tuple[jax.Array, jax.Array]:
    """Per-row ``(temperatures [B], top_k [B])`` of a benchmark batch.

    ``greedy``: every row greedy; ``sampling``: every row samples at T = 1 over the whole
    vocabulary; ``mixed``: the first ``max(1, B // 2)`` rows sample, the rest are greedy.
    """
    from dspark_jax.sampling import TOP_K_ALL

    sample = mode_sampling_rows(batch, mode)
    temps = np.where(sample, 1.0, 0.0).astype(np.float32)
    top_k = np.where(sample, TOP_K_ALL, 1).astype(np.int32)
    return jnp.asarray(temps), jnp.asarray(top_k)


# --------------------------------------------------------------------------- floors
def round_cost(cfg: DraftConfig, batch: int, context: int, *, folded_sampling: bool) -> dict[str, float]:
    """Bytes a draft round must move and the FLOPs it must do.

    Counted: the layer weights, the lm_head and the embedding rows once; ``markov_w2``
    once per walk step (78 MB at the 8B shapes, more than an H200's 60 MB L2, and each
    step needs the previous step's token); the context keys and values of ``context``
    positions per request; the corrected logits ``[B, γ, V]`` (model dtype) written when the
    round folds sampling. Norms, RoPE and the confidence head are negligible.

    Returns:
      ``bytes``, ``flops`` and the parts of each.
    """
    item = jnp.dtype(cfg.jnp_param_dtype).itemsize
    act = jnp.dtype(cfg.jnp_dtype).itemsize
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, kvh, v, r, g = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.markov_rank, cfg.gamma
    rows = batch * cfg.num_query_rows
    layer_params = h * nh * d * 2 + h * kvh * d * 2 + 3 * h * i
    parts_bytes = {
        "layers": cfg.num_hidden_layers * layer_params * item,
        "lm_head": v * h * item,
        "markov_w2": g * v * r * item,
        "context_kv": 2 * cfg.num_hidden_layers * batch * context * kvh * d * act,
        "embed_rows": rows * h * item,
        "corrected_logits": batch * g * v * act if folded_sampling else 0,
    }
    keys = context + cfg.num_query_rows
    parts_flops = {
        "layers": 2 * rows * cfg.num_hidden_layers * layer_params,
        "attention": 2 * 2 * rows * cfg.num_hidden_layers * nh * d * keys,
        "lm_head": 2 * batch * g * v * h,
        "markov": 2 * batch * g * v * r,
    }
    return {
        "bytes": float(sum(parts_bytes.values())),
        "flops": float(sum(parts_flops.values())),
        "bytes_parts": parts_bytes,
        "flops_parts": parts_flops,
    }


def floor_ms(cost: dict[str, float], bandwidth: float, flop_rate: float) -> tuple[float, str]:
    """``max(bytes / bandwidth, flops / flop_rate)`` in ms and which term bounds it."""
    t_bytes = cost["bytes"] / bandwidth * 1e3
    t_flops = cost["flops"] / flop_rate * 1e3
    return (t_bytes, "bytes") if t_bytes >= t_flops else (t_flops, "flops")


def random_inputs(cfg: DraftConfig, batch: int, context: int, capacity: int, seed: int) -> dict[str, Any]:
    """A benchmark batch's inputs: a random context cache (:func:`random_context`), random
    bonus tokens ``[B]`` and ``context`` cached positions per request ``[B]``."""
    key = jax.random.key(seed)
    k_cache, k_bonus = jax.random.split(key)
    return {
        "cache": random_context(cfg, batch, capacity, k_cache),
        "bonus": jax.random.randint(k_bonus, (batch,), 0, cfg.vocab_size, jnp.int32),
        "prefix_lens": jnp.full((batch,), context, jnp.int32),
    }
