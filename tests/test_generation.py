"""Speculative generation is lossless: greedy token for token, sampling in distribution."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.generation import (
    _cut,
    _verify_scheduled,
    generate,
    measure_verify_schedule,
    speculative_generate,
    verify_widths,
)
from dspark_jax.target import Qwen3Target

V = 24
CAPACITY = 64


def _target_cfg(vocab: int) -> TargetConfig:
    return TargetConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=vocab,
    )


def _bigram_target(vocab: int, context_scale: float, seed: int = 0) -> tuple[Qwen3Target, np.ndarray]:
    """A random target whose next token mostly depends on the current one.

    Unit-scale embedding and lm_head make ``f(t) = argmax(norm(E[t]) · W)`` the usual next
    token; attention and MLP outputs scaled by ``context_scale`` let the context change
    it often enough that positions and caches matter. Returns the target and ``f``.
    """
    target = Qwen3Target(_target_cfg(vocab), rngs=nnx.Rngs(seed))
    rng = np.random.default_rng(seed)
    e = rng.standard_normal((vocab, 16)).astype(np.float32)
    w = rng.standard_normal((vocab, 16)).astype(np.float32)
    target.embed.set_value(jnp.asarray(e))
    target.head.set_value(jnp.asarray(w))
    for layer in target.layers:
        for linear in (layer.self_attn.o_proj, layer.mlp.down_proj):
            linear.kernel.set_value(linear.kernel.get_value() * context_scale)
    f = np.argmax((e / np.sqrt(np.mean(e * e, -1, keepdims=True) + 1e-6)) @ w.T, -1)
    return target, f


def _rigged_draft(target, bigram, *, gamma, sample_from_anchor, keep, strength, seed=1, **fields) -> DSparkDraft:
    """A draft whose Markov head predicts ``bigram[prev]`` for the ``keep`` fraction of tokens.

    ``fields`` are further :class:`DraftConfig` fields (e.g. ``max_position_embeddings``).
    """
    vocab = target.config.vocab_size
    cfg = DraftConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=vocab,
        block_size=gamma,
        mask_token_id=vocab - 1,
        target_layer_ids=(0, 1),
        markov_rank=vocab,
        sample_from_anchor=sample_from_anchor,
        **fields,
    )
    draft = DSparkDraft(cfg, rngs=nnx.Rngs(seed), embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    rng = np.random.default_rng(seed)
    w2 = np.zeros((vocab, vocab), np.float32)  # bias[prev, v] = w1[prev] · w2[v] = w2[v, prev]
    for prev in np.flatnonzero(rng.random(vocab) < keep):
        w2[bigram[prev], prev] = strength
    draft.markov_head.markov_w1.set_value(jnp.eye(vocab))
    draft.markov_head.markov_w2.set_value(jnp.asarray(w2))
    return draft


# (γ, sample_from_anchor, batch size, batches): 53 prompts; one compilation per case.
GREEDY_CASES = [(1, True, 8, 1), (1, False, 5, 2), (4, True, 8, 1), (4, True, 1, 2), (4, False, 3, 3), (7, True, 8, 1)]
GREEDY_CASES += [(7, False, 8, 1)]


def _case_batches(case: int) -> list[slice]:
    start = sum(batch * n for _, _, batch, n in GREEDY_CASES[:case])
    _, _, batch, n = GREEDY_CASES[case]
    return [slice(start + i * batch, start + (i + 1) * batch) for i in range(n)]


@pytest.fixture(scope="module")
def greedy_setup():
    target, bigram = _bigram_target(V, context_scale=60.0)
    total = sum(batch * n for _, _, batch, n in GREEDY_CASES)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(0, V, size=rng.integers(1, 15)).tolist() for _ in range(total)]
    max_new = rng.integers(4, 25, size=total)
    for case in range(len(GREEDY_CASES)):
        for rows in _case_batches(case):
            max_new[rows.start] = 24  # batches of a case share their longest request, so one compilation
    plain = generate(target, prompts, max_new_tokens=max_new.tolist(), key=jax.random.key(0), capacity=CAPACITY)
    for b in range(total):
        assert len(plain.tokens[b]) == max_new[b]
    in_graph = generate(
        target, prompts, max_new_tokens=max_new.tolist(), key=jax.random.key(0), capacity=CAPACITY, device_loop=True
    )
    assert in_graph.tokens == plain.tokens and in_graph.rounds == plain.rounds
    return target, bigram, prompts, max_new, plain.tokens


@pytest.mark.parametrize(
    "case",
    range(len(GREEDY_CASES)),
    ids=[f"gamma{g}-{'anchor' if a else 'dflash'}-B{b}" for g, a, b, _ in GREEDY_CASES],
)
def test_speculative_greedy_equals_plain_greedy(greedy_setup, case):
    target, bigram, prompts, max_new, plain = greedy_setup
    gamma, sample_from_anchor, _, _ = GREEDY_CASES[case]
    draft = _rigged_draft(target, bigram, gamma=gamma, sample_from_anchor=sample_from_anchor, keep=0.7, strength=100.0)
    counts = np.zeros(gamma + 1, np.int64)
    for rows in _case_batches(case):
        result = speculative_generate(
            target,
            draft,
            prompts[rows],
            max_new_tokens=max_new[rows].tolist(),
            key=jax.random.key(1),
            capacity=CAPACITY,
        )
        assert result.tokens == plain[rows]
        step_counts = np.asarray(result.accept_length_counts)
        assert result.tau_overall == pytest.approx((step_counts * np.arange(1, gamma + 2)).sum() / step_counts.sum())
        counts += step_counts
    assert counts[0] > 0  # rejections happen
    if gamma > 1:
        assert counts[2:].sum() > 0  # and rounds accepting >= 2 drafts


@pytest.mark.parametrize("rule", ["per_request", "uniform"])
@pytest.mark.parametrize(
    ("cost", "verified"),
    [(0.0, "all"), (0.02, "some"), (0.3, "anchor")],
    ids=["flat-table", "falling-table", "steep-table"],
)
def test_scheduled_verification_keeps_greedy_output_and_verifies_what_the_table_pays_for(
    greedy_setup, cost, verified, rule
):
    """``verify_schedule`` (DSPARK_SPEC §5): greedy output still equals plain greedy, host
    loop and device loop agree, and the target verifies all γ + 1 tokens when steps cost
    nothing more per token, the anchor alone when they cost much, something between else;
    under the uniform rule every request of a round verifies one width of ``verify_widths``."""
    target, bigram, prompts, max_new, plain = greedy_setup
    rows = _case_batches(2)[0]  # γ = 4, batch 8
    draft = _rigged_draft(
        target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0, enable_confidence_head=True
    )
    table = 1.0 / (1.0 + cost * np.arange(8 * 5 + 1, dtype=np.float32))
    run = functools.partial(
        speculative_generate,
        target,
        draft,
        prompts[rows],
        max_new_tokens=max_new[rows].tolist(),
        key=jax.random.key(1),
        capacity=CAPACITY,
        verify_schedule=table,
        verify_rule=rule,
    )
    host, device = run(), run(device_loop=True)
    assert host.tokens == plain[rows] and device.tokens == plain[rows]
    assert host.verified_tokens == device.verified_tokens and host.rounds == device.rounds
    request_rounds = sum(host.accept_length_counts)
    full = {"all": 5 * request_rounds, "anchor": request_rounds}
    if verified in full:
        assert host.verified_tokens == full[verified]
    else:
        assert request_rounds < host.verified_tokens < 5 * request_rounds
    if verified == "anchor":  # each round commits the target's own token only
        assert host.accept_length_counts[1:] == [0] * 4
    lengths = np.asarray(host.verify_length_counts)  # [γ + 1] request-rounds by tokens verified
    assert lengths.sum() == request_rounds and lengths @ np.arange(1, 6) == host.verified_tokens
    assert host.verify_length_counts == device.verify_length_counts
    if verified == "some":  # the uniform rule verifies widths 1, 2, 4 or 5 only; the spec's rule any length
        assert (lengths[2] == 0) == (rule == "uniform"), lengths


def test_confidence_by_position_averages_each_rounds_survival_over_the_requests_that_took_part(greedy_setup):
    """A confidence head rigged to constant per-slot probabilities ``c_k`` (zero weights, a
    bias, per-position temperatures) predicts ``Π_{j ≤ k} c_j`` for draft ``k`` in every
    round, so the average over request-rounds is exactly that, though requests of
    different lengths leave the batch at different rounds; a draft without the head
    reports nothing."""
    target, bigram, prompts, max_new, plain = greedy_setup
    rows = _case_batches(2)[0]  # γ = 4, batch 8, max_new_tokens from 4 to 24
    draft = _rigged_draft(
        target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0, enable_confidence_head=True
    )
    head = draft.confidence_head
    head.proj.kernel.set_value(jnp.zeros_like(head.proj.kernel.get_value()))
    head.proj.bias.set_value(jnp.full((1,), 1.5, jnp.float32))
    temperatures = np.array([1.0, 2.0, 0.5, 4.0], np.float32)
    head.sts_temperature.set_value(jnp.asarray(temperatures))
    want = np.cumprod(1 / (1 + np.exp(-1.5 / temperatures)))
    run = functools.partial(
        speculative_generate, target, draft, prompts[rows], max_new_tokens=max_new[rows].tolist(), key=jax.random.key(1)
    )
    for out in (run(), run(device_loop=True)):
        assert out.tokens == plain[rows]
        assert (
            len(set(max_new[rows].tolist())) > 1 and sum(out.accept_length_counts) < 8 * out.rounds
        )  # rows left early
        np.testing.assert_allclose(out.confidence_by_position, want, rtol=1e-5)
    no_head = _rigged_draft(target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0)
    assert (
        speculative_generate(
            target, no_head, prompts[rows][:2], max_new_tokens=3, key=jax.random.key(1)
        ).confidence_by_position
        == []
    )


def test_scheduled_verify_runs_the_narrowest_width_and_caches_only_verified_slots():
    target, _ = _bigram_target(V, context_scale=1.0)
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, V, size=(3, 5)), jnp.int32)  # [B, T], T = γ + 1 = 5
    positions = jnp.asarray(np.arange(5)[None, :] + np.array([[0], [3], [6]]), jnp.int32)
    active = jnp.asarray([True, True, False])
    verify_len = jnp.asarray([3, 1, 5], jnp.int32)  # the longest active row verifies 3: width 4
    cache = target.init_cache(3, 16)
    feature_layers = (0, 1)

    @jax.jit
    def both(cache):
        scheduled = _verify_scheduled(target, tokens, positions, cache, active, verify_len, feature_layers)
        full = target(tokens, positions, cache, valid=jnp.ones((3, 5), bool), feature_layers=feature_layers)
        return scheduled, full

    (logits, features, new_cache), (full_logits, full_features, full_cache) = both(cache)
    assert verify_widths(5) == (1, 2, 4, 5)
    np.testing.assert_array_equal(np.asarray(logits)[:, 4:], 0)  # past the width run: zeros
    assert np.abs(np.asarray(logits)[:, 3]).max() > 0  # width 4 ran, not 3 (a width it lacks)
    for b, n in ((0, 3), (1, 1)):  # verified slots match the full verify (causal: later slots unseen)
        np.testing.assert_allclose(np.asarray(logits)[b, :n], np.asarray(full_logits)[b, :n], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(np.asarray(features)[b, :n], np.asarray(full_features)[b, :n], rtol=1e-5, atol=1e-5)
    k, full_k = np.asarray(new_cache.k), np.asarray(full_cache.k)  # [L, B, C, KVH, D]
    written = np.abs(k).sum(axis=(0, 3, 4)) > 0  # [B, C]
    want = np.zeros((3, 16), bool)
    want[0, 0:3] = True  # row 0: positions 0, 1, 2
    want[1, 3] = True  # row 1: its anchor only; row 2 (finished): nothing
    np.testing.assert_array_equal(written, want)
    np.testing.assert_allclose(k[:, 0, 0:3], full_k[:, 0, 0:3], rtol=1e-5, atol=1e-5)


def test_early_stopping_request_leaves_the_others_unchanged(greedy_setup):
    target, bigram, prompts, _, _ = greedy_setup
    draft = _rigged_draft(target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0)
    batch = prompts[:8]
    temps = [0.0, 1.0, 0.0, 1.0, 0.7, 1.0, 0.0, 1.3]
    run = functools.partial(  # the in-graph round loop (the other tests use the host loop)
        speculative_generate,
        target,
        draft,
        batch,
        temperature=temps,
        key=jax.random.key(3),
        capacity=CAPACITY,
        device_loop=True,
    )
    free = run(max_new_tokens=24)
    stop_1 = free.tokens[1][5]
    stops = [[], [stop_1], [], [], [], [free.tokens[5][0]], [], []]
    max_new = [24, 24, 3, 24, 24, 24, 24, 24]
    stopped = run(max_new_tokens=max_new, stop_tokens=stops)
    for b in (0, 3, 4, 6, 7):
        assert stopped.tokens[b] == free.tokens[b]
    assert stopped.tokens[1] == free.tokens[1][: free.tokens[1].index(stop_1) + 1]
    assert stopped.tokens[2] == free.tokens[2][:3]
    assert stopped.tokens[5] == free.tokens[5][:1]


STOP_TEMPS = [0.0, 1.0, 0.0, 1.0, 0.7, 1.0, 0.0, 1.3]  # greedy and sampling rows, as in the test above


@pytest.fixture(scope="module")
def free_runs(greedy_setup):
    """Eight mixed requests of 24 tokens without stop tokens, host loop and device loop, and
    the speculative call that made them (a draft that is often rejected: keep = 0.7)."""
    target, bigram, prompts, _, _ = greedy_setup
    draft = _rigged_draft(target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0)
    run = functools.partial(
        speculative_generate,
        target,
        draft,
        prompts[:8],
        max_new_tokens=24,
        temperature=STOP_TEMPS,
        key=jax.random.key(3),
        capacity=CAPACITY,
    )
    free = {loop: run(device_loop=loop) for loop in (False, True)}
    for out in free.values():
        assert all(len(t) == 24 for t in out.tokens)
        assert out.accept_length_counts[0] > 0 and out.accept_length_counts[-1] > 0  # rejections and full accepts
    return target, prompts[:8], run, free


@pytest.mark.parametrize("device_loop", [False, True], ids=["host-loop", "device-loop"])
def test_a_stop_token_among_rejected_drafts_or_padding_does_not_end_a_request(free_runs, device_loop):
    """Every row stops on every id it never emits: rejected drafts and the padding after the
    bonus hold such ids, but only emitted tokens count, so nothing changes."""
    _, _, run, free = free_runs
    free = free[device_loop]
    stops = [[v for v in range(V) if v not in free.tokens[b]] for b in range(8)]
    assert all(stops) and all(0 in s for s in stops)  # the padding id 0 among them
    stopped = run(stop_tokens=stops, device_loop=device_loop)
    assert stopped.tokens == free.tokens
    assert stopped.rounds == free.rounds
    assert stopped.accept_length_counts == free.accept_length_counts


@pytest.mark.parametrize("device_loop", [False, True], ids=["host-loop", "device-loop"])
def test_a_stop_token_ends_decoding_at_the_round_that_emits_it(free_runs, device_loop):
    """Each row stops at its third token: it takes part in no round after the one that
    emitted it, so the call runs fewer rounds and commits at most γ tokens past the stops;
    plain decoding stops at the step that emits it."""
    target, prompts, run, free = free_runs
    gamma = len(free[device_loop].accept_length_counts) - 1
    free = free[device_loop]
    stops = [[t[2]] for t in free.tokens]
    stopped = run(stop_tokens=stops, device_loop=device_loop)
    lengths = [t.index(s[0]) + 1 for t, s in zip(free.tokens, stops, strict=True)]
    assert stopped.tokens == [t[:n] for t, n in zip(free.tokens, lengths, strict=True)]
    # Every round a row takes part in commits >= 1 token, the first comes from the prefill.
    after_start = sum(lengths) - len(lengths)
    counts = np.asarray(stopped.accept_length_counts)
    assert counts.sum() <= after_start
    assert after_start <= counts @ np.arange(1, gamma + 2) <= after_start + len(lengths) * gamma
    assert stopped.rounds <= max(lengths) - 1 < free.rounds
    assert stopped.verified_tokens == (gamma + 1) * counts.sum()

    plain = functools.partial(
        generate, target, prompts, max_new_tokens=24, temperature=STOP_TEMPS, key=jax.random.key(3), capacity=CAPACITY
    )
    plain_free = plain(device_loop=device_loop)
    assert plain_free.rounds == 23
    stops = [[t[2]] for t in plain_free.tokens]
    plain_stopped = plain(stop_tokens=stops, device_loop=device_loop)
    lengths = [t.index(s[0]) + 1 for t, s in zip(plain_free.tokens, stops, strict=True)]
    assert plain_stopped.tokens == [t[:n] for t, n in zip(plain_free.tokens, lengths, strict=True)]
    assert plain_stopped.rounds == max(lengths) - 1  # row b emits token i at step i (0: the prefill)
    assert plain_stopped.verified_tokens == sum(lengths) - len(lengths)


def test_acceptance_by_position_is_the_fraction_of_rounds_accepting_at_least_k_drafts(free_runs):
    """``acceptance_by_position[k − 1]``: request-rounds that accepted draft ``d_k``, i.e. whose
    ``correct_len >= k``, over all request-rounds."""
    _, _, _, free = free_runs
    for out in free.values():
        counts = np.asarray(out.accept_length_counts)
        gamma = len(counts) - 1
        want = [sum(int(counts[j]) for j in range(k, gamma + 1)) / int(counts.sum()) for k in range(1, gamma + 1)]
        assert len(out.acceptance_by_position) == gamma
        np.testing.assert_allclose(out.acceptance_by_position, want, rtol=1e-12)
        assert out.acceptance_by_position[-1] > 0 and out.acceptance_by_position[0] < 1  # neither all nor none
        assert np.all(np.diff(out.acceptance_by_position) <= 0)


@pytest.mark.parametrize("device_loop", [False, True], ids=["host-loop", "device-loop"])
def test_plain_verified_tokens_are_the_decode_steps_of_every_request(small_pair, device_loop):
    """One token per request and decode step, the first (from the prefill) not counted:
    ``Σ len(tokens) − B``, ``rounds · B`` when every request has the same max_new_tokens."""
    target, _ = small_pair
    prompts = [[1, 2, 3], [4], [5, 6]]
    run = functools.partial(generate, target, prompts, key=jax.random.key(0), device_loop=device_loop)
    same = run(max_new_tokens=5)
    assert [len(t) for t in same.tokens] == [5, 5, 5]
    assert same.verified_tokens == 3 * 4 == same.rounds * 3
    mixed = run(max_new_tokens=[5, 2, 3])
    assert [len(t) for t in mixed.tokens] == [5, 2, 3]
    assert mixed.verified_tokens == (5 - 1) + (2 - 1) + (3 - 1)


def test_each_requests_tau_counts_only_the_rounds_it_took_part_in(greedy_setup):
    """Greedy rows are independent, so each row's tau in a batch whose rows finish at
    different rounds equals its tau decoded alone (a finished row's later rounds counted
    in made it too small); a request done at its first token (max_new_tokens=1) took
    part in no round: tau NaN."""
    target, bigram, prompts, _, _ = greedy_setup
    draft = _rigged_draft(target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0)
    rows = [0, 1, 2, 3]
    max_new = [1, 3, 9, 24]
    run = functools.partial(speculative_generate, target, draft, key=jax.random.key(1), capacity=CAPACITY)
    batch = run([prompts[b] for b in rows], max_new_tokens=max_new)
    assert [len(t) for t in batch.tokens] == max_new
    assert np.isnan(batch.tau[0])
    alone = [run([prompts[b]], max_new_tokens=n) for b, n in zip(rows[1:], max_new[1:], strict=True)]
    assert [a.tokens[0] for a in alone] == batch.tokens[1:]
    assert batch.tau[1:] == [a.tau[0] for a in alone]
    assert len({a.rounds for a in alone}) == 3 and all(t >= 1 for t in batch.tau[1:])


def test_cut_keeps_each_row_through_its_first_stop_token_and_within_max_new_tokens():
    """Stop lists are −1 padded; the id 0 is a stop token like any other."""
    out = np.array([[3, 0, 5, 0, 7, 9], [4, 2, 0, 2, 1, 0], [6, 6, 6, 6, 6, 6]], np.int32)
    n_out = np.array([6, 6, 5])
    max_new = np.array([6, 4, 6])
    stop = np.array([[0, -1], [2, -1], [-1, -1]], np.int32)
    assert _cut(out, n_out, max_new, stop) == [[3, 0], [4, 2], [6, 6, 6, 6, 6]]
    assert _cut(out, n_out, np.array([6, 6, 2]), np.array([[5, 0], [-1, -1], [1, -1]], np.int32)) == [
        [3, 0],
        [4, 2, 0, 2, 1, 0],
        [6, 6],
    ]


def test_stop_token_id_0_ends_the_output_after_its_first_occurrence(greedy_setup):
    """Rounds accept several tokens at once, so the round that emits a 0 may emit more after
    it; the output is still cut right after the first 0, as for any stop token."""
    target, bigram, prompts, _, _ = greedy_setup
    # This target never emits 0: swapping ids 0 and 21 (a common one) in both of its tables
    # makes one that emits 0 where it emits 21.
    swap = np.arange(V)
    swap[[0, 21]] = [21, 0]
    swapped = Qwen3Target(target.config, rngs=nnx.Rngs(0))
    nnx.update(swapped, nnx.state(target))
    for table in (swapped.embed, swapped.head):
        table.set_value(table.get_value()[swap])
    draft = _rigged_draft(swapped, swap[bigram[swap]], gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0)
    rows = prompts[:12]
    plain = generate(swapped, rows, max_new_tokens=24, key=jax.random.key(0), capacity=CAPACITY).tokens
    assert sum(0 in t[:-1] for t in plain) >= 3  # the 0 ends several rows early
    out = speculative_generate(
        swapped, draft, rows, max_new_tokens=24, stop_tokens=[0], key=jax.random.key(1), capacity=CAPACITY
    )
    assert out.tokens == [t[: t.index(0) + 1] if 0 in t else t for t in plain]


# ---------------------------------------------------------------- lossless sampling
SV, PROMPT = 6, [1, 4, 2]


@functools.partial(jax.jit, static_argnames="graphdef")
def _logits(graphdef, state, tokens):
    target = nnx.merge(graphdef, state)
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    logits, _, _ = target(tokens, positions, target.init_cache(b, s))
    return logits


def _continuation_logits(target) -> tuple[np.ndarray, np.ndarray]:
    """Target logits ``[36, P + 2, V]`` of PROMPT followed by every pair of tokens."""
    pairs = np.array(list(itertools.product(range(SV), repeat=2)))  # [36, 2]
    seqs = np.concatenate([np.tile(PROMPT, (len(pairs), 1)), pairs], axis=1)
    return pairs, np.asarray(_logits(*nnx.split(target), jnp.asarray(seqs, jnp.int32)), np.float64)


def _greedy_tokens(target) -> list[int]:
    pairs, logits = _continuation_logits(target)
    p = len(PROMPT)
    t1 = int(np.argmax(logits[0, p - 1]))
    t2 = int(np.argmax(logits[t1 * SV, p]))
    return [t1, t2, int(np.argmax(logits[t1 * SV + t2, p + 1]))]


def _exact_joint(target, temp, top_k, top_p) -> np.ndarray:
    """P(t1, t2, t3) of the target sampling three tokens after PROMPT, by enumeration."""
    pairs, logits = _continuation_logits(target)
    p = len(PROMPT)

    def dist(row):  # softmax at the temperature; keep the top k by (−prob, id), then the top-p prefix
        z = np.exp((row - row.max()) / temp)
        probs = z / z.sum()
        ranked = sorted(range(SV), key=lambda v: (-probs[v], v))[:top_k]
        mass, kept = probs[ranked].sum(), []
        for v in ranked:
            kept.append(v)
            if top_p < 1 and probs[kept].sum() >= top_p * mass:
                break
        out = np.zeros(SV)
        out[kept] = probs[kept]
        return out / out.sum()

    joint = np.zeros((SV, SV, SV))
    p1 = dist(logits[0, p - 1])
    for i, (t1, t2) in enumerate(pairs):
        joint[t1, t2] = p1[t1] * dist(logits[i, p])[t2] * dist(logits[i, p + 1])
    return joint


def _tv_tolerance(want: np.ndarray, n: int) -> float:
    # E[TV] = ½ Σ E|p̂ − p| <= ½ Σ sqrt(p(1 − p) / n); TV moves by <= 1/n per sample, so by
    # McDiarmid it exceeds its mean by t with probability <= exp(−2 t² n): t for e^−8.
    return 0.5 * np.sqrt(want * (1 - want) / n).sum() + np.sqrt(8 / (2 * n))


@pytest.mark.parametrize(
    ("gamma", "scheduled"),
    [(2, None), (2, "per_request"), (2, "uniform"), (1, None)],
    ids=["full", "scheduled", "scheduled-uniform", "gamma1"],
)
def test_speculative_sampling_matches_target_distribution_in_a_mixed_batch(gamma, scheduled):
    """The joint law of the first three tokens; ``scheduled`` verifies each request's
    confidence-scheduled prefix of the block only (``verify_schedule`` under that
    ``verify_rule``; the uniform rule, one length for the whole round), which must keep it.
    With γ = 1 the third token is the bonus of a round that accepted its draft, or the
    second round's first token: the bonus after a full acceptance is in the law."""
    target, bigram = _bigram_target(SV, context_scale=20.0, seed=3)
    fields = dict(enable_confidence_head=True) if scheduled else {}
    draft = _rigged_draft(
        target, bigram, gamma=gamma, sample_from_anchor=True, keep=0.5, strength=2.0, seed=4, **fields
    )
    groups = [  # (rows, temperature, top_k, top_p)
        (20_000, 2.0, 4, 0.95),
        (6_000, 0.8, None, 1.0),
        (16, 0.0, None, 1.0),
    ]
    temps, ks, ps = [], [], []
    for n, t, k, p in groups:
        temps += [t] * n
        ks += [k] * n
        ps += [p] * n
    order = np.random.default_rng(0).permutation(len(temps))  # interleave the groups
    batch = len(temps)
    # Steps per second fall by 0.3 of a step per token per batch row: drafts are verified
    # only where their survival is high enough (here: most rows verify 2 tokens, some 3).
    schedule = 1.0 / (1.0 + 0.3 * np.arange(batch * 3 + 1) / batch) if scheduled else None
    result = speculative_generate(
        target,
        draft,
        [PROMPT] * len(temps),
        max_new_tokens=3,
        temperature=[temps[i] for i in order],
        top_k=[ks[i] for i in order],
        top_p=[ps[i] for i in order],
        key=jax.random.key(11),
        capacity=16,
        verify_schedule=schedule,
        verify_rule=scheduled or "per_request",
    )
    out = np.empty((len(temps), 3), np.int64)
    out[order] = np.asarray(result.tokens)
    counts = np.asarray(result.accept_length_counts)
    lengths = np.asarray(result.verify_length_counts)  # [γ + 1] request-rounds by tokens verified
    request_rounds = int(counts.sum())
    if scheduled == "uniform":  # whole rounds verify 2 of the 3 tokens (the first) or the anchor alone
        assert lengths[1] == len(temps) and lengths[2] == 0 and counts[0] > 0 and counts[1] > 0, (lengths, counts)
    else:
        assert (counts > 0).all()  # rejections, partial and full acceptances
    if scheduled == "per_request":  # most rounds verified fewer than all γ + 1 = 3 tokens, some more than the anchor
        assert request_rounds < result.verified_tokens < 2.5 * request_rounds, (result.verified_tokens, request_rounds)
    elif not scheduled:
        assert result.verified_tokens == (gamma + 1) * request_rounds
    start = 0
    for n, t, k, p in groups:
        rows = out[start : start + n]
        start += n
        if t == 0.0:
            assert (rows == _greedy_tokens(target)).all()
            continue
        want = _exact_joint(target, t, 1 << 30 if k is None else k, p)
        got = np.zeros_like(want)
        np.add.at(got, tuple(rows.T), 1)
        tv = 0.5 * np.abs(got / n - want).sum()
        assert tv < _tv_tolerance(want, n), (t, k, p, tv, _tv_tolerance(want, n))
        if k == 4:
            assert (got[want == 0] == 0).all()  # nothing outside the top-k / top-p is ever emitted


