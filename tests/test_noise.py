"""The race noise generator (bit-exact Philox-4x32-10 layout, word → U → log E, marginals,
independence) and the two-level race against a NumPy reference.

Tolerances:

- Uniformity of ``U`` (recovered as ``exp(−E)`` from the noise, in float64): the
  Dvoretzky–Kiefer–Wolfowitz inequality with Massart's constant,
  ``P(sup |F̂_n − F| > ε) ≤ 2 exp(−2 n ε²)``, holds for every ``n``; with ``δ = 1e-6``,
  ``ε = sqrt(ln(2/δ) / 2n)``. ``U`` lives on the ``2²³`` cell midpoints, whose CDF is within
  ``2⁻²⁴`` of the continuous one, which is added to ``ε``.
- Moments of ``log E`` (``−log E`` is standard Gumbel: mean ``γ``, variance ``π²/6``, excess
  kurtosis ``12/5``): the sample mean has standard deviation ``sqrt(π²/6 / n)`` and the
  sample variance ``sqrt((κ − 1) / n) · π²/6`` with ``κ = 3 + 12/5``; both are checked at 6
  standard deviations (normal approximation, ``n = 2¹⁸``).
- Independence of two noise values: under independence the sample correlation of ``n``
  pairs is approximately ``N(0, 1/n)``, checked at ``5 / sqrt(n)`` (two-sided ``p ≈ 6e-7``);
  their 16 × 16 joint histogram is checked against the uniform one with the TV bound of
  ``test_sampling.py``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_sampling import tv, tv_bound

from dspark_jax import sampling as S
from dspark_jax.sampling import (
    MIN_TEMPERATURE,
    _log_exponential,
    _uniform,
    log_exponential_noise,
    row_keys,
    sample_step,
    step_keys,
)

PHILOX_M = (0xD2511F53, 0xCD9E8D57)
PHILOX_W = (0x9E3779B9, 0xBB67AE85)
MASK = np.uint64(0xFFFFFFFF)


def philox4x32(key: tuple[int, int], counter: tuple, rounds: int = 10) -> tuple[np.ndarray, ...]:
    """Philox-4x32 (Salmon et al., SC 2011), NumPy: 64-bit products of 32-bit words in uint64.

    A round: ``(h₀, l₀) = M₀·c₀``, ``(h₁, l₁) = M₁·c₂``,
    ``c ← (h₁ ⊕ c₁ ⊕ k₀, l₁, h₀ ⊕ c₃ ⊕ k₁, l₀)``, then ``k ← k + (W₀, W₁)`` mod 2³².
    """
    c = [np.asarray(x, np.uint64) for x in counter]
    k0, k1 = (np.uint64(x) for x in key)
    for _ in range(rounds):
        p0, p1 = np.uint64(PHILOX_M[0]) * c[0], np.uint64(PHILOX_M[1]) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & MASK, (p0 >> np.uint64(32)) ^ c[3] ^ k1, p0 & MASK]
        k0, k1 = (k0 + np.uint64(PHILOX_W[0])) & MASK, (k1 + np.uint64(PHILOX_W[1])) & MASK
    return tuple(x.astype(np.uint32) for x in c)


def reference_uniform(words: np.ndarray) -> np.ndarray:
    """``U = (⌊w / 2⁹⌋ + ½) / 2²³`` in float64: the midpoint of the cell the top 23 bits pick."""
    return (np.floor(np.asarray(words, np.float64) / 2**9) + 0.5) / 2**23


def reference_noise(key_words: np.ndarray, ids, domain: int = 0) -> np.ndarray:
    """``log E`` ``[B, N]`` float64: id ``i`` (a token, or a race block for domain 1) gets word 0
    of Philox block ``(i, domain, 0, 0)`` under the row's key words."""
    i = np.asarray(ids, np.uint32)
    zero = np.zeros_like(i)
    rows = [philox4x32((k0, k1), (i, zero + domain, zero, zero))[0] for k0, k1 in key_words]
    return np.log(-np.log(reference_uniform(np.stack(rows))))


def uniforms(log_e) -> np.ndarray:
    """``U = exp(−E)`` recovered from ``log E`` in float64."""
    return np.exp(-np.exp(np.asarray(log_e, np.float64)))


KNOWN_ANSWERS = [  # Random123's kat_vectors for philox4x32 with 10 rounds
    ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0xA4093822, 0x299F31D0),
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


