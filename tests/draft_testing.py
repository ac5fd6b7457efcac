"""Shared helpers for the draft tests: tiny configs, random parameters, export to names.

``hf_params`` reads each parameter off the module by attribute (not through
``dspark_jax.checkpoint``), so the reference comparisons do not depend on the loader.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax import sampling as S
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import DSparkDraft

TRAINING_TARGET = TargetConfig(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    vocab_size=32,
    max_position_embeddings=64,
    tie_word_embeddings=True,
)
"""The tiny target the training tests train (or stand in for), vocabulary 32."""

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=40,
    rope_theta=1_000_000.0,
    mask_token_id=39,
    target_layer_ids=(-1, 0, 2),
    num_target_layers=3,
    block_size=4,
    markov_rank=8,
    markov_head_type="vanilla",
    enable_confidence_head=True,
    confidence_head_with_markov=True,
)
EMBED_ROWS = 44  # a target embedding padded past vocab_size (base logits must crop)


def tiny_config(**overrides) -> DraftConfig:
    return DraftConfig(**{**TINY, **overrides})


def rel_err(actual, expected) -> float:
    """``max |actual − expected| / max |expected|``."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / np.max(np.abs(expected)))


def _random_leaf(rng: np.random.Generator, markov_scale: float):
    def fill(path, x):
        name = jax.tree_util.keystr(path)
        if "norm" in name:
            value = 1.0 + 0.3 * rng.standard_normal(x.shape)
        elif "sts_temperature" in name:
            value = rng.uniform(0.5, 2.0, x.shape)
        elif "markov_w" in name:
            value = markov_scale * rng.standard_normal(x.shape)
        elif "embed_tokens" in name or "lm_head" in name:
            value = 0.5 * rng.standard_normal(x.shape)
        else:
            value = 0.3 * rng.standard_normal(x.shape)
        return jnp.asarray(value, x.dtype)

    return fill


def randomize(module: nnx.Module, seed: int, *, markov_scale: float = 1.0) -> None:
    """Gives every parameter of ``module`` random values (norm weights near 1, positive STS)."""
    state = nnx.state(module)
    fill = _random_leaf(np.random.default_rng(seed), markov_scale)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state)))
    nnx.update(module, state)


def random_draft(cfg: DraftConfig, seed: int = 0) -> DSparkDraft:
    """A draft with random parameters and random ``[EMBED_ROWS, H]`` borrowed tables.

    Built abstractly and filled from NumPy, so no initialiser runs (fast on CPU).
    """
    table = jax.ShapeDtypeStruct((EMBED_ROWS, cfg.hidden_size), cfg.jnp_param_dtype)

    def build():
        zeros = jnp.zeros(table.shape, table.dtype)
        return DSparkDraft(cfg, rngs=nnx.Rngs(0), embed_tokens=zeros, lm_head=zeros + 0)

    graphdef, state = nnx.split(nnx.eval_shape(build))
    fill = _random_leaf(np.random.default_rng(seed), 1.0)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_map_with_path(fill, nnx.to_pure_dict(state)))
    return nnx.merge(graphdef, state)


def jit_apply(fn, module: nnx.Module, *args):
    """``fn(module, *args)`` compiled as one program: far faster on CPU than op-by-op eager dispatch."""
    return nnx.jit(fn)(module, *args)


def _np(x) -> np.ndarray:
    return np.asarray(jax.device_get(x[...]), np.float64)


def _linear(out: dict, name: str, module: nnx.Linear) -> None:
    out[name + ".weight"] = _np(module.kernel).T  # flax [in, out] -> PyTorch [out, in]
    if module.bias is not None:
        out[name + ".bias"] = _np(module.bias)


def hf_params(draft: DSparkDraft) -> dict[str, np.ndarray]:
    """The draft's parameters under DeepSpec names, PyTorch layouts, float64."""
    out = {
        "embed_tokens.weight": _np(draft.embed_tokens),
        "lm_head.weight": _np(draft.lm_head),
        "hidden_norm.weight": _np(draft.hidden_norm.weight),
        "norm.weight": _np(draft.norm.weight),
    }
    _linear(out, "fc", draft.fc)
    for i, layer in enumerate(draft.layers):
        attn = layer.self_attn
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            _linear(out, f"layers.{i}.self_attn.{proj}", getattr(attn, proj))
        out[f"layers.{i}.self_attn.q_norm.weight"] = _np(attn.q_norm.weight)
        out[f"layers.{i}.self_attn.k_norm.weight"] = _np(attn.k_norm.weight)
        for proj in ("gate_proj", "up_proj", "down_proj"):
            _linear(out, f"layers.{i}.mlp.{proj}", getattr(layer.mlp, proj))
        out[f"layers.{i}.input_layernorm.weight"] = _np(layer.input_layernorm.weight)
        out[f"layers.{i}.post_attention_layernorm.weight"] = _np(layer.post_attention_layernorm.weight)
    head = draft.markov_head
    if head is not None:
        out["markov_head.markov_w1.weight"] = _np(head.markov_w1)
        out["markov_head.markov_w2.weight"] = _np(head.markov_w2)
        for proj in ("gate_proj", "joint_proj"):
            if hasattr(head, proj):
                _linear(out, f"markov_head.{proj}", getattr(head, proj))
    if draft.confidence_head is not None:
        _linear(out, "confidence_head.proj", draft.confidence_head.proj)
        out["confidence_head.sts_temperature"] = _np(draft.confidence_head.sts_temperature)
    return out


TINY_ROUND_SEED = 2
"""The key seed of :func:`tiny_rounds_per_choice`'s rounds (``jax.random.key(TINY_ROUND_SEED)``)."""


