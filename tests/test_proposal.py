"""The draft round: NumPy reference, folded/eager parity, walk statistics, input checks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from draft_testing import hf_params, random_draft, rel_err, tiny_config
from flax import nnx
from test_sampling import N_DRAWS, softmax, tv, tv_bound

from dspark_jax.cache import fill_context, init_context_cache
from dspark_jax.proposal import DraftBlock, propose, propose_eager, validate_proposal_inputs
from dspark_jax.proposer import CompileCounter
from dspark_jax.sampling import TOP_K_ALL, log_exponential_noise, row_keys, step_keys
from dspark_jax.split_round import SplitRound

B, N_CTX, CAPACITY = 4, 6, 12
PREFIX = np.array([6, 3, 0, 5])
TEMPS = np.array([0.0, 0.8, 1.0, 1.7], np.float32)
TOP_K = np.array([TOP_K_ALL, TOP_K_ALL, 1, 50])  # rows 0 and 2 greedy

_propose = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")

CONFIGS = {
    "vanilla-confidence": dict(num_hidden_layers=1),
    "rnn": dict(
        num_hidden_layers=1, markov_head_type="rnn", enable_confidence_head=False, confidence_head_with_markov=False
    ),
    "dflash-no-head": dict(
        num_hidden_layers=1,
        markov_rank=0,
        sample_from_anchor=False,
        enable_confidence_head=False,
        confidence_head_with_markov=False,
    ),
}


def setup_round(cfg, seed=0, batch=B, prefix=PREFIX):
    """A random draft, ``[B, N, K·H]`` context features and the cache filled with them."""
    draft = random_draft(cfg, seed)
    rng = np.random.default_rng(seed + 100)
    features = rng.standard_normal((batch, N_CTX, cfg.num_fused_layers * cfg.hidden_size)).astype(np.float32)
    cache = init_context_cache(cfg, batch, CAPACITY)
    cache = fill_context(draft, cache, jnp.asarray(features), jnp.zeros(batch, jnp.int32), jnp.full(batch, N_CTX))
    bonus = rng.integers(0, cfg.vocab_size, batch)
    return draft, cache, features, bonus, np.asarray(prefix)


def reference_round(draft, features, bonus, prefix, temps, top_k, key, fold_sampling=True):
    """The round in float64 NumPy; sampled rows use the documented key schedule's noise."""
    cfg = draft.cfg
    p = hf_params(draft)
    hidden, base = ref.draft_forward(bonus, prefix, features.astype(np.float64), p, cfg)
    batch = bonus.shape[0]
    greedy = ((top_k <= 1) | (temps == 0)) if fold_sampling else np.ones(batch, bool)
    keys = row_keys(key, batch)
    t = np.maximum(temps, 1e-5)[:, None]

    def pick(k, logits):
        log_e = np.asarray(log_exponential_noise(step_keys(keys, k), cfg.vocab_size), np.float64)
        return np.where(greedy, logits.argmax(-1), (logits / t - log_e).argmax(-1))

    kind = cfg.markov_head_type if cfg.has_markov_head else None
    tokens, corrected = ref.markov_walk(kind, p, base, hidden, bonus, pick)
    conf = None
    if cfg.enable_confidence_head:
        prev = np.concatenate([bonus[:, None], tokens[:, :-1]], axis=1)
        conf = ref.confidence(p, hidden, prev, cfg.confidence_head_with_markov, p["confidence_head.sts_temperature"])
    return tokens, corrected, greedy, conf


@pytest.mark.parametrize("name", list(CONFIGS))
def test_round_matches_numpy_reference(name):
    cfg = tiny_config(**CONFIGS[name])
    draft, cache, features, bonus, prefix = setup_round(cfg)
    key = jax.random.key(3)
    graphdef, state = nnx.split(draft)
    block = _propose(graphdef, state, cache, bonus, prefix, TEMPS, TOP_K, key)
    tokens, corrected, greedy, conf = reference_round(draft, features, bonus, prefix, TEMPS, TOP_K, key)
    np.testing.assert_array_equal(np.asarray(block.draft_tokens), tokens)
    assert rel_err(block.corrected_logits, corrected) < 1e-4
    np.testing.assert_array_equal(np.asarray(block.greedy_mask), greedy)
    np.testing.assert_allclose(np.asarray(block.temperatures), np.maximum(TEMPS, 1e-5))
    if conf is None:
        assert block.confidence.shape == (B, 0)
    else:
        np.testing.assert_allclose(np.asarray(block.confidence), conf, atol=1e-5)
    assert block.draft_tokens.dtype == jnp.int32 and block.corrected_logits.dtype == jnp.float32


