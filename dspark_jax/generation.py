"""Batched speculative generation with a DSpark draft, and the plain decoding baseline.

Shape legend: B requests, P padded prompt length, C cache capacity, γ drafts per round,
T = γ + 1 verify width, N output buffer length, V vocabulary.

Compiled calls: :func:`speculative_generate` runs ONE compiled call to start (target
prefill, draft context prefill, the first target token) and then ONE compiled call per
round: propose ``d_1 … d_γ`` from the bonus, verify ``[bonus, d_1 … d_γ]`` with the
target, accept, and commit the accepted positions into the draft context cache, all
inside one ``jax.jit`` with the decode state (both caches) donated. The Python loop
between rounds only reads the ``[B]`` done flags. With ``device_loop=True`` the rounds run
in a ``lax.while_loop`` instead: two compiled calls for the whole generation.
:func:`generate` (the baseline) runs one compiled call to start and one per token (or
one ``while_loop`` for all tokens with ``device_loop=True``).

Each batch compiles one variant of these calls, chosen on the host from its requests
(:func:`_variant`): all-greedy (no noise, no probabilities); sampling without top-k /
top-p (no vocabulary sort); or sampling with top-k / top-p over a static number of ranks
(the power of two covering the largest top-k, or the whole vocabulary for top-p alone).

With ``verify_schedule`` (confidence-scheduled verification, ``DSPARK_SPEC.md`` §5) a round
verifies each request's scheduled prefix of ``[bonus, d_1 … d_γ]`` only: the target runs at
the narrowest width of :func:`verify_widths` holding the longest (one ``lax.switch``
branch per width, all compiled with the round), and ``accept`` is capped there. The
per-request rule is the spec's; ``verify_rule="uniform"`` gives every request of a round one
width, which suits a dense target; :func:`measure_verify_schedule` measures the table.

Per request: temperature / top-k / top-p / max new tokens / stop tokens. A row is greedy
when ``top_k <= 1`` or its temperature is 0. Finished requests stop changing: their
cache writes, output and statistics are masked. Outputs are cut after the first stop
token (which is kept) and at ``max_new_tokens``. Prompts are right-padded; each row has
its own positions, and padding is never cached.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx, struct

from dspark_jax.cache import ContextCache, commit, init_context_cache, prefill
from dspark_jax.config import check_seed, positive_int
from dspark_jax.decode_requests import (
    Requests,
    bucket,
    cache_capacity,
    check_bool,
    check_confidence_head,
    check_key,
    check_positions,
    check_requests,
    check_verify_rule,
    check_verify_schedule,
)
from dspark_jax.draft import DSparkDraft, check_models
from dspark_jax.proposal import propose_with
from dspark_jax.sampling import greedy_step
from dspark_jax.target import Target, check_pair
from dspark_jax.verification import accept, required_filter_width, sample_tokens, schedule_verify_lengths


@dataclasses.dataclass(frozen=True)
class GenerationResult:
    """Generated tokens and decoding statistics.

    Attributes:
      tokens: per request, the new tokens (prompt excluded), cut after the first stop
        token and at its ``max_new_tokens``.
      rounds: compiled rounds run after the start (decode steps for :func:`generate`).
      tau: per request, mean tokens committed per round it took part in (accepted
        drafts + bonus, before the final cut); NaN for a request that needed no round.
      tau_overall: total committed tokens / total request-rounds.
      acceptance_by_position: ``[γ]``; entry ``k − 1`` is the fraction of request-rounds
        that accepted draft ``d_k`` (so it never increases with ``k``); empty for
        :func:`generate`.
      accept_length_counts: ``[γ + 1]`` request-rounds with ``correct_len = 0 … γ``.
      verified_tokens: tokens the target verified over all request-rounds, anchors
        included: ``γ + 1`` per request-round, fewer with ``verify_schedule``; the
        decode steps for :func:`generate`.
      verify_length_counts: ``[γ + 1]``; entry ``j − 1`` counts the request-rounds that
        verified ``j`` tokens (all at ``γ + 1`` without ``verify_schedule``); empty for
        :func:`generate`.
      confidence_by_position: ``[γ]``; entry ``k − 1`` is the draft's own prediction of
        ``acceptance_by_position[k − 1]``: the survival ``Π_{j ≤ k} confidence_j``
        averaged over request-rounds. Empty without a confidence head and for
        :func:`generate`. (With ``verify_schedule`` the accepted fractions are capped by
        the verify lengths; compare the two without one.)
      seconds: wall time of the call, compilation included.
    """

    tokens: list[list[int]]
    rounds: int
    tau: list[float]
    tau_overall: float
    acceptance_by_position: list[float]
    accept_length_counts: list[int]
    verified_tokens: int
    verify_length_counts: list[int]
    confidence_by_position: list[float]
    seconds: float


@struct.dataclass
class DecodeState:
    """Everything a round reads and writes (donated to the round)."""

    target_cache: Any
    context: ContextCache
    prefix_lens: jax.Array  # [B] position of the bonus
    bonus: jax.Array  # [B]
    done: jax.Array  # [B] bool
    out: jax.Array  # [B, N] int32
    n_out: jax.Array  # [B] tokens written to out
    key: jax.Array
    rounds: jax.Array  # [B] rounds each request took part in
    accept_counts: jax.Array  # [B, γ + 1] histogram of correct_len
    verify_counts: jax.Array  # [B, γ + 1] histogram of each request's verify length (1 … γ + 1)
    survival_sums: jax.Array  # [B, γ] (γ = 0 without a confidence head) Σ over rounds of Π_{j ≤ k} confidence_j


# ------------------------------------------------------------------ shared pieces
def _emit(out, n_out, tokens, count, done, requests):
    """Appends ``tokens[b, :count[b]]`` to each row's output ``out [B, N]``.

    Returns ``(out, n_out, done)``; a row is done once it emitted a stop token or reached
    its ``max_new_tokens``.
    """
    b, t = tokens.shape
    j = jnp.arange(t, dtype=jnp.int32)
    written = j[None, :] < count[:, None]  # [B, T]
    idx = jnp.where(written, n_out[:, None] + j[None, :], out.shape[1])  # past the end -> dropped
    out = out.at[jnp.arange(b)[:, None], idx].set(tokens, mode="drop")
    n_out = n_out + count
    hit = (tokens[:, :, None] == requests.stop[:, None, :]) & written[:, :, None]  # [B, T, S]
    done = done | jnp.any(hit, axis=(1, 2)) | (n_out >= requests.max_new)
    return out, n_out, done


def _variant(requests: Requests, vocab_size: int) -> dict[str, Any]:
    """The static decoding variant of a batch, decided on the host from its requests.

    ``sampling``: whether any row samples (all-greedy batches draw no noise and build no
    probabilities); ``filter_width``: ranks the target's top-k / top-p examine
    (:func:`~dspark_jax.verification.required_filter_width`: 0 = no sort at all).
    """
    temps, top_k, top_p = (np.asarray(x) for x in (requests.temperatures, requests.top_k, requests.top_p))
    sampling = not bool(np.all((top_k <= 1) | (temps <= 0)))
    return dict(sampling=sampling, filter_width=required_filter_width(temps, top_k, top_p, vocab_size))


def _pick(logits: jax.Array, requests: Requests, key: jax.Array, sampling: bool, filter_width: int) -> jax.Array:
    """The target's own next token ``[B]``: argmax, or its sampling rule when any row samples."""
    if not sampling:
        return greedy_step(logits)
    return sample_tokens(logits, requests.temperatures, requests.top_k, requests.top_p, key, filter_width=filter_width)