@pytest.mark.parametrize(("key", "counter", "expected"), KNOWN_ANSWERS)
def test_philox_matches_random123_known_answers(key, counter, expected):
    assert tuple(int(w[0]) for w in philox4x32(key, tuple([x] for x in counter))) == expected
    k0, k1 = (jnp.uint32(x) for x in key)
    got = S.philox4x32(k0, k1, tuple(jnp.array([x], jnp.uint32) for x in counter))
    assert tuple(int(w[0]) for w in got) == expected
    if counter == (0, 0, 0, 0):  # words known to be zero (the int 0) skip their products: same block
        assert tuple(int(w) for w in S.philox4x32(k0, k1, (0, 0, 0, 0))) == expected


def test_mul_hi_lo_is_the_exact_64_bit_product():
    edge = [0, 1, 2, 0xFFFF, 0x10000, 0x10001, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFE, 0xFFFFFFFF]
    rng = np.random.default_rng(0)
    a = np.concatenate([np.array(edge, np.uint64), rng.integers(0, 2**32, 4096, dtype=np.uint64)])
    for m in (*PHILOX_M, 0xFFFFFFFF, 1, 0x10000):
        product = a * np.uint64(m)  # < 2⁶⁴: exact in uint64
        hi, lo = S.mul_hi_lo(jnp.asarray(a.astype(np.uint32)), np.uint32(m))
        np.testing.assert_array_equal(np.asarray(hi), (product >> np.uint64(32)).astype(np.uint32))
        np.testing.assert_array_equal(np.asarray(lo), (product & MASK).astype(np.uint32))


@pytest.mark.parametrize("vocab", [1, 10, 11, 12])
@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_noise_is_the_documented_philox_generator(vocab, raw):
    keys = jax.random.split(jax.random.key(12), 3)
    key_words = np.asarray(jax.random.key_data(keys))
    got = np.asarray(log_exponential_noise(key_words if raw else keys, vocab))
    assert got.shape == (3, vocab) and got.dtype == np.float32
    # Swapped words, another layout or a wrong cell would move values by O(1), far above 2e-6.
    np.testing.assert_allclose(got, reference_noise(key_words, np.arange(vocab)), rtol=0, atol=2e-6)
    blocks = np.asarray(S.log_exponential_block_noise(key_words if raw else keys, vocab))
    np.testing.assert_allclose(blocks, reference_noise(key_words, np.arange(vocab), domain=1), rtol=0, atol=2e-6)


def test_words_map_to_cell_midpoints():
    words = np.array([0, 1, 255, 256, 511, 512, 2**23, 2**31 - 1, 2**31, 0x12345678, 2**32 - 512, 2**32 - 1], np.uint32)
    u = np.asarray(_uniform(words))
    expected = reference_uniform(words)
    np.testing.assert_array_equal(u.astype(np.float64), expected)  # every midpoint is a float32: exact
    assert expected[0] == 2**-24 and expected[-1] == 1 - 2**-24
    assert ((u > 0) & (u < 1)).all()
    log_e = np.asarray(_log_exponential(words))
    assert np.isfinite(log_e).all()
    np.testing.assert_allclose(log_e, np.log(-np.log(expected)), rtol=1e-6, atol=1e-6)


def ks_distance_to_uniform(x: np.ndarray) -> float:
    """``sup_x |F̂_n(x) − x|`` of samples in ``[0, 1]``."""
    x = np.sort(x.ravel())
    n = x.size
    return float(max((np.arange(1, n + 1) / n - x).max(), (x - np.arange(n) / n).max()))


def test_uniform_marginal_is_uniform():
    u = uniforms(log_exponential_noise(jax.random.split(jax.random.key(30), 16), 4096))
    n = u.size  # 2^16
    eps = math.sqrt(math.log(2 / 1e-6) / (2 * n)) + 2**-24
    assert ks_distance_to_uniform(u) < eps
    # The test has power: U² (CDF sqrt(x), distance 1/4 at x = 1/4) is far outside the bound.
    assert ks_distance_to_uniform(u**2) > 5 * eps


def test_log_noise_has_log_exponential_mean_and_variance():
    log_e = np.asarray(log_exponential_noise(jax.random.split(jax.random.key(31), 64), 4096), np.float64).ravel()
    n = log_e.size  # 2^18
    var = math.pi**2 / 6
    assert abs(log_e.mean() + np.euler_gamma) < 6 * math.sqrt(var / n)
    assert abs(log_e.var() - var) < 6 * math.sqrt((3 + 12 / 5 - 1) / n) * var


