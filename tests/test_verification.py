"""Accepting drafts: greedy prefix match, chain rejection sampling, top-k/top-p, verify caps."""

from __future__ import annotations

import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax.proposal import DraftBlock
from dspark_jax.sampling import TOP_K_ALL
from dspark_jax.verification import (
    accept,
    accept_with_noise,
    apply_top_k_top_p,
    required_filter_width,
    sample_tokens,
    schedule_verify_lengths,
    target_probs,
)


# ---------------------------------------------------------------- NumPy references
def _softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def _ref_top_k_top_p(probs: np.ndarray, k: int, p: float) -> np.ndarray:
    """One row: rank by (−prob, id), keep the top k, then the shortest prefix with mass >= p."""
    ranked = sorted(range(len(probs)), key=lambda v: (-probs[v], v))[:k]
    mass = sum(probs[v] for v in ranked)
    kept, acc = [], 0.0
    for v in ranked:
        kept.append(v)
        acc += probs[v]
        if p < 1 and acc >= p * mass:
            break
    out = np.zeros_like(probs)
    out[kept] = probs[kept]
    return out / out.sum()


def _ref_accept(logits, drafts, corrected, greedy, temp, k, p, cap, u, e):
    """One row, straight from DSPARK_SPEC §4."""
    gamma = len(drafts)
    if greedy:
        pred = np.argmax(logits, -1)
        n = 0
        while n < cap and drafts[n] == pred[n]:
            n += 1
        return n, int(pred[n])
    t = max(temp, 1e-5)
    pt = [_ref_top_k_top_p(_softmax(logits[i] / t), k, p) for i in range(gamma + 1)]
    q = [_softmax(corrected[i] / t) for i in range(gamma)]
    n = 0
    while n < cap and u[n] * q[n][drafts[n]] < pt[n][drafts[n]]:
        n += 1
    dist = pt[n]
    if n < cap:
        residual = np.maximum(pt[n] - q[n], 0)
        if residual.sum() > 0:
            dist = residual / residual.sum()
    with np.errstate(divide="ignore"):
        return n, int(np.argmax(np.where(dist > 0, np.log(dist) - np.log(e), -np.inf)))


def _block(drafts, corrected, greedy, temps):
    b, gamma = drafts.shape
    return DraftBlock(
        draft_tokens=jnp.asarray(drafts, jnp.int32),
        corrected_logits=jnp.asarray(corrected, jnp.float32),
        greedy_mask=jnp.asarray(greedy),
        temperatures=jnp.maximum(jnp.asarray(temps, jnp.float32), 1e-5),
        confidence=jnp.zeros((b, 0), jnp.float32),
    )


# ---------------------------------------------------------------------- tests
def test_top_k_top_p_matches_reference_with_ties():
    rng = np.random.default_rng(0)
    # Quantised probabilities make many exact ties.
    raw = rng.integers(1, 6, size=(200, 9)).astype(np.float32)
    raw[:20, :3] = 0.0  # zero-probability tokens too
    probs = raw / raw.sum(-1, keepdims=True)
    ks = rng.choice([1, 2, 3, 5, 9, TOP_K_ALL], size=200)
    ps = rng.choice([0.05, 0.3, 0.5, 0.77, 0.9, 1.0], size=200)
    got = np.asarray(jax.jit(apply_top_k_top_p)(jnp.asarray(probs), jnp.asarray(ks), jnp.asarray(ps, jnp.float32)))
    want = np.stack([_ref_top_k_top_p(probs[i], int(ks[i]), float(ps[i])) for i in range(200)])
    np.testing.assert_allclose(got, want, atol=1e-6)
    assert ((got > 0).sum(-1) >= 1).all()


def test_partial_ranking_width_matches_reference_with_ties():
    rng = np.random.default_rng(4)
    v, width = 40, 8
    raw = rng.integers(1, 5, size=(300, v)).astype(np.float32)  # many exact ties
    raw[:30, :10] = 0.0
    probs = raw / raw.sum(-1, keepdims=True)
    ks = rng.choice([1, 2, 5, 8, TOP_K_ALL], size=300)
    ps = rng.choice([0.05, 0.4, 0.77, 1.0], size=300)
    ps[ks == TOP_K_ALL] = 1.0  # rows without top-k must not restrict (their ranks would exceed the width)
    restrict = jax.jit(apply_top_k_top_p, static_argnames="width")  # one compilation instead of one per op
    got = np.asarray(restrict(jnp.asarray(probs), jnp.asarray(ks), jnp.asarray(ps, jnp.float32), width=width))
    want = np.stack([_ref_top_k_top_p(probs[i], int(ks[i]), float(ps[i])) for i in range(300)])
    np.testing.assert_allclose(got, want, atol=1e-6)
    keep_all = ks == TOP_K_ALL
    np.testing.assert_array_equal(got[keep_all], probs[keep_all])  # returned unchanged, not renormalised


def test_required_filter_width_counts_only_restricting_sampling_rows():
    v = 2048
    width = functools.partial(required_filter_width, vocab_size=v)
    assert width([1.0, 0.7], [TOP_K_ALL, v], [1.0, 1.0]) == 0  # nothing restricts: no ranking
    assert width([0.0, 1.0, 1.0], [TOP_K_ALL, 1, TOP_K_ALL], [0.5, 0.5, 1.0]) == 0  # greedy rows never count
    assert width([1.0, 1.0, 1.0], [3, 50, TOP_K_ALL], [1.0, 0.9, 1.0]) == 64  # power of two >= the largest top-k
    assert width([1.0], [64], [1.0]) == 64
    assert width([1.0], [2000], [1.0]) == v  # capped at V
    assert width([1.0, 1.0], [5, TOP_K_ALL], [1.0, 0.95]) == v  # top-p alone ranks the whole vocabulary


