"""The race noise generator: bit-exact Threefry layout, word → U → log E, marginals, independence.

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
import numpy as np
import pytest
from test_sampling import tv, tv_bound

from dspark_jax.sampling import (
    MIN_TEMPERATURE,
    _log_exponential,
    _uniform,
    log_exponential_noise,
    row_keys,
    sample_step,
    step_keys,
)

ROTATIONS = (13, 15, 26, 6, 17, 29, 16, 24)
SKEIN_KEY_PARITY = 0x1BD11BDA


def threefry2x32(key: tuple[int, int], x0: np.ndarray, x1: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Threefry-2x32 with 20 rounds (Salmon et al., SC 2011), NumPy uint32 arithmetic mod 2³².

    Four rounds of ``x0 += x1; x1 = rotl(x1, r) ^ x0``, then key injection ``s``:
    ``x0 += ks[s mod 3]; x1 += ks[(s + 1) mod 3] + s``, with
    ``ks = (k0, k1, k0 ^ k1 ^ 0x1BD11BDA)``; injection 0 precedes the first round.
    """
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    ks = (k0, k1, k0 ^ k1 ^ np.uint32(SKEIN_KEY_PARITY))
    x0 = np.asarray(x0, np.uint32) + ks[0]
    x1 = np.asarray(x1, np.uint32) + ks[1]
    for r in range(20):
        rot = np.uint32(ROTATIONS[r % 8])
        x0 = x0 + x1
        x1 = ((x1 << rot) | (x1 >> (np.uint32(32) - rot))) ^ x0
        if r % 4 == 3:
            s = r // 4 + 1
            x0 = x0 + ks[s % 3]
            x1 = x1 + ks[(s + 1) % 3] + np.uint32(s)
    return x0, x1


def reference_uniform(words: np.ndarray) -> np.ndarray:
    """``U = (⌊w / 2⁹⌋ + ½) / 2²³`` in float64: the midpoint of the cell the top 23 bits pick."""
    return (np.floor(np.asarray(words, np.float64) / 2**9) + 0.5) / 2**23


def reference_noise(key_words: np.ndarray, vocab: int) -> np.ndarray:
    """``log E`` ``[B, V]`` float64: token ``i`` and ``i + P`` get the words of block ``(i, i + P)``."""
    pairs = (vocab + 1) // 2
    i = np.arange(pairs, dtype=np.uint32)
    rows = []
    for k0, k1 in key_words:
        w0, w1 = threefry2x32((k0, k1), i, i + np.uint32(pairs))
        rows.append(np.concatenate([w0, w1])[:vocab])
    return np.log(-np.log(reference_uniform(np.stack(rows))))


def uniforms(log_e) -> np.ndarray:
    """``U = exp(−E)`` recovered from ``log E`` in float64."""
    return np.exp(-np.exp(np.asarray(log_e, np.float64)))


@pytest.mark.parametrize(
    ("key", "counter", "expected"),
    [
        ((0, 0), (0, 0), (0x6B200159, 0x99BA4EFE)),
        ((0xFFFFFFFF, 0xFFFFFFFF), (0xFFFFFFFF, 0xFFFFFFFF), (0x1CB996FC, 0xBB002BE7)),
        ((0x13198A2E, 0x03707344), (0x243F6A88, 0x85A308D3), (0xC4923A9C, 0x483DF7A0)),
    ],
)
def test_numpy_threefry_matches_random123_known_answers(key, counter, expected):
    w0, w1 = threefry2x32(key, np.array([counter[0]]), np.array([counter[1]]))
    assert (int(w0[0]), int(w1[0])) == expected


@pytest.mark.parametrize("vocab", [1, 10, 11])
@pytest.mark.parametrize("raw", [False, True], ids=["typed", "raw"])
def test_noise_is_the_documented_threefry_generator(vocab, raw):
    keys = jax.random.split(jax.random.key(12), 3)
    key_words = np.asarray(jax.random.key_data(keys))
    got = np.asarray(log_exponential_noise(key_words if raw else keys, vocab))
    assert got.shape == (3, vocab) and got.dtype == np.float32
    # Swapped words, another pairing or a wrong cell would move values by O(1), far above 2e-6.
    np.testing.assert_allclose(got, reference_noise(key_words, vocab), rtol=0, atol=2e-6)


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
    u = uniforms(log_exponential_noise(keys, 8192))  # [16, 8192], P = 4096
    if kind == "same-block":  # tokens i and i + P share one Threefry call
        return u[:, :4096], u[:, 4096:]
    if kind == "adjacent-ids":
        return u[:, 0::2], u[:, 1::2]
    return u[0::2], u[1::2]  # adjacent rows: fold_in(key, b) and fold_in(key, b + 1)


@pytest.mark.parametrize("kind", ["same-block", "adjacent-ids", "adjacent-rows", "consecutive-steps"])
def test_noise_values_are_uncorrelated(kind):
    a, b = (x.ravel() for x in _noise_pairs(kind))
    n = a.size
    assert n == 2**16
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


@pytest.mark.parametrize("vocab", [33, 34])
def test_sample_step_races_log_exponential_noise(vocab):
    # sample_step decides the pairs (i, i + P) first; it must equal the plain race over V.
    rng = np.random.default_rng(35)
    batch = 48
    logits = (3 * rng.standard_normal((batch, vocab))).astype(np.float32)
    logits[0, 5] = np.nan
    logits[1] = -np.inf
    logits[2, [4, 20]] = np.inf
    temps = rng.uniform(0.3, 2.0, batch).astype(np.float32)
    temps[3] = 1e-7
    greedy = rng.random(batch) < 0.25
    greedy[:4] = False
    keys = jax.random.split(jax.random.key(36), batch)
    noise = np.asarray(log_exponential_noise(keys, vocab))
    raced = logits / np.maximum(temps, np.float32(MIN_TEMPERATURE))[:, None] - noise  # float32, as sample_step
    scores = np.where(greedy[:, None], logits, raced)
    expected = np.where(np.isnan(scores), -np.inf, scores).argmax(-1)
    got = np.asarray(jax.jit(sample_step)(logits, temps, greedy, keys))
    np.testing.assert_array_equal(got, expected)
    assert expected[1] == 0 and expected[2] == 4


def test_ties_across_block_halves_go_to_lowest_id():
    # V = 6, P = 3: ids 2 (block 2, low half) and 4 (block 1, high half) tie at the maximum;
    # the earlier block holds the larger id, so an argmax over block winners alone would pick 4.
    greedy_logits = np.array([[0.0, 0.0, 5.0, 0.0, 5.0, 0.0]], np.float32)
    sampled_logits = np.array([[-np.inf, 0.0, np.inf, 0.0, np.inf, 0.0]], np.float32)
    for logits, greedy in ((greedy_logits, True), (sampled_logits, False)):
        for seed in range(4):
            got = sample_step(logits, np.ones(1, np.float32), np.array([greedy]), jax.random.key(seed))
            assert int(got[0]) == 2


def test_non_threefry_keys_raise_type_error():
    keys = jax.random.split(jax.random.key(0, impl="rbg"), 4)
    with pytest.raises(TypeError, match=r"^key has PRNG implementation rbg"):
        log_exponential_noise(keys, 8)
