"""The draft's token picker: greedy argmax or the exponential race, float32.

Shape legend: B batch rows, V vocabulary.

A row is greedy when its ``top_k <= 1`` or its temperature is 0; otherwise it samples
from ``q = softmax(logits / T)`` (``T`` clamped below at :data:`MIN_TEMPERATURE`; top-k is
never applied to the draft, ``DSPARK_SPEC.md`` §3).

Sampling is the exponential race: with ``E_v ~ Exp(1)`` i.i.d., the token
``argmax_v q_v / E_v`` is distributed as ``q``. We compute it in log form,
``argmax_v (logits_v / T - log E_v)``: for ``q_v > 0`` and ``E_v > 0``, ``log`` is strictly
increasing and ``log q_v = logits_v / T - logsumexp(logits / T)`` differs from
``logits_v / T`` by a per-row constant, so both forms pick the same token in exact
arithmetic, and the log form needs no softmax pass over ``V`` and cannot overflow
``exp``. ``-log E`` is a standard Gumbel variable, so this is also the Gumbel-max trick.

Noise generator (:func:`log_exponential_noise`): a row's key is the two 32-bit words
``(k0, k1) = key_data(key)`` of its (Threefry-2x32, JAX's default) step key, used as the key of
Philox-4x32-10 (Salmon et al., SC 2011; :func:`philox4x32`). With ``Q = ⌈V / 4⌉``, the
tokens ``i``, ``i + Q``, ``i + 2Q`` and ``i + 3Q`` (``i < Q``) share one Philox block:
``(w0, w1, w2, w3) = philox4x32((k0, k1), (i, 0, 0, 0))`` gives token ``i + l·Q`` the word
``w_l`` (words of tokens ``≥ V`` are dropped). One hash per four tokens, with less integer
work per token than the 20-round Threefry-2x32 block per two tokens this module used before
(on the H200 the fused race step of an all-sampling batch of 128 rows took 12–13 µs less,
README note 46). Philox-4x32-10 is a counter-based generator that passes TestU01's BigCrush
(Salmon et al.), the one cuRAND and PyTorch use on GPUs, and is meant to have every word of
every block used, so the four words are as independent as words of different blocks. Its
32 × 32 → 64-bit products are computed exactly in 32-bit arithmetic here (XLA has no such
product without 64-bit types); the GPU kernel (:mod:`dspark_jax.race_kernel`) uses the
hardware's ``mul.hi`` and computes the same words.

A word ``w`` becomes ``U = (⌊w / 2⁹⌋ + ½) · 2⁻²³``: its top 23 bits pick one of ``2²³``
equal cells of ``(0, 1)`` and ``U`` is the cell's midpoint, computed exactly in float32 as
``((w >> 8) | 1) · 2⁻²⁴``. So ``U ∈ [2⁻²⁴, 1 − 2⁻²⁴]``, ``E = −log U ∈ [6e-8, 16.7]`` is
strictly positive and finite, and the noise is ``log E = log(−log U)``. No token wins by
a zero draw (``jax.random.exponential`` can return exactly 0, which at ``V = 151936``
happens in about 2 % of rows per step and would pick a uniformly random token).

:func:`sample_step` races the four tokens of each block side by side (all four words are
used at the same position, so a fused kernel hashes each block once) and reduces the block
winners with an argmax that breaks ties by token id.

Determinism rules: ties go to the lowest token id; NaN logits count as ``-inf``; a row
whose logits are all ``-inf`` yields token 0.

Randomness: the caller passes one key or one key per row (:func:`row_keys`); row ``b``
uses ``fold_in(key, b)`` for a single key, or its own key, and step ``k`` folds in ``k``
(:func:`step_keys`). A row's noise is a function of its step key and ``V`` only, so it
never depends on the other rows or on the batch size.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

TOP_K_ALL = 1 << 30
"""``top_k`` meaning "no top-k" (sample from the full distribution)."""

MIN_TEMPERATURE = 1e-5
"""Sampling temperatures are clamped below at this value."""

LANES = 4
"""Tokens per Philox-4x32 block: token ``i + l·Q`` takes word ``l`` of block ``i``."""

_PHILOX_M = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))  # round multipliers
_PHILOX_W = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))  # key increments (Weyl sequence)
PHILOX_ROUNDS = 10

_KEY_HELP = (
    "one PRNG key (a typed jax.random.key(...) scalar or a raw uint32[{n}] jax.random.PRNGKey) "
    "or one key per row (typed [B] or raw uint32[B, {n}])"
)


@functools.cache
def _default_key_dtype():
    """The dtype of typed keys of the default PRNG implementation (``key<fry>`` for threefry)."""
    return jax.random.key(0).dtype


@functools.cache
def _raw_key_size() -> int:
    """Length of a raw key of the default PRNG implementation (2 for threefry)."""
    return int(jax.random.key_data(jax.random.key(0)).shape[-1])


def key_rows(key, batch: int) -> bool:
    """Checks ``key``'s type and shape; returns True for per-row keys, False for one key.

    Only static properties (dtype, shape) are read, so this works on tracers.

    Args:
      key: one typed key ``[]``, one raw key ``uint32[n]``, typed keys ``[B]`` or raw keys
        ``uint32[B, n]``.
      batch: ``B``.

    Raises:
      TypeError: ``key`` is not a PRNG key of an allowed shape.
    """
    n = _raw_key_size()
    allowed = _KEY_HELP.format(n=n)
    dtype = getattr(key, "dtype", None)
    shape = tuple(getattr(key, "shape", ()))
    if dtype is None:
        raise TypeError(f"key={key!r} has type {type(key).__name__}: expected {allowed}")
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if dtype != _default_key_dtype():  # a dtype comparison: unwrapping the key costs ~0.1 ms a call
            raise TypeError(
                f"key has PRNG implementation {jax.random.key_impl(key)}: expected the default one, {allowed}"
            )
        if shape == ():
            return False
        if shape == (batch,):
            return True
    elif dtype == np.uint32:
        if shape == (n,):
            return False
        if shape == (batch, n):
            return True
    else:
        raise TypeError(f"key has dtype {dtype}: expected {allowed}")
    raise TypeError(f"key has shape {shape} for batch {batch}: expected {allowed}")


def row_keys(key, batch: int) -> jax.Array:
    """Normalises ``key`` to typed per-row keys ``[B]``.

    One key gives row ``b`` the key ``fold_in(key, b)``, which does not depend on ``B``
    (so padding a batch never changes its real rows); per-row keys are used as they are.

    Args:
      key: see :func:`key_rows`.
      batch: ``B``.

    Returns:
      Typed keys ``[B]``.
    """
    per_row = key_rows(key, batch)
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if per_row:
        return key
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch, dtype=jnp.uint32))


def step_keys(keys: jax.Array, step: jax.Array | int) -> jax.Array:
    """Per-row keys ``[B]`` of walk step ``step`` (``fold_in(row_key, step)``)."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, jnp.asarray(step, jnp.uint32))