@pytest.mark.parametrize(
    ("name", "fold_sampling", "per_row_keys"),
    [
        ("vanilla-confidence", True, True),
        ("dflash-no-head", True, False),
        ("vanilla-confidence", False, False),
        ("rnn", True, False),  # a head that reads each slot's hidden state (the vanilla one ignores it)
    ],
)
def test_folded_and_eager_pick_identical_tokens(name, fold_sampling, per_row_keys):
    cfg = tiny_config(**CONFIGS[name])
    draft, cache, _, bonus, prefix = setup_round(cfg, seed=1)
    graphdef, state = nnx.split(draft)
    key = jax.random.split(jax.random.key(6), B) if per_row_keys else jax.random.key(5)
    folded = _propose(graphdef, state, cache, bonus, prefix, TEMPS, TOP_K, key, fold_sampling=fold_sampling)
    eager = propose_eager(draft, cache, bonus, prefix, TEMPS, TOP_K, key, fold_sampling=fold_sampling)
    np.testing.assert_array_equal(np.asarray(eager.draft_tokens), np.asarray(folded.draft_tokens))
    np.testing.assert_array_equal(np.asarray(eager.greedy_mask), np.asarray(folded.greedy_mask))
    np.testing.assert_allclose(np.asarray(eager.corrected_logits), np.asarray(folded.corrected_logits), atol=1e-5)
    np.testing.assert_allclose(np.asarray(eager.confidence), np.asarray(folded.confidence), atol=1e-6)
    assert jax.tree.structure(eager) == jax.tree.structure(folded)
    if fold_sampling:  # the batch has sampled rows and they did sample (not all argmax)
        sampled = ~np.asarray(folded.greedy_mask)
        argmax = np.asarray(folded.corrected_logits).argmax(-1)
        assert (np.asarray(folded.draft_tokens)[sampled] != argmax[sampled]).any()