def test_fast_path_matches_filtered_path_without_top_k_top_p():
    """``filter_width=0`` (no sort) must give exactly what the full ranking gives when nothing restricts."""
    rng = np.random.default_rng(5)
    b, gamma, v = 64, 4, 11
    greedy = rng.random(b) < 0.2
    temps = np.where(greedy, 0.0, rng.choice([0.5, 1.0, 1.7], size=b)).astype(np.float32)
    ks = np.where(greedy, rng.choice([1, TOP_K_ALL], size=b), rng.choice([v, v + 3, TOP_K_ALL], size=b))
    ps = np.where(greedy, rng.choice([0.3, 1.0], size=b), 1.0).astype(np.float32)
    assert required_filter_width(temps, ks, ps, v) == 0
    logits = 2 * rng.standard_normal((b, gamma + 1, v))
    corrected = logits[:, :gamma] + rng.standard_normal((b, gamma, v))  # close to p: long accepted runs
    drafts = logits[:, :gamma].argmax(-1)
    block = _block(drafts, corrected, greedy, temps)

    @jax.jit
    def both_paths(logits, block, top_k, top_p, key):  # one compilation for both variants
        out = []
        for width in (0, None):
            n, bonus = accept(logits, block, top_k=top_k, top_p=top_p, key=key, filter_width=width)
            first = logits[:, 0]  # [B, V] as in plain decoding
            probs = target_probs(first, block.temperatures, top_k, top_p, filter_width=width)
            out.append(
                (n, bonus, probs, sample_tokens(first, block.temperatures, top_k, top_p, key, filter_width=width))
            )
        return out

    fast, full = both_paths(
        jnp.asarray(logits, jnp.float32), block, jnp.asarray(ks, jnp.int32), jnp.asarray(ps), jax.random.key(3)
    )
    for name, f, g in zip(("correct_len", "bonus", "probs", "sampled"), fast, full, strict=True):
        f, g = np.asarray(f), np.asarray(g)
        if name == "probs":  # greedy rows never read them (a top_k = 1 row is one-hot only when filtered)
            f, g = f[~greedy], g[~greedy]
        np.testing.assert_array_equal(f, g, err_msg=name)
    n = np.asarray(fast[0])[~greedy]
    assert (n == 0).any() and (n == gamma).any()  # rejections and full acceptances both occur


def test_accept_matches_per_row_reference_with_fixed_noise():
    rng = np.random.default_rng(1)
    b, gamma, v = 96, 4, 7
    greedy = rng.random(b) < 0.3
    temps = np.where(greedy, 0.0, rng.choice([0.5, 1.0, 1.7], size=b))
    ks = rng.choice([2, 3, TOP_K_ALL], size=b)
    ps = rng.choice([0.6, 0.9, 1.0], size=b).astype(np.float32)
    caps = rng.integers(1, gamma + 2, size=b)
    # Integer logits give argmax ties on greedy rows.
    logits = np.where(
        greedy[:, None, None], rng.integers(-2, 3, (b, gamma + 1, v)), 2 * rng.standard_normal((b, gamma + 1, v))
    )
    corrected = 2 * rng.standard_normal((b, gamma, v))
    drafts = np.stack(
        [[rng.choice(v, p=_softmax(corrected[i, j] / max(temps[i], 1e-5))) for j in range(gamma)] for i in range(b)]
    )
    greedy_pred = logits.argmax(-1)
    copy = greedy & (rng.random(b) < 0.6)  # greedy rows whose drafts match for a while
    drafts[copy] = greedy_pred[copy, :gamma]
    same = ~greedy & (rng.random(b) < 0.25)  # q == p: every draft accepted
    corrected[same] = logits[same, :gamma]
    ks[same], ps[same] = TOP_K_ALL, 1.0
    zero = ~greedy & ~same & (rng.random(b) < 0.2)  # drafts outside the target's top-k
    ks[zero] = 2
    for i in np.flatnonzero(zero):
        drafts[i, 0] = np.argsort(-logits[i, 0], kind="stable")[-1]
    u = rng.random((b, gamma)).astype(np.float32)
    e = rng.exponential(size=(b, v)).astype(np.float32)

    n, bonus = jax.jit(accept_with_noise)(
        jnp.asarray(logits, jnp.float32),
        _block(drafts, corrected, greedy, temps),
        top_k=jnp.asarray(ks, jnp.int32),
        top_p=jnp.asarray(ps),
        verify_len=jnp.asarray(caps, jnp.int32),
        uniforms=jnp.asarray(u),
        exponentials=jnp.asarray(e),
    )
    want = [
        _ref_accept(logits[i], drafts[i], corrected[i], greedy[i], temps[i], ks[i], ps[i], caps[i] - 1, u[i], e[i])
        for i in range(b)
    ]
    np.testing.assert_array_equal(np.asarray(n), [w[0] for w in want])
    np.testing.assert_array_equal(np.asarray(bonus), [w[1] for w in want])
    n = np.asarray(n)
    assert (n <= caps - 1).all()
    np.testing.assert_array_equal(n[same], caps[same] - 1)  # all accepted up to the cap
    assert (n[zero] == 0).all()  # a zero-probability draft is always rejected
    assert (n[greedy] >= 2).any() and (n[~greedy] >= 2).any()


def test_greedy_only_block_without_corrected_logits():
    logits = jnp.asarray([[[0.0, 3.0, 3.0], [5.0, 0.0, 0.0], [0.0, 0.0, 1.0]]])  # ties go to id 1
    block = _block(np.array([[1, 0]]), np.zeros((1, 2, 0)), np.array([True]), np.array([0.0]))
    run = jax.jit(accept)
    n, bonus = run(logits, block, top_k=jnp.asarray([1]), top_p=jnp.asarray([1.0]), key=jax.random.key(0))
    assert (int(n[0]), int(bonus[0])) == (2, 2)
    capped = run(
        logits,
        block,
        top_k=jnp.asarray([1]),
        top_p=jnp.asarray([1.0]),
        verify_len=jnp.asarray([2]),
        key=jax.random.key(0),
    )
    assert (int(capped[0][0]), int(capped[1][0])) == (1, 0)


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (
            dict(logits=np.zeros((1, 4, 3))),
            ValueError,
            r"block.corrected_logits has shape \(1, 2, 3\): expected .* \(1, 3, 3\)",
        ),
        (
            dict(logits=np.zeros((1, 3, 5))),
            ValueError,
            r"block.corrected_logits has shape \(1, 2, 3\): expected .* \(1, 2, 5\)",
        ),
        (dict(logits=np.zeros((3, 3))), ValueError, r"target_logits has shape \(3, 3\): expected \[B, γ \+ 1, V\]"),
        (dict(top_k=np.array([1, 1])), ValueError, r"top_k has shape \(2,\): expected \(1,\)"),
        (dict(verify_len=np.array([[2]])), ValueError, r"verify_len has shape \(1, 1\): expected \(1,\)"),
        (dict(drafts=np.array([[1.0, 0.0]])), TypeError, r"block.draft_tokens has dtype float32: expected an integer"),
        (dict(top_k=np.array([1.0])), TypeError, r"top_k has dtype float32: expected an integer dtype"),
    ],
)
def test_accept_refuses_mismatched_shapes_while_tracing(change, error, message):
    """Every shape is static, so a mismatch fails while tracing, naming the field, not as a
    broadcasting error deep inside (or a quietly clamped gather)."""
    logits = jnp.asarray(change.get("logits", np.zeros((1, 3, 3))), jnp.float32)
    drafts = np.asarray(change.get("drafts", np.array([[1, 0]])))
    block = _block(drafts, np.zeros((1, 2, 3)), np.array([False]), np.array([1.0]))
    block = block.replace(draft_tokens=jnp.asarray(drafts, jnp.float32 if drafts.dtype.kind == "f" else jnp.int32))
    top_k = jnp.asarray(change.get("top_k", np.array([TOP_K_ALL])))
    top_k = top_k.astype(jnp.float32 if top_k.dtype.kind == "f" else jnp.int32)
    verify_len = jnp.asarray(change["verify_len"]) if "verify_len" in change else None
    run = jax.jit(functools.partial(accept, top_p=jnp.asarray([1.0]), key=jax.random.key(0)))
    with pytest.raises(error, match=message):
        run(logits, block, top_k=top_k, verify_len=verify_len)


