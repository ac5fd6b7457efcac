"""The fused race kernel (Pallas interpreter on the CPU, compiled on GPUs) picks exactly what the XLA sampler picks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import TINY_ROUND_SEED, edge_race_rows, planted_race_rows, tiny_rounds_per_choice

from dspark_jax import sampling as S
from dspark_jax.race_kernel import (
    RACE_ENV,
    RACE_TUNING,
    RaceTuning,
    race_choice,
    race_step,
    race_supported,
    step_key_words,
    use_race_kernel,
)

INTERPRET = jax.default_backend() != "gpu"  # on GPUs the compiled kernel
_sample_step = jax.jit(S.sample_step, static_argnames="race_dtype")  # one compile, not one per primitive


def _walk_inputs(batch, gamma, vocab, seed):
    k = jax.random.split(jax.random.key(seed), 3)
    base = (3 * jax.random.normal(k[0], (batch, gamma, vocab))).astype(jnp.bfloat16)
    bias = jax.random.normal(k[1], (gamma, batch, vocab)).astype(jnp.bfloat16)
    temps = S.clamp_temperatures(jnp.linspace(0.0, 2.0, batch))  # row 0 clamped to 1e-5
    greedy = jnp.arange(batch) % 3 == 1
    return base, bias, temps, greedy, S.row_keys(k[2], batch)


# one block of 64 tokens; 20 and 33 blocks per row (of S.RACE_BLOCK = 128), the last program clamped
@pytest.mark.parametrize("batch, vocab", [(4, 64), (3, 2500), (2, 4100)])
def test_race_step_equals_sample_step(batch, vocab):
    """Tokens and corrected logits equal the XLA walk's, step after step, for greedy and sampling rows."""
    gamma = 2
    base, bias, temps, greedy, keys = _walk_inputs(batch, gamma, vocab, seed=vocab)
    corrected = None
    words = step_key_words(keys, gamma)  # [B, γ, 2]
    for step in range(gamma):
        np.testing.assert_array_equal(np.asarray(words[:, step]), np.asarray(S._key_words(S.step_keys(keys, step))))
        tokens, corrected = race_step(base, bias[step], corrected, temps, greedy, words, step, interpret=INTERPRET)
        logits = base[:, step].astype(jnp.float32) + bias[step].astype(jnp.float32)
        want = _sample_step(logits, temps, greedy, S.step_keys(keys, step), race_dtype=base.dtype)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))
        assert corrected.dtype == base.dtype  # kept in the base logits' dtype, rounded from float32
        np.testing.assert_array_equal(np.asarray(corrected[:, step]), np.asarray(logits.astype(base.dtype)))


# 32 blocks per program (W = 128): 25 blocks, fewer than P, in one program whose loads and stores
# are masked past V; tokens and corrected logits as with one block per program (the default's 8,
# several programs with the last one masked, is checked against XLA above)
def test_blocks_per_program_changes_no_token():
    batch, gamma, vocab = 4, 2, 3073
    base, bias, temps, greedy, keys = _walk_inputs(batch, gamma, vocab, seed=vocab)
    tunings = [RaceTuning(blocks_per_program=p, warps=1, pick_warps=4) for p in (32, 1)]
    words = step_key_words(keys, gamma)
    got = want = None
    rows = (temps, greedy, words)
    for step in range(gamma):
        tokens, got = race_step(base, bias[step], got, *rows, step, interpret=INTERPRET, tuning=tunings[0])
        ref, want = race_step(base, bias[step], want, *rows, step, interpret=INTERPRET, tuning=tunings[1])
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))  # every slot, the masked tail untouched


@pytest.mark.parametrize("per_program", [1, 2])  # 2: the second program's last block past V
def test_edge_quotients_give_the_xla_samplers_tokens(per_program):
    """The rows of :func:`draft_testing.edge_race_rows` (tiny, zero and overflowing quotients,
    ``T = 2¹⁸``), with a bias: the XLA sampler's tokens."""
    base, temps, greedy = edge_race_rows()
    batch, _, vocab = base.shape
    tiny = jnp.asarray([True, True, False, False, True, True, False, False])[:, None]
    bias = jnp.where(tiny, 0.0, jax.random.normal(jax.random.key(1), (batch, vocab)))
    bias = bias.astype(jnp.bfloat16)  # none on the tiny and zero rows (their tops stay tiny)
    tuning = RaceTuning(blocks_per_program=per_program)
    for seed in range(4):
        keys = S.row_keys(jax.random.key(seed), batch)
        words = S._key_words(S.step_keys(keys, 0))[:, None]  # [B, 1, 2]
        tokens, _ = race_step(base, bias, None, temps, greedy, words, 0, interpret=INTERPRET, tuning=tuning)
        logits = base[:, 0].astype(jnp.float32) + bias.astype(jnp.float32)
        want = _sample_step(logits, temps, greedy, S.step_keys(keys, 0), race_dtype=base.dtype)
        np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want))