def test_input_embeds_match_in_graph_embedding():
    cfg = tiny_config(**CONFIGS["vanilla-confidence"])
    draft, cache, _, bonus, prefix = setup_round(cfg, seed=2)
    graphdef, state = nnx.split(draft)
    key = jax.random.key(8)
    embeds = draft.embed(draft.block_ids(jnp.asarray(bonus)))
    in_graph = _propose(graphdef, state, cache, bonus, prefix, TEMPS, TOP_K, key)
    given = _propose(graphdef, state, cache, bonus, prefix, TEMPS, TOP_K, key, input_embeds=embeds)
    for a, b in zip(jax.tree.leaves(in_graph), jax.tree.leaves(given), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        if np.issubdtype(a.dtype, np.floating):  # equal on the CPU; on a GPU the two programs may fuse differently
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
        else:
            np.testing.assert_array_equal(a, b)


def test_greedy_only_folding_keeps_structure_and_greedy_tokens():
    cfg = tiny_config(**CONFIGS["vanilla-confidence"])
    draft, cache, _, bonus, prefix = setup_round(cfg, seed=3)
    graphdef, state = nnx.split(draft)
    key = jax.random.key(0)
    greedy_only = _propose(graphdef, state, cache, bonus, prefix, TEMPS, TOP_K, key, fold_sampling=False)
    zeros = np.zeros(B, np.float32)
    all_greedy = _propose(graphdef, state, cache, bonus, prefix, zeros, TOP_K, key, fold_sampling=True)
    assert isinstance(greedy_only, DraftBlock)
    assert jax.tree.structure(greedy_only) == jax.tree.structure(all_greedy)
    assert greedy_only.corrected_logits.shape == (B, cfg.gamma, 0)
    assert bool(np.asarray(greedy_only.greedy_mask).all())
    np.testing.assert_array_equal(np.asarray(greedy_only.draft_tokens), np.asarray(all_greedy.draft_tokens))
    np.testing.assert_allclose(np.asarray(greedy_only.confidence), np.asarray(all_greedy.confidence), atol=1e-6)


def test_rows_do_not_depend_on_batch_composition():
    cfg = tiny_config(**CONFIGS["vanilla-confidence"])
    draft, cache, _, bonus, prefix = setup_round(cfg, seed=4)
    graphdef, state = nnx.split(draft)
    keys = jax.random.split(jax.random.key(12), B)
    temps = np.full(B, 1.5, np.float32)
    top_k = np.full(B, TOP_K_ALL)
    full = _propose(graphdef, state, cache, bonus, prefix, temps, top_k, keys)
    order = np.array([3, 0, 1, 2])
    sub_cache = jax.tree.map(lambda x: x[:, order], cache)
    permuted = _propose(graphdef, state, sub_cache, bonus[order], prefix[order], temps, top_k, keys[order])
    np.testing.assert_array_equal(np.asarray(permuted.draft_tokens), np.asarray(full.draft_tokens)[order])
    np.testing.assert_allclose(
        np.asarray(permuted.corrected_logits), np.asarray(full.corrected_logits)[order], rtol=1e-5, atol=1e-5
    )


@pytest.fixture(scope="module")
def walk_draws():
    """``3·N_DRAWS`` identical requests (V = 8) at three temperatures plus greedy rows, one call.

    The T = 2 rows carry ``top_k = 2``: top-k / top-p are never applied to the draft
    (``DSPARK_SPEC.md`` §3), so they must still follow the whole ``softmax(corrected / T)``.
    """
    cfg = tiny_config(**CONFIGS["vanilla-confidence"], vocab_size=8, mask_token_id=7)
    draft, cache, _, bonus, prefix = setup_round(cfg, seed=5, batch=1, prefix=[4])
    temps = (0.6, 1.0, 2.0)
    rows = N_DRAWS * len(temps) + 64
    row_temps = np.concatenate([np.repeat(np.float32(temps), N_DRAWS), np.zeros(64, np.float32)])
    big_cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (x.shape[0], rows, *x.shape[2:])), cache)
    graphdef, state = nnx.split(draft)
    block = _propose(
        graphdef,
        state,
        big_cache,
        np.repeat(bonus, rows),
        np.repeat(prefix, rows),
        row_temps,
        np.concatenate([np.repeat([TOP_K_ALL, TOP_K_ALL, 2], N_DRAWS), np.full(64, TOP_K_ALL)]),
        jax.random.key(2024),
    )
    return cfg, draft, np.repeat(bonus, rows), temps, row_temps, jax.device_get(block)


def test_walk_samples_follow_corrected_softmax_at_every_step(walk_draws):
    cfg, _, _, temps, row_temps, block = walk_draws
    bound = tv_bound(cfg.vocab_size, N_DRAWS)
    for i, t in enumerate(temps):
        rows = slice(i * N_DRAWS, (i + 1) * N_DRAWS)
        tokens = block.draft_tokens[rows]
        logits = block.corrected_logits[rows].astype(np.float64)
        for k in range(cfg.gamma):
            # Draws at step k are independent given the rows' histories, each from
            # softmax(corrected[b, k] / T); the empirical law concentrates on their mean.
            expected = softmax(logits[:, k] / t).mean(0)
            freq = np.bincount(tokens[:, k], minlength=cfg.vocab_size) / N_DRAWS
            assert tv(freq, expected) < bound, (t, k)
        if i == 2:  # these rows carry top_k = 2, never applied to the draft: other tokens occur
            top2 = np.argsort(logits[:, 0], axis=-1)[:, -2:]
            outside = np.mean(~(top2 == tokens[:, :1]).any(-1))
            assert outside > 3 * bound, outside
        # The Markov bias makes step 1 depend on step 0's token: the conditioning matters.
        first = tokens[:, 0]
        a, b = np.flatnonzero(first == first[0])[0], np.flatnonzero(first != first[0])[0]
        assert tv(softmax(logits[a, 1] / t), softmax(logits[b, 1] / t)) > 3 * bound