def _prefill_target(target, tokens, lengths, capacity, feature_layers):
    """Runs the padded prompts; returns ``(last-token logits [B, V], features, cache)``."""
    b, p = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (b, p))
    valid = positions < lengths[:, None]
    logits, features, cache = target(
        tokens, positions, target.init_cache(b, capacity), valid=valid, feature_layers=feature_layers
    )
    return logits[jnp.arange(b), lengths - 1], features, cache


def _split(module: nnx.Module) -> tuple[tuple[nnx.GraphDef, Any], list[jax.Array]]:
    """``nnx.split`` with the state as a flat list of arrays: ``((graphdef, treedef), leaves)``.

    The ``(graphdef, treedef)`` structure is bound into the compiled calls once (see
    :func:`_speculative_program`) and the leaves, a plain list, are cheap to pass per call.
    """
    graphdef, state = nnx.split(module)
    leaves, treedef = jax.tree.flatten(state)
    return (graphdef, treedef), leaves


def _merge(structure: tuple[nnx.GraphDef, Any], leaves: list[jax.Array]) -> Any:
    """Inverse of :func:`_split` (inside the traced function)."""
    graphdef, treedef = structure
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


class _Program(NamedTuple):
    """The compiled calls of one decoding variant (:func:`_speculative_program`, :func:`_plain_program`)."""

    start: Callable  # (target, [draft,] tokens, lengths, requests, key, *, capacity, out_len) -> state
    step: Callable  # (target, [draft,] state, requests) -> state; state donated
    loop: Callable  # (target, [draft,] state, requests, max_steps) -> (state, steps); state donated


