"""One sampling step of the folded Markov walk as one Pallas (Triton) kernel on GPUs.

Shape legend: B batch, γ block slots, V vocabulary, W tokens per race block
(:func:`dspark_jax.sampling.race_width`), NB = ⌈V / W⌉ blocks per row.

Step ``k`` of the folded walk (:func:`dspark_jax.markov.markov_walk` with
:func:`dspark_jax.sampling.sample_step`) forms the corrected logits ``base[:, k] + bias`` in
float32, keeps them in the base logits' dtype for the block's ``[B, γ, V]`` corrected logits
and races the kept values (greedy rows take the plain argmax of the float32 sum).
:func:`race_step` does the pass over ``V`` in one kernel per step: program ``(b, j)`` reads
race block ``j`` of row ``b`` (tokens ``[j·W, (j + 1)·W)``; the last program reads the last
``W`` tokens and masks those of the block before), writes their corrected logits into slot
``k`` of the ``[B, γ, V]`` output in place (the buffer is aliased from step to step, so
nothing is stacked), and writes the block's score in the blocks' race for a sampling row
(:func:`dspark_jax.sampling.block_scores` of :func:`dspark_jax.sampling.block_mass`: one
Philox block per program) or its best logit and token for a greedy row. A second kernel, one
program per row, picks the token as :func:`dspark_jax.sampling.race_blocks` does (the block
with the best score, then the race of its ``W`` tokens, read back from ``base`` and
``bias``), hashing their Philox blocks with the hardware's ``mul.hi``/``mul.lo``: in XLA the
hash's 32-bit products are emulated in 16-bit halves, which made the sampling programs
several times larger and their compilation slower (README note 47). How the work is laid
out (race blocks per block program, warps per program of either kernel) is a
:class:`RaceTuning`; with ``P > 1`` blocks per program, program ``(b, p)`` reads blocks
``p·P … p·P + P − 1`` as one ``[P, W]`` tile, its loads and stores masked past ``V``.

Same maths as :func:`dspark_jax.sampling.sample_step`, operation for operation (float32,
``exp`` through libdevice as XLA does, ``logits / T`` as the product with
:func:`~dspark_jax.sampling.inverse_temperatures`, computed by XLA before the kernels, the block
mass summed exactly as integers; ties to the lowest token id, NaN as ``-inf``), so the kernel
and the XLA sampler pick the same tokens from the same keys (tested through the Pallas
interpreter; on the H200 against the XLA sampler, see README).

:func:`race_supported` says when the kernel applies (``V ≥`` :data:`RACE_BLOCK`, or ``V`` a
power of two of at least 64, one block) and :func:`use_race_kernel` whether this trace uses
it (:data:`RACE_ENV`; by default on GPU backends only). ``interpret=True`` runs it through
the Pallas interpreter on any backend.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _whole
from dspark_jax.kernel_choice import KERNEL_CHOICES, env_choice, kernel_mode, triton_params
from dspark_jax.sampling import (
    BLOCK_NOISE,
    NO_ID,
    RACE_BLOCK,
    TOKEN_NOISE,
    _key_words,
    _log_exponential,
    block_log_mass,
    block_mass,
    inverse_temperatures,
    mul_hi_lo,
    philox4x32,
    race_width,
    step_keys,
)

if TYPE_CHECKING:
    from dspark_jax.markov import MarkovHead

RACE_ENV = "DSPARK_JAX_RACE"
"""Environment variable choosing the folded walk's sampling step: ``auto`` (default: the
kernel on GPUs when :func:`race_supported`), ``xla`` (never) or ``pallas`` (wherever
supported, the Pallas interpreter off GPUs)."""

RACE_CHOICES = KERNEL_CHOICES

_WARP_COUNTS = (1, 2, 4, 8, 16, 32)


@dataclasses.dataclass(frozen=True, kw_only=True)
class RaceTuning:
    """How :func:`race_step` lays its work out on the GPU; the tokens do not depend on it.

    Attributes:
      blocks_per_program: race blocks per program of the block kernel, a power of two (the
        last program's loads and stores are masked past ``V`` when it is above 1).
      warps: warps per program of the block kernel.
      pick_warps: warps per program of the pick kernel.

    The defaults are the setting measured on the H200 (README notes 47, 48 and 66): 2 warps
    per block program were faster than 4 at every batch, 8 per pick program faster than 4 at
    batches 1–32; with race blocks of 1024 tokens one block per program was fastest, and with
    blocks of 128 (note 66) 8 per program (1024 tokens) took the batch-128 step from 142–216 µs
    to 78–88.
    """

    blocks_per_program: int = 8
    warps: int = 2
    pick_warps: int = 8

    def __post_init__(self):
        p = self.blocks_per_program
        if isinstance(p, bool) or not isinstance(p, int) or p < 1 or p & (p - 1):
            raise ValueError(f"blocks_per_program={p!r} is invalid: must be a power of two >= 1")
        for name in ("warps", "pick_warps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value not in _WARP_COUNTS:
                raise ValueError(f"{name}={value!r} is invalid: must be one of {_WARP_COUNTS}")

    @property
    def label(self) -> str:
        """``p{blocks_per_program}w{warps}k{pick_warps}``, e.g. ``p1w2k8``."""
        return f"p{self.blocks_per_program}w{self.warps}k{self.pick_warps}"

    @classmethod
    def parse(cls, text: str) -> RaceTuning:
        """From ``"P:W:K"`` (blocks per program, block-kernel warps, pick-kernel warps).

        Raises:
          ValueError: not three integers, or a value :class:`RaceTuning` refuses.
        """
        parts = text.strip().split(":")
        try:
            p, w, k = (int(x) for x in parts)
        except ValueError:
            raise ValueError(
                f"race tuning {text!r} is invalid: must be P:W:K, three integers "
                "(blocks per program, block-kernel warps, pick-kernel warps), e.g. 1:2:8"
            ) from None
        return cls(blocks_per_program=p, warps=w, pick_warps=k)


RACE_TUNING = RaceTuning()
"""The :class:`RaceTuning` :func:`race_step` uses unless given one."""


def race_choice() -> str:
    """The value of :data:`RACE_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(RACE_ENV)


def race_supported(vocab: int) -> bool:
    """True when the kernel applies: at least :data:`RACE_BLOCK` tokens (the last block's
    program reads the last ``W`` tokens), or one block of a power of two of at least 64 tokens
    (Triton's tiles are powers of two)."""
    return vocab >= RACE_BLOCK or (vocab >= 64 and vocab & (vocab - 1) == 0)


def use_race_kernel(vocab: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`race_choice`."""
    return kernel_mode(RACE_ENV, race_supported(vocab))


def _mul_hi_lo_gpu(a: jax.Array, m: np.uint32) -> tuple[jax.Array, jax.Array]:
    """:func:`dspark_jax.sampling.mul_hi_lo` through the hardware: ``mul.hi.u32`` and ``mul.lo.u32``
    (Triton's integers are signless: the operands pass as int32 bit patterns). A scalar takes
    the exact 32-bit arithmetic instead."""
    if jnp.ndim(a) == 0:
        return mul_hi_lo(a, m)
    from jax.experimental.pallas import triton as plgpu

    cast = jax.lax.bitcast_convert_type
    args = [cast(a, jnp.int32), cast(jnp.full(a.shape, m, jnp.uint32), jnp.int32)]
    out = jax.ShapeDtypeStruct(a.shape, jnp.int32)
    words = []
    for part in ("hi", "lo"):
        [word] = plgpu.elementwise_inline_asm(
            f"mul.{part}.u32 $0, $1, $2;", args=args, constraints="=r,r,r", pack=1, result_shape_dtypes=[out]
        )
        words.append(cast(word, jnp.uint32))
    return words[0], words[1]


def _noise(k0: jax.Array, k1: jax.Array, counter: jax.Array, domain: int, interpret: bool) -> jax.Array:
    """:func:`dspark_jax.sampling._noise` for one row inside a kernel (key words as scalars)."""
    mul = mul_hi_lo if interpret else _mul_hi_lo_gpu
    return _log_exponential(philox4x32(k0, k1, (counter, domain, 0, 0), mul=mul)[0])


def _tile(base_ref, bias_ref, corrected_ref, b, step, *, vocab, width, per_program):
    """Program ``(b, p)``'s tokens: ``(summed, kept, index, owned)``, each ``[W]`` for one block
    per program or ``[P, W]`` for ``P`` (blocks ``p·P … p·P + P − 1``); the corrected logits
    ``kept`` are written to slot ``step``.

    One block: the last program reads the last ``W`` tokens and does not own those of the block
    before (no masked memory access). ``P`` blocks: loads and stores are masked past ``V``.
    """
    if per_program == 1:
        first = pl.program_id(1) * width
        start = jnp.minimum(first, vocab - width)  # the last program reads the last W tokens
        at = pl.ds(start, width)
        summed = base_ref[b, step, at].astype(jnp.float32) + bias_ref[b, at].astype(jnp.float32)  # [W]
        kept = summed.astype(corrected_ref.dtype)  # the base logits' dtype
        corrected_ref[b, step, at] = kept
        index = start + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        return summed, kept, index, index >= first  # the rest belongs to the block before
    from jax.experimental.pallas import triton as plgpu

    span = per_program * width
    first = pl.program_id(1) * span
    at = pl.ds(first, span)
    index = first + jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
    owned = index < vocab
    base = plgpu.load(base_ref.at[b, step, at], mask=owned, other=0)
    bias = plgpu.load(bias_ref.at[b, at], mask=owned, other=0)
    summed = base.astype(jnp.float32) + bias.astype(jnp.float32)  # [P·W]
    kept = summed.astype(corrected_ref.dtype)
    plgpu.store(corrected_ref.at[b, step, at], kept, mask=owned)
    shape = (per_program, width)
    return summed.reshape(shape), kept.reshape(shape), index.reshape(shape), owned.reshape(shape)


def _kernel(
    step_ref, inverse_t_ref, greedy_ref, words_ref, base_ref, bias_ref, *refs, vocab, width, per_program, interpret
):
    """Program ``(b, p)``: race blocks ``p·P … p·P + P − 1`` of row ``b`` (``P = per_program``).

    Refs: ``step`` ``[1]`` (an operand, so that the γ steps share one compiled kernel),
    ``inverse_t`` (``1/T``), ``greedy`` ``[B]``, ``words`` ``uint32 [B, γ, 2]``, ``base``
    ``[B, γ, V]``, ``bias`` ``[B, V]``, (the aliased corrected logits ``[B, γ, V]`` after step 0), then the outputs:
    corrected logits ``[B, γ, V]``, each block's score and token ``[1, P]`` each (a greedy
    row: its best float32 logit and the lowest id holding it; a sampling row: its score in the
    blocks' race, :func:`dspark_jax.sampling.block_scores` of ``block_mass(kept / T)``, and 0).
    """
    corrected_ref, score_ref, token_ref = refs[-3:]
    b = pl.program_id(0)
    step = step_ref[0]
    summed, kept, index, owned = _tile(
        base_ref, bias_ref, corrected_ref, b, step, vocab=vocab, width=width, per_program=per_program
    )
    block = pl.program_id(1) * per_program
    if per_program > 1:
        block = block + jax.lax.broadcasted_iota(jnp.int32, (per_program,), 0)

    # Each branch returns traced values, not literals (Triton's scf.yield takes values only).
    def greedy():
        x = jnp.where(owned & ~jnp.isnan(summed), summed, -jnp.inf)
        top = x.max(-1)
        best = top if per_program == 1 else top[:, None]
        return top, jnp.where(owned & (x == best), index, NO_ID).min(-1)

    def sampled():  # on the kept values: q = softmax(kept / T) is the law of the pick
        x = kept.astype(jnp.float32) * inverse_t_ref[b]
        top, mass = block_mass(jnp.where(owned & ~jnp.isnan(x), x, -jnp.inf))
        noise = _noise(words_ref[b, step, 0], words_ref[b, step, 1], block.astype(jnp.uint32), BLOCK_NOISE, interpret)
        score = block_log_mass(top, mass) - noise
        return score, (score * 0).astype(jnp.int32)

    score, token = jax.lax.cond(greedy_ref[b] != 0, greedy, sampled)
    if per_program == 1:
        score_ref[...] = jnp.full((1, 1), score, jnp.float32)
        token_ref[...] = jnp.full((1, 1), token, jnp.int32)
    else:
        score_ref[...] = score.reshape(1, per_program)
        token_ref[...] = token.reshape(1, per_program)


def _pick_kernel(
    step_ref, inverse_t_ref, greedy_ref, words_ref, score_ref, token_ref, base_ref, bias_ref, out_ref, **static
):
    """Program ``b``: row ``b``'s token from its blocks' ``(score, token)``, ``[B, S]`` each with
    ``S`` a power of two ``≥ NB`` (columns from ``NB`` on unwritten or past ``V``, masked), as
    :func:`dspark_jax.sampling.race_blocks` picks it: the block with the best score, then the
    race of its tokens, read back from ``base`` and ``bias``."""
    vocab, width, blocks, interpret = (static[name] for name in ("vocab", "width", "blocks", "interpret"))
    b = pl.program_id(0)
    step = step_ref[0]
    span = score_ref.shape[1]
    column = jax.lax.broadcasted_iota(jnp.int32, (span,), 0)
    real = column < blocks
    scores = jnp.where(real, score_ref[b, :], -jnp.inf)
    best = scores.max()

    def greedy():  # each block's best float32 logit and lowest id holding it
        return jnp.where(real & (scores == best), token_ref[b, :], NO_ID).min()

    def sampled():
        k0, k1 = words_ref[b, step, 0], words_ref[b, step, 1]
        block = jnp.where(scores == best, column, NO_ID).min()
        first = block * width
        start = jnp.minimum(first, vocab - width)
        at = pl.ds(start, width)
        summed = base_ref[b, step, at].astype(jnp.float32) + bias_ref[b, at].astype(jnp.float32)  # [W]
        kept = summed.astype(base_ref.dtype).astype(jnp.float32)
        ids = start + jax.lax.broadcasted_iota(jnp.int32, (width,), 0)
        raced = kept * inverse_t_ref[b] - _noise(k0, k1, ids.astype(jnp.uint32), TOKEN_NOISE, interpret)
        raced = jnp.where((ids >= first) & ~jnp.isnan(raced), raced, -jnp.inf)
        return jnp.where(raced == raced.max(), ids, NO_ID).min()

    out_ref[...] = jnp.full((1, 1), jax.lax.cond(greedy_ref[b] != 0, greedy, sampled), jnp.int32)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def race_step(
    base: jax.Array,
    bias: jax.Array,
    corrected: jax.Array | None,
    temperatures: jax.Array,
    greedy: jax.Array,
    key_words: jax.Array,
    step: jax.Array | int,
    *,
    interpret: bool = False,
    tuning: RaceTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Walk step ``step``: corrected logits, their race (or argmax), the tokens.

    Args:
      base: ``[B, γ, V]`` base logits (model dtype).
      bias: ``[B, V]`` this step's Markov bias.
      corrected: ``[B, γ, V]`` corrected logits of the earlier steps, in ``base``'s dtype (updated in
        place), or ``None`` at the first step (a new buffer; its other slots are written by
        the later steps).
      temperatures: ``[B]`` float32, clamped (:func:`dspark_jax.sampling.clamp_temperatures`).
      greedy: ``[B]`` bool, True for rows that take the argmax (they draw no noise).
      key_words: ``uint32 [B, γ, 2]`` every step's per-row key words (the Philox keys)
        (:func:`step_key_words`; one array for the whole walk, so that XLA makes them in
        one kernel rather than one per step); this step reads slot ``step``.
      step: ``k`` (int32 scalar, may be traced).
      interpret: run through the Pallas interpreter (any backend).
      tuning: the kernels' layout (None: :data:`RACE_TUNING`; one block per program where the
        vocabulary is one block). The tokens do not depend on it.

    Returns:
      ``(tokens [B] int32, corrected [B, γ, V] in base's dtype)`` with slot ``k`` filled;
      sampling rows race on the kept (rounded) values, greedy rows take the float32 argmax.
    """
    batch, gamma, vocab = base.shape
    if not race_supported(vocab):
        raise ValueError(
            f"vocab={vocab} is not supported by the race kernel: must be at least {RACE_BLOCK}, "
            "or a power of two of at least 64"
        )
    width = race_width(vocab)
    blocks = -(-vocab // width)
    tuning = RACE_TUNING if tuning is None else tuning
    if not isinstance(tuning, RaceTuning):
        raise TypeError(f"tuning={tuning!r} is invalid: must be a RaceTuning or None")
    per_program = 1 if blocks == 1 else tuning.blocks_per_program
    kernel = functools.partial(_kernel, vocab=vocab, width=width, per_program=per_program, interpret=interpret)
    if key_words.shape != (batch, gamma, 2):
        raise ValueError(f"key_words has shape {key_words.shape}: must be (B, γ, 2) = {(batch, gamma, 2)}")
    if corrected is not None and (corrected.shape, corrected.dtype) != (base.shape, base.dtype):
        raise ValueError(
            f"corrected has shape {corrected.shape} and dtype {corrected.dtype}: must be base's, "
            f"{base.shape} {base.dtype} (the corrected logits are kept in the base logits' dtype)"
        )
    step = jnp.asarray(step, jnp.int32)
    inverse_t = inverse_temperatures(temperatures)  # logits / T is logits · RN(1/T), as in XLA's sampler
    words = key_words.astype(jnp.uint32)
    in_specs = [_whole(shape) for shape in ((1,), (batch,), (batch,), words.shape, base.shape, bias.shape)]
    args = [jnp.reshape(step, (1,)), inverse_t, greedy.astype(jnp.int32), words, base, bias]
    aliases = {}
    if corrected is not None:
        in_specs.append(_whole(corrected.shape))
        args.append(corrected)
        aliases = {len(args) - 1: 0}
    tile = pl.BlockSpec((1, per_program), lambda b, j: (b, j))
    # The pick kernel loads a power of two of columns, at least the programs' P each.
    span = max(1 << (blocks - 1).bit_length(), per_program)
    out, score, token = pl.pallas_call(
        kernel,
        grid=(batch, -(-blocks // per_program)),
        in_specs=in_specs,
        out_specs=[_whole((batch, gamma, vocab)), tile, tile],
        out_shape=[
            jax.ShapeDtypeStruct((batch, gamma, vocab), base.dtype),
            jax.ShapeDtypeStruct((batch, span), jnp.float32),
            jax.ShapeDtypeStruct((batch, span), jnp.int32),
        ],
        input_output_aliases=aliases,
        interpret=interpret,
        name="dspark_race_step",
        **triton_params(tuning.warps, 1, interpret),
    )(*args)
    pick = functools.partial(_pick_kernel, vocab=vocab, width=width, blocks=blocks, interpret=interpret)
    blocks_in = [args[0], inverse_t, args[2], words, score, token, base, bias]
    tokens = pl.pallas_call(
        pick,
        grid=(batch,),
        in_specs=[_whole(x.shape) for x in blocks_in],
        out_specs=pl.BlockSpec((1, 1), lambda b: (b, 0)),
        out_shape=jax.ShapeDtypeStruct((batch, 1), jnp.int32),
        interpret=interpret,
        name="dspark_race_pick",
        **triton_params(tuning.pick_warps, 1, interpret),
    )(*blocks_in)
    return tokens[:, 0], out


def step_key_words(keys: jax.Array, gamma: int) -> jax.Array:
    """``uint32 [B, γ, 2]``: the key words of ``step_keys(keys, k)`` for ``k < γ`` (the Philox keys).

    Args:
      keys: typed per-row keys ``[B]`` (:func:`dspark_jax.sampling.row_keys`).
      gamma: ``γ``.
    """
    return jax.vmap(lambda k: _key_words(step_keys(keys, k)), out_axes=1)(jnp.arange(gamma, dtype=jnp.uint32))


def raced_markov_walk(
    head: MarkovHead,
    base_logits: jax.Array,
    hidden: jax.Array,
    bonus: jax.Array,
    temperatures: jax.Array,
    greedy: jax.Array,
    keys: jax.Array,
    *,
    interpret: bool = False,
    tuning: RaceTuning | None = None,
) -> tuple[jax.Array, jax.Array]:
    """:func:`dspark_jax.markov.markov_walk` with the folded sampler, one :func:`race_step` per step.

    Args:
      head: the Markov head (not ``None``).
      base_logits: ``[B, γ, V]``.
      hidden: ``[B, γ, H]`` draft hidden states.
      bonus: ``[B]`` the anchor token (``prev`` of step 0).
      temperatures: ``[B]`` clamped float32 temperatures.
      greedy: ``[B]`` bool greedy rows.
      keys: typed per-row keys ``[B]`` (:func:`dspark_jax.sampling.row_keys`); step ``k``
        uses ``step_keys(keys, k)``, as :func:`dspark_jax.sampling.sample_step` does.
      interpret: run the kernel through the Pallas interpreter.
      tuning: the kernels' layout (:func:`race_step`; None: :data:`RACE_TUNING`).

    Returns:
      ``(tokens [B, γ] int32, corrected [B, γ, V] in base_logits' dtype)``, equal to the XLA
      walk's (:func:`dspark_jax.markov.markov_walk` with ``keep_dtype = base_logits.dtype``).
    """
    batch, gamma = base_logits.shape[:2]
    state, prev = head.init_state(batch), bonus.astype(jnp.int32)
    corrected, tokens = None, []
    words = step_key_words(keys, gamma)  # [B, γ, 2]
    for k in range(gamma):
        state, bias = head.step(state, prev, hidden[:, k])
        prev, corrected = race_step(
            base_logits, bias, corrected, temperatures, greedy, words, k, interpret=interpret, tuning=tuning
        )
        tokens.append(prev)
    return jnp.stack(tokens, axis=1), corrected
