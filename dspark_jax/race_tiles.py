"""The folded walk's sampling step with the Markov projection inside: two Pallas (Triton) kernels per step.

Shape legend: B batch, BR padded rows (:func:`~dspark_jax.greedy_kernel.padded_rows`), γ block
slots, V vocabulary, r Markov rank, W = :func:`~dspark_jax.sampling.race_width` tokens per race
block, NB = ⌈V / W⌉ blocks per row.

Step ``k`` of the folded walk with the XLA sampler is a GEMM writing the ``[B, V]`` bias
``z @ markov_w2ᵀ`` (rounded to the head's dtype), then the race over ``base[:, k] + bias``
(:func:`dspark_jax.sampling.sample_step` with ``race_dtype`` the base logits' dtype; on GPUs
:func:`dspark_jax.race_kernel.race_step`, which reads the bias back). :func:`race_tiles` does
the GEMM and the race's pass over ``V`` at once, as :func:`~dspark_jax.greedy_kernel.greedy_tiles`
does for greedy-only walks: program ``(i, j)`` multiplies row block ``i``'s latents by race
block ``j``'s table rows on the tensor cores (the vocabulary tile is the race block, W =
:data:`~dspark_jax.sampling.RACE_BLOCK` tokens), adds the base logits, writes the kept
(rounded) corrected logits into slot ``k`` of the ``[B, γ, V]`` output in place, and writes
each row's block result: a greedy row's best float32 logit and lowest id holding it, a
sampling row's score in the blocks' race (:func:`~dspark_jax.sampling.block_log_mass` of
:func:`~dspark_jax.sampling.block_mass` of ``kept / T``, minus the block's noise). The bias
never goes to memory. :func:`pick_raced`, one program per row, then picks the token as
:func:`~dspark_jax.sampling.race_blocks` does (the best block, then the race of its ``W``
tokens, read back from the corrected logits) and gathers the next step's ``markov_w1`` row.

Same maths as the XLA sampler, operation for operation (README note 50). As with the greedy
kernels, the bias is a float32 sum in the tensor cores' order, which may differ from the XLA
GEMM's by one unit of the head's dtype; the tests pin the maths on inputs whose sums are exact.

:func:`race_tiles_supported` says when the kernels apply (:func:`~dspark_jax.race_kernel.race_supported`
and :func:`~dspark_jax.greedy_kernel.greedy_supported`); :func:`dspark_jax.proposal.walk_block`
uses them wherever :func:`~dspark_jax.race_kernel.use_race_kernel` chooses the race kernel
(``DSPARK_JAX_RACE``) and they apply, and no :class:`~dspark_jax.race_kernel.RaceTuning` asks
for :func:`~dspark_jax.race_kernel.race_step` by name.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _whole
from dspark_jax.greedy_kernel import (
    GREEDY_TUNING,
    greedy_supported,
    padded_latent,
    padded_rows,
    tile_best,
    tile_sums,
    walk_tables,
)
from dspark_jax.kernel_choice import triton_params
from dspark_jax.markov import MarkovHead
from dspark_jax.race_kernel import _divide, _noise, race_supported, step_key_words
from dspark_jax.sampling import BLOCK_NOISE, RACE_BLOCK, TOKEN_NOISE, block_log_mass, block_mass, race_width

_NO_TOKEN = np.int32(np.iinfo(np.int32).max)
_MAX_ROWS = 128  # rows per program, as greedy_tiles: a [128, W] float32 accumulator


def race_tiles_supported(rank: int, dtype: jnp.dtype, vocab: int) -> bool:
    """True when the kernels apply: the race kernel's vocabularies and the greedy kernel's heads
    (a 16-bit head dtype, ``r`` a power of two of at least 16)."""
    return race_supported(vocab) and greedy_supported(rank, dtype)


def _tile_kernel(step_ref, t_ref, greedy_ref, words_ref, z_ref, w2_ref, base_ref, *refs, batch, rows, chunk, interpret):
    """Program ``(i, j)``: rows ``i·rows …`` against race block ``j``.

    Refs: ``step`` ``[1]``, ``t``, ``greedy`` ``[B]``, ``words`` ``uint32 [B, γ, 2]``, ``z``
    ``[BR, r]``, ``w2`` ``[V, r]``, ``base`` ``[B, γ, V]``, (the aliased corrected logits
    ``[B, γ, V]`` after step 0), then the outputs: corrected logits ``[B, γ, V]``, ``score`` and
    ``token`` ``[BR, NB]`` (this program writes its ``[rows, 1]`` block).
    """
    from jax.experimental.pallas import triton as plgpu

    corrected_ref, score_ref, token_ref = refs[-3:]
    step = step_ref[0]
    summed, cols, valid = tile_sums(step, z_ref, w2_ref, base_ref, batch=batch, rows=rows, tile=RACE_BLOCK, chunk=chunk)
    kept = summed.astype(corrected_ref.dtype)  # the base logits' dtype
    first_row, start = pl.program_id(0) * rows, pl.program_id(1) * RACE_BLOCK
    plgpu.store(corrected_ref.at[pl.ds(first_row, rows), step, pl.ds(start, RACE_BLOCK)], kept, mask=valid)

    live = first_row + jax.lax.broadcasted_iota(jnp.int32, (rows,), 0) < batch  # [rows]
    at = pl.ds(first_row, rows)
    t = plgpu.load(t_ref.at[at], mask=live, other=1.0)
    greedy = plgpu.load(greedy_ref.at[at], mask=live, other=1) != 0
    k0, k1 = (plgpu.load(words_ref.at[at, step, jnp.int32(w)], mask=live, other=0) for w in (0, 1))

    top, idx = tile_best(summed, cols, valid)  # greedy rows: the float32 argmax of the sum
    # sampling rows race on the kept values: q = softmax(kept / T) is the law of the pick
    x = _divide(kept.astype(jnp.float32), t[:, None], interpret)
    block_top, mass = block_mass(jnp.where(valid & ~jnp.isnan(x), x, -jnp.inf))  # [rows]
    block = jnp.full((rows,), pl.program_id(1), jnp.uint32)
    score = block_log_mass(block_top, mass) - _noise(k0, k1, block, BLOCK_NOISE, interpret)
    score_ref[...] = jnp.where(greedy, top, score)[:, None]
    token_ref[...] = jnp.where(greedy, idx, 0)[:, None]


@functools.partial(jax.jit, static_argnames=("batch", "interpret"))
def race_tiles(
    z: jax.Array,
    w2: jax.Array,
    base: jax.Array,
    corrected: jax.Array | None,
    temperatures: jax.Array,
    greedy: jax.Array,
    key_words: jax.Array,
    step: jax.Array | int,
    *,
    batch: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Walk step ``step``'s corrected logits and each row's result per race block.

    Args:
      z: ``[BR, r]`` the rows' latents in the head's dtype (rows from ``batch`` on: ignored).
      w2: ``[V, r]`` the ``markov_w2`` table in the same dtype.
      base: ``[B, γ, V]`` base logits (model dtype).
      corrected: ``[B, γ, V]`` corrected logits of the earlier steps in ``base``'s dtype
        (updated in place), or ``None`` at the first step.
      temperatures: ``[B]`` float32, clamped (:func:`dspark_jax.sampling.clamp_temperatures`).
      greedy: ``[B]`` bool, True for rows that take the argmax.
      key_words: ``uint32 [B, γ, 2]`` every step's key words
        (:func:`~dspark_jax.race_kernel.step_key_words`).
      step: ``k`` (int32 scalar, may be traced).
      batch: ``B``.
      interpret: run through the Pallas interpreter (any backend).

    Returns:
      ``(score [BR, NB] float32, token [BR, NB] int32, corrected [B, γ, V])`` with slot ``k``
      of ``corrected`` filled: ``kept = (base[:, k] + bias)`` rounded to ``base``'s dtype. Per
      row and block: a greedy row's largest float32 ``base + bias`` and the lowest id holding
      it; a sampling row's ``log p_S − log E_S`` of ``kept / T`` and 0.

    Raises:
      ValueError: shapes or dtypes that do not fit together.
    """
    total, rank = z.shape
    vocab = w2.shape[0]
    if base.ndim != 3 or base.shape[0] != batch or base.shape[2] != vocab:
        raise ValueError(f"base has shape {base.shape}: must be [B, γ, V] with B={batch}, V={vocab}")
    gamma = base.shape[1]
    if total != padded_rows(batch) or w2.shape[1] != rank or z.dtype != w2.dtype:
        raise ValueError(
            f"z has shape {z.shape} and dtype {z.dtype}, w2 {w2.shape} {w2.dtype}: must be "
            f"[{padded_rows(batch)}, r] and [V, r] in one dtype"
        )
    if not race_tiles_supported(rank, w2.dtype, vocab):
        raise ValueError(f"rank={rank}, dtype={w2.dtype} and vocab={vocab} are not supported: see race_tiles_supported")
    if key_words.shape != (batch, gamma, 2):
        raise ValueError(f"key_words has shape {key_words.shape}: must be (B, γ, 2) = {(batch, gamma, 2)}")
    if corrected is not None and (corrected.shape, corrected.dtype) != (base.shape, base.dtype):
        raise ValueError(
            f"corrected has shape {corrected.shape} and dtype {corrected.dtype}: must be base's, "
            f"{base.shape} {base.dtype}"
        )
    rows = min(total, _MAX_ROWS)
    blocks = -(-vocab // race_width(vocab))
    kernel = functools.partial(
        _tile_kernel, batch=batch, rows=rows, chunk=min(GREEDY_TUNING.chunk, rank), interpret=interpret
    )
    step = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
    args = [step, temperatures.astype(jnp.float32), greedy.astype(jnp.int32), key_words.astype(jnp.uint32), z, w2, base]
    aliases = {}
    if corrected is not None:
        args.append(corrected)
        aliases = {len(args) - 1: 0}
    out = pl.BlockSpec((rows, 1), lambda i, j: (i, j))
    corrected, score, token = pl.pallas_call(
        kernel,
        grid=(total // rows, blocks),  # the row blocks of one race block run next to each other (L2)
        in_specs=[_whole(x.shape) for x in args],
        out_specs=[_whole(base.shape), out, out],
        out_shape=[
            jax.ShapeDtypeStruct(base.shape, base.dtype),
            jax.ShapeDtypeStruct((total, blocks), jnp.float32),
            jax.ShapeDtypeStruct((total, blocks), jnp.int32),
        ],
        input_output_aliases=aliases,
        interpret=interpret,
        name="dspark_race_tiles",
        **triton_params(GREEDY_TUNING.warps_for(rows), GREEDY_TUNING.stages, interpret),
    )(*args)
    return score, token, corrected


def _pick_kernel(step_ref, t_ref, greedy_ref, words_ref, score_ref, token_ref, w1_ref, corrected_ref, *refs, **static):
    """Program ``b``: row ``b``'s token from its blocks' ``(score, token)`` ``[BR, NB]``, as
    :func:`dspark_jax.sampling.race_blocks` picks it (the block with the best score, then the
    race of its tokens, read back from the corrected logits), and row ``token`` of
    ``markov_w1`` (zeros for a padding row). The corrected logits pass through (aliased)."""
    from jax.experimental.pallas import triton as plgpu

    token_out, e_out = refs[:2]
    batch, vocab, width, span, interpret = (static[k] for k in ("batch", "vocab", "width", "span", "interpret"))
    b = pl.program_id(0)
    row = jnp.minimum(b, batch - 1)  # a padding row reads the last real row's inputs
    step = step_ref[0]
    blocks = score_ref.shape[1]
    column = jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
    real = column < blocks
    scores = plgpu.load(score_ref.at[b, pl.ds(0, span)], mask=real, other=-jnp.inf)
    best = scores.max()

    def greedy():  # each block's best float32 logit and the lowest id holding it, in id order
        ids = plgpu.load(token_ref.at[b, pl.ds(0, span)], mask=real, other=_NO_TOKEN)
        return jnp.where(real & (scores == best), ids, _NO_TOKEN).min()

    def sampled():
        k0, k1 = words_ref[row, step, 0], words_ref[row, step, 1]
        block = jnp.where(scores == best, column, _NO_TOKEN).min()
        first = block * width
        start = jnp.minimum(first, vocab - width)  # the last block's window ends at V
        kept = corrected_ref[row, step, pl.ds(start, width)].astype(jnp.float32)  # [W]
        ids = start + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        raced = _divide(kept, t_ref[row], interpret) - _noise(k0, k1, ids.astype(jnp.uint32), TOKEN_NOISE, interpret)
        raced = jnp.where((ids >= first) & ~jnp.isnan(raced), raced, -jnp.inf)  # the head: the block before's
        return jnp.where(raced == raced.max(), ids, _NO_TOKEN).min()

    token = jax.lax.cond((greedy_ref[row] != 0) | (b >= batch), greedy, sampled)
    token_out[...] = jnp.full((1, 1), token, jnp.int32)
    e = w1_ref[jnp.minimum(token, w1_ref.shape[0] - 1), :]  # [r]
    e_out[...] = jnp.where(b < batch, e, jnp.zeros_like(e))[None, :]


@functools.partial(jax.jit, static_argnames=("batch", "interpret"))
def pick_raced(
    score: jax.Array,
    token: jax.Array,
    w1: jax.Array,
    corrected: jax.Array,
    temperatures: jax.Array,
    greedy: jax.Array,
    key_words: jax.Array,
    step: jax.Array | int,
    *,
    batch: int,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each row's token from :func:`race_tiles`' output, and its ``markov_w1`` row.

    Args:
      score, token: ``[BR, NB]`` from :func:`race_tiles`.
      w1: ``[V, r]`` the ``markov_w1`` table.
      corrected: ``[B, γ, V]`` from :func:`race_tiles` (slot ``step`` filled); returned as is
        (aliased, so the next step updates it in place without a copy).
      temperatures, greedy, key_words, step, batch: as for :func:`race_tiles`.
      interpret: run through the Pallas interpreter.

    Returns:
      ``(tokens [BR] int32, e [BR, r] in w1's dtype, corrected)``: padding rows' tokens are
      unspecified and their ``e`` rows zero.
    """
    total, blocks = score.shape
    vocab = corrected.shape[2]
    static = dict(
        batch=batch, vocab=vocab, width=race_width(vocab), span=1 << (blocks - 1).bit_length(), interpret=interpret
    )
    step = jnp.reshape(jnp.asarray(step, jnp.int32), (1,))
    args = [step, temperatures.astype(jnp.float32), greedy.astype(jnp.int32), key_words.astype(jnp.uint32)]
    args += [score, token, w1, corrected]
    rank = w1.shape[1]
    tokens, e, corrected = pl.pallas_call(
        functools.partial(_pick_kernel, **static),
        grid=(total,),
        in_specs=[_whole(x.shape) for x in args],
        out_specs=[
            pl.BlockSpec((1, 1), lambda b: (b, 0)),
            pl.BlockSpec((1, rank), lambda b: (b, 0)),
            _whole(corrected.shape),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((total, 1), jnp.int32),
            jax.ShapeDtypeStruct((total, rank), w1.dtype),
            jax.ShapeDtypeStruct(corrected.shape, corrected.dtype),
        ],
        input_output_aliases={len(args) - 1: 2},
        interpret=interpret,
        name="dspark_race_tiles_pick",
        **triton_params(8, 1, interpret),
    )(*args)
    return tokens[:, 0], e, corrected


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
) -> tuple[jax.Array, jax.Array]:
    """:func:`dspark_jax.markov.markov_walk` with the folded sampler, two kernels per step, no ``[B, V]`` bias.

    Args:
      head: the Markov head (not ``None``); :func:`race_tiles_supported` must hold.
      base_logits: ``[B, γ, V]``.
      hidden: ``[B, γ, H]`` draft hidden states (the gated and RNN heads read them).
      bonus: ``[B]`` the anchor token (``prev`` of step 0).
      temperatures: ``[B]`` clamped float32 temperatures.
      greedy: ``[B]`` bool greedy rows.
      keys: typed per-row keys ``[B]``; step ``k`` uses ``step_keys(keys, k)``, as
        :func:`dspark_jax.sampling.sample_step` does.
      interpret: run the kernels through the Pallas interpreter.

    Returns:
      ``(tokens [B, γ] int32, corrected [B, γ, V] in base_logits' dtype)``, as the XLA walk
      (:func:`dspark_jax.markov.markov_walk` with ``keep_dtype = base_logits.dtype``) gives them.
    """
    batch, gamma = base_logits.shape[:2]
    w1, w2, e = walk_tables(head, bonus)
    state = head.init_state(batch)
    words = step_key_words(keys, gamma)  # [B, γ, 2]
    t, rows_greedy = temperatures.astype(jnp.float32), greedy.astype(jnp.int32)
    corrected, tokens = None, []
    for k in range(gamma):
        z, state = padded_latent(head, state, e, hidden[:, k], batch)
        score, token, corrected = race_tiles(
            z, w2, base_logits, corrected, t, rows_greedy, words, k, batch=batch, interpret=interpret
        )
        token, e, corrected = pick_raced(
            score, token, w1, corrected, t, rows_greedy, words, k, batch=batch, interpret=interpret
        )
        tokens.append(token[:batch])
    return jnp.stack(tokens, axis=1), corrected