# ------------------------------------------------------------------ speculative
def _start(
    target_state,
    draft_state,
    tokens,
    lengths,
    requests: Requests,
    key,
    *,
    target_def,
    draft_def,
    capacity: int,
    out_len: int,
    sampling: bool,
    filter_width: int,
    feature_layers: tuple[int, ...],
) -> DecodeState:
    """Target prefill, draft context prefill and the first token, one compiled call."""
    target = _merge(target_def, target_state)
    draft = _merge(draft_def, draft_state)
    b = tokens.shape[0]
    last_logits, features, target_cache = _prefill_target(target, tokens, lengths, capacity, feature_layers)
    context = prefill(draft, init_context_cache(draft.cfg, b, capacity), features, lengths)
    key, k_first = jax.random.split(key)
    first = _pick(last_logits, requests, k_first, sampling, filter_width)  # [B]
    out, n_out, done = _emit(
        jnp.zeros((b, out_len), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        first[:, None],
        jnp.ones((b,), jnp.int32),
        jnp.zeros((b,), bool),
        requests,
    )
    gamma = draft.cfg.gamma
    return DecodeState(
        target_cache=target_cache,
        context=context,
        prefix_lens=lengths,
        bonus=first,
        done=done,
        out=out,
        n_out=n_out,
        key=key,
        rounds=jnp.zeros((b,), jnp.int32),
        accept_counts=jnp.zeros((b, gamma + 1), jnp.int32),
        verify_counts=jnp.zeros((b, gamma + 1), jnp.int32),
        survival_sums=jnp.zeros((b, gamma if draft.cfg.enable_confidence_head else 0), jnp.float32),
    )


def _round_step(
    target,
    draft: DSparkDraft,
    state: DecodeState,
    requests: Requests,
    *,
    sampling: bool,
    filter_width: int,
    feature_layers,
    uniform_verify: bool = False,
) -> DecodeState:
    """One round on merged modules: propose, verify, accept, commit, emit (traced).

    ``uniform_verify``: with a ``verify_schedule``, every request verifies one scheduled
    length (``schedule_verify_lengths(..., widths=verify_widths(γ + 1))``) instead of its own.
    """
    active = ~state.done  # [B]
    key, k_prop, k_accept = jax.random.split(state.key, 3)
    block = propose_with(
        draft,
        state.context,
        state.bonus,
        state.prefix_lens,
        requests.temperatures,
        requests.top_k,
        k_prop,
        fold_sampling=sampling,
    )
    b, gamma = block.draft_tokens.shape
    tokens = jnp.concatenate([state.bonus[:, None], block.draft_tokens], axis=1)  # [B, T]
    positions = state.prefix_lens[:, None] + jnp.arange(gamma + 1, dtype=jnp.int32)  # [B, T]
    if requests.verify_schedule is None:
        verify_len = None
        valid = jnp.broadcast_to(active[:, None], tokens.shape)
        logits, features, target_cache = target(
            tokens, positions, state.target_cache, valid=valid, feature_layers=feature_layers
        )
    else:
        # Finished rows carry no survival, so they take no share of the budget.
        confidence = jnp.where(active[:, None], block.confidence, 0.0)  # [B, γ]
        widths = verify_widths(gamma + 1) if uniform_verify else None
        verify_len = schedule_verify_lengths(confidence, requests.verify_schedule, widths=widths)  # [B] in [1, T]
        logits, features, target_cache = _verify_scheduled(
            target, tokens, positions, state.target_cache, active, verify_len, feature_layers
        )
    correct_len, bonus = accept(
        logits,
        block,
        top_k=requests.top_k,
        top_p=requests.top_p,
        verify_len=verify_len,
        key=k_accept,
        filter_width=filter_width,
    )
    context, prefix_lens = commit(draft, state.context, features, state.prefix_lens, correct_len, active=active)
    # This round's tokens: the accepted drafts, then the bonus at index correct_len.
    slot = jnp.arange(gamma + 1, dtype=jnp.int32)[None, :]
    emitted = jnp.concatenate([block.draft_tokens, jnp.zeros((b, 1), jnp.int32)], axis=1)
    emitted = jnp.where(slot == correct_len[:, None], bonus[:, None], emitted)  # [B, T]
    count = jnp.where(active, correct_len + 1, 0)
    out, n_out, done = _emit(state.out, state.n_out, emitted, count, state.done, requests)
    bonus = jnp.where(active, bonus, state.bonus)
    hit = (slot == correct_len[:, None]) & active[:, None]
    verified = slot + 1 == (gamma + 1 if verify_len is None else verify_len[:, None])  # [B, T] one-hot length
    return DecodeState(
        target_cache=target_cache,
        context=context,
        prefix_lens=prefix_lens,
        bonus=bonus,
        done=done,
        out=out,
        n_out=n_out,
        key=key,
        rounds=state.rounds + active.astype(jnp.int32),
        accept_counts=state.accept_counts + hit.astype(jnp.int32),
        verify_counts=state.verify_counts + (verified & active[:, None]).astype(jnp.int32),
        survival_sums=state.survival_sums + jnp.where(active[:, None], jnp.cumprod(block.confidence, axis=-1), 0.0),
    )


def verify_widths(tokens: int) -> tuple[int, ...]:
    """The target widths a scheduled round compiles: ``1, 2, 4, …`` below ``tokens``, then
    ``tokens`` (= γ + 1); a round runs the narrowest that holds its longest verify length.

    Raises:
      ValueError: ``tokens`` is not an integer >= 1.
    """
    tokens = positive_int("tokens", tokens)
    return (*(1 << i for i in range(max(tokens - 1, 0).bit_length()) if 1 << i < tokens), tokens)


def _verify_scheduled(target, tokens, positions, cache, active, verify_len, feature_layers):
    """The target over each row's first ``verify_len`` tokens of ``tokens [B, T]`` (traced).

    One ``lax.switch`` branch per width of :func:`verify_widths`: only the narrowest
    holding every active row's ``verify_len`` runs, and slots past a row's ``verify_len``
    are neither cached nor seen. Logits and features come back ``[B, T, ·]``, zero past
    the width (``accept`` never reads them: ``correct_len < verify_len``).
    """
    t = tokens.shape[1]
    widths = verify_widths(t)
    valid = active[:, None] & (jnp.arange(t, dtype=jnp.int32)[None, :] < verify_len[:, None])  # [B, T]
    longest = jnp.max(jnp.where(active, verify_len, 1))
    branch = jnp.searchsorted(jnp.asarray(widths, jnp.int32), longest)  # narrowest width >= longest

    def width(w):
        def run(cache):
            logits, features, cache = target(
                tokens[:, :w], positions[:, :w], cache, valid=valid[:, :w], feature_layers=feature_layers
            )
            pad = ((0, 0), (0, t - w), (0, 0))
            return jnp.pad(logits, pad), jnp.pad(features, pad), cache

        return run

    return jax.lax.switch(branch, [width(w) for w in widths], cache)


def _round(
    target_state,
    draft_state,
    state: DecodeState,
    requests: Requests,
    *,
    target_def,
    draft_def,
    uniform_verify,
    **variant,
) -> DecodeState:
    """One round, one compiled call (the host loop reads the done flags in between)."""
    target, draft = _merge(target_def, target_state), _merge(draft_def, draft_state)
    return _round_step(target, draft, state, requests, uniform_verify=uniform_verify, **variant)


def _all_rounds(
    target_state,
    draft_state,
    state: DecodeState,
    requests: Requests,
    max_rounds: jax.Array,
    *,
    target_def,
    draft_def,
    uniform_verify,
    **variant,
) -> tuple[DecodeState, jax.Array]:
    """Every round in one compiled call: a ``while_loop`` until all rows are done."""
    target, draft = _merge(target_def, target_state), _merge(draft_def, draft_state)

    def cond(carry):
        state, rounds = carry
        return (rounds < max_rounds) & ~jnp.all(state.done)

    def body(carry):
        state, rounds = carry
        state = _round_step(target, draft, state, requests, uniform_verify=uniform_verify, **variant)
        return state, rounds + 1

    return jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))


