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

``E = -log U`` with ``U`` uniform on ``[tiny, 1)``: ``E`` is strictly positive and finite,
so no token wins by a zero draw (``jax.random.exponential`` can return exactly 0, which
at ``V = 151936`` happens in about 2 % of rows per step and would pick a uniformly random
token).

Determinism rules: ties go to the lowest token id (``jnp.argmax`` returns the first
maximum); NaN logits count as ``-inf``; a row whose logits are all ``-inf`` yields
token 0.

Randomness: the caller passes one key or one key per row (:func:`row_keys`); row ``b``
uses ``fold_in(key, b)`` for a single key, or its own key, and step ``k`` folds in ``k``
(:func:`step_keys`), so a row's noise never depends on the other rows of the batch.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

TOP_K_ALL = 1 << 30
"""``top_k`` meaning "no top-k" (sample from the full distribution)."""

MIN_TEMPERATURE = 1e-5
"""Sampling temperatures are clamped below at this value."""

_KEY_HELP = (
    "one PRNG key (a typed jax.random.key(...) scalar or a raw uint32[{n}] jax.random.PRNGKey) "
    "or one key per row (typed [B] or raw uint32[B, {n}])"
)


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
        if jax.random.key_data(key).shape[-1] != n:
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


def log_exponential_noise(keys: jax.Array, vocab: int) -> jax.Array:
    """``log E`` for ``E ~ Exp(1)`` i.i.d., one ``[V]`` row per key.

    Args:
      keys: typed keys ``[B]``.
      vocab: ``V``.

    Returns:
      ``[B, V]`` float32, finite.
    """
    tiny = jnp.finfo(jnp.float32).tiny

    def one(key):
        u = jax.random.uniform(key, (vocab,), jnp.float32, minval=tiny, maxval=1.0)
        return jnp.log(-jnp.log(u))  # E = -log U > 0

    return jax.vmap(one)(keys)


def sample_step(
    logits: jax.Array,
    temperatures: jax.Array,
    greedy_mask: jax.Array,
    noise_keys: jax.Array,
) -> jax.Array:
    """Picks one token per row: greedy argmax or the exponential race.

    Args:
      logits: ``[B, V]`` step logits (cast to float32).
      temperatures: ``[B]`` sampling temperatures (clamped at :data:`MIN_TEMPERATURE`
        here; greedy rows never read them).
      greedy_mask: ``[B]`` bool, True for greedy rows (they never read the noise).
      noise_keys: this step's keys: typed ``[B]`` (see :func:`step_keys`), or any key
        form :func:`row_keys` accepts.

    Returns:
      ``[B]`` int32 token ids.
    """
    logits = logits.astype(jnp.float32)  # [B, V]
    t = clamp_temperatures(temperatures)[:, None]  # [B, 1]
    keys = row_keys(noise_keys, logits.shape[0])
    raced = logits / t - log_exponential_noise(keys, logits.shape[-1])  # [B, V]
    scores = jnp.where(greedy_mask[:, None], logits, raced)
    # NaN (from NaN logits or inf / inf) counts as -inf, so an all -inf row picks token 0.
    scores = jnp.where(jnp.isnan(scores), -jnp.inf, scores)
    return jnp.argmax(scores, axis=-1).astype(jnp.int32)
