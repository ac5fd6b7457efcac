"""The greedy walk kernels (Pallas interpreter on the CPU, compiled on GPUs) pick the argmax the XLA walk picks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import tiny_round
from flax import nnx

from dspark_jax import bench_workload, propose
from dspark_jax.greedy_kernel import (
    GREEDY_AUTO_MAX_BATCH,
    GREEDY_ENV,
    GreedyTuning,
    greedy_choice,
    greedy_markov_walk,
    greedy_supported,
    greedy_tiles,
    padded_rows,
    pick_tiles,
    use_greedy_kernel,
)
from dspark_jax.markov import markov_walk
from dspark_jax.presets import load_preset
from dspark_jax.sampling import greedy_step

INTERPRET = jax.default_backend() != "gpu"  # on GPUs the compiled kernels


def _exact_inputs(batch, gamma, vocab, rank, seed):
    """Latents and tables of small multiples of 1/8 (every product and sum exact in float32, so
    the bias does not depend on the summation order) and bf16 base logits with planted ties
    and NaNs."""
    rng = np.random.default_rng(seed)
    z = rng.integers(-3, 4, (batch, rank)) / 8
    w1 = rng.integers(-3, 4, (vocab, rank)) / 8
    w2 = rng.integers(-3, 4, (vocab, rank)) / 8
    base = rng.integers(-64, 64, (batch, gamma, vocab)) / 4
    w2[vocab - 2] = w2[5]
    base[0, :, [5, vocab - 2]] = 40.0  # a tie across tiles (same bias): the lowest id wins
    base[min(1, batch - 1), 0, :] = np.nan  # a NaN row: every logit -inf, token 0
    base[-1, -1, 7] = np.nan  # one NaN counts as -inf
    return tuple(jnp.asarray(x.astype(jnp.bfloat16)) for x in (z, w1, w2, base))


def _np_argmax(base_k, bias):
    """NumPy reference: argmax of ``base + bias`` in float64 (NaN as -inf, lowest id on ties),
    the bias rounded to bf16 as the head's GEMM output is."""
    bias = bias.astype(jnp.bfloat16).astype(np.float64)
    x = np.asarray(base_k, np.float64) + bias
    x[np.isnan(x)] = -np.inf
    return np.argmax(x, axis=-1)


