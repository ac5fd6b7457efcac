"""Bad input to the public functions an input audit found unchecked: each used to return
quietly wrong output or fail with a low-level error; each is now refused, naming the argument."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import TRAINING_TARGET, random_draft, tiny_config
from flax import nnx

from dspark_jax import generation, sampling
from dspark_jax.cache import ContextCache, context_mask, fill_context, init_context_cache, write_context
from dspark_jax.calibration import fit_sts_temperature
from dspark_jax.draft_training import (
    check_draft_fits,
    default_draft_config,
    distillation_data,
    draft_loss,
    evaluate_draft,
)
from dspark_jax.evaluate import compare_drafts, measure_tau
from dspark_jax.generation import generate, measure_verify_schedule, verify_widths
from dspark_jax.markov import make_markov_head, markov_walk
from dspark_jax.target import Qwen3Target
from dspark_jax.verification import required_filter_width, sample_tokens, schedule_verify_lengths, target_probs

TARGET = Qwen3Target(TRAINING_TARGET, rngs=nnx.Rngs(0))
DRAFT_CFG = default_draft_config(TRAINING_TARGET, mask_token_id=31, gamma=3, markov_rank=4, num_layers=1)
STREAM = np.arange(200, dtype=np.int32) % 31
KEY = jax.random.key(0)


def _draft():
    from dspark_jax.draft import DSparkDraft

    return DSparkDraft(DRAFT_CFG, rngs=nnx.Rngs(1), embed_tokens=TARGET.embed_tokens, lm_head=TARGET.lm_head)


# --------------------------------------------------------------------------- generation
def test_a_prompt_holding_a_bool_is_refused():
    """``[[True, 2]]`` ran with True read as token 1."""
    with pytest.raises(TypeError, match=re.escape("prompts[0] holds a bool: expected integer token ids")):
        generate(TARGET, [[True, 2]], max_new_tokens=1, key=jax.random.key(0))


def test_stop_lists_of_other_lengths_share_the_compiled_programs():
    """The stop table's width followed the longest stop list: a list one longer recompiled the
    start and round programs; widths now round up to 8."""
    program = generation._plain_program(nnx.graphdef(TARGET), sampling=False, filter_width=0)

    def compiled():
        return program.start._cache_size() + program.step._cache_size()

    outs = [generate(TARGET, [[1, 2]], max_new_tokens=3, stop_tokens=[30], key=KEY)]
    warm = compiled()
    for stops in ([30, 29], [30, 29, 28, 27, 26]):
        outs.append(generate(TARGET, [[1, 2]], max_new_tokens=3, stop_tokens=stops, key=KEY))
    assert compiled() == warm
    plain = generate(TARGET, [[1, 2]], max_new_tokens=3, key=KEY)
    stopped = [t for t in plain.tokens[0] if t in (30, 29, 28, 27, 26)]
    for out in outs:
        assert out.tokens == plain.tokens or stopped  # the same tokens unless a stop token came


@pytest.mark.parametrize("tokens", [0, -3, True, 2.5])
def test_verify_widths_refuses_anything_but_a_positive_integer(tokens):
    with pytest.raises(ValueError, match=f"tokens={re.escape(repr(tokens))} is invalid: must be an integer >= 1"):
        verify_widths(tokens)
    assert verify_widths(np.int64(5)) == (1, 2, 4, 5)


def test_seeds_outside_numpys_range_are_named():
    assert DRAFT_CFG.enable_confidence_head  # measure_verify_schedule needs one
    with pytest.raises(ValueError, match=re.escape("seed=-1 is invalid: must be an integer in [0, 2**32 - 1]")):
        measure_verify_schedule(TARGET, _draft(), 1, prompt_len=2, rounds=1, seed=-1)
    with pytest.raises(ValueError, match=re.escape("seed=1.5 is invalid")):
        measure_tau(TARGET, _draft(), [[1, 2]], temperature=0.0, max_new_tokens=2, seed=1.5)
    with pytest.raises(ValueError, match=re.escape("seed=-1 is invalid")):
        evaluate_draft(_draft(), TARGET, STREAM, batches=1, batch_size=1, seq_len=16, seed=-1)
    with pytest.raises(ValueError, match=re.escape("seed=-2 is invalid")):
        distillation_data(TARGET, STREAM, count=2, seq_len=8, prompt_len=4, seed=-2)


# --------------------------------------------------------------------------- evaluation and training
def test_swapped_models_are_named_in_the_held_out_evaluation():
    """``evaluate_draft(target, draft, …)`` failed on ``'Qwen3Target' object has no attribute 'cfg'``."""
    with pytest.raises(TypeError, match="target must be a target model, got a DSparkDraft"):
        evaluate_draft(TARGET, _draft(), STREAM, batches=1, batch_size=1, seq_len=16)


def test_distillation_sizes_are_checked_by_name():
    """``prompt_len=2.5`` raised IndexError; a ``seq_len`` past the target's positions was
    reported as ``max_new_tokens[0]``, a value the caller never passed."""
    with pytest.raises(ValueError, match=re.escape("prompt_len=2.5 is invalid: must be an integer in 1..seq_len-1=7")):
        distillation_data(TARGET, STREAM, count=2, seq_len=8, prompt_len=2.5)
    with pytest.raises(ValueError, match=re.escape("seq_len=500 is invalid: must be an integer in [2, 64]")):
        distillation_data(TARGET, STREAM, count=2, seq_len=500, prompt_len=4)
    with pytest.raises(TypeError, match="target must be a target model, got a DSparkDraft"):
        distillation_data(_draft(), STREAM, count=2, seq_len=8, prompt_len=4)


def test_configs_of_the_wrong_kind_are_named_not_failed_on_an_attribute():
    with pytest.raises(TypeError, match="target_cfg must be a target's config .*, got DraftConfig"):
        default_draft_config(DRAFT_CFG, mask_token_id=31)
    with pytest.raises(TypeError, match="target_cfg must be a target's config .*, got dict"):
        default_draft_config({"hidden_size": 16}, mask_token_id=31)
    with pytest.raises(TypeError, match=re.escape("confidence_head='no' is invalid: must be True or False")):
        default_draft_config(TRAINING_TARGET, mask_token_id=31, confidence_head="no")
    with pytest.raises(TypeError, match=re.escape("target_layer_ids=5 is invalid: expected a sequence")):
        default_draft_config(TRAINING_TARGET, mask_token_id=31, target_layer_ids=5)
    with pytest.raises(ValueError, match="markov_rank='x' is invalid"):
        default_draft_config(TRAINING_TARGET, mask_token_id=31, markov_rank="x")
    with pytest.raises(TypeError, match="draft_cfg must be a DraftConfig, got TargetConfig"):
        check_draft_fits(TRAINING_TARGET, TRAINING_TARGET, 32)
    with pytest.raises(TypeError, match="target_cfg must be a target's config"):
        check_draft_fits(DRAFT_CFG, DRAFT_CFG, 32)
    with pytest.raises(TypeError, match="cfg must be a DraftConfig, got TargetConfig"):
        make_markov_head(TRAINING_TARGET, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="tcfg must be a DraftTrainConfig, got dict"):
        draft_loss(_draft(), TARGET, jnp.zeros((1, 16), jnp.int32), jnp.ones((1, 1), jnp.int32), {})


@pytest.mark.parametrize("anchors", [0, -5, 2.5, "x"])
def test_check_draft_fits_refuses_anchor_counts_below_one(anchors):
    """0, -5 and 2.5 passed; ``'x'`` failed on ``'>' not supported``."""
    with pytest.raises(ValueError, match=f"anchors_per_seq={re.escape(repr(anchors))} is invalid"):
        check_draft_fits(DRAFT_CFG, TRAINING_TARGET, 32, anchors_per_seq=anchors)


def test_check_draft_fits_takes_numpy_lengths_and_names_other_types():
    """``np.int64(32)`` was reported as ``shorter than a block``."""
    check_draft_fits(DRAFT_CFG, TRAINING_TARGET, np.int64(32), anchors_per_seq=np.int64(2))
    with pytest.raises(ValueError, match=re.escape("seq_len=32.0 is invalid: must be an integer")):
        check_draft_fits(DRAFT_CFG, TRAINING_TARGET, 32.0)


def test_compare_drafts_refuses_no_drafts_and_repeated_or_missing_temperatures():
    """``{}`` returned ``{}``, ``temperatures=()`` empty results, a repeated temperature merged
    two measurements into one entry, and a list of drafts failed on ``.items``."""
    draft = _draft()
    cases = [
        (TypeError, "drafts must be a dict of names to drafts, got list", dict(drafts=[draft])),
        (ValueError, "drafts={} is invalid: give at least one draft", dict(drafts={})),
        (ValueError, "temperatures=() is invalid", dict(drafts={"a": draft}, temperatures=())),
        (TypeError, "temperatures=0.0 is invalid: expected a sequence", dict(drafts={"a": draft}, temperatures=0.0)),
        (ValueError, "[0.0] given more than once", dict(drafts={"a": draft}, temperatures=(0.0, 1.0, 0.0))),
    ]
    for error, says, kwargs in cases:
        with pytest.raises(error, match=re.escape(says)):
            compare_drafts(TARGET, prompts=[[1, 2]], max_new_tokens=2, **kwargs)


def test_calibration_refuses_a_non_bool_apply():
    """``apply='no'`` overwrote the draft's temperatures (any truthy value did)."""
    draft = random_draft(tiny_config(), seed=3)
    before = np.asarray(draft.confidence_head.sts_temperature[...])
    with pytest.raises(TypeError, match=re.escape("apply='no' is invalid: must be True or False")):
        fit_sts_temperature(draft, TARGET, STREAM, apply="no")
    np.testing.assert_array_equal(draft.confidence_head.sts_temperature[...], before)


