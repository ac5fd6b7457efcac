"""A call's per-row inputs, packed: one ``[Bp, 6 + n]`` uint32 array per round.

Shape legend: B rows of a call, Bp its bucket, n the words of a raw PRNG key.

:class:`~dspark_jax.proposer.Proposer` sends a call's slots, bonus tokens, context lengths,
temperatures, top-k and keys to its compiled round as one array (one host-to-device copy, or
one in-graph packing of arrays already on the device) and unpacks it inside the round. The
columns: slot, bonus, prefix_len and top_k (the integer columns), the temperature's float32
bits, a per-row key flag (every row alike), then the row's raw key when keys are given per
row. Padded rows are zero: slot 0, bonus 0, prefix_len 0, greedy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt

# Column indices of the packed inputs.
SLOT_COL, BONUS_COL, PREFIX_COL, TOP_K_COL, TEMPERATURE_COL, PER_ROW_COL, KEY_COL = range(7)
INT_COLUMNS = ("slot", "bonus", "prefix_len", "top_k")  # the integer columns' names
CALL_ARGS = ("cache", "bonus", "prefix_lens", "temperatures", "top_k", "key", "slots")  # a Proposer call's arguments


def fold_row_keys(rows_data: jax.Array, per_row: jax.Array, key: jax.Array) -> jax.Array:
    """Raw per-row keys ``[Bp, n]``: the given rows' ones, or ``fold_in(key, b)`` of one typed key."""
    index = jnp.arange(rows_data.shape[0], dtype=jnp.uint32)
    folded = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, index)
    return jnp.where(per_row, rows_data, jax.random.key_data(folded))


def row_ints(packed: jax.Array, limits: tuple[int, ...]) -> jax.Array:
    """``[Bp, 4]`` int32 slot, bonus, prefix_len and top_k of the packed inputs, each clamped
    into ``[0, limit]``.

    ``Proposer`` checks a call's values on the host while the device runs (README note 58)
    and raises for any out of range, dropping the round; the clamp keeps such a round's reads
    inside the cache and the tables until then. Valid values pass unchanged.
    """
    return jnp.clip(packed[:, :TEMPERATURE_COL].astype(jnp.int32), 0, jnp.asarray(limits, jnp.int32))


def unpack(limits: tuple[int, ...], packed: jax.Array, key: jax.Array) -> dict[str, jax.Array]:
    """``[Bp, 6 + n]`` uint32 packed inputs and the call's typed key → the round's arrays.

    See the module docstring for the columns and :func:`row_ints` for ``limits``.
    """
    ints = row_ints(packed, limits)
    return {
        "slots": ints[:, SLOT_COL],
        "bonus": ints[:, BONUS_COL],
        "prefix_lens": ints[:, PREFIX_COL],
        "top_k": ints[:, TOP_K_COL],
        "temperatures": jax.lax.bitcast_convert_type(packed[:, TEMPERATURE_COL], jnp.float32),
        "keys": fold_row_keys(packed[:, KEY_COL:], packed[0, PER_ROW_COL] != 0, key),
    }


def host_inputs(
    bonus: npt.ArrayLike,
    prefix_lens: npt.ArrayLike,
    temperatures: npt.ArrayLike,
    top_k: npt.ArrayLike,
    slots: npt.ArrayLike | None,
) -> tuple[int, np.ndarray, np.ndarray]:
    """A call's per-row inputs as packed, unchecked (``Proposer._check`` checks them):
    ``(B, ints [B, 4], temperatures float32 [B])``, ``ints`` the int64 columns slot, bonus,
    prefix_len and top_k (a uint64 beyond int64 wraps negative, a float truncates: the
    checks refuse both).

    Raises:
      Exception: whatever NumPy raises for inputs of unequal or wrong shapes.
    """
    bonus = np.asarray(bonus)
    rows = bonus.shape[0]
    columns = (np.arange(rows) if slots is None else slots, bonus, prefix_lens, top_k)
    with np.errstate(over="ignore"):  # a float64 1e39 becomes inf, which the checks refuse
        temps = np.asarray(temperatures).astype(np.float32)
    return rows, np.stack(columns, axis=1, dtype=np.int64, casting="unsafe"), temps


