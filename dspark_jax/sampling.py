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

Noise generator (:func:`log_exponential_noise`): a row's key is two 32-bit words
``(k0, k1) = key_data(key)`` of a Threefry-2x32 key. With ``P = ⌈V / 2⌉``, token ``i < P``
and token ``i + P`` share one 20-round Threefry-2x32 block: ``(w0, w1) =
threefry2x32((k0, k1), (i, i + P))`` gives token ``i`` the word ``w0`` and token ``i + P``
the word ``w1`` (for odd ``V`` the unused last ``w1`` is dropped). This is
``jax.extend.random.threefry_2x32(key, arange(2P))``: one hash per two tokens, half of what
``jax.random.uniform`` spends under ``jax_threefry_partitionable`` (one hash per element,
its two words XORed into one), and it does not depend on that flag. Threefry-2x32 with 20
rounds is a counter-based generator that passes TestU01's BigCrush with rounds to spare
(Salmon et al., SC 2011) and is meant to have every word of every block used, so ``w0``
and ``w1`` are as independent as words of different blocks.

A word ``w`` becomes ``U = (⌊w / 2⁹⌋ + ½) · 2⁻²³``: its top 23 bits pick one of ``2²³``
equal cells of ``(0, 1)`` and ``U`` is the cell's midpoint, computed exactly in float32 as
``((w >> 8) | 1) · 2⁻²⁴``. So ``U ∈ [2⁻²⁴, 1 − 2⁻²⁴]``, ``E = −log U ∈ [6e-8, 16.7]`` is
strictly positive and finite, and the noise is ``log E = log(−log U)``. No token wins by
a zero draw (``jax.random.exponential`` can return exactly 0, which at ``V = 151936``
happens in about 2 % of rows per step and would pick a uniformly random token).

:func:`sample_step` races the two tokens of each block side by side (both words are used
at the same position, so a fused kernel hashes each block once) and reduces the pair
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

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.random import threefry_2x32

TOP_K_ALL = 1 << 30
"""``top_k`` meaning "no top-k" (sample from the full distribution)."""

MIN_TEMPERATURE = 1e-5
"""Sampling temperatures are clamped below at this value."""

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


def _block_words(keys: jax.Array, pairs: int) -> tuple[jax.Array, jax.Array]:
    """Words of the Threefry blocks ``(i, i + P)``, ``i < P``: ``w0`` for tokens ``i``, ``w1`` for ``i + P``.

    Args:
      keys: typed keys ``[B]``.
      pairs: ``P``.

    Returns:
      ``(w0, w1)``, each ``uint32 [B, P]``.
    """
    counts = jnp.arange(2 * pairs, dtype=jnp.uint32)  # threefry_2x32 hashes (counts[i], counts[i + P])
    words = jax.vmap(lambda k: threefry_2x32((k[0], k[1]), counts))(_key_words(keys))  # [B, 2P]
    return words[:, :pairs], words[:, pairs:]


def _uniform(words: jax.Array) -> jax.Array:
    """``U = (⌊w / 2⁹⌋ + ½) · 2⁻²³`` in float32, exactly: ``[2⁻²⁴, 1 − 2⁻²⁴]``, same shape as ``words``."""
    return ((words >> 8) | 1).astype(jnp.float32) * 2.0**-24  # an odd integer below 2^24: exact


def _log_exponential(words: jax.Array) -> jax.Array:
    """``log E`` with ``E = −log U`` (see :func:`_uniform`), float32, finite."""
    return jnp.log(-jnp.log(_uniform(words)))


def log_exponential_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """``log E`` for ``E ~ Exp(1)`` i.i.d., one ``[V]`` row per key (generator: module docstring).

    This materialises the noise (references, tests); :func:`sample_step` computes the same
    values inside its race, where each Threefry block is hashed once.

    Args:
      keys: Threefry-2x32 keys ``[B]``, typed (or raw ``uint32 [B, 2]``).
      vocab: ``V``.

    Returns:
      ``[B, V]`` float32, finite.

    Raises:
      TypeError: the keys are not Threefry-2x32 keys.
    """
    pairs = (vocab + 1) // 2
    low, high = _block_words(keys, pairs)  # [B, P] each
    return _log_exponential(jnp.concatenate([low, high], axis=1)[:, :vocab])  # [B, V]


def _max_then_lowest_id(a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array]):
    """Reduction step of an argmax: the larger score, or on equal scores the lower id."""
    (a_score, a_id), (b_score, b_id) = a, b
    take_a = (a_score > b_score) | ((a_score == b_score) & (a_id < b_id))
    return jnp.where(take_a, a_score, b_score), jnp.where(take_a, a_id, b_id)


def _argmax_of_halves(low: jax.Array, high: jax.Array) -> jax.Array:
    """``argmax`` of ``concatenate([low, high], 1)`` ``[B, 2P]`` (no NaN), lowest id on ties → ``[B]`` int32.

    Pairs ``(i, i + P)`` are decided first, side by side, so both words of a Threefry
    block are read at the same position; then one pass reduces the pair winners.
    """
    pairs = low.shape[1]
    take_high = high > low  # [B, P]; a tie keeps the lower id, i
    best = jnp.where(take_high, high, low)
    ids = jax.lax.broadcasted_iota(jnp.int32, low.shape, 1) + jnp.where(take_high, pairs, 0)  # [B, P]
    init = (np.float32(-np.inf), np.int32(np.iinfo(np.int32).max))
    _, token = jax.lax.reduce((best, ids), init, _max_then_lowest_id, (1,))
    return token


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
    pairs = (vocab + 1) // 2
    t = clamp_temperatures(temperatures)[:, None]  # [B, 1]
    keys = row_keys(noise_keys, batch)
    # Odd V: a -inf column completes the last pair; it never beats a real token (ties go to lower ids).
    logits = jnp.pad(logits, ((0, 0), (0, 2 * pairs - vocab)), constant_values=-jnp.inf)  # [B, 2P]
    kept = logits if race_dtype is None else logits.astype(race_dtype).astype(jnp.float32)  # -inf stays -inf
    low_words, high_words = _block_words(keys, pairs)  # [B, P] each

    def scores(half, kept_half, words):  # [B, P]
        raced = kept_half / t - _log_exponential(words)
        picked = jnp.where(greedy_mask[:, None], half, raced)
        # NaN (from NaN logits or inf / inf) counts as -inf, so an all -inf row picks token 0.
        return jnp.where(jnp.isnan(picked), -jnp.inf, picked)

    low = scores(logits[:, :pairs], kept[:, :pairs], low_words)
    return _argmax_of_halves(low, scores(logits[:, pairs:], kept[:, pairs:], high_words))
