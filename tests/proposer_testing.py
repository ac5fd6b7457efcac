"""Shared helpers for the Proposer tests: a small cache, random calls, the FORCE proposer.

The precompiled FORCE proposer is built once per session (``forced_proposer`` in
``conftest.py``) and saves its programs in an executable store, so the store's tests load
them back instead of compiling the same programs again.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from draft_testing import random_draft, tiny_config

from dspark_jax.cache import fill_context, init_context_cache
from dspark_jax.proposer import Proposer
from dspark_jax.sampling import TOP_K_ALL

SLOTS, CAPACITY, N_CTX = 5, 12, 6
CFG = dict(num_hidden_layers=2)  # two backbone pieces per round (SplitRound)


def make_cache(draft, seed=0):
    cfg = draft.cfg
    rng = np.random.default_rng(seed)
    features = rng.standard_normal((SLOTS, N_CTX, cfg.num_fused_layers * cfg.hidden_size)).astype(np.float32)
    cache = init_context_cache(cfg, SLOTS, CAPACITY)
    return fill_context(draft, cache, jnp.asarray(features), jnp.zeros(SLOTS, jnp.int32), jnp.full(SLOTS, N_CTX))


def forced_proposer(draft, store, **kwargs):
    """A FORCE proposer (buckets 1, 2, 4) over a 5-slot cache, with twin programs (the GPU
    default) on the CPU, keeping its programs in ``store``; not yet compiled."""
    kwargs = {**dict(max_batch=4, capacity=CAPACITY, num_slots=SLOTS, folded_sampling="force"), **kwargs}
    return Proposer(draft, twin_programs=True, executable_store=store, **kwargs)


def build_forced(store):
    """``(draft, proposer, cache)``: the draft, its precompiled FORCE proposer and a cache."""
    draft = random_draft(tiny_config(**CFG), seed=0)
    proposer = forced_proposer(draft, store)
    proposer.precompile(workers=2)  # also exercises the concurrent compile path
    return draft, proposer, make_cache(draft)


def random_call(rng, vocab, rows):
    """Inputs of one call with ``rows`` requests in random slots, mixed greedy/sampling rows."""
    temps = rng.choice([0.0, 0.7, 1.3], size=rows).astype(np.float32)
    top_k = rng.choice([1, 20, TOP_K_ALL], size=rows)
    return dict(
        bonus=rng.integers(0, vocab, rows),
        prefix_lens=rng.integers(0, N_CTX + 1, rows),
        temperatures=temps,
        top_k=top_k,
        slots=rng.permutation(SLOTS)[:rows],
    )