@functools.lru_cache(maxsize=16)
def _speculative_program(
    target_def,
    draft_def,
    *,
    sampling: bool,
    filter_width: int,
    feature_layers: tuple[int, ...],
    uniform_verify: bool = False,
) -> _Program:
    """The compiled calls of one model pair and decoding variant, built once and reused.

    The model structures are bound here instead of being static arguments of every call:
    hashing an NNX GraphDef costs about half a millisecond on the host, which each round
    would otherwise pay twice.
    """
    static = dict(
        target_def=target_def,
        draft_def=draft_def,
        sampling=sampling,
        filter_width=filter_width,
        feature_layers=feature_layers,
    )
    return _Program(
        start=jax.jit(functools.partial(_start, **static), static_argnames=("capacity", "out_len")),
        step=jax.jit(functools.partial(_round, uniform_verify=uniform_verify, **static), donate_argnames=("state",)),
        loop=jax.jit(
            functools.partial(_all_rounds, uniform_verify=uniform_verify, **static), donate_argnames=("state",)
        ),
    )


def _position_limits(target, draft) -> dict[str, int | None]:
    """Each model's ``max_position_embeddings`` (``None`` where its config has none)."""
    return dict(target=getattr(target.config, "max_position_embeddings", None), draft=draft.cfg.max_position_embeddings)


