"""A decoding call's requests, checked on the host before anything compiles.

Shape legend: B requests, P padded prompt length, S stop-list width.

Prompts (token id lists, or a ``[B, P]`` array) and the per-request settings of
:func:`~dspark_jax.generation.speculative_generate` and :func:`~dspark_jax.generation.generate`
(max new tokens, temperature, top-k, top-p, stop tokens; one value for all or one per request)
become the :class:`Requests` pytree the compiled calls read; the cache capacity, the models'
position limits, the ``verify_schedule`` table, its rule and the key are checked here too.
Every bad value is named (``prompts[1][3]=…``, ``temperature[0]=…``) with what is allowed.
Static lengths round up (:func:`bucket`) so that nearby batches share compiled programs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from dspark_jax.config import check_flag, is_integer, is_real
from dspark_jax.sampling import TOP_K_ALL, TOP_K_MAX, key_rows

MAX_TEMPERATURE = float(np.finfo(np.float32).max)  # a larger temperature reaches the round as inf
MAX_NEW_TOKENS = int(np.iinfo(np.int32).max)  # max_new_tokens reaches the round as int32


@struct.dataclass
class Requests:
    """Per-request sampling parameters, ``[B]`` each (``stop`` is ``[B, S]``, −1 padded), and
    the batch's ``[N]`` steps-per-second table when verification is confidence-scheduled."""

    temperatures: jax.Array
    top_k: jax.Array
    top_p: jax.Array
    max_new: jax.Array
    stop: jax.Array
    verify_schedule: jax.Array | None = None


def as_scalar(value: Any) -> Any:
    """A NumPy / JAX 0-d array or scalar as the Python number it holds; anything else unchanged."""
    if isinstance(value, (np.generic, np.ndarray, jax.Array)) and np.ndim(value) == 0:
        return np.asarray(value).item()
    return value


def _invalid(field: str, value: Any, allowed: str, *, right_kind: bool) -> Exception:
    """The error for a bad value: ``TypeError`` for the wrong kind of value, ``ValueError`` for one out of range."""
    return (ValueError if right_kind else TypeError)(f"{field}={value!r} is invalid: {allowed}")


def check_bool(name: str, value: Any) -> bool:
    """A boolean flag (Python, NumPy or JAX bool) as a Python bool; anything else is refused."""
    value = as_scalar(value)
    check_flag(name, value)
    return value


def _per_request(name: str, value: Any, batch: int) -> list:
    """One value per request, NumPy / JAX scalars as Python numbers: a list, tuple or array of
    ``batch`` entries, or one value for all."""
    arrays = (np.ndarray, jax.Array)
    if isinstance(value, (list, tuple)) or (isinstance(value, arrays) and value.ndim >= 1):
        if len(value) != batch:
            raise ValueError(f"{name} has {len(value)} entries: expected one per prompt ({batch}) or a single value")
        return [as_scalar(v) for v in (np.asarray(value) if isinstance(value, arrays) else value)]
    return [as_scalar(value)] * batch


def _entries(value: Any) -> list | None:
    """The entries of an iterable or an array of >= 1 dimension; None for a single value or a string."""
    if isinstance(value, (np.generic, np.ndarray, jax.Array)):
        return list(np.asarray(value)) if np.ndim(value) else None
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        return None
    return list(value)


