"""The draft's token picker: greedy argmax or the exponential race, float32.

Shape legend: B batch rows, V vocabulary.

A row is greedy when its ``top_k <= 1`` or its temperature is not ``> 0``; otherwise it samples
from ``q = softmax(logits / T)`` (``T`` clamped below at :data:`MIN_TEMPERATURE`; top-k is
never applied to the draft, ``DSPARK_SPEC.md`` §3). In float32 ``logits / T`` is
``logits · RN(1/T)``, one rounded reciprocal per row then a product
(:func:`inverse_temperatures`), everywhere: the XLA sampler, the GPU kernels and the acceptance
test (XLA compiles a division by a broadcast temperature into that product itself; README note
92).

Sampling is the exponential race: with ``E_v ~ Exp(1)`` i.i.d., the token
``argmax_v q_v / E_v`` is distributed as ``q``. In log form, ``argmax_v (logits_v / T -
log E_v)``: ``log q_v`` differs from ``logits_v / T`` by a per-row constant, and ``-log E``
is a standard Gumbel variable (the Gumbel-max trick).

The race is run in two levels, which draw the same law from far fewer exponentials. Cut the
vocabulary into blocks ``S`` of :data:`RACE_BLOCK` tokens (the last one shorter; ``V ≤``
:data:`RACE_BLOCK` is one block). Over a block, ``min_{v∈S} E_v / q_v`` is exponential with
rate ``q_S = Σ_{v∈S} q_v``, and which token attains it is independent of its value and
distributed as ``q_v / q_S``. So draw one ``E_S ~ Exp(1)`` per block and let the block
``argmax_S (log q_S − log E_S)`` win (probability ``q_S``), then race the winning block's
tokens alone, ``argmax_{v∈S} (logits_v / T − log E_v)`` (probability ``q_v / q_S``): the
token has law ``q_v``, as in the flat race. Per row and step that is ``⌈V / W⌉ + W`` draws
instead of ``V`` (1315 instead of 151936 at the Qwen3 vocabulary), and the pass over ``V`` is
one ``exp`` per token (:func:`block_mass`) instead of a hash and two ``log``s; on the H200,
with blocks of 1024, the fused step of an all-sampling batch of 128 rows took 75 µs against
99 µs for the flat race (README note 47). Blocks are 128 tokens (README note 66; 1024 before): the vocabulary
tile of :mod:`dspark_jax.tile_race_kernel`, which forms each block's corrected logits and
races it in one pass, so a block must fit one program's tile.

``log q_S`` (up to the row's constant) is ``top + log(mass · 2⁻³⁰)`` with ``top`` the
block's largest ``logits / T`` and ``mass`` the integer sum of ``round(exp(x − top) · 2³⁰)``
(:func:`block_mass`): integer sums do not depend on the order of the additions, so the GPU
kernel (:mod:`dspark_jax.race_kernel`) and XLA compute bitwise the same block scores.

Noise generator: a row's key is the two 32-bit words ``(k0, k1) = key_data(key)`` of its
(Threefry-2x32, JAX's default) step key, used as the key of Philox-4x32-10 (Salmon et al.,
SC 2011; :func:`philox4x32`; cuRAND's and PyTorch's GPU generator, passes TestU01's
BigCrush). Token ``v`` draws from word 0 of block ``(v, 0, 0, 0)`` and race block ``j`` from
word 0 of block ``(j, 1, 0, 0)`` (:data:`TOKEN_NOISE`, :data:`BLOCK_NOISE`), so every draw
has its own counter. The 32 × 32 → 64-bit products are computed exactly in 32-bit
arithmetic (:func:`mul_hi_lo`; XLA has no such product without 64-bit types).

A word ``w`` becomes ``U = (⌊w / 2⁹⌋ + ½) · 2⁻²³``: its top 23 bits pick one of ``2²³``
equal cells of ``(0, 1)`` and ``U`` is the cell's midpoint, computed exactly in float32 as
``((w >> 8) | 1) · 2⁻²⁴``. So ``U ∈ [2⁻²⁴, 1 − 2⁻²⁴]``, ``E = −log U ∈ [6e-8, 16.7]`` is
strictly positive and finite, and the noise is ``log E = log(−log U)``. No token wins by
a zero draw (``jax.random.exponential`` can return exactly 0).

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

from dspark_jax.config import positive_int

TOP_K_ALL = 1 << 30
"""``top_k`` meaning "no top-k" (sample from the full distribution)."""

TOP_K_MAX = (1 << 31) - 1
"""The largest ``top_k`` the host-side checks accept: the round reads ``top_k`` as int32."""

MIN_TEMPERATURE = 1e-5
"""Sampling temperatures are clamped below at this value."""

RACE_BLOCK = 128
"""Tokens per block of the two-level race (the last block of a row may be shorter; a
vocabulary of at most this many tokens is one block)."""

MASS_SCALE = 2.0**30
"""A race block's mass counts ``exp(x − top)`` in units of ``2⁻³⁰`` (:func:`block_mass`)."""