def test_walk_corrected_logits_follow_the_drawn_tokens(walk_draws):
    # corrected[:, k] = base[:, k] + markov_w1[prev_k] @ markov_w2ᵀ with prev = [bonus, d_1 … d_{γ−1}].
    cfg, draft, bonus, _, _, block = walk_draws
    p = hf_params(draft)
    rows = np.arange(0, len(bonus), 997)
    tokens = block.draft_tokens[rows]
    prev = np.concatenate([bonus[rows, None], tokens[:, :-1]], axis=1)
    bias = p["markov_head.markov_w1.weight"][prev] @ p["markov_head.markov_w2.weight"].T  # [b, γ, V]
    base = block.corrected_logits[rows[:1]].astype(np.float64) - bias[:1]
    np.testing.assert_allclose(block.corrected_logits[rows], base + bias, atol=1e-4)


def test_walk_greedy_rows_never_move(walk_draws):
    _, _, _, _, row_temps, block = walk_draws
    greedy = row_temps == 0
    assert block.greedy_mask[greedy].all() and not block.greedy_mask[~greedy].any()
    tokens = block.draft_tokens[greedy]
    assert (tokens == tokens[0]).all()
    np.testing.assert_array_equal(tokens[0], block.corrected_logits[greedy][0].argmax(-1))


# ------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def small_round():
    cfg = tiny_config(**CONFIGS["vanilla-confidence"])
    draft, cache, _, bonus, prefix = setup_round(cfg, seed=6)
    return draft, cache, dict(bonus=bonus, prefix_lens=prefix, temperatures=TEMPS, top_k=TOP_K, key=jax.random.key(0))