def test_race_tuning_parses_and_refuses_bad_values():
    assert RaceTuning.parse(" 4:2:8 ") == RaceTuning(blocks_per_program=4, warps=2, pick_warps=8)
    assert RaceTuning.parse("4:2:8").label == "p4w2k8"
    assert (RACE_TUNING.blocks_per_program, RACE_TUNING.warps, RACE_TUNING.pick_warps) == (8, 2, 8)  # measured, note 66
    for field, bad, allowed in [
        ("blocks_per_program", 3, "a power of two"),
        ("blocks_per_program", 0, "a power of two"),
        ("blocks_per_program", 2.0, "a power of two"),
        ("warps", 3, "one of"),
        ("pick_warps", 64, "one of"),
        ("warps", 2.0, "one of"),
        ("warps", True, "one of"),
    ]:
        with pytest.raises(ValueError, match=f"{field}={bad!r} is invalid: must be {allowed}"):
            RaceTuning(**{field: bad})
    for text in ("4:2", "a:2:8", "1:2:8:1"):
        with pytest.raises(ValueError, match="must be P:W:K"):
            RaceTuning.parse(text)
    base = jnp.zeros((1, 1, 2048), jnp.float32)
    with pytest.raises(TypeError, match="tuning=4 is invalid: must be a RaceTuning or None"):
        race_step(base, base[:, 0], None, jnp.ones(1), jnp.ones(1, bool), jnp.zeros((1, 1, 2), jnp.uint32), 0, tuning=4)


@pytest.mark.parametrize("per_program", [1, 32])  # 32: the 20 blocks in one program
def test_ties_nan_and_all_minus_inf_rows(per_program):
    """The planted rows of :func:`draft_testing.planted_race_rows`."""
    base, greedy, want = planted_race_rows()
    batch, _, vocab = base.shape
    bias = jnp.zeros((batch, vocab), jnp.float32)
    temps = jnp.ones((batch,), jnp.float32)
    words = S._key_words(S.row_keys(jax.random.key(0), batch))[:, None]  # [B, 1, 2]
    tuning = RaceTuning(blocks_per_program=per_program)
    tokens, _ = race_step(base, bias, None, temps, greedy, words, 0, interpret=INTERPRET, tuning=tuning)
    np.testing.assert_array_equal(np.asarray(tokens), want)


def test_race_choice_support_and_bad_vocab(monkeypatch):
    assert S.RACE_BLOCK == 128
    assert all(race_supported(v) for v in (151936, 151935, 2500, 1000, 128, 64))
    assert not any(race_supported(v) for v in (127, 96, 32))
    monkeypatch.delenv(RACE_ENV, raising=False)
    assert race_choice() == "auto"
    assert use_race_kernel(512) == (jax.default_backend() == "gpu", False)
    monkeypatch.setenv(RACE_ENV, " Pallas ")
    assert use_race_kernel(512) == (True, jax.default_backend() != "gpu")
    assert use_race_kernel(100) == (False, False)
    monkeypatch.setenv(RACE_ENV, "xla")
    assert use_race_kernel(512) == (False, False)
    monkeypatch.setenv(RACE_ENV, "cuda")
    with pytest.raises(ValueError, match="DSPARK_JAX_RACE='cuda' is invalid"):
        race_choice()
    base = jnp.zeros((1, 1, 100), jnp.float32)
    with pytest.raises(ValueError, match="vocab=100 is not supported by the race kernel: must be at least 128"):
        race_step(base, base[:, 0], None, jnp.ones(1), jnp.ones(1, bool), jnp.zeros((1, 1, 2), jnp.uint32), 0)
    base = jnp.zeros((1, 3, 512), jnp.float32)
    with pytest.raises(ValueError, match=r"key_words has shape \(1, 2\): must be \(B, γ, 2\) = \(1, 3, 2\)"):
        race_step(base, base[:, 0], None, jnp.ones(1), jnp.ones(1, bool), jnp.zeros((1, 2), jnp.uint32), 0)
    words = jnp.zeros((1, 3, 2), jnp.uint32)
    with pytest.raises(ValueError, match=r"corrected has shape \(1, 3, 512\) and dtype float32: must be base's"):
        race_step(base.astype(jnp.bfloat16), base[:, 0], base, jnp.ones(1), jnp.ones(1, bool), words, 0)