_PHILOX_M = (np.uint32(0xD2511F53), np.uint32(0xCD9E8D57))  # round multipliers
_PHILOX_W = (np.uint32(0x9E3779B9), np.uint32(0xBB67AE85))  # key increments (Weyl sequence)
PHILOX_ROUNDS = 10

_ONE_KEY_HELP = "one PRNG key (a typed jax.random.key(...) scalar or a raw uint32[{n}] jax.random.PRNGKey)"
_KEY_HELP = _ONE_KEY_HELP + " or one key per row (typed [B] or raw uint32[B, {n}])"


@functools.cache
def _default_key_dtype():
    """The dtype of typed keys of the default PRNG implementation (``key<fry>`` for threefry)."""
    return jax.random.key(0).dtype


@functools.cache
def _raw_key_size() -> int:
    """Length of a raw key of the default PRNG implementation (2 for threefry)."""
    return int(jax.random.key_data(jax.random.key(0)).shape[-1])


def key_rows(key: jax.Array | np.ndarray, batch: int) -> bool:
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
    dtype, shape = _key_dtype_shape(key, allowed)
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


def check_one_key(key: jax.Array | np.ndarray) -> None:
    """Checks that ``key`` is one PRNG key, for the entry points that split one key themselves.

    Only static properties (dtype, shape) are read, so this works on tracers. A typed key
    may be of any PRNG implementation (``jax.random`` draws from all of them); a raw key is
    read as one of the default implementation.

    Args:
      key: one typed key ``[]`` or one raw key ``uint32[n]``.

    Raises:
      TypeError: ``key`` is not one PRNG key (a batch of keys included).
    """
    n = _raw_key_size()
    allowed = _ONE_KEY_HELP.format(n=n)
    dtype, shape = _key_dtype_shape(key, allowed)
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        if shape == ():
            return
    elif dtype == np.uint32:
        if shape == (n,):
            return
    else:
        raise TypeError(f"key has dtype {dtype}: expected {allowed}")
    raise TypeError(f"key has shape {shape}: expected {allowed}")


def _key_dtype_shape(key, allowed: str) -> tuple[Any, tuple[int, ...]]:
    """``key``'s static ``(dtype, shape)``; a TypeError naming ``key`` when it is no array at all."""
    dtype = getattr(key, "dtype", None)
    if dtype is None:
        raise TypeError(f"key={key!r} has type {type(key).__name__}: expected {allowed}")
    return dtype, tuple(getattr(key, "shape", ()))


def row_keys(key: jax.Array | np.ndarray, batch: int) -> jax.Array:
    """Normalises ``key`` to typed per-row keys ``[B]``.

    One key gives row ``b`` the key ``fold_in(key, b)``, which does not depend on ``B``
    (so padding a batch never changes its real rows); per-row keys are used as they are.

    Args:
      key: see :func:`key_rows`.
      batch: ``B``, a Python or NumPy integer ``>= 1`` (static).

    Returns:
      Typed keys ``[B]``.

    Raises:
      ValueError: ``batch`` is not an integer ``>= 1`` (a bool or a float included).
      TypeError: see :func:`key_rows`.
    """
    batch = positive_int("batch", batch)
    per_row = key_rows(key, batch)
    if not jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    if per_row:
        return key
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(batch, dtype=jnp.uint32))