def _exact_outcomes(logits, drafts, corrected, temp, k, p, cap):
    """P(correct_len = n, bonus = x) for one sampling row, by enumeration."""
    gamma, v = corrected.shape
    pt = [_ref_top_k_top_p(_softmax(logits[i] / temp), k, p) for i in range(gamma + 1)]
    q = [_softmax(corrected[i] / temp) for i in range(gamma)]
    out = np.zeros((cap + 1, v))
    reach = 1.0
    for n in range(cap + 1):
        if n == cap:
            out[n] = reach * pt[n]
            break
        a = min(1.0, pt[n][drafts[n]] / q[n][drafts[n]])
        residual = np.maximum(pt[n] - q[n], 0)
        out[n] = reach * (1 - a) * (residual / residual.sum() if residual.sum() > 0 else pt[n])
        reach *= a
    return out


def test_target_probs_read_nan_and_infinite_logits_as_greedy_step_does():
    """A NaN logit counts as −inf and ``+inf`` entries share the mass, so a sampling row picks
    what the greedy row picks (the softmax alone would make the whole row NaN: token 0)."""
    logits = jnp.asarray([[0.0, 1.0, jnp.inf, 0.0, jnp.inf], [0.0, 1.0, 2.0, jnp.nan, 0.0]], jnp.float32)
    ones, all_k, temps = jnp.ones(2, jnp.float32), jnp.full(2, TOP_K_ALL, jnp.int32), jnp.full(2, 0.7, jnp.float32)
    probs = np.asarray(target_probs(logits, temps, all_k, ones))
    np.testing.assert_allclose(probs[0], [0, 0, 0.5, 0, 0.5])
    want = _softmax(np.asarray([0.0, 1.0, 2.0, -np.inf, 0.0]) / 0.7)
    np.testing.assert_allclose(probs[1], want, rtol=1e-6)
    for seed in range(20):
        tokens = np.asarray(sample_tokens(logits, temps, all_k, ones, key=jax.random.key(seed)))
        assert tokens[0] in (2, 4) and tokens[1] != 3


def test_accept_takes_lists_for_verify_len_and_the_blocks_arrays():
    rng = np.random.default_rng(4)
    b, gamma, v = 3, 2, 5
    logits = jnp.asarray(rng.standard_normal((b, gamma + 1, v)), jnp.float32)
    drafts, corrected = rng.integers(0, v, (b, gamma)), rng.standard_normal((b, gamma, v))
    block = _block(drafts, corrected, np.array([True, False, False]), [0.0, 1.0, 0.5])
    noise = dict(
        top_k=jnp.full(b, TOP_K_ALL, jnp.int32),
        top_p=jnp.ones(b, jnp.float32),
        uniforms=jnp.asarray(rng.random((b, gamma)), jnp.float32),
        exponentials=jnp.asarray(rng.exponential(size=(b, v)), jnp.float32),
    )
    want = accept_with_noise(logits, block, verify_len=jnp.asarray([3, 2, 1], jnp.int32), **noise)
    as_lists = block.replace(draft_tokens=drafts.tolist(), temperatures=np.asarray(block.temperatures).tolist())
    got = accept_with_noise(logits, as_lists, verify_len=[3, 2, 1], **noise)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def _outcome_tv(logits, drafts, corrected, temp, k, p, cap, n_rows, *, seed):
    """``(tv, tol, want)``: ``accept`` on ``n_rows`` copies of one row (key ``seed``), the total
    variation between its ``(correct_len, bonus)`` histogram and ``_exact_outcomes``, and the
    tolerance: E[TV] = ½ Σ E|p̂ − p| <= ½ Σ sqrt(p(1 − p) / N), plus 0.01 by McDiarmid at
    probability e^-8."""
    v = logits.shape[-1]
    block = _block(
        np.tile(drafts, (n_rows, 1)), np.tile(corrected, (n_rows, 1, 1)), np.zeros(n_rows, bool), np.full(n_rows, temp)
    )
    n, bonus = jax.jit(accept)(
        jnp.asarray(np.tile(logits, (n_rows, 1, 1)), jnp.float32),
        block,
        top_k=jnp.full((n_rows,), k),
        top_p=jnp.full((n_rows,), p, jnp.float32),
        key=jax.random.key(seed),
    )
    counts = np.zeros((cap + 1, v))
    np.add.at(counts, (np.asarray(n), np.asarray(bonus)), 1)
    want = _exact_outcomes(logits, drafts, corrected, temp, k, p, cap)
    tol = 0.5 * np.sqrt(want * (1 - want) / n_rows).sum() + 0.01
    return 0.5 * np.abs(counts / n_rows - want).sum(), tol, want


def test_accept_outcome_distribution_matches_enumeration():
    rng = np.random.default_rng(2)
    n_rows, gamma, v = 40_000, 3, 5
    logits = 0.7 * rng.standard_normal((gamma + 1, v))
    corrected = logits[:gamma] + rng.standard_normal((gamma, v))
    temp, k, p, cap = 1.0, 4, 0.85, gamma
    # Slot 0 drafts the target's second choice, which the draft over-rates: rejection possible, not certain.
    second = int(np.argsort(-logits[0], kind="stable")[1])
    corrected[0, second] += 2.0
    drafts = np.array([second, np.argmax(logits[1]), np.argmax(logits[2])])
    tv, tol, want = _outcome_tv(logits, drafts, corrected, temp, k, p, cap, n_rows, seed=7)
    assert tv < tol, (tv, tol)
    assert want[0].sum() > 0.05 and want[cap].sum() > 0.05  # both rejection and full acceptance occur


def test_schedule_verify_lengths_maximises_throughput_over_all_prefix_choices():
    rng = np.random.default_rng(3)
    b, gamma = 3, 3
    for trial in range(6):
        conf = rng.random((b, gamma)).astype(np.float32)
        sps = (100.0 / (1 + 0.2 * np.arange(b * (gamma + 1) + 1) ** (1 + trial % 3 * 0.3))).astype(np.float32)
        got = np.asarray(schedule_verify_lengths(jnp.asarray(conf), jnp.asarray(sps)))
        surv = np.cumprod(conf.astype(np.float64), -1)

        def value(lens, surv=surv, sps=sps):
            gain = sum(surv[i, : lens[i] - 1].sum() for i in range(b))
            return (b + gain) * sps[sum(lens)]

        best = max(value(lens) for lens in itertools.product(range(1, gamma + 2), repeat=b))
        assert ((got >= 1) & (got <= gamma + 1)).all()
        np.testing.assert_allclose(value(got), best, rtol=1e-5)