def _launch(target, draft, tokens, lengths, requests, key, *, capacity, out_len, uniform_verify) -> _Program:
    """The compiled calls of this pair and batch, bound to the models' states and the batch.

    Returns a :class:`_Program` of ``start() -> state``, ``step(state, requests) -> state``
    and ``loop(state, requests, max_rounds) -> (state, rounds)``.
    """
    target_def, target_state = _split(target)
    draft_def, draft_state = _split(draft)
    program = _speculative_program(
        target_def,
        draft_def,
        feature_layers=tuple(draft.cfg.target_layer_ids),
        uniform_verify=uniform_verify,
        **_variant(requests, target.config.vocab_size),
    )
    return _Program(
        start=functools.partial(
            program.start,
            target_state,
            draft_state,
            jnp.asarray(tokens),
            jnp.asarray(lengths),
            requests,
            key,
            capacity=capacity,
            out_len=out_len,
        ),
        step=functools.partial(program.step, target_state, draft_state),
        loop=functools.partial(program.loop, target_state, draft_state),
    )


def speculative_generate(
    target: Target,
    draft: DSparkDraft,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 0.0,
    top_k: int | None | Sequence[int | None] = None,
    top_p: float | Sequence[float] = 1.0,
    stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    key: jax.Array,
    capacity: int | None = None,
    device_loop: bool = False,
    verify_schedule: Any = None,
    verify_rule: str = "per_request",
) -> GenerationResult:
    """Generates with the draft proposing and the target verifying; output is the target's.

    ``max_new_tokens``, ``temperature``, ``top_k`` and ``top_p`` take one value for all
    requests or one per request (a list, tuple or 1-D NumPy / JAX array); numbers may be
    Python, NumPy or JAX 0-d scalars, never bools. Every input is checked before anything
    is compiled.

    Args:
      target: a :class:`~dspark_jax.target.Target` (e.g. ``Qwen3Target``).
      draft: a :class:`~dspark_jax.draft.DSparkDraft` that borrows the target's
        embedding and lm_head.
      prompts: ``B`` lists of token ids, each non-empty, of any lengths (or one ``[B, P]``
        integer array of equal-length prompts).
      max_new_tokens: new tokens per request, in ``[1, 2**31 − 1]``.
      temperature: 0 = greedy; read in float32, so a positive one below float32's
        smallest (1.4e-45) is 0 too.
      top_k: ``None`` = no top-k, 1 = greedy.
      top_p: nucleus mass in ``(0, 1]``.
      stop_tokens: ids that end a request (one list for all, or one list per request).
      key: one PRNG key (used only by sampling requests).
      capacity: cache positions per request: at least prompt + max_new_tokens + γ − 1 (the
        last round verifies γ − 1 positions past the output); default that, rounded up.
      device_loop: run all rounds inside one compiled ``while_loop`` (no host sync per
        round) instead of one compiled call per round from a Python loop. Same tokens.
      verify_schedule: ``None`` (the target verifies all γ + 1 tokens of every round) or
        confidence-scheduled verification (``DSPARK_SPEC.md`` §5): a ``[N]`` table, ``N >
        B·(γ + 1)``, of measured decoding steps (whole rounds: draft, verify, accept) per
        second when the batch verifies ``t`` tokens in total (index ``t``, anchors
        included; finite, >= 0, not all 0). Each round, :func:`~dspark_jax.verification.schedule_verify_lengths`
        turns the draft's confidence into per-request verify lengths, the target runs at
        the narrowest width of :func:`verify_widths` holding the longest, and each
        request's slots past its length are neither computed into its accept nor cached.
        Needs a draft with a confidence head. Still lossless: greedy output equals
        plain greedy decoding, sampled output keeps the target's law.
        :func:`measure_verify_schedule` measures such a table.
      verify_rule: with ``verify_schedule``, ``"per_request"`` (the spec's rule above) or
        ``"uniform"``: every request verifies the one width of :func:`verify_widths` that
        maximises ``(B + expected accepted drafts) · table[B·width]``, the rule that fits
        a dense target (which pays for the width times the batch, whatever each request
        needs). Same losslessness.

    Returns:
      A :class:`GenerationResult`.

    Raises:
      TypeError: ``target`` or ``draft`` is not a model of its kind (or the two are
        swapped); a value of the wrong kind: a bool, string or float where an integer is
        expected, a bool or string where a number is, a ``device_loop`` that is not a
        bool, ``stop_tokens`` that are neither a list of ids nor one list per request,
        a ``verify_rule`` that is not a string, or a key per row.
      ValueError: a value out of range (ids outside the vocabulary, ``max_new_tokens`` or
        ``top_k`` outside ``[1, 2**31 − 1]``, …), a wrong number of per-request values, a
        ``capacity`` too small, a draft that does not fit the target, or a request whose
        prompt + max_new_tokens + γ − 1 positions exceed the target's or the draft's
        ``max_position_embeddings`` (the last round verifies γ − 1 positions past the
        output), a ``verify_rule`` not in :data:`VERIFY_RULES` or ``"uniform"`` without a
        ``verify_schedule``.
    """
    started = time.perf_counter()
    check_models(target, draft)
    check_pair(draft.cfg, target.config)
    gamma = draft.cfg.gamma
    tokens, lengths, requests = check_requests(
        prompts, target.config.vocab_size, max_new_tokens, temperature, top_k, top_p, stop_tokens
    )
    check_key(key, len(prompts))
    device_loop = check_bool("device_loop", device_loop)
    uniform_verify = check_verify_rule(verify_rule, verify_schedule)
    if verify_schedule is not None:
        requests = requests.replace(verify_schedule=check_verify_schedule(verify_schedule, draft.cfg, len(prompts)))
    max_new = np.asarray(requests.max_new)
    check_positions(lengths, max_new, gamma - 1, _position_limits(target, draft))
    program = _launch(
        target,
        draft,
        tokens,
        lengths,
        requests,
        key,
        capacity=cache_capacity(capacity, lengths, max_new, gamma - 1),
        out_len=bucket(int(max_new.max()) + gamma + 1),
        uniform_verify=uniform_verify,
    )
    state = program.start()
    # Each round commits >= 1 token per active request, so max_new rounds always suffice.
    max_rounds = int(max_new.max())
    if device_loop:
        state, rounds = program.loop(state, requests, jnp.int32(max_rounds))
        return _result(state, max_new, requests, int(rounds), started)
    rounds = 0
    while rounds < max_rounds and not np.asarray(state.done).all():
        state = program.step(state, requests)
        rounds += 1
    return _result(state, max_new, requests, rounds, started)


