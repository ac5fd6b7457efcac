"""The folded Markov walk with each step's projection, corrected logits and block race in one
Pallas (Triton) kernel on GPUs.

Shape legend: B batch, BR padded rows (:func:`~dspark_jax.greedy_kernel.padded_rows`), γ block
slots, V vocabulary, r Markov rank, W tokens per race block
(:func:`~dspark_jax.sampling.race_width`), NB = ⌈V / W⌉ blocks per row.

A step of the folded walk (:func:`dspark_jax.markov.markov_walk` with
:func:`dspark_jax.sampling.sample_step`) forms the ``[B, V]`` bias ``z @ markov_w2ᵀ`` (rounded
to the head's dtype), adds the step's base logits in float32, keeps the sum in the base
logits' dtype as slot ``k`` of the ``[B, γ, V]`` corrected logits, and picks each row's token:
a greedy row the argmax of the float32 sum, a sampling row by the two-level race on the kept
values (:func:`dspark_jax.sampling.race_blocks`). The race kernel
(:mod:`dspark_jax.race_kernel`) takes the bias from an XLA GEMM, which writes it to memory and
reads it back. Here the vocabulary tile of the kernel is the race block, so one pass does it
all, as :mod:`dspark_jax.greedy_kernel` does for greedy-only rounds: program ``(i, j)``
multiplies row block ``i``'s latents by block ``j`` of the table (``NB − 1 − j`` on odd steps,
:func:`~dspark_jax.greedy_kernel.walk_tile`) on the tensor cores, adds the
base logits, writes the kept sums into slot ``k`` (the buffer is aliased from step to step),
and writes, per row, the block's best float32 logit and lowest id holding it (a greedy row) or
the block's score in the blocks' race and the block's index (a sampling row:
:func:`~dspark_jax.sampling.block_scores` of :func:`~dspark_jax.sampling.block_mass` of
``kept / T``). :func:`pick_raced_tiles`, one program per row, picks the token (the best block's
token, or the race of the best block's ``W`` tokens, read back from the corrected logits) and
gathers the next step's ``markov_w1`` row. Two kernels per step; the bias never goes to memory.
At most batches (:data:`TILE_RACE_PROGRAMS`) fewer, persistent programs each take every
``P``-th race block in one pipelined loop, so that a block's loads overlap the block before
it's race (README note 86), and keep each row's best ``(score, token or block)`` over their
blocks, so that they write one column each, not one per block (README note 87).

Same maths as the XLA sampler, operation for operation (the race kernel's helpers: Philox with
the hardware's ``mul.hi``/``mul.lo``; ``kept / T`` as the product with
:func:`~dspark_jax.sampling.inverse_temperatures`, computed by XLA before the kernels, README
note 92); the bias is a sum over ``r`` whose float32 order may differ from the XLA GEMM's, so,
as with the greedy kernels, a bias can differ by one unit of the head's dtype, and the corrected
logits with it (the tokens are raced on the corrected logits the round returns, so verification
stays exact).

:func:`tile_race_supported` says when the kernel applies and :func:`use_tile_race_kernel`
whether this trace uses it (:data:`TILE_RACE_ENV`; by default on GPU backends only, up to
:data:`TILE_RACE_AUTO_BATCHES`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _whole
from dspark_jax.greedy_kernel import first_latent_rows, greedy_supported, padded_latents, padded_rows, walk_tile
from dspark_jax.kernel_choice import KERNEL_CHOICES, check_tile_layout, env_choice, kernel_mode, triton_params
from dspark_jax.markov import MarkovHead
from dspark_jax.race_kernel import _noise, race_supported, step_key_words
from dspark_jax.sampling import (
    BLOCK_NOISE,
    NO_ID,
    TOKEN_NOISE,
    block_log_mass,
    block_mass,
    inverse_temperatures,
    race_width,
)

TILE_RACE_ENV = "DSPARK_JAX_TILE_RACE"
"""Environment variable choosing the folded walk's step: ``auto`` (default: these kernels on GPUs
when :func:`tile_race_supported`, at :data:`TILE_RACE_AUTO_BATCHES`), ``xla`` (never:
the race kernel or the XLA sampler, as :data:`dspark_jax.race_kernel.RACE_ENV` says) or
``pallas`` (wherever supported, at any batch; the Pallas interpreter off GPUs)."""

TILE_RACE_CHOICES = KERNEL_CHOICES

_WARP_COUNTS = (1, 2, 4, 8, 16)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TileRaceTuning:
    """How :func:`race_tiles` lays its work out on the GPU; the tokens do not depend on it.

    Attributes:
      max_rows: rows per program at most, a power of two >= 16 (more rows are split into
        row blocks, whose programs for one vocabulary block run next to each other).
      warps: warps per program; None picks 4 up to 32 rows per program and 8 above.
      stages: Triton pipeline stages of the loop over the rank.
      chunk: rank columns per step of that loop, a power of two >= 16 (at most ``r``).
      alternate: odd steps walk the race blocks in reverse program order, so that a step
        starts on the part of the table the step before it read last, which may still be in
        L2 (README note 70; the blocks' outputs keep their places).
      programs: 0 for one program per race block; ``P > 0`` for ``min(P, NB)`` persistent
        programs per row block, program ``p`` taking race blocks ``p, p + P, …`` in one
        pipelined loop and writing its rows' best over them (README notes 86 and 87; at batch
        1 the one row is finished alone either way, README note 77).

    The defaults, measured on the H200 with the 8B draft (README notes 66 and 67; the walk
    alone, µs per step, pipelined): at batch 32 one row block of 32 rows at 4 warps, sampling
    rows 41.4, against 45.7 for two of 16 and 46.1 at 8 warps; stages 2 (45.0) or 4 with
    chunks of 32 (46.3), chunks of 128 (42.0) and 8 warps (41.6) no faster (note 67: 41.5).
    At batch 64, two row blocks of 32 at 4 warps against one of 64 at 8 (all-greedy rows /
    mixed / sampling): 51.1 / 52.5 / 56.1 against 50.8 / 66.5 / 61.0 (64 rows at 4 warps:
    50.2 / 75.4 / 70.8; the mixed batch's first 32 rows sample, so there each block of 32 runs
    one part). At batch 128 (where ``auto`` runs the race kernel) 64 rows at 8 warps
    105.6 against 117.6 at 4, 32 rows at 4 warps 101.5.
    """

    max_rows: int = 32
    warps: int | None = None
    stages: int = 3
    chunk: int = 64
    alternate: bool = True
    programs: int = 0

    def __post_init__(self):
        check_tile_layout(self, ("max_rows", "chunk"), _WARP_COUNTS, flags=("alternate",))
        if isinstance(self.programs, bool) or not isinstance(self.programs, int) or self.programs < 0:
            raise ValueError(f"programs={self.programs!r} is invalid: must be an integer >= 0")

    def warps_for(self, rows: int) -> int:
        """Warps per program for ``rows`` rows per program."""
        return self.warps if self.warps is not None else (4 if rows <= 32 else 8)


TILE_RACE_TUNING = TileRaceTuning()
"""The layout :func:`race_tiles` starts from unless given one (:func:`tile_race_tuning` sets its
``programs`` by batch)."""

TILE_RACE_PROGRAMS = ((1, 396), (16, 594), (32, 396), (64, 264))
"""``(largest batch, programs)``: the persistent programs per row block :func:`tile_race_tuning`
picks (0, one program per race block, beyond the last pair). Measured on the H200 (132 SMs)
with the 8B draft, the walk alone, device µs per walk (all-greedy rows / mixed / sampling),
one program per race block first. Note 86 (each block's outputs stored): batch 2 188.0 / 220.0
/ 213.8, 594 programs 160.8 / 203.8 / 200.9; batch 4 190.6 / 224.2 / 215.8, 594 programs 163.6
/ 207.8 / 201.9; batch 8 195.4 / 211.5 / 205.6, 594 programs 168.9 / 197.4 / 186.2; batch 32
228.3 / 277.4 / 260.6, 396 programs 218.9 / 274.3 / 256.2 (264, 528, 792 and 132 no faster).
Note 87 (each program's best over its blocks stored): batch 32 218.9 / 275.9 / 257.5, 396
programs 208.5 / 269.8 / 254.1 (264: 239.8 / 328.7 / 310.0; 528: 219.5 / 277.2 / 259.2); batch
16 197.9 / 225.1 / 220.4, 594 programs 180.2 / 218.3 / 206.3 (396: 191.3 / 228.3 / 223.1); batch
64 332.9 / 350.7 / 371.1, 264 programs 285.9 / 351.2 / 356.8 (396: 321.9 / 399.9 / 391.0); batch
8 170.2 / 195.0 / 184.7 with 594 programs storing each block, 168.7 / 194.8 / 185.4 storing
each program's best. Note 89 (batch 1, its one row finished alone in the persistent programs
too; all-greedy rows / sampling, the batch's mixed being its sampling): one program per block
172.4 / 188.7, 132 programs 226.1 / 251.3, 264 177.0 / 196.7, **396 159.9 / 171.6**, 594
152.2 / 176.7, 792 170.1 / 173.9; at 2 warps 396 161.4 / 172.1, 594 151.9 / 174.6."""


def tile_race_tuning(batch: int) -> TileRaceTuning:
    """:data:`TILE_RACE_TUNING` with the ``programs`` of :data:`TILE_RACE_PROGRAMS` for ``batch``."""
    programs = next((n for last, n in TILE_RACE_PROGRAMS if batch <= last), 0)
    return dataclasses.replace(TILE_RACE_TUNING, programs=programs)


def tile_race_choice() -> str:
    """The value of :data:`TILE_RACE_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(TILE_RACE_ENV)


def tile_race_supported(rank: int, dtype: jnp.dtype, vocab: int) -> bool:
    """True when the kernel applies: the greedy kernels' head (:func:`greedy_supported`: a
    16-bit dtype, ``r`` a power of two of at least 16) and the race kernel's vocabulary
    (:func:`~dspark_jax.race_kernel.race_supported`: the race block a power of two)."""
    return greedy_supported(rank, dtype) and race_supported(vocab)


TILE_RACE_AUTO_BATCHES = (1, 64)
"""The batches ``auto`` runs the kernels for, first and last. Measured on the H200 with the 8B
draft, the walk alone (README note 66, µs per step, pipelined; all-greedy rows / mixed /
sampling), the tiled kernels against the race kernel: batch 32 37.8 / 46.0 / 43.3 against
41.9 / 47.0 / 50.2, batch 8 33.2 / 36.0 / 35.2 against 33.6 / 37.5 / 38.9; batch 1 33.4 / 36.1 /
36.8 against 35.5 / 35.5 / 35.9 and batch 4 34.5 / 38.9 / 38.4 against 35.5 / 36.6 / 38.6;
batch 64 (note 67, two row blocks of 32) 53.9 / 58.6 / 58.3 against 55.5 / 62.5 / 68.2; batch
128 80.5 / 90.3 / 101.1 against 77.4 / 87.4 / 97.8. Batches 1–4 ran the race kernel until the
tiled kernels alternated their tile order (README note 70: about 2.5 µs less per step). ``pallas``
forces them at any batch."""


def use_tile_race_kernel(rank: int, dtype: jnp.dtype, vocab: int, batch: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`tile_race_choice`
    (``auto``: at :data:`TILE_RACE_AUTO_BATCHES`)."""
    first, last = TILE_RACE_AUTO_BATCHES
    wanted = first <= batch <= last or tile_race_choice() == "pallas"
    return kernel_mode(TILE_RACE_ENV, tile_race_supported(rank, dtype, vocab) and wanted)


def _tile_kernel(*refs, batch, rows, chunk, alternate, interpret):
    """Program ``(i, j)``: rows ``i·rows …`` against race block
    :func:`~dspark_jax.greedy_kernel.walk_tile`.

    Refs: ``step`` ``[1]`` (an operand, so that the γ steps share one compiled kernel),
    ``z`` ``[BR, r]``, ``w2`` ``[V, r]``, ``inverse_t`` float32 ``[BR]`` (``1/T``), ``greedy``
    int32 ``[BR]``, ``words`` ``uint32 [2, γ, BR]``, ``base`` ``[B, γ, V]``, (the aliased
    corrected logits ``[B, γ, V]`` after step 0), then the outputs: corrected logits
    ``[B, γ, V]``, ``score`` and ``token`` ``[BR, NB]`` (this program writes its rows of the
    block's column; a sampling row's token is the block's index).

    With one real row (``batch`` 1) the program takes that row out of the tensor cores' 16-row
    tile and finishes it alone (the padding rows get score ``-inf`` and token 0), so the
    race's arithmetic runs on 1 row instead of 16 (README note 77).
    """
    step_ref, z_ref, w2_ref = refs[:3]
    rank = w2_ref.shape[1]
    block = walk_tile(step_ref[0], alternate)
    first_row = pl.program_id(0) * rows
    acc = jax.lax.fori_loop(
        0,
        rank // chunk,
        lambda c, acc: acc + _block_product(z_ref, w2_ref, first_row, rows, block, c, chunk),
        jnp.zeros((rows, race_width(w2_ref.shape[0])), jnp.float32),
    )
    if batch == 1 < rows:  # one real row: finish it alone, not its tensor-core tile's padding too
        _store_padding(refs, rows, block)
        acc, rows = _row_zero(acc), 1
    score, key = _finish_block(acc, block, first_row, rows, refs, batch=batch, interpret=interpret)
    _store_column(refs, first_row, block, score, key)


def _persistent_kernel(*refs, batch, rows, chunk, alternate, interpret):
    """Program ``(i, p)`` of ``P`` along the vocabulary: rows ``i·rows …`` against race blocks
    ``p, p + P, …`` (each through :func:`~dspark_jax.greedy_kernel.walk_tile`'s order), in one
    loop over ``(block, rank chunk)`` pairs whose last chunk of a block finishes that block under
    a ``cond``: the pipeliner keeps the next block's table loads in flight while a block's
    corrected logits and race are formed (README note 86). Each row's best ``(score, key)`` over
    the program's blocks (the higher score, on a tie the lower key: what :func:`_pick_kernel`
    takes over all blocks) is carried through the loop and written once, into column ``p`` of
    ``score`` and ``token`` ``[BR, P]`` (README note 87). Refs as :func:`_tile_kernel`'s."""
    step_ref, z_ref, w2_ref = refs[:3]
    vocab, rank = w2_ref.shape
    width, per = race_width(vocab), rank // chunk
    blocks, count = -(-vocab // width), pl.num_programs(1)  # NB, P
    p, step = pl.program_id(1), step_ref[0]
    first_row = pl.program_id(0) * rows
    mine = jax.lax.div(blocks - 1 - p, count) + 1  # blocks p, p + P, … below NB
    alone = batch == 1 < rows  # one real row, finished alone as in _tile_kernel
    carried = 1 if alone else rows  # rows whose best the loop carries

    def body(i, carry):  # lax.div / lax.rem: `//` and `%` on the loop index do not lower here
        acc, held = carry
        n, c = jax.lax.div(i, per), jax.lax.rem(i, per)
        block = walk_tile(step, alternate, p + n * count, blocks)
        acc = acc + _block_product(z_ref, w2_ref, first_row, rows, block, c, chunk)

        def finish():
            sums = _row_zero(acc) if alone else acc
            score, key = _finish_block(sums, block, first_row, carried, refs, batch=batch, interpret=interpret)
            better = (score > held[0]) | ((score == held[0]) & (key < held[1]))  # [carried]
            return jnp.zeros_like(acc), (jnp.where(better, score, held[0]), jnp.where(better, key, held[1]))

        return jax.lax.cond(c == per - 1, finish, lambda: (acc, held))

    none = (jnp.full((carried,), -jnp.inf, jnp.float32), jnp.full((carried,), NO_ID, jnp.int32))
    _, (score, key) = jax.lax.fori_loop(0, mine * per, body, (jnp.zeros((rows, width), jnp.float32), none))
    if alone:
        _store_padding(refs, rows, p)
    _store_column(refs, first_row, p, score, key)


def _row_zero(acc):
    """``[1, W]``: row 0 of ``acc [rows, W]`` exactly (Triton takes power-of-two shapes only, so
    the row is taken by a masked maximum, not a slice)."""
    row = jax.lax.broadcasted_iota(jnp.int32, (acc.shape[0], 1), 0)
    return jnp.where(row == 0, acc, -jnp.inf).max(axis=0, keepdims=True)


def _store_padding(refs, rows, column):
    """Batch 1's padding rows ``1 … rows − 1`` of column ``column`` of the ``score`` and ``token``
    outputs (the kernel's last two refs): score ``-inf``, token 0, so that they are written, not
    left as the buffer held them."""
    from jax.experimental.pallas import triton as plgpu

    score_ref, token_ref = refs[-2:]
    here, padding = (pl.ds(0, rows), pl.ds(column, 1)), jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) > 0
    plgpu.store(score_ref.at[here], jnp.full((rows, 1), -jnp.inf, jnp.float32), mask=padding)
    plgpu.store(token_ref.at[here], jnp.zeros((rows, 1), jnp.int32), mask=padding)


def _store_column(refs, first_row, column, score, key):
    """Rows ``first_row …`` of column ``column`` of the ``score`` and ``token`` outputs (the
    kernel's last two refs) from ``score`` float32 and ``key`` int32 ``[rows]``."""
    score_ref, token_ref = refs[-2:]
    here = (pl.ds(first_row, score.shape[0]), pl.ds(column, 1))
    score_ref[here] = score[:, None]
    token_ref[here] = key[:, None]


def _block_product(z_ref, w2_ref, first_row, rows, block, c, chunk):
    """``[rows, W]`` float32: rank chunk ``c`` of the rows' latents times race block ``block`` of
    the table (table rows past ``V`` read as zeros)."""
    from jax.experimental.pallas import triton as plgpu

    vocab = w2_ref.shape[0]
    width = race_width(vocab)
    start, at = block * width, pl.ds(c * chunk, chunk)
    z = z_ref[pl.ds(first_row, rows), at]  # [rows, chunk]
    if vocab % width:
        owned = start + jax.lax.broadcasted_iota(jnp.int32, (width,), 0) < vocab
        w = plgpu.load(w2_ref.at[pl.ds(start, width), at], mask=owned[:, None], other=0)
    else:
        w = w2_ref[pl.ds(start, width), at]  # [W, chunk]
    return jax.lax.dot_general(z, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)


def _finish_block(acc, block, first_row, rows, refs, *, batch, interpret):
    """Race block ``block`` of rows ``first_row …`` (``rows`` of them) from their bias sums
    ``acc [rows, W]``: the corrected logits into slot ``step``; returns each row's
    ``(score, key)`` float32 and int32 ``[rows]`` (a greedy row: the block's best float32 logit
    and the lowest id holding it; a sampling row: the block's race score and ``block``).
    ``refs``: all of the kernel's, as :func:`_tile_kernel` lists them."""
    from jax.experimental.pallas import triton as plgpu

    step_ref, _, w2_ref, inverse_t_ref, greedy_ref, words_ref, base_ref = refs[:7]
    corrected_ref = refs[-3]
    vocab = w2_ref.shape[0]
    width = race_width(vocab)
    start = block * width
    cols = start + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)  # [W]
    owned = cols < vocab
    bias = acc.astype(w2_ref.dtype).astype(jnp.float32)  # rounded as XLA's GEMM output is
    here = pl.ds(first_row, rows)
    real = first_row + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < batch  # [rows]
    valid = real[:, None] & owned[None, :]
    step = step_ref[0]
    at = (here, step, pl.ds(start, width))
    summed = plgpu.load(base_ref.at[at], mask=valid, other=0).astype(jnp.float32) + bias  # [rows, W]
    kept = summed.astype(corrected_ref.dtype)  # the base logits' dtype
    plgpu.store(corrected_ref.at[at], kept, mask=valid)
    greedy = greedy_ref[here] != 0  # [rows]

    # Each part runs only when a row of this block needs it; the branches return traced
    # values, not literals (Triton's scf.yield takes values only).
    def greedy_part():  # the float32 sum's best logit and lowest id holding it
        x = jnp.where(valid & ~jnp.isnan(summed), summed, -jnp.inf)
        top = x.max(axis=1)  # [rows]
        return top, jnp.where(x == top[:, None], cols[None, :], NO_ID).min(axis=1)

    def sampled_part():  # the block's score in the race of kept / T
        y = kept.astype(jnp.float32) * inverse_t_ref[here][:, None]
        top, mass = block_mass(jnp.where(valid & ~jnp.isnan(y), y, -jnp.inf))
        counter = jnp.full((rows,), block, jnp.uint32)
        noise = _noise(words_ref[0, step, here], words_ref[1, step, here], counter, BLOCK_NOISE, interpret)
        return block_log_mass(top, mass) - noise

    def some(chosen):  # any real row of this block chosen (Triton lowers no reduce_or)
        return jnp.where(real & chosen, 1, 0).max() > 0

    none = jnp.full((rows,), -jnp.inf, jnp.float32)
    top, best = jax.lax.cond(some(greedy), greedy_part, lambda: (none, jnp.zeros((rows,), jnp.int32) + block))
    score = jax.lax.cond(some(~greedy), sampled_part, lambda: none + 0)
    return jnp.where(greedy, top, score), jnp.where(greedy, best, block)