# ---------------------------------------------------------------- bad input
@pytest.fixture(scope="module")
def small_pair():
    target, bigram = _bigram_target(V, context_scale=1.0)
    return target, _rigged_draft(target, bigram, gamma=3, sample_from_anchor=True, keep=0.5, strength=5.0)


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(prompts=[]), ValueError, "prompts"),
        (dict(prompts=[[1, 2], []]), ValueError, r"prompts\[1\] is empty"),
        (dict(prompts=[[1, [2]], [3]]), ValueError, r"prompts\[0\] is empty or not a flat list of token ids"),
        (dict(prompts=np.ones((2, 2, 2), np.int32)), ValueError, r"prompts has shape \(2, 2, 2\): .* \[B, P\]"),
        (dict(prompts=[[1, V]]), ValueError, r"prompts\[0\]\[1\]=24 is outside the vocabulary"),
        (dict(prompts=[[-1]]), ValueError, "outside the vocabulary"),
        (dict(capacity=8), ValueError, "capacity=8 is too small"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens"),
        (dict(max_new_tokens=[3, 4, 5]), ValueError, "max_new_tokens has 3 entries"),
        (dict(temperature=-1.0), ValueError, "temperature"),
        (dict(top_k=0), ValueError, "top_k"),
        # the round reads top_k as int32 and temperatures as float32
        (dict(top_k=2**31), ValueError, r"top_k\[0\]=2147483648 is invalid: .* \[1, 2147483647\]"),
        (dict(temperature=1e39), ValueError, r"temperature\[0\]=1e\+39 is invalid: .* finite in float32"),
        (dict(top_p=0.0), ValueError, "top_p"),
        (dict(stop_tokens=[V + 1]), ValueError, "stop_tokens"),
        (dict(key=7), TypeError, "key"),
        # bools are not numbers here, and flags take only bools
        (dict(temperature=True), TypeError, r"temperature\[0\]=True is invalid: must be a number >= 0"),
        (dict(top_p=True), TypeError, r"top_p\[0\]=True is invalid: must be a number in \(0, 1\]"),
        (dict(top_k=[None, True]), TypeError, r"top_k\[1\]=True is invalid: must be None \(no top-k\) or an integer"),
        (dict(max_new_tokens=True), TypeError, r"max_new_tokens\[0\]=True is invalid: must be an integer"),
        (dict(device_loop="no"), TypeError, "device_loop='no' is invalid: must be True or False"),
        (dict(device_loop=1), TypeError, "device_loop=1 is invalid: must be True or False"),
        (dict(capacity=64.0), TypeError, r"capacity=64.0 is invalid: must be None \(.*\) or an integer"),
        (dict(capacity=np.int64(8)), ValueError, "capacity=8 is too small"),
        # stop_tokens: one list of ids, or one list per request
        (dict(stop_tokens=5), TypeError, "stop_tokens=5 is invalid: expected token ids: one list for every request"),
        (dict(stop_tokens=[1, [2]]), TypeError, r"stop_tokens=\[1, \[2\]\] is invalid: it mixes ids and lists"),
        (dict(stop_tokens=[[1], [2, True]]), TypeError, r"stop_tokens\[1\]\[1\]=True is invalid: .* ids in \[0, 24\)"),
        (dict(stop_tokens=[[1], [2], [3]]), ValueError, r"stop_tokens has 3 lists: expected one per prompt \(2\)"),
        # max_new_tokens reaches the round as int32; 10**400 has no float
        (dict(max_new_tokens=2**31), ValueError, r"max_new_tokens\[0\]=2147483648 is invalid: .* \[1, 2147483647\]"),
        (dict(temperature=10**400), ValueError, r"temperature\[0\]=10+ is invalid: .* finite in float32"),
        (dict(temperature=jnp.array([[0.5, 0.5]])), ValueError, "temperature has 1 entries: expected one per prompt"),
    ],
)
def test_bad_input_raises_before_compiling(small_pair, kwargs, error, message):
    target, draft = small_pair
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=5, key=jax.random.key(0)) | kwargs
    with pytest.raises(error, match=message):
        speculative_generate(target, draft, **args)


