"""Draft training against a frozen target (the DeepSpec recipe, DSPARK_SPEC.md §6), and ``train-draft``.

Shape legend: B sequences, S sequence length, A anchors per sequence, N = B·A blocks,
γ draft slots, R query rows (γ or γ+1), V vocabulary, H hidden, L draft layers.

One step: the frozen target runs each sequence once and gives its logits and the fused
features of every position (computed on the fly, no offline cache); the draft projects
the features to context keys/values once per sequence; ``A`` distinct random anchors per
sequence (drawn without replacement, :func:`sample_anchors`) each open a block
``[x_a, MASK, …]`` at positions ``a + 0..R−1`` that sees the context at positions ``< a``.
Slot ``k`` is scored against the target's distribution of the token at ``a + k + 1`` on its
Markov-corrected, teacher-forced logits (``prev = [x_a, x_{a+1} … x_{a+γ−1}]``)::

    loss = Σ_k w_k (0.1·CE_k + 0.9·TV_k + 1.0·BCE_k) / Σ_k w_k,   w_k = exp(−k / 4)

with ``TV_k = ‖softmax(draft_k) − softmax(target_k)‖₁``, ``CE_k`` the cross-entropy of
the text's token, and ``BCE_k`` the confidence head's binary cross-entropy against
``clamp(1 − ½·TV_k, 0, 1)`` (held constant). AdamW (lr 6e-4, 4 % warmup, cosine decay,
no weight decay, global-norm clip 1.0) updates the draft's ``nnx.Param`` leaves only;
the borrowed embedding / lm_head and the calibration constants stay fixed.

Batches and anchors are drawn from a NumPy generator seeded with ``(seed, step)``, so a
run resumed from a checkpoint (parameters, optimizer state, step) continues exactly.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.cli import add_save_dtype, check_checkpoint, loading
from dspark_jax.config import (
    SHAPE_FIELDS,
    DraftConfig,
    TargetConfig,
    check_flag,
    check_seed,
    is_integer,
    normalise_numbers,
    positive_int,
)
from dspark_jax.draft import check_models
from dspark_jax.training import (
    COUNT,
    COUNT_OR_ZERO,
    LEARNING_RATE,
    SEED,
    TrainResult,
    cast_params,
    check_heldout_losses,
    check_max_seconds,
    check_number,
    check_output_folder,
    check_resume_settings,
    check_schedule_fields,
    check_token_stream,
    check_trainable_dtype,
    check_training_memory,
    check_weight,
    compile_training_step,
    fit,
    optimizer_for,
    positive_seconds,
    recorded_value,
    sample_windows,
)

if TYPE_CHECKING:
    from dspark_jax.draft import DSparkDraft
    from dspark_jax.target import Target

DISTILL_PROMPT_LEN = 32  # corpus tokens that open each sequence the target writes for distillation


# --------------------------------------------------------------------------- the draft loss
@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftTrainConfig:
    """Hyper-parameters of :func:`train_draft` (defaults: DeepSpec's recipe, small batches).

    NumPy integer and float scalars are accepted and stored as Python numbers.

    Raises:
      TypeError: a float field (``lr``, a loss weight, ``position_decay`` …) is not a
        number, naming it.
      ValueError: a field is invalid, naming it, its value and what is allowed; or every
        loss weight is 0.
    """

    steps: int = 2000
    batch_size: int = 16
    seq_len: int = 256
    anchors_per_seq: int = 32
    lr: float = 6e-4
    warmup_frac: float = 0.04
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    ce_weight: float = 0.1
    tv_weight: float = 0.9
    confidence_weight: float = 1.0
    position_decay: float = 4.0
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        normalise_numbers(self)
        check_schedule_fields(self, ("steps", "batch_size", "seq_len", "anchors_per_seq", "log_every"))
        weights = ("ce_weight", "tv_weight", "confidence_weight")
        for name in weights:
            check_weight(name, getattr(self, name))
        if not any(getattr(self, name) > 0 for name in weights):
            raise ValueError(f"{' = '.join(weights)} = 0 is invalid: at least one loss weight must be > 0")
        check_number("position_decay", self.position_decay)
        if not self.position_decay > 0:  # inf is allowed: every position weighs the same
            raise ValueError(
                f"position_decay={self.position_decay!r} is invalid: must be > 0 (inf: equal position weights)"
            )


def check_target_config(target_cfg: Any) -> None:
    """Raises ``TypeError`` unless ``target_cfg`` is a target's config (a
    :class:`~dspark_jax.config.TargetConfig`, or any config with its shape fields)."""
    if isinstance(target_cfg, DraftConfig) or not all(hasattr(target_cfg, f) for f in SHAPE_FIELDS):
        raise TypeError(f"target_cfg must be a target's config (a TargetConfig), got {type(target_cfg).__name__}")


def check_draft_fits(
    draft_cfg: DraftConfig, target_cfg: TargetConfig, seq_len: int, *, anchors_per_seq: int = 1
) -> None:
    """Raises ``ValueError`` unless the draft can train on this target with ``seq_len``-token
    sequences holding ``anchors_per_seq`` distinct anchors each (at most :func:`anchor_positions`).

    Raises:
      TypeError: a config of the wrong kind.
    """
    if not isinstance(draft_cfg, DraftConfig):
        raise TypeError(f"draft_cfg must be a DraftConfig, got {type(draft_cfg).__name__}")
    check_target_config(target_cfg)
    positive_int("anchors_per_seq", anchors_per_seq)
    if draft_cfg.hidden_size != target_cfg.hidden_size:
        raise ValueError(
            f"draft hidden_size={draft_cfg.hidden_size} does not fit the target: must equal the target's "
            f"hidden_size={target_cfg.hidden_size} (the draft borrows its embedding and lm_head)"
        )
    depth = target_cfg.num_hidden_layers
    bad = [i for i in draft_cfg.target_layer_ids if not -1 <= i < depth]
    if bad or (draft_cfg.num_target_layers is not None and draft_cfg.num_target_layers != depth):
        raise ValueError(
            f"draft target_layer_ids={list(draft_cfg.target_layer_ids)} (num_target_layers="
            f"{draft_cfg.num_target_layers}) do not fit a target with num_hidden_layers={depth}: "
            f"ids must lie in -1 <= id < {depth}"
        )
    if draft_cfg.vocab_size > target_cfg.vocab_size:
        raise ValueError(
            f"draft vocab_size={draft_cfg.vocab_size} does not fit the target: must be <= the target's "
            f"vocab_size={target_cfg.vocab_size}"
        )
    need = draft_cfg.num_query_rows + 2
    if not is_integer(seq_len):
        raise ValueError(f"seq_len={seq_len!r} is invalid: must be an integer")
    if seq_len < need:
        raise ValueError(
            f"seq_len={seq_len!r} is shorter than a block: need at least {need} tokens "
            f"(a context token, the {draft_cfg.num_query_rows} block rows and the last row's target)"
        )
    if seq_len > draft_cfg.max_position_embeddings or seq_len > target_cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={seq_len} exceeds max_position_embeddings (draft {draft_cfg.max_position_embeddings}, "
            f"target {target_cfg.max_position_embeddings})"
        )
    limit = anchor_positions(seq_len, draft_cfg.num_query_rows)
    if anchors_per_seq > limit:
        raise ValueError(
            f"anchors_per_seq={anchors_per_seq} is invalid with seq_len={seq_len} and {draft_cfg.num_query_rows} "
            f"query rows: must be <= {limit}, the distinct anchor positions a sequence offers"
        )


def anchor_positions(seq_len: int, rows: int) -> int:
    """How many positions :func:`sample_anchors` draws from: ``1 … S − R − 1``."""
    return seq_len - rows - 1


def sample_anchors(rng: np.random.Generator, batch: int, anchors: int, seq_len: int, rows: int) -> np.ndarray:
    """Each sequence's ``A`` distinct anchors, drawn without replacement and uniformly from
    ``1 … S − R − 1`` (a non-empty context and every target inside the sequence).

    Row ``b`` holds the first ``A`` entries of a uniform random permutation of those positions
    (``rng.permuted`` shuffles every row apart), so no block counts twice in the loss, as in the
    DFlash-lineage trainers. The draw depends on ``rng``'s state alone (reproducible per seed
    and step).

    Args:
      rng: the step's NumPy generator.
      batch: ``B`` sequences.
      anchors: ``A`` anchors per sequence, at most :func:`anchor_positions`.
      seq_len: ``S``.
      rows: ``R``, the draft's query rows.

    Returns:
      int32 ``[B, A]``.

    Raises:
      ValueError: ``anchors`` is negative or above ``anchor_positions(seq_len, rows)``.
    """
    positions = max(anchor_positions(seq_len, rows), 0)
    if not 0 <= anchors <= positions:
        raise ValueError(
            f"anchors={anchors} is invalid with seq_len={seq_len} and {rows} query rows: must be in "
            f"[0, {positions}], the distinct anchor positions a sequence offers"
        )
    grid = np.broadcast_to(np.arange(1, positions + 1, dtype=np.int32), (batch, positions))  # [B, S − R − 1]
    return np.ascontiguousarray(rng.permuted(grid, axis=1)[:, :anchors])


def block_loss_terms(
    corrected: jax.Array,
    target_logits: jax.Array,
    gold: jax.Array,
    confidence_logits: jax.Array | None,
) -> dict[str, jax.Array]:
    """Per-slot loss terms of a batch of blocks.

    Args:
      corrected: ``[N, γ, V]`` draft Markov-corrected logits (float32).
      target_logits: ``[N, γ, V]`` target logits of the same positions.
      gold: ``[N, γ]`` the text's tokens at ``a + k + 1``.
      confidence_logits: ``[N, γ]`` raw confidence scores, or ``None``.

    Returns:
      ``ce``, ``tv``, ``bce`` (zeros without a confidence head), each ``[N, γ]``.
    """
    logq = jax.nn.log_softmax(corrected.astype(jnp.float32), axis=-1)
    p = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
    ce = -jnp.take_along_axis(logq, gold[..., None], axis=-1)[..., 0]
    tv = jnp.sum(jnp.abs(jnp.exp(logq) - p), axis=-1)
    if confidence_logits is None:
        bce = jnp.zeros_like(tv)
    else:
        label = jax.lax.stop_gradient(jnp.clip(1.0 - 0.5 * tv, 0.0, 1.0))
        bce = optax.sigmoid_binary_cross_entropy(confidence_logits.astype(jnp.float32), label)
    return {"ce": ce, "tv": tv, "bce": bce}


def draft_blocks(draft: DSparkDraft, target: Target, tokens: jax.Array, anchors: jax.Array) -> dict[str, jax.Array]:
    """Runs target and draft over every anchored block of a batch.

    Args:
      draft: a merged :class:`~dspark_jax.draft.DSparkDraft`.
      target: a merged target (frozen: its outputs are held constant).
      tokens: ``[B, S]`` int32.
      anchors: ``[B, A]`` int32 anchor positions.

    Returns:
      ``corrected [N, γ, V]``, ``target_logits [N, γ, V]``, ``gold [N, γ]``,
      ``confidence_logits [N, γ]`` (only with a confidence head).
    """
    cfg = draft.cfg
    b, s = tokens.shape
    gamma = cfg.gamma
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    logits, features, _ = target(tokens, positions, target.init_cache(b, s), feature_layers=cfg.target_layer_ids)
    logits = jax.lax.stop_gradient(logits[..., : cfg.vocab_size])  # [B, S, V]
    features = jax.lax.stop_gradient(features)  # [B, S, K·H]
    ctx_k, ctx_v = draft.context_kv(features, positions)  # [L, B, S, KVH, D]

    ids = jax.vmap(draft.block_ids, in_axes=1, out_axes=1)(jnp.take_along_axis(tokens, anchors, axis=1))  # [B, A, R]
    block_pos = jax.vmap(draft.block_positions, in_axes=1, out_axes=1)(anchors)  # [B, A, R]
    ctx_mask = jnp.arange(s, dtype=jnp.int32)[None, None, :] < anchors[:, :, None]  # [B, A, S]

    def one_anchor(ids_a, pos_a, mask_a):
        return draft(ids_a, positions=pos_a, ctx_k=ctx_k, ctx_v=ctx_v, ctx_mask=mask_a)

    if anchors.shape[1] == 1:  # XLA's CPU backend crashed (SIGSEGV) differentiating the vmap over one anchor
        hidden = one_anchor(ids[:, 0], block_pos[:, 0], ctx_mask[:, 0])[:, None]  # [B, 1, R, H]
    else:
        hidden = jax.vmap(one_anchor, in_axes=1, out_axes=1)(ids, block_pos, ctx_mask)  # [B, A, R, H]
    n = b * anchors.shape[1]
    hidden = draft.slots(hidden.reshape(n, hidden.shape[2], hidden.shape[3]))  # [N, γ, H]

    slot_pos = (anchors[:, :, None] + jnp.arange(gamma, dtype=jnp.int32)).reshape(b, -1)  # [B, A·γ]
    prev = jnp.take_along_axis(tokens, slot_pos, axis=1).reshape(n, gamma)  # [N, γ] x_{a+k}
    gold = jnp.take_along_axis(tokens, slot_pos + 1, axis=1).reshape(n, gamma)  # [N, γ] x_{a+k+1}
    t_logits = jnp.take_along_axis(logits, slot_pos[..., None], axis=1).reshape(n, gamma, -1)  # [N, γ, V]
    out = {"corrected": draft.corrected_logits(hidden, prev), "target_logits": t_logits, "gold": gold}
    if draft.confidence_head is not None:
        prev_embed = draft.markov_head.embed_prev(prev) if cfg.confidence_head_with_markov else None
        out["confidence_logits"] = draft.confidence_head.logits(hidden, prev_embed)
    return out


def draft_loss(
    draft: DSparkDraft, target: Target, tokens: jax.Array, anchors: jax.Array, tcfg: DraftTrainConfig
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The weighted DeepSpec loss of one batch and its mean terms (see the module docstring).

    Raises:
      TypeError: ``tcfg`` is not a :class:`DraftTrainConfig`.
    """
    if not isinstance(tcfg, DraftTrainConfig):
        raise TypeError(f"tcfg must be a DraftTrainConfig, got {type(tcfg).__name__}")
    blocks = draft_blocks(draft, target, tokens, anchors)
    terms = block_loss_terms(
        blocks["corrected"], blocks["target_logits"], blocks["gold"], blocks.get("confidence_logits")
    )
    gamma = draft.cfg.gamma
    w = jnp.exp(-jnp.arange(gamma, dtype=jnp.float32) / tcfg.position_decay)
    w = w / w.sum()  # [γ]

    def weighted(x):
        return jnp.mean(jnp.sum(x * w, axis=-1))

    metrics = {name: weighted(x) for name, x in terms.items()}
    loss = tcfg.ce_weight * metrics["ce"] + tcfg.tv_weight * metrics["tv"] + tcfg.confidence_weight * metrics["bce"]
    return loss, {"loss": loss, **metrics}


