"""The exponential-race sampler: distribution, determinism rules and key handling.

Statistical tolerance (used by every frequency test here and in test_proposal.py):
for ``n`` independent draws over ``V`` cells with probabilities ``p``,
``E[TV] = ½ Σ E|p̂_v − p_v| ≤ ½ Σ sqrt(p_v / n) ≤ ½ sqrt(V / n)`` (Cauchy–Schwarz), and
TV changes by at most ``1 / n`` when one draw changes, so McDiarmid gives
``P(TV ≥ E[TV] + t) ≤ exp(−2 n t²)``. With ``t = sqrt(ln(1/δ) / (2n))`` and
``δ = 1e-6`` a correct sampler fails one check with probability below 1e-6.
"""

from __future__ import annotations

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import sampling as S
from dspark_jax.sampling import (
    MIN_TEMPERATURE,
    TOP_K_ALL,
    greedy_rows,
    log_exponential_noise,
    row_keys,
    sample_step,
    step_keys,
)

N_DRAWS = 20_000


def tv_bound(vocab: int, n: int, delta: float = 1e-6) -> float:
    """``½ sqrt(V / n) + sqrt(ln(1/δ) / 2n)`` (see the module docstring)."""
    return 0.5 * math.sqrt(vocab / n) + math.sqrt(math.log(1 / delta) / (2 * n))


def softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(-1, keepdims=True))
    return z / z.sum(-1, keepdims=True)


def tv(freq: np.ndarray, p: np.ndarray) -> float:
    return 0.5 * float(np.abs(freq - p).sum())


_sample = jax.jit(sample_step, static_argnames="race_dtype")  # one compile, not one per primitive

LOGITS = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, -3.0], np.float32)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_sampled_frequencies_match_softmax_over_temperature(temperature):
    v = LOGITS.size
    logits = np.broadcast_to(LOGITS, (N_DRAWS, v))
    tokens = np.asarray(
        _sample(logits, np.full(N_DRAWS, temperature, np.float32), np.zeros(N_DRAWS, bool), jax.random.key(7))
    )
    freq = np.bincount(tokens, minlength=v) / N_DRAWS
    expected = softmax(LOGITS.astype(np.float64) / temperature)
    bound = tv_bound(v, N_DRAWS)
    # The test has power: the neighbouring temperatures' distributions are far outside the bound.
    for other in (0.5, 1.0, 2.5):
        if other != temperature:
            assert tv(softmax(LOGITS.astype(np.float64) / other), expected) > 3 * bound
    assert tv(freq, expected) < bound


@pytest.mark.parametrize("temperature", [0.5, 1.0])
def test_sampled_frequencies_match_softmax_across_race_blocks(temperature):
    """V = 2W + W/2: three race blocks (the last one short). Cells: three strong tokens, one per
    block, and the rest of each block; a block weighed by its token count, or by its best
    token, instead of its mass would miss the bound by far (checked)."""
    w = S.RACE_BLOCK
    vocab = 2 * w + w // 2
    sizes = [w, w, vocab - 2 * w]
    strong = [5, w + 6, 2 * w + 40]
    rng = np.random.default_rng(11)
    logits = rng.standard_normal(vocab).astype(np.float32) + np.repeat([1.0, -1.0, 0.0], sizes)
    logits[strong] = [3.0, 3.0, 2.0]  # both wrong laws ≥ 10 bounds away at either temperature
    tokens = np.asarray(
        _sample(
            np.broadcast_to(logits, (N_DRAWS, vocab)),
            np.full(N_DRAWS, temperature, np.float32),
            np.zeros(N_DRAWS, bool),
            jax.random.key(12),
        )
    )
    cell_of = np.repeat(np.arange(3), sizes) + 3
    cell_of[strong] = [0, 1, 2]
    p = softmax(logits.astype(np.float64) / temperature)
    expected = np.bincount(cell_of, weights=p, minlength=6)
    freq = np.bincount(cell_of[tokens], minlength=6) / N_DRAWS
    bound = tv_bound(6, N_DRAWS)
    blocks = np.repeat(np.arange(3), sizes)
    by_count = np.bincount(blocks, minlength=3) / vocab
    by_best = softmax(np.array([logits[b == blocks].max() for b in range(3)], np.float64) / temperature)
    block = np.arange(6) % 3  # the block of each cell
    within = expected / np.bincount(block, weights=expected, minlength=3)[block]
    for wrong in (by_count, by_best):
        assert tv(within * wrong[block], expected) > 3 * bound
    assert tv(freq, expected) < bound