def test_uniform_rule_gives_every_row_the_width_that_maximises_throughput():
    """``widths=``: one length for all rows, the best of ``widths`` by the dense value
    ``(B + Σ_b Σ_{k < w − 1} S[b, k]) · sps[B·w]`` (a NumPy brute force), the narrower
    width on a tie."""
    rng = np.random.default_rng(5)
    b, gamma = 3, 4
    widths = (1, 2, 4, 5)
    chosen = set()
    for trial in range(12):
        conf = rng.random((b, gamma)).astype(np.float32) ** (0.2 + 0.3 * (trial % 4))
        sps = (100.0 / (1 + 0.05 * trial * np.arange(b * (gamma + 1) + 1) ** 1.2)).astype(np.float32)
        got = np.asarray(schedule_verify_lengths(jnp.asarray(conf), jnp.asarray(sps), widths=widths))
        surv = np.cumprod(conf.astype(np.float64), -1)
        value = {w: (b + surv[:, : w - 1].sum()) * sps[b * w] for w in widths}
        assert got.dtype == np.int32 and (got == got[0]).all() and got[0] in widths
        np.testing.assert_allclose(value[int(got[0])], max(value.values()), rtol=1e-5)
        chosen.add(int(got[0]))
    assert len(chosen) >= 3, chosen  # the cases reach several widths
    flat = np.asarray(schedule_verify_lengths(jnp.zeros((b, gamma)), jnp.ones(16), widths=(4, 2, 5)))
    assert flat.tolist() == [2, 2, 2]  # every width equal (no survival, flat table): the narrowest


@pytest.mark.parametrize(
    "widths, error, message",
    [
        ((), TypeError, r"widths=\(\) is invalid: expected a non-empty tuple of integers"),
        ([1, 2], TypeError, r"widths=\[1, 2\] is invalid: expected a non-empty tuple"),
        ((1, 2.0), TypeError, "expected a non-empty tuple of integers"),
        ((1, 1), ValueError, r"widths=\(1, 1\) is invalid: expected distinct integers in \[1, γ\+1\] = \[1, 4\]"),
        ((0, 2), ValueError, "expected distinct integers in"),
        ((2, 5), ValueError, "expected distinct integers in"),
    ],
)
def test_uniform_rule_refuses_bad_widths_by_name(widths, error, message):
    with pytest.raises(error, match=message):
        schedule_verify_lengths(jnp.ones((2, 3)), jnp.ones((9,)), widths=widths)


def test_schedule_verify_lengths_rejects_short_table():
    with pytest.raises(ValueError, match="steps_per_second"):
        schedule_verify_lengths(jnp.ones((2, 3)), jnp.ones((5,)))


def test_schedule_verify_lengths_refuses_wrong_ranks_and_dtypes():
    with pytest.raises(ValueError, match=r"confidence has shape \(3,\) and steps_per_second \(20,\): expected"):
        schedule_verify_lengths(jnp.ones((3,)), jnp.ones((20,)))
    with pytest.raises(ValueError, match=r"steps_per_second \(20, 1\): expected \[B, γ\] and \[N\]"):
        schedule_verify_lengths(jnp.ones((2, 3)), jnp.ones((20, 1)))
    with pytest.raises(TypeError, match="confidence has dtype int32: expected a floating dtype"):
        schedule_verify_lengths(jnp.ones((2, 3), jnp.int32), jnp.ones((20,)))


@pytest.mark.parametrize("bad", [5.0, -0.5, np.nan])
def test_schedule_verify_lengths_refuses_confidence_outside_0_1_and_clips_it_when_traced(bad):
    """Concrete confidences must be probabilities; traced ones are clipped into [0, 1] (NaN as 0),
    so the chosen entries stay a prefix of each row: with [[0.1, 5.0]] unclipped the
    survivals [0.1, 0.5] would pick slot 1 alone and verify slot 0 instead."""
    conf = np.asarray([[0.1, bad], [0.3, 0.2]], np.float32)
    table = np.asarray([1, 1, 1, 1, 0, 0, 0], np.float32)  # a budget of at most 1 draft beyond the anchors
    with pytest.raises(ValueError, match=rf"confidence\[0, 1\]={bad} is invalid: must be a probability in \[0, 1\]"):
        schedule_verify_lengths(conf, table)
    clipped = np.clip(np.nan_to_num(conf, nan=0.0), 0.0, 1.0)
    for widths in (None, (1, 2, 3)):
        run = jax.jit(functools.partial(schedule_verify_lengths, widths=widths))
        np.testing.assert_array_equal(run(conf, table), schedule_verify_lengths(clipped, table, widths=widths))
    np.testing.assert_array_equal(jax.jit(schedule_verify_lengths)(conf, table), [1, 2])  # row 1's 0.3 wins


def test_accept_refuses_a_greedy_mask_that_is_not_bool():
    logits = jnp.zeros((1, 3, 3), jnp.float32)
    block = _block(np.array([[1, 0]]), np.zeros((1, 2, 3)), np.array([False]), np.array([1.0]))
    block = block.replace(greedy_mask=jnp.asarray([0.0]))
    with pytest.raises(TypeError, match="block.greedy_mask has dtype float32: expected bool"):
        accept(logits, block, top_k=jnp.asarray([TOP_K_ALL]), top_p=jnp.asarray([1.0]), key=jax.random.key(0))


def test_out_of_vocabulary_drafts_are_rejected_and_the_target_picks_the_bonus():
    """An id outside [0, V) ends the row's drafts like a verify cap: nothing from it on is
    accepted (a negative id must not wrap to token V − 1), and the bonus there is the target's."""
    rng = np.random.default_rng(6)
    gamma, v = 3, 5
    logits = np.zeros((4, gamma + 1, v))
    logits[:, :, v - 1] = 6.0  # the target all but insists on token V − 1, which id −1 would wrap to
    corrected = np.array(logits[:, :gamma])
    drafts = np.array([[v - 1, -1, v - 1], [v, v - 1, v - 1], [v - 1, -1, v - 1], [v - 1, v - 1, v + 7]])
    greedy = np.array([False, False, True, True])
    temps = np.where(greedy, 0.0, 1.0)
    u = rng.random((4, gamma)).astype(np.float32)
    e = rng.exponential(size=(4, v)).astype(np.float32)
    n, bonus = jax.jit(accept_with_noise)(
        jnp.asarray(logits, jnp.float32),
        _block(drafts, corrected, greedy, temps),
        top_k=jnp.full((4,), TOP_K_ALL),
        top_p=jnp.ones((4,)),
        verify_len=None,
        uniforms=jnp.asarray(u),
        exponentials=jnp.asarray(e),
    )
    first_bad = [1, 0, 1, 2]
    want = [
        _ref_accept(logits[i], drafts[i], corrected[i], greedy[i], temps[i], TOP_K_ALL, 1.0, first_bad[i], u[i], e[i])
        for i in range(4)
    ]
    np.testing.assert_array_equal(np.asarray(n), first_bad)
    np.testing.assert_array_equal(np.asarray(bonus), [w[1] for w in want])