BAD_INPUTS = {
    "bonus-out-of-vocab": (dict(bonus=np.array([0, 1, 40, 2])), ValueError, r"bonus\[2\]=40 is out of range"),
    "bonus-negative": (dict(bonus=np.array([0, -1, 3, 2])), ValueError, r"bonus\[1\]=-1 is out of range"),
    "bonus-float": (dict(bonus=np.array([0.0, 1.0, 3.0, 2.0])), TypeError, r"bonus has dtype float64"),
    "bonus-2d": (dict(bonus=np.zeros((4, 1), int)), ValueError, r"bonus has shape \(4, 1\)"),
    "prefix-batch": (dict(prefix_lens=np.array([1, 2, 3])), ValueError, r"prefix_lens has shape \(3,\)"),
    "temperature-batch": (dict(temperatures=np.ones(5, np.float32)), ValueError, r"temperatures has shape \(5,\)"),
    "top-k-batch": (dict(top_k=np.ones(2, int)), ValueError, r"top_k has shape \(2,\)"),
    "prefix-beyond-capacity": (
        dict(prefix_lens=np.array([0, 9, 0, 0])),
        ValueError,
        r"prefix_lens\[1\]=9 is out of range: must be in \[0, capacity - gamma\] = \[0, 8\]",
    ),
    "temperature-negative": (
        dict(temperatures=np.array([0.0, -0.5, 1.0, 1.0], np.float32)),
        ValueError,
        r"temperatures\[1\]=-0.5 is invalid: must be >= 0 \(0 = greedy\) and finite in float32",
    ),
    "temperature-nan": (
        dict(temperatures=np.array([0.0, 1.0, np.nan, 1.0], np.float32)),
        ValueError,
        r"temperatures\[2\]=nan is invalid",
    ),
    "temperature-float32-overflow": (
        dict(temperatures=np.array([0.0, 1e39, 1.0, 1.0])),
        ValueError,
        r"temperatures\[1\]=1e\+39 is invalid: .* finite in float32",
    ),
    "top-k-negative": (dict(top_k=np.array([1, -1, 1, 1])), ValueError, r"top_k\[1\]=-1 .* TOP_K_ALL"),
    # int32 in the round: 2**31 would read as negative (greedy), 2**32 + 5 as 5
    "top-k-beyond-int32": (
        dict(top_k=np.array([1, 2**31, 1, 1])),
        ValueError,
        r"top_k\[1\]=2147483648 is out of range: must be in \[0, 2147483647\]",
    ),
    "key-int": (dict(key=0), TypeError, r"key=0 has type int"),
    "key-float": (dict(key=np.zeros(2, np.float32)), TypeError, r"key has dtype float32"),
    "key-batch": (dict(key=jax.random.split(jax.random.key(0), 3)), TypeError, r"key has shape \(3,\) for batch 4"),
    # integer embeddings were cast silently; a NaN one drafted token 0 in every slot
    "input-embeds-int": (
        dict(input_embeds=np.zeros((B, 4, 32), np.int32)),
        TypeError,
        r"input_embeds has dtype int32: expected a floating dtype",
    ),
    "input-embeds-nan": (
        dict(input_embeds=np.where(np.arange(B * 4 * 32).reshape(B, 4, 32) == 3 * 128 + 37, np.nan, 0.0)),
        ValueError,
        r"input_embeds\[3, 1, 5\]=nan is invalid: must be finite in float32",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_raises_before_any_compilation(small_round, case):
    draft, cache, good = small_round
    change, error, message = BAD_INPUTS[case]
    args = {**good, **change}
    with CompileCounter() as counter, pytest.raises(error, match=message):
        propose_eager(draft, cache, **args)
    assert counter.count == 0 and counter.lowerings == 0


def test_cache_with_other_batch_is_rejected(small_round):
    draft, cache, good = small_round
    small = jax.tree.map(lambda x: x[:, :2], cache)
    with pytest.raises(ValueError, match=r"cache has 2 request slots: expected B=4"):
        validate_proposal_inputs(draft.cfg, small, **good)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(bonus=np.array([0.0, 1.5, 3.0, 2.0], np.float32)), "bonus has dtype float32"),
        (dict(prefix_lens=np.array([1.0, 2.0, 3.0, 4.0], np.float32)), "prefix_lens has dtype float32"),
        (dict(top_k=np.array([True, False, True, True])), "top_k has dtype bool"),
        (dict(temperatures=np.array([True, False, True, True])), "temperatures has dtype bool"),
    ],
)
def test_jitted_propose_refuses_wrong_dtypes_while_tracing(small_round, change, message):
    """Under jax.jit the values cannot be read, but the dtypes are known: a float token id would
    otherwise be truncated inside the round without a word."""
    draft, cache, good = small_round
    args = {**good, **{k: jnp.asarray(v) for k, v in change.items()}}
    graphdef, state = nnx.split(draft)
    step = jax.jit(propose, static_argnums=0)
    with pytest.raises(TypeError, match=f"{message}: expected an? (integer|float) dtype"):
        names = ("bonus", "prefix_lens", "temperatures", "top_k", "key")
        step(graphdef, state, cache, *(args[n] for n in names))
    bf16 = jnp.asarray(good["temperatures"], jnp.bfloat16)  # a float dtype NumPy does not know as one
    assert validate_proposal_inputs(draft.cfg, cache, **{**good, "temperatures": bf16}) == 4


def test_a_fold_sampling_flag_that_is_not_a_bool_is_refused(small_round):
    """The flag is static: a string such as "no" was true, and folded sampling in."""
    draft, cache, good = small_round
    names = ("bonus", "prefix_lens", "temperatures", "top_k", "key")
    with pytest.raises(TypeError, match="fold_sampling='no' is invalid: must be True or False"):
        propose_eager(draft, cache, *(good[n] for n in names), fold_sampling="no")
    graphdef, state = nnx.split(draft)
    step = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")
    args = [jnp.asarray(good[n]) if n != "key" else good[n] for n in names]
    with pytest.raises(TypeError, match="fold_sampling=1 is invalid: must be True or False"):
        step(graphdef, state, cache, *args, fold_sampling=1)
    split = SplitRound(draft, twin_programs=False)
    with pytest.raises(TypeError, match="fold_sampling='yes' is invalid"):
        split(cache, *args, fold_sampling="yes")


def test_input_embeds_of_wrong_shape_are_rejected(small_round):
    draft, cache, good = small_round
    with pytest.raises(ValueError, match=r"input_embeds has shape \(4, 3, 32\): expected \[B, R, H\]"):
        validate_proposal_inputs(draft.cfg, cache, **good, input_embeds=np.zeros((4, 3, 32), np.float32))