def test_sampled_frequencies_match_softmax_for_odd_vocabulary():
    # V = 7: one race block of 7 tokens.
    logits = LOGITS[:7]
    batch = np.broadcast_to(logits, (N_DRAWS, 7))
    tokens = np.asarray(_sample(batch, np.ones(N_DRAWS, np.float32), np.zeros(N_DRAWS, bool), jax.random.key(8)))
    assert tokens.max() < 7
    freq = np.bincount(tokens, minlength=7) / N_DRAWS
    assert tv(freq, softmax(logits.astype(np.float64))) < tv_bound(7, N_DRAWS)


def test_noise_is_fresh_at_every_step():
    # Uniform logits: tokens of steps 0 and 1 must be independent, so the joint histogram
    # over V² cells is uniform; reusing a step's noise would put all mass on the diagonal.
    v = 8
    keys = row_keys(jax.random.key(3), N_DRAWS)
    logits = np.zeros((N_DRAWS, v), np.float32)
    temps, greedy = np.ones(N_DRAWS, np.float32), np.zeros(N_DRAWS, bool)
    first = np.asarray(_sample(logits, temps, greedy, step_keys(keys, 0)))
    second = np.asarray(_sample(logits, temps, greedy, step_keys(keys, 1)))
    joint = np.bincount(first * v + second, minlength=v * v) / N_DRAWS
    assert tv(joint, np.full(v * v, 1 / (v * v))) < tv_bound(v * v, N_DRAWS)


def test_noise_is_strictly_positive_exponential():
    log_e = np.asarray(log_exponential_noise(jax.random.split(jax.random.key(0), 64), 4096))
    assert np.isfinite(log_e).all()
    e = np.exp(log_e.astype(np.float64)).ravel()
    # Exp(1): mean 1, P(E > 1) = 1/e; 262144 draws, 6-sigma tolerances.
    n = e.size
    assert abs(e.mean() - 1.0) < 6 / math.sqrt(n)
    assert abs((e > 1).mean() - math.exp(-1)) < 6 * math.sqrt(math.exp(-1) * (1 - math.exp(-1)) / n)


def test_greedy_rows_ignore_noise_and_temperature():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 50)).astype(np.float32)
    expected = logits.argmax(-1)
    for seed, temp in ((0, 0.7), (1, 3.0), (2, 1e-3)):
        got = _sample(logits, np.full(16, temp, np.float32), np.ones(16, bool), jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(got), expected)


def test_ties_go_to_lowest_token_id():
    # Greedy: equal maxima at ids 1, 3, 4.
    logits = np.array([[0.0, 3.0, 1.0, 3.0, 3.0], [-1.0, 2.0, 2.0, -np.inf, 2.0]], np.float32)
    got = _sample(logits, np.ones(2, np.float32), np.ones(2, bool), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), [1, 1])
    # Sampled: +inf logits race at +inf whatever the noise, an exact tie in the scores.
    tied = np.broadcast_to(np.array([0.0, np.inf, 5.0, np.inf], np.float32), (500, 4))
    got = _sample(tied, np.full(500, 0.8, np.float32), np.zeros(500, bool), jax.random.key(1))
    assert (np.asarray(got) == 1).all()


def test_all_minus_inf_or_nan_row_yields_token_zero():
    logits = np.zeros((4, 6), np.float32)
    logits[0] = -np.inf
    logits[1] = np.nan
    logits[2] = [-np.inf, np.nan, -np.inf, np.nan, -np.inf, -np.inf]
    logits[3] = [-np.inf, np.nan, -np.inf, 2.0, -np.inf, -np.inf]  # NaN counts as -inf
    for greedy in (True, False):
        for seed in range(3):
            got = _sample(logits, np.ones(4, np.float32), np.full(4, greedy), jax.random.key(seed))
            np.testing.assert_array_equal(np.asarray(got), [0, 0, 0, 3])


def test_minus_inf_tokens_are_never_sampled():
    logits = np.broadcast_to(np.array([-np.inf, 0.0, -np.inf, 0.0], np.float32), (4000, 4))
    got = np.asarray(_sample(logits, np.full(4000, 5.0, np.float32), np.zeros(4000, bool), jax.random.key(1)))
    assert set(np.unique(got)) == {1, 3}


