"""One draft round: block ids → backbone → base logits → Markov walk → confidence.

Shape legend: B batch, R query rows (γ or γ+1), γ draft slots, V vocabulary, H hidden,
C context capacity, L draft layers, KVH key/value heads, D head dim, r Markov rank.

Two ways to run the same maths (``DSPARK_SPEC.md`` §1, §3):

* **folded** — :func:`propose` / :func:`propose_with`: pure and jittable; the embedding
  lookup, backbone, base logits, the whole Markov walk with in-graph sampling and the
  confidence head trace into one computation (wrap them in ``jax.jit``, or call them from
  inside your own jitted round).
* **eager** — :func:`propose_eager`: the same stages run one after the other as small
  jitted pieces (backbone, one walk step at a time, finish), the fallback when folded
  sampling is gated off and the reference for parity tests. Given the same key both pick
  the same tokens.

``fold_sampling=False`` folds greedy-only: every row is drafted greedily (``greedy_mask``
is all True; the caller routes sampling rows elsewhere), no noise is drawn and
``corrected_logits`` is an empty ``[B, γ, 0]`` array so the pytree structure is stable.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspark_jax.cache import ContextCache, context_mask
from dspark_jax.config import DraftConfig
from dspark_jax.draft import DSparkDraft, check_draft
from dspark_jax.greedy_kernel import greedy_markov_walk, use_greedy_kernel
from dspark_jax.markov import MarkovHead, markov_walk
from dspark_jax.race_kernel import RaceTuning, raced_markov_walk, use_race_kernel
from dspark_jax.sampling import (
    TOP_K_ALL,
    TOP_K_MAX,
    check_dtypes,
    clamp_temperatures,
    dtype_of,
    greedy_rows,
    greedy_step,
    key_rows,
    row_keys,
    sample_step,
    step_keys,
)
from dspark_jax.tile_race_kernel import tiled_race_walk, use_tile_race_kernel


@struct.dataclass
class DraftBlock:
    """One round's proposal.

    Attributes:
      draft_tokens: ``[B, γ]`` int32 drafts ``d_1 … d_γ``.
      corrected_logits: ``[B, γ, V]`` Markov-corrected step logits (before the temperature)
        in the base logits' dtype (the model dtype): ``q = softmax(corrected / T)``, computed
        in float32 from these values, is exactly the law the sampling rows drew from;
        ``[B, γ, 0]`` when sampling was not folded.
      greedy_mask: ``[B]`` bool, True for rows drafted greedily.
      temperatures: ``[B]`` float32 temperatures, clamped below at 1e-5 (a NaN stays NaN;
        its row is greedy).
      confidence: ``[B, γ]`` float32 acceptance probabilities; ``[B, 0]`` when the draft
        has no confidence head.
    """

    draft_tokens: jax.Array
    corrected_logits: jax.Array
    greedy_mask: jax.Array
    temperatures: jax.Array
    confidence: jax.Array


# ---------------------------------------------------------------------- checks
def check_shapes(
    cfg: DraftConfig,
    cache: ContextCache,
    bonus: Any,
    prefix_lens: Any,
    temperatures: Any,
    top_k: Any,
    key: Any,
    *,
    input_embeds: Any = None,
    slots: Any = None,
    fold_sampling: Any = True,
) -> int:
    """Checks the static shapes and dtypes of a proposal's inputs (works on tracers).

    Args:
      cfg: the draft config.
      cache: the context cache.
      bonus, prefix_lens, temperatures, top_k: ``[B]`` each.
      key: one key or per-row keys (see :func:`dspark_jax.sampling.key_rows`).
      input_embeds: optional ``[B, R, H]``.
      slots: optional ``[B]`` cache slot per row; without it the cache must hold exactly
        ``B`` slots.
      fold_sampling: the round's static flag, which must be a bool (a string such as "no"
        would be true).

    Returns:
      ``B``.

    Raises:
      ValueError: a shape does not match.
      TypeError: ``bonus``, ``prefix_lens``, ``top_k`` or ``slots`` is not of an integer
        dtype, ``temperatures`` of neither a float nor an integer one, ``input_embeds`` or the
        cache's keys or values not of a floating dtype, ``key`` is not an allowed key, or
        ``fold_sampling`` is not a bool.
    """
    if not isinstance(fold_sampling, (bool, np.bool_)):
        raise TypeError(f"fold_sampling={fold_sampling!r} is invalid: must be True or False")
    if not isinstance(cache, ContextCache):
        raise TypeError(f"cache has type {type(cache).__name__}: expected a ContextCache")
    bonus_shape = tuple(np.shape(bonus))
    if len(bonus_shape) != 1 or bonus_shape[0] < 1:
        raise ValueError(f"bonus has shape {bonus_shape}: expected [B] with B >= 1")
    batch = bonus_shape[0]
    for name, value in (("prefix_lens", prefix_lens), ("temperatures", temperatures), ("top_k", top_k)):
        if tuple(np.shape(value)) != (batch,):
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}: expected [{batch}] like bonus")
    expected = (cfg.num_hidden_layers, cache.batch, cache.capacity, cfg.num_key_value_heads, cfg.head_dim)
    for name in ("k", "v"):
        shape = tuple(getattr(cache, name).shape)
        if shape != expected:
            raise ValueError(f"cache.{name} has shape {shape}: expected [L, B, C, KVH, D] = {expected}")
    if slots is not None and tuple(np.shape(slots)) != (batch,):
        raise ValueError(f"slots has shape {tuple(np.shape(slots))}: expected [{batch}] like bonus")
    if slots is None and cache.batch != batch:
        raise ValueError(f"cache has {cache.batch} request slots: expected B={batch} like bonus")
    if cache.capacity < cfg.gamma:
        raise ValueError(f"cache capacity={cache.capacity} is too small: must be >= gamma={cfg.gamma}")
    if input_embeds is not None:
        want = (batch, cfg.num_query_rows, cfg.hidden_size)
        if tuple(np.shape(input_embeds)) != want:
            raise ValueError(f"input_embeds has shape {tuple(np.shape(input_embeds))}: expected [B, R, H] = {want}")
        # the backbone would cast integer embeddings silently
        check_dtypes({"input_embeds": (input_embeds, jnp.floating)})
    # a float token id or length would be truncated silently inside the round
    ints = {"bonus": bonus, "prefix_lens": prefix_lens, "top_k": top_k, "slots": slots}
    check_dtypes({name: (value, jnp.integer) for name, value in ints.items()})
    temps_dtype = dtype_of(temperatures)
    if not (jnp.issubdtype(temps_dtype, jnp.floating) or jnp.issubdtype(temps_dtype, jnp.integer)):
        raise TypeError(f"temperatures has dtype {temps_dtype}: expected a float dtype")
    # the draft attends over them: integer keys and values draft meaningless tokens
    check_dtypes({"cache.k": (cache.k, jnp.floating), "cache.v": (cache.v, jnp.floating)})
    key_rows(key, batch)
    return batch


def validate_proposal_inputs(
    cfg: DraftConfig,
    cache: ContextCache,
    bonus: Any,
    prefix_lens: Any,
    temperatures: Any,
    top_k: Any,
    key: Any,
    *,
    input_embeds: Any = None,
    slots: Any = None,
    max_batch: int | None = None,
    fold_sampling: Any = True,
) -> int:
    """Checks a proposal's inputs on the host, before anything is compiled.

    Reads values with ``np.asarray``, so it must run outside ``jax.jit`` (the eager entry
    point calls it; :class:`~dspark_jax.proposer.Proposer` for every call its own quicker
    checks refuse, to raise this function's message; :func:`propose` does not).

    Args:
      cfg: the draft config.
      cache: the context cache.
      bonus: ``[B]`` ints in ``[0, V)``.
      prefix_lens: ``[B]`` ints in ``[0, capacity − γ]``.
      temperatures: ``[B]`` floats, ``>= 0`` (0 = greedy) and finite in float32.
      top_k: ``[B]`` ints in ``[0, TOP_K_MAX]`` (``<= 1`` = greedy, ``TOP_K_ALL`` = no top-k).
      key: one key or per-row keys.
      input_embeds: optional ``[B, R, H]`` of a floating dtype, finite.
      slots: optional ``[B]`` cache slot of each row, in ``[0, cache.batch)``; when
        omitted the cache must have exactly ``B`` slots.
      max_batch: the largest batch allowed, if any.
      fold_sampling: the round's flag, which must be a bool.

    Returns:
      ``B``.

    Raises:
      ValueError: a value or shape is out of range.
      TypeError: ``cfg`` is not a :class:`~dspark_jax.config.DraftConfig`, or a dtype or the key
        type is wrong.
    """
    if not isinstance(cfg, DraftConfig):
        raise TypeError(f"cfg must be a DraftConfig, got {type(cfg).__name__}")
    batch = np.shape(bonus)[0] if np.ndim(bonus) == 1 else None
    if max_batch is not None and batch is not None and batch > max_batch:
        raise ValueError(f"batch size B={batch} (len(bonus)) is too large: must be <= max_batch={max_batch}")
    batch = check_shapes(
        cfg,
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        key,
        input_embeds=input_embeds,
        slots=slots,
        fold_sampling=fold_sampling,
    )
    ints = {"bonus": np.asarray(bonus), "prefix_lens": np.asarray(prefix_lens), "top_k": np.asarray(top_k)}
    _check_range("bonus", ints["bonus"], 0, cfg.vocab_size - 1, f"token ids in [0, vocab_size={cfg.vocab_size})")
    room = cache.capacity - cfg.gamma
    _check_range(
        "prefix_lens",
        ints["prefix_lens"],
        0,
        room,
        f"in [0, capacity - gamma] = [0, {room}] so the block's {cfg.gamma} positions fit in the cache",
    )
    _check_range(
        "top_k",
        ints["top_k"],
        0,
        TOP_K_MAX,
        f"in [0, {TOP_K_MAX}] (0 or 1 = greedy, TOP_K_ALL={TOP_K_ALL} = no top-k; the round reads int32)",
    )
    temps = np.asarray(temperatures)
    # the round samples in float32: a float64 1e39 would arrive as inf
    with np.errstate(over="ignore"):
        bad = ~(np.isfinite(temps.astype(np.float32)) & (temps >= 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"temperatures[{i}]={float(temps[i])!r} is invalid: must be >= 0 (0 = greedy) and finite in float32"
        )
    if slots is not None:
        slots = np.asarray(slots)
        _check_range("slots", slots, 0, cache.batch - 1, f"cache slot ids in [0, {cache.batch})")
    if input_embeds is not None:
        # a NaN embedding drafts token 0 in every slot, without a word
        with np.errstate(over="ignore"):
            embeds = np.asarray(input_embeds, np.float32)
        finite = np.isfinite(embeds)
        if not finite.all():
            i = np.unravel_index(int(np.argmin(finite)), finite.shape)
            raise ValueError(
                f"input_embeds[{', '.join(map(str, i))}]={float(embeds[i])!r} is invalid: must be finite in float32"
            )
    return batch


def _check_range(name: str, values: np.ndarray, lo: int, hi: int | None, allowed: str) -> None:
    if not values.size or (values.min() >= lo and (hi is None or values.max() <= hi)):
        return  # the common case: two reductions, no mask
    bad = (values < lo) if hi is None else ((values < lo) | (values > hi))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{name}[{i}]={int(values[i])} is out of range: must be {allowed}")


# --------------------------------------------------------------------- stages
def _draft_slots(
    draft: DSparkDraft,
    cache: ContextCache,
    bonus: jax.Array,
    prefix_lens: jax.Array,
    input_embeds: jax.Array | None,
) -> tuple[jax.Array, jax.Array]:
    """Backbone over the block; returns slot hidden ``[B, γ, H]`` and base logits ``[B, γ, V]``."""
    return _slot_logits(draft, backbone_stage(draft, None, cache, bonus, prefix_lens, input_embeds=input_embeds))


def _slot_logits(draft: DSparkDraft, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[B, R, H]`` residual stream → slot hidden ``[B, γ, H]`` (final norm) and base logits ``[B, γ, V]``."""
    slot_hidden = draft.slots(draft.norm(x))
    return slot_hidden, draft.base_logits(slot_hidden)


def _confidence(draft: DSparkDraft, slot_hidden: jax.Array, bonus: jax.Array, tokens: jax.Array) -> jax.Array:
    """``[B, γ]`` confidence with ``prev = [bonus, d_1 … d_{γ−1}]``; ``[B, 0]`` without a head."""
    if draft.confidence_head is None:
        return jnp.zeros((tokens.shape[0], 0), jnp.float32)
    prev = jnp.concatenate([jnp.asarray(bonus, jnp.int32)[:, None], tokens[:, :-1]], axis=1)  # [B, γ]
    return draft.confidence(slot_hidden, prev).astype(jnp.float32)


def _greedy_mask(temperatures: jax.Array, top_k: jax.Array, batch: int, fold_sampling: bool) -> jax.Array:
    """``[B]`` rows drafted greedily: every row when sampling is not folded."""
    return greedy_rows(temperatures, top_k) if fold_sampling else jnp.ones((batch,), bool)


def _pick(
    step: jax.Array,
    logits: jax.Array,
    *,
    temps: jax.Array,
    greedy: jax.Array,
    keys: jax.Array | None,
    fold_sampling: bool,
    keep_dtype: jnp.dtype,
) -> jax.Array:
    """``[B]`` tokens of walk step ``step`` from its ``[B, V]`` float32 logits (argmax without
    folding); sampling rows race on the logits rounded to ``keep_dtype``, as they are kept."""
    if fold_sampling:
        return sample_step(logits, temps, greedy, step_keys(keys, step), race_dtype=keep_dtype)
    return greedy_step(logits)


def returned_corrected(corrected: jax.Array, fold_sampling: bool) -> jax.Array:
    """The corrected logits a round returns: ``corrected [B, γ, V]`` with folding, an empty
    ``[B, γ, 0]`` without (it depends on the shape only, so XLA never forms the logits)."""
    return corrected if fold_sampling else jnp.zeros((*corrected.shape[:-1], 0), corrected.dtype)


def _finish(
    draft: DSparkDraft,
    slot_hidden: jax.Array,
    bonus: jax.Array,
    tokens: jax.Array,
    corrected: jax.Array,
    greedy: jax.Array,
    temps: jax.Array,
    fold_sampling: bool,
) -> DraftBlock:
    """The :class:`DraftBlock` of ``tokens [B, γ]``; ``corrected [B, γ, V]`` is dropped without folding."""
    return DraftBlock(
        draft_tokens=tokens,
        corrected_logits=returned_corrected(corrected, fold_sampling),
        greedy_mask=greedy,
        temperatures=temps,
        confidence=_confidence(draft, slot_hidden, bonus, tokens),
    )


def backbone_stage(
    draft: DSparkDraft,
    x: jax.Array | None,
    cache: ContextCache,
    bonus: jax.Array,
    prefix_lens: jax.Array,
    *,
    start: int = 0,
    stop: int | None = None,
    input_embeds: jax.Array | None = None,
    slots: jax.Array | None = None,
) -> jax.Array:
    """Layers ``start … stop − 1`` of the round's backbone (pure; one piece of a split round).

    Args:
      draft: the draft module.
      x: ``[B, R, H]`` residual stream entering layer ``start``; None when ``start == 0``
        (the block ``[bonus, MASK, …]`` is embedded in-graph, or ``input_embeds`` used).
      cache, bonus, prefix_lens, input_embeds, slots: as in :func:`propose_with`.
      start, stop: the layer range (``stop`` default ``L``).

    Returns:
      ``[B, R, H]`` the residual stream after layer ``stop − 1`` (before the final norm).
    """
    if (x is None) != (start == 0):
        raise ValueError(
            f"backbone_stage got x={'None' if x is None else 'an array'} with start={start}: "
            "x must be None exactly when start == 0"
        )
    prefix_lens = jnp.asarray(prefix_lens, jnp.int32)
    if x is None:
        ids = None if input_embeds is not None else draft.block_ids(jnp.asarray(bonus, jnp.int32))
        x = draft.inputs(ids, input_embeds)
    return draft.run_layers(
        x,
        positions=draft.block_positions(prefix_lens),
        ctx_k=cache.k,
        ctx_v=cache.v,
        ctx_mask=context_mask(prefix_lens, cache.capacity),
        prefix_lens=prefix_lens,
        slots=None if slots is None else jnp.asarray(slots, jnp.int32),
        start=start,
        stop=stop,
    )


def head_stage(
    draft: DSparkDraft,
    x: jax.Array,
    bonus: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
    *,
    fold_sampling: bool = True,
) -> DraftBlock:
    """The round after the backbone: final norm, base logits, Markov walk, confidence (pure).

    Args:
      draft: the draft module.
      x: ``[B, R, H]`` residual stream after the last layer.
      bonus, temperatures, top_k, key, fold_sampling: as in :func:`propose_with`.

    Returns:
      The :class:`DraftBlock`.
    """
    slot_hidden, base = _slot_logits(draft, x)  # [B, γ, H], [B, γ, V]
    tokens, corrected, greedy, temps = walk_block(
        draft.markov_head, base, slot_hidden, bonus, temperatures, top_k, key, fold_sampling=fold_sampling
    )
    return _finish(draft, slot_hidden, bonus, tokens, corrected, greedy, temps, fold_sampling)


def walk_block(
    head: MarkovHead | None,
    base: jax.Array,
    slot_hidden: jax.Array,
    bonus: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
    *,
    fold_sampling: bool = True,
    race_tuning: RaceTuning | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The round's Markov walk over its base logits (pure): with folding, the tiled race kernels
    where :func:`~dspark_jax.tile_race_kernel.use_tile_race_kernel` says so, else the race kernel
    per step where :func:`~dspark_jax.race_kernel.use_race_kernel` says so; without, the greedy
    kernels where :func:`~dspark_jax.greedy_kernel.use_greedy_kernel` says so; else the XLA
    walk.

    Args:
      head: the draft's Markov head, or ``None``.
      base: ``[B, γ, V]`` base logits (model dtype).
      slot_hidden: ``[B, γ, H]`` the slots' hidden states.
      bonus, temperatures, top_k, key, fold_sampling: as in :func:`propose_with`.
      race_tuning: the race kernel's layout (:class:`~dspark_jax.race_kernel.RaceTuning`;
        None: its default); the tokens do not depend on it.

    Returns:
      ``(tokens [B, γ] int32, corrected [B, γ, V] in base's dtype, greedy [B] bool,
      temperatures [B] float32 clamped)``; without folding ``corrected`` may be an empty
      ``[B, γ, 0]`` (the greedy kernels never form it; the round drops it anyway).
    """
    batch = base.shape[0]
    temps = clamp_temperatures(temperatures)
    greedy = _greedy_mask(temperatures, top_k, batch, fold_sampling)
    keys = row_keys(key, batch) if fold_sampling else None  # no noise without folding
    kernel, interpret = False, False
    if fold_sampling and head is not None:
        tiled, interpret = use_tile_race_kernel(head.rank, head.dtype, base.shape[-1], batch)
        if tiled:  # two kernels per step, the [B, V] bias never in memory
            tokens, corrected = tiled_race_walk(
                head, base, slot_hidden, bonus, temps, greedy, keys, interpret=interpret
            )
            return tokens, corrected, greedy, temps
        kernel, interpret = use_race_kernel(base.shape[-1])
    elif head is not None:
        greedy_kernel, interpret = use_greedy_kernel(head.rank, head.dtype, batch)
        if greedy_kernel:  # two kernels per step, the [B, V] bias never in memory
            tokens = greedy_markov_walk(head, base, slot_hidden, bonus, interpret=interpret)
            return tokens, returned_corrected(base, fold_sampling), greedy, temps  # [B, γ, 0]
    if kernel:  # one block kernel and one pick kernel per step, corrected logits written in place
        tokens, corrected = raced_markov_walk(
            head, base, slot_hidden, bonus, temps, greedy, keys, interpret=interpret, tuning=race_tuning
        )
    else:  # the corrected logits are kept in the base logits' dtype (the model dtype)
        pick = functools.partial(
            _pick, temps=temps, greedy=greedy, keys=keys, fold_sampling=fold_sampling, keep_dtype=base.dtype
        )
        tokens, corrected = markov_walk(head, base, slot_hidden, bonus, pick, keep_dtype=base.dtype)
    return tokens, corrected, greedy, temps


def propose_with(
    draft: DSparkDraft,
    cache: ContextCache,
    bonus: jax.Array,
    prefix_lens: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
    *,
    fold_sampling: bool = True,
    input_embeds: jax.Array | None = None,
    slots: jax.Array | None = None,
) -> DraftBlock:
    """Folded draft round on a merged draft module (pure; trace it inside ``jax.jit``).

    Args:
      draft: the draft module.
      cache: context cache with ``B`` request slots, ``[L, B, C, KVH, D]``.
      bonus: ``[B]`` int anchor tokens.
      prefix_lens: ``[B]`` int context lengths (the block sits at ``prefix_len + 0..R−1``).
      temperatures: ``[B]`` float sampling temperatures (a row whose temperature is not
        ``> 0``, NaN included, is greedy).
      top_k: ``[B]`` int (``<= 1`` = greedy; ``TOP_K_ALL`` otherwise; never applied).
      key: one PRNG key (typed or raw) or per-row keys ``[B]``.
      fold_sampling: False folds greedy-only (every row greedy, empty corrected logits).
      input_embeds: ``[B, R, H]`` block embeddings to use instead of the in-graph lookup
        (parity tests).
      slots: ``[B]`` int cache slot of each row, when the cache holds ``N`` request slots
        (``[L, N, C, KVH, D]``) and this round serves ``B`` of them; the GPU kernel reads
        them in place (no gathered copy of the context). Default: row ``b`` is slot ``b``
        (``N == B``). Values are not range-checked here (jittable);
        :func:`validate_proposal_inputs` checks them on the host.

    Returns:
      The :class:`DraftBlock`.

    Raises:
      ValueError, TypeError: a shape or dtype is wrong (:func:`check_shapes`, while tracing).
    """
    check_shapes(
        draft.cfg,
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        key,
        input_embeds=input_embeds,
        slots=slots,
        fold_sampling=fold_sampling,
    )
    x = backbone_stage(draft, None, cache, bonus, prefix_lens, input_embeds=input_embeds, slots=slots)
    return head_stage(draft, x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling)


def propose(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: ContextCache,
    bonus: jax.Array,
    prefix_lens: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
    *,
    fold_sampling: bool = True,
    input_embeds: jax.Array | None = None,
    slots: jax.Array | None = None,
) -> DraftBlock:
    """Folded draft round over split NNX state (``graphdef`` static under ``jax.jit``).

    Example::

        graphdef, state = nnx.split(draft)
        step = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")
        block = step(graphdef, state, cache, bonus, prefix_lens, temps, top_k, key)

    Args:
      graphdef: from ``nnx.split(draft)``.
      state: the draft's state.
      cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling, input_embeds,
        slots: as in :func:`propose_with`.

    Returns:
      The :class:`DraftBlock`.

    Raises:
      ValueError, TypeError: a shape or dtype is wrong (:func:`check_shapes`, while tracing).
    """
    return propose_with(
        nnx.merge(graphdef, state),
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        key,
        fold_sampling=fold_sampling,
        input_embeds=input_embeds,
        slots=slots,
    )


# ---------------------------------------------------------------------- eager
@functools.partial(jax.jit, static_argnums=0, static_argnames="fold_sampling")
def _eager_backbone(
    graphdef, state, cache, bonus, prefix_lens, temperatures, top_k, key, input_embeds, *, fold_sampling
):
    draft = nnx.merge(graphdef, state)
    batch = bonus.shape[0]
    slot_hidden, base = _draft_slots(draft, cache, bonus, prefix_lens, input_embeds)
    head = draft.markov_head
    head_state = head.init_state(batch) if head is not None else jnp.zeros((batch, 0), jnp.float32)
    greedy = _greedy_mask(temperatures, top_k, batch, fold_sampling)
    keys = row_keys(key, batch)
    return slot_hidden, base, head_state, clamp_temperatures(temperatures), greedy, keys


@functools.partial(jax.jit, static_argnums=0, static_argnames="fold_sampling")
def _eager_step(graphdef, state, head_state, prev, base, hidden, temps, greedy, keys, step, *, fold_sampling):
    head = nnx.merge(graphdef, state).markov_head
    logits = base[:, step].astype(jnp.float32)  # [B, V]
    if head is not None:
        head_state, bias = head.step(head_state, prev, hidden[:, step])
        logits = logits + bias.astype(jnp.float32)
    keep = base.dtype  # the corrected logits' dtype, as in the folded round
    tokens = _pick(step, logits, temps=temps, greedy=greedy, keys=keys, fold_sampling=fold_sampling, keep_dtype=keep)
    return head_state, tokens, logits.astype(keep)


@functools.partial(jax.jit, static_argnums=0, static_argnames="fold_sampling")
def _eager_finish(graphdef, state, slot_hidden, bonus, tokens, logits, temps, greedy, *, fold_sampling):
    tokens, corrected = jnp.stack(tokens, axis=1), jnp.stack(logits, axis=1)  # [B, γ], [B, γ, V]
    return _finish(nnx.merge(graphdef, state), slot_hidden, bonus, tokens, corrected, greedy, temps, fold_sampling)


def run_eager(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    cache: ContextCache,
    bonus: jax.Array,
    prefix_lens: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    key: jax.Array,
    *,
    fold_sampling: bool = True,
    input_embeds: jax.Array | None = None,
) -> DraftBlock:
    """The eager round over split state, without input validation (see :func:`propose_eager`)."""
    bonus = np.asarray(bonus, np.int32)
    prefix_lens = np.asarray(prefix_lens, np.int32)
    temperatures = np.asarray(temperatures, np.float32)
    top_k = np.asarray(top_k, np.int32)
    slot_hidden, base, head_state, temps, greedy, keys = _eager_backbone(
        graphdef,
        state,
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        key,
        input_embeds,
        fold_sampling=fold_sampling,
    )
    prev, tokens, logits = bonus, [], []
    for step in range(base.shape[1]):
        head_state, prev, step_logits = _eager_step(
            graphdef,
            state,
            head_state,
            prev,
            base,
            slot_hidden,
            temps,
            greedy,
            keys,
            np.uint32(step),
            fold_sampling=fold_sampling,
        )
        tokens.append(prev)
        logits.append(step_logits)
    return _eager_finish(
        graphdef,
        state,
        slot_hidden,
        bonus,
        tokens,
        logits,
        temps,
        greedy,
        fold_sampling=fold_sampling,
    )


def propose_eager(
    draft: DSparkDraft,
    cache: ContextCache,
    bonus: Any,
    prefix_lens: Any,
    temperatures: Any,
    top_k: Any,
    key: Any,
    *,
    fold_sampling: bool = True,
    input_embeds: Any = None,
) -> DraftBlock:
    """The draft round run stage by stage (backbone, one walk step at a time, finish).

    Same maths, keys and rules as :func:`propose_with`; inputs are validated on the host
    first (:func:`validate_proposal_inputs`), so bad input fails before anything compiles.

    Args:
      draft: the draft module.
      cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling, input_embeds: as in
        :func:`propose_with`.

    Returns:
      The :class:`DraftBlock`.

    Raises:
      TypeError: ``draft`` is not a :class:`~dspark_jax.draft.DSparkDraft`.
      ValueError, TypeError: a value, shape or dtype is wrong (:func:`validate_proposal_inputs`).
    """
    check_draft(draft)
    validate_proposal_inputs(
        draft.cfg,
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        key,
        input_embeds=input_embeds,
        fold_sampling=fold_sampling,
    )
    graphdef, state = nnx.split(draft)
    return run_eager(
        graphdef,
        state,
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        key,
        fold_sampling=fold_sampling,
        input_embeds=input_embeds,
    )