@functools.lru_cache(maxsize=8)
def make_draft_train_step(
    draft_graphdef: nnx.GraphDef[DSparkDraft], target_graphdef: nnx.GraphDef[Target], tcfg: DraftTrainConfig
) -> Callable:
    """The jitted step ``(params, rest, opt_state, target_state, tokens, anchors) -> (params, opt_state, metrics)``.

    Cached on its (hashable) arguments, so runs of the same models and settings in one
    process, a resumed run for example, share one compilation.
    """
    optimizer = optimizer_for(tcfg)

    def step(params, rest, opt_state, target_state, tokens, anchors):
        target = nnx.merge(target_graphdef, target_state)

        def loss_fn(p):
            draft = nnx.merge(draft_graphdef, p, rest)
            return draft_loss(draft, target, tokens, anchors, tcfg)

        (_, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, metrics

    return jax.jit(step, donate_argnums=(0, 2))


def block_acceptance(blocks: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Per-block teacher-forced acceptance of each slot (the text's prefix accepted before it).

    Returns:
      ``accept [N, γ]``: ``Σ_v min(p_k, q_k)``, the chance that rejection sampling at T = 1
      accepts a draft drawn from ``q_k``; ``match [N, γ]``: 1 where ``argmax q_k ==
      argmax p_k`` (greedy decoding accepts), else 0.
    """
    q = jax.nn.softmax(blocks["corrected"], axis=-1)
    p = jax.nn.softmax(blocks["target_logits"].astype(jnp.float32), axis=-1)
    accept = jnp.sum(jnp.minimum(p, q), axis=-1)  # [N, γ]
    match = (jnp.argmax(q, axis=-1) == jnp.argmax(p, axis=-1)).astype(jnp.float32)  # [N, γ]
    return accept, match


def acceptance_stats(blocks: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Teacher-forced acceptance of a batch of blocks (:func:`block_acceptance`) and the τ
    estimates that chain it: ``1 + Σ_k Π_{j≤k} accept_j`` per block (the bonus included).

    Returns:
      ``accept_t1 [γ]``, ``match_greedy [γ]``, ``tau_t1`` and ``tau_greedy`` (scalars).
    """
    acc, match = block_acceptance(blocks)
    return {
        "accept_t1": acc.mean(0),
        "match_greedy": match.mean(0),
        "tau_t1": (1.0 + jnp.cumprod(acc, axis=-1).sum(-1)).mean(),
        "tau_greedy": (1.0 + jnp.cumprod(match, axis=-1).sum(-1)).mean(),
    }


def heldout_windows(
    draft_cfg: DraftConfig,
    target_cfg: Any,
    tokens: np.ndarray,
    *,
    batches: int,
    batch_size: int,
    seq_len: int,
    seed: int,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """``batches`` pairs of ``[batch_size, seq_len]`` windows of a token stream and their
    ``[batch_size, A]`` anchors (every 4th position with room for the draft's block).

    Raises:
      ValueError: ``batches`` or ``batch_size`` below 1, a ``seq_len`` with no room for an
        anchor's block or past either model's ``max_position_embeddings``, or a bad token
        stream.
    """
    positive_int("batches", batches), positive_int("batch_size", batch_size)
    check_seed("seed", seed)
    rows = draft_cfg.num_query_rows
    if not is_integer(seq_len) or seq_len < rows + 2:  # room for one anchor and its block of query rows
        raise ValueError(
            f"seq_len={seq_len!r} is invalid: must be an integer >= {rows + 2} (one anchor and the draft's "
            f"{rows} query rows)"
        )
    limits = {
        "draft": draft_cfg.max_position_embeddings,
        "target": getattr(target_cfg, "max_position_embeddings", None),
    }
    if any(limit is not None and seq_len > limit for limit in limits.values()):
        raise ValueError(
            f"seq_len={seq_len} exceeds max_position_embeddings (draft {limits['draft']}, target {limits['target']}): "
            "a window runs both models at positions 0 … seq_len − 1"
        )
    tokens = check_token_stream(tokens, seq_len, draft_cfg.vocab_size)
    rng = np.random.default_rng(seed)
    anchors = np.arange(1, seq_len - rows, 4, dtype=np.int32)
    anchors = np.broadcast_to(anchors, (batch_size, anchors.size))
    return [(sample_windows(tokens, batch_size, seq_len, rng), anchors) for _ in range(batches)]


def map_heldout_blocks(
    draft: DSparkDraft,
    target: Target,
    tokens: np.ndarray,
    fn: Callable,
    *,
    batches: int,
    batch_size: int,
    seq_len: int,
    seed: int,
) -> list:
    """``fn(blocks)`` (traced; ``blocks`` as :func:`draft_blocks` returns them) for each batch
    of :func:`heldout_windows`, one compiled call per batch; returns their outputs.

    Raises:
      ValueError: as :func:`heldout_windows`.
    """
    check_models(target, draft)
    windows = heldout_windows(
        draft.cfg, target.config, tokens, batches=batches, batch_size=batch_size, seq_len=seq_len, seed=seed
    )
    dgraph, dstate = nnx.split(draft)
    tgraph, tstate = nnx.split(target)

    @jax.jit
    def score(dstate, tstate, batch, anchors):
        return fn(draft_blocks(nnx.merge(dgraph, dstate), nnx.merge(tgraph, tstate), batch, anchors))

    return [score(dstate, tstate, batch, anchors) for batch, anchors in windows]


def evaluate_draft(
    draft: DSparkDraft,
    target: Target,
    tokens: np.ndarray,
    *,
    batches: int = 8,
    batch_size: int = 8,
    seq_len: int = 256,
    seed: int = 1,
) -> dict[str, Any]:
    """Teacher-forced loss terms and acceptance of a draft on a token stream (held-out text).

    Args:
      draft, target: merged modules.
      tokens: ``[N]`` int32 token stream.
      batches, batch_size, seq_len: how much text to score; anchors at every 4th position.
      seed: window sampling seed.

    Returns:
      Mean ``ce``, ``tv``, ``bce``, ``tau_t1``, ``tau_greedy`` and per-slot ``accept_t1`` /
      ``match_greedy`` lists.

    Raises:
      ValueError: ``batches`` or ``batch_size`` below 1, a ``seq_len`` with no room for an
        anchor's block or past either model's ``max_position_embeddings``, or a bad token
        stream (:func:`heldout_windows`).
    """

    def score(blocks):
        terms = block_loss_terms(
            blocks["corrected"], blocks["target_logits"], blocks["gold"], blocks.get("confidence_logits")
        )
        return {**{k: v.mean() for k, v in terms.items()}, **acceptance_stats(blocks)}

    results = map_heldout_blocks(
        draft, target, tokens, score, batches=batches, batch_size=batch_size, seq_len=seq_len, seed=seed
    )
    out = jax.tree.map(lambda *xs: np.mean(np.stack([np.asarray(x) for x in xs]), axis=0), *results)
    return {k: (v.tolist() if np.ndim(v) else float(v)) for k, v in out.items()}


def distillation_data(
    target: Target,
    tokens: np.ndarray,
    *,
    count: int,
    seq_len: int,
    prompt_len: int = DISTILL_PROMPT_LEN,
    seed: int = 0,
    batch: int = 2048,
) -> np.ndarray:
    """Sequences the target writes itself from prompts of the training text (DeepSpec trains on
    target-generated responses): half greedy, half sampled at temperature 1.

    Args:
      target: the target.
      tokens: ``[N]`` training token stream the prompts are cut from.
      count: number of sequences.
      seq_len: tokens per sequence (prompt included).
      prompt_len: prompt tokens.
      seed: prompt choice and sampling key.
      batch: sequences generated per call.

    Returns:
      ``[count, seq_len]`` int32.

    Raises:
      TypeError: ``target`` is not a target model.
      ValueError: ``count`` or ``batch`` below 1, a ``seq_len`` past the target's positions,
        ``prompt_len`` outside 1..seq_len-1, a ``seed`` outside ``[0, 2³² − 1]``, or a bad
        token stream.
    """
    from dspark_jax.generation import generate

    check_models(target)
    positive_int("count", count), positive_int("batch", batch)
    check_seed("seed", seed)
    limit = target.config.max_position_embeddings
    if not is_integer(seq_len) or not 2 <= seq_len <= limit:
        raise ValueError(
            f"seq_len={seq_len!r} is invalid: must be an integer in [2, {limit}] (the target's "
            "max_position_embeddings: it writes every position of a sequence)"
        )
    if not is_integer(prompt_len) or not 0 < prompt_len < seq_len:
        raise ValueError(f"prompt_len={prompt_len!r} is invalid: must be an integer in 1..seq_len-1={seq_len - 1}")
    tokens = check_token_stream(tokens, seq_len, target.config.vocab_size)
    rng = np.random.default_rng([seed, 1])
    out = np.zeros((count, seq_len), np.int32)
    for i in range(0, count, batch):
        prompts = sample_windows(tokens, min(batch, count - i), prompt_len, rng)
        temps = [float(j % 2) for j in range(len(prompts))]
        result = generate(
            target,
            prompts.tolist(),
            max_new_tokens=seq_len - prompt_len,
            temperature=temps,
            key=jax.random.fold_in(jax.random.key(seed), i),
        )
        for j, new in enumerate(result.tokens):
            out[i + j, :prompt_len] = prompts[j]
            out[i + j, prompt_len:] = new
    return out


def train_draft(
    target: Target,
    draft_cfg: DraftConfig,
    tokens: np.ndarray,
    tcfg: DraftTrainConfig,
    *,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_at: int | None = None,
    max_seconds: float | None = None,
    distilled: np.ndarray | None = None,
) -> TrainResult:
    """Trains a DSpark (or DFlash-style, ``markov_rank=0``) draft against a frozen target.

    Args:
      target: the target module (its embedding and lm_head are borrowed, not trained).
      draft_cfg: the draft's config; must fit the target.
      tokens: ``[N]`` training token stream (documents joined by ``<|endoftext|>``).
      tcfg: training hyper-parameters.
      checkpoint_dir: where the resumable training state is written (every
        ``tcfg.checkpoint_every`` steps and at the end); ``None``: nowhere.
      resume: continue from the state in ``checkpoint_dir``.
      progress: draw the progress bar on stderr.
      stop_at: stop after this step (< ``tcfg.steps``), as if interrupted; the schedule
        still spans ``tcfg.steps``.
      max_seconds: also stop (and checkpoint) once the loop has run this long.
      distilled: ``[M, S]`` sequences the target generated itself (see
        :func:`distillation_data`); when given, ``batch_size // 2`` rows of every batch
        are drawn from them and the rest from ``tokens``.

    Returns:
      A :class:`TrainResult` with the draft and the metric history of the steps run.

    Raises:
      ValueError: the draft does not fit the target, or has float16 parameters
        (:func:`check_trainable_dtype`); it and one step's logits cannot fit in free memory
        (:func:`check_draft_memory`), or the compiled step cannot
        (:func:`compile_training_step`); ``tcfg.anchors_per_seq`` above the
        distinct anchor positions of a sequence; a bad token stream or ``distilled`` array;
        ``distilled`` with ``tcfg.batch_size < 2`` (no batch row would come from it);
        ``resume`` without ``checkpoint_dir``; ``stop_at`` or ``max_seconds`` out of range;
        a checkpoint that cannot be resumed; a loss or parameters that become NaN or
        infinite.
    """
    check_draft_fits(draft_cfg, target.config, tcfg.seq_len, anchors_per_seq=tcfg.anchors_per_seq)
    check_trainable_dtype("the draft's", draft_cfg)
    tokens = check_token_stream(tokens, tcfg.seq_len, draft_cfg.vocab_size)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs a checkpoint_dir")
    if distilled is not None:
        if tcfg.batch_size < 2:
            raise ValueError(
                f"batch_size={tcfg.batch_size} is invalid with distilled data: must be >= 2, since "
                "batch_size // 2 rows of every batch come from the distilled sequences"
            )
        distilled = np.asarray(distilled)
        if distilled.ndim != 2 or distilled.shape[1] != tcfg.seq_len or distilled.shape[0] < 1:
            raise ValueError(f"distilled has shape {distilled.shape}: expected [M >= 1, seq_len={tcfg.seq_len}]")
        distilled = check_token_stream(distilled.reshape(-1), tcfg.seq_len, draft_cfg.vocab_size).reshape(
            distilled.shape
        )
    end = tcfg.steps if stop_at is None else stop_at
    if not 0 < end <= tcfg.steps:
        raise ValueError(f"stop_at={stop_at!r} is invalid: must lie in 1..steps={tcfg.steps}")
    check_max_seconds(max_seconds)
    check_draft_memory(draft_cfg, target, tcfg)

    rows = draft_cfg.num_query_rows
    tgraph, tstate = nnx.split(target)
    draft = _new_draft(draft_cfg, target, tcfg.seed)
    graphdef, params, rest = nnx.split(draft, nnx.Param, ...)
    optimizer = optimizer_for(tcfg)
    batch = jax.ShapeDtypeStruct((tcfg.batch_size, tcfg.seq_len), jnp.int32)
    anchors = jax.ShapeDtypeStruct((tcfg.batch_size, tcfg.anchors_per_seq), jnp.int32)
    train_step = compile_training_step(
        make_draft_train_step(graphdef, tgraph, tcfg),
        (params, rest, jax.eval_shape(optimizer.init, params), tstate, batch, anchors),
        draft_sizes(draft_cfg, tcfg),
    )

    def step_fn(params, opt_state, step):
        rng = np.random.default_rng([tcfg.seed, step])
        batch = sample_windows(tokens, tcfg.batch_size, tcfg.seq_len, rng)
        if distilled is not None:
            rows_d = rng.integers(0, distilled.shape[0], size=tcfg.batch_size // 2)
            batch[: rows_d.size] = distilled[rows_d]
        anchors = sample_anchors(rng, tcfg.batch_size, tcfg.anchors_per_seq, tcfg.seq_len, rows)
        return train_step(params, rest, opt_state, tstate, batch, anchors)

    params, history, done, seconds = fit(
        step_fn,
        params,
        optimizer.init(params),
        tcfg,
        name="draft",
        run_meta=draft_run_meta(draft_cfg, tcfg),
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        progress=progress,
        max_seconds=max_seconds,
        end=end,
        record_every_step=True,
    )
    nnx.update(draft, params)
    return TrainResult(model=draft, history=history, step=done, seconds=seconds)


def draft_run_meta(draft_cfg: DraftConfig, tcfg: DraftTrainConfig) -> dict[str, Any]:
    """The settings a draft training checkpoint records; resuming needs them unchanged."""
    return {"train_config": dataclasses.asdict(tcfg), "draft_config": draft_cfg.to_hf_config()}


def check_draft_memory(
    draft_cfg: DraftConfig, target: Target, tcfg: DraftTrainConfig, *, sizes: str | None = None
) -> int:
    """:func:`check_training_memory` for a draft trained against ``target``: the draft's own
    parameters and one step's float32 logits ``[batch_size, anchors_per_seq·rows, V]``.
    ``sizes`` names the settings in the message (default: the fields that set them)."""
    rows = tcfg.batch_size * tcfg.anchors_per_seq * draft_cfg.num_query_rows
    # The borrowed tables only as shapes: the count reads none of their values (and the draft's
    # finiteness check is left to the draft that is trained).
    tables = {name: getattr(target, name) for name in ("embed_tokens", "lm_head")}
    shapes = SimpleNamespace(**{name: jax.ShapeDtypeStruct(t.shape, t.dtype) for name, t in tables.items()})
    return check_training_memory(
        draft_sizes(draft_cfg, tcfg) if sizes is None else sizes,
        lambda n: _new_draft(dataclasses.replace(draft_cfg, num_hidden_layers=n), shapes, 0),
        draft_cfg.num_hidden_layers,
        activations=("float32 logits", 4 * rows * draft_cfg.vocab_size),
    )


def draft_sizes(draft_cfg: DraftConfig, tcfg: DraftTrainConfig) -> str:
    """The settings that set a draft training run's memory, as the messages name them."""
    return (
        f"num_hidden_layers={draft_cfg.num_hidden_layers}, markov_rank={draft_cfg.markov_rank}, "
        f"block_size={draft_cfg.block_size}, batch_size={tcfg.batch_size}, seq_len={tcfg.seq_len}, "
        f"anchors_per_seq={tcfg.anchors_per_seq}"
    )


def _new_draft(draft_cfg: DraftConfig, target, seed: int):
    from dspark_jax.draft import DSparkDraft

    return DSparkDraft(draft_cfg, rngs=nnx.Rngs(seed), embed_tokens=target.embed_tokens, lm_head=target.lm_head)


# --------------------------------------------------------------------------- command line
def default_draft_config(
    target_cfg: TargetConfig,
    *,
    mask_token_id: int,
    gamma: int = 7,
    markov_rank: int = 64,
    num_layers: int = 2,
    confidence_head: bool = True,
    target_layer_ids: tuple[int, ...] | None = None,
) -> DraftConfig:
    """A draft shaped after the target: same hidden size and attention geometry, ``num_layers`` layers.

    The fused layers default to every target layer (``0 … L−1``), as a small target has few.

    Raises:
      TypeError: ``target_cfg`` is not a target's config, ``confidence_head`` not a bool,
        or ``target_layer_ids`` not a sequence.
      ValueError: a value the :class:`~dspark_jax.config.DraftConfig` refuses.
    """
    check_target_config(target_cfg)
    check_flag("confidence_head", confidence_head)
    if target_layer_ids is not None and (
        isinstance(target_layer_ids, (str, bytes)) or not isinstance(target_layer_ids, (list, tuple, np.ndarray))
    ):
        raise TypeError(f"target_layer_ids={target_layer_ids!r} is invalid: expected a sequence of layer ids or None")
    ids = tuple(range(target_cfg.num_hidden_layers)) if target_layer_ids is None else tuple(target_layer_ids)
    return DraftConfig(
        hidden_size=target_cfg.hidden_size,
        intermediate_size=target_cfg.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=target_cfg.num_attention_heads,
        num_key_value_heads=target_cfg.num_key_value_heads,
        head_dim=target_cfg.head_dim,
        vocab_size=target_cfg.vocab_size,
        rms_norm_eps=target_cfg.rms_norm_eps,
        rope_theta=target_cfg.rope_theta,
        max_position_embeddings=target_cfg.max_position_embeddings,
        block_size=gamma,
        mask_token_id=mask_token_id,
        target_layer_ids=ids,
        num_target_layers=target_cfg.num_hidden_layers,
        markov_rank=markov_rank,
        markov_head_type="vanilla",
        enable_confidence_head=confidence_head,
        confidence_head_with_markov=confidence_head and is_integer(markov_rank) and markov_rank > 0,
    )


# Draft-shape flags, their defaults, and the DraftConfig fields they set; ``--draft-config``
# replaces them all, so they default to None to tell a flag given explicitly from its default.
DRAFT_SHAPE_FLAGS = {"gamma": 7, "markov_rank": 64, "layers": 2}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax train-draft`` flags."""
    parser.add_argument("--target", required=True, help="target checkpoint folder (with tokenizer.json)")
    parser.add_argument("--out", required=True, help="output folder for the draft checkpoint (new, or --resume)")
    parser.add_argument("--steps", type=COUNT, default=2000, help="optimizer steps (default 2000)")
    parser.add_argument("--batch", type=COUNT, default=16, help="sequences per step (>= 2 with --distill)")
    parser.add_argument("--seq-len", type=COUNT, default=256, help="tokens per training sequence (default 256)")
    parser.add_argument(
        "--anchors", type=COUNT, default=32, help="anchors (blocks) per sequence, at most seq-len − rows − 1"
    )
    parser.add_argument("--gamma", type=COUNT, help="draft tokens per block (default 7)")
    parser.add_argument("--markov-rank", type=COUNT_OR_ZERO, help="0 = DFlash-style draft, no Markov head (default 64)")
    parser.add_argument("--layers", type=COUNT, help="draft decoder layers (default 2)")
    parser.add_argument("--no-confidence", action="store_true", help="train without a confidence head")
    parser.add_argument(
        "--draft-config", help="a draft config.json to use instead of --gamma, --markov-rank, --layers, --no-confidence"
    )
    parser.add_argument("--lr", type=LEARNING_RATE, default=6e-4, help="peak AdamW learning rate (default 6e-4)")
    parser.add_argument("--seed", type=SEED, default=0, help="initialisation, batch and anchor seed (default 0)")
    add_save_dtype(parser, "weights (training runs in float32)")
    parser.add_argument("--checkpoint-every", type=COUNT_OR_ZERO, default=500, help="0 = only at the end")
    parser.add_argument(
        "--distill",
        type=COUNT_OR_ZERO,
        default=0,
        help="also train on this many sequences the target generates (half of each batch); 0 = text only",
    )
    parser.add_argument(
        "--max-seconds", type=positive_seconds, help="stop early after this much training time (seconds > 0)"
    )
    parser.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    parser.add_argument(
        "--calibrate",
        choices=("sampling", "greedy"),
        help="fit the confidence head's STS temperature on held-out text after training (dspark-jax calibrate)",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


def check_draft_arguments(args: argparse.Namespace) -> None:
    """The checks of ``train-draft``'s options that need no file read beyond the listings of
    ``--target`` and ``--out``.

    Raises:
      ValueError: ``--target`` is not a folder holding ``config.json`` and
        ``tokenizer.json``; ``--out`` is ``--target``'s folder, an existing file, cannot be
        created or written, a folder holding a model without ``--resume``, or lacks a
        checkpoint with ``--resume``; ``--distill`` comes with ``--batch`` below 2 or a
        ``--seq-len`` with no room after the prompt; ``--anchors`` exceeds the distinct
        anchor positions of a ``--seq-len`` sequence (with ``--gamma`` rows); a
        draft-shape flag is given together with ``--draft-config``; or ``--calibrate``
        comes with ``--no-confidence``.
    """
    check_checkpoint("--target", args.target, tokenizer=True)
    if os.path.realpath(args.out) == os.path.realpath(args.target):
        raise ValueError(
            f"--out {args.out!r} is the --target folder {args.target!r}: the draft would overwrite the target; "
            "give another folder"
        )
    check_output_folder(args.out, resume=args.resume)
    if args.calibrate and args.no_confidence:
        raise ValueError(
            f"--calibrate {args.calibrate} is invalid with --no-confidence: it calibrates the confidence head"
        )
    if args.distill:
        if args.batch < 2:
            raise ValueError(
                f"--batch {args.batch} is invalid with --distill {args.distill}: must be >= 2, since half of "
                "every batch (batch // 2 sequences) comes from the distilled data"
            )
        if args.seq_len <= DISTILL_PROMPT_LEN:
            raise ValueError(
                f"--seq-len {args.seq_len} is too short for --distill {args.distill}: each distilled sequence "
                f"opens with a {DISTILL_PROMPT_LEN}-token prompt, so --seq-len must be > {DISTILL_PROMPT_LEN}"
            )
    if args.draft_config:
        given = [
            f"--{name.replace('_', '-')} {getattr(args, name)}"
            for name in DRAFT_SHAPE_FLAGS
            if getattr(args, name) is not None
        ]
        if args.no_confidence:
            given.append("--no-confidence")
        if given:
            raise ValueError(
                f"{', '.join(given)} conflict with --draft-config {args.draft_config!r}: the config file sets the "
                "draft's shape; drop the flags or edit the config"
            )
    else:  # default_draft_config's anchor layout: γ query rows
        check_anchor_flags(args, DRAFT_SHAPE_FLAGS["gamma"] if args.gamma is None else args.gamma)


def check_anchor_flags(args: argparse.Namespace, rows: int) -> None:
    """Raises ``ValueError`` unless ``--seq-len`` holds a block of ``rows`` query rows and
    ``--anchors`` distinct anchor positions (see :func:`sample_anchors`)."""
    if args.seq_len < rows + 2:
        raise ValueError(
            f"--seq-len {args.seq_len} is shorter than a block: must be >= {rows + 2} (a context token, the "
            f"draft's {rows} query rows and the last row's target)"
        )
    limit = anchor_positions(args.seq_len, rows)
    if args.anchors > limit:
        raise ValueError(
            f"--anchors {args.anchors} is invalid with --seq-len {args.seq_len}: must be <= {limit}, the distinct "
            f"anchor positions a sequence offers (1 … seq-len − {rows} query rows − 1)"
        )


def run(args: argparse.Namespace) -> int:
    """``dspark-jax train-draft``: distillation data, training, checkpoint and ``training.json``.

    Raises:
      ValueError: the options are invalid (see :func:`check_draft_arguments`), the
        ``--draft-config``'s ``mask_token_id`` is not the tokenizer's mask id or its rows
        leave no room for ``--anchors``, the draft or training settings are invalid, or
        ``--resume`` meets a checkpoint of other settings; all raised before the corpus is
        read and before anything is written (the option checks before anything loads).
        Also when the training diverges (see :func:`fit`, :func:`check_heldout_losses`):
        then no draft is saved.
    """
    from dspark_jax.checkpoint import save_draft
    from dspark_jax.corpus import encode_documents, load_corpus
    from dspark_jax.target import load_target
    from dspark_jax.tokenizer import load_tokenizer

    check_draft_arguments(args)
    tcfg = DraftTrainConfig(
        steps=args.steps,
        batch_size=args.batch,
        seq_len=args.seq_len,
        anchors_per_seq=args.anchors,
        lr=args.lr,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
    )
    draft_cfg = None
    if args.draft_config:
        with loading("--draft-config", args.draft_config):
            draft_cfg = DraftConfig.from_pretrained(args.draft_config)
    if draft_cfg is not None:
        check_anchor_flags(args, draft_cfg.num_query_rows)
    tokenizer = load_tokenizer(args.target)
    if draft_cfg is not None and draft_cfg.mask_token_id != tokenizer.mask_id:
        raise ValueError(
            f"--draft-config {args.draft_config!r} has mask_token_id={draft_cfg.mask_token_id}: must equal the "
            f"--target tokenizer's mask id {tokenizer.mask_id}"
        )
    target = load_target(args.target, dtype="float32")
    if draft_cfg is None:
        shape = {
            name: default if getattr(args, name) is None else getattr(args, name)
            for name, default in DRAFT_SHAPE_FLAGS.items()
        }
        draft_cfg = default_draft_config(
            target.config,
            mask_token_id=tokenizer.mask_id,
            gamma=shape["gamma"],
            markov_rank=shape["markov_rank"],
            num_layers=shape["layers"],
            confidence_head=not args.no_confidence,
        )
    check_draft_fits(draft_cfg, target.config, tcfg.seq_len, anchors_per_seq=tcfg.anchors_per_seq)
    if args.calibrate and not draft_cfg.enable_confidence_head:
        raise ValueError(
            f"--calibrate {args.calibrate} is invalid: --draft-config {args.draft_config!r} has no confidence head"
        )
    checkpoint_dir = os.path.join(args.out, "checkpoint")
    if args.resume:
        check_resume_settings(checkpoint_dir, draft_run_meta(draft_cfg, tcfg))
    origin = f"--draft-config {args.draft_config}" if args.draft_config else "--layers, --markov-rank, --gamma"
    check_draft_memory(
        draft_cfg,
        target,
        tcfg,
        sizes=f"{origin} ({draft_cfg.num_hidden_layers} layers, Markov rank {draft_cfg.markov_rank}, "
        f"γ {draft_cfg.gamma}), --batch {tcfg.batch_size}, --anchors {tcfg.anchors_per_seq}",
    )
    corpus = load_corpus()
    print(f"encoding {len(corpus.train_files)} training files …", file=sys.stderr)
    tokens = encode_documents(tokenizer, corpus.texts("train"))
    distilled = None
    if args.distill:
        t0 = time.perf_counter()
        distilled = distillation_data(target, tokens, count=args.distill, seq_len=tcfg.seq_len, seed=args.seed)
        print(f"generated {args.distill} target sequences in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    t0 = time.perf_counter()
    result = train_draft(
        target,
        draft_cfg,
        tokens,
        tcfg,
        checkpoint_dir=checkpoint_dir,
        resume=args.resume,
        progress=not args.quiet,
        max_seconds=args.max_seconds,
        distilled=distilled,
    )
    seconds = time.perf_counter() - t0
    heldout = encode_documents(tokenizer, corpus.texts("heldout"))
    stats = evaluate_draft(result.model, target, heldout, seq_len=min(tcfg.seq_len, 256))
    check_heldout_losses("draft", {key: stats[key] for key in ("ce", "tv", "bce")}, result.step)
    draft = result.model
    calibration = None
    calibration_error = None
    if args.calibrate:
        from dspark_jax.calibration import fit_sts_temperature

        try:
            fit = fit_sts_temperature(draft, target, heldout, labels=args.calibrate, seq_len=min(tcfg.seq_len, 256))
            calibration = dataclasses.asdict(fit)
        except ValueError as err:  # the training is kept: the draft is saved uncalibrated, then this is raised
            calibration_error = f"--calibrate {args.calibrate} failed: {err}"
            calibration = {"error": calibration_error}
    draft.cfg = dataclasses.replace(draft_cfg, dtype=args.save_dtype, param_dtype=args.save_dtype)
    cast_params(draft, args.save_dtype)
    save_draft(draft, args.out)
    info = {
        "train_config": dataclasses.asdict(tcfg),
        "steps_done": result.step,
        "distilled_sequences": args.distill,
        "distilled_sha256": hashlib.sha256(distilled.tobytes()).hexdigest() if distilled is not None else None,
        "train_seconds": seconds,
        "train_loop_seconds_all_sessions": result.seconds,
        "final_metrics": (
            {k: v[-1] for k, v in result.history.items()}
            if result.history
            else recorded_value(args.out, "final_metrics") or {}
        ),
        "heldout_teacher_forced": stats,
        "sts_calibration": calibration,
        "corpus": corpus.provenance(),
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0]),
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps({"heldout_teacher_forced": stats}, indent=2))
    if calibration_error is not None:
        raise ValueError(
            f"{calibration_error}; the trained draft was saved uncalibrated in --out {args.out!r} "
            "(its training.json says so); `dspark-jax calibrate` can try again with other labels or more text"
        )
    return 0