def _pick_kernel(
    step_ref, inverse_t_ref, greedy_ref, words_ref, score_ref, token_ref, corrected_ref, w1_ref, *refs, **static
):
    """Program ``b``: row ``b``'s token from the ``(score, key)`` columns of its blocks or of the
    persistent programs' bests (the best column's lowest key: a greedy row's token; a sampling
    row's block, whose tokens race, read back from the corrected logits), and row ``token`` of
    ``markov_w1`` (zeros for a padding row)."""
    from jax.experimental.pallas import triton as plgpu

    out_ref, e_ref = refs
    batch, span, interpret = static["batch"], static["span"], static["interpret"]
    vocab, width = corrected_ref.shape[2], race_width(corrected_ref.shape[2])
    b = pl.program_id(0)
    step = step_ref[0]
    column = jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
    real = column < score_ref.shape[1]
    scores = plgpu.load(score_ref.at[b, pl.ds(0, span)], mask=real, other=-jnp.inf)
    top = real & (scores == scores.max())
    key = jnp.where(top, plgpu.load(token_ref.at[b, pl.ds(0, span)], mask=real, other=NO_ID), NO_ID).min()

    def sampled():
        first = key * width
        ids = first + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        inside = ids < vocab
        rb = jnp.minimum(b, corrected_ref.shape[0] - 1)  # a padding row is greedy: never read
        kept = plgpu.load(corrected_ref.at[rb, step, pl.ds(first, width)], mask=inside, other=0).astype(jnp.float32)
        noise = _noise(words_ref[0, step, b], words_ref[1, step, b], ids.astype(jnp.uint32), TOKEN_NOISE, interpret)
        raced = kept * inverse_t_ref[b] - noise
        raced = jnp.where(inside & ~jnp.isnan(raced), raced, -jnp.inf)
        return jnp.where(raced == raced.max(), ids, NO_ID).min()

    token = jax.lax.cond(greedy_ref[b] != 0, lambda: key, sampled)
    out_ref[...] = jnp.full((1, 1), token, jnp.int32)
    row = w1_ref[jnp.minimum(token, vocab - 1), :]  # [r]
    e_ref[...] = jnp.where(b < batch, row, jnp.zeros_like(row))[None, :]