def greedy_rows(temperatures: jax.Array, top_k: jax.Array) -> jax.Array:
    """``[B]`` True for rows drafted greedily: ``top_k <= 1`` or temperature 0 (or below)."""
    return (jnp.asarray(top_k) <= 1) | (jnp.asarray(temperatures) <= 0)


def clamp_temperatures(temperatures: jax.Array) -> jax.Array:
    """``[B]`` float32 temperatures clamped below at :data:`MIN_TEMPERATURE`."""
    return jnp.maximum(jnp.asarray(temperatures, jnp.float32), MIN_TEMPERATURE)


def greedy_step(logits: jax.Array) -> jax.Array:
    """``argmax`` over ``[B, V]`` (NaN counts as ``-inf``; lowest id on ties) → ``[B]`` int32."""
    logits = logits.astype(jnp.float32)
    logits = jnp.where(jnp.isnan(logits), -jnp.inf, logits)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32)


def _key_words(keys: jax.Array) -> jax.Array:
    """``uint32 [B, 2]`` Threefry-2x32 key words of keys ``[B]`` (typed, or raw ``[B, 2]``).

    Raises:
      TypeError: the keys are not Threefry-2x32 keys.
    """
    if not jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key):
        keys = jax.random.wrap_key_data(keys)
    impl = str(jax.random.key_impl(keys))
    if impl != "threefry2x32":
        raise TypeError(f"key has PRNG implementation {impl}: the noise hashes threefry2x32 keys (JAX's default)")
    return jax.random.key_data(keys)