def test_temperature_is_clamped_at_min_temperature():
    n = 2000
    # Logits 2e-5 apart: at T = 1e-5 that is 2 nats, so the race is genuinely random.
    near = np.broadcast_to(np.array([0.0, 2e-5, 1e-5], np.float32), (n, 3))
    keys = jax.random.key(11)
    at_min = np.asarray(_sample(near, np.full(n, MIN_TEMPERATURE, np.float32), np.zeros(n, bool), keys))
    below = np.asarray(_sample(near, np.full(n, 1e-7, np.float32), np.zeros(n, bool), keys))
    np.testing.assert_array_equal(below, at_min)
    assert len(np.unique(at_min)) == 3  # not argmax: without the clamp 1e-7 would always pick 1
    # Well-separated logits: a clamped tiny temperature is argmax for every key.
    far = np.broadcast_to(np.array([0.0, 1e-2, -1e-2], np.float32), (n, 3))
    got = np.asarray(_sample(far, np.full(n, 1e-7, np.float32), np.zeros(n, bool), keys))
    assert (got == 1).all()


def test_greedy_rows_rule():
    temps = np.array([0.0, 0.0, 1.0, 1.0, 0.5, 0.7, np.nan, -1.0, 1e-30], np.float32)
    top_k = np.array([TOP_K_ALL, 1, 1, 0, 2, TOP_K_ALL, TOP_K_ALL, TOP_K_ALL, TOP_K_ALL])
    want = [True, True, True, True, False, False, True, True, False]  # NaN is not > 0: greedy
    np.testing.assert_array_equal(np.asarray(greedy_rows(temps, top_k)), want)
    np.testing.assert_array_equal(np.asarray(jax.jit(greedy_rows)(temps, top_k)), want)


def test_zero_temperature_row_is_greedy_through_the_rule():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((64, 20)).astype(np.float32)
    temps = np.zeros(64, np.float32)
    got = _sample(logits, temps, greedy_rows(temps, np.full(64, TOP_K_ALL)), jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(got), logits.argmax(-1))


def test_per_row_keys_make_rows_independent_of_the_batch():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 30)).astype(np.float32)
    temps = np.full(6, 1.3, np.float32)
    keys = jax.random.split(jax.random.key(5), 6)
    full = np.asarray(_sample(logits, temps, np.zeros(6, bool), keys))
    order = np.array([4, 1, 5])
    subset = np.asarray(_sample(logits[order], temps[order], np.zeros(3, bool), keys[order]))
    np.testing.assert_array_equal(subset, full[order])


def test_one_key_rows_do_not_depend_on_batch_size():
    # Row b of one key uses fold_in(key, b), so padding a batch leaves its rows unchanged.
    keys3 = jax.random.key_data(row_keys(jax.random.key(9), 3))
    keys8 = jax.random.key_data(row_keys(jax.random.key(9), 8))
    np.testing.assert_array_equal(np.asarray(keys8[:3]), np.asarray(keys3))


def test_raw_and_typed_keys_agree():
    typed = jax.random.key(21)
    raw = jax.random.key_data(typed)
    for single_typed, single_raw in (
        (typed, raw),
        (jax.random.split(typed, 4), jax.random.key_data(jax.random.split(typed, 4))),
    ):
        a = jax.random.key_data(row_keys(single_typed, 4))
        b = jax.random.key_data(row_keys(single_raw, 4))
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "key",
    [
        7,
        np.zeros(2, np.float32),
        np.zeros(3, np.uint32),
        np.zeros((5, 2), np.uint32),
        "seed",
    ],
    ids=["int", "float-array", "raw-wrong-length", "raw-wrong-batch", "str"],
)
def test_bad_key_raises_type_error_naming_key(key):
    with pytest.raises(TypeError, match=r"^key"):
        row_keys(key, 4)


def test_sample_step_refuses_a_greedy_mask_that_is_not_bool():
    """A float mask (temperatures passed in its place, say) would pick rows by being nonzero."""
    step = jax.jit(S.sample_step)
    for mask in (jnp.asarray([0.0, 0.7, 1.0]), jnp.asarray([0, 1, 0], jnp.int32)):
        with pytest.raises(TypeError, match=f"greedy_mask has dtype {mask.dtype}: expected bool"):
            step(jnp.zeros((3, 8)), jnp.ones((3,)), mask, jax.random.key(0))


def test_typed_keys_of_wrong_batch_raise():
    with pytest.raises(TypeError, match=r"key has shape \(3,\) for batch 4"):
        row_keys(jax.random.split(jax.random.key(0), 3), 4)


