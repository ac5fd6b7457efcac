"""Proposer: buckets, padding, ahead-of-time compilation, the gate and input checks."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from draft_testing import random_draft, tiny_config
from flax import nnx
from proposer_testing import CAPACITY, CFG, SLOTS, make_cache, random_call

from dspark_jax import packed_inputs
from dspark_jax import proposer as proposer_module
from dspark_jax.cache import init_context_cache
from dspark_jax.memory_gate import ENV_VAR, FoldedSampling
from dspark_jax.packed_inputs import sampling_rows
from dspark_jax.proposal import propose
from dspark_jax.proposer import CompileCounter, Proposer, batch_buckets
from dspark_jax.race_kernel import use_race_kernel
from dspark_jax.sampling import TOP_K_ALL, greedy_rows
from dspark_jax.split_round import BACKBONE_GEMM_ENV


@pytest.fixture(scope="module")
def forced(forced_session):
    """The session's precompiled FORCE proposer (``conftest.py``): ``(draft, proposer, cache)``."""
    draft, proposer, cache, _ = forced_session
    return draft, proposer, cache


def test_batch_buckets_are_powers_of_two_up_to_max_batch():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(6) == (1, 2, 4, 6)
    with pytest.raises(ValueError, match=r"max_batch=0 is invalid"):
        batch_buckets(0)


def test_no_compilation_across_200_calls_after_precompile(forced):
    draft, proposer, cache = forced
    rng = np.random.default_rng(0)
    calls = []
    for i in range(200):
        rows = int(rng.integers(1, 5))
        args = random_call(rng, draft.cfg.vocab_size, rows)
        if i % 3 == 0:  # all greedy
            args["temperatures"] = np.zeros(rows, np.float32)
        typed = jax.random.key(i)
        per_row = jax.random.split(typed, rows)
        args["key"] = [typed, jax.random.key_data(typed), per_row, jax.random.key_data(per_row)][i % 4]
        calls.append(args)
    with CompileCounter() as counter:
        blocks = [proposer(cache, **args) for args in calls]
        jax.block_until_ready(blocks)
    assert counter.count == 0 and counter.lowerings == 0
    sampled = [bool((~np.asarray(b.greedy_mask)).any()) for b in blocks]
    assert any(sampled) and not all(sampled)
    assert {b.draft_tokens.shape[0] for b in blocks} == {1, 2, 3, 4}


