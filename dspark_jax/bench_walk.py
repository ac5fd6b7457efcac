"""``dspark-jax bench --walk``: the draft's Markov walk alone, per batch and sampling mode.

The walk (:func:`dspark_jax.proposal.walk_block`) is the γ dependent steps after the
lm_head: each step adds its Markov bias to the base logits, picks the step's tokens (greedy
argmax or the exponential race) and keeps the corrected logits. It is where mixed and
sampling rounds differ from greedy ones, so timing it alone separates the sampler's cost
from the round's noise (README note 47 measured the race this way).

Paths, each its own compiled program over the same inputs:

* ``greedy_only``: ``fold_sampling=False`` (every row takes the argmax; the program a
  greedy-only bucket runs);
* ``folded``: the folded sampler as the round runs it here (on GPUs the tiled race kernels,
  :mod:`dspark_jax.tile_race_kernel`);
* ``folded_race``: the folded sampler with :data:`~dspark_jax.tile_race_kernel.TILE_RACE_ENV`
  set to ``xla`` (the race kernel per step, :mod:`dspark_jax.race_kernel`), timed only where
  ``folded`` uses the tiled kernels and the race kernel applies;
* ``folded_xla``: the folded sampler with both variables set to ``xla`` (the XLA sampler),
  timed only where ``folded`` uses a kernel;
* ``folded_p{P}w{W}k{K}``: the race kernel with another
  :class:`~dspark_jax.race_kernel.RaceTuning` (``--race-tunings P:W:K,…``), where it
  applies: the layouts to try, side by side in one process.

Each row gives the median of calls waited for, the per-call time of calls dispatched back
to back (``pipelined``) and that per step (``step_us``), and whether its tokens equal the
reference path's for the same inputs and key (``greedy_only`` for greedy batches, else
``folded``). With ``--profile`` each row also records its device time per kernel, and the
table gives the device time per walk (README note 75 took the walk's mode difference apart
this way).

Shape legend: B batch, γ draft slots, V vocabulary, H hidden.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.bench_timing import environment, profile_call, time_calls
from dspark_jax.bench_workload import sampling_params
from dspark_jax.draft import DSparkDraft
from dspark_jax.proposal import returned_corrected, walk_block
from dspark_jax.race_kernel import RACE_ENV, RaceTuning, use_race_kernel
from dspark_jax.tile_race_kernel import TILE_RACE_ENV, use_tile_race_kernel

WALK_PATHS = ("greedy_only", "folded", "folded_race", "folded_xla")


def _walk(graphdef, state, base, hidden, bonus, temperatures, top_k, key, *, fold_sampling, tuning):
    """:func:`walk_block` over the split Markov head; returns ``(tokens [B, γ], corrected)``.

    ``corrected`` is what the round returns (:func:`~dspark_jax.proposal.returned_corrected`):
    ``[B, γ, 0]`` without folding, so the greedy-only program never forms the corrected logits
    (timing them would charge it for work its round does not do).
    """
    head = nnx.merge(graphdef, state)
    tokens, corrected, _, _ = walk_block(
        head, base, hidden, bonus, temperatures, top_k, key, fold_sampling=fold_sampling, race_tuning=tuning
    )
    return tokens, returned_corrected(corrected, fold_sampling)


def walk_inputs(draft: DSparkDraft, batch: int, seed: int = 0) -> dict[str, jax.Array]:
    """Random walk inputs at the draft's shapes: base logits ``[B, γ, V]`` (normal, σ = 2) and
    slot hidden states ``[B, γ, H]`` (normal) in the model dtype, anchors ``[B]``, a key."""
    cfg = draft.cfg
    gamma, dtype = cfg.block_size, cfg.jnp_dtype
    k_base, k_hidden, k_bonus, key = jax.random.split(jax.random.key(seed), 4)
    return {
        "base": (2.0 * jax.random.normal(k_base, (batch, gamma, cfg.vocab_size), jnp.float32)).astype(dtype),
        "hidden": jax.random.normal(k_hidden, (batch, gamma, cfg.hidden_size), jnp.float32).astype(dtype),
        "bonus": jax.random.randint(k_bonus, (batch,), 0, cfg.vocab_size, jnp.int32),
        "key": key,
    }


def bench_walk(
    draft: DSparkDraft,
    *,
    batches: tuple[int, ...],
    modes: tuple[str, ...],
    iters: int,
    tunings: tuple[RaceTuning, ...] = (),
    profile: bool = False,
) -> list[dict[str, Any]]:
    """Times the walk's paths for every batch and mode (interleaved per batch, :func:`time_calls`).

    Args:
      draft: a draft with a Markov head.
      batches: batch sizes.
      modes: subset of :data:`dspark_jax.bench.MODES`.
      iters: timed calls per loop of :func:`~dspark_jax.bench.time_call`.
      tunings: race-kernel layouts timed besides the default, where the kernel applies.
      profile: also record each path's device time per kernel
        (:func:`~dspark_jax.bench.profile_call`) as the row's ``profile``.

    Returns:
      One dict per (batch, mode, path): ``batch``, ``mode``, ``path``, ``kernel`` (the
      folded walk's kernel that ran: ``tiles``, ``race`` or None), ``tuning`` (the race
      kernel's layout label, None for the default or XLA),
      :func:`~dspark_jax.bench.time_call`'s statistics, ``step_us``,
      ``tokens_reference``, ``tokens_differ``, ``tokens_compared``, and with ``profile`` the
      ``profile`` dict.

    Raises:
      ValueError: the draft has no Markov head.
    """
    if draft.markov_head is None:
        raise ValueError("bench_walk needs a draft with a Markov head: markov_head is None")
    gamma = draft.cfg.block_size
    head = draft.markov_head
    race = use_race_kernel(draft.cfg.vocab_size)[0]
    no_tiles = {TILE_RACE_ENV: "xla"}
    graphdef, state = nnx.split(draft.markov_head)
    rows = []
    for batch in batches:
        tiles = use_tile_race_kernel(head.rank, head.dtype, draft.cfg.vocab_size, batch)[0]
        inputs = walk_inputs(draft, batch)
        calls, results, meta = {}, {}, {}
        for mode in modes:
            temperatures, top_k = sampling_params(batch, mode)
            args = (state, inputs["base"], inputs["hidden"], inputs["bonus"], temperatures, top_k, inputs["key"])
            # (path, fold_sampling, environment, race tuning, the kernel it runs)
            paths = [("folded", True, {}, None, "tiles" if tiles else "race" if race else None)]
            if mode == "greedy":
                paths.insert(0, ("greedy_only", False, {}, None, None))
            if tiles and race:
                paths.append(("folded_race", True, no_tiles, None, "race"))
            if tiles or race:
                paths.append(("folded_xla", True, {TILE_RACE_ENV: "xla", RACE_ENV: "xla"}, None, None))
            if race:
                paths += [(f"folded_{t.label}", True, no_tiles, t, "race") for t in tunings]
            for path, fold_sampling, env, tuning, ran in paths:
                fn = jax.jit(functools.partial(_walk, graphdef, fold_sampling=fold_sampling, tuning=tuning))
                with environment(env):  # read while tracing: compile now, inside the block
                    compiled = fn.lower(*args).compile()
                calls[(mode, path)] = functools.partial(compiled, *args)
                results[(mode, path)] = np.asarray(calls[(mode, path)]()[0])
                meta[(mode, path)] = (ran, tuning and tuning.label)
        timed = time_calls(calls, iters=iters)
        for (mode, path), stats in timed.items():
            reference = "greedy_only" if mode == "greedy" else "folded"
            tokens, ref_tokens = results[(mode, path)], results[(mode, reference)]
            extra = {"profile": profile_call(calls[(mode, path)], iters)} if profile else {}
            rows.append(
                {
                    "batch": batch,
                    "mode": mode,
                    "path": path,
                    "kernel": meta[(mode, path)][0],
                    "tuning": meta[(mode, path)][1],
                    **stats,
                    "step_us": 1e3 * stats["pipelined_ms"] / gamma,
                    "tokens_reference": reference,
                    "tokens_differ": int((tokens != ref_tokens).sum()),
                    "tokens_compared": int(tokens.size),
                    **extra,
                }
            )
    return rows


def format_walk(rows: list[dict[str, Any]]) -> list[str]:
    """Table lines for :func:`bench_walk`'s rows (empty when there are none)."""
    if not rows:
        return []
    greedy_step = {r["batch"]: r["step_us"] for r in rows if r["path"] == "greedy_only"}
    busy = any("profile" in r for r in rows)
    lines = [
        "Markov walk alone (the γ steps after the lm_head), ms; step = pipelined per step, µs; "
        "vs greedy = step time over the greedy-only program's at the same batch"
        + ("; busy = device time per walk from a profile, µs (0 where the backend records none)" if busy else ""),
        f"{'batch':>5} {'mode':<8} {'path':<16} {'median':>8} {'pipelined':>9} {'step':>7} {'vs greedy':>9}"
        + (f" {'busy':>7}" if busy else "")
        + "  tokens",
    ]
    for r in rows:
        base = greedy_step.get(r["batch"])
        ratio = f"{r['step_us'] / base:9.3f}" if base else f"{'-':>9}"
        same = "same" if r["tokens_differ"] == 0 else f"{r['tokens_differ']}/{r['tokens_compared']} differ"
        device = r.get("profile", {}).get("device_busy_ms")
        column = (f" {1e3 * device:7.1f}" if device is not None else f" {'-':>7}") if busy else ""
        lines.append(
            f"{r['batch']:>5} {r['mode']:<8} {r['path']:<16} {r['median_ms']:8.3f} {r['pipelined_ms']:9.3f} "
            f"{r['step_us']:7.1f} {ratio}{column}  {same} (vs {r['tokens_reference']})"
        )
    return lines