def _noise_pairs(kind: str) -> tuple[np.ndarray, np.ndarray]:
    """``2¹⁶`` pairs of noise uniforms that must be independent."""
    keys = row_keys(jax.random.key(32), 16)
    if kind == "consecutive-steps":
        keys = keys[:8]
        return (
            uniforms(log_exponential_noise(step_keys(keys, 0), 8192)),
            uniforms(log_exponential_noise(step_keys(keys, 1), 8192)),
        )
    u = uniforms(log_exponential_noise(keys, 8192))  # [16, 8192]
    if kind == "token-and-block":  # token i and race block i: counters (i, 0, 0, 0) and (i, 1, 0, 0)
        return u, uniforms(S.log_exponential_block_noise(keys, 8192))
    if kind == "adjacent-ids":
        return u[:, 0::2], u[:, 1::2]
    return u[0::2], u[1::2]  # adjacent rows: fold_in(key, b) and fold_in(key, b + 1)


@pytest.mark.parametrize("kind", ["token-and-block", "adjacent-ids", "adjacent-rows", "consecutive-steps"])
def test_noise_values_are_uncorrelated(kind):
    a, b = (x.ravel() for x in _noise_pairs(kind))
    n = a.size
    assert n in (2**16, 2**17)
    assert abs(np.corrcoef(a, b)[0, 1]) < 5 / math.sqrt(n)
    cells = np.minimum((a * 16).astype(int), 15) * 16 + np.minimum((b * 16).astype(int), 15)
    assert tv(np.bincount(cells, minlength=256) / n, np.full(256, 1 / 256)) < tv_bound(256, n)


def test_row_noise_ignores_batch_size_and_other_rows():
    vocab = 301
    keys = jax.random.split(jax.random.key(33), 6)
    full = np.asarray(log_exponential_noise(keys, vocab))
    order = np.array([4, 1, 5])
    np.testing.assert_array_equal(np.asarray(log_exponential_noise(keys[order], vocab)), full[order])
    np.testing.assert_array_equal(np.asarray(log_exponential_noise(keys[2:3], vocab)), full[2:3])
    # One key: row b hashes with fold_in(key, b) whatever the batch size.
    small = np.asarray(log_exponential_noise(row_keys(jax.random.key(34), 3), vocab))
    padded = np.asarray(log_exponential_noise(row_keys(jax.random.key(34), 8), vocab))
    np.testing.assert_array_equal(padded[:3], small)