def call_inputs(args: tuple[Any, ...]) -> tuple[int, np.ndarray, np.ndarray]:
    """:func:`host_inputs` of a call's ``(cache, bonus, prefix_lens, temperatures, top_k, key, slots)``."""
    _, bonus, prefix_lens, temperatures, top_k, _, slots = args
    return host_inputs(bonus, prefix_lens, temperatures, top_k, slots)


def pack_on_host(bucket: int, width: int, ints: np.ndarray, temps: np.ndarray, row_keys: Any) -> np.ndarray:
    """A call's per-row inputs padded to ``bucket`` rows and packed on the host.

    Args:
      bucket: ``Bp``.
      width: ``6 + n``.
      ints: ``[B, 4]`` slot, bonus, prefix_len, top_k (:func:`host_inputs`; values outside
        ``[0, 2³²)`` wrap).
      temps: ``[B]`` float32 temperatures.
      row_keys: per-row keys (typed ``[B]`` or raw ``[B, n]``), or None for one key.

    Returns:
      ``[Bp, width]`` uint32 (see the module docstring for the columns).
    """
    rows = len(ints)
    packed = np.zeros((bucket, width), np.uint32)
    packed[:rows, :TEMPERATURE_COL] = ints
    packed[:rows, TEMPERATURE_COL] = temps.view(np.uint32)
    if row_keys is not None:
        packed[:, PER_ROW_COL] = 1
        packed[:rows, KEY_COL:] = np.asarray(key_data(row_keys), np.uint32)
    return packed


def pack_on_device(
    bucket: int,
    width: int,
    bonus: jax.Array,
    prefix_lens: jax.Array,
    temperatures: jax.Array,
    top_k: jax.Array,
    slots: jax.Array | None,
    row_keys: jax.Array | None,
) -> jax.Array:
    """The packed inputs of :func:`pack_on_host`, built on the device from arrays
    already there: ``[B]`` each (``slots`` None for ``0..B−1``; ``row_keys`` per-row keys,
    typed ``[B]`` or raw ``[B, n]``, or None) → ``[Bp, width]`` uint32, rows ``>= B`` zero
    (padding).

    Integers pass as their low 32 bits (what the host packing keeps of an int64), so the
    in-graph clamp (:func:`row_ints`) sees the same values; the host checks the inputs
    themselves (``Proposer._check``).
    """
    rows = bonus.shape[0]
    slots = jnp.arange(rows, dtype=jnp.uint32) if slots is None else slots
    columns = [x.astype(jnp.uint32) for x in (slots, bonus, prefix_lens, top_k)]
    columns.append(jax.lax.bitcast_convert_type(temperatures.astype(jnp.float32), jnp.uint32))
    packed = jnp.zeros((bucket, width), jnp.uint32).at[:rows, :PER_ROW_COL].set(jnp.stack(columns, axis=1))
    if row_keys is None:
        return packed
    packed = packed.at[:, PER_ROW_COL].set(1)
    return packed.at[:rows, KEY_COL:].set(key_data(row_keys).astype(jnp.uint32))


def key_data(keys: Any) -> Any:
    """Per-row keys' raw data ``[B, n]``: typed keys' words, raw data as given."""
    return jax.random.key_data(keys) if jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) else keys


def sampling_rows(top_k: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """``[B]`` True for the rows that sample: on the host, the complement of
    :func:`~dspark_jax.sampling.greedy_rows`."""
    return (top_k > 1) & (temperatures > 0)


def check_mode(sampling: bool, ints: np.ndarray, temps: np.ndarray) -> None:
    """Raises where ``sampling=False`` was given for rows that sample."""
    samples = sampling_rows(ints[:, TOP_K_COL], temps)
    if not sampling and samples.any():
        raise ValueError(
            f"sampling=False but rows {np.flatnonzero(samples).tolist()} sample (temperature > 0 and top_k > 1): "
            "pass sampling=True or None for such batches"
        )


def fetched(args: tuple[Any, ...]) -> tuple[Any, ...]:
    """A call's ``(cache, bonus, prefix_lens, temperatures, top_k, key, slots)`` with the
    per-row arrays on the host (NumPy; host values pass unchanged)."""
    cache, bonus, prefix_lens, temperatures, top_k, key, slots = args
    bonus, prefix_lens, temperatures, top_k, slots = jax.device_get((bonus, prefix_lens, temperatures, top_k, slots))
    return cache, bonus, prefix_lens, temperatures, top_k, key, slots