# --------------------------------------------------------------------------- verification
def test_a_filter_width_below_a_rows_top_k_is_refused_on_concrete_rows():
    """``top_k=5`` with ``filter_width=3`` sampled the top 3, and ``0`` dropped top-k entirely."""
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(2, 16)), jnp.float32)
    temps, top_k, top_p = jnp.array([1.0, 0.0]), jnp.array([5, 5]), jnp.array([1.0, 1.0])
    for width in (3, 0):
        with pytest.raises(ValueError, match=rf"filter_width={width} is too small .* row 0 \(top_k\[0\]=5\) needs 5"):
            sample_tokens(logits, temps, top_k, top_p, jax.random.key(0), filter_width=width)
    with pytest.raises(ValueError, match=r"row 1 \(top_p\[1\]=0.5\) needs 16 ranks"):
        target_probs(logits, jnp.array([0.0, 1.0]), jnp.array([5, 1 << 20]), jnp.array([1.0, 0.5]), filter_width=8)
    # Enough ranks, and the greedy row's top-k (it never samples) does not count.
    np.testing.assert_array_equal(
        target_probs(logits, temps, top_k, top_p, filter_width=5),
        target_probs(logits, temps, top_k, top_p, filter_width=None),
    )
    assert required_filter_width(temps, top_k, top_p, 16) == 8