def test_prompts_may_be_one_array_of_equal_length_prompts(small_pair):
    target, draft = small_pair
    prompts = [[1, 2, 3], [4, 5, 6]]
    for decode in (functools.partial(speculative_generate, target, draft), functools.partial(generate, target)):
        want = decode(prompts, max_new_tokens=4, key=jax.random.key(0)).tokens
        assert decode(np.asarray(prompts), max_new_tokens=4, key=jax.random.key(0)).tokens == want
        assert decode(jnp.asarray(prompts), max_new_tokens=4, key=jax.random.key(0)).tokens == want


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(device_loop="no"), TypeError, "device_loop='no' is invalid: must be True or False"),
        (dict(temperature=[0.0, True]), TypeError, r"temperature\[1\]=True is invalid"),
        (dict(stop_tokens=5), TypeError, "stop_tokens=5 is invalid"),
        (dict(capacity=np.int64(7)), ValueError, "capacity=7 is too small"),
    ],
)
def test_plain_generate_refuses_bad_input(small_pair, kwargs, error, message):
    target, _ = small_pair
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=5, key=jax.random.key(0)) | kwargs
    with pytest.raises(error, match=message):
        generate(target, **args)


@pytest.mark.parametrize(
    "table, error, message",
    [
        (
            np.ones(8 * 4),
            ValueError,
            r"verify_schedule has shape \(32,\): expected \[N\] with N >= B·\(γ \+ 1\) \+ 1 = 9",
        ),
        (np.ones((2, 9)), ValueError, r"verify_schedule has shape \(2, 9\)"),
        (np.r_[np.ones(5), -1.0, np.ones(5)], ValueError, r"verify_schedule\[5\]=-1.0 is invalid: must be >= 0"),
        (np.r_[np.ones(5), np.nan, np.ones(5)], ValueError, r"verify_schedule\[5\]=nan is invalid"),
        (
            np.r_[np.ones(5), 1e39, np.ones(5)],
            ValueError,
            r"verify_schedule\[5\]=1e\+39 is invalid: .* finite in float32",
        ),
        (np.zeros(9), ValueError, "verify_schedule is all zeros"),
        (np.ones(9, bool), TypeError, "verify_schedule has dtype bool: expected real numbers"),
        (np.array(["1"] * 9), TypeError, "verify_schedule has dtype <U1"),
    ],
)
def test_bad_verify_schedules_are_refused_by_name(table, error, message):
    target, bigram = _bigram_target(V, context_scale=1.0)
    draft = _rigged_draft(
        target, bigram, gamma=3, sample_from_anchor=True, keep=0.5, strength=5.0, enable_confidence_head=True
    )
    args = dict(prompts=[[1, 2, 3], [4]], max_new_tokens=5, key=jax.random.key(0))
    if table.ndim == 1 and table.size == 32:
        args["prompts"] = [[1]] * 8  # B·(γ + 1) + 1 = 33 > 32
        message = message.replace("= 9", "= 33")
    with pytest.raises(error, match=message):
        speculative_generate(target, draft, verify_schedule=table, **args)


