"""``dspark-jax bench --e2e``: a Qwen3-shaped target (random weights) decoding plainly against
speculative decoding whose accepted lengths are forced to a chosen mean (benchmark only).

Shape legend: B batch, T verify width (γ + 1).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.bench_timing import time_call
from dspark_jax.bench_workload import BenchShapes, build_draft, draft_config, jit_split, random_context, target_config
from dspark_jax.cache import fill_context
from dspark_jax.config import DraftConfig
from dspark_jax.target import KVCache, Qwen3Target


def forced_accept_probs(mean_accepted: float, gamma: int) -> np.ndarray:
    """A fixed distribution of ``correct_len`` over ``0..γ`` with mean ``mean_accepted − 1``.

    ``P(c) ∝ exp(λ·c)`` with ``λ`` found by bisection; ``mean_accepted`` counts the bonus
    token, like the paper's τ.

    Returns:
      ``[γ + 1]`` float64 probabilities.
    """
    want = mean_accepted - 1.0
    if not 0.0 < want < gamma:
        raise ValueError(f"tau={mean_accepted!r} is invalid: must lie strictly between 1 and gamma + 1 = {gamma + 1}")
    c = np.arange(gamma + 1, dtype=np.float64)

    def probs(lam):
        w = np.exp(lam * c - np.max(lam * c))
        return w / w.sum()

    lo, hi = -60.0, 60.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if probs(mid) @ c < want else (lo, mid)
    return probs(0.5 * (lo + hi))


def fused_layer_ids(cfg: DraftConfig, num_layers: int) -> tuple[int, ...]:
    """The draft's ``target_layer_ids`` for a target of ``num_layers`` layers (``--e2e-layers``).

    The draft's own ids where they fit; else its ``num_fused_layers`` ids spread evenly from
    the first layer to the last (rounded half up, so strictly increasing); with one layer too
    few for that, the embedding output (id -1) and every layer.

    Raises:
      ValueError: ``num_layers`` is below ``num_fused_layers - 1``.
    """
    n = cfg.num_fused_layers
    if num_layers < n - 1:
        raise ValueError(
            f"target_layers={num_layers!r} is invalid: the draft fuses {n} target layers, so the target needs at "
            f"least {n - 1} (the embedding output counts as one)"
        )
    if cfg.target_layer_ids[-1] < num_layers:
        return cfg.target_layer_ids
    if num_layers == n - 1:
        return tuple(range(-1, num_layers))
    return tuple(int(i) for i in np.floor(np.linspace(0, num_layers - 1, n) + 0.5))


def _spec_round(t_graphdef, t_state, d_graphdef, d_state, kv, ctx, bonus, prefix_lens, key, accept_probs):
    """Greedy propose → verify → forced accept → commit, one compiled round."""
    from dspark_jax.proposal import propose

    target = nnx.merge(t_graphdef, t_state)
    draft = nnx.merge(d_graphdef, d_state)
    cfg = draft.cfg
    batch = bonus.shape[0]
    k_prop, k_acc = jax.random.split(key)
    zeros = jnp.zeros((batch,), jnp.float32)
    ones = jnp.ones((batch,), jnp.int32)
    block = propose(d_graphdef, d_state, ctx, bonus, prefix_lens, zeros, ones, k_prop, fold_sampling=False)
    tokens = jnp.concatenate([bonus[:, None], block.draft_tokens], axis=1)  # [B, T]
    positions = prefix_lens[:, None] + jnp.arange(cfg.gamma + 1, dtype=jnp.int32)  # [B, T]
    logits, features, kv = target(tokens, positions, kv, feature_layers=cfg.target_layer_ids)
    pred = jnp.argmax(logits, axis=-1).astype(jnp.int32)  # [B, T]
    # Benchmark only: accepted lengths drawn from a fixed distribution, not from pred.
    correct = jax.random.choice(k_acc, cfg.gamma + 1, (batch,), p=accept_probs).astype(jnp.int32)
    new_bonus = jnp.take_along_axis(pred, correct[:, None], axis=1)[:, 0]
    ctx = fill_context(draft, ctx, features, prefix_lens, correct + 1)
    return kv, ctx, new_bonus, prefix_lens + correct + 1, correct


def _plain_step(graphdef, state, kv, tokens, positions):
    """One greedy decode step of the target: ``[B]`` tokens at ``[B]`` positions."""
    target = nnx.merge(graphdef, state)
    logits, _, kv = target(tokens[:, None], positions[:, None], kv)
    return kv, jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), positions + 1


def _verify(graphdef, state, kv, tokens, positions, feature_layers):
    target = nnx.merge(graphdef, state)
    logits, features, kv = target(tokens, positions, kv, feature_layers=feature_layers)
    return kv, logits, features


def bench_e2e(
    shapes: BenchShapes, *, target_layers: int, tau: float, rounds: int, seed: int = 0, batch: int = 1
) -> dict[str, Any]:
    """Plain against speculative decoding with accepted lengths forced to mean ``tau``.

    Both decode greedily from a ``context``-token prefix held in random caches; every
    step or round is waited for before the next (as a server streaming tokens does).
    The ideal speed-up from measured parts is ``τ · t_plain_step / (t_propose + t_verify)``.
    """
    from dspark_jax.proposal import propose

    dcfg = draft_config(shapes)
    tcfg = target_config(shapes, target_layers)
    if tcfg.num_hidden_layers != dcfg.num_target_layers:
        dcfg = dataclasses.replace(
            dcfg,
            target_layer_ids=fused_layer_ids(dcfg, tcfg.num_hidden_layers),
            num_target_layers=tcfg.num_hidden_layers,
        )
    target = Qwen3Target(tcfg, rngs=nnx.Rngs(seed))
    t_graphdef, t_state = nnx.split(target)
    d_graphdef, d_state = build_draft(dcfg, seed + 1, embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    t = dcfg.gamma + 1
    context = shapes.context
    capacity = context + (rounds + 8) * t
    keys = jax.random.split(jax.random.key(seed + 2), 4)
    kv_shape = (tcfg.num_hidden_layers, batch, capacity, tcfg.num_key_value_heads, tcfg.head_dim)
    make = jax.jit(lambda k: jax.random.normal(k, kv_shape, tcfg.jnp_dtype))
    start = jnp.full((batch,), context, jnp.int32)
    first = jax.random.randint(keys[2], (batch,), 0, tcfg.vocab_size, jnp.int32)
    probs = jnp.asarray(forced_accept_probs(tau, dcfg.gamma), jnp.float32)

    # Plain decoding.
    plain, t_leaves = jit_split(_plain_step, t_graphdef, t_state, donate_argnums=1)
    kv = KVCache(k=make(keys[0]), v=make(keys[1]))
    tok, pos = first, start
    plain_ms = []
    for i in range(rounds * 2 + 3):
        t0 = time.perf_counter()
        kv, tok, pos = jax.block_until_ready(plain(t_leaves, kv, tok, pos))
        if i >= 3:
            plain_ms.append((time.perf_counter() - t0) * 1e3)

    # The parts: greedy propose and the γ + 1 verify forward, each alone.
    ctx = random_context(dcfg, batch, capacity, keys[3])
    folded, d_leaves = jit_split(propose, d_graphdef, d_state, static_argnames="fold_sampling")
    zeros, ones = jnp.zeros((batch,), jnp.float32), jnp.ones((batch,), jnp.int32)
    t_propose = time_call(
        lambda: folded(d_leaves, ctx, first, start, zeros, ones, keys[0], fold_sampling=False), iters=rounds
    )["median_ms"]
    verify, _ = jit_split(_verify, t_graphdef, t_state, static_argnums=4, donate_argnums=1)
    vtokens = jnp.broadcast_to(first[:, None], (batch, t))
    vpos = start[:, None] + jnp.arange(t, dtype=jnp.int32)
    verify_ms = []
    for i in range(rounds + 3):
        t0 = time.perf_counter()
        kv, *_ = jax.block_until_ready(verify(t_leaves, kv, vtokens, vpos, dcfg.target_layer_ids))
        if i >= 3:
            verify_ms.append((time.perf_counter() - t0) * 1e3)
    t_verify = float(np.median(verify_ms))

    # Speculative decoding: one compiled round, both graphdefs closed over.
    d_tree = jax.tree.structure(d_state)
    t_tree = jax.tree.structure(t_state)

    def round_fn(t_leaves, d_leaves, *args):
        t_st, d_st = jax.tree.unflatten(t_tree, t_leaves), jax.tree.unflatten(d_tree, d_leaves)
        return _spec_round(t_graphdef, t_st, d_graphdef, d_st, *args)

    spec = jax.jit(round_fn, donate_argnums=(2, 3))
    bonus, prefix = first, start
    round_ms, accepted = [], []
    round_keys = list(jax.random.split(jax.random.key(seed + 3), rounds + 3))
    for i in range(rounds + 3):
        t0 = time.perf_counter()
        kv, ctx, bonus, prefix, correct = jax.block_until_ready(
            spec(t_leaves, d_leaves, kv, ctx, bonus, prefix, round_keys[i], probs)
        )
        if i >= 3:
            round_ms.append((time.perf_counter() - t0) * 1e3)
            accepted.append(np.asarray(correct) + 1)
    t_plain = float(np.median(plain_ms))
    tau_measured = float(np.mean(accepted))
    plain_tps = batch * 1e3 / float(np.mean(plain_ms))
    spec_tps = float(np.sum(accepted)) * 1e3 / float(np.sum(round_ms))
    ideal = tau_measured * t_plain / (t_propose + t_verify)
    achieved = spec_tps / plain_tps
    return {
        "batch": batch,
        "target_layers": tcfg.num_hidden_layers,
        "context": context,
        "rounds": rounds,
        "tau_forced_mean": tau,
        "tau_measured": tau_measured,
        "plain_step_ms": t_plain,
        "propose_ms": t_propose,
        "verify_ms": t_verify,
        "round_ms": float(np.median(round_ms)),
        "plain_tokens_per_s": plain_tps,
        "spec_tokens_per_s": spec_tps,
        "speedup": achieved,
        "ideal_speedup": ideal,
        "fraction_of_ideal": achieved / ideal,
    }