# V a multiple of the tile and not; B padded to 16, 32 and to two row blocks of 128
@pytest.mark.parametrize("batch, vocab, tile", [(1, 256, 64), (3, 300, 128), (20, 200, 64), (130, 160, 64)])
def test_tiles_then_pick_give_the_numpy_argmax_and_the_next_rows(batch, vocab, tile):
    rank, gamma = 32, 2
    z, w1, w2, base = _exact_inputs(batch, gamma, vocab, rank, seed=vocab + batch)
    zp = jnp.zeros((padded_rows(batch), rank), z.dtype).at[:batch].set(z)
    tuning = GreedyTuning(tile=tile, chunk=16)
    bias = np.asarray(z, np.float64) @ np.asarray(w2, np.float64).T  # [B, V], exact
    for step in range(gamma):
        top, idx = greedy_tiles(zp, w2, base, step, batch=batch, interpret=INTERPRET, tuning=tuning)
        assert top.shape == idx.shape == (padded_rows(batch), -(-vocab // tile))
        tokens, e = pick_tiles(top, idx, w1, batch=batch, interpret=INTERPRET)
        want = _np_argmax(np.asarray(base[:, step]).astype(np.float64), bias)
        np.testing.assert_array_equal(np.asarray(tokens[:batch]), want)
        np.testing.assert_array_equal(np.asarray(e[:batch]), np.asarray(w1)[want])
        assert not np.asarray(e[batch:]).any()  # padding rows: zero latents
        if step == 0:
            assert want[min(1, batch - 1)] == 0  # the NaN row
        # odd steps read the tiles in reverse program order; each tile's outputs keep their
        # places; the base logits loaded before the loop over the rank or after it, the same
        for change in ({"alternate": False}, {"prefetch": True}, {"prefetch": False}):
            plain = dataclasses.replace(tuning, **change)
            other = greedy_tiles(zp, w2, base, step, batch=batch, interpret=INTERPRET, tuning=plain)
            for got, ref in zip((top, idx), other, strict=True):
                np.testing.assert_array_equal(np.asarray(got)[:batch], np.asarray(ref)[:batch])
    assert want[0] == 5  # the tie


def _tiny_head(head_type):
    """The bf16 tiny preset's head with exact tables (small multiples of 1/8)."""
    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16", markov_head_type=head_type)
    graphdef, state = bench_workload.build_draft(cfg)
    head = nnx.merge(graphdef, state).markov_head
    rng = np.random.default_rng(1)
    for name in ("markov_w1", "markov_w2"):
        table = getattr(head, name)
        table[...] = jnp.asarray(rng.integers(-3, 4, table[...].shape) / 8, jnp.bfloat16)
    return cfg, head


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_greedy_walk_equals_the_xla_walk(head_type):
    """Tokens equal the XLA walk's (``markov_walk`` + ``greedy_step``) for every head; where the
    two biases' summation orders could part (gated and RNN latents are not exact), a differing
    token must be a near-tie of the XLA walk's own logits (within a bf16 unit of the bias)."""
    cfg, head = _tiny_head(head_type)
    batch, gamma, vocab = 5, cfg.gamma, cfg.vocab_size
    k = jax.random.split(jax.random.key(3), 3)
    base = (3 * jax.random.normal(k[0], (batch, gamma, vocab))).astype(jnp.bfloat16)
    hidden = jax.random.normal(k[1], (batch, gamma, cfg.hidden_size)).astype(jnp.bfloat16)
    bonus = jax.random.randint(k[2], (batch,), 0, vocab)
    want, corrected = markov_walk(head, base, hidden, bonus, lambda _, x: greedy_step(x), keep_dtype=jnp.float32)
    got = greedy_markov_walk(head, base, hidden, bonus, interpret=INTERPRET)
    assert got.shape == (batch, gamma) and got.dtype == jnp.int32
    got, want, corrected = np.asarray(got), np.asarray(want), np.asarray(corrected)
    if head_type == "vanilla":  # exact latents and tables: the same bias in any order
        np.testing.assert_array_equal(got, want)
        return
    first = np.argmax(got != want, axis=1) if (got != want).any() else None
    if first is None:
        return
    for b in np.nonzero((got != want).any(axis=1))[0]:  # up to the first difference, then the paths part
        s = first[b]
        x = corrected[b, s]
        assert x[got[b, s]] >= x[want[b, s]] - 2.0**-6 * max(1.0, abs(x[want[b, s]]))


def test_propose_greedy_only_takes_the_kernels_and_keeps_its_tokens(monkeypatch):
    """``propose(fold_sampling=False)`` under ``pallas`` runs two greedy kernels per step and no
    bias GEMM, and drafts the tokens it drafts under ``xla``."""
    cfg, graphdef, args = tiny_round("greedy")
    blocks, names = {}, {}
    for choice in ("xla", "pallas"):
        monkeypatch.setenv(GREEDY_ENV, choice)
        fn = lambda *a: propose(graphdef, *a, fold_sampling=False)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        names[choice] = (jaxpr.count("name=greedy_tiles"), jaxpr.count("name=pick_tiles"))  # calls per round
        blocks[choice] = jax.jit(fn)(*args)
    assert names == {"xla": (0, 0), "pallas": (cfg.gamma, cfg.gamma)}
    np.testing.assert_array_equal(np.asarray(blocks["pallas"].draft_tokens), np.asarray(blocks["xla"].draft_tokens))
    assert blocks["pallas"].corrected_logits.shape == (4, cfg.gamma, 0)
    np.testing.assert_array_equal(np.asarray(blocks["pallas"].confidence), np.asarray(blocks["xla"].confidence))


def test_choice_support_tuning_and_bad_inputs(monkeypatch):
    monkeypatch.delenv(GREEDY_ENV, raising=False)
    assert greedy_choice() == "auto"
    on_gpu = jax.default_backend() == "gpu"
    assert use_greedy_kernel(256, jnp.bfloat16, GREEDY_AUTO_MAX_BATCH) == (on_gpu, False)
    assert use_greedy_kernel(256, jnp.bfloat16, GREEDY_AUTO_MAX_BATCH + 1) == (False, False)  # XLA was faster
    monkeypatch.setenv(GREEDY_ENV, " Pallas ")
    assert use_greedy_kernel(256, jnp.bfloat16, 128) == (True, INTERPRET)  # forced at any batch
    assert use_greedy_kernel(256, jnp.float32, 8) == (False, False)  # TF32 products: not XLA's GEMM
    assert use_greedy_kernel(24, jnp.bfloat16, 8) == (False, False)
    monkeypatch.setenv(GREEDY_ENV, "xla")
    assert use_greedy_kernel(256, jnp.bfloat16, 8) == (False, False)
    monkeypatch.setenv(GREEDY_ENV, "cuda")
    with pytest.raises(ValueError, match="DSPARK_JAX_GREEDY='cuda' is invalid"):
        greedy_choice()
    assert greedy_supported(16, jnp.float16) and not greedy_supported(8, jnp.bfloat16)
    assert [padded_rows(b) for b in (1, 16, 17, 128, 130)] == [16, 16, 32, 128, 256]

    for field, value in (("tile", 48), ("chunk", 8), ("warps", 3), ("stages", 0), ("tile", True)):
        with pytest.raises(ValueError, match=f"{field}="):
            GreedyTuning(**{field: value})
    with pytest.raises(TypeError, match="alternate='yes'"):
        GreedyTuning(alternate="yes")
    assert GreedyTuning().warps_for(16) == 4 and GreedyTuning().warps_for(128) == 8
    assert GreedyTuning(warps=2).warps_for(128) == 2
    assert GreedyTuning().prefetch_for(16) and not GreedyTuning().prefetch_for(32)  # README note 87
    assert GreedyTuning(prefetch=True).prefetch_for(128) and not GreedyTuning(prefetch=False).prefetch_for(16)
    for bad in ("yes", 1, 0.0):  # flags are bools, as alternate is: 1 and 0.0 are not read as True / False
        with pytest.raises(TypeError, match=f"prefetch={bad!r} is invalid: must be True, False or None"):
            GreedyTuning(prefetch=bad)
    with pytest.raises(TypeError, match="alternate=1 is invalid"):
        GreedyTuning(alternate=1)
    assert GreedyTuning(warps=np.int64(8), tile=np.int64(64)) == GreedyTuning(warps=8, tile=64)

    z, w1, w2, base = _exact_inputs(2, 1, 64, 16, seed=0)
    zp = jnp.zeros((16, 16), z.dtype).at[:2].set(z)
    with pytest.raises(ValueError, match=r"base has shape \(2, 1, 64\)"):
        greedy_tiles(zp, w2, base, 0, batch=3, interpret=True)
    with pytest.raises(ValueError, match=r"z has shape \(2, 16\)"):
        greedy_tiles(z, w2, base, 0, batch=2, interpret=True)
    with pytest.raises(ValueError, match="rank=16 and dtype=float32 are not supported"):
        greedy_tiles(zp.astype(jnp.float32), w2.astype(jnp.float32), base, 0, batch=2, interpret=True)
    with pytest.raises(TypeError, match="tuning="):
        greedy_tiles(zp, w2, base, 0, batch=2, interpret=True, tuning="fast")


def test_the_kernel_rounds_the_bias_to_the_tables_dtype_as_the_xla_walk_does():
    """Token 200's float32 bias is 1 + 2⁻¹⁰, token 3's is 1: in bf16 both round to 1, a tie
    the lower id wins (as in the XLA walk, whose head GEMM outputs bf16); a kernel that kept
    the float32 sum would pick 200 (the exact inputs of the test above never parted there)."""
    rank, vocab, low, high = 32, 256, 3, 200
    z = np.zeros((1, rank))
    z[0, :2] = [1.0, 2.0**-10]
    w2 = np.zeros((vocab, rank))
    w2[low, 0] = 1.0
    w2[high, :2] = [1.0, 1.0]
    base = np.full((1, 1, vocab), -8.0)
    base[0, 0, [low, high]] = 0.0
    z, w2, base = (jnp.asarray(x, jnp.bfloat16) for x in (z, w2, base))
    assert float(z[0, 1]) == 2.0**-10  # exact in bf16
    zp = jnp.zeros((padded_rows(1), rank), z.dtype).at[:1].set(z)
    top, idx = greedy_tiles(zp, w2, base, 0, batch=1, interpret=INTERPRET, tuning=GreedyTuning(tile=64, chunk=16))
    tokens, _ = pick_tiles(top, idx, w2, batch=1, interpret=INTERPRET)
    assert int(tokens[0]) == low
    assert (
        int(_np_argmax(np.asarray(base[:, 0], np.float64), np.asarray(z, np.float64) @ np.asarray(w2, np.float64).T)[0])
        == low
    )