def test_a_verify_schedule_needs_a_confidence_head(small_pair):
    target, draft = small_pair
    with pytest.raises(ValueError, match=r"verify_schedule needs a draft with a confidence head"):
        speculative_generate(target, draft, [[1]], max_new_tokens=2, key=jax.random.key(0), verify_schedule=np.ones(9))


@pytest.mark.parametrize(
    "rule, table, error, message",
    [
        (
            "dense",
            np.ones(9),
            ValueError,
            r"verify_rule='dense' is invalid: expected one of \('per_request', 'uniform'\)",
        ),
        (1, np.ones(9), TypeError, r"verify_rule=1 is invalid: expected one of"),
        ("uniform", None, ValueError, r"verify_rule='uniform' needs a verify_schedule"),
    ],
)
def test_bad_verify_rules_are_refused_by_name(rule, table, error, message):
    target, bigram = _bigram_target(V, context_scale=1.0)
    draft = _rigged_draft(
        target, bigram, gamma=3, sample_from_anchor=True, keep=0.5, strength=5.0, enable_confidence_head=True
    )
    with pytest.raises(error, match=message):
        speculative_generate(
            target, draft, [[1, 2]], max_new_tokens=2, key=jax.random.key(0), verify_schedule=table, verify_rule=rule
        )