@pytest.mark.parametrize("bad", [-1, 5, 12])
def test_out_of_vocabulary_draft_keeps_the_committed_tokens_target_distributed(bad):
    """Behind an id outside [0, V) the bonus is drawn from the target's own p (the residual
    max(p − q, 0) is the right law only for a draft drawn from q): the outcomes are those of a
    row whose verify cap ends at that draft."""
    rng = np.random.default_rng(8)
    n_rows, gamma, v = 20_000, 2, 5
    logits = 0.8 * rng.standard_normal((gamma + 1, v))
    corrected = logits[:gamma] + rng.standard_normal((gamma, v))
    first = int(np.argmax(corrected[0]))
    want = np.zeros((gamma + 1, v))
    want[:2] = _exact_outcomes(logits, np.array([first, 0]), corrected, 1.0, TOP_K_ALL, 1.0, cap=1)
    block = _block(
        np.tile([first, bad], (n_rows, 1)), np.tile(corrected, (n_rows, 1, 1)), np.zeros(n_rows, bool), np.ones(n_rows)
    )
    n, bonus = jax.jit(accept)(
        jnp.asarray(np.tile(logits, (n_rows, 1, 1)), jnp.float32),
        block,
        top_k=jnp.full((n_rows,), TOP_K_ALL),
        top_p=jnp.ones((n_rows,)),
        key=jax.random.key(11),
    )
    counts = np.zeros((gamma + 1, v))
    np.add.at(counts, (np.asarray(n), np.asarray(bonus)), 1)
    # E[TV] <= ½ Σ sqrt(p(1 − p) / N); McDiarmid adds 0.015 at probability about e^-9.
    tol = 0.5 * np.sqrt(want * (1 - want) / n_rows).sum() + 0.015
    tv = 0.5 * np.abs(counts / n_rows - want).sum()
    assert tv < tol, (tv, tol)
    assert want[0].sum() > 0.05 and want[1].sum() > 0.05  # both the rejection and the cap occur


def test_verify_len_is_clamped_into_one_to_gamma_plus_one():
    rng = np.random.default_rng(9)
    b, gamma, v = 6, 3, 4
    logits = np.zeros((b, gamma + 1, v))
    logits[..., 2] = 5.0
    drafts = np.full((b, gamma), 2)  # every draft is the target's choice: only the cap stops them
    greedy = np.array([True, True, True, False, False, False])
    block = _block(drafts, logits[:, :gamma], greedy, np.where(greedy, 0.0, 1.0))
    run = jax.jit(
        functools.partial(
            accept_with_noise,
            top_k=jnp.full((b,), TOP_K_ALL),
            top_p=jnp.ones((b,)),
            uniforms=jnp.asarray(rng.random((b, gamma)), jnp.float32),
            exponentials=jnp.asarray(rng.exponential(size=(b, v)), jnp.float32),
        )
    )
    got = run(jnp.asarray(logits, jnp.float32), block, verify_len=jnp.asarray([0, -2, 9, 0, -7, gamma + 2]))
    want = run(jnp.asarray(logits, jnp.float32), block, verify_len=jnp.asarray([1, 1, gamma + 1] * 2))
    np.testing.assert_array_equal(np.asarray(got[0]), [0, 0, gamma, 0, 0, gamma])
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


_B, _V = 2, 6


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(temperatures=np.ones(1, np.float32)), ValueError, r"temperatures has shape \(1,\): expected \(2,\)"),
        (dict(top_k=np.full(3, 4, np.int32)), ValueError, r"top_k has shape \(3,\): expected \(2,\)"),
        (dict(top_p=np.ones((2, 1), np.float32)), ValueError, r"top_p has shape \(2, 1\): expected \(2,\)"),
        (dict(logits=np.zeros(_V, np.float32)), ValueError, r"logits has shape \(6,\): expected \[B, V\]"),
        (
            dict(logits=np.zeros((_B, 3, _V), np.float32)),
            ValueError,
            r"logits has shape \(2, 3, 6\): expected \[B, V\]",
        ),
        (dict(top_k=np.full(2, 4.0, np.float32)), TypeError, r"top_k has dtype float32: expected an integer dtype"),
        (dict(top_p=np.ones(2, np.int32)), TypeError, r"top_p has dtype int32: expected a floating dtype"),
        (dict(temperatures=np.ones(2, np.int32)), TypeError, r"temperatures has dtype int32: expected a floating"),
    ],
)
def test_sample_tokens_refuses_mismatched_rows_and_dtypes_while_tracing(change, error, message):
    """A [1] temperature would otherwise spread over every row unnoticed."""
    args = dict(
        logits=np.zeros((_B, _V), np.float32),
        temperatures=np.ones(_B, np.float32),
        top_k=np.full(_B, 4, np.int32),
        top_p=np.ones(_B, np.float32),
    )
    args.update(change)
    run = jax.jit(sample_tokens)
    with pytest.raises(error, match=message):
        run(*(jnp.asarray(args[k]) for k in ("logits", "temperatures", "top_k", "top_p")), jax.random.key(0))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        (dict(temperatures=np.ones(1, np.float32)), ValueError, r"temperatures has shape \(1,\): expected \(2,\)"),
        (dict(top_p=np.ones((2, 3), np.float32)), ValueError, r"top_p has shape \(2, 3\): expected \(2,\)"),
        (dict(logits=np.zeros(_V, np.float32)), ValueError, r"logits has shape \(6,\): expected \[B, \.\.\., V\]"),
        (dict(top_k=np.full(2, 4.0, np.float32)), TypeError, r"top_k has dtype float32: expected an integer dtype"),
    ],
)
def test_target_probs_refuses_mismatched_rows_and_dtypes_while_tracing(change, error, message):
    args = dict(
        logits=np.zeros((_B, 3, _V), np.float32),
        temperatures=np.ones(_B, np.float32),
        top_k=np.full(_B, 4, np.int32),
        top_p=np.ones(_B, np.float32),
    )
    args.update(change)
    with pytest.raises(error, match=message):
        jax.jit(target_probs)(*(jnp.asarray(args[k]) for k in ("logits", "temperatures", "top_k", "top_p")))