def reference_race(logits, temps, greedy, key_words, width) -> np.ndarray:
    """The two-level race from its equations (module docstring of ``sampling``), NumPy.

    Scores ``x = logits · RN(1/T)`` in float32 as the sampler forms ``logits / T`` (NaN as
    ``-inf``), then in float64: block ``j`` (tokens ``[jW, (j + 1)W)``) scores
    ``logsumexp(x_S) − log E_j``; the best block's tokens score ``x_v − log E_v``; greedy rows
    take the argmax of the logits.
    """
    batch, vocab = logits.shape
    blocks = -(-vocab // width)
    tokens = []
    for b in range(batch):
        if greedy[b]:
            tokens.append(int(np.where(np.isnan(logits[b]), -np.inf, logits[b]).argmax()))
            continue
        x = logits[b] * (np.float32(1) / np.maximum(temps[b], np.float32(MIN_TEMPERATURE)))
        x = np.where(np.isnan(x), -np.inf, x).astype(np.float64)
        log_q = []
        for j in range(blocks):
            part = x[j * width : (j + 1) * width]
            top = part.max()
            log_q.append(top if np.isinf(top) else top + np.log(np.exp(part - top).sum()))
        j = int((np.array(log_q) - reference_noise(key_words[b : b + 1], np.arange(blocks), domain=1)[0]).argmax())
        ids = np.arange(j * width, min((j + 1) * width, vocab))
        raced = x[ids] - reference_noise(key_words[b : b + 1], ids)[0]
        tokens.append(int(ids[np.where(np.isnan(raced), -np.inf, raced).argmax()]))
    return np.array(tokens)


@pytest.mark.parametrize("vocab", [33, S.RACE_BLOCK, 2500, 3 * S.RACE_BLOCK + 1])
def test_sample_step_is_the_two_level_race(vocab):
    rng = np.random.default_rng(35)
    batch = 48
    logits = (3 * rng.standard_normal((batch, vocab))).astype(np.float32)
    logits[0, 5] = np.nan
    logits[1] = -np.inf
    logits[2, [4, vocab - 3]] = np.inf
    logits[3, : vocab // 2] = -np.inf  # whole blocks without mass
    temps = rng.uniform(0.3, 2.0, batch).astype(np.float32)
    temps[4] = 1e-7
    greedy = rng.random(batch) < 0.25
    greedy[:5] = False
    keys = jax.random.split(jax.random.key(36), batch)
    expected = reference_race(logits, temps, greedy, np.asarray(jax.random.key_data(keys)), S.race_width(vocab))
    got = np.asarray(jax.jit(sample_step)(logits, temps, greedy, keys))
    np.testing.assert_array_equal(got, expected)
    assert expected[1] == 0 and expected[2] == 4 and expected[3] >= vocab // 2


W = S.RACE_BLOCK
V3 = 2 * W + W // 2  # three race blocks: [0, W), [W, 2W), [2W, V3), the last one short


def test_ties_across_race_blocks_go_to_lowest_id():
    vocab = V3
    greedy_logits = np.zeros((1, vocab), np.float32)
    greedy_logits[0, [W + 6, 2 * W + 40, vocab - 1]] = 5.0
    sampled_logits = np.full((2, vocab), -np.inf, np.float32)
    sampled_logits[0, [2 * W + 40, W + 6, 2 * W - 8]] = np.inf  # blocks 1 and 2 tie at +inf
    sampled_logits[1, [2 * W + 40, 2 * W + 4]] = np.inf
    sampled_logits[1, : W // 2] = 0.0
    step = jax.jit(sample_step)  # op by op, the Philox words' many small ops compile one by one
    for seed in range(4):
        got = step(greedy_logits, np.ones(1, np.float32), np.array([True]), jax.random.key(seed))
        assert int(got[0]) == W + 6
        got = step(sampled_logits, np.ones(2, np.float32), np.zeros(2, bool), jax.random.key(seed))
        np.testing.assert_array_equal(np.asarray(got), [W + 6, 2 * W + 4])


def test_last_race_block_races_only_its_own_tokens():
    """The last block's window reads the last W tokens; those of the block before are masked.

    Block 1 holds one token ``2W − 8`` (inside that window) at ``log(W/2)`` and block 2 its
    ``W/2`` tokens at 0: each block wins half the rows. Were ``2W − 8`` raced again in block 2's
    window it would win half of those too (share ≈ 3/4); masked, its share is ½ (|share − ½|
    < 0.05 is over 6 standard deviations for 4000 rows).
    """
    vocab, n, token = V3, 4000, 2 * W - 8
    assert vocab - W <= token < 2 * W  # inside the last window, owned by block 1
    row = np.full(vocab, -np.inf, np.float32)
    row[token] = np.log(vocab - 2.0 * W)
    row[2 * W :] = 0.0
    got = np.asarray(
        jax.jit(sample_step)(
            np.broadcast_to(row, (n, vocab)), np.ones(n, np.float32), np.zeros(n, bool), jax.random.key(9)
        )
    )
    assert set(np.unique(got)) <= {token, *range(2 * W, vocab)}
    assert abs(np.mean(got == token) - 0.5) < 0.05


def test_block_mass_is_exact_whatever_the_order():
    rng = np.random.default_rng(41)
    x = (4 * rng.standard_normal((6, 1024))).astype(np.float32)
    x[1, :1000] = -np.inf
    x[2] = -np.inf
    x[3, 17] = np.inf
    top, mass = (np.asarray(a) for a in S.block_mass(jnp.asarray(x)))
    # Integer sums: any order of the terms gives the same float32 (a float32 sum would not).
    perm = rng.permutation(1024)
    np.testing.assert_array_equal(np.asarray(S.block_mass(jnp.asarray(x[:, perm]))[1]), mass)
    finite = np.isfinite(top)
    np.testing.assert_array_equal(top, x.max(-1))
    np.testing.assert_array_equal(mass[~finite], 0.0)
    # Each term within one unit of exp(x − top) · 2³⁰ (float64), the total within float32 rounding.
    exact = (np.exp(x[finite].astype(np.float64) - top[finite, None]) * 2**30).sum(-1)
    assert (np.abs(mass[finite] - exact) <= 1024 + exact * 2**-23).all()
    assert (mass[finite] >= 2**30).all()
    scores = np.asarray(S.block_scores(jnp.asarray(top)[None], jnp.asarray(mass)[None], jnp.zeros((1, 2), jnp.uint32)))
    assert scores[0, 2] == -np.inf and scores[0, 3] == np.inf and np.isfinite(scores[0, [0, 1, 4, 5]]).all()


def test_ties_inside_a_block_go_to_lowest_id():
    sample = jax.jit(sample_step)  # one compile, not one per primitive
    greedy_logits = np.array([[0.0, 1.0, 0.0, 5.0, 0.0, 2.0, 0.0, 5.0]], np.float32)
    got = sample(greedy_logits, np.ones(1, np.float32), np.array([True]), jax.random.key(0))
    assert int(got[0]) == 3
    sampled_logits = np.array([[-np.inf, 0.0, np.inf, 0.0, np.inf, 2.0, 0.0, 5.0]], np.float32)
    for seed in range(4):
        got = sample(sampled_logits, np.ones(1, np.float32), np.array([False]), jax.random.key(seed))
        assert int(got[0]) == 2


def test_non_threefry_keys_raise_type_error():
    keys = jax.random.split(jax.random.key(0, impl="rbg"), 4)
    with pytest.raises(TypeError, match=r"^key has PRNG implementation rbg"):
        log_exponential_noise(keys, 8)


def test_block_mass_rounds_each_term_to_the_nearest_integer():
    """``mass = Σ round(exp(x − top) · 2³⁰)`` with round-to-nearest (module docstring of
    ``sampling``), as ``f32(high) · 2¹⁵ + f32(low)`` of the exact integer sums of the terms' high
    and low 15 bits. The reference takes the float32 terms ``exp(x − top)`` from the same
    ``exp`` (it is not the code under test) and does the rest exactly in float64/int64. Many
    small terms (fractional parts everywhere) make truncation, instead of rounding, move the
    mass by hundreds of units, several float32 ulps of a mass near 2³⁰ (128): compared exactly."""
    rng = np.random.default_rng(42)
    x = rng.uniform(-20.0, -8.0, (4, 1024)).astype(np.float32)
    x[:, 0] = 0.0  # top = 0
    top, mass = (np.asarray(a) for a in S.block_mass(jnp.asarray(x)))
    terms = np.asarray(jnp.exp(jnp.asarray(x) - jnp.asarray(top)[:, None])).astype(np.float64)
    n = np.floor(terms * 2.0**30 + 0.5).astype(np.int64)
    high, low = (n >> 15).sum(-1), (n & 0x7FFF).sum(-1)
    want = np.float32(high.astype(np.float32) * np.float32(2.0**15)) + low.astype(np.float32)
    np.testing.assert_array_equal(top, 0.0)
    np.testing.assert_array_equal(mass, want)
    truncated = np.floor(terms * 2.0**30).astype(np.int64).sum(-1)
    assert (np.abs(n.sum(-1) - truncated) > 3 * 128).all()  # truncating instead: over 3 ulps off


def test_a_nan_logit_counts_as_minus_inf_in_the_block_race():
    """A NaN logit is ``-inf`` (module docstring of ``sampling``) in the blocks' scores as well as
    the tokens': with ``V = 2W``, token 3 NaN, block 0's other logits 0 and block 1's 1, block 0
    wins with probability ``(W − 1) / (W − 1 + W·e)``. Small batches (4 rows, 200 keys), where the
    CPU's reductions propagate a NaN ``top`` (a wide vectorised max may drop it and hide a missing
    NaN guard). Tolerance: 6 standard deviations of the block-0 share over the 800 draws (a
    correct sampler fails with probability below 1e-8); a NaN block score, which never wins the
    lowest-id argmax, gives a share of 0."""
    vocab, rows, calls = 2 * W, 4, 200
    row = np.zeros(vocab, np.float32)
    row[W:] = 1.0
    row[3] = np.nan
    logits = np.broadcast_to(row, (rows, vocab))
    step = jax.jit(sample_step)
    got = np.concatenate(
        [
            np.asarray(step(logits, np.ones(rows, np.float32), np.zeros(rows, bool), jax.random.key(seed)))
            for seed in range(calls)
        ]
    )
    assert 3 not in got
    n, want = got.size, (W - 1) / (W - 1 + W * np.e)
    share = np.mean(got < W)
    assert abs(share - want) < 6 * np.sqrt(want * (1 - want) / n), share