def test_measure_verify_schedule_prices_each_total_at_the_narrowest_width_holding_it(greedy_setup):
    """The measured table is positive, one value per width of ``verify_widths`` (γ = 4:
    1, 2, 4, 5 tokens per request) over the totals that width holds, and the greedy
    output scheduled with it, under either rule, is still plain greedy."""
    target, bigram, prompts, max_new, plain = greedy_setup
    first = _case_batches(2)[0].start
    rows = slice(first, first + 3)
    draft = _rigged_draft(
        target, bigram, gamma=4, sample_from_anchor=True, keep=0.7, strength=100.0, enable_confidence_head=True
    )
    table = measure_verify_schedule(target, draft, 3, prompt_len=4, rounds=2)
    assert table.shape == (3 * 5 + 1,) and table.dtype == np.float32
    assert np.isfinite(table).all() and (table > 0).all()
    for lo, hi in ((0, 3), (4, 6), (7, 12), (13, 15)):  # totals t whose ⌈t / 3⌉ needs width 1, 2, 4, 5
        assert (table[lo : hi + 1] == table[lo]).all(), (lo, hi, table)
    assert len(set(table[[0, 4, 7, 13]].tolist())) == 4  # four widths, four timings
    for rule in ("per_request", "uniform"):
        out = speculative_generate(
            target,
            draft,
            prompts[rows],
            max_new_tokens=max_new[rows].tolist(),
            key=jax.random.key(1),
            capacity=CAPACITY,
            verify_schedule=table,
            verify_rule=rule,
        )
        assert out.tokens == plain[rows]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(batch=0), ValueError, "batch=0 is invalid"),
        (dict(rounds=True), ValueError, "rounds=True is invalid"),
        (
            dict(prompt_len=54),
            ValueError,
            r"prompt_len=54 and rounds=1 need prompt_len \+ \(rounds \+ 1\)·\(γ \+ 1\) \+ γ = 65 positions \(γ = 3\), "
            r"past the draft.s max_position_embeddings=64: lower prompt_len or rounds",
        ),
        (dict(temperature=-1.0), ValueError, r"temperature\[0\]=-1.0 is invalid"),
    ],
)
def test_measure_verify_schedule_refuses_bad_input_by_name(kwargs, error, message):
    target, bigram = _bigram_target(V, context_scale=1.0)
    draft = _rigged_draft(
        target,
        bigram,
        gamma=3,
        sample_from_anchor=True,
        keep=0.5,
        strength=5.0,
        enable_confidence_head=True,
        max_position_embeddings=64,
    )
    args = dict(batch=2, prompt_len=4, rounds=1) | kwargs
    with pytest.raises(error, match=message):
        measure_verify_schedule(target, draft, **args)