@pytest.mark.parametrize(
    ("top_k", "top_p", "width", "error", "message"),
    [
        (np.full(1, 2, np.int32), np.ones(2, np.float32), None, ValueError, r"top_k has shape \(1,\): expected \(2,\)"),
        (np.full(2, 2, np.int32), np.ones(3, np.float32), None, ValueError, r"top_p has shape \(3,\): expected \(2,\)"),
        (np.full(2, 2.0, np.float32), np.ones(2, np.float32), None, TypeError, r"top_k has dtype float32: expected an"),
        (np.full(2, 2, np.int32), np.ones(2, np.float32), 2.5, ValueError, r"width=2.5 is invalid: must be an integer"),
    ],
)
def test_apply_top_k_top_p_refuses_mismatched_rows_dtypes_and_widths(top_k, top_p, width, error, message):
    probs = jnp.full((_B, _V), 1.0 / _V)
    with pytest.raises(error, match=message):
        apply_top_k_top_p(probs, jnp.asarray(top_k), jnp.asarray(top_p), width=width)


def _one_row_sampling_block():
    return _block(np.array([[1, 0]]), np.zeros((1, 2, 3)), np.array([False]), np.array([1.0]))


@pytest.mark.parametrize(
    "key",
    [
        7,
        np.zeros(2, np.float32),
        np.zeros((1, 2), np.uint32),
        np.zeros(3, np.uint32),
        "per-row typed keys",
    ],
    ids=["int", "float-array", "raw-batch", "raw-wrong-length", "typed-batch"],
)
def test_accept_and_sample_tokens_refuse_a_bad_key_naming_key(key):
    """Each splits one key itself, so a batch of keys is refused as firmly as a non-key."""
    if isinstance(key, str):
        key = jax.random.split(jax.random.key(0), 1)
    top_k, top_p = jnp.asarray([TOP_K_ALL]), jnp.asarray([1.0])
    with pytest.raises(TypeError, match=r"^key.*expected one PRNG key"):
        accept(jnp.zeros((1, 3, 3)), _one_row_sampling_block(), top_k=top_k, top_p=top_p, key=key)
    with pytest.raises(TypeError, match=r"^key.*expected one PRNG key"):
        sample_tokens(jnp.zeros((1, 3)), jnp.asarray([1.0]), top_k, top_p, key)


@pytest.mark.parametrize("width", [2.5, -1, 4, np.float32(2.0)])
def test_filter_width_must_be_a_static_integer_in_zero_to_vocab(width):
    top_k, top_p = jnp.asarray([2]), jnp.asarray([1.0])
    message = re.escape(f"filter_width={width!r} is invalid") + r": must be None \(= V\), 0 .* in \[1, V=3\]"
    for greedy_only in (False, True):
        block = _one_row_sampling_block()
        if greedy_only:
            block = block.replace(corrected_logits=jnp.zeros((1, 2, 0)), greedy_mask=jnp.asarray([True]))
        with pytest.raises(ValueError, match=message):
            accept(jnp.zeros((1, 3, 3)), block, top_k=top_k, top_p=top_p, key=jax.random.key(0), filter_width=width)
    with pytest.raises(ValueError, match=message):
        sample_tokens(jnp.zeros((1, 3)), jnp.asarray([1.0]), top_k, top_p, jax.random.key(0), filter_width=width)


_TEMPERATURE_RULE = r"must be a number >= 0 \(0 = greedy\), finite in float32"
_TOP_K_RULE = r"must be an integer in \[1, 2147483647\] \(1 = greedy\)"
_TOP_P_RULE = r"must be a number in \(0, 1\]"


@pytest.mark.parametrize(
    ("top_k", "top_p", "message"),
    [
        ([0, 0], [1.0, 1.0], rf"^top_k\[0\]=0 is invalid: {_TOP_K_RULE}"),
        ([2, -5], [1.0, 1.0], rf"^top_k\[1\]=-5 is invalid: {_TOP_K_RULE}"),
        ([2, 2], [1.0, 0.0], rf"^top_p\[1\]=0.0 is invalid: {_TOP_P_RULE}"),
        ([2, 2], [-1.0, 0.5], rf"^top_p\[0\]=-1.0 is invalid: {_TOP_P_RULE}"),
        ([2, 2], [np.nan, 0.5], rf"^top_p\[0\]=nan is invalid: {_TOP_P_RULE}"),
        ([2, 2], [0.5, 1.5], rf"^top_p\[1\]=1.5 is invalid: {_TOP_P_RULE}"),
    ],
)
def test_apply_top_k_top_p_refuses_concrete_top_k_below_one_and_top_p_outside_zero_one(top_k, top_p, message):
    """top_k = 0 or < 0 used to keep the whole distribution, top_p <= 0 or NaN to turn a row greedy."""
    probs = jnp.full((_B, _V), 1.0 / _V)
    with pytest.raises(ValueError, match=message):
        apply_top_k_top_p(probs, jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32))


def test_apply_top_k_top_p_names_the_first_bad_entry_of_many_rows():
    top_k = np.full((2, 3), 2, np.int32)
    top_k[1, 2] = 0
    with pytest.raises(ValueError, match=rf"^top_k\[1, 2\]=0 is invalid: {_TOP_K_RULE}"):
        apply_top_k_top_p(jnp.full((2, 3, _V), 1.0 / _V), top_k, np.ones((2, 3), np.float32))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(temperatures=[np.nan, 1.0]), rf"temperatures\[0\]=nan is invalid: {_TEMPERATURE_RULE}"),
        (dict(temperatures=[1.0, -1.0]), rf"temperatures\[1\]=-1.0 is invalid: {_TEMPERATURE_RULE}"),
        (dict(temperatures=[np.inf, 1.0]), rf"temperatures\[0\]=inf is invalid: {_TEMPERATURE_RULE}"),
        (dict(top_k=[0, 4]), rf"top_k\[0\]=0 is invalid: {_TOP_K_RULE}"),
        (dict(top_p=[1.0, np.nan]), rf"top_p\[1\]=nan is invalid: {_TOP_P_RULE}"),
    ],
)
def test_sample_tokens_and_target_probs_refuse_concrete_values_out_of_range(change, message):
    """NaN or negative temperatures used to give tokens without a word (and top_k = 0 a greedy row)."""
    args = dict(temperatures=[1.0, 1.0], top_k=[4, 4], top_p=[1.0, 1.0]) | change
    temps, top_k, top_p = (
        jnp.asarray(args[k], dtype)
        for k, dtype in (("temperatures", jnp.float32), ("top_k", jnp.int32), ("top_p", jnp.float32))
    )
    with pytest.raises(ValueError, match=f"^{message}"):
        sample_tokens(jnp.zeros((_B, _V)), temps, top_k, top_p, jax.random.key(0))
    with pytest.raises(ValueError, match=f"^{message}"):
        target_probs(jnp.zeros((_B, 3, _V)), temps, top_k, top_p)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(temperatures=[np.nan, 1.0]), rf"block.temperatures\[0\]=nan is invalid: {_TEMPERATURE_RULE}"),
        (dict(temperatures=[1.0, -1.0]), rf"block.temperatures\[1\]=-1.0 is invalid: {_TEMPERATURE_RULE}"),
        (dict(temperatures=[1.0, np.inf]), rf"block.temperatures\[1\]=inf is invalid: {_TEMPERATURE_RULE}"),
        (dict(top_k=[4, 0]), rf"top_k\[1\]=0 is invalid: {_TOP_K_RULE}"),
        (dict(top_p=[0.0, 1.0]), rf"top_p\[0\]=0.0 is invalid: {_TOP_P_RULE}"),
    ],
)
def test_accept_refuses_concrete_values_out_of_range(change, message):
    """A NaN in block.temperatures used to change accept's output silently."""
    args = dict(temperatures=[1.0, 1.0], top_k=[4, 4], top_p=[1.0, 1.0]) | change
    block = _block(np.zeros((_B, 2), np.int32), np.zeros((_B, 2, 3)), np.array([False, True]), [1.0, 1.0])
    block = block.replace(temperatures=jnp.asarray(args["temperatures"], jnp.float32))  # unclamped: NaN, -1, inf stay
    top_k, top_p = jnp.asarray(args["top_k"], jnp.int32), jnp.asarray(args["top_p"], jnp.float32)
    for greedy_only in (False, True):  # checked on the greedy-only path too
        if greedy_only:
            block = block.replace(corrected_logits=jnp.zeros((_B, 2, 0)))
        with pytest.raises(ValueError, match=f"^{message}"):
            accept(jnp.zeros((_B, 3, 3)), block, top_k=top_k, top_p=top_p, key=jax.random.key(0))


