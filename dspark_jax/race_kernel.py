"""One sampling step of the folded Markov walk as one Pallas (Triton) kernel on GPUs.

Shape legend: B batch, γ block slots, V vocabulary, Q = V / 4 Philox blocks per row (four
tokens each), T blocks per program, NB = ⌈Q / T⌉ programs per row.

Step ``k`` of the folded walk (:func:`dspark_jax.markov.markov_walk` with
:func:`dspark_jax.sampling.sample_step`) forms the corrected logits
``base[:, k] + bias`` in float32, keeps them in the base logits' dtype for the block's
``[B, γ, V]`` corrected logits and races the kept values against fresh exponential noise
(greedy rows take the plain argmax of the float32 sum). XLA
runs that as a noise-and-race fusion that writes its scores, a reduction that reads them
back, and, after the walk, a copy that stacks the γ steps' logits (measured on the H200 at
batch 128: 75 + 25 µs per step and 0.27 ms for the stack). :func:`race_step` does it in one
kernel per step: program ``(b, j)`` reads blocks ``[j·T, (j + 1)·T)`` of row ``b`` (tokens
``i``, ``i + Q``, ``i + 2Q`` and ``i + 3Q``, the four words of one Philox-4x32-10 block),
writes their corrected logits into slot ``k`` of the ``[B, γ, V]`` output in place (the
buffer is aliased from step to step, so nothing is stacked), hashes the noise only for
sampling rows, and writes its blocks' best score and token; a small XLA reduction picks each
row's token.

Same maths as :func:`dspark_jax.sampling.sample_step`, operation for operation (float32,
``log`` through libdevice as XLA does, division rounded to nearest as XLA's, the Philox
products through ``mul.hi.u32``/``mul.lo.u32``; ties to the lowest token id, NaN as
``-inf``), so the kernel and the XLA sampler pick the same tokens from the same keys (tested
through the Pallas interpreter; on the H200 against the XLA sampler, see README).

:func:`race_supported` says when the kernel applies (``V`` a multiple of 4 with ``Q ≥ 64``)
and :func:`use_race_kernel` whether this trace uses it (:data:`RACE_ENV`; by default on GPU
backends only). ``interpret=True`` runs it through the Pallas interpreter on any backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _whole
from dspark_jax.kernel_choice import KERNEL_CHOICES, env_choice, kernel_mode
from dspark_jax.sampling import (
    LANES,
    _key_words,
    _log_exponential,
    _max_then_lowest_id,
    best_lane,
    mul_hi_lo,
    philox4x32,
    step_keys,
)

RACE_ENV = "DSPARK_JAX_RACE"
"""Environment variable choosing the folded walk's sampling step: ``auto`` (default: the
kernel on GPUs when :func:`race_supported`), ``xla`` (never) or ``pallas`` (wherever
supported, the Pallas interpreter off GPUs)."""

RACE_CHOICES = KERNEL_CHOICES

_NO_TOKEN = np.int32(np.iinfo(np.int32).max)
_WARPS = 4  # per program


def race_choice() -> str:
    """The value of :data:`RACE_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(RACE_ENV)


def race_supported(vocab: int) -> bool:
    """True when the kernel applies: a vocabulary of at least 256 tokens that is a multiple of
    4 (so every program's blocks lie inside the row, the last program's range clamped to the
    end)."""
    return vocab % LANES == 0 and vocab >= 256


def use_race_kernel(vocab: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`race_choice`."""
    return kernel_mode(RACE_ENV, race_supported(vocab))


def _mul_hi_lo_gpu(a: jax.Array, m: np.uint32) -> tuple[jax.Array, jax.Array]:
    """:func:`dspark_jax.sampling.mul_hi_lo` through the hardware: ``mul.hi.u32`` and ``mul.lo.u32``
    (Triton's integers are signless: the operands pass as int32 bit patterns). A scalar (a
    program's key word, uniform over its tokens) takes the exact 32-bit arithmetic instead."""
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


def _tile(batch: int, quads: int) -> int:
    """Philox blocks per program: 512 (2048 tokens) from batch 32 up, 128 (512 tokens, as many
    as the pair layout's 256 pairs before; not swept again) below, so a small batch still fills
    the GPU; at most the largest power of two ≤ ``quads``. On the H200 at the 8B vocabulary,
    512 blocks and 4 warps ran batch-32 and batch-128 sampling steps fastest of 256 or 512
    blocks with 4 or 8 warps."""
    want = 512 if batch >= 32 else 128
    return min(want, 1 << (quads.bit_length() - 1))


def _divide(x: jax.Array, t: jax.Array, interpret: bool) -> jax.Array:
    """``x / t`` rounded to nearest (Triton's own float32 division is approximate; XLA's is not)."""
    t = jnp.broadcast_to(t, x.shape)
    if interpret:
        return x / t
    from jax.experimental.pallas import triton as plgpu

    [out] = plgpu.elementwise_inline_asm(
        "div.rn.f32 $0, $1, $2;",
        args=[x, t],
        constraints="=f,f,f",
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(x.shape, jnp.float32)],
    )
    return out


def _kernel(step_ref, t_ref, greedy_ref, words_ref, base_ref, bias_ref, *refs, quads, tile, interpret):
    """Program ``(b, j)``: Philox blocks ``[j·T, (j + 1)·T)`` of row ``b`` (the last range clamped to end at ``Q``).

    Refs: ``step`` ``[1]`` (an operand, so that the γ steps share one compiled kernel),
    ``t``, ``greedy`` ``[B]``, ``words`` ``[B, γ, 2]``, ``base`` ``[B, γ, V]``,
    ``bias`` ``[B, V]``, (the aliased corrected logits ``[B, γ, V]`` after step 0), then the
    outputs: corrected logits ``[B, γ, V]``, this program's best score and token ``[1, 1]``.
    """
    corrected_ref, score_ref, token_ref = refs[-3:]
    b = pl.program_id(0)
    step = step_ref[0]
    start = jnp.minimum(pl.program_id(1) * tile, quads - tile)
    lanes = [pl.ds(lane * quads + start, tile) for lane in range(LANES)]  # tokens i + l·Q
    summed = [base_ref[b, step, at].astype(jnp.float32) + bias_ref[b, at].astype(jnp.float32) for at in lanes]  # [T]
    kept = [x.astype(corrected_ref.dtype) for x in summed]  # the base logits' dtype
    for at, x in zip(lanes, kept, strict=True):
        corrected_ref[b, step, at] = x
    index = start + jax.lax.broadcasted_iota(jnp.int32, (tile,), 0)  # block i: tokens i + l·Q

    def race():  # on the kept values: q = softmax(kept / T) is the law of the pick
        counter = (index.astype(jnp.uint32), 0, 0, 0)
        mul = mul_hi_lo if interpret else _mul_hi_lo_gpu
        words = philox4x32(words_ref[b, step, 0], words_ref[b, step, 1], counter, mul=mul)
        t = t_ref[b]
        return tuple(
            _divide(x.astype(jnp.float32), t, interpret) - _log_exponential(w) for x, w in zip(kept, words, strict=True)
        )

    scores = jax.lax.cond(greedy_ref[b] != 0, lambda: tuple(summed), race)
    best, lane = best_lane(tuple(jnp.where(jnp.isnan(x), -jnp.inf, x) for x in scores))  # [T]
    token = index + lane * quads
    top = best.max()
    score_ref[...] = jnp.full((1, 1), top, jnp.float32)
    token_ref[...] = jnp.full((1, 1), jnp.where(best == top, token, _NO_TOKEN).min(), jnp.int32)


@functools.partial(jax.jit, static_argnames="interpret")
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
) -> tuple[jax.Array, jax.Array]:
    """Walk step ``step``: corrected logits, their race (or argmax), the tokens.

    Args:
      base: ``[B, γ, V]`` base logits (model dtype).
      bias: ``[B, V]`` this step's Markov bias.
      corrected: ``[B, γ, V]`` corrected logits of the earlier steps, in ``base``'s dtype (updated in
        place), or ``None`` at the first step (a new buffer; its other slots are written by
        the later steps).
      temperatures: ``[B]`` float32, clamped (:func:`dspark_jax.sampling.clamp_temperatures`).
      greedy: ``[B]`` bool, True for rows that take the argmax (they never hash noise).
      key_words: ``uint32 [B, γ, 2]`` every step's per-row key words (the Philox key)
        (:func:`step_key_words`; one array for the whole walk, so that XLA makes them in
        one kernel rather than one per step); this step reads slot ``step``.
      step: ``k`` (int32 scalar, may be traced).
      interpret: run through the Pallas interpreter (any backend).

    Returns:
      ``(tokens [B] int32, corrected [B, γ, V] in base's dtype)`` with slot ``k`` filled;
      sampling rows race on the kept (rounded) values, greedy rows take the float32 argmax.
    """
    batch, gamma, vocab = base.shape
    if not race_supported(vocab):
        raise ValueError(
            f"vocab={vocab} is not supported by the race kernel: must be a multiple of {LANES} and at least 256"
        )
    quads = vocab // LANES
    tile = _tile(batch, quads)
    blocks = -(-quads // tile)
    kernel = functools.partial(_kernel, quads=quads, tile=tile, interpret=interpret)
    if key_words.shape != (batch, gamma, 2):
        raise ValueError(f"key_words has shape {key_words.shape}: must be (B, γ, 2) = {(batch, gamma, 2)}")
    if corrected is not None and (corrected.shape, corrected.dtype) != (base.shape, base.dtype):
        raise ValueError(
            f"corrected has shape {corrected.shape} and dtype {corrected.dtype}: must be base's, "
            f"{base.shape} {base.dtype} (the corrected logits are kept in the base logits' dtype)"
        )
    in_specs = [_whole(shape) for shape in ((1,), (batch,), (batch,), key_words.shape, base.shape, bias.shape)]
    args = [
        jnp.reshape(jnp.asarray(step, jnp.int32), (1,)),
        temperatures.astype(jnp.float32),
        greedy.astype(jnp.int32),
        key_words.astype(jnp.uint32),
        base,
        bias,
    ]
    aliases = {}
    if corrected is not None:
        in_specs.append(_whole(corrected.shape))
        args.append(corrected)
        aliases = {len(args) - 1: 0}
    one = pl.BlockSpec((1, 1), lambda b, j: (b, j))
    params = {}
    if not interpret:
        from jax.experimental.pallas import triton as plgpu

        params["compiler_params"] = plgpu.CompilerParams(num_warps=_WARPS, num_stages=1)
    out, score, token = pl.pallas_call(
        kernel,
        grid=(batch, blocks),
        in_specs=in_specs,
        out_specs=[_whole((batch, gamma, vocab)), one, one],
        out_shape=[
            jax.ShapeDtypeStruct((batch, gamma, vocab), base.dtype),
            jax.ShapeDtypeStruct((batch, blocks), jnp.float32),
            jax.ShapeDtypeStruct((batch, blocks), jnp.int32),
        ],
        input_output_aliases=aliases,
        interpret=interpret,
        name="dspark_race_step",
        **params,
    )(*args)
    init = (np.float32(-np.inf), _NO_TOKEN)
    _, tokens = jax.lax.reduce((score, token), init, _max_then_lowest_id, (1,))
    return tokens, out


def step_key_words(keys: jax.Array, gamma: int) -> jax.Array:
    """``uint32 [B, γ, 2]``: the key words of ``step_keys(keys, k)`` for ``k < γ`` (the Philox keys).

    Args:
      keys: typed per-row keys ``[B]`` (:func:`dspark_jax.sampling.row_keys`).
      gamma: ``γ``.
    """
    return jax.vmap(lambda k: _key_words(step_keys(keys, k)), out_axes=1)(jnp.arange(gamma, dtype=jnp.uint32))


def raced_markov_walk(
    head,
    base_logits: jax.Array,
    hidden: jax.Array,
    bonus: jax.Array,
    temperatures: jax.Array,
    greedy: jax.Array,
    keys: jax.Array,
    *,
    interpret: bool = False,
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
        prev, corrected = race_step(base_logits, bias, corrected, temperatures, greedy, words, k, interpret=interpret)
        tokens.append(prev)
    return jnp.stack(tokens, axis=1), corrected