def test_measure_verify_schedule_needs_a_confidence_head(small_pair):
    with pytest.raises(ValueError, match="verify_schedule needs a draft with a confidence head"):
        measure_verify_schedule(*small_pair, 2)


def test_models_of_the_wrong_kind_are_type_errors_naming_the_argument(small_pair):
    target, draft = small_pair
    args = dict(prompts=[[1, 2, 3]], max_new_tokens=5, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"got a DSparkDraft \(the target and the draft are swapped"):
        speculative_generate(draft, target, **args)
    with pytest.raises(TypeError, match="draft must be a DSparkDraft, got NoneType"):
        speculative_generate(target, None, **args)
    with pytest.raises(TypeError, match=r"target must be an NNX module with config and init_cache .*, got dict"):
        speculative_generate({"config": target.config}, draft, **args)
    with pytest.raises(TypeError, match="target must be a target model, got a DSparkDraft$"):
        generate(draft, **args)


def test_numpy_and_jax_numbers_act_as_python_numbers(small_pair):
    target, draft = small_pair
    run = functools.partial(speculative_generate, target, draft, [[1, 2, 3], [4]], key=jax.random.key(2))
    want = run(max_new_tokens=5, temperature=0.7, top_k=[None, 5], top_p=0.9, stop_tokens=[3], capacity=32)
    scalars = run(
        max_new_tokens=np.int64(5),
        temperature=jnp.float32(0.7),
        top_k=[None, np.int32(5)],
        top_p=jnp.float32(0.9),
        stop_tokens=np.array([3]),
        capacity=np.int64(32),
    )
    per_request = run(
        max_new_tokens=[5, np.int16(5)],
        temperature=jnp.array([0.7, 0.7]),  # temperatures may come one per request
        top_k=[None, 5],
        top_p=np.array([0.9, 0.9]),
        stop_tokens=[[3], np.array([3])],
        capacity=32,
    )
    assert scalars.tokens == want.tokens
    assert per_request.tokens == want.tokens


