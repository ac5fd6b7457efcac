"""Accepting draft tokens against the target: greedy prefix match and chain rejection sampling.

Shape legend: B batch, γ draft tokens, T = γ + 1 verify rows, V vocabulary.

Verify row ``i`` of the target logits (position ``prefix_len + i``) predicts the token
after it, so it judges draft ``d_{i+1}`` and, when every draft before it is accepted,
supplies the bonus. Per row (``DSPARK_SPEC.md`` §4):

* greedy rows: ``correct_len`` = leading ``d_{i+1} == argmax(target_logits[i])``,
  ``bonus = argmax(target_logits[correct_len])``;
* sampling rows: ``p`` = target probabilities at the request's temperature with its
  top-k / top-p, ``q = softmax(corrected / T)``; accept ``d_i`` while
  ``u_i · q_i(d_i) < p_i(d_i)``; on the first rejection at ``n`` the bonus is drawn from
  ``normalise(max(p_n − q_n, 0))`` (``p_n`` when that is all zero), after the last verified
  draft from ``p`` at that row. The committed tokens are then distributed exactly as if
  the target had sampled them one at a time.

A per-request cap ``verify_len ∈ [1, γ+1]`` (the anchor plus the drafts the target
verified) bounds ``correct_len ≤ verify_len − 1``; values outside are clamped into that
range, as nothing can raise inside a compiled round. A draft id outside ``[0, V)`` (which no
draft distribution produces) ends the row's drafts where it stands, like such a cap: it and
every draft after it are rejected, and the bonus there comes from the target alone (its
argmax, or ``p`` at that row, not the residual, which is the right law only for a draft
drawn from ``q``), so the output is still the target's. Sampling draws ``u ~ U[0, 1)`` and
``E ~ Exp(1)`` (the exponential race, ``argmax(probs / E)``), all in float32.

Shapes and dtypes are checked while tracing. The requests' values (temperatures ``>= 0`` and
finite, ``top_k`` in ``[1, TOP_K_MAX]``, ``top_p`` in ``(0, 1]``, as generation allows them) are
checked only when concrete (an eager call, or host values): a traced value has nothing to read
and a compiled round cannot raise, so the checks add nothing to a compiled program.

Ranking the vocabulary for top-k / top-p is a sort, by far the dearest step on CPU, so
the number of ranks examined is a static ``filter_width`` decided on the host from the
requests (:func:`required_filter_width`): ``0`` when no sampling row restricts its distribution
(no ranking at all), the power of two covering the largest top-k when every restricting
row has one (a partial ``lax.top_k``), else ``V`` (a full ranking). Rows that keep the
whole vocabulary get the softmax itself in every variant, so all variants agree exactly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

from dspark_jax.config import is_integer, positive_int
from dspark_jax.sampling import (
    TOP_K_MAX,
    check_dtypes,
    check_one_key,
    check_values,
    clamp_temperatures,
    greedy_rows,
    greedy_step,
    inverse_temperatures,
)

if TYPE_CHECKING:
    import numpy.typing as npt

    from dspark_jax.proposal import DraftBlock

# Value rules of the requests' per-row inputs, ``(valid(values) -> bool array, what is allowed)``,
# as generation allows them.
_TEMPERATURES = (
    lambda t: np.isfinite(t.astype(np.float32)) & (t >= 0),  # a float64 1e39 reaches the round as inf
    "must be a number >= 0 (0 = greedy), finite in float32",
)
_TOP_K = (lambda k: (k >= 1) & (k <= TOP_K_MAX), f"must be an integer in [1, {TOP_K_MAX}] (1 = greedy)")
_TOP_P = (lambda p: (p > 0) & (p <= 1), "must be a number in (0, 1]")
_PROBABILITIES = (lambda c: (c >= 0) & (c <= 1), "must be a probability in [0, 1]")
_RATES = (lambda r: np.isfinite(r) & (r >= 0), "must be a finite rate >= 0 (steps per second)")


def required_filter_width(
    temperatures: npt.ArrayLike, top_k: npt.ArrayLike, top_p: npt.ArrayLike, vocab_size: int
) -> int:
    """The static number of ranks top-k / top-p must examine for these requests (host side).

    Only sampling rows count (greedy rows, ``top_k <= 1`` or temperature 0, never read
    the target's probabilities). A row restricts its distribution when ``top_k < V`` or
    ``top_p < 1``.

    Args:
      temperatures: ``[B]`` host values (NumPy or lists), ``>= 0`` and finite in float32.
      top_k: ``[B]`` integers in ``[1, TOP_K_MAX]``.
      top_p: ``[B]`` numbers in ``(0, 1]``.
      vocab_size: ``V``, an integer ``>= 1``.

    Returns:
      ``0`` when no sampling row restricts (skip the ranking); otherwise the smallest power
      of two ``>=`` every restricting row's ``top_k``, capped at ``V`` (``V`` as soon as
      one restricting row has ``top_k >= V``, i.e. top-p alone).

    Raises:
      ValueError: ``vocab_size`` is not an integer ``>= 1``, the three are not ``[B]`` of one
        length, or a value is out of range (naming its first offending entry).
      TypeError: ``top_k`` is not of an integer dtype, ``temperatures`` or ``top_p`` not of a
        numeric one.
    """
    vocab_size = positive_int("vocab_size", vocab_size)
    temperatures, top_k, top_p = (np.asarray(x) for x in (temperatures, top_k, top_p))
    shapes = tuple(x.shape for x in (temperatures, top_k, top_p))
    if any(len(shape) != 1 for shape in shapes) or len(set(shapes)) != 1:
        raise ValueError(
            f"temperatures, top_k and top_p have shapes {shapes[0]}, {shapes[1]} and {shapes[2]}: "
            "expected [B] each, one entry per request"
        )
    check_dtypes({"top_k": (top_k, jnp.integer)})
    for name, values in (("temperatures", temperatures), ("top_p", top_p)):
        if not (jnp.issubdtype(values.dtype, jnp.integer) or jnp.issubdtype(values.dtype, jnp.floating)):
            raise TypeError(f"{name} has dtype {values.dtype}: expected a numeric (integer or floating) dtype")
    check_values({"temperatures": (temperatures, _TEMPERATURES), "top_k": (top_k, _TOP_K), "top_p": (top_p, _TOP_P)})
    widest = int(_ranks_read(temperatures, top_k, top_p, vocab_size).max())
    if widest == 0:
        return 0
    return min(vocab_size, 1 << (widest - 1).bit_length())


def _ranks_read(temperatures: np.ndarray, top_k: np.ndarray, top_p: np.ndarray, vocab: int) -> np.ndarray:
    """``[B]`` host: the ranks each row's top-k / top-p reads, ``min(top_k, V)`` for a sampling
    row that restricts its distribution (``top_k < V`` or ``top_p < 1``), else 0."""
    with np.errstate(invalid="ignore"):  # a NaN temperature is a greedy row
        restricting = (top_k > 1) & (temperatures > 0) & ((top_k < vocab) | (top_p < 1.0))
    return np.where(restricting, np.minimum(top_k.astype(np.int64), vocab), 0)


def apply_top_k_top_p(probs: jax.Array, top_k: jax.Array, top_p: jax.Array, *, width: int | None = None) -> jax.Array:
    """Restricts distributions to their top-k, then to their top-p nucleus, and renormalises.

    Tokens are ranked by probability, ties by lowest id. Top-k keeps the ``k`` first
    ranks; top-p then keeps the shortest ranked prefix whose (top-k renormalised) mass
    reaches ``top_p``, never fewer than one token; ``top_p >= 1`` keeps all. Rows with
    ``top_k >= V`` and ``top_p >= 1`` are returned unchanged.

    Args:
      probs: ``[..., V]`` float32 probabilities (rows sum to 1).
      top_k: ``[...]`` integer, ``>= 1`` (a huge value = no top-k).
      top_p: ``[...]`` float in ``(0, 1]``.
      width: static number of ranks examined, in ``[1, V]`` (default ``V``); a smaller
        width sorts only that many ranks, and a row that restricts acts as if its
        ``top_k`` were ``min(top_k, width)`` (exact when ``width >= top_k``).

    Returns:
      ``[..., V]`` float32 probabilities, zero outside the kept set.

    Raises:
      ValueError: ``probs`` has no vocabulary axis, ``top_k`` or ``top_p`` is not of shape
        ``probs.shape[:-1]``, or ``width`` is not an integer in ``[1, V]`` (all checked while
        tracing); with concrete values, a ``top_k`` outside ``[1, TOP_K_MAX]`` or a ``top_p``
        outside ``(0, 1]``.
      TypeError: ``top_k`` is not of an integer dtype or ``top_p`` not of a floating one.
    """
    if np.ndim(probs) < 1:
        raise ValueError(f"probs has shape {np.shape(probs)}: expected [..., V]")
    rows = tuple(np.shape(probs)[:-1])
    _check_shapes({"top_k": (top_k, rows), "top_p": (top_p, rows)}, "probs.shape[:-1]")
    check_dtypes({"top_k": (top_k, jnp.integer), "top_p": (top_p, jnp.floating)})
    v = np.shape(probs)[-1]
    width = v if width is None else width
    if not is_integer(width) or not 1 <= width <= v:
        raise ValueError(f"width={width!r} is invalid: must be an integer in [1, V={v}]")
    check_values({"top_k": (top_k, _TOP_K), "top_p": (top_p, _TOP_P)})
    return _top_k_top_p(probs, top_k, top_p, width)


def _top_k_top_p(probs: jax.Array, top_k: jax.Array, top_p: jax.Array, width: int) -> jax.Array:
    """:func:`apply_top_k_top_p` on checked inputs (``width`` an integer in ``[1, V]``)."""
    probs = probs.astype(jnp.float32)
    v = probs.shape[-1]
    top_k = jnp.asarray(top_k)[..., None]
    top_p = jnp.asarray(top_p)[..., None].astype(jnp.float32)
    ranked, order = jax.lax.top_k(probs, width)  # [..., W] descending, ties by lowest id
    rank = jnp.arange(width)
    in_top_k = rank < top_k
    # Running sums in rank order, so the top-k mass and the mass ranked strictly ahead of a
    # token round the same way whatever the width.
    running = jnp.cumsum(ranked, axis=-1)  # [..., W]
    mass_k = jnp.take_along_axis(running, jnp.clip(top_k, 1, width) - 1, axis=-1)
    before = jnp.concatenate([jnp.zeros_like(running[..., :1]), running[..., :-1]], axis=-1)
    keep_ranked = in_top_k & ((before < top_p * mass_k) | (top_p >= 1.0) | (rank == 0))  # a prefix of the ranks
    last = jnp.sum(keep_ranked, axis=-1, keepdims=True) - 1  # rank of the last kept token
    cut_prob = jnp.take_along_axis(ranked, last, axis=-1)
    cut_id = jnp.take_along_axis(order, last, axis=-1)
    ids = jnp.arange(v)
    # Token v ranks at or ahead of the last kept one: more probable, or as probable with a lower id.
    keep = (probs > cut_prob) | ((probs == cut_prob) & (ids <= cut_id))
    kept = jnp.where(keep, probs, 0.0)
    filtered = kept / jnp.sum(kept, axis=-1, keepdims=True)
    return jnp.where((top_k >= v) & (top_p >= 1.0), probs, filtered)


def target_probs(
    logits: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    *,
    filter_width: int | None = None,
) -> jax.Array:
    """The target's sampling distribution: ``softmax(logits / T)`` with top-k / top-p.

    Logits are read as :func:`~dspark_jax.sampling.greedy_step` reads them: a NaN counts as
    ``−inf``, and a row holding ``+inf`` entries spreads its mass evenly over them.

    Args:
      logits: ``[B, ..., V]``.
      temperatures: ``[B]`` (clamped below at ``1e-5``).
      top_k, top_p: ``[B]``.
      filter_width: static ranks examined (see :func:`required_filter_width`): ``0`` skips top-k /
        top-p entirely (the caller guarantees no row that matters restricts), ``None`` =
        ``V`` (exact for every row).

    Returns:
      ``[B, ..., V]`` float32.

    Raises:
      ValueError: ``logits`` is not ``[B, ..., V]``, a per-row input is not ``[B]``, or
        ``filter_width`` is not None or an integer in ``[0, V]`` (checked while tracing); with
        concrete values, a temperature that is negative, NaN or infinite, a ``top_k`` outside
        ``[1, TOP_K_MAX]`` or a ``top_p`` outside ``(0, 1]``.
      TypeError: ``top_k`` is not of an integer dtype, ``temperatures`` or ``top_p`` not of a
        floating one.
    """
    _check_per_row_inputs(logits, "[B, ..., V]", temperatures, top_k, top_p)
    _check_filter_width(filter_width, np.shape(logits)[-1])
    _check_filter_covers(filter_width, temperatures, top_k, top_p, np.shape(logits)[-1])
    return _target_probs(logits, temperatures, top_k, top_p, filter_width)


def _target_probs(logits, temperatures, top_k, top_p, filter_width: int | None) -> jax.Array:
    """:func:`target_probs` on checked inputs."""
    extra = logits.ndim - 2
    expand = (slice(None),) + (None,) * extra
    inverse_t = inverse_temperatures(clamp_temperatures(temperatures))[expand + (None,)]
    x = logits.astype(jnp.float32) * inverse_t  # logits / T
    # As greedy_step reads logits: NaN counts as −inf, and +inf entries win (here: share the mass).
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)
    x = jnp.where(jnp.max(x, axis=-1, keepdims=True) == jnp.inf, jnp.where(x == jnp.inf, 0.0, -jnp.inf), x)
    probs = jax.nn.softmax(x, axis=-1)
    if filter_width == 0:
        return probs
    rows = probs.shape[:-1]
    top_k, top_p = (jnp.broadcast_to(jnp.asarray(x)[expand], rows) for x in (top_k, top_p))
    return _top_k_top_p(probs, top_k, top_p, probs.shape[-1] if filter_width is None else filter_width)


def exponential_noise(key: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """``E ~ Exp(1)`` as ``-log U`` with ``U`` uniform on ``[tiny, 1)``: strictly positive, finite."""
    u = jax.random.uniform(key, shape, jnp.float32, minval=jnp.finfo(jnp.float32).tiny, maxval=1.0)
    return -jnp.log(u)


def race(probs: jax.Array, exponentials: jax.Array) -> jax.Array:
    """Exponential race ``argmax(probs / E)`` in log form: samples ``probs [..., V]``.

    Zero-probability tokens never win; ties go to the lowest id.
    """
    scores = jnp.where(probs > 0, jnp.log(jnp.maximum(probs, 1e-38)) - jnp.log(exponentials), -jnp.inf)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)


def sample_tokens(
    logits: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    key: jax.Array,
    *,
    filter_width: int | None = None,
) -> jax.Array:
    """Samples one token per row the way the target samples on its own.

    Args:
      logits: ``[B, V]`` float32.
      temperatures, top_k, top_p: ``[B]``; greedy rows (``sampling.greedy_rows``) take the argmax.
      key: a PRNG key.
      filter_width: static ranks examined for top-k / top-p (see :func:`required_filter_width`;
        ``None`` = ``V``).

    Returns:
      ``[B]`` int32.

    Raises:
      ValueError: ``logits`` is not ``[B, V]``, a per-row input is not ``[B]``, or
        ``filter_width`` is not None or an integer in ``[0, V]`` (checked while tracing: a
        ``[1]`` would otherwise spread over every row); with concrete values, a temperature
        that is negative, NaN or infinite, a ``top_k`` outside ``[1, TOP_K_MAX]`` or a
        ``top_p`` outside ``(0, 1]``.
      TypeError: ``top_k`` is not of an integer dtype, ``temperatures`` or ``top_p`` not of a
        floating one, or ``key`` is not one PRNG key.
    """
    if np.ndim(logits) != 2:
        raise ValueError(f"logits has shape {np.shape(logits)}: expected [B, V]")
    check_one_key(key)
    probs = target_probs(logits, temperatures, top_k, top_p, filter_width=filter_width)
    sampled = race(probs, exponential_noise(key, logits.shape))
    return jnp.where(greedy_rows(temperatures, top_k), greedy_step(logits), sampled)


def accept(
    target_logits: jax.Array,
    block: DraftBlock,
    *,
    top_k: jax.Array,
    top_p: jax.Array,
    verify_len: jax.Array | None = None,
    key: jax.Array,
    filter_width: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Accepts a prefix of each row's drafts and picks the bonus token. Jittable.

    A draft id outside ``[0, V)`` is rejected, with every draft after it; the bonus at its
    place comes from the target alone (see the module docstring).

    Args:
      target_logits: ``[B, T, V]`` float32 target logits of ``[bonus, d_1 … d_γ]``.
      block: the proposal (``draft_tokens [B, γ]``, ``corrected_logits [B, γ, V]`` or an
        empty ``[B, γ, 0]`` when every row is greedy, ``greedy_mask [B]``,
        ``temperatures [B]``).
      top_k, top_p: ``[B]`` the requests' target top-k / top-p.
      verify_len: ``[B]`` int, rows the target verified (anchor included), clamped into
        ``[1, γ+1]``; ``None`` = all ``γ + 1``.
      key: one PRNG key for the uniforms and the bonus draw.
      filter_width: static ranks examined for top-k / top-p (see :func:`required_filter_width`):
        ``0`` = no sampling row restricts (no sort), ``None`` = ``V`` (exact for any rows),
        else an integer in ``[1, V]``.

    Returns:
      ``(correct_len [B] int32 in [0, verify_len − 1], bonus [B] int32)``.

    Raises:
      ValueError: a shape does not match ``target_logits [B, γ + 1, V]``, or ``filter_width``
        is not None or an integer in ``[0, V]`` (checked while tracing); with concrete values,
        a ``block.temperatures`` entry that is negative, NaN or infinite, a ``top_k`` outside
        ``[1, TOP_K_MAX]`` or a ``top_p`` outside ``(0, 1]`` (greedy rows included).
      TypeError: ``key`` is not one PRNG key; ``draft_tokens``, ``top_k`` or ``verify_len`` is
        not of an integer dtype, ``temperatures`` or ``top_p`` not of a floating one.
    """
    b, t, v = _target_shape(target_logits)
    check_one_key(key)
    k_u, k_e = jax.random.split(key)
    uniforms = jax.random.uniform(k_u, (b, t - 1), jnp.float32)
    exponentials = exponential_noise(k_e, (b, v))
    return accept_with_noise(
        target_logits,
        block,
        top_k=top_k,
        top_p=top_p,
        verify_len=verify_len,
        uniforms=uniforms,
        exponentials=exponentials,
        filter_width=filter_width,
    )