def test_propose_with_the_race_kernel_matches_the_xla_walk(monkeypatch):
    """The whole folded round, bf16 tiny draft: same tokens and confidence as the XLA walk and
    the eager round; corrected logits kept in bf16, within bf16 rounding of each other (inside
    one program XLA may keep the bf16 logits GEMMs' outputs in float32, while the kernel reads
    them as stored); each sampling row's tokens are the race on the kept logits."""
    cfg, blocks = tiny_rounds_per_choice(monkeypatch, RACE_ENV, eager=True, gamma=3)  # greedy and sampling rows
    a, b = blocks["xla"], blocks["pallas"]
    for name in ("draft_tokens", "confidence", "greedy_mask"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)))
    np.testing.assert_array_equal(np.asarray(blocks["eager"].draft_tokens), np.asarray(a.draft_tokens))
    keys = S.row_keys(jax.random.key(TINY_ROUND_SEED), 4)
    for block in blocks.values():
        assert block.corrected_logits.dtype == jnp.bfloat16
        sampling = ~np.asarray(block.greedy_mask)
        assert sampling.any() and not sampling.all()
        for k in range(cfg.gamma):  # replay step k's race on the returned (kept) logits
            step = (block.corrected_logits[:, k], block.temperatures, block.greedy_mask, S.step_keys(keys, k))
            again = np.asarray(_sample_step(*step))
            np.testing.assert_array_equal(again[sampling], np.asarray(block.draft_tokens)[sampling, k])
    la, lb = np.asarray(a.corrected_logits, np.float64), np.asarray(b.corrected_logits, np.float64)
    assert la.shape == lb.shape == (4, cfg.gamma, cfg.vocab_size)
    np.testing.assert_allclose(lb, la, rtol=0, atol=2.0**-8 * np.abs(la).max())


def _rounding_rows(vocab, width):
    """Sixteen sampling rows at ``T = 2⁻¹²`` whose only finite logits are two tokens ``a < b``,
    each of base logit 1, ``a`` with a bias of ``2⁻⁹``: the float32 sum ``1 + 2⁻⁹`` is kept as
    exactly 1 in bf16 (half a unit is ``2⁻⁸``). Rows 0–7 hold ``a, b`` in race block 0, rows
    8–15 in blocks 0 and 1. Returns ``(base [16, 1, V] bf16, bias [16, V] bf16, temps, greedy, a, b)``."""
    batch, a = 16, 10
    b = np.where(np.arange(batch) < 8, a + 10, width + 10)  # same block, then the next block
    base = np.full((batch, 1, vocab), -np.inf)
    base[:, 0, a] = 1.0
    base[np.arange(batch), 0, b] = 1.0
    bias = np.zeros((batch, vocab))
    bias[:, a] = 2.0**-9
    temps = S.clamp_temperatures(jnp.full((batch,), 2.0**-12, jnp.float32))
    return jnp.asarray(base, jnp.bfloat16), jnp.asarray(bias, jnp.bfloat16), temps, jnp.zeros(batch, bool), a, b


@pytest.mark.parametrize("per_program", [1, 2])
def test_sampling_races_the_kept_logits_not_their_float32_sums(per_program):
    """Sampling rows race ``softmax(kept / T)`` over the corrected logits rounded to the base
    logits' dtype (the values the round returns), both in the blocks' race (block mass) and in
    the pick's race among the best block's tokens. Here the two tokens' kept logits are equal,
    so each is the pick with probability 1/2; a race on the float32 sums (``a`` ahead by
    ``2⁻⁹ / T = 8``) would pick ``a`` with probability ``1 / (1 + e⁻⁸) > 0.999`` in every row.
    Checked: every pick is ``a`` or ``b``, ``b`` is picked in both row groups (16 draws: the
    seed is fixed), and the tokens equal the XLA sampler's on the same float32 sums."""
    vocab = 256
    width = S.race_width(vocab)
    base, bias, temps, greedy, a, b = _rounding_rows(vocab, width)
    sums = base[:, 0].astype(jnp.float32) + bias.astype(jnp.float32)
    assert np.all(np.asarray(sums[:, a]) == 1 + 2.0**-9) and np.all(np.asarray(sums.astype(jnp.bfloat16)[:, a]) == 1)
    keys = S.row_keys(jax.random.key(7), base.shape[0])
    words = S._key_words(S.step_keys(keys, 0))[:, None]  # [B, 1, 2]
    tuning = RaceTuning(blocks_per_program=per_program)
    tokens, _ = race_step(base, bias, None, temps, greedy, words, 0, interpret=INTERPRET, tuning=tuning)
    tokens = np.asarray(tokens)
    assert np.all((tokens == a) | (tokens == b)), tokens
    assert (tokens[:8] == b[:8]).any() and (tokens[8:] == b[8:]).any(), tokens  # each group: b drawn
    want = _sample_step(sums, temps, greedy, S.step_keys(keys, 0), race_dtype=base.dtype)
    np.testing.assert_array_equal(tokens, np.asarray(want))