def test_concrete_value_checks_allow_greedy_settings_and_skip_traced_values():
    """Temperature 0 and top_k 1 (greedy) pass; inside jit nothing is read back or refused."""
    logits = jnp.asarray([[0.0, 2.0, 1.0], [3.0, 0.0, 1.0]])
    temps, top_k, top_p = jnp.asarray([0.0, 1.0]), jnp.asarray([4, 1], jnp.int32), jnp.asarray([1.0, 0.5])
    np.testing.assert_array_equal(np.asarray(sample_tokens(logits, temps, top_k, top_p, jax.random.key(0))), [1, 0])
    bad = (jnp.asarray([np.nan, -1.0]), jnp.asarray([0, -3], jnp.int32), jnp.asarray([np.nan, 0.0]))
    jax.jit(sample_tokens)(logits, *bad, jax.random.key(0))


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        (([1.0, 1.0, 1.0], [3], [0.5, 0.2], 8), ValueError, r"shapes \(3,\), \(1,\) and \(2,\): expected \[B\] each"),
        ((1.0, 3, 0.5, 8), ValueError, r"shapes \(\), \(\) and \(\): expected \[B\] each"),
        ((["1"], [3], [0.5], 8), TypeError, r"^temperatures has dtype <U1: expected a numeric"),
        (([1.0], [3.0], [0.5], 8), TypeError, r"^top_k has dtype float64: expected an integer dtype"),
        (([1.0], [3], [None], 8), TypeError, r"^top_p has dtype object: expected a numeric"),
        (
            ([np.nan, 1.0], [2, 2], [1.0, 1.0], 4),
            ValueError,
            rf"^temperatures\[0\]=nan is invalid: {_TEMPERATURE_RULE}",
        ),
        (([1.0, -2.0], [2, 2], [1.0, 1.0], 4), ValueError, rf"^temperatures\[1\]=-2.0 is invalid: {_TEMPERATURE_RULE}"),
        (([1.0, 1.0], [-3, 2], [1.0, 1.0], 4), ValueError, rf"^top_k\[0\]=-3 is invalid: {_TOP_K_RULE}"),
        (([1.0, 1.0], [2, 0], [1.0, 1.0], 4), ValueError, rf"^top_k\[1\]=0 is invalid: {_TOP_K_RULE}"),
        (([1.0, 1.0], [2, 1 << 40], [1.0, 1.0], 4), ValueError, r"^top_k\[1\]=1099511627776 is invalid"),
        (([1.0, 1.0], [2, 2], [1.0, np.nan], 4), ValueError, rf"^top_p\[1\]=nan is invalid: {_TOP_P_RULE}"),
        (([1.0, 1.0], [2, 2], [0.0, 1.0], 4), ValueError, rf"^top_p\[0\]=0.0 is invalid: {_TOP_P_RULE}"),
        (([1.0], [3], [0.5], 0), ValueError, r"^vocab_size=0 is invalid: must be an integer >= 1"),
        (([1.0], [3], [0.5], 8.0), ValueError, r"^vocab_size=8.0 is invalid: must be an integer >= 1"),
        (([1.0], [3], [0.5], True), ValueError, r"^vocab_size=True is invalid: must be an integer >= 1"),
    ],
)
def test_required_filter_width_refuses_bad_requests_naming_the_field(args, error, message):
    """It used to check nothing: a raw broadcast error, a UFuncTypeError, or NaN and negatives passing."""
    with pytest.raises(error, match=message):
        required_filter_width(*args)


def test_required_filter_width_takes_host_numbers_of_either_kind():
    assert required_filter_width([1, 0], np.array([3, 1], np.int64), [1, 1], np.int64(8)) == 4


def test_a_draft_the_target_cannot_emit_is_rejected_even_at_uniform_zero():
    """The test is ``u · q(d) < p(d)``, strict: with ``u = 0`` and ``p(d) = 0`` (here ``d`` outside
    the target's top-2) a ``<=`` would accept a token the target never emits."""
    b, gamma, v = 1, 2, 6
    logits = jnp.asarray([[[3.0, 2.0, 1.0, 0.0, -1.0, -2.0]] * (gamma + 1)], jnp.float32)
    drafts = np.array([[4, 0]])  # slot 0: rank 5 of the target, outside its top-2
    corrected = np.zeros((b, gamma, v))
    corrected[0, :, 4] = 5.0  # the draft rates it highly: q(d) > 0
    block = _block(drafts, corrected, np.array([False]), [1.0])
    correct_len, bonus = accept_with_noise(
        logits,
        block,
        top_k=jnp.array([2], jnp.int32),
        top_p=jnp.ones(b, jnp.float32),
        verify_len=None,
        uniforms=jnp.zeros((b, gamma), jnp.float32),
        exponentials=jnp.ones((b, v), jnp.float32),
    )
    assert int(correct_len[0]) == 0
    assert int(bonus[0]) in (0, 1)  # from the target's top-2 residual