def test_jitted_propose_refuses_integer_input_embeds_while_tracing(small_round):
    draft, cache, good = small_round
    graphdef, state = nnx.split(draft)
    names = ("bonus", "prefix_lens", "temperatures", "top_k", "key")
    embeds = jnp.zeros((B, draft.cfg.num_query_rows, draft.cfg.hidden_size), jnp.int32)
    with pytest.raises(TypeError, match=r"input_embeds has dtype int32: expected a floating dtype"):
        _propose(graphdef, state, cache, *(good[n] for n in names), input_embeds=embeds)


def test_objects_of_the_wrong_type_are_refused_by_name(small_round):
    """A None or a config in place of the draft failed on a missing attribute."""
    draft, cache, good = small_round
    with CompileCounter() as counter:
        for wrong, name in ((None, "NoneType"), (draft.cfg, "DraftConfig")):
            with pytest.raises(TypeError, match=rf"draft must be a DSparkDraft, got {name}"):
                propose_eager(wrong, cache, **good)
        with pytest.raises(TypeError, match=r"cfg must be a DraftConfig, got DSparkDraft"):
            validate_proposal_inputs(draft, cache, **good)
    assert counter.count == 0 and counter.lowerings == 0


@pytest.mark.parametrize("jitted", [False, True])
def test_a_cache_of_integer_dtype_is_refused(small_round, jitted):
    """The draft attends over the cache: integer keys and values drafted meaningless tokens."""
    draft, cache, good = small_round
    ints = jax.tree.map(lambda x: x.astype(jnp.int32), cache)
    with pytest.raises(TypeError, match=r"cache.k has dtype int32: expected a floating dtype"):
        if jitted:  # checked while tracing
            graphdef, state = nnx.split(draft)
            names = ("bonus", "prefix_lens", "temperatures", "top_k", "key")
            _propose(graphdef, state, ints, *(good[n] for n in names))
        else:
            propose_eager(draft, ints, **good)


def test_bfloat16_walk_races_on_the_corrected_logits_as_kept():
    """``DraftBlock.corrected_logits`` (model dtype): ``q = softmax(corrected / T)`` is exactly the
    law the sampling rows drew from, so each sampling row's token is the race of its step key on
    the kept bfloat16 corrected logits, not on the float32 ``base + bias`` before rounding.
    Logits in [64, 72) (a bfloat16 unit of 0.5) and a sizeable Markov bias make the two races
    differ in many rows."""
    from dspark_jax.markov import make_markov_head
    from dspark_jax.proposal import walk_block
    from dspark_jax.sampling import sample_step

    cfg = tiny_config(dtype="bfloat16", param_dtype="bfloat16")
    head = make_markov_head(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(9)
    v, r = cfg.vocab_size, cfg.markov_rank
    head.markov_w1[...] = jnp.asarray(rng.standard_normal((v, r)), jnp.bfloat16)
    head.markov_w2[...] = jnp.asarray(0.5 * rng.standard_normal((v, r)), jnp.bfloat16)
    b, gamma = 256, cfg.gamma
    base = jnp.asarray(64.0 + 8.0 * rng.random((b, gamma, v)), jnp.bfloat16)
    hidden = jnp.asarray(rng.standard_normal((b, gamma, cfg.hidden_size)), jnp.bfloat16)
    bonus = jnp.asarray(rng.integers(0, v, b), jnp.int32)
    temps = jnp.where(jnp.arange(b) % 4 == 0, 0.0, 1.0).astype(jnp.float32)
    top_k = jnp.full(b, TOP_K_ALL, jnp.int32)
    key = jax.random.key(10)
    tokens, corrected, greedy, clamped = jax.jit(walk_block, static_argnums=0)(
        head, base, hidden, bonus, temps, top_k, key
    )
    assert corrected.dtype == jnp.bfloat16
    keys = row_keys(key, b)
    for k in range(gamma):
        want = sample_step(corrected[:, k].astype(jnp.float32), clamped, greedy, step_keys(keys, k))
        np.testing.assert_array_equal(
            np.asarray(tokens[:, k])[~np.asarray(greedy)], np.asarray(want)[~np.asarray(greedy)]
        )