def test_padded_rows_never_change_real_rows(forced):
    draft, proposer, cache = forced
    rng = np.random.default_rng(1)
    args = random_call(rng, draft.cfg.vocab_size, 3)
    args["temperatures"] = np.array([0.0, 0.9, 1.4], np.float32)
    args["top_k"] = np.full(3, TOP_K_ALL)
    key = jax.random.key(77)
    padded = proposer(cache, **args, key=key)  # bucket 4
    # The same rows, unpadded, through plain propose on the gathered cache rows.
    slots = args.pop("slots")
    rows_cache = jax.tree.map(lambda x: x[:, slots], cache)
    graphdef, state = nnx.split(draft)
    direct = jax.jit(propose, static_argnums=0)(graphdef, state, rows_cache, **args, key=key)
    np.testing.assert_array_equal(np.asarray(padded.draft_tokens), np.asarray(direct.draft_tokens))
    np.testing.assert_allclose(np.asarray(padded.corrected_logits), np.asarray(direct.corrected_logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(padded.confidence), np.asarray(direct.confidence), atol=1e-6)
    # unpad=False returns the whole bucket; its first rows are the same.
    proposer.unpad = False
    try:
        whole = proposer(cache, **args, slots=slots, key=key)
    finally:
        proposer.unpad = True
    assert whole.draft_tokens.shape[0] == 4
    np.testing.assert_array_equal(np.asarray(whole.draft_tokens)[:3], np.asarray(direct.draft_tokens))
    # A fourth real row of any content leaves the first three unchanged.
    for extra in range(2):
        more = {name: np.concatenate([value, value[:1] * 0 + extra]) for name, value in args.items()}
        more["slots"] = np.concatenate([slots, [4 - extra]])
        more["temperatures"][3] = 1.0 + extra
        full = proposer(cache, **more, key=key)
        np.testing.assert_array_equal(np.asarray(full.draft_tokens)[:3], np.asarray(direct.draft_tokens))


def test_gate_reports_closed_form_and_compiled_estimates(forced):
    draft, proposer, _ = forced
    cfg, gate = draft.cfg, proposer.gate
    assert gate.mode is FoldedSampling.FORCE and gate.enabled
    kernel, interpret = use_race_kernel(cfg.vocab_size)
    noise = 0 if kernel and not interpret else 4 * cfg.vocab_size * 4  # the race kernel draws it in registers
    assert gate.closed_form_bytes == noise + 4 * cfg.gamma * cfg.vocab_size * 4
    # XLA's estimate: how much the sampling head's footprint (scratch + outputs) exceeds the
    # largest footprint of the greedy round's programs (its head and the backbone pieces).
    top = proposer.buckets[-1]

    def footprint(name):
        stats = proposer._programs[name].compiled.memory_analysis()
        return stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes

    heads = footprint(("head", top, True)), footprint(("head", top, False))
    pieces = [footprint(("piece", top, start, stop)) for start, stop in proposer._split.ranges]
    # the sampling head returns the [max_bs, γ, V] float32 logits the greedy one does not (its
    # scratch may be smaller: XLA can write the walk's logits straight into that output)
    outputs = [
        proposer._programs["head", top, s].compiled.memory_analysis().output_size_in_bytes for s in (True, False)
    ]
    assert outputs[0] - outputs[1] >= 4 * cfg.gamma * cfg.vocab_size * 4
    assert heads[0] > heads[1]
    assert gate.compiled_bytes == max(heads[0] - max(heads[1], *pieces), 0)
    assert gate.needed_bytes == gate.compiled_bytes


def test_folded_round_hook_sees_each_program_and_changes_nothing(forced):
    """The bench's hook into the round (each program's own peak) calls the same programs."""
    draft, proposer, cache = forced
    args = random_call(np.random.default_rng(5), draft.cfg.vocab_size, 4)
    args["temperatures"] = np.full(4, 0.9, np.float32)
    args["top_k"] = np.full(4, TOP_K_ALL)
    key = jax.random.key(7)
    whole = proposer(cache, **args, key=key)
    _, ints, temps = packed_inputs.host_inputs(
        *(args[k] for k in ("bonus", "prefix_lens", "temperatures", "top_k", "slots"))
    )
    packed, packed_key = proposer._pack_inputs(4, ints, temps, key)
    seen = []

    def run(program, *inputs):
        seen.append(program)
        return program(*inputs)

    hooked = proposer._folded_round(4, cache, packed, packed_key, True, run=run)
    assert len(seen) == len(proposer._split.ranges) + 1 and seen[-1] is proposer._programs["head", 4, True]
    np.testing.assert_array_equal(np.asarray(hooked.draft_tokens), np.asarray(whole.draft_tokens))
    np.testing.assert_array_equal(np.asarray(hooked.corrected_logits), np.asarray(whole.corrected_logits))


def test_bf16_draft_keeps_bf16_logits_through_the_padded_bucket_and_its_slicer():
    """A bf16 draft (not precompiled): 3 rows run in bucket 4 and are sliced back with their
    corrected logits still bf16 (the bucket's own rows, bit for bit); the tokens equal plain
    ``propose`` on the gathered rows (whose bf16 logits, from another program, may differ by
    rounding)."""
    draft = random_draft(tiny_config(**CFG, dtype="bfloat16", param_dtype="bfloat16"), seed=4)
    cache = make_cache(draft)
    proposer = Proposer(draft, max_batch=4, capacity=CAPACITY, num_slots=SLOTS, folded_sampling="force")
    args = random_call(np.random.default_rng(6), draft.cfg.vocab_size, 3)
    args["temperatures"], args["top_k"] = np.array([0.0, 0.9, 1.4], np.float32), np.array([1, TOP_K_ALL, 50])
    key = jax.random.key(8)
    block = proposer(cache, **args, key=key)
    proposer.unpad = False
    bucket = proposer(cache, **args, key=key)
    assert block.corrected_logits.dtype == bucket.corrected_logits.dtype == jnp.bfloat16
    assert block.corrected_logits.shape == (3, draft.cfg.gamma, draft.cfg.vocab_size)
    assert bucket.corrected_logits.shape[0] == 4
    np.testing.assert_array_equal(np.asarray(block.corrected_logits), np.asarray(bucket.corrected_logits)[:3])
    slots = args.pop("slots")
    rows = jax.tree.map(lambda x: x[:, slots], cache)
    direct = jax.jit(propose, static_argnums=0)(*nnx.split(draft), rows, **args, key=key)
    np.testing.assert_array_equal(np.asarray(block.draft_tokens), np.asarray(direct.draft_tokens))


def test_gate_counts_no_noise_array_where_the_race_kernel_draws_the_noise(monkeypatch):
    """With the compiled race kernel the closed form is the corrected logits alone; through the
    interpreter, or without a Markov head (no race), the float32 noise array counts too."""
    markov = tiny_config(**CFG)
    plain = tiny_config(**CFG, markov_rank=0, confidence_head_with_markov=False)
    half = tiny_config(**CFG, dtype="bfloat16", param_dtype="bfloat16")  # logits kept in bf16: 2 bytes
    for choice, cfg, noise in (
        ((True, False), markov, False),
        ((True, True), markov, True),
        ((True, False), plain, True),
        ((True, False), half, False),
    ):
        monkeypatch.setattr("dspark_jax.proposer.use_race_kernel", lambda vocab, choice=choice: choice)
        proposer = Proposer(random_draft(cfg, seed=3), max_batch=4, capacity=CAPACITY, folded_sampling="force")
        itemsize = 2 if cfg is half else 4
        want = 4 * cfg.gamma * cfg.vocab_size * itemsize + (4 * cfg.vocab_size * 4 if noise else 0)
        assert proposer.gate.closed_form_bytes == want, (choice, cfg.markov_rank, cfg.dtype)


def test_auto_gate_short_of_memory_warns_and_samples_eagerly(forced):
    draft, reference, cache = forced
    with pytest.warns(RuntimeWarning, match='pass folded_sampling="force" to fold them anyway') as caught:
        proposer = Proposer(
            draft, max_batch=1, capacity=CAPACITY, num_slots=SLOTS, folded_sampling="auto", free_bytes=1
        )
    assert ENV_VAR not in str(caught[0].message)  # the argument overrides the variable
    assert not proposer.gate.enabled and proposer.gate.free_bytes == 1
    proposer.precompile()
    rng = np.random.default_rng(2)
    calls = [dict(random_call(rng, draft.cfg.vocab_size, 1), key=jax.random.key(i)) for i in range(40)]
    with CompileCounter() as counter:
        blocks = [proposer(cache, **args) for args in calls]
        jax.block_until_ready(blocks)
    assert counter.count == 0 and counter.lowerings == 0
    assert any(not bool(np.asarray(b.greedy_mask)[0]) for b in blocks)  # some calls sampled
    # The eager path picks the same tokens as the folded one (same keys, same rows).
    for args, block in zip(calls, blocks, strict=True):
        expected = reference(cache, **args)
        np.testing.assert_array_equal(np.asarray(block.draft_tokens), np.asarray(expected.draft_tokens))
        np.testing.assert_allclose(np.asarray(block.corrected_logits), np.asarray(expected.corrected_logits), atol=1e-5)


@pytest.mark.parametrize("env", ["auto", None])
def test_auto_warning_names_the_environment_variable_when_the_mode_came_from_it(monkeypatch, env):
    """Without the argument the mode comes from the variable (or the AUTO default), so setting
    the variable is advice that works; with the argument it would do nothing (the test above)."""
    draft = random_draft(tiny_config(**CFG), seed=0)
    if env is None:
        monkeypatch.delenv(ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(ENV_VAR, env)
    with pytest.warns(RuntimeWarning, match=re.escape(f'set {ENV_VAR}=FORCE (or pass folded_sampling="force")')):
        proposer = Proposer(draft, max_batch=1, capacity=CAPACITY, free_bytes=1)
    assert proposer.gate.mode is FoldedSampling.AUTO and not proposer.gate.enabled
    # With the argument given, the variable (set to FORCE here) is not read and not named.
    monkeypatch.setenv(ENV_VAR, "force")
    with pytest.warns(RuntimeWarning, match=r"disabled") as caught:
        Proposer(draft, max_batch=1, capacity=CAPACITY, folded_sampling=FoldedSampling.AUTO, free_bytes=1)
    assert ENV_VAR not in str(caught[0].message) and 'pass folded_sampling="force"' in str(caught[0].message)


def test_a_nan_temperature_row_of_propose_is_drafted_greedily():
    """``propose`` checks no values: a NaN temperature must make its row greedy (it used to race
    on NaN scores and draft token 0 in every slot) and leave the other rows as they were."""
    draft = random_draft(tiny_config(**CFG), seed=0)
    cache = make_cache(draft)
    graphdef, state = nnx.split(draft)
    step = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")
    rng = np.random.default_rng(8)
    args = dict(
        bonus=rng.integers(0, draft.cfg.vocab_size, 4),
        prefix_lens=np.array([6, 3, 0, 5]),
        top_k=np.full(4, TOP_K_ALL),
        slots=np.array([3, 0, 4, 1]),
        key=jax.random.key(9),
    )
    temps = np.array([np.nan, 0.9, 0.0, 1.4], np.float32)
    got = step(graphdef, state, cache, temperatures=temps, **args)
    zero = step(graphdef, state, cache, temperatures=np.nan_to_num(temps, nan=0.0), **args)  # row 0 greedy by T = 0
    greedy = step(graphdef, state, cache, temperatures=temps, **args, fold_sampling=False)  # every row greedy
    np.testing.assert_array_equal(np.asarray(got.greedy_mask), [True, False, True, False])
    np.testing.assert_array_equal(np.asarray(got.draft_tokens)[0], np.asarray(greedy.draft_tokens)[0])
    assert np.asarray(got.draft_tokens)[0].any()  # the greedy tokens are not the NaN race's zeros
    np.testing.assert_array_equal(np.asarray(got.draft_tokens), np.asarray(zero.draft_tokens))
    np.testing.assert_array_equal(np.asarray(got.corrected_logits), np.asarray(zero.corrected_logits))


def test_mode_comes_from_the_environment_variable(monkeypatch):
    draft = random_draft(tiny_config(**CFG), seed=0)
    monkeypatch.setenv(ENV_VAR, "off")
    proposer = Proposer(draft, max_batch=2, capacity=CAPACITY)
    assert proposer.gate.mode is FoldedSampling.OFF and not proposer.gate.enabled


BAD_CALLS = {
    "batch-above-max": (
        dict(rows=5),
        ValueError,
        r"batch size B=5 \(len\(bonus\)\) is too large: must be <= max_batch=4",
    ),
    "slot-out-of-range": (dict(slots=np.array([0, 5])), ValueError, r"slots\[1\]=5 is out of range"),
    "bonus-out-of-vocab": (dict(bonus=np.array([3, 40])), ValueError, r"bonus\[1\]=40 is out of range"),
    "mismatched-batch": (dict(top_k=np.array([1, 1, 1])), ValueError, r"top_k has shape \(3,\)"),
    "temperature-nan": (dict(temperatures=np.array([np.nan, 1.0], np.float32)), ValueError, r"temperatures\[0\]=nan"),
    "temperature-negative": (dict(temperatures=np.array([1.0, -2.0], np.float32)), ValueError, r"temperatures\[1\]"),
    "key-wrong-type": (dict(key=np.zeros(2, np.int64)), TypeError, r"key has dtype int64"),
    # values the uint32 packing would wrap into range are refused first
    "bonus-negative": (dict(bonus=np.array([3, -1])), ValueError, r"bonus\[1\]=-1 is out of range"),
    "slot-negative": (dict(slots=np.array([-1, 0], np.int8)), ValueError, r"slots\[0\]=-1 is out of range"),
    "top-k-wraps": (dict(top_k=np.array([1, 2**32 + 5])), ValueError, r"top_k\[1\]=4294967301 is out of range"),
    "bonus-bool": (dict(bonus=np.array([True, False])), TypeError, r"bonus has dtype bool"),
    "temperature-float32-inf": (dict(temperatures=np.array([1e39, 1.0])), ValueError, r"finite in float32"),
    "cache-wrong-dtype": (dict(cache_dtype=np.float16), ValueError, r"this Proposer was built for"),
    "cache-wrong-capacity": (dict(capacity=CAPACITY + 1), ValueError, r"this Proposer was built for"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_call_raises_before_any_compilation(forced, case):
    draft, proposer, cache = forced
    change, error, message = BAD_CALLS[case]
    change = dict(change)
    rows = change.pop("rows", 2)
    args = dict(
        bonus=np.arange(rows) % draft.cfg.vocab_size,
        prefix_lens=np.zeros(rows, int),
        temperatures=np.ones(rows, np.float32),
        top_k=np.full(rows, TOP_K_ALL),
        key=jax.random.key(0),
        slots=np.arange(rows) % SLOTS,
    )
    if "capacity" in change:
        shape = (*proposer.cache_shape[:2], change.pop("capacity"), *proposer.cache_shape[3:])
        cache = type(cache)(k=np.zeros(shape, np.float32), v=np.zeros(shape, np.float32))
    if "cache_dtype" in change:
        dtype = change.pop("cache_dtype")
        cache = type(cache)(k=np.zeros(proposer.cache_shape, dtype), v=np.zeros(proposer.cache_shape, dtype))
    args.update(change)
    with CompileCounter() as counter, pytest.raises(error, match=message):
        proposer(cache, **args)
    assert counter.count == 0 and counter.lowerings == 0


def test_any_integer_dtype_and_sequences_draft_the_same_rows(forced):
    """The quick input check (one vectorised range test, note 58) takes every integer dtype,
    integer temperatures and plain lists, and packs the same values as int64 arrays."""
    draft, proposer, cache = forced
    args = random_call(np.random.default_rng(9), draft.cfg.vocab_size, 3)
    key = jax.random.key(3)
    reference = proposer(cache, **args, key=key)
    other = dict(
        bonus=args["bonus"].astype(np.uint64),
        prefix_lens=[int(n) for n in args["prefix_lens"]],
        temperatures=args["temperatures"].astype(np.float64),
        top_k=args["top_k"].astype(np.int32),
        slots=args["slots"].astype(np.uint8),
    )
    block = proposer(cache, **other, key=key)
    np.testing.assert_array_equal(np.asarray(block.draft_tokens), np.asarray(reference.draft_tokens))
    np.testing.assert_array_equal(np.asarray(block.corrected_logits), np.asarray(reference.corrected_logits))
    rows, ints, temps = packed_inputs.host_inputs(
        *(other[k] for k in ("bonus", "prefix_lens", "temperatures", "top_k", "slots"))
    )
    assert rows == 3 and ints.dtype == np.int64 and temps.dtype == np.float32
    np.testing.assert_array_equal(ints, np.stack([args[k] for k in ("slots", "bonus", "prefix_lens", "top_k")], axis=1))
    greedy_ints = dict(args, temperatures=np.zeros(3, np.int64))  # integer temperatures: 0 = greedy
    np.testing.assert_array_equal(np.asarray(proposer(cache, **greedy_ints, key=key).greedy_mask), np.ones(3, bool))


def test_a_bad_value_found_after_the_launch_drops_that_round_only(forced, monkeypatch):
    """Values are checked while the precompiled round runs (note 58): the call raises, and
    the next call (the twin programs' turn moved on) drafts as if the bad one never ran."""
    draft, proposer, cache = forced
    args = random_call(np.random.default_rng(11), draft.cfg.vocab_size, 4)
    key = jax.random.key(5)
    before = proposer(cache, **args, key=key)
    bad = dict(args, prefix_lens=np.array([0, 1, CAPACITY, 2]))
    with CompileCounter() as counter, pytest.raises(ValueError, match=r"prefix_lens\[2\]=\d+ is out of range"):
        proposer(cache, **bad, key=key)
    assert counter.count == 0
    after = proposer(cache, **args, key=key)
    np.testing.assert_array_equal(np.asarray(after.draft_tokens), np.asarray(before.draft_tokens))
    np.testing.assert_array_equal(np.asarray(after.corrected_logits), np.asarray(before.corrected_logits))
    # the last line of defence names the values even if the validator let them through
    monkeypatch.setattr(proposer_module, "validate_proposal_inputs", lambda *a, **k: None)
    with pytest.raises(
        ValueError,
        match=r"per-row inputs out of range: .* allowed slot in \[0, 4\], bonus in \[0, 39\], prefix_len in \[0, 8\]",
    ):
        proposer(cache, **bad, key=key)


def test_in_graph_clamp_keeps_wrapped_values_inside_their_ranges():
    """Until the host's check raises, a round's reads stay inside the cache and the tables:
    values that wrapped in the uint32 packing (negative, beyond 2³¹) clamp to [0, limit]."""
    limits = (3, 39, 10, 2**31 - 1)
    ints = np.array([[0, 5, 10, 1], [2**32 - 1, 40, 11, 2**31], [3, 2**31 + 7, 2**32 - 2, 2**30]], np.uint64)
    packed = np.zeros((3, 8), np.uint32)
    packed[:, :4] = ints.astype(np.uint32)
    got = np.asarray(packed_inputs.row_ints(jnp.asarray(packed), limits))
    np.testing.assert_array_equal(got, [[0, 5, 10, 1], [0, 39, 10, 0], [3, 0, 0, 2**30]])


def test_every_key_form_samples_the_same_rows(forced):
    """One typed key, its raw data, and the per-row keys ``fold_in(key, b)`` (typed or raw)
    are the same keys to the round: the packed inputs and the key argument agree."""
    draft, proposer, cache = forced
    rng = np.random.default_rng(5)
    args = random_call(rng, draft.cfg.vocab_size, 3)
    args["temperatures"] = np.array([1.0, 0.9, 1.4], np.float32)
    args["top_k"] = np.full(3, TOP_K_ALL)
    key = jax.random.key(123)
    per_row = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, jnp.arange(3, dtype=jnp.uint32))
    forms = [key, jax.random.key_data(key), np.asarray(jax.random.key_data(key)), per_row, jax.random.key_data(per_row)]
    blocks = [proposer(cache, **args, key=k) for k in forms]
    for block in blocks[1:]:
        np.testing.assert_array_equal(np.asarray(block.draft_tokens), np.asarray(blocks[0].draft_tokens))
        np.testing.assert_array_equal(np.asarray(block.corrected_logits), np.asarray(blocks[0].corrected_logits))
    other = proposer(cache, **args, key=jax.random.key(124))
    assert not np.array_equal(np.asarray(other.draft_tokens), np.asarray(blocks[0].draft_tokens))


def _spy_rounds(proposer, monkeypatch):
    """Records the packed inputs each round of ``proposer`` gets (a NumPy array from the
    host path, a device array from the device path)."""
    packed_seen, run = [], proposer._folded_round

    def spy(bucket, cache, packed, *rest, **kwargs):
        packed_seen.append(packed)
        return run(bucket, cache, packed, *rest, **kwargs)

    monkeypatch.setattr(proposer, "_folded_round", spy)
    return packed_seen


def test_device_inputs_are_packed_on_the_device_and_draft_the_same_rows(forced, monkeypatch):
    """Inputs already on the device (notes 59, 62) are packed on the device: the packed
    array is the host packing's, bit for bit (negative and wrapped values, per-row keys,
    padding included), and the blocks equal the host inputs' blocks; bucket-sized int32
    inputs with one key go to the precompiled front program, which packs them itself (its
    packed output and residual stream equal the first piece's of the host packing; nothing
    compiles), others to the jitted packing and the first piece.

    The front and the first piece are two programs, compiled apart: on a GPU XLA's
    autotuner may pick another GEMM tiling for each, which sums in another order, so there
    their floats agree to float32 rounding (measured on the H200: 6.7e-6 at most) and the
    tokens exactly; on the CPU bit for bit."""
    draft, proposer, cache = forced
    tol = 0.0 if jax.default_backend() == "cpu" else 1e-4
    rng = np.random.default_rng(21)
    width = packed_inputs.KEY_COL + jax.random.key_data(jax.random.key(0)).shape[-1]  # 6 + the key's words
    for rows, bucket in ((3, 4), (4, 4), (1, 1)):
        args = random_call(rng, draft.cfg.vocab_size, rows)
        key = jax.random.key(rows)
        keys = [key, jax.random.split(key, rows), jax.random.key_data(jax.random.split(key, rows))]
        for k in keys:
            ints = np.stack([args[c] for c in ("slots", "bonus", "prefix_lens", "top_k")], axis=1)
            ints[0, 2], ints[-1, 3] = -3, 2**31 + 5  # wrapped as the host packing wraps them
            host, _ = proposer._pack_inputs(bucket, ints, args["temperatures"], k)
            row_keys, _ = proposer._round_key(k)
            slots, bonus, prefix_lens = (jnp.asarray(ints[:, i]) for i in range(3))  # int32: -3 wraps alike
            top_k = jnp.asarray(ints[:, 3].astype(np.uint32))  # 2³¹ + 5 fits uint32, not int32
            temps = jnp.asarray(args["temperatures"])
            on_device = jax.jit(packed_inputs.pack_on_device, static_argnums=(0, 1))(
                bucket, width, bonus, prefix_lens, temps, top_k, slots, row_keys
            )
            assert on_device.shape == (bucket, width)
            np.testing.assert_array_equal(np.asarray(on_device), host)
            if rows == bucket and row_keys is None:  # what the front program takes
                front = proposer_module._Front(bonus, prefix_lens, temps, top_k.astype(jnp.int32), slots)
                assert proposer._front_takes(bucket, front)
                x, packed = proposer._programs[front.name(bucket)](proposer._sub_leaves["front",], cache, *front)
                stop = proposer._split.ranges[0][1]
                piece = proposer._programs["piece", bucket, 0, stop]
                want_x, _ = piece(proposer._sub_leaves["piece", 0, stop], None, cache, host)
                np.testing.assert_array_equal(np.asarray(packed), host)
                np.testing.assert_allclose(np.asarray(x), np.asarray(want_x), rtol=tol, atol=tol)
                assert not proposer._front_takes(bucket, front._replace(bonus=bonus[:-1]))
                assert not proposer._front_takes(bucket, front._replace(temperatures=temps.astype(jnp.bfloat16)))
    packed_seen = _spy_rounds(proposer, monkeypatch)
    for rows in (3, 4):
        args = random_call(rng, draft.cfg.vocab_size, rows)
        args["temperatures"][0] = 0.8  # a sampling row
        args["top_k"][0] = TOP_K_ALL
        device_args = {
            name: jnp.asarray(value, jnp.int32 if name != "temperatures" else jnp.float32)
            for name, value in args.items()
        }
        for key in (jax.random.key(rows), jax.random.split(jax.random.key(rows), rows)):
            expected = proposer(cache, **args, key=key)
            with CompileCounter() as counter:
                block = proposer(cache, **device_args, key=key)
            assert isinstance(packed_seen[-2], np.ndarray)
            if rows == 4 and key.ndim == 0:  # a front program takes them
                assert isinstance(packed_seen[-1], proposer_module._Front)
            else:  # another row count or per-row keys: packed on the host, nothing compiled
                assert isinstance(packed_seen[-1], np.ndarray)
            assert counter.count == 0 and counter.lowerings == 0
            for got, want in zip(jax.tree.leaves(block), jax.tree.leaves(expected), strict=True):
                assert got.shape == want.shape and got.dtype == want.dtype
                got, want = np.asarray(got), np.asarray(want)
                if np.issubdtype(got.dtype, np.floating):
                    np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=tol, atol=tol)
                else:
                    np.testing.assert_array_equal(got, want)  # tokens, greedy mask


def test_device_inputs_of_other_dtypes_and_bfloat16_temperatures_compile_nothing(forced):
    """After ``precompile``, device inputs no front program takes (uint32 or int64-like ids,
    float16 / bfloat16 / integer temperatures) go through the host packing: no compile, the
    host path's rows."""
    draft, proposer, cache = forced
    rng = np.random.default_rng(8)
    args = random_call(rng, draft.cfg.vocab_size, 3)
    args["temperatures"] = np.array([0.0, 0.875, 1.5], np.float32)  # exact in bfloat16
    key = jax.random.key(9)
    expected = proposer(cache, **args, key=key)
    variants = [
        {**args, "temperatures": args["temperatures"].astype(ml_dtypes.bfloat16)},  # host bf16
        {
            **{n: jnp.asarray(v) for n, v in args.items()},
            "temperatures": jnp.asarray(args["temperatures"], jnp.bfloat16),
        },
        {
            **{n: jnp.asarray(v, jnp.uint32) for n, v in args.items() if n != "temperatures"},
            "temperatures": jnp.asarray(args["temperatures"], jnp.float16),
        },
        {
            **{n: jnp.asarray(v, jnp.int32) for n, v in args.items() if n != "temperatures"},
            "temperatures": jnp.asarray([0, 1, 1], jnp.int32),
        },
    ]
    for i, call in enumerate(variants):
        with CompileCounter() as counter:
            block = proposer(cache, **call, key=key)
            jax.block_until_ready(block)
        assert counter.count == 0 and counter.lowerings == 0, i
        if i < 3:  # the same temperatures: the same rows
            np.testing.assert_array_equal(np.asarray(block.draft_tokens), np.asarray(expected.draft_tokens))


def test_a_bucket_compiles_its_front_program_at_its_first_device_call():
    """Without ``precompile``, a bucket's first call with device inputs compiles the front
    program it needs (slots given or not) once; later calls compile nothing and draft what
    the host inputs draft."""
    draft = random_draft(tiny_config(**CFG), seed=7)
    proposer = Proposer(draft, max_batch=2, capacity=CAPACITY, num_slots=SLOTS, executable_store=False)
    cache = make_cache(draft, seed=3)
    args = random_call(np.random.default_rng(31), draft.cfg.vocab_size, 2)
    args["temperatures"] = np.zeros(2, np.float32)
    key = jax.random.key(4)
    for slots_given in (True, False):
        call = args if slots_given else {n: v for n, v in args.items() if n != "slots"}
        want = proposer(cache, **call, key=key).draft_tokens  # the first compiles the greedy round
        on_device = {n: jnp.asarray(v, jnp.float32 if n == "temperatures" else jnp.int32) for n, v in call.items()}
        for compiles in (1, 0):
            with CompileCounter() as counter:
                got = proposer(cache, **on_device, key=key, sampling=False).draft_tokens
            assert counter.count == compiles
            assert ("front", 2, slots_given) in proposer._programs
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not any(name[0] == "front" and name[1] == 1 for name in proposer._programs)


def test_device_inputs_are_checked_after_the_launch(forced, monkeypatch):
    """A bad value on the device is read back after its round was launched and refused with
    the field's message (the round dropped, the next call unchanged); inputs the device
    packing cannot take go through the host path's checks; where the round is not ready the
    host path runs it."""
    draft, proposer, cache = forced
    args = random_call(np.random.default_rng(23), draft.cfg.vocab_size, 4)
    device_args = {name: jnp.asarray(value) for name, value in args.items()}
    key = jax.random.key(9)
    before = proposer(cache, **device_args, key=key)
    packed_seen = _spy_rounds(proposer, monkeypatch)
    bad = dict(device_args, prefix_lens=jnp.array([0, 1, CAPACITY, 2]))
    with pytest.raises(ValueError, match=r"prefix_lens\[2\]=\d+ is out of range"):
        proposer(cache, **bad, key=key)
    assert len(packed_seen) == 1 and isinstance(packed_seen[0], proposer_module._Front)  # launched, then refused
    bad = dict(device_args, bonus=jnp.array([0, 1, draft.cfg.vocab_size, 2]))
    with pytest.raises(ValueError, match=r"bonus\[2\]=\d+ is out of range"):
        proposer(cache, **bad, key=key)
    short = dict(device_args, top_k=device_args["top_k"][:3])
    with pytest.raises(ValueError, match=r"top_k has shape \(3,\)"):
        proposer(cache, **short, key=key)
    assert len(packed_seen) == 2  # the short one never launched
    after = proposer(cache, **device_args, key=key)
    np.testing.assert_array_equal(np.asarray(after.draft_tokens), np.asarray(before.draft_tokens))
    monkeypatch.setattr(proposer, "_ready", lambda bucket, sampling: False)
    fallback = proposer(cache, **device_args, key=key)
    assert isinstance(packed_seen[-1], np.ndarray)
    np.testing.assert_array_equal(np.asarray(fallback.draft_tokens), np.asarray(before.draft_tokens))


@pytest.mark.parametrize("on_device", [False, True])
def test_sampling_argument_picks_the_round_and_refuses_a_sampling_row_for_false(forced, on_device):
    """``sampling=True`` runs the sampling-capable round for greedy rows (same tokens, the
    corrected logits returned), ``sampling=False`` with a sampling row raises naming the
    row, anything but a bool or None is a TypeError."""
    draft, proposer, cache = forced
    args = random_call(np.random.default_rng(25), draft.cfg.vocab_size, 3)
    args["temperatures"] = np.zeros(3, np.float32)
    put = (lambda a: {n: jnp.asarray(v) for n, v in a.items()}) if on_device else dict
    key = jax.random.key(2)
    greedy = proposer(cache, **put(args), key=key)
    forced_sampling = proposer(cache, **put(args), key=key, sampling=True)
    assert greedy.corrected_logits.shape[-1] == 0
    assert forced_sampling.corrected_logits.shape == (3, draft.cfg.gamma, draft.cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(forced_sampling.draft_tokens), np.asarray(greedy.draft_tokens))
    np.testing.assert_array_equal(
        np.asarray(proposer(cache, **put(args), key=key, sampling=False).draft_tokens), np.asarray(greedy.draft_tokens)
    )
    args["temperatures"][1], args["top_k"][1] = 0.7, 5
    with pytest.raises(ValueError, match=r"sampling=False but rows \[1\] sample"):
        proposer(cache, **put(args), key=key, sampling=False)
    with pytest.raises(TypeError, match=r"sampling='yes' is invalid: must be True, False or None"):
        proposer(cache, **put(args), key=key, sampling="yes")


def test_a_traced_call_names_the_traced_inputs_and_points_to_propose(forced):
    draft, proposer, cache = forced
    args = random_call(np.random.default_rng(27), draft.cfg.vocab_size, 2)
    rows = [args[n] for n in ("prefix_lens", "temperatures", "top_k")]
    key = jax.random.key(0)

    def traced(bonus, k):
        block = proposer(type(cache)(k=k, v=cache.v), bonus, *rows, key, slots=args["slots"])
        return block.draft_tokens

    message = r"traced bonus, cache \(inside jax.jit, vmap or grad\).*call dspark_jax.propose in traced code instead"
    with pytest.raises(TypeError, match=message):
        jax.jit(traced)(jnp.asarray(args["bonus"]), cache.k)


def test_the_mode_of_device_inputs_is_read_once_per_pair_of_arrays(forced, monkeypatch):
    """Without ``sampling``, device inputs' temperatures and top-k are read before the launch,
    once for as long as the caller passes the same two arrays (immutable)."""
    _, proposer, _ = forced
    temps, top_k = jnp.array([0.0, 0.8]), jnp.array([1, 5])
    assert proposer._mode_of(temps, top_k) is True

    def no_reads(*args):
        raise AssertionError("read again")

    monkeypatch.setattr(proposer_module.jax, "device_get", no_reads)
    assert proposer._mode_of(temps, top_k) is True
    with pytest.raises(AssertionError, match="read again"):
        proposer._mode_of(jnp.array([0.0, 0.8]), top_k)  # equal values, another array: read


def test_the_mode_is_read_again_when_only_top_k_changes(forced):
    """The kept mode is keyed on both arrays: the same temperatures with a new top-k (all 1,
    then 50) must take the sampling round, and back."""
    _, proposer, _ = forced
    temps = jnp.array([0.8, 0.8])
    assert proposer._mode_of(temps, jnp.array([1, 1])) is False
    assert proposer._mode_of(temps, jnp.array([50, 50])) is True
    assert proposer._mode_of(temps, jnp.array([1, 1])) is False


def test_host_sampling_rows_are_the_complement_of_greedy_rows():
    """``packed_inputs.sampling_rows`` (the host's mode read) against ``sampling.greedy_rows``
    (the programs' own) on every kind of row: top-k 0, 1, 2, huge; temperature 0, 0.5, NaN."""
    ks = np.array([0, 1, 2, TOP_K_ALL] * 3, np.int32)
    temps = np.repeat(np.array([0.0, 0.5, np.nan], np.float32), 4)
    want = ~np.asarray(greedy_rows(jnp.asarray(temps), jnp.asarray(ks)))
    np.testing.assert_array_equal(sampling_rows(ks, temps), want)
    assert want.sum() == 2  # top-k 2 and huge at T 0.5


@pytest.mark.parametrize("workers", [1, 2])
def test_precompile_builds_each_program_once_gate_first_then_largest_buckets(workers, monkeypatch):
    """Every program is compiled exactly once (a backbone piece shared by both modes too, even
    while its first compile is still pending in the pool), in the order the docstring gives:
    the largest bucket's greedy round and sampling head (the gate's), the other greedy
    rounds largest first, the other sampling heads, the device packings, then the slicers."""
    draft = random_draft(tiny_config(**CFG), seed=7)
    proposer = Proposer(
        draft, max_batch=4, capacity=CAPACITY, num_slots=SLOTS, folded_sampling="force", executable_store=False
    )
    installed, install = [], proposer._install
    proposer._install = lambda name, compiled: installed.append(name) or install(name, compiled)
    submitted, options, submit = [], {}, proposer_module._Compiles.submit

    def record(name, job):
        submitted.append(name)
        options[name] = getattr(job, "keywords", {}).get("compiler_options")
        return name, job

    monkeypatch.setattr(
        proposer_module._Compiles, "submit", lambda self, jobs: submit(self, (record(*j) for j in jobs))
    )
    monkeypatch.setenv(BACKBONE_GEMM_ENV, "cublas")  # on the CPU the option changes nothing
    with CompileCounter() as counter:
        proposer.precompile(workers=workers)
    ranges = proposer._split.ranges
    greedy = [[*(("piece", b, *r) for r in ranges), ("head", b, False)] for b in (4, 2, 1)]
    want = [*greedy[0], ("head", 4, True), *greedy[1], *greedy[2], ("head", 2, True), ("head", 1, True)]
    want += [("front", b, slots) for b in (4, 2, 1) for slots in (False, True)]
    want += [("slicer", 3, 4, False), ("slicer", 3, 4, True)]
    assert submitted == want
    assert sorted(installed, key=repr) == sorted(want, key=repr)  # in parallel, the gate's first
    assert counter.count == len(want)
    assert proposer.gate.compiled_bytes is not None
    # the backbone pieces (device-input fronts too) compile with cuBLAS GEMMs asked for, the
    # heads and slicers with XLA's defaults
    assert {name for name, o in options.items() if o} == {name for name in want if name[0] in ("piece", "front")}
    assert all(o in (None, {"xla_gpu_enable_triton_gemm": False}) for o in options.values())


def test_precompile_error_while_lowering_propagates_and_installs_nothing_more(monkeypatch):
    draft = random_draft(tiny_config(**CFG), seed=7)
    proposer = Proposer(draft, max_batch=4, capacity=CAPACITY, num_slots=SLOTS, executable_store=False)

    def broken(rows, sampling):
        raise RuntimeError(f"lowering the slicer for {rows} rows failed")

    monkeypatch.setattr(proposer, "_lower_slicer", broken)
    with pytest.raises(RuntimeError, match="slicer for 3 rows"):
        proposer.precompile(workers=2)
    assert not proposer._slicers


def test_numpy_integer_sizes_are_taken_as_ints():
    draft = random_draft(tiny_config(**CFG), seed=0)
    proposer = Proposer(
        draft, max_batch=np.int64(2), capacity=np.int64(CAPACITY), num_slots=np.int32(3), executable_store=False
    )
    assert proposer.buckets == (1, 2) and type(proposer.max_batch) is int
    assert proposer.cache_shape[1:3] == (3, CAPACITY) and all(type(n) is int for n in proposer.cache_shape)
    assert batch_buckets(np.uint8(4)) == (1, 2, 4)


@pytest.mark.parametrize(
    ("cache_dtype", "message"),
    [(jnp.int32, r"cache_dtype=int32 is invalid"), ("float33", r"cache_dtype='float33' is invalid")],
)
def test_a_non_floating_cache_dtype_is_refused_at_construction(cache_dtype, message):
    draft = random_draft(tiny_config(**CFG), seed=0)
    with pytest.raises(TypeError, match=rf"{message}: must be a floating dtype"):
        Proposer(draft, max_batch=2, capacity=CAPACITY, cache_dtype=cache_dtype, executable_store=False)


def test_flags_that_are_not_bools_are_refused_at_construction():
    """``unpad="no"`` was true; ``twin_programs`` also takes None (twins on GPUs only)."""
    draft = random_draft(tiny_config(**CFG), seed=0)
    for flags, message in ((dict(unpad="no"), "unpad='no' is invalid"), (dict(twin_programs=0), "twin_programs=0")):
        with pytest.raises(TypeError, match=message):
            Proposer(draft, max_batch=2, capacity=CAPACITY, executable_store=False, **flags)


@pytest.mark.parametrize(
    ("gate", "message"),
    [
        (dict(free_bytes=-1), r"free_bytes=-1 is invalid: must be None or an integer >= 0 \(bytes\)"),
        (dict(free_bytes="x"), r"free_bytes='x' is invalid"),
        (dict(free_bytes=1.5), r"free_bytes=1.5 is invalid"),
        (dict(free_bytes=True), r"free_bytes=True is invalid"),
        (dict(headroom=-5), r"headroom=-5 is invalid: must be an integer >= 0 \(bytes\)"),
        # a NaN headroom turned folded sampling off without a word
        (dict(headroom=float("nan")), r"headroom=nan is invalid"),
        (dict(headroom=None), r"headroom=None is invalid"),
    ],
)
def test_bad_gate_sizes_are_refused_at_construction(gate, message):
    draft = random_draft(tiny_config(**CFG), seed=0)
    with pytest.raises(ValueError, match=message):
        Proposer(draft, max_batch=2, capacity=CAPACITY, folded_sampling="auto", executable_store=False, **gate)


def test_a_draft_of_the_wrong_type_is_refused_at_construction():
    """None or the draft's config in place of the draft failed on a missing attribute."""
    cfg = tiny_config(**CFG)
    for wrong, name in ((None, "NoneType"), (cfg, "DraftConfig")):
        with pytest.raises(TypeError, match=rf"draft must be a DSparkDraft, got {name}"):
            Proposer(wrong, max_batch=2, capacity=CAPACITY, executable_store=False)


@pytest.mark.parametrize("workers", [0, -1, "2", 1.5, True])
def test_bad_precompile_workers_are_refused_before_any_compilation(workers):
    draft = random_draft(tiny_config(**CFG), seed=0)
    proposer = Proposer(draft, max_batch=1, capacity=CAPACITY, folded_sampling="off", executable_store=False)
    with CompileCounter() as counter, pytest.raises(ValueError, match=rf"workers={workers!r} is invalid"):
        proposer.precompile(workers=workers)
    assert counter.count == 0 and counter.lowerings == 0


def test_a_call_without_slots_and_more_rows_than_slots_says_rows_use_the_first_slots():
    """Rows without ``slots`` draft slots 0..B−1: with 2 slots, 3 rows must name the slots."""
    draft = random_draft(tiny_config(**CFG), seed=0)
    proposer = Proposer(
        draft, max_batch=4, capacity=CAPACITY, num_slots=2, folded_sampling="force", executable_store=False
    )
    cache = init_context_cache(draft.cfg, 2, CAPACITY)
    args = dict(bonus=np.arange(3), prefix_lens=np.zeros(3, int), temperatures=np.zeros(3), top_k=np.ones(3, int))
    with (
        CompileCounter() as counter,
        pytest.raises(
            ValueError,
            match=r"B=3 .* too large for a call without slots: its rows use cache slots 0..B-1, .* num_slots=2",
        ),
    ):
        proposer(cache, **args, key=jax.random.key(0))
    assert counter.count == 0


@pytest.mark.parametrize("temperature", [-1e-30, -0.5, -1.0])
@pytest.mark.parametrize("on_device", [False, True])
def test_a_negative_temperature_is_refused_after_precompile(forced, on_device, temperature):
    """Temperatures must be >= 0 (0 = greedy): a slightly negative one is refused as a large
    one is, by the quick check (note 58) on host inputs and on inputs already on the device."""
    draft, proposer, cache = forced
    args = dict(
        bonus=np.array([3, 5], np.int32),
        prefix_lens=np.array([2, 4], np.int32),
        temperatures=np.array([1.0, temperature], np.float32),
        top_k=np.full(2, TOP_K_ALL, np.int32),
        slots=np.array([1, 3], np.int32),
    )
    if on_device:
        args = {name: jnp.asarray(value) for name, value in args.items()}
    with pytest.raises(ValueError, match=r"temperatures\[1\]=-[0-9.e-]+ is invalid: must be >= 0"):
        proposer(cache, **args, key=jax.random.key(0))


def test_the_closed_gate_warns_once_however_often_it_is_planned_closed():
    """A Proposer warns once that sampling takes the eager path, even where the gate is
    planned closed again (as precompile re-plans it with XLA's estimate)."""
    import warnings

    from dspark_jax.memory_gate import GIB, plan_folded_sampling

    draft = random_draft(tiny_config(**CFG), seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a repeated warning is not hidden by the filters
        proposer = Proposer(draft, max_batch=1, capacity=CAPACITY, folded_sampling="auto", free_bytes=GIB // 2)
        assert not proposer.gate.enabled
        for extra in (GIB // 4, GIB // 8):  # short of the 1 GiB headroom again
            replanned = plan_folded_sampling(proposer.gate.mode, compiled_bytes=extra, **proposer._gate_kwargs())
            proposer._set_gate(replanned)
            assert not proposer.gate.enabled and proposer.gate.compiled_bytes == extra
    disabled = [w for w in caught if issubclass(w.category, RuntimeWarning) and "disabled" in str(w.message)]
    assert len(disabled) == 1