def test_schedule_verify_lengths_refuses_a_bad_rate_table():
    """A NaN, a negative or an all-zero rate table gave lengths (an argmax over garbage)."""
    confidence = jnp.full((1, 3), 0.5)
    good = jnp.linspace(1.0, 0.5, 5)
    for table, says in (
        (good.at[2].set(jnp.nan), "steps_per_second[2]=nan is invalid: must be a finite rate >= 0"),
        (-good, "steps_per_second[0]=-1.0 is invalid"),
        (jnp.zeros(5), "steps_per_second is all 0"),
    ):
        with pytest.raises(ValueError, match=re.escape(says)):
            schedule_verify_lengths(confidence, table)
    assert schedule_verify_lengths(confidence, good).shape == (1,)


# --------------------------------------------------------------------------- cache
def test_integer_or_misshapen_caches_are_refused():
    """An int32 cache truncated every projected key and value; a ``v`` unlike ``k`` was written."""
    draft = random_draft(tiny_config(), seed=1)
    cache = init_context_cache(draft.cfg, 2, 8)
    features = jnp.ones((2, 3, draft.cfg.num_fused_layers * draft.cfg.hidden_size))
    rows = dict(start=jnp.zeros(2, jnp.int32), count=jnp.full(2, 3, jnp.int32))
    as_int = ContextCache(k=cache.k.astype(jnp.int32), v=cache.v.astype(jnp.int32))
    with pytest.raises(TypeError, match="cache.k has dtype int32: expected a floating"):
        fill_context(draft, as_int, features, **rows)
    short_v = ContextCache(k=cache.k, v=cache.v[:, :, :5])
    with pytest.raises(ValueError, match=r"cache.k has shape .* and cache.v .*: expected one \[L, B, C, KVH, D\]"):
        fill_context(draft, short_v, features, **rows)
    k = jnp.ones((*cache.k.shape[:2], 3, *cache.k.shape[3:]), jnp.int32)
    with pytest.raises(TypeError, match="k has dtype int32: expected a floating"):
        write_context(cache, k, k, rows["start"], rows["count"])


