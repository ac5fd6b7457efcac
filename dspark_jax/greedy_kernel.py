"""The greedy-only Markov walk with each step's projection, bias and argmax in one Pallas (Triton) kernel.

Shape legend: B batch, BR padded rows (a power of two, at least 16), γ block slots,
V vocabulary, r Markov rank, T vocabulary tile, NT = ⌈V / T⌉ tiles.

A greedy step of the XLA walk (:func:`dspark_jax.markov.markov_walk` with
:func:`dspark_jax.sampling.greedy_step`) is a GEMM that writes the ``[B, V]`` bias
``z @ markov_w2ᵀ`` (rounded to the head's dtype), then a fusion that reads it back with
the step's base logits and takes the argmax of their float32 sum. :func:`greedy_tiles`
does both in one pass: program ``(i, j)`` multiplies row block ``i``'s latents by the table's
vocabulary tile ``j`` on the tensor cores (float32 accumulation, rounded to the head's dtype
as XLA's GEMM output is), adds the base logits and writes the tile's best float32 logit and
the lowest id holding it, so the bias never goes to memory (at batch 128 it was 39 MB
written and read per step). :func:`pick_tiles` then takes each row's token from its tiles
and gathers the next step's ``markov_w1`` row, in one program per row. On odd steps program
``(i, j)`` reads tile ``NT − 1 − j`` instead (:func:`walk_tile`): a step then starts on the
tiles the step before it read last, some of them still in L2 (README note 70).

Same maths as the XLA greedy step (NaN as ``-inf``, ties to the lowest id). The bias is a
sum over ``r`` whose float32 order may differ from the XLA GEMM's, so a bias can differ by
one unit of the head's dtype and a near-tie then go the other way; on the H200 the tokens
equalled the XLA walk's in every row measured (README note 49).

:func:`greedy_supported` says when the kernel applies (a 16-bit head dtype, ``r`` a power of
two of at least 16) and :func:`use_greedy_kernel` whether this trace uses it
(:data:`GREEDY_ENV`; by default on GPU backends only, up to :data:`GREEDY_AUTO_MAX_BATCH` rows).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _whole
from dspark_jax.config import check_flag
from dspark_jax.kernel_choice import (
    KERNEL_CHOICES,
    check_tile_layout,
    env_choice,
    kernel_mode,
    pow2_ceil,
    triton_params,
)
from dspark_jax.markov import MarkovHead, VanillaMarkovHead
from dspark_jax.sampling import NO_ID

GREEDY_ENV = "DSPARK_JAX_GREEDY"
"""Environment variable choosing the greedy-only walk's step: ``auto`` (default: the kernel
on GPUs when :func:`greedy_supported`), ``xla`` (never) or ``pallas`` (wherever supported,
the Pallas interpreter off GPUs)."""

GREEDY_CHOICES = KERNEL_CHOICES

_WARP_COUNTS = (1, 2, 4, 8, 16)
_MAX_ROWS = 128  # rows per program: a [128, T] float32 accumulator is the most that fits


@dataclasses.dataclass(frozen=True, kw_only=True)
class GreedyTuning:
    """How :func:`greedy_tiles` lays its work out on the GPU; the tokens do not depend on it.

    Attributes:
      tile: vocabulary tokens per program ``T``, a power of two >= 16.
      warps: warps per program; None picks 4 up to 64 rows per program and 8 above.
      stages: Triton pipeline stages of the loop over the rank.
      chunk: rank columns per step of that loop, a power of two >= 16 (at most ``r``).
      alternate: odd steps walk the table's tiles in reverse program order, so that a step
        starts on the tiles the step before it read last, which may still be in L2 (the
        table, 78 MB for the 8B draft, does not fit in it).
      prefetch: load the program's base logits before the loop over the rank, so that their
        load overlaps it, instead of after it; None does so up to 16 rows per program.

    The defaults are the fastest of the settings measured on the H200 (README notes 49, 70
    and 87: the walk alone with the 8B draft, device µs per walk, the base logits loaded after
    the loop against before it: batch 1 159.5 / 154.4, batch 4 167.9 / 155.8, batch 8 170.4 /
    158.5 and 171.5 / 160.7, batch 16 177.8 / 163.9; with 32 rows per program batch 32 184.2 /
    194.4 and 185.0 / 194.4, batch 64 223.4 / 231.5).
    """

    tile: int = 128
    warps: int | None = None
    stages: int = 3
    chunk: int = 64
    alternate: bool = True
    prefetch: bool | None = None

    def __post_init__(self):
        check_tile_layout(self, ("tile", "chunk"), _WARP_COUNTS, flags=("alternate",))
        # a bool or None, as ``alternate`` is a bool: ``1`` or ``0.0`` are refused, not read as flags
        check_flag("prefetch", self.prefetch, none_allowed=True)

    def warps_for(self, rows: int) -> int:
        """Warps per program for ``rows`` rows per program."""
        return self.warps if self.warps is not None else (4 if rows <= 64 else 8)

    def prefetch_for(self, rows: int) -> bool:
        """Whether a program of ``rows`` rows loads its base logits before the loop over the rank."""
        return self.prefetch if self.prefetch is not None else rows <= 16


GREEDY_TUNING = GreedyTuning()
"""The :class:`GreedyTuning` :func:`greedy_tiles` uses unless given one."""


def greedy_choice() -> str:
    """The value of :data:`GREEDY_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(GREEDY_ENV)


def greedy_supported(rank: int, dtype: jnp.dtype) -> bool:
    """True when the kernel applies: a 16-bit compute dtype (a float32 product would run on
    TF32 tensor cores, not as XLA's float32 GEMM) and ``r`` a power of two of at least 16."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return half and rank >= 16 and not rank & (rank - 1)


GREEDY_AUTO_MAX_BATCH = 64
"""The largest batch ``auto`` runs the kernels for. At batch 128 the split round was not faster
with them on the H200 (pipelined +0.03 to −0.09 ms, waited medians 0.14–0.19 ms slower in six
interleaved A/Bs, README notes 49 and 51: 80 µs less device time, but a tail of slow calls while
the caller holds the previous block), though the walk alone was; ``pallas`` forces them."""


def use_greedy_kernel(rank: int, dtype: jnp.dtype, batch: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`greedy_choice`
    (``auto``: up to :data:`GREEDY_AUTO_MAX_BATCH` rows)."""
    wanted = batch <= GREEDY_AUTO_MAX_BATCH or greedy_choice() == "pallas"
    return kernel_mode(GREEDY_ENV, greedy_supported(rank, dtype) and wanted)


def padded_rows(batch: int) -> int:
    """``BR``: ``batch`` rounded up to a power of two, at least 16 (the tensor cores' smallest tile)."""
    return max(16, pow2_ceil(batch))


def walk_tile(step: jax.Array, alternate: bool, j: jax.Array | None = None, count: int | None = None) -> jax.Array:
    """The vocabulary tile (or race block) that a walk kernel's program ``(i, j)`` reads at step
    ``step`` (a scalar read inside the kernel): ``j``, or ``NT − 1 − j`` on odd steps when
    ``alternate``, so that a step starts on the tiles the step before it read last, some of
    which are still in L2 (README note 70). ``j`` and ``NT`` (``count``) default to the
    program's index and count along the grid's second axis; a persistent program passes the
    ``j``-th of ``count`` tiles it is at."""
    j = pl.program_id(1) if j is None else j
    count = pl.num_programs(1) if count is None else count
    return jnp.where(step % 2 == 1, count - 1 - j, j) if alternate else j


def _tile_kernel(step_ref, z_ref, w2_ref, base_ref, top_ref, idx_ref, *, batch, rows, tile, chunk, alternate, prefetch):
    """Program ``(i, j)``: rows ``i·rows …`` against vocabulary tile :func:`walk_tile`, its base
    logits loaded before the loop over the rank when ``prefetch``, else after it.

    Refs: ``step`` ``[1]`` (an operand, so that the γ steps share one compiled kernel),
    ``z`` ``[BR, r]``, ``w2`` ``[V, r]``, ``base`` ``[B, γ, V]``; outputs ``top``, ``idx``
    ``[BR, NT]`` (this program writes its rows of its tile's column).
    """
    from jax.experimental.pallas import triton as plgpu

    vocab, rank = w2_ref.shape
    j = walk_tile(step_ref[0], alternate)
    first_row, start = pl.program_id(0) * rows, j * tile
    cols = start + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)  # [T]
    owned = cols < vocab
    tail = vocab % tile != 0
    row_ids = first_row + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0)
    valid = (row_ids < batch)[:, None] & owned[None, :]  # [rows, T]
    base_at = base_ref.at[pl.ds(first_row, rows), step_ref[0], pl.ds(start, tile)]
    base = plgpu.load(base_at, mask=valid, other=0) if prefetch else None  # [rows, T]

    def body(c, acc):
        at = pl.ds(c * chunk, chunk)
        z = z_ref[pl.ds(first_row, rows), at]  # [rows, chunk]
        if tail:
            w = plgpu.load(w2_ref.at[pl.ds(start, tile), at], mask=owned[:, None], other=0)
        else:
            w = w2_ref[pl.ds(start, tile), at]  # [T, chunk]
        return acc + jax.lax.dot_general(z, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)

    acc = jax.lax.fori_loop(0, rank // chunk, body, jnp.zeros((rows, tile), jnp.float32))
    bias = acc.astype(w2_ref.dtype).astype(jnp.float32)  # rounded as XLA's GEMM output is
    base = plgpu.load(base_at, mask=valid, other=0) if base is None else base
    x = base.astype(jnp.float32) + bias
    x = jnp.where(valid & ~jnp.isnan(x), x, -jnp.inf)
    top = x.max(axis=1)  # [rows]
    here = (pl.ds(first_row, rows), pl.ds(j, 1))
    top_ref[here] = top[:, None]
    idx_ref[here] = jnp.where(x == top[:, None], cols[None, :], NO_ID).min(axis=1)[:, None]


def _pick_kernel(top_ref, idx_ref, w1_ref, token_ref, e_ref, *, batch, span):
    """Program ``b``: row ``b``'s token from its tiles, and row ``token`` of ``markov_w1``
    (zeros for a padding row)."""
    from jax.experimental.pallas import triton as plgpu

    b = pl.program_id(0)
    tiles = top_ref.shape[1]
    column = jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
    real = column < tiles
    top = plgpu.load(top_ref.at[b, pl.ds(0, span)], mask=real, other=-jnp.inf)
    idx = plgpu.load(idx_ref.at[b, pl.ds(0, span)], mask=real, other=NO_ID)
    token = jnp.where(real & (top == top.max()), idx, NO_ID).min()
    token_ref[...] = jnp.full((1, 1), token, jnp.int32)
    row = w1_ref[jnp.minimum(token, w1_ref.shape[0] - 1), :]  # [r]
    e_ref[...] = jnp.where(b < batch, row, jnp.zeros_like(row))[None, :]


@functools.partial(jax.jit, static_argnames=("batch", "interpret", "tuning"))
def greedy_tiles(
    z: jax.Array,
    w2: jax.Array,
    base: jax.Array,
    step: jax.Array | int,
    *,
    batch: int,
    interpret: bool = False,
    tuning: GreedyTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Walk step ``step``'s best logit and token per vocabulary tile.

    Args:
      z: ``[BR, r]`` the rows' latents in the head's dtype (rows from ``batch`` on: ignored).
      w2: ``[V, r]`` the ``markov_w2`` table in the same dtype.
      base: ``[B, γ, V]`` base logits.
      step: ``k`` (int32 scalar, may be traced): the slot of ``base`` to read.
      batch: ``B``.
      interpret: run through the Pallas interpreter (any backend).
      tuning: the layout (None: :data:`GREEDY_TUNING`).

    Returns:
      ``(top [BR, NT] float32, idx [BR, NT] int32)``: per row and tile, the largest
      ``base[b, k, v] + bias[b, v]`` in float32 (NaN as ``-inf``) and the lowest ``v`` holding it.

    Raises:
      ValueError: shapes or dtypes that do not fit together.
    """
    tuning = GREEDY_TUNING if tuning is None else tuning
    if not isinstance(tuning, GreedyTuning):
        raise TypeError(f"tuning={tuning!r} is invalid: must be a GreedyTuning or None")
    total, rank = z.shape
    vocab = w2.shape[0]
    if base.ndim != 3 or base.shape[0] != batch or base.shape[2] != vocab:
        raise ValueError(f"base has shape {base.shape}: must be [B, γ, V] with B={batch}, V={vocab}")
    if total != padded_rows(batch) or w2.shape[1] != rank or z.dtype != w2.dtype:
        raise ValueError(
            f"z has shape {z.shape} and dtype {z.dtype}, w2 {w2.shape} {w2.dtype}: must be "
            f"[{padded_rows(batch)}, r] and [V, r] in one dtype"
        )
    if not greedy_supported(rank, w2.dtype):
        raise ValueError(f"rank={rank} and dtype={w2.dtype} are not supported: see greedy_supported")
    rows = min(total, _MAX_ROWS)
    chunk = min(tuning.chunk, rank)
    tiles = -(-vocab // tuning.tile)
    kernel = functools.partial(
        _tile_kernel,
        batch=batch,
        rows=rows,
        tile=tuning.tile,
        chunk=chunk,
        alternate=tuning.alternate,
        prefetch=tuning.prefetch_for(rows),
    )
    step = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
    return pl.pallas_call(
        kernel,
        grid=(total // rows, tiles),  # the row blocks of one tile run next to each other (L2)
        in_specs=[_whole(x.shape) for x in (step, z, w2, base)],
        out_specs=[_whole((total, tiles)), _whole((total, tiles))],
        out_shape=[
            jax.ShapeDtypeStruct((total, tiles), jnp.float32),
            jax.ShapeDtypeStruct((total, tiles), jnp.int32),
        ],
        interpret=interpret,
        name="dspark_greedy_tiles",
        **triton_params(tuning.warps_for(rows), tuning.stages, interpret),
    )(step, z, w2, base)


@functools.partial(jax.jit, static_argnames=("batch", "interpret"))
def pick_tiles(
    top: jax.Array, idx: jax.Array, w1: jax.Array, *, batch: int, interpret: bool = False
) -> tuple[jax.Array, jax.Array]:
    """Each row's token from :func:`greedy_tiles`' output, and its ``markov_w1`` row.

    Args:
      top, idx: ``[BR, NT]`` from :func:`greedy_tiles`.
      w1: ``[V, r]`` the ``markov_w1`` table.
      batch: ``B``.
      interpret: run through the Pallas interpreter.

    Returns:
      ``(tokens [BR] int32, e [BR, r])``: the argmax per row (padding rows: unspecified) and
      ``w1[tokens]`` in ``w1``'s dtype (zero rows from ``batch`` on).
    """
    total, tiles = top.shape
    rank = w1.shape[1]
    kernel = functools.partial(_pick_kernel, batch=batch, span=1 << (tiles - 1).bit_length())
    tokens, e = pl.pallas_call(
        kernel,
        grid=(total,),
        in_specs=[_whole(x.shape) for x in (top, idx, w1)],
        out_specs=[pl.BlockSpec((1, 1), lambda b: (b, 0)), pl.BlockSpec((1, rank), lambda b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct((total, 1), jnp.int32), jax.ShapeDtypeStruct((total, rank), w1.dtype)],
        interpret=interpret,
        name="dspark_greedy_pick",
        **triton_params(4, 1, interpret),
    )(top, idx, w1)
    return tokens[:, 0], e


def first_latent_rows(head: MarkovHead, bonus: jax.Array) -> jax.Array:
    """``[BR, r]``: the anchors' ``markov_w1`` rows (``prev`` of step 0), zero padding rows."""
    w1 = head.markov_w1[...]
    total = padded_rows(bonus.shape[0])
    return jnp.zeros((total, head.rank), w1.dtype).at[: bonus.shape[0]].set(jnp.take(w1, bonus, axis=0, mode="clip"))


def padded_latents(
    head: MarkovHead, state: jax.Array, e: jax.Array, hidden: jax.Array, batch: int
) -> tuple[jax.Array, jax.Array]:
    """A walk step's latents for the kernels: ``(z [BR, r] in the head's dtype, state [B, r])``.

    Args:
      head: the Markov head.
      state: ``[B, r]`` its recurrent state.
      e: ``[BR, r]`` the previous tokens' ``markov_w1`` rows (zero padding rows).
      hidden: ``[B, H]`` this slot's draft hidden states.
      batch: ``B``.
    """
    if isinstance(head, VanillaMarkovHead):  # z = e: the padded rows go in as they are
        return e.astype(head.dtype), state
    z, state = head.latent(state, e[:batch].astype(head.dtype), hidden)
    return jnp.zeros((e.shape[0], head.rank), head.dtype).at[:batch].set(z.astype(head.dtype)), state


def greedy_markov_walk(
    head: MarkovHead,
    base_logits: jax.Array,
    hidden: jax.Array,
    bonus: jax.Array,
    *,
    interpret: bool = False,
    tuning: GreedyTuning | None = None,
) -> jax.Array:
    """The greedy-only :func:`dspark_jax.markov.markov_walk`: two kernels per step, no ``[B, V]`` bias.

    Args:
      head: the Markov head (not ``None``); :func:`greedy_supported` must hold for its rank
        and dtype.
      base_logits: ``[B, γ, V]``.
      hidden: ``[B, γ, H]`` draft hidden states (the gated and RNN heads read them).
      bonus: ``[B]`` the anchor token (``prev`` of step 0).
      interpret: run the kernels through the Pallas interpreter.
      tuning: :func:`greedy_tiles`' layout.

    Returns:
      ``tokens [B, γ] int32``: the argmax of ``base + bias`` at every step, as the XLA walk
      with :func:`dspark_jax.sampling.greedy_step` picks them.
    """
    batch, gamma = base_logits.shape[:2]
    w1 = head.markov_w1[...]
    w2 = head.markov_w2[...].astype(head.dtype)  # as MarkovHead.project multiplies
    state = head.init_state(batch)
    e = first_latent_rows(head, bonus)
    tokens = []
    for k in range(gamma):
        z, state = padded_latents(head, state, e, hidden[:, k], batch)
        top, idx = greedy_tiles(z, w2, base_logits, k, batch=batch, interpret=interpret, tuning=tuning)
        token, e = pick_tiles(top, idx, w1, batch=batch, interpret=interpret)
        tokens.append(token[:batch])
    return jnp.stack(tokens, axis=1)