def mul_hi_lo(a: jax.Array, b: np.uint32) -> tuple[jax.Array, jax.Array]:
    """``(hi, lo)`` 32-bit words of the 64-bit product ``a · b`` (uint32), in 32-bit arithmetic.

    ``a = a₁·2¹⁶ + a₀`` and ``b = b₁·2¹⁶ + b₀``: the four 16 × 16-bit products fit in 32
    bits, and the middle column's carries are added exactly; ``lo`` is the wrapped product.
    """
    mask, half = np.uint32(0xFFFF), np.uint32(16)
    a0, a1 = a & mask, a >> half
    b0, b1 = np.uint32(int(b) & 0xFFFF), np.uint32(int(b) >> 16)
    p00, p01, p10, p11 = a0 * b0, a0 * b1, a1 * b0, a1 * b1
    middle = (p00 >> half) + (p01 & mask) + (p10 & mask)  # < 3·2¹⁶
    return p11 + (p01 >> half) + (p10 >> half) + (middle >> half), a * np.uint32(b)


def _times(word: Any, multiplier: np.uint32, mul: Callable) -> tuple[Any, Any]:
    """``mul(word, multiplier)``, or ``(0, 0)`` for a word known to be zero (the int 0)."""
    return (0, 0) if _is_zero(word) else mul(word, multiplier)


def _is_zero(word: Any) -> bool:
    return isinstance(word, int) and word == 0


def _xor(*words: Any) -> Any:
    """``⊕`` of the words, skipping those known to be zero."""
    words = [w for w in words if not _is_zero(w)]
    return functools.reduce(lambda a, b: a ^ b, words) if words else 0