def test_a_cache_of_another_draft_config_is_named_as_such():
    """It was reported as a bad ``k``, an argument the caller never passed."""
    draft = random_draft(tiny_config(), seed=1)
    other = init_context_cache(tiny_config(num_hidden_layers=1), 2, 8)
    features = jnp.ones((2, 3, draft.cfg.num_fused_layers * draft.cfg.hidden_size))
    with pytest.raises(ValueError, match=r"cache has L=1 layers, KVH=2 heads of D=8: this draft needs L=2"):
        fill_context(draft, other, features, jnp.zeros(2, jnp.int32), jnp.full(2, 3, jnp.int32))


@pytest.mark.parametrize(
    ("lens", "capacity", "error", "says"),
    [
        ([2, 3], -1, ValueError, "capacity=-1 is invalid: must be an integer >= 1"),
        ([2, 3], 2.5, ValueError, "capacity=2.5 is invalid"),
        ([2, 3], True, ValueError, "capacity=True is invalid"),
        (np.int32(2), 4, ValueError, "prefix_lens has shape (): expected [B]"),
        ([[1, 2]], 4, ValueError, "prefix_lens has shape (1, 2): expected [B]"),
        (np.array([2**32 + 1, 1]), 4, ValueError, f"prefix_lens[0]={2**32 + 1} is invalid: must fit int32"),
    ],
)
def test_context_mask_refuses_bad_capacities_and_lengths(lens, capacity, error, says):
    with pytest.raises(error, match=re.escape(says)):
        context_mask(lens, capacity)


# --------------------------------------------------------------------------- Markov walk and sampling
def test_markov_walk_refuses_out_of_vocabulary_anchors_and_mismatched_shapes():
    """Ids were clipped and floats truncated; a wrong batch failed inside ``lax.scan``."""
    draft = random_draft(tiny_config(), seed=2)
    head, v = draft.markov_head, draft.cfg.vocab_size
    base, hidden = jnp.zeros((2, 4, v)), jnp.zeros((2, 4, draft.cfg.hidden_size))

    def pick(k, logits):
        return jnp.argmax(logits, axis=-1)

    cases = [
        (
            ValueError,
            f"bonus[0]={v + 5} is outside the vocabulary: 0 <= id < {v}",
            (base, hidden, jnp.array([v + 5, 2])),
        ),
        (ValueError, "bonus[0]=-1 is outside the vocabulary", (base, hidden, jnp.array([-1, 2]))),
        (TypeError, "bonus has dtype float32: expected an integer dtype", (base, hidden, jnp.array([1.7, 2.2]))),
        (ValueError, "bonus has shape (1,): expected [B] = (2,)", (base, hidden, jnp.array([1]))),
        (TypeError, "bonus is a list: expected an array", (base, hidden, [1, 2])),
        (ValueError, "expected [B, γ, V] and [B, γ, H] of one B and γ", (base, hidden[:1], jnp.array([1, 2]))),
        (
            ValueError,
            f"base_logits has V={v + 1}: the Markov head's tables have {v} rows",
            (jnp.zeros((2, 4, v + 1)), hidden, jnp.array([1, 2])),
        ),
    ]
    for error, says, (b, h, bonus) in cases:
        with pytest.raises(error, match=re.escape(says)):
            markov_walk(head, b, h, bonus, pick)
    with pytest.raises(TypeError, match="keep_dtype=<class 'jax.numpy.int8'> is invalid: must be a floating dtype"):
        markov_walk(head, base, hidden, jnp.array([1, 2]), pick, keep_dtype=jnp.int8)
    with pytest.raises(TypeError, match="head must be a MarkovHead or None, got DraftConfig"):
        markov_walk(draft.cfg, base, hidden, jnp.array([1, 2]), pick)
    tokens, _ = markov_walk(head, base, hidden, jnp.array([0, v - 1]), pick)
    assert tokens.shape == (2, 4)