def _stop_lists(stop_tokens: Any, batch: int, vocab_size: int) -> list[list[int]]:
    """``stop_tokens`` (``None``, one list of ids for all requests, or one list per request) as ``B`` lists."""
    if stop_tokens is None:
        return [[] for _ in range(batch)]
    allowed = "expected token ids: one list for every request, or one list per request"
    entries = _entries(stop_tokens)
    if entries is None:
        raise TypeError(f"stop_tokens={stop_tokens!r} is invalid: {allowed}")
    lists = [_entries(e) for e in entries]
    shared = all(s is None for s in lists)  # an empty list is shared too
    if not shared and any(s is None for s in lists):
        raise TypeError(f"stop_tokens={stop_tokens!r} is invalid: it mixes ids and lists; {allowed}")
    if not shared and len(lists) != batch:
        raise ValueError(f"stop_tokens has {len(lists)} lists: expected one per prompt ({batch}) or one list for all")
    rows = [entries] if shared else lists
    for b, row in enumerate(rows):
        for i, t in enumerate(row):
            t = row[i] = as_scalar(t)
            if not is_integer(t) or not 0 <= t < vocab_size:
                field = f"stop_tokens[{i}]" if shared else f"stop_tokens[{b}][{i}]"
                allowed = f"stop tokens must be token ids in [0, {vocab_size})"
                raise _invalid(field, t, allowed, right_kind=is_integer(t))
    return rows * batch if shared else rows


def check_requests(
    prompts: Sequence[Sequence[int]],
    vocab_size: int,
    max_new_tokens: Any,
    temperature: Any,
    top_k: Any,
    top_p: Any,
    stop_tokens: Any,
) -> tuple[np.ndarray, np.ndarray, Requests]:
    """Checks a decoding call's prompts and per-request settings on the host.

    Args:
      prompts: ``B`` lists of token ids (or a ``[B, P]`` integer array), each ``>= 1`` long.
      vocab_size: ids must lie in ``[0, vocab_size)`` (prompts and stop tokens).
      max_new_tokens, temperature, top_k, top_p: one value for every request or one per
        request (``top_k``/``top_p`` ``None``: no filter).
      stop_tokens: ``None``, one list of ids for every request, or one list per request.

    Returns:
      ``(tokens [B, P], lengths [B], requests)``: the prompts right-padded with zeros to
      ``P`` (a multiple of 16), their lengths, and the :class:`Requests` the rounds read.

    Raises:
      TypeError: a value of the wrong kind (a float token id, a string temperature).
      ValueError: a value out of range, or a per-request list of the wrong length.
    """
    if isinstance(prompts, (np.ndarray, jax.Array)):  # [B, P]: B prompts of P tokens
        if prompts.ndim != 2 or prompts.size == 0:
            raise ValueError(f"prompts has shape {prompts.shape}: an array of prompts must be [B, P] with B, P >= 1")
        prompts = list(np.asarray(prompts))
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError(f"prompts={prompts!r} is invalid: expected a non-empty list of token id lists")
    batch = len(prompts)
    rows = []
    for b, prompt in enumerate(prompts):
        if isinstance(prompt, (list, tuple)) and any(isinstance(i, (bool, np.bool_)) for i in prompt):
            raise TypeError(f"prompts[{b}] holds a bool: expected integer token ids (NumPy would read True as 1)")
        try:
            ids = np.asarray(prompt)
        except ValueError:  # ragged nesting
            ids = np.empty((0, 0))
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompts[{b}] is empty or not a flat list of token ids: every prompt needs >= 1 token")
        if not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"prompts[{b}] has dtype {ids.dtype}: expected integer token ids")
        bad = (ids < 0) | (ids >= vocab_size)
        if bad.any():
            i = int(np.argmax(bad))
            raise ValueError(f"prompts[{b}][{i}]={int(ids[i])} is outside the vocabulary: 0 <= id < {vocab_size}")
        rows.append(ids)
    lengths = np.array([len(r) for r in rows], np.int32)
    width = bucket(int(lengths.max()))
    tokens = np.zeros((batch, width), np.int32)
    for b, r in enumerate(rows):
        tokens[b, : len(r)] = r

    max_new = _per_request("max_new_tokens", max_new_tokens, batch)
    for b, m in enumerate(max_new):
        if not is_integer(m) or not 1 <= m <= MAX_NEW_TOKENS:
            allowed = f"must be an integer in [1, {MAX_NEW_TOKENS}]"
            raise _invalid(f"max_new_tokens[{b}]", m, allowed, right_kind=is_integer(m))
    temps = _per_request("temperature", temperature, batch)
    for b, t in enumerate(temps):
        if not is_real(t) or not 0 <= t <= MAX_TEMPERATURE:  # also refuses NaN
            allowed = "must be a number >= 0 (0 = greedy), finite in float32"
            raise _invalid(f"temperature[{b}]", t, allowed, right_kind=is_real(t))
    ks = [TOP_K_ALL if k is None else k for k in _per_request("top_k", top_k, batch)]
    for b, k in enumerate(ks):
        if not is_integer(k) or not 1 <= k <= TOP_K_MAX:
            allowed = f"must be None (no top-k) or an integer in [1, {TOP_K_MAX}] (1 = greedy)"
            raise _invalid(f"top_k[{b}]", k, allowed, right_kind=is_integer(k))
    ps = [1.0 if p is None else p for p in _per_request("top_p", top_p, batch)]
    for b, p in enumerate(ps):
        if not is_real(p) or not 0 < p <= 1:
            raise _invalid(f"top_p[{b}]", p, "must be a number in (0, 1]", right_kind=is_real(p))
    stops = _stop_lists(stop_tokens, batch, vocab_size)
    # [B, S]: S rounded up so that stop lists of other lengths share the compiled programs
    stop = np.full((batch, bucket(max(1, max(len(s) for s in stops)), 8)), -1, np.int32)
    for b, s in enumerate(stops):
        stop[b, : len(s)] = s
    requests = Requests(
        temperatures=jnp.asarray(np.array(temps, np.float32)),
        top_k=jnp.asarray(np.array(ks, np.int32)),
        top_p=jnp.asarray(np.array(ps, np.float32)),
        max_new=jnp.asarray(np.array(max_new, np.int32)),
        stop=jnp.asarray(stop),
    )
    return tokens, lengths, requests