def step_keys(keys: jax.Array, step: jax.Array | int) -> jax.Array:
    """Per-row keys ``[B]`` of walk step ``step`` (``fold_in(row_key, step)``)."""
    return jax.vmap(jax.random.fold_in, in_axes=(0, None))(keys, jnp.asarray(step, jnp.uint32))


def dtype_of(value: Any) -> np.dtype:
    """``value``'s dtype: an array's or a tracer's own, a host sequence's as NumPy reads it (for
    the static dtype checks of the jittable entry points)."""
    return np.dtype(value.dtype) if hasattr(value, "dtype") else np.asarray(value).dtype


_DTYPE_KINDS = {jnp.integer: "an integer dtype", jnp.floating: "a floating dtype", jnp.bool_: "bool"}


def check_dtypes(fields: dict[str, tuple[Any, type]]) -> None:
    """The static dtype checks of the jittable entry points (they work on tracers).

    Args:
      fields: ``name: (value, kind)``, ``kind`` one of ``jnp.integer``, ``jnp.floating`` and
        ``jnp.bool_``; None values are skipped.

    Raises:
      TypeError: for the first value whose dtype is not of its kind, naming it.
    """
    for name, (value, kind) in fields.items():
        if value is not None and not jnp.issubdtype(dtype_of(value), kind):
            raise TypeError(f"{name} has dtype {dtype_of(value)}: expected {_DTYPE_KINDS[kind]}")


def check_values(fields: dict[str, tuple[Any, tuple[Any, str]]]) -> None:
    """ValueError for the first ``name: (value, (valid, allowed))`` holding an entry ``valid``
    refuses, naming it (``top_k[3]=0``); None values are skipped.

    Only concrete values are read: a tracer (the library's compiled rounds) is skipped, as in
    ``Qwen3Target.__call__``, so nothing is added to a traced program.
    """
    for name, (value, (valid, allowed)) in fields.items():
        if value is None or isinstance(value, jax.core.Tracer):
            continue
        values = np.asarray(value)
        with np.errstate(over="ignore", invalid="ignore"):
            ok = valid(values)
        if not ok.all():
            index = np.unravel_index(int(np.argmin(ok)), values.shape)
            at = f"[{', '.join(str(i) for i in index)}]" if index else ""
            raise ValueError(f"{name}{at}={values[index]} is invalid: {allowed}")


def greedy_rows(temperatures: jax.Array, top_k: jax.Array) -> jax.Array:
    """``[B]`` True for rows drafted greedily: ``top_k <= 1`` or a temperature that is not
    ``> 0`` (0, below 0, or NaN).

    The host entry points refuse a negative or NaN temperature; the jittable ones do not check
    values, and there a NaN row takes the argmax rather than racing on ``x · (1/NaN)`` (every
    score NaN: token 0 in every slot).

    Raises:
      ValueError: ``temperatures`` and ``top_k`` are not ``[B]`` of one ``B`` (static).
    """
    if np.ndim(temperatures) != 1 or np.shape(top_k) != np.shape(temperatures):
        raise ValueError(
            f"temperatures has shape {tuple(np.shape(temperatures))} and top_k {tuple(np.shape(top_k))}: expected [B] "
            "each, one entry per row (a [1] or [B, 1] would broadcast over the rows)"
        )
    return (jnp.asarray(top_k) <= 1) | ~(jnp.asarray(temperatures) > 0)


def clamp_temperatures(temperatures: jax.Array) -> jax.Array:
    """``[B]`` float32 temperatures clamped below at :data:`MIN_TEMPERATURE`."""
    return jnp.maximum(jnp.asarray(temperatures, jnp.float32), MIN_TEMPERATURE)


