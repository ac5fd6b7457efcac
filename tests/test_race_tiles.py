"""The tiled race kernels (Pallas interpreter on the CPU, compiled on GPUs) pick what the XLA sampler picks."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from test_greedy_kernel import _exact_inputs, _tiny_head

from dspark_jax import bench, propose
from dspark_jax import sampling as S
from dspark_jax.greedy_kernel import padded_rows
from dspark_jax.markov import markov_walk
from dspark_jax.presets import load_preset
from dspark_jax.proposal import _pick, walk_block
from dspark_jax.race_kernel import RACE_ENV, RaceTuning, step_key_words
from dspark_jax.race_tiles import pick_raced, race_tiles, race_tiles_supported, tiled_race_walk

INTERPRET = jax.default_backend() != "gpu"  # on GPUs the compiled kernels


def _rows(batch, seed):
    """Temperatures (row 0 clamped to 1e-5), a mix of greedy and sampling rows, per-row keys."""
    temps = S.clamp_temperatures(jnp.linspace(0.0, 2.0, batch))
    greedy = jnp.arange(batch) % 3 == 1
    return temps, greedy, S.row_keys(jax.random.key(seed), batch)


# one block of 64 (a power of two below W) and of W; V = 2W + 44 (the last block short, the
# table's tail masked); B padded to 16, to 32 and to two row blocks of 128
@pytest.mark.parametrize("batch, vocab", [(2, 64), (3, 128), (20, 300), (130, 160)])
def test_tiles_then_pick_equal_sample_step(batch, vocab):
    """Step after step: tokens equal ``sample_step`` on the exact sum (greedy rows its float32
    argmax, sampling rows the race on the kept logits), the corrected slot is the sum rounded
    to bf16 and the other slots stay as written, ``e`` is the tokens' ``markov_w1`` rows."""
    rank, gamma = 32, 3
    z, w1, w2, base = _exact_inputs(batch, gamma, vocab, rank, seed=vocab + batch)
    base = base.at[-1, 1, :].set(-jnp.inf)  # an all -inf row: token 0
    zp = jnp.zeros((padded_rows(batch), rank), z.dtype).at[:batch].set(z)
    temps, greedy, keys = _rows(batch, seed=vocab)
    words = step_key_words(keys, gamma)
    bias = (np.asarray(z, np.float64) @ np.asarray(w2, np.float64).T).astype(np.float32)  # exact
    corrected, slots = None, []
    for step in range(gamma):
        score, token, corrected = race_tiles(
            zp, w2, base, corrected, temps, greedy, words, step, batch=batch, interpret=INTERPRET
        )
        assert score.shape == token.shape == (padded_rows(batch), -(-vocab // S.race_width(vocab)))
        tokens, e, corrected = pick_raced(
            score, token, w1, corrected, temps, greedy, words, step, batch=batch, interpret=INTERPRET
        )
        logits = base[:, step].astype(jnp.float32) + jnp.asarray(bias).astype(jnp.bfloat16).astype(jnp.float32)
        want = S.sample_step(logits, temps, greedy, S.step_keys(keys, step), race_dtype=base.dtype)
        np.testing.assert_array_equal(np.asarray(tokens[:batch]), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(e[:batch]), np.asarray(w1)[np.asarray(want)])
        assert not np.asarray(e[batch:]).any()  # padding rows: zero latents
        slots.append(np.asarray(logits.astype(base.dtype), np.float32))
        assert corrected.dtype == base.dtype
        np.testing.assert_array_equal(np.asarray(corrected[:, : step + 1], np.float32), np.stack(slots, axis=1))
        if step < 2:  # step 0: row 1 all NaN (row 0 when B = 1); step 1: the last row all -inf
            assert int(want[min(1, batch - 1) if step == 0 else -1]) == 0


def test_ties_nan_and_all_minus_inf_rows():
    """As the race kernel's: greedy ties across blocks go to the lowest id, NaN counts as -inf,
    an all -inf row yields token 0, +inf sampled tokens tie and the lowest wins."""
    vocab, batch, rank = 300, 6, 16  # blocks [0, 128), [128, 256), [256, 300)
    base = jnp.zeros((batch, 1, vocab), jnp.bfloat16)
    base = base.at[0, 0, [130, 260, 299]].set(5.0)
    base = base.at[1, 0, :].set(-jnp.inf)
    base = base.at[2, 0, :].set(jnp.nan).at[2, 0, 200].set(1.0)
    base = base.at[3, 0, :].set(-jnp.inf)  # sampling row, all -inf
    base = base.at[4, 0, :].set(jnp.nan).at[4, 0, [290, 150]].set(jnp.inf)  # sampling: +inf in blocks 1, 2
    base = base.at[5, 0, :].set(-jnp.inf).at[5, 0, 255].set(0.0)  # sampling: block 1's last token only
    z = jnp.zeros((16, rank), jnp.bfloat16)  # no bias
    w = jnp.ones((vocab, rank), jnp.bfloat16)
    greedy = jnp.array([True, True, True, False, False, False])
    words = S._key_words(S.row_keys(jax.random.key(0), batch))[:, None]  # [B, 1, 2]
    temps = jnp.ones((batch,), jnp.float32)
    score, token, corrected = race_tiles(z, w, base, None, temps, greedy, words, 0, batch=batch, interpret=INTERPRET)
    tokens, _, _ = pick_raced(score, token, w, corrected, temps, greedy, words, 0, batch=batch, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(tokens[:batch]), [130, 0, 200, 0, 150, 255])


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_tiled_walk_equals_the_xla_walk(head_type):
    """The whole walk against the XLA walk (``markov_walk`` + ``sample_step``), mixed rows.
    Vanilla (exact tables and latents): the same tokens and corrected logits. Gated and RNN
    (inexact latents: the biases' summation orders may part by a bf16 unit): corrected logits
    within a bf16 unit of the XLA walk's, and each sampling row's tokens the race on the
    returned (kept) logits."""
    cfg, head = _tiny_head(head_type)
    batch, gamma, vocab = 5, cfg.gamma, cfg.vocab_size
    k = jax.random.split(jax.random.key(3), 3)
    base = (3 * jax.random.normal(k[0], (batch, gamma, vocab))).astype(jnp.bfloat16)
    hidden = jax.random.normal(k[1], (batch, gamma, cfg.hidden_size)).astype(jnp.bfloat16)
    bonus = jax.random.randint(k[2], (batch,), 0, vocab)
    temps, greedy, keys = _rows(batch, seed=4)
    pick = functools.partial(_pick, temps=temps, greedy=greedy, keys=keys, fold_sampling=True, keep_dtype=base.dtype)
    want, want_corrected = markov_walk(head, base, hidden, bonus, pick, keep_dtype=base.dtype)
    got, corrected = tiled_race_walk(head, base, hidden, bonus, temps, greedy, keys, interpret=INTERPRET)
    assert got.shape == (batch, gamma) and got.dtype == jnp.int32 and corrected.dtype == base.dtype
    if head_type == "vanilla":
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        np.testing.assert_array_equal(np.asarray(corrected, np.float32), np.asarray(want_corrected, np.float32))
        return
    ref = np.asarray(want_corrected, np.float64)
    np.testing.assert_allclose(np.asarray(corrected, np.float64), ref, rtol=2.0**-7, atol=2.0**-7)
    sampling = ~np.asarray(greedy)
    for step in range(gamma):
        again = S.sample_step(corrected[:, step], temps, greedy, S.step_keys(keys, step), race_dtype=base.dtype)
        np.testing.assert_array_equal(np.asarray(again)[sampling], np.asarray(got)[sampling, step])


def test_propose_takes_the_tiled_kernels_unless_a_race_tuning_names_race_step(monkeypatch):
    """Under ``pallas`` the folded round runs two tiled kernels per step and no ``race_step``;
    ``walk_block`` with a :class:`RaceTuning` runs ``race_step`` and picks the same tokens."""
    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = bench.build_draft(cfg)
    cache = bench.random_context(cfg, 4, 48, jax.random.key(1))
    args = (state, cache, jnp.array([3, 7, 11, 0], jnp.int32), jnp.array([20, 0, 33, 41], jnp.int32))
    args += (*bench.sampling_params(4, "mixed"), jax.random.key(0))
    monkeypatch.setenv(RACE_ENV, "pallas")
    jaxpr = str(jax.make_jaxpr(lambda *a: propose(graphdef, *a))(*args))
    assert (jaxpr.count("name=race_tiles"), jaxpr.count("name=pick_raced"), jaxpr.count("name=race_step")) == (
        cfg.gamma,
        cfg.gamma,
        0,
    )
    head = nnx.merge(graphdef, state).markov_head
    base = (3 * jax.random.normal(jax.random.key(5), (4, cfg.gamma, cfg.vocab_size))).astype(jnp.bfloat16)
    hidden = jnp.zeros((4, cfg.gamma, cfg.hidden_size), jnp.bfloat16)
    bonus, _, temps, top_k, key = args[2:]

    def walk(base, tuning):
        return walk_block(head, base, hidden, bonus, temps, top_k, key, race_tuning=tuning)

    tiled, named = walk(base, None), walk(base, RaceTuning())
    np.testing.assert_array_equal(np.asarray(tiled[0]), np.asarray(named[0]))
    np.testing.assert_array_equal(np.asarray(tiled[1], np.float32), np.asarray(named[1], np.float32))
    named_jaxpr = str(jax.make_jaxpr(lambda b: walk(b, RaceTuning()))(base))
    assert named_jaxpr.count("name=race_step") == cfg.gamma and "name=race_tiles" not in named_jaxpr


def test_support_and_bad_inputs():
    assert race_tiles_supported(256, jnp.bfloat16, 151936) and race_tiles_supported(16, jnp.float16, 64)
    assert not race_tiles_supported(256, jnp.float32, 151936)  # TF32 products: not XLA's GEMM
    assert not race_tiles_supported(24, jnp.bfloat16, 151936)
    assert not race_tiles_supported(256, jnp.bfloat16, 100)  # the race kernel's vocabularies
    z, w1, w2, base = _exact_inputs(2, 2, 128, 16, seed=0)
    zp = jnp.zeros((16, 16), z.dtype).at[:2].set(z)
    temps, greedy, keys = _rows(2, seed=0)
    words = step_key_words(keys, 2)
    rows = (temps, greedy, words, 0)
    with pytest.raises(ValueError, match=r"base has shape \(2, 2, 128\): must be \[B, γ, V\] with B=3"):
        race_tiles(zp, w2, base, None, *rows, batch=3, interpret=True)
    with pytest.raises(ValueError, match=r"z has shape \(2, 16\)"):
        race_tiles(z, w2, base, None, *rows, batch=2, interpret=True)
    with pytest.raises(ValueError, match="rank=16, dtype=float32 and vocab=128 are not supported"):
        race_tiles(zp.astype(jnp.float32), w2.astype(jnp.float32), base, None, *rows, batch=2, interpret=True)
    with pytest.raises(ValueError, match=r"key_words has shape \(2, 2\): must be \(B, γ, 2\) = \(2, 2, 2\)"):
        race_tiles(zp, w2, base, None, temps, greedy, words[:, 0], 0, batch=2, interpret=True)
    with pytest.raises(ValueError, match=r"corrected has shape \(2, 2, 128\) and dtype float32: must be base's"):
        race_tiles(zp, w2, base, base.astype(jnp.float32), *rows, batch=2, interpret=True)