def test_a_rejection_with_no_residual_mass_draws_the_bonus_from_p():
    """§4 and the module docstring: on a rejection the bonus comes from ``normalise(max(p − q, 0))``,
    or from ``p`` itself when that residual is all zero. Here ``q == p`` (same logits, no top-k /
    top-p) and the draft is a token both give probability 0, so slot 0 is rejected with a zero
    residual; token 0 has ``p = 0`` too, so a race on the all-zero residual (token 0) is wrong.
    Odd rows' ``q`` differs (their residual has mass): each row's fallback is its own. Compared
    with the per-row reference for several fixed noises."""
    b, gamma, v = 8, 2, 5
    row = np.array([-np.inf, 1.0, 0.5, -np.inf, 0.0], np.float32)
    logits = np.broadcast_to(row, (b, gamma + 1, v)).copy()
    corrected = logits[:, :gamma].copy()
    corrected[1::2, :, 1] += 3.0  # odd rows: q over-rates token 1, so their residual has mass
    drafts = np.tile([3, 1], (b, 1))  # p(3) = q(3) = 0
    rng = np.random.default_rng(31)
    u = rng.random((b, gamma)).astype(np.float32)
    e = rng.exponential(size=(b, v)).astype(np.float32)
    ks, ps, temps = np.full(b, TOP_K_ALL), np.ones(b, np.float32), np.full(b, 0.9, np.float32)
    n, bonus = jax.jit(accept_with_noise)(
        jnp.asarray(logits),
        _block(drafts, corrected, np.zeros(b, bool), temps),
        top_k=jnp.asarray(ks, jnp.int32),
        top_p=jnp.asarray(ps),
        verify_len=None,
        uniforms=jnp.asarray(u),
        exponentials=jnp.asarray(e),
    )
    want = [
        _ref_accept(logits[i], drafts[i], corrected[i], False, temps[i], ks[i], ps[i], gamma, u[i], e[i])
        for i in range(b)
    ]
    np.testing.assert_array_equal(np.asarray(n), [w[0] for w in want])
    np.testing.assert_array_equal(np.asarray(bonus), [w[1] for w in want])
    assert (np.asarray(n) == 0).all() and np.isin(np.asarray(bonus), [1, 2, 4]).all()


def test_top_p_keeps_the_top_token_even_when_its_threshold_underflows():
    """Top-p keeps "never fewer than one token" (``apply_top_k_top_p``): with ``top_p`` the smallest
    float32 above 0, ``top_p · mass`` underflows to 0 (or the CPU flushes the subnormal), and no
    rank passes the ``before < top_p · mass`` test; the first rank must still be kept."""
    probs = np.array([[0.1, 0.4, 0.3, 0.2], [0.25, 0.25, 0.3, 0.2]], np.float32)
    top_p = np.full(2, np.finfo(np.float32).smallest_subnormal, np.float32)
    for top_k in ([2, 3], [TOP_K_ALL, TOP_K_ALL]):
        got = np.asarray(jax.jit(apply_top_k_top_p)(jnp.asarray(probs), jnp.asarray(top_k), jnp.asarray(top_p)))
        want = np.stack([_ref_top_k_top_p(probs[i], top_k[i], float(top_p[i])) for i in range(2)])
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got, [[0, 1, 0, 0], [0, 0, 1, 0]])


def test_accept_draws_the_uniforms_and_the_bonus_noise_independently():
    """The committed tokens' law needs the uniforms ``u`` and the bonus race's ``E`` independent.
    With ``γ = V`` the row's ``u[i, j]`` and ``E[i, j]`` sit at the same flat index, so drawing both
    from one key (instead of two split keys) couples ``u_0`` to ``E_0``: a rejection at slot 0
    (``u_0`` large) then makes ``E_0`` small and token 0 wins the residual race too often.
    Tolerance as in ``test_accept_outcome_distribution_matches_enumeration`` (E[TV] bound plus
    0.01 by McDiarmid at probability e^-8)."""
    n_rows, gamma, v = 40_000, 3, 3
    logits = np.array([[0.0, 0.0, 0.0]] * (gamma + 1))
    corrected = np.zeros((gamma, v))
    corrected[:, 2] = np.log(4.0)  # q = (1/6, 1/6, 2/3), p uniform: slot 0 accepted w.p. 1/2
    drafts = np.array([2, 2, 2])
    temp, k, p, cap = 1.0, TOP_K_ALL, 1.0, gamma
    tv, tol, _ = _outcome_tv(logits, drafts, corrected, temp, k, p, cap, n_rows, seed=8)
    assert tv < tol, (tv, tol)


def test_top_p_one_keeps_every_top_k_token_even_below_the_running_sums_resolution():
    """``top_p >= 1`` keeps all of the top-k: a token whose probability (1e-9) is lost in the float32
    running sum must not be dropped by the top-p test (``before < top_p · mass`` fails for it, as
    its ``before`` already equals the top-k mass)."""
    probs = np.array([[0.6, 0.4 - 1e-9, 1e-9, 0.0, 0.0]], np.float32)
    top_k, top_p = np.array([3]), np.ones(1, np.float32)
    got = np.asarray(jax.jit(apply_top_k_top_p)(jnp.asarray(probs), jnp.asarray(top_k), jnp.asarray(top_p)))
    want = _ref_top_k_top_p(probs[0], 3, 1.0)
    np.testing.assert_array_equal(got[0] > 0, want > 0)
    np.testing.assert_allclose(got[0], want, rtol=1e-6)
    assert got[0, 2] > 0


def test_sample_tokens_takes_the_argmax_for_temperature_zero_not_a_tiny_temperature():
    """A temperature-0 row is greedy (``greedy_rows``): the argmax, lowest id on ties, whatever the
    key, not a race at the 1e-5 clamp (logits 1e-6 apart are 0.1 nat apart there, and tied ones a
    coin toss)."""
    logits = jnp.asarray([[0.0, 1e-6, -1.0], [2.0, 0.5, 2.0], [1.0, 1.0 + 1e-6, 1.0]], jnp.float32)
    temps = jnp.zeros(3, jnp.float32)
    top_k, top_p = jnp.full(3, TOP_K_ALL, jnp.int32), jnp.ones(3, jnp.float32)
    run = jax.jit(sample_tokens)
    for seed in range(16):
        got = np.asarray(run(logits, temps, top_k, top_p, jax.random.key(seed)))
        np.testing.assert_array_equal(got, [1, 0, 1])


def test_target_probs_are_computed_from_the_float32_logits():
    """The target's law is ``softmax(logits / T)`` of the float32 logits as given (the library does
    its sampling maths in float32): logits 0.01 apart at 8 (one bfloat16 value) keep their
    distinct probabilities. Reference in float64, relative tolerance 1e-5 (float32 rounding;
    rounding the logits to bfloat16 first moves them by 0.5 %)."""
    logits = np.array([[8.0, 8.01, 7.5, 6.0], [0.3, 0.301, -1.0, 0.0]], np.float32)
    temps = np.array([1.0, 0.7], np.float32)
    ones, all_k = jnp.ones(2, jnp.float32), jnp.full(2, TOP_K_ALL, jnp.int32)
    got = np.asarray(jax.jit(target_probs)(jnp.asarray(logits), jnp.asarray(temps), all_k, ones))
    want = _softmax(logits.astype(np.float64) / temps[:, None].astype(np.float64))
    np.testing.assert_allclose(got, want, rtol=1e-5)