def inverse_temperatures(temperatures: jax.Array) -> jax.Array:
    """``RN(1/T)`` in float32, ``temperatures``' shape (clamped ones): what logits are multiplied
    by wherever ``logits / T`` is formed (the samplers, the race kernels, the acceptance test's
    ``p`` and ``q``).

    XLA compiles ``x / T`` with ``T`` broadcast over the vocabulary as ``x · RN(1/T)`` (its
    algebraic simplifier: often one unit in the last place from ``RN(x / T)``, and ``inf`` a
    little below ``RN(x / T)``'s overflow threshold; README note 92). Writing the product out
    keeps every path on those same float32 values whatever XLA's passes do, and lets the GPU
    kernels multiply instead of divide.
    """
    return 1.0 / jnp.asarray(temperatures, jnp.float32)


def greedy_step(logits: jax.Array) -> jax.Array:
    """``argmax`` over ``[B, V]`` (NaN counts as ``-inf``; lowest id on ties) → ``[B]`` int32.

    Raises:
      ValueError: ``logits`` is not ``[B, V]`` with ``V >= 1`` (static).
      TypeError: ``logits`` is not of a floating dtype.
    """
    if np.ndim(logits) != 2 or np.shape(logits)[1] < 1:
        raise ValueError(f"logits has shape {tuple(np.shape(logits))}: expected [B, V] with V >= 1")
    check_dtypes({"logits": (logits, jnp.floating)})
    logits = jnp.asarray(logits).astype(jnp.float32)
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


def _uniform(words: jax.Array) -> jax.Array:
    """``U = (⌊w / 2⁹⌋ + ½) · 2⁻²³`` in float32, exactly: ``[2⁻²⁴, 1 − 2⁻²⁴]``, same shape as ``words``."""
    return ((words >> 8) | 1).astype(jnp.float32) * 2.0**-24  # an odd integer below 2^24: exact


def _log_exponential(words: jax.Array) -> jax.Array:
    """``log E`` with ``E = −log U`` (see :func:`_uniform`), float32, finite."""
    return jnp.log(-jnp.log(_uniform(words)))


TOKEN_NOISE = 0
"""Second counter word of the Philox blocks that give tokens their noise (see the module docstring)."""
BLOCK_NOISE = 1
"""Second counter word of the Philox blocks that give race blocks their noise."""


def _noise(words: jax.Array, counter: jax.Array, domain: int) -> jax.Array:
    """``log E`` from word 0 of Philox block ``(counter, domain, 0, 0)`` under each row's key.

    Args:
      words: ``uint32 [B, 2]`` the rows' key words (:func:`_key_words`).
      counter: uint32 ids broadcasting against ``[B, 1]`` (token or block ids).
      domain: :data:`TOKEN_NOISE` or :data:`BLOCK_NOISE`.

    Returns:
      float32, the broadcast shape of ``counter`` and ``[B, 1]``.
    """
    return _log_exponential(philox4x32(words[:, :1], words[:, 1:], (counter, domain, 0, 0))[0])


def log_exponential_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """Every token's ``log E`` (``E ~ Exp(1)`` i.i.d.), one ``[V]`` row per key.

    This materialises the tokens' noise (references, tests); :func:`sample_step` draws it only
    for the tokens of the block it races (module docstring).

    Args:
      keys: Threefry-2x32 keys ``[B]``, typed (or raw ``uint32 [B, 2]``).
      vocab: ``V``.

    Returns:
      ``[B, V]`` float32, finite.

    Raises:
      TypeError: the keys are not Threefry-2x32 keys.
    """
    return _noise(_key_words(keys), jnp.arange(vocab, dtype=jnp.uint32)[None], TOKEN_NOISE)


def log_exponential_block_noise(keys: jax.Array, blocks: int) -> jax.Array:
    """Every race block's ``log E``, ``[B, NB]`` float32 (as :func:`log_exponential_noise`, for blocks)."""
    return _noise(_key_words(keys), jnp.arange(blocks, dtype=jnp.uint32)[None], BLOCK_NOISE)