def accept_with_noise(
    target_logits: jax.Array,
    block: DraftBlock,
    *,
    top_k: jax.Array,
    top_p: jax.Array,
    verify_len: jax.Array | None,
    uniforms: jax.Array,
    exponentials: jax.Array,
    filter_width: int | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`accept` with its randomness supplied: ``uniforms [B, γ]`` in ``[0, 1)`` and
    ``exponentials [B, V]`` Exp(1) noise for the bonus race (sampling rows only).

    Raises:
      ValueError: a shape does not match ``target_logits [B, γ + 1, V]``, or ``filter_width``
        is not None or an integer in ``[0, V]`` (checked while tracing, as every shape here is
        static); a concrete value out of range, as in :func:`accept`.
      TypeError: ``draft_tokens``, ``top_k`` or ``verify_len`` is not of an integer dtype,
        ``temperatures`` or ``top_p`` not of a floating one.
    """
    _check_accept_inputs(target_logits, block, top_k, top_p, verify_len, uniforms, exponentials, filter_width)
    block = block.replace(  # lists and NumPy arrays are fine too
        **{
            f.name: jnp.asarray(getattr(block, f.name))
            for f in dataclasses.fields(block)
            if getattr(block, f.name) is not None
        }
    )
    verify_len = None if verify_len is None else jnp.asarray(verify_len)
    b, t, v = target_logits.shape
    gamma = t - 1
    drafts = block.draft_tokens.astype(jnp.int32)  # [B, γ]
    cap = jnp.full((b,), gamma, jnp.int32) if verify_len is None else jnp.clip(verify_len.astype(jnp.int32), 1, t) - 1
    # No draft distribution yields an id outside [0, V): end the row's drafts there, like a verify cap.
    in_vocab = (drafts >= 0) & (drafts < v)
    cap = jnp.minimum(cap, _leading_true(in_vocab))
    rows = jnp.arange(b)

    pred = greedy_step(target_logits.reshape(b * t, v)).reshape(b, t)  # [B, T]
    greedy_len = jnp.minimum(_leading_true(drafts == pred[:, :gamma]), cap)
    greedy_bonus = pred[rows, greedy_len]
    if block.corrected_logits.shape[-1] == 0:  # greedy-only proposal: no q to sample against
        return greedy_len, greedy_bonus

    temps = clamp_temperatures(block.temperatures)
    p = _target_probs(target_logits, temps, top_k, top_p, filter_width)  # [B, T, V]
    # [B, γ, V]: corrected / T as the draft's race formed it
    q = jax.nn.softmax(block.corrected_logits.astype(jnp.float32) * inverse_temperatures(temps)[:, None, None], axis=-1)
    index = jnp.where(in_vocab, drafts, 0)[..., None]  # [B, γ, 1]; the cap rejects the slots it changes
    p_d = jnp.take_along_axis(p[:, :gamma], index, axis=-1)[..., 0]  # [B, γ]
    q_d = jnp.take_along_axis(q, index, axis=-1)[..., 0]
    sample_len = jnp.minimum(_leading_true(uniforms * q_d < p_d), cap)
    p_n = p[rows, sample_len]  # [B, V]
    q_n = q[rows, jnp.minimum(sample_len, gamma - 1)]
    residual = jnp.maximum(p_n - q_n, 0.0)
    mass = jnp.sum(residual, axis=-1, keepdims=True)
    rejected = (sample_len < cap)[:, None] & (mass > 0)
    dist = jnp.where(rejected, residual / jnp.where(mass > 0, mass, 1.0), p_n)
    sample_bonus = race(dist, exponentials)

    greedy = block.greedy_mask
    return jnp.where(greedy, greedy_len, sample_len), jnp.where(greedy, greedy_bonus, sample_bonus)


def _target_shape(target_logits: jax.Array) -> tuple[int, int, int]:
    """``(B, T, V)`` of ``target_logits``, which must be ``[B, γ + 1, V]`` with ``B, γ >= 1``."""
    shape = tuple(np.shape(target_logits))
    if len(shape) != 3 or shape[0] < 1 or shape[1] < 2:
        raise ValueError(f"target_logits has shape {shape}: expected [B, γ + 1, V] with B >= 1 and γ >= 1")
    return shape


def _check_accept_inputs(target_logits, block, top_k, top_p, verify_len, uniforms, exponentials, filter_width) -> None:
    """The checks of :func:`accept_with_noise`: shapes, dtypes and ``filter_width`` (static), then
    the concrete values (see there)."""
    b, t, v = _target_shape(target_logits)
    gamma = t - 1
    corrected = np.shape(block.corrected_logits)
    if corrected not in ((b, gamma, v), (b, gamma, 0)):
        raise ValueError(
            f"block.corrected_logits has shape {corrected}: expected [B, γ, V] = {(b, gamma, v)} like target_logits "
            f"[B, γ + 1, V] = {(b, t, v)}, or [B, γ, 0] for a greedy-only block"
        )
    expected = {
        "block.draft_tokens": (block.draft_tokens, (b, gamma)),
        "block.greedy_mask": (block.greedy_mask, (b,)),
        "block.temperatures": (block.temperatures, (b,)),
        "top_k": (top_k, (b,)),
        "top_p": (top_p, (b,)),
        "verify_len": (verify_len, (b,)),
        "uniforms": (uniforms, (b, gamma)),
        "exponentials": (exponentials, (b, v)),
    }
    _check_shapes(expected, "B, γ, V of target_logits")
    check_dtypes(
        {
            "block.draft_tokens": (block.draft_tokens, jnp.integer),
            "block.greedy_mask": (block.greedy_mask, jnp.bool_),
            "block.temperatures": (block.temperatures, jnp.floating),
            "top_k": (top_k, jnp.integer),
            "top_p": (top_p, jnp.floating),
            "verify_len": (verify_len, jnp.integer),
        }
    )
    _check_filter_width(filter_width, v)
    check_values(
        {"block.temperatures": (block.temperatures, _TEMPERATURES), "top_k": (top_k, _TOP_K), "top_p": (top_p, _TOP_P)}
    )
    _check_filter_covers(filter_width, block.temperatures, top_k, top_p, v)


def _check_per_row_inputs(logits, layout: str, temperatures, top_k, top_p) -> None:
    """``logits [B, ..., V]`` (at least 2-D) and the per-row ``[B]`` inputs, with their dtypes and
    (when concrete) values."""
    shape = tuple(np.shape(logits))
    if len(shape) < 2:
        raise ValueError(f"logits has shape {shape}: expected {layout}")
    _check_shapes(
        {"temperatures": (temperatures, shape[:1]), "top_k": (top_k, shape[:1]), "top_p": (top_p, shape[:1])},
        f"[B], one per row of logits {shape}",
    )
    check_dtypes(
        {"temperatures": (temperatures, jnp.floating), "top_k": (top_k, jnp.integer), "top_p": (top_p, jnp.floating)}
    )
    check_values({"temperatures": (temperatures, _TEMPERATURES), "top_k": (top_k, _TOP_K), "top_p": (top_p, _TOP_P)})


def _check_shapes(fields: dict[str, tuple[Any, tuple[int, ...]]], allowed: str) -> None:
    """ValueError for the first ``name: (value, shape)`` whose static shape differs (None skipped)."""
    for name, (value, shape) in fields.items():
        if value is not None and tuple(np.shape(value)) != shape:
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}: expected {shape} ({allowed})")


def _check_filter_covers(filter_width, temperatures, top_k, top_p, vocab: int) -> None:
    """With concrete rows, a ``filter_width`` must hold every sampling row's top-k (all ``V``
    ranks for a top-p row without one): fewer would sample a narrower law without a word."""
    rows = (temperatures, top_k, top_p)
    if filter_width is None or any(isinstance(x, jax.core.Tracer) for x in rows):
        return
    temperatures, top_k, top_p = (np.asarray(x) for x in rows)
    need = _ranks_read(temperatures, top_k, top_p, vocab)  # [B]
    if filter_width < need.max():
        row = int(np.argmax(need))
        why = f"top_k[{row}]={int(top_k[row])}" if top_k[row] < vocab else f"top_p[{row}]={float(top_p[row])}"
        raise ValueError(
            f"filter_width={filter_width!r} is too small for these rows: sampling row {row} ({why}) needs "
            f"{int(need[row])} ranks; use required_filter_width(temperatures, top_k, top_p, V) or None"
        )


def _check_filter_width(filter_width, vocab: int) -> None:
    """``filter_width`` must be static: None, or a Python (or NumPy) integer in ``[0, V]``."""
    if filter_width is not None and not (is_integer(filter_width) and 0 <= filter_width <= vocab):
        raise ValueError(
            f"filter_width={filter_width!r} is invalid: must be None (= V), 0 (no top-k / top-p) or an integer "
            f"in [1, V={vocab}], given statically (see required_filter_width)"
        )


def _leading_true(flags: jax.Array) -> jax.Array:
    """``[B, γ]`` bool → ``[B]`` int32 count of leading True values."""
    return jnp.sum(jnp.cumprod(flags.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _unsort(ranked: jax.Array, order: jax.Array) -> jax.Array:
    """Scatters ``ranked[..., r]`` back to token ``order[..., r]`` along the last axis."""
    inverse = jnp.argsort(order, axis=-1)
    return jnp.take_along_axis(ranked, inverse, axis=-1)


def schedule_verify_lengths(
    confidence: jax.Array, steps_per_second: jax.Array, *, widths: tuple[int, ...] | None = None
) -> jax.Array:
    """Confidence-scheduled verify lengths (``DSPARK_SPEC.md`` §5). Jittable.

    With survivals ``S[b, k] = Π_{j ≤ k} confidence[b, j]``, picks the global budget ``m``
    of drafts maximising ``(B + Σ top-m survivals) · steps_per_second[B + m]``, then gives
    each request the anchor plus its entries among the top ``m`` (a prefix, since
    survival never increases along a row; equal survivals go to the earlier slot).

    With ``widths`` (the uniform rule, for a dense target whose cost is its width times
    the batch whatever each row needs) every request verifies the same length: the ``w``
    of ``widths`` maximising ``(B + Σ_b Σ_{k < w − 1} S[b, k]) · steps_per_second[B·w]``
    (the anchor and ``w − 1`` drafts per row; ties go to the narrower width).

    Args:
      confidence: ``[B, γ]`` per-slot acceptance probabilities; traced values outside
        ``[0, 1]`` are clipped into it (NaN counts as 0), so survival never increases.
      steps_per_second: ``[N]`` measured decoding steps (whole rounds) per second when the
        batch verifies ``t`` tokens in total (anchors included), indexed by ``t``;
        ``N > B·(γ+1)``.
      widths: ``None`` (the per-request rule above) or the verify lengths the uniform
        rule chooses among: distinct integers in ``[1, γ+1]`` (static), e.g.
        :func:`~dspark_jax.generation.verify_widths`.

    Returns:
      ``verify_len [B]`` int32 in ``[1, γ+1]``.

    Raises:
      ValueError: ``confidence`` is not ``[B, γ]`` or (concrete) holds a value outside
        ``[0, 1]`` or NaN, ``steps_per_second`` not ``[N]`` with ``N > B·(γ+1)`` or (concrete)
        not finite, negative or all 0, ``widths``
        empty, repeated or outside ``[1, γ+1]``.
      TypeError: either array is not of a floating dtype; ``widths`` not a tuple of
        integers.
    """
    if np.ndim(confidence) != 2 or np.ndim(steps_per_second) != 1:
        raise ValueError(
            f"confidence has shape {np.shape(confidence)} and steps_per_second {np.shape(steps_per_second)}: "
            "expected [B, γ] and [N]"
        )
    check_dtypes({"confidence": (confidence, jnp.floating), "steps_per_second": (steps_per_second, jnp.floating)})
    b, gamma = np.shape(confidence)
    if np.shape(steps_per_second)[0] <= b * (gamma + 1):
        raise ValueError(
            f"steps_per_second has {np.shape(steps_per_second)[0]} entries: needs more than "
            f"B·(γ+1) = {b * (gamma + 1)} (indexed by tokens verified per step)"
        )
    check_values({"confidence": (confidence, _PROBABILITIES), "steps_per_second": (steps_per_second, _RATES)})
    if not isinstance(steps_per_second, jax.core.Tracer) and not np.asarray(steps_per_second).any():
        raise ValueError("steps_per_second is all 0: a measured table has at least one rate > 0")
    confidence = jnp.asarray(confidence, jnp.float32)
    steps_per_second = jnp.asarray(steps_per_second)  # lists and NumPy arrays too
    confidence = jnp.where(confidence > 0, jnp.minimum(confidence, 1.0), 0.0)  # traced: NaN and below 0 → 0
    if widths is not None:
        return _uniform_verify_length(confidence, steps_per_second, _check_widths(widths, gamma))
    survival = jnp.cumprod(confidence, axis=-1).reshape(-1)  # [B·γ]
    order = jnp.argsort(-survival, stable=True)
    gain = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(survival[order])])  # [B·γ + 1]
    budget = jnp.arange(b * gamma + 1)
    value = (b + gain) * steps_per_second[b + budget].astype(jnp.float32)
    best = jnp.argmax(value)
    chosen = _unsort(budget[1:] <= best, order).reshape(b, gamma)
    return (1 + jnp.sum(chosen, axis=-1)).astype(jnp.int32)


def _check_widths(widths: Any, gamma: int) -> tuple[int, ...]:
    """``widths`` as a tuple of distinct ints in ``[1, γ+1]``, or a named error."""
    if not isinstance(widths, tuple) or not widths or not all(is_integer(w) for w in widths):
        raise TypeError(f"widths={widths!r} is invalid: expected a non-empty tuple of integers (verify lengths)")
    if len(set(widths)) != len(widths) or not all(1 <= w <= gamma + 1 for w in widths):
        raise ValueError(f"widths={widths!r} is invalid: expected distinct integers in [1, γ+1] = [1, {gamma + 1}]")
    return tuple(sorted(int(w) for w in widths))


def _uniform_verify_length(confidence: jax.Array, steps_per_second: jax.Array, widths: tuple[int, ...]) -> jax.Array:
    """The uniform rule of :func:`schedule_verify_lengths`: one length for every row."""
    b, gamma = confidence.shape
    survival = jnp.cumprod(confidence, axis=-1)  # [B, γ]
    # gain[j] = Σ_b Σ_{k < j} S[b, k]: the expected accepted drafts when each row verifies j of them.
    gain = jnp.concatenate([jnp.zeros((1,), jnp.float32), jnp.cumsum(jnp.sum(survival, axis=0))])  # [γ + 1]
    w = jnp.asarray(widths, jnp.int32)  # [W] ascending
    value = (b + gain[w - 1]) * steps_per_second[b * w].astype(jnp.float32)  # [W]
    return jnp.full((b,), w[jnp.argmax(value)], jnp.int32)  # argmax: the first (narrowest) of equals