def test_greedy_rows_refuses_rows_of_other_lengths():
    """A ``[1]`` top-k broadcast over three temperatures; ``[B, 1]`` temperatures made a
    ``[B, B]`` mask."""
    temps = jnp.array([0.0, 1.0, 1.0])
    for t, k in ((temps, jnp.array([1])), (temps[:, None], jnp.array([1, 2, 3])), (temps, jnp.array([1, 2]))):
        with pytest.raises(ValueError, match=r"temperatures has shape .* and top_k .*: expected \[B\] each"):
            sampling.greedy_rows(t, k)
    np.testing.assert_array_equal(sampling.greedy_rows(temps, jnp.array([5, 1, 5])), [True, True, False])


def test_sample_step_refuses_bool_or_integer_temperatures():
    """``True`` was read as T = 1."""
    logits, mask = jnp.zeros((2, 8)), jnp.zeros(2, bool)
    for temps in (jnp.array([True, False]), jnp.array([1, 0])):
        with pytest.raises(TypeError, match="temperatures has dtype"):
            sampling.sample_step(logits, temps, mask, jax.random.key(0))


def test_schedule_verify_lengths_takes_host_lists():
    """A list ``confidence`` failed on ``'list' object has no attribute 'shape'``."""
    confidence, rates = [[0.9, 0.5, 0.1]], [1.0, 0.9, 0.8, 0.7, 0.6]
    got = schedule_verify_lengths(confidence, rates)
    np.testing.assert_array_equal(got, schedule_verify_lengths(jnp.asarray(confidence), jnp.asarray(rates)))


def test_a_corpus_or_power_sampler_of_bad_fields_is_refused(tmp_path):
    """``Corpus(root='/nonexistent', held_out_percent=-5)`` and ``PowerSampler(reader=5)`` built."""
    from dspark_jax.corpus import Corpus
    from dspark_jax.gpu_power import PowerSampler

    files = dict(train_files=("a.py",), heldout_files=())
    with pytest.raises(ValueError, match="root='/nonexistent' is invalid: must be an existing folder"):
        Corpus(root="/nonexistent", **files)
    with pytest.raises(ValueError, match=re.escape("held_out_percent=-5 is invalid: must lie in [0, 100]")):
        Corpus(root=str(tmp_path), **files, held_out_percent=-5)
    with pytest.raises(TypeError, match="train_files must be a sequence of file paths"):
        Corpus(root=str(tmp_path), train_files="a.py", heldout_files=())
    assert Corpus(root=str(tmp_path), **files).files("train") == ("a.py",)
    with pytest.raises(TypeError, match=re.escape("reader=5 is invalid: must be a Reader (read, power_limit_w)")):
        PowerSampler(reader=5)


def test_greedy_step_wants_a_floating_batch_of_rows_and_sample_step_a_floating_race_dtype():
    """A 1-D ``[V]`` gave a scalar and a 3-D input ``[1, B]``; ``race_dtype='nope'`` failed in NumPy."""
    for shape in ((8,), (1, 2, 8), (2, 0)):
        with pytest.raises(ValueError, match=re.escape(f"logits has shape {shape}: expected [B, V] with V >= 1")):
            sampling.greedy_step(jnp.zeros(shape))
    with pytest.raises(TypeError, match="logits has dtype int32: expected a floating dtype"):
        sampling.greedy_step(jnp.zeros((2, 8), jnp.int32))
    np.testing.assert_array_equal(sampling.greedy_step(jnp.array([[0.0, 2.0, 1.0], [3.0, 0.0, 3.0]])), [1, 0])
    logits, temps, mask = jnp.zeros((2, 8)), jnp.ones(2), jnp.zeros(2, bool)
    for bad in ("nope", jnp.int8):
        with pytest.raises(TypeError, match="race_dtype=.* is invalid: must be a floating dtype or None"):
            sampling.sample_step(logits, temps, mask, jax.random.key(0), race_dtype=bad)