def philox4x32(
    k0: jax.Array,
    k1: jax.Array,
    counter: tuple[Any, Any, Any, Any],
    *,
    rounds: int = PHILOX_ROUNDS,
    mul: Callable[[jax.Array, np.uint32], tuple[jax.Array, jax.Array]] = mul_hi_lo,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Philox-4x32 (Salmon et al., SC 2011) with ``rounds`` rounds (10: Philox-4x32-10).

    A round: ``(h₀, l₀) = M₀·c₀``, ``(h₁, l₁) = M₁·c₂`` (64-bit products split into words),
    ``c ← (h₁ ⊕ c₁ ⊕ k₀, l₁, h₀ ⊕ c₃ ⊕ k₁, l₀)``, then ``k ← k + (W₀, W₁)`` mod 2³².

    Args:
      k0, k1: uint32 key words (scalars, or arrays broadcasting with the counter).
      counter: the four uint32 counter words: arrays broadcasting together, scalars, or the
        int 0 for a word known to be zero (its products and ``⊕`` are skipped, as a compiler
        folds them; the noise's counters are ``(i, 0, 0, 0)``).
      rounds: rounds (tests pass the known-answer vectors' counts).
      mul: ``mul(a, m) -> (hi, lo)`` of the product of uint32 ``a`` and constant ``m``
        (:func:`mul_hi_lo`; the GPU kernel passes the hardware's).

    Returns:
      The block's four output words, uint32, broadcast to one shape.
    """
    c0, c1, c2, c3 = (c if _is_zero(c) else jnp.asarray(c, jnp.uint32) for c in counter)
    for _ in range(rounds):
        hi0, lo0 = _times(c0, _PHILOX_M[0], mul)
        hi1, lo1 = _times(c2, _PHILOX_M[1], mul)
        c0, c1, c2, c3 = _xor(hi1, c1, k0), lo1, _xor(hi0, c3, k1), lo0
        k0, k1 = k0 + _PHILOX_W[0], k1 + _PHILOX_W[1]
    return tuple(jnp.broadcast_arrays(*(jnp.asarray(c, jnp.uint32) for c in (c0, c1, c2, c3))))


def _block_words(keys: jax.Array, quads: int) -> tuple[jax.Array, ...]:
    """Words of the Philox blocks ``i < Q``: word ``l`` of block ``i`` is token ``i + l·Q``'s.

    Args:
      keys: typed keys ``[B]``.
      quads: ``Q``.

    Returns:
      :data:`LANES` arrays ``uint32 [B, Q]``.
    """
    words = _key_words(keys)  # [B, 2]
    counts = jnp.arange(quads, dtype=jnp.uint32)[None, :]  # [1, Q]
    return philox4x32(words[:, :1], words[:, 1:], (counts, 0, 0, 0))  # broadcast to [B, Q]


def _uniform(words: jax.Array) -> jax.Array:
    """``U = (⌊w / 2⁹⌋ + ½) · 2⁻²³`` in float32, exactly: ``[2⁻²⁴, 1 − 2⁻²⁴]``, same shape as ``words``."""
    return ((words >> 8) | 1).astype(jnp.float32) * 2.0**-24  # an odd integer below 2^24: exact


def _log_exponential(words: jax.Array) -> jax.Array:
    """``log E`` with ``E = −log U`` (see :func:`_uniform`), float32, finite."""
    return jnp.log(-jnp.log(_uniform(words)))


def log_exponential_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """``log E`` for ``E ~ Exp(1)`` i.i.d., one ``[V]`` row per key (generator: module docstring).

    This materialises the noise (references, tests); :func:`sample_step` computes the same
    values inside its race, where each Philox block is hashed once.

    Args:
      keys: Threefry-2x32 keys ``[B]``, typed (or raw ``uint32 [B, 2]``).
      vocab: ``V``.

    Returns:
      ``[B, V]`` float32, finite.

    Raises:
      TypeError: the keys are not Threefry-2x32 keys.
    """
    quads = -(-vocab // LANES)
    words = _block_words(keys, quads)  # LANES × [B, Q]
    return _log_exponential(jnp.concatenate(words, axis=1)[:, :vocab])  # [B, V]


def _max_then_lowest_id(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Reduction step of an argmax: the larger score, or on equal scores the lower id."""
    (a_score, a_id), (b_score, b_id) = a, b
    take_a = (a_score > b_score) | ((a_score == b_score) & (a_id < b_id))
    return jnp.where(take_a, a_score, b_score), jnp.where(take_a, a_id, b_id)


def best_lane(lanes: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
    """Each block's winner: ``(best score, its lane)`` over the lanes' scores (no NaN), ties
    to the earlier lane (the lower token id); same shape as each lane, the lane int32."""
    best, lane = lanes[0], jnp.zeros(lanes[0].shape, jnp.int32)
    for index, scores in enumerate(lanes[1:], start=1):
        take = scores > best
        best, lane = jnp.where(take, scores, best), jnp.where(take, index, lane)
    return best, lane


def _argmax_of_lanes(lanes: tuple[jax.Array, ...]) -> jax.Array:
    """``argmax`` of ``concatenate(lanes, 1)`` ``[B, LANES·Q]`` (no NaN), lowest id on ties → ``[B]`` int32.

    The tokens of one block (``i + l·Q``) are decided first, side by side, so every word of
    a Philox block is read at the same position; then one pass reduces the block winners.
    """
    quads = lanes[0].shape[1]
    best, lane = best_lane(lanes)  # [B, Q]
    ids = jax.lax.broadcasted_iota(jnp.int32, best.shape, 1) + lane * quads  # [B, Q]
    init = (np.float32(-np.inf), np.int32(np.iinfo(np.int32).max))
    _, token = jax.lax.reduce((best, ids), init, _max_then_lowest_id, (1,))
    return token


def round_to(x: jax.Array, dtype: jnp.dtype) -> jax.Array:
    """Float32 ``x`` rounded to ``dtype``'s values, kept in float32, in a form XLA keeps.

    ``x.astype(dtype).astype(float32)`` is not enough inside a jitted program: XLA's
    ``SimplifyFPConversions`` pass (run by XLA:GPU when excess precision is allowed, its
    default) removes such an ``f32 → bf16 → f32`` pair, so the race would run on the
    unrounded logits while the acceptance test's ``q`` is computed from the rounded ones
    (the likely cause of the jitted XLA race picking about 1 % of tokens differently from
    the eager one on the H200 at the 8B vocabulary, README note 46). For formats with
    float32's exponent range (bfloat16, float32) ``jax.lax.reduce_precision`` rounds exactly
    as the conversion does and is never simplified away; other formats (float16: its
    subnormals, which ``reduce_precision`` flushes to zero) round through a real conversion
    behind an optimisation barrier.
    """
    info = jnp.finfo(dtype)
    if info.nexp == jnp.finfo(jnp.float32).nexp:
        return jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    return jax.lax.optimization_barrier(x.astype(dtype)).astype(jnp.float32)


def sample_step(
    logits: jax.Array,
    temperatures: jax.Array,
    greedy_mask: jax.Array,
    noise_keys: jax.Array,
    *,
    race_dtype: jnp.dtype | None = None,
) -> jax.Array:
    """Picks one token per row: greedy argmax or the exponential race.

    Args:
      logits: ``[B, V]`` step logits (cast to float32).
      temperatures: ``[B]`` sampling temperatures (clamped at :data:`MIN_TEMPERATURE`
        here; greedy rows never read them).
      greedy_mask: ``[B]`` bool, True for greedy rows (they never read the noise).
      noise_keys: this step's keys: typed ``[B]`` (see :func:`step_keys`), or any key
        form :func:`row_keys` accepts.
      race_dtype: the dtype the caller keeps the logits in for the acceptance test: sampling
        rows race on ``logits`` rounded to it (so ``q = softmax(kept / T)`` is exactly the law
        of their tokens); greedy rows take the argmax of ``logits`` as given. None: no
        rounding.

    Returns:
      ``[B]`` int32 token ids.
    """
    logits = logits.astype(jnp.float32)  # [B, V]
    batch, vocab = logits.shape
    quads = -(-vocab // LANES)
    t = clamp_temperatures(temperatures)[:, None]  # [B, 1]
    keys = row_keys(noise_keys, batch)
    # V not a multiple of 4: -inf columns complete the last block; they never beat a real token
    # (ties go to lower ids).
    logits = jnp.pad(logits, ((0, 0), (0, LANES * quads - vocab)), constant_values=-jnp.inf)  # [B, 4Q]
    kept = logits if race_dtype is None else round_to(logits, race_dtype)  # -inf stays -inf
    words = _block_words(keys, quads)  # LANES × [B, Q]

    def scores(lane: int) -> jax.Array:  # [B, Q]
        part = slice(lane * quads, (lane + 1) * quads)
        raced = kept[:, part] / t - _log_exponential(words[lane])
        picked = jnp.where(greedy_mask[:, None], logits[:, part], raced)
        # NaN (from NaN logits or inf / inf) counts as -inf, so an all -inf row picks token 0.
        return jnp.where(jnp.isnan(picked), -jnp.inf, picked)

    return _argmax_of_lanes(tuple(scores(lane) for lane in range(LANES)))