@pytest.mark.parametrize(
    ("logits", "temps", "greedy", "message"),
    [
        ((3, 8), (1,), (3,), r"temperatures has shape \(1,\): expected \[B\] = \(3,\)"),
        ((3, 8), (3,), (3, 1), r"greedy_mask has shape \(3, 1\): expected \[B\] = \(3,\)"),
        ((8,), (1,), (1,), r"logits has shape \(8,\): expected \[B, V\]"),
        ((3, 0), (3,), (3,), r"logits has shape \(3, 0\): expected \[B, V\] with B, V >= 1"),
        ((0, 8), (0,), (0,), r"logits has shape \(0, 8\): expected \[B, V\] with B, V >= 1"),
    ],
)
def test_sample_step_refuses_mismatched_shapes_while_tracing(logits, temps, greedy, message):
    """A [1] temperature would otherwise broadcast over every row without a word."""
    step = jax.jit(S.sample_step)
    with pytest.raises(ValueError, match=message):
        step(jnp.zeros(logits), jnp.ones(temps), jnp.zeros(greedy, bool), jax.random.key(0))


def test_sampling_rows_race_on_the_kept_logits_greedy_rows_take_the_float32_argmax():
    """``race_dtype``: a sampling row's law is ``softmax(kept / T)`` for the logits as kept."""
    n, v = 4000, 16
    row = np.full(v, -30.0, np.float32)
    row[0], row[1] = 8.0, 8.01  # two float32 values, one bfloat16 value (its unit is 1/16 at 8)
    kept = np.asarray(jnp.asarray(row, jnp.bfloat16).astype(jnp.float32))
    assert kept[0] == kept[1] != row[1]
    temps, greedy = np.full(n, 1e-3, np.float32), np.arange(n) % 2 == 0
    key = jax.random.key(5)
    got = np.asarray(_sample(np.broadcast_to(row, (n, v)), temps, greedy, key, race_dtype=jnp.bfloat16))
    on_kept = np.asarray(_sample(np.broadcast_to(kept, (n, v)), temps, greedy, key))
    plain = np.asarray(_sample(np.broadcast_to(row, (n, v)), temps, greedy, key))
    # Sampling rows: exactly the race on the kept values, a fair coin between the tied tokens
    # (|share − ½| within 6 standard deviations of a fair coin over the sampling rows) ...
    np.testing.assert_array_equal(got[~greedy], on_kept[~greedy])
    assert abs(np.mean(got[~greedy] == 0) - 0.5) < 6 * np.sqrt(0.25 / np.sum(~greedy))
    # ... where the float32 race all but always picks token 1 (token 0 at odds of e^-10).
    assert np.mean(plain[~greedy] == 1) > 0.99
    # Greedy rows: the float32 argmax, not the kept values' lowest tied id.
    assert (got[greedy] == 1).all() and (on_kept[greedy] == 0).all()


def test_sample_step_is_float32_for_low_precision_logits():
    logits = jnp.asarray(np.random.default_rng(3).standard_normal((8, 40)), jnp.bfloat16)
    got = _sample(logits, np.ones(8, np.float32), np.ones(8, bool), jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(logits.astype(jnp.float32)).argmax(-1))


def test_round_to_rounds_as_the_conversion_does_in_a_form_xla_keeps():
    """``round_to`` equals ``x.astype(dtype).astype(float32)`` (bf16, float16 with its subnormals
    and overflow, float32) and lowers to ops XLA cannot fold away: ``reduce_precision`` for the
    float32-range formats, a conversion behind an optimisation barrier for float16 (a bare
    convert pair is what XLA:GPU drops under excess precision)."""
    rng = np.random.default_rng(40)
    special = [np.inf, -np.inf, np.nan, 0.0, -0.0, 65504.0, 65520.0, 1e5, 3.0e38, 1e-45, 6e-8, 3e-8]
    x = np.concatenate([10 * rng.standard_normal(4096), 1e-5 * rng.standard_normal(512), special]).astype(np.float32)
    ops = {jnp.bfloat16: "reduce_precision", jnp.float16: "optimization_barrier", jnp.float32: "reduce_precision"}
    for dtype, op in ops.items():
        want = np.asarray(jnp.asarray(x).astype(dtype).astype(jnp.float32))
        fn = jax.jit(S.round_to, static_argnums=1)
        np.testing.assert_array_equal(np.asarray(fn(x, dtype)), want)
        assert f"stablehlo.{op}" in fn.lower(x, dtype).as_text()
    lowered = jax.jit(S.sample_step, static_argnames="race_dtype").lower(
        x[None, :64], np.ones(1, np.float32), np.zeros(1, bool), jax.random.key(0), race_dtype=jnp.bfloat16
    )
    assert "stablehlo.reduce_precision" in lowered.as_text()


@pytest.mark.parametrize(
    "key",
    [jax.random.key(3), jax.random.key_data(jax.random.key(3)), jax.random.key(3, impl="rbg")],
    ids=["typed", "raw", "typed-other-impl"],
)
def test_check_one_key_accepts_one_key_of_any_form(key):
    S.check_one_key(key)  # no error