@pytest.mark.parametrize(
    "target_limit, draft_limit, exceeded",
    [
        (16, 4096, "the target's max_position_embeddings=16$"),
        (4096, 16, "the draft's max_position_embeddings=16$"),
        (16, 16, "the target's max_position_embeddings=16 and the draft's max_position_embeddings=16$"),
    ],
)
def test_requests_past_max_position_embeddings_are_refused(target_limit, draft_limit, exceeded):
    target = Qwen3Target(dataclasses.replace(_target_cfg(V), max_position_embeddings=target_limit), rngs=nnx.Rngs(0))
    bigram = np.arange(V)
    draft = _rigged_draft(
        target, bigram, gamma=3, sample_from_anchor=True, keep=0.5, strength=5.0, max_position_embeddings=draft_limit
    )
    prompts, key = [[1], [2] * 10], jax.random.key(0)
    # γ = 3: the last round verifies up to γ − 1 = 2 positions past the output, so
    # prompt + max_new_tokens + 2 positions must fit: 10 + 4 + 2 = 16 does, 10 + 5 + 2 does not.
    message = r"prompts\[1\] has 10 tokens and max_new_tokens\[1\]=5: prompt \+ max_new_tokens \+ gamma - 1 = 17 "
    with pytest.raises(ValueError, match=message + ".* exceed " + exceeded):
        speculative_generate(target, draft, prompts, max_new_tokens=[9, 5], key=key)
    with pytest.raises(ValueError, match="capacity=1 is too small"):  # past the position check
        speculative_generate(target, draft, prompts, max_new_tokens=[9, 4], key=key, capacity=1)
    # Plain decoding runs no lookahead: prompt + max_new_tokens positions must fit the target.
    if target_limit == 16:
        message = r"prompts\[1\] has 10 tokens and max_new_tokens\[1\]=7: prompt \+ max_new_tokens = 17 positions"
        with pytest.raises(ValueError, match=message + " exceed the target's max_position_embeddings=16$"):
            generate(target, prompts, max_new_tokens=7, key=key)
    with pytest.raises(ValueError, match="capacity=1 is too small"):
        generate(target, prompts, max_new_tokens=6, key=key, capacity=1)