def measure_verify_schedule(
    target: Target,
    draft: DSparkDraft,
    batch: int,
    *,
    prompt_len: int = 64,
    rounds: int = 10,
    temperature: float = 0.0,
    seed: int = 0,
) -> np.ndarray:
    """Measures a ``verify_schedule`` table for this pair, batch and device.

    Decodes ``batch`` random prompts of ``prompt_len`` tokens with every request forced to
    verify ``w`` tokens per round, for each width ``w`` of :func:`verify_widths` (``γ + 1``),
    through the same compiled round that ``speculative_generate`` runs with a schedule:
    one compilation, then ``rounds`` timed rounds per width after one untimed round, each
    waited for. A dense target pays for the round's width whatever each request verifies,
    so ``table[t]`` is one over the median round at the narrowest width holding
    ``⌈t / B⌉`` tokens per request: exact for ``verify_rule="uniform"`` (``t = B·w``), a
    lower bound on the per-request rule's cost when its lengths are ragged.

    Args:
      target: a :class:`~dspark_jax.target.Target`.
      draft: a :class:`~dspark_jax.draft.DSparkDraft` with a confidence head.
      batch: requests per round (the ``B`` the table will serve).
      prompt_len: tokens of context per request before the timed rounds.
      rounds: timed rounds per width.
      temperature: the requests' temperature (0 = greedy rounds, > 0 = sampling rounds).
      seed: the prompts' and the sampling key's seed.

    Returns:
      ``[B·(γ + 1) + 1]`` float32 steps (rounds) per second, indexed by tokens verified.

    Raises:
      TypeError: ``target`` or ``draft`` is not a model of its kind.
      ValueError: a count below 1, a bad temperature, a draft without a confidence head,
        or positions past either model's ``max_position_embeddings``.
    """
    check_models(target, draft)
    check_pair(draft.cfg, target.config)
    batch, prompt_len, rounds = (
        positive_int(n, v) for n, v in [("batch", batch), ("prompt_len", prompt_len), ("rounds", rounds)]
    )
    gamma = draft.cfg.gamma
    widths = verify_widths(gamma + 1)
    size = batch * (gamma + 1) + 1
    check_confidence_head(draft.cfg)
    rng = np.random.default_rng(check_seed("seed", seed))
    prompts = rng.integers(0, target.config.vocab_size, (batch, prompt_len)).tolist()
    # Each width decodes afresh from the prompts; a round commits 1 … γ + 1 tokens per
    # request, so none finishes before its last timed round.
    max_new = (rounds + 1) * (gamma + 1) + 1
    tokens, lengths, requests = check_requests(prompts, target.config.vocab_size, max_new, temperature, None, 1.0, None)
    need = prompt_len + max_new + gamma - 1
    limits = _position_limits(target, draft).items()
    over = " and ".join(f"the {name}'s max_position_embeddings={n}" for name, n in limits if n and need > n)
    if over:
        raise ValueError(
            f"prompt_len={prompt_len} and rounds={rounds} need prompt_len + (rounds + 1)·(γ + 1) + γ = {need} "
            f"positions (γ = {gamma}), past {over}: lower prompt_len or rounds"
        )
    program = _launch(
        target,
        draft,
        tokens,
        lengths,
        requests,
        jax.random.key(seed),
        capacity=cache_capacity(None, lengths, np.asarray(requests.max_new), gamma - 1),
        out_len=bucket(max_new + gamma + 1),
        uniform_verify=True,
    )
    seconds = []
    for w in widths:
        state = program.start()
        forced = np.zeros(size, np.float32)
        forced[batch * w] = 1.0  # the uniform rule's only width of non-zero value
        forced_requests = requests.replace(verify_schedule=jnp.asarray(forced))
        before, times = np.asarray(state.verify_counts).sum(0), []  # [γ + 1]
        for _ in range(rounds + 1):
            began = time.perf_counter()
            state = jax.block_until_ready(program.step(state, forced_requests))
            times.append(time.perf_counter() - began)
        if (np.asarray(state.verify_counts).sum(0) - before)[w - 1] != batch * (rounds + 1):
            raise RuntimeError(f"the rounds timed at width {w} did not all verify {w} tokens for every request")
        seconds.append(float(np.median(times[1:])))
    per_request = -(-np.arange(size) // batch)  # ⌈t / B⌉
    narrowest = np.searchsorted(np.asarray(widths), np.maximum(per_request, 1))  # [N] index into widths
    return (1.0 / np.asarray(seconds, np.float64)[narrowest]).astype(np.float32)


def _cut(out: np.ndarray, n_out: np.ndarray, max_new: np.ndarray, stop: np.ndarray) -> list[list[int]]:
    """Each row's output up to its max_new_tokens and through its first stop token."""
    tokens = []
    for b in range(out.shape[0]):
        row = out[b, : min(int(n_out[b]), int(max_new[b]))].tolist()
        stops = set(stop[b][stop[b] >= 0].tolist())
        first_stop = next((i for i, t in enumerate(row) if t in stops), None)
        tokens.append(row if first_stop is None else row[: first_stop + 1])
    return tokens


def _result(state: DecodeState, max_new, requests: Requests, rounds: int, started: float) -> GenerationResult:
    tokens = _cut(np.asarray(state.out), np.asarray(state.n_out), max_new, np.asarray(requests.stop))
    counts = np.asarray(state.accept_counts)  # [B, γ + 1]
    gamma = counts.shape[1] - 1
    committed = counts @ np.arange(1, gamma + 2)  # [B] tokens committed over all rounds
    with np.errstate(invalid="ignore", divide="ignore"):
        tau = (committed / np.asarray(state.rounds)).tolist()
    total = counts.sum(0)  # [γ + 1]
    n = int(total.sum())
    verify_counts = np.asarray(state.verify_counts).sum(0)  # [γ + 1]
    return GenerationResult(
        tokens=tokens,
        rounds=rounds,
        tau=tau,
        tau_overall=float(committed.sum() / n) if n else float("nan"),
        acceptance_by_position=[float(total[k:].sum() / max(n, 1)) for k in range(1, gamma + 1)],
        accept_length_counts=total.tolist(),
        verified_tokens=int(verify_counts @ np.arange(1, gamma + 2)),
        verify_length_counts=verify_counts.tolist(),
        confidence_by_position=(np.asarray(state.survival_sums).sum(0) / max(n, 1)).tolist(),
        seconds=time.perf_counter() - started,
    )


# ------------------------------------------------------------------ plain baseline
@struct.dataclass
class _PlainState:
    cache: Any
    next_pos: jax.Array  # [B] position of the last emitted token
    last: jax.Array  # [B] last emitted token
    done: jax.Array
    out: jax.Array
    n_out: jax.Array
    key: jax.Array


def _plain_start(
    target_state, tokens, lengths, requests, key, *, target_def, capacity, out_len, sampling, filter_width
):
    target = _merge(target_def, target_state)
    b = tokens.shape[0]
    last_logits, _, cache = _prefill_target(target, tokens, lengths, capacity, ())
    key, k_first = jax.random.split(key)
    first = _pick(last_logits, requests, k_first, sampling, filter_width)
    out, n_out, done = _emit(
        jnp.zeros((b, out_len), jnp.int32),
        jnp.zeros((b,), jnp.int32),
        first[:, None],
        jnp.ones((b,), jnp.int32),
        jnp.zeros((b,), bool),
        requests,
    )
    return _PlainState(cache=cache, next_pos=lengths, last=first, done=done, out=out, n_out=n_out, key=key)


def _plain_token(target, state: _PlainState, requests: Requests, sampling: bool, filter_width: int) -> _PlainState:
    """One decode step on the merged target (traced)."""
    active = ~state.done
    logits, _, cache = target(
        state.last[:, None], state.next_pos[:, None], state.cache, valid=active[:, None], feature_layers=()
    )
    key, k_tok = jax.random.split(state.key)
    tok = _pick(logits[:, 0], requests, k_tok, sampling, filter_width)
    out, n_out, done = _emit(state.out, state.n_out, tok[:, None], active.astype(jnp.int32), state.done, requests)
    return _PlainState(
        cache=cache,
        next_pos=state.next_pos + active.astype(jnp.int32),
        last=jnp.where(active, tok, state.last),
        done=done,
        out=out,
        n_out=n_out,
        key=key,
    )


def _plain_step(target_state, state: _PlainState, requests, *, target_def, sampling, filter_width) -> _PlainState:
    return _plain_token(_merge(target_def, target_state), state, requests, sampling, filter_width)


def _plain_all_steps(target_state, state: _PlainState, requests, max_steps, *, target_def, sampling, filter_width):
    target = _merge(target_def, target_state)

    def cond(carry):
        state, steps = carry
        return (steps < max_steps) & ~jnp.all(state.done)

    def body(carry):
        state, steps = carry
        return _plain_token(target, state, requests, sampling, filter_width), steps + 1

    return jax.lax.while_loop(cond, body, (state, jnp.zeros((), jnp.int32)))


@functools.lru_cache(maxsize=16)
def _plain_program(target_def, *, sampling: bool, filter_width: int) -> _Program:
    """The baseline's compiled calls for one target and decoding variant (see :func:`_speculative_program`)."""
    static = dict(target_def=target_def, sampling=sampling, filter_width=filter_width)
    return _Program(
        start=jax.jit(functools.partial(_plain_start, **static), static_argnames=("capacity", "out_len")),
        step=jax.jit(functools.partial(_plain_step, **static), donate_argnames=("state",)),
        loop=jax.jit(functools.partial(_plain_all_steps, **static), donate_argnames=("state",)),
    )


def generate(
    target: Target,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int | Sequence[int],
    temperature: float | Sequence[float] = 0.0,
    top_k: int | None | Sequence[int | None] = None,
    top_p: float | Sequence[float] = 1.0,
    stop_tokens: Sequence[int] | Sequence[Sequence[int]] | None = None,
    key: jax.Array,
    capacity: int | None = None,
    device_loop: bool = False,
) -> GenerationResult:
    """Plain autoregressive decoding with the target alone (the baseline).

    Same arguments and sampling semantics as :func:`speculative_generate` (so greedy
    outputs compare token for token); ``rounds`` counts decode steps after the first
    token, ``tau`` is 1. ``device_loop=True`` runs every step in one compiled
    ``while_loop``.

    Raises:
      TypeError: as for :func:`speculative_generate` (``target`` a draft or not a model).
      ValueError: as for :func:`speculative_generate`; here a request's prompt +
        max_new_tokens must not exceed the target's ``max_position_embeddings``.
    """
    started = time.perf_counter()
    check_models(target)
    tokens, lengths, requests = check_requests(
        prompts, target.config.vocab_size, max_new_tokens, temperature, top_k, top_p, stop_tokens
    )
    check_key(key, len(prompts))
    device_loop = check_bool("device_loop", device_loop)
    max_new = np.asarray(requests.max_new)
    check_positions(lengths, max_new, 0, dict(target=getattr(target.config, "max_position_embeddings", None)))
    capacity = cache_capacity(capacity, lengths, max_new, 0)
    target_def, target_state = _split(target)
    program = _plain_program(target_def, **_variant(requests, target.config.vocab_size))
    state = program.start(
        target_state,
        jnp.asarray(tokens),
        jnp.asarray(lengths),
        requests,
        key,
        capacity=capacity,
        out_len=bucket(int(max_new.max()) + 1),
    )
    max_steps = int(max_new.max())
    if device_loop:
        state, steps = program.loop(target_state, state, requests, jnp.int32(max_steps))
        steps = int(steps)
    else:
        steps = 0
        while steps < max_steps and not np.asarray(state.done).all():
            state = program.step(target_state, state, requests)
            steps += 1
    tokens = _cut(np.asarray(state.out), np.asarray(state.n_out), max_new, np.asarray(requests.stop))
    return GenerationResult(
        tokens=tokens,
        rounds=steps,
        tau=[1.0] * len(tokens),
        tau_overall=1.0,
        acceptance_by_position=[],
        accept_length_counts=[],
        verified_tokens=int(np.asarray(state.n_out).sum()) - len(tokens),  # one per request-step
        seconds=time.perf_counter() - started,
        verify_length_counts=[],
        confidence_by_position=[],
    )