@pytest.mark.parametrize(
    ("key", "message"),
    [
        (7, r"key=7 has type int"),
        (np.zeros(2, np.float32), r"key has dtype float32"),
        (np.zeros((4, 2), np.uint32), r"key has shape \(4, 2\)"),
        (jax.random.split(jax.random.key(0), 4), r"key has shape \(4,\)"),
    ],
    ids=["int", "float-array", "raw-batch", "typed-batch"],
)
def test_check_one_key_refuses_batches_and_non_keys_naming_key(key, message):
    with pytest.raises(TypeError, match=message + r": expected one PRNG key \(a typed .*\)$"):
        S.check_one_key(key)


@pytest.mark.parametrize("batch", [-1, 0, 2.0, True, "2", np.float32(2)])
def test_row_keys_refuses_a_batch_that_is_not_a_positive_integer(batch):
    """Batches of -1 and 0 used to give empty keys, and 2.0 to pass."""
    with pytest.raises(ValueError, match="^" + re.escape(f"batch={batch!r} is invalid: must be an integer >= 1")):
        row_keys(jax.random.key(0), batch)


def test_row_keys_takes_a_numpy_integer_batch():
    assert row_keys(jax.random.key(0), np.int64(3)).shape == (3,)


def test_row_and_step_keys_are_fold_ins_of_the_row_and_the_step():
    """The documented key layout, pinned with plain ``jax.random`` calls (the NumPy reference of
    the proposal tests calls these functions itself, so a shifted layout passed there): row
    ``b`` of one key is ``fold_in(key, b)``, step ``k`` of a row key ``fold_in(row_key, k)``."""
    key = jax.random.key(11)
    rows = row_keys(key, 3)
    for b in range(3):
        want = jax.random.key_data(jax.random.fold_in(key, b))
        np.testing.assert_array_equal(jax.random.key_data(rows[b]), want)
        step = jax.random.key_data(S.step_keys(rows, 2)[b])
        np.testing.assert_array_equal(step, jax.random.key_data(jax.random.fold_in(rows[b], 2)))
    raw = row_keys(jax.random.key_data(key), 3)  # a raw key: the same keys
    np.testing.assert_array_equal(jax.random.key_data(raw), jax.random.key_data(rows))


def test_temperatures_above_the_1e_5_clamp_sample_their_own_law():
    """DSPARK_SPEC §3 clamps temperatures below at 1e-5, no higher: T = 5e-5 must sample
    ``softmax(logits / 5e-5)`` (logits 5e-5 apart: 1 nat apart). Tolerance: ``tv_bound`` (module
    docstring, δ = 1e-6); a clamp at 1e-3 would draw a near-uniform law, over 10 bounds away."""
    logits = np.array([0.0, 5e-5, 1e-4, -5e-5], np.float32)
    temperature = 5e-5
    tokens = np.asarray(
        _sample(
            np.broadcast_to(logits, (N_DRAWS, 4)),
            np.full(N_DRAWS, temperature, np.float32),
            np.zeros(N_DRAWS, bool),
            jax.random.key(21),
        )
    )
    freq = np.bincount(tokens, minlength=4) / N_DRAWS
    expected = softmax(logits.astype(np.float64) / temperature)
    bound = tv_bound(4, N_DRAWS)
    assert tv(softmax(logits.astype(np.float64) / 1e-3), expected) > 10 * bound
    assert tv(freq, expected) < bound


def test_race_dtype_rounds_the_logits_of_the_block_race_too():
    """With ``race_dtype`` every level of the two-level race reads the kept (rounded) logits: the
    blocks' masses as well as the winning block's tokens, so the tokens are exactly those of the
    race run on the kept values. Logits in [64, 72) (a bfloat16 unit of 0.5 there) and four race
    blocks make block masses from the unrounded logits pick another block in many rows."""
    n, v = 512, 3 * S.RACE_BLOCK + 1
    rng = np.random.default_rng(23)
    logits = (64.0 + 8.0 * rng.random((n, v))).astype(np.float32)
    kept = np.asarray(jnp.asarray(logits, jnp.bfloat16).astype(jnp.float32))
    temps, greedy, key = np.ones(n, np.float32), np.zeros(n, bool), jax.random.key(24)
    got = np.asarray(_sample(logits, temps, greedy, key, race_dtype=jnp.bfloat16))
    np.testing.assert_array_equal(got, np.asarray(_sample(kept, temps, greedy, key)))