@pytest.mark.parametrize("device_loop", [False, True])
def test_the_smallest_capacity_accepted_gives_the_same_tokens_as_a_large_one(device_loop):
    """Both decoders accept exactly the positions they refuse past ``max_position_embeddings``
    (speculative: prompt + max_new_tokens + γ − 1; plain: prompt + max_new_tokens), one less is
    refused naming the sum, and at the smallest the tokens (greedy and sampled, requests
    ending at different rounds, a weak draft so that every output length is reached) equal
    those of a roomy cache."""
    target, bigram = _bigram_target(V, context_scale=60.0)
    draft = _rigged_draft(target, bigram, gamma=4, sample_from_anchor=True, keep=0.3, strength=100.0)
    prompts, max_new = [[1, 2, 3], [4] * 7, [5]], [9, 6, 11]
    run = dict(max_new_tokens=max_new, temperature=[0.0, 0.8, 0.0], key=jax.random.key(3), device_loop=device_loop)
    for decode, need, terms in [
        (functools.partial(speculative_generate, target, draft), 7 + 6 + 3, r"max_new_tokens \+ gamma - 1, the"),
        (functools.partial(generate, target), 7 + 6, r"max_new_tokens\)"),
    ]:
        roomy = decode(prompts, capacity=64, **run).tokens
        assert decode(prompts, capacity=need, **run).tokens == roomy
        with pytest.raises(
            ValueError, match=rf"capacity={need - 1} is too small: .* needs capacity >= {need} \(prompt \+ {terms}"
        ):
            decode(prompts, capacity=need - 1, **run)


def test_misfit_draft_raises(small_pair):
    target, _ = small_pair
    cfg = DraftConfig(
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=V,
        block_size=3,
        mask_token_id=V - 1,
        target_layer_ids=(0, 2),  # the target has 2 layers
        markov_rank=4,
    )
    draft = DSparkDraft(cfg, rngs=nnx.Rngs(0), embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    with pytest.raises(ValueError, match="target_layer_ids"):
        speculative_generate(target, draft, [[1, 2]], max_new_tokens=4, key=jax.random.key(0))