def _max_then_lowest_id(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Reduction step of an argmax: the larger score, or on equal scores the lower id."""
    (a_score, a_id), (b_score, b_id) = a, b
    take_a = (a_score > b_score) | ((a_score == b_score) & (a_id < b_id))
    return jnp.where(take_a, a_score, b_score), jnp.where(take_a, a_id, b_id)


NO_ID = np.int32(np.iinfo(np.int32).max)
"""An id larger than every token id: what a masked or empty place offers to a lowest-id minimum."""


def argmax_lowest(scores: jax.Array, ids: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(best score, its id)`` over the last axis of ``scores`` (no NaN), ties to the lowest id.

    Args:
      scores: float32 ``[..., N]``.
      ids: int32 ``[..., N]``, the ids of the scores.

    Returns:
      float32 and int32 arrays ``[...]``.
    """
    init = (np.float32(-np.inf), NO_ID)
    return jax.lax.reduce((scores, ids), init, _max_then_lowest_id, (scores.ndim - 1,))


def race_width(vocab: int) -> int:
    """``W``, the tokens per race block: :data:`RACE_BLOCK`, or ``V`` when smaller (one block)."""
    return min(RACE_BLOCK, vocab)


def block_mass(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """A race block's ``(top, mass)`` from its scores ``x = kept / T`` (NaN as ``-inf``).

    ``top = max x`` and ``mass = Σ round(exp(x − top) · 2³⁰)``, summed as integers (the high
    and low 15 bits of each term apart, so both int32 sums are exact for blocks of up to
    2¹⁶ − 1 tokens; at 2¹⁶ equal tokens the high sum reaches 2³¹ and wraps) and returned as
    ``f32(high) · 2¹⁵ + f32(low)`` in float32. That result is rounded, not the exact integer sum
    (relative error below 2⁻²³), but it is a fixed function of the two exact sums, so whatever
    order a kernel or XLA adds the terms in, the mass is the same number. ``exp(x − top) ≤ 1``
    and the top term is ``2³⁰``, so ``mass ≥ 2³⁰``; terms below ``2⁻³¹`` round to 0 (the
    integer rounding of the terms moves the mass by a relative ``< W · 2⁻³¹``).
    A block with ``top = ±inf`` gets ``mass = 0`` (see :func:`block_scores`).

    Args:
      x: float32 ``[..., W]``, no NaN.

    Returns:
      ``(top, mass)``, float32 ``[...]``.
    """
    top = x.max(-1)
    finite = jnp.isfinite(top)
    shift = jnp.where(finite, top, 0.0)[..., None]
    terms = jnp.where(finite[..., None], jnp.exp(x - shift), 0.0)  # [..., W] in [0, 1]
    n = (terms * MASS_SCALE + 0.5).astype(jnp.int32)  # ≤ 2³⁰: round to nearest integer
    high, low = (n >> 15).sum(-1), (n & 0x7FFF).sum(-1)
    return top, high.astype(jnp.float32) * 2.0**15 + low.astype(jnp.float32)


def block_log_mass(top: jax.Array, mass: jax.Array) -> jax.Array:
    """``log p_S = top + log(mass · 2⁻³⁰)`` of :func:`block_mass`'s ``(top, mass)`` (the race
    kernel calls it too, so both compute the same operations): ``+inf`` for a block holding
    a ``+inf`` score, ``-inf`` for an all ``-inf`` block (``-inf + log 0``)."""
    return jnp.where(top == jnp.inf, jnp.inf, top + jnp.log(mass * (1 / MASS_SCALE)))


def block_scores(top: jax.Array, mass: jax.Array, words: jax.Array) -> jax.Array:
    """The blocks' race: ``log p_S − log E_S`` with ``log p_S = top + log(mass · 2⁻³⁰)``.

    Args:
      top, mass: float32 ``[B, NB]`` from :func:`block_mass`.
      words: ``uint32 [B, 2]`` the rows' key words.

    Returns:
      float32 ``[B, NB]``: ``+inf`` for a block holding a ``+inf`` score, ``-inf`` for an all
      ``-inf`` block.
    """
    blocks = jnp.arange(top.shape[-1], dtype=jnp.uint32)[None]
    return block_log_mass(top, mass) - _noise(words, blocks, BLOCK_NOISE)


def _slice_rows(rows: jax.Array, start: jax.Array, width: int) -> jax.Array:
    """``rows[b, start[b] : start[b] + width]`` → ``[B, width]``."""
    return jax.vmap(lambda row, s: jax.lax.dynamic_slice(row, (s,), (width,)))(rows, start)


def race_blocks(
    top: jax.Array,
    mass: jax.Array,
    words: jax.Array,
    inverse_t: jax.Array,
    vocab: int,
    window: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """The two-level race's tokens from its blocks' ``(top, mass)``.

    Args:
      top, mass: float32 ``[B, NB]`` (:func:`block_mass` of each block's ``kept / T``).
      words: ``uint32 [B, 2]`` the rows' key words.
      inverse_t: ``[B, 1]`` :func:`inverse_temperatures` of the clamped temperatures.
      vocab: ``V``.
      window: ``window(start [B]) -> [B, W]``, the kept logits (float32) of tokens
        ``start … start + W − 1`` of each row.

    Returns:
      ``[B]`` int32 tokens.
    """
    width = race_width(vocab)
    ids = jax.lax.broadcasted_iota(jnp.int32, top.shape, 1)
    _, block = argmax_lowest(block_scores(top, mass, words), ids)  # [B]
    first = block * width
    start = jnp.minimum(first, vocab - width)  # the last block's window ends at V
    tokens = start[:, None] + jnp.arange(width, dtype=jnp.int32)  # [B, W]
    raced = window(start) * inverse_t - _noise(words, tokens.astype(jnp.uint32), TOKEN_NOISE)
    owned = tokens >= first[:, None]  # the last window's head belongs to the block before
    return argmax_lowest(jnp.where(owned & ~jnp.isnan(raced), raced, -jnp.inf), tokens)[1]


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
    """Picks one token per row: greedy argmax or the exponential race (in two levels).

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

    Raises:
      ValueError: ``logits`` is not ``[B, V]``, or ``temperatures`` or ``greedy_mask`` not ``[B]``
        (checked while tracing; a ``[1]`` would otherwise broadcast over the rows unnoticed).
      TypeError: ``greedy_mask`` is not bool (a float or integer array, temperatures passed by
        mistake say, would pick the greedy rows by being nonzero), or ``temperatures`` or
        ``logits`` not of a floating dtype (a bool ``True`` would be read as T = 1).
    """
    if np.ndim(logits) != 2 or np.shape(logits)[0] < 1 or np.shape(logits)[1] < 1:
        raise ValueError(f"logits has shape {np.shape(logits)}: expected [B, V] with B, V >= 1")
    for name, value in (("temperatures", temperatures), ("greedy_mask", greedy_mask)):
        if tuple(np.shape(value)) != np.shape(logits)[:1]:
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}: expected [B] = {np.shape(logits)[:1]}")
    check_dtypes(
        {
            "greedy_mask": (greedy_mask, jnp.bool_),
            "temperatures": (temperatures, jnp.floating),
            "logits": (logits, jnp.floating),
        }
    )
    logits = logits.astype(jnp.float32)  # [B, V]
    batch, vocab = logits.shape
    width = race_width(vocab)
    blocks = -(-vocab // width)
    inverse_t = inverse_temperatures(clamp_temperatures(temperatures))[:, None]  # [B, 1]
    words = _key_words(row_keys(noise_keys, batch))  # [B, 2]
    if race_dtype is not None:
        try:
            floating = jnp.issubdtype(jnp.dtype(race_dtype), jnp.floating)
        except TypeError:
            floating = False
        if not floating:
            raise TypeError(f"race_dtype={race_dtype!r} is invalid: must be a floating dtype or None")
    kept = logits if race_dtype is None else round_to(logits, race_dtype)  # -inf stays -inf
    x = kept * inverse_t  # logits / T
    x = jnp.where(jnp.isnan(x), -jnp.inf, x)  # NaN (NaN logits; inf · 0 if 1/T flushed to 0) counts as -inf
    x = jnp.pad(x, ((0, 0), (0, blocks * width - vocab)), constant_values=-jnp.inf)  # the last block's tail
    top, mass = block_mass(x.reshape(batch, blocks, width))  # [B, NB]
    sampled = race_blocks(top, mass, words, inverse_t, vocab, lambda start: _slice_rows(kept, start, width))
    return jnp.where(greedy_mask, greedy_step(logits), sampled)