def tiny_round(mode: str, *, gamma: int | None = None) -> tuple:
    """The bf16 tiny preset's draft and one round's inputs: 4 rows (``mode`` of
    :func:`dspark_jax.bench.sampling_params`), contexts of 20, 0, 33 and 41 tokens, the key of
    :data:`TINY_ROUND_SEED`; ``gamma`` overrides the preset's γ (fewer walk steps to trace
    through the Pallas interpreter).

    Returns:
      ``(cfg, graphdef, args)`` with ``args = (state, cache, bonus, prefix_lens, temperatures,
      top_k, key)``: ``propose(graphdef, *args)`` is the round.
    """
    from dspark_jax import bench_workload
    from dspark_jax.presets import load_preset

    overrides = {} if gamma is None else {"block_size": gamma}
    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16", **overrides)
    graphdef, state = bench_workload.build_draft(cfg)
    cache = bench_workload.random_context(cfg, 4, 48, jax.random.key(1))
    bonus = jnp.array([3, 7, 11, 0], jnp.int32)
    lens = jnp.array([20, 0, 33, 41], jnp.int32)
    args = (state, cache, bonus, lens, *bench_workload.sampling_params(4, mode), jax.random.key(TINY_ROUND_SEED))
    return cfg, graphdef, args


def tiny_rounds_per_choice(
    monkeypatch, variable: str, choices=("xla", "pallas"), *, eager: bool = False, gamma: int | None = None
) -> tuple:
    """The folded round of :func:`tiny_round` (mixed greedy / sampling rows), traced afresh under
    each value of environment ``variable``; with ``eager``, also the eager round
    (``propose_eager``) under the key ``"eager"``; ``gamma`` as in :func:`tiny_round`.

    Returns:
      ``(cfg, {choice: DraftBlock})``.
    """
    from dspark_jax import propose, propose_eager

    cfg, graphdef, args = tiny_round("mixed", gamma=gamma)
    blocks = {}
    for choice in choices:
        monkeypatch.setenv(variable, choice)
        step = jax.jit(lambda *a: propose(graphdef, *a))  # a fresh trace per choice
        blocks[choice] = step(*args)
    if eager:
        state, *rest = args
        blocks["eager"] = propose_eager(nnx.merge(graphdef, state), *rest)
    return cfg, blocks


def planted_race_rows() -> tuple[jax.Array, jax.Array, list[int]]:
    """Six rows of one walk step over V = 2500 (race blocks of 128) with planted edge cases, for
    the race kernels: greedy ties go to the lowest id across blocks, NaN counts as -inf, an all
    -inf row yields token 0, +inf sampled tokens tie and the lowest wins.

    Returns:
      ``(base float32 [6, 1, V], greedy [6] bool, the tokens any sampler must pick)``.
    """
    vocab, batch = 2500, 6
    base = jnp.zeros((batch, 1, vocab), jnp.float32)
    base = base.at[0, 0, [1030, 2100, 2499]].set(5.0)  # a three-way tie across blocks 8, 16 and 19
    base = base.at[1, 0, :].set(-jnp.inf)
    base = base.at[2, 0, :].set(jnp.nan).at[2, 0, 1800].set(1.0)
    base = base.at[3, 0, :].set(-jnp.inf)  # sampling row, all -inf
    base = base.at[4, 0, :].set(jnp.nan).at[4, 0, [2450, 1500]].set(jnp.inf)  # sampling: +inf in blocks 19, 11
    base = base.at[5, 0, :].set(-jnp.inf).at[5, 0, 2047].set(0.0)  # sampling: block 15's last token only
    greedy = jnp.array([True, True, True, False, False, False])
    return base, greedy, [1030, 0, 1800, 0, 1500, 2047]


def edge_race_rows() -> tuple[jax.Array, jax.Array, jax.Array]:
    """Eight rows of one walk step over V = 300 (race blocks of 128, the last one short) at the
    edges of ``kept / T``: tiny logits (row 0), zero logits (1), ``T = 2¹⁸`` (2), a plain row (3),
    a greedy row with tiny logits (4), tiny logits in block 0 alone (5), half the tokens ``-inf``
    (6), and one token per block whose ``kept · RN(1/T)`` overflows to ``+inf`` (7:
    ``1.9375·2¹²⁷ / (0.96875 + 2⁻²⁴)``, which the rounded division would take to the largest
    float32; README note 92).

    Returns:
      ``(base bf16 [8, 1, V], temperatures [8] clamped, greedy [8] bool)``.
    """
    batch, vocab = 8, 300
    width = S.race_width(vocab)
    rng = np.random.default_rng(5)
    base = rng.normal(0.0, 2.0, (batch, 1, vocab))
    base[[0, 4]] *= 1e-30
    base[1] = 0.0
    base[5, 0, :width] *= 1e-30
    base[6, 0, ::2] = -np.inf
    base[7, 0, [3, 150, 299]] = 1.9375 * 2.0**127
    base = jnp.asarray(base, jnp.bfloat16)
    temps = S.clamp_temperatures(jnp.asarray([0.9, 1.3, 2.0**18, 0.7, 0.0, 1.1, 0.5, 0.96875 + 2.0**-24], jnp.float32))
    greedy = jnp.asarray([False, False, False, False, True, False, False, False])
    x, t = np.asarray(base[7, 0, [3, 150, 299]], np.float32), np.asarray(temps)[7]
    with np.errstate(over="ignore"):  # the overflow is the point
        assert np.all(np.isinf(x * (np.float32(1) / t))) and np.all(x / t == np.finfo(np.float32).max)
    return base, temps, greedy