def bucket(n: int, step: int = 16) -> int:
    """Rounds a static length up to a multiple of ``step`` so nearby sizes share compilations."""
    return -(-n // step) * step


def check_positions(lengths: np.ndarray, max_new: np.ndarray, lookahead: int, limits: dict[str, Any]) -> None:
    """Refuses requests that would run a model at a position >= its ``max_position_embeddings``.

    A request's prompt and output fill positions ``0 … prompt + max_new_tokens − 1``. A
    speculative round starts from the bonus (at most at ``prompt + max_new_tokens − 2``
    while the request is unfinished) and runs both models ``γ`` positions past it, so
    speculative decoding looks ``lookahead = γ − 1`` positions further.

    Args:
      lengths: ``[B]`` prompt lengths.
      max_new: ``[B]`` max_new_tokens.
      lookahead: positions run past the last output token (γ − 1, or 0 for plain decoding).
      limits: ``max_position_embeddings`` by model name (``None`` where a config has none).
    """
    b, need = _longest_request(lengths, max_new, lookahead)
    over = {name: limit for name, limit in limits.items() if limit is not None and need > limit}
    if over:
        terms = "prompt + max_new_tokens" + (" + gamma - 1" if lookahead else "")
        why = f" (the last round verifies gamma - 1 = {lookahead} positions past the output)" if lookahead else ""
        models = " and ".join(f"the {name}'s max_position_embeddings={limit}" for name, limit in over.items())
        raise ValueError(
            f"prompts[{b}] has {int(lengths[b])} tokens and max_new_tokens[{b}]={int(max_new[b])}: "
            f"{terms} = {need} positions{why} exceed {models}"
        )


def _longest_request(lengths: np.ndarray, max_new: np.ndarray, lookahead: int) -> tuple[int, int]:
    """``(b, need)``: the request needing the most positions and how many (prompt, output and
    ``lookahead``)."""
    ends = lengths.astype(np.int64) + max_new  # [B]
    b = int(np.argmax(ends))
    return b, int(ends[b]) + lookahead


def cache_capacity(capacity: Any, lengths: np.ndarray, max_new: np.ndarray, lookahead: int) -> int:
    """The cache capacity: ``capacity``, checked, or the bucket of the positions the requests
    need (as :func:`check_positions`: prompt and output, plus ``lookahead``)."""
    b, need = _longest_request(lengths, max_new, lookahead)
    if capacity is None:
        return bucket(need)
    capacity = as_scalar(capacity)
    if not is_integer(capacity):
        raise TypeError(f"capacity={capacity!r} is invalid: must be None (sized from the requests) or an integer")
    if capacity < need:
        raise ValueError(
            f"capacity={capacity!r} is too small: prompt {b} has {int(lengths[b])} tokens and may generate "
            f"{int(max_new[b])}, which needs capacity >= {need} (prompt + max_new_tokens"
            + (" + gamma - 1, the positions the last round verifies past the output)" if lookahead else ")")
        )
    return int(capacity)


def check_confidence_head(cfg) -> None:
    """Raises ``ValueError`` unless the draft has the confidence head a schedule ranks by."""
    if not cfg.enable_confidence_head:
        raise ValueError(
            "verify_schedule needs a draft with a confidence head (enable_confidence_head=True): "
            "the schedule ranks drafts by their confidence"
        )


def check_verify_schedule(table: Any, cfg, batch: int) -> jax.Array:
    """The ``verify_schedule`` table as a float32 device array, checked on the host.

    Raises:
      TypeError: ``table`` is not a 1-D array of real numbers.
      ValueError: too short, a value negative or not finite, all zeros, or a draft
        without a confidence head.
    """
    check_confidence_head(cfg)
    values = np.asarray(table)
    if values.dtype == bool or not (
        np.issubdtype(values.dtype, np.integer) or np.issubdtype(values.dtype, np.floating)
    ):
        raise TypeError(f"verify_schedule has dtype {values.dtype}: expected real numbers (steps per second)")
    need = batch * (cfg.gamma + 1) + 1
    if values.ndim != 1 or values.shape[0] < need:
        raise ValueError(
            f"verify_schedule has shape {values.shape}: expected [N] with N >= B·(γ + 1) + 1 = {need} "
            "(steps per second indexed by tokens verified per step, 0 … B·(γ + 1))"
        )
    with np.errstate(over="ignore"):  # a value past float32's range is reported below
        as_f32 = values.astype(np.float32)
    bad = ~(np.isfinite(as_f32) & (as_f32 >= 0))
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(
            f"verify_schedule[{i}]={values[i]} is invalid: must be >= 0 and finite in float32 (steps per second)"
        )
    if not as_f32.any():
        raise ValueError("verify_schedule is all zeros: expected measured steps per second")
    return jnp.asarray(as_f32)


VERIFY_RULES = ("per_request", "uniform")


def check_verify_rule(rule: Any, table: Any) -> bool:
    """Whether ``verify_rule`` is the uniform rule; raises on anything else than a rule
    of :data:`VERIFY_RULES`, or on a non-default rule without a ``verify_schedule``."""
    if not isinstance(rule, str):
        raise TypeError(f"verify_rule={rule!r} is invalid: expected one of {VERIFY_RULES}")
    if rule not in VERIFY_RULES:
        raise ValueError(f"verify_rule={rule!r} is invalid: expected one of {VERIFY_RULES}")
    if rule != "per_request" and table is None:
        raise ValueError(f"verify_rule={rule!r} needs a verify_schedule (the table the rule reads)")
    return rule == "uniform"


def check_key(key: Any, batch: int) -> None:
    """One PRNG key (typed or raw); the rounds split it, so per-row keys are refused."""
    if key_rows(key, batch):
        raise TypeError(f"key has shape {key.shape}: expected one PRNG key (jax.random.key(seed)), not one per row")