@functools.partial(jax.jit, static_argnames=("batch", "interpret", "tuning"))
def race_tiles(
    z: jax.Array,
    w2: jax.Array,
    base: jax.Array,
    corrected: jax.Array | None,
    temperatures: jax.Array,
    greedy: jax.Array,
    words: jax.Array,
    step: jax.Array | int,
    *,
    batch: int,
    interpret: bool = False,
    tuning: TileRaceTuning | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk step ``step``: corrected logits into slot ``step``, and each race block's score.

    Args:
      z: ``[BR, r]`` the rows' latents in the head's dtype (rows from ``batch`` on: ignored).
      w2: ``[V, r]`` the ``markov_w2`` table in the same dtype.
      base: ``[B, γ, V]`` base logits.
      corrected: ``[B, γ, V]`` corrected logits of the earlier steps in ``base``'s dtype
        (updated in place), or ``None`` at the first step (a new buffer; its other slots are
        written by the later steps).
      temperatures: float32 ``[BR]`` clamped temperatures (padding rows: any).
      greedy: int32 ``[BR]``, nonzero for rows that take the argmax (padding rows: nonzero).
      words: ``uint32 [2, γ, BR]`` every step's key words per row (:func:`padded_walk_inputs`).
      step: ``k`` (int32 scalar, may be traced).
      batch: ``B``.
      interpret: run through the Pallas interpreter (any backend).
      tuning: the layout (None: :func:`tile_race_tuning` of ``batch``).

    Returns:
      ``(score [BR, C] float32, token [BR, C] int32, corrected [B, γ, V])``: per row and
      column, a greedy row's largest float32 ``base + bias`` and the lowest id holding it, a
      sampling row's block score and the block's index; a column is a race block (``C = NB``),
      or with persistent programs (``tuning.programs``) a program's best over its
      blocks (``C = min(programs, NB)``: the higher score, on a tie the lower token or block).

    Raises:
      ValueError: shapes or dtypes that do not fit together, or no kernel for them.
    """
    tuning = tile_race_tuning(batch) if tuning is None else tuning
    if not isinstance(tuning, TileRaceTuning):
        raise TypeError(f"tuning={tuning!r} is invalid: must be a TileRaceTuning or None")
    total, rank = z.shape
    vocab = w2.shape[0]
    gamma = base.shape[1] if base.ndim == 3 else 0
    if base.ndim != 3 or base.shape[0] != batch or base.shape[2] != vocab:
        raise ValueError(f"base has shape {base.shape}: must be [B, γ, V] with B={batch}, V={vocab}")
    if total != padded_rows(batch) or w2.shape[1] != rank or z.dtype != w2.dtype:
        raise ValueError(
            f"z has shape {z.shape} and dtype {z.dtype}, w2 {w2.shape} {w2.dtype}: must be "
            f"[{padded_rows(batch)}, r] and [V, r] in one dtype"
        )
    if not tile_race_supported(rank, w2.dtype, vocab):
        raise ValueError(f"rank={rank}, dtype={w2.dtype} and vocab={vocab} are not supported: see tile_race_supported")
    for name, x, shape in (("temperatures", temperatures, (total,)), ("greedy", greedy, (total,))):
        if x.shape != shape:
            raise ValueError(f"{name} has shape {x.shape}: must be {shape} (the padded rows)")
    if words.shape != (2, gamma, total):
        raise ValueError(f"words has shape {words.shape}: must be (2, γ, BR) = {(2, gamma, total)}")
    if corrected is not None and (corrected.shape, corrected.dtype) != (base.shape, base.dtype):
        raise ValueError(
            f"corrected has shape {corrected.shape} and dtype {corrected.dtype}: must be base's, "
            f"{base.shape} {base.dtype}"
        )
    rows = min(total, tuning.max_rows)
    blocks = -(-vocab // race_width(vocab))
    programs = min(tuning.programs, blocks)
    columns = programs or blocks  # C: one (score, key) column per program
    kernel = functools.partial(
        _persistent_kernel if programs else _tile_kernel,
        batch=batch,
        rows=rows,
        chunk=min(tuning.chunk, rank),
        alternate=tuning.alternate,
        interpret=interpret,
    )
    step = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
    inverse_t = inverse_temperatures(temperatures)  # kept / T is kept · RN(1/T), as in XLA's sampler
    args = [step, z, w2, inverse_t, greedy.astype(jnp.int32), words.astype(jnp.uint32), base]
    aliases = {}
    if corrected is not None:
        args.append(corrected)
        aliases = {len(args) - 1: 0}
    corrected, score, token = pl.pallas_call(
        kernel,
        # the row blocks of one vocabulary block run next to each other (L2)
        grid=(total // rows, columns),
        in_specs=[_whole(x.shape) for x in args],
        out_specs=[_whole(base.shape), _whole((total, columns)), _whole((total, columns))],
        out_shape=[
            jax.ShapeDtypeStruct(base.shape, base.dtype),
            jax.ShapeDtypeStruct((total, columns), jnp.float32),
            jax.ShapeDtypeStruct((total, columns), jnp.int32),
        ],
        input_output_aliases=aliases,
        interpret=interpret,
        name="dspark_race_tiles",
        **triton_params(tuning.warps_for(rows), tuning.stages, interpret),
    )(*args)
    return score, token, corrected


@functools.partial(jax.jit, static_argnames=("batch", "interpret"))
def pick_raced_tiles(
    score: jax.Array,
    token: jax.Array,
    corrected: jax.Array,
    w1: jax.Array,
    temperatures: jax.Array,
    greedy: jax.Array,
    words: jax.Array,
    step: jax.Array | int,
    *,
    batch: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Each row's token from :func:`race_tiles`' output, and its ``markov_w1`` row.

    Args:
      score, token: ``[BR, C]`` from :func:`race_tiles`.
      corrected: ``[B, γ, V]`` the corrected logits, slot ``step`` written.
      w1: ``[V, r]`` the ``markov_w1`` table.
      temperatures, greedy, words, step, batch, interpret: as given to :func:`race_tiles`.

    Returns:
      ``(tokens [BR] int32, e [BR, r])``: the rows' picks (padding rows: unspecified) and
      ``w1[tokens]`` in ``w1``'s dtype (zero rows from ``batch`` on).
    """
    total, columns = score.shape
    rank = w1.shape[1]
    # a power of two of columns, masked from C on; at least 16, so a one-block vocabulary is not
    # a one-element tensor (a guard from the first GPU runs, not shown to be needed)
    span = max(16, 1 << (columns - 1).bit_length())
    kernel = functools.partial(_pick_kernel, batch=batch, span=span, interpret=interpret)
    step = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
    args = [step, inverse_temperatures(temperatures), greedy.astype(jnp.int32), words.astype(jnp.uint32)]
    args += [score, token, corrected, w1]
    tokens, e = pl.pallas_call(
        kernel,
        grid=(total,),
        in_specs=[_whole(x.shape) for x in args],
        out_specs=[pl.BlockSpec((1, 1), lambda b: (b, 0)), pl.BlockSpec((1, rank), lambda b: (b, 0))],
        out_shape=[jax.ShapeDtypeStruct((total, 1), jnp.int32), jax.ShapeDtypeStruct((total, rank), w1.dtype)],
        interpret=interpret,
        name="dspark_race_tiles_pick",
        **triton_params(8, 1, interpret),
    )(*args)
    return tokens[:, 0], e


def padded_walk_inputs(
    temperatures: jax.Array, greedy: jax.Array, keys: jax.Array, gamma: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The rows' sampling inputs as the kernels read them, padded to ``BR`` rows once per walk.

    Args:
      temperatures: ``[B]`` clamped float32 temperatures.
      greedy: ``[B]`` bool greedy rows.
      keys: typed per-row keys ``[B]`` (:func:`dspark_jax.sampling.row_keys`).
      gamma: ``γ``.

    Returns:
      ``(t float32 [BR], greedy int32 [BR], words uint32 [2, γ, BR])``: padding rows are
      greedy at temperature 1 with zero key words; ``words[:, k]`` are the key words of
      ``step_keys(keys, k)`` (:func:`~dspark_jax.race_kernel.step_key_words`).
    """
    batch = temperatures.shape[0]
    total = padded_rows(batch)
    t = jnp.ones((total,), jnp.float32).at[:batch].set(temperatures.astype(jnp.float32))
    g = jnp.ones((total,), jnp.int32).at[:batch].set(greedy.astype(jnp.int32))
    words = jnp.transpose(step_key_words(keys, gamma), (2, 1, 0))  # [2, γ, B]
    return t, g, jnp.zeros((2, gamma, total), jnp.uint32).at[:, :, :batch].set(words)


def tiled_race_walk(
    head: MarkovHead,
    base_logits: jax.Array,
    hidden: jax.Array,
    bonus: jax.Array,
    temperatures: jax.Array,
    greedy: jax.Array,
    keys: jax.Array,
    *,
    interpret: bool = False,
    tuning: TileRaceTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`dspark_jax.markov.markov_walk` with the folded sampler: two kernels per step, no ``[B, V]`` bias.

    Args:
      head: the Markov head (not ``None``); :func:`tile_race_supported` must hold.
      base_logits: ``[B, γ, V]``.
      hidden: ``[B, γ, H]`` draft hidden states (the gated and RNN heads read them).
      bonus: ``[B]`` the anchor token (``prev`` of step 0).
      temperatures: ``[B]`` clamped float32 temperatures.
      greedy: ``[B]`` bool greedy rows.
      keys: typed per-row keys ``[B]``; step ``k`` uses ``step_keys(keys, k)``, as
        :func:`dspark_jax.sampling.sample_step` does.
      interpret: run the kernels through the Pallas interpreter.
      tuning: :func:`race_tiles`' layout.

    Returns:
      ``(tokens [B, γ] int32, corrected [B, γ, V] in base_logits' dtype)``, as the XLA walk
      with :func:`dspark_jax.sampling.sample_step` makes them.
    """
    batch, gamma = base_logits.shape[:2]
    w1 = head.markov_w1[...]
    w2 = head.markov_w2[...].astype(head.dtype)  # as MarkovHead.project multiplies
    t, g, words = padded_walk_inputs(temperatures, greedy, keys, gamma)
    state, e = head.init_state(batch), first_latent_rows(head, bonus)
    corrected, tokens = None, []
    for k in range(gamma):
        z, state = padded_latents(head, state, e, hidden[:, k], batch)
        score, token, corrected = race_tiles(
            z, w2, base_logits, corrected, t, g, words, k, batch=batch, interpret=interpret, tuning=tuning
        )
        token, e = pick_raced_tiles(score, token, corrected, w1, t, g, words, k, batch=batch, interpret=interpret)
        tokens.append(token[:batch])
    return jnp.stack(tokens, axis=1), corrected
