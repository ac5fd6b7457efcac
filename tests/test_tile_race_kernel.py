"""The tiled race kernels (Pallas interpreter on the CPU, compiled on GPUs) pick what the XLA sampler picks."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import edge_race_rows, planted_race_rows, tiny_round
from test_greedy_kernel import _exact_inputs, _tiny_head

from dspark_jax import propose
from dspark_jax import sampling as S
from dspark_jax.greedy_kernel import padded_rows
from dspark_jax.markov import markov_walk
from dspark_jax.race_kernel import RACE_ENV
from dspark_jax.tile_race_kernel import (
    TILE_RACE_AUTO_BATCHES,
    TILE_RACE_ENV,
    TILE_RACE_PROGRAMS,
    TileRaceTuning,
    padded_walk_inputs,
    pick_raced_tiles,
    race_tiles,
    tile_race_choice,
    tile_race_supported,
    tile_race_tuning,
    tiled_race_walk,
    use_tile_race_kernel,
)

INTERPRET = jax.default_backend() != "gpu"  # on GPUs the compiled kernels
_sample_step = jax.jit(S.sample_step, static_argnames="race_dtype")


def _rows(batch, seed):
    """Temperatures (one clamped to 1e-5) and greedy rows (every third), clamped as the walk takes them."""
    rng = np.random.default_rng(seed)
    temps = rng.uniform(0.3, 2.0, batch).astype(np.float32)
    temps[-1] = 0.0
    return S.clamp_temperatures(jnp.asarray(temps)), jnp.arange(batch) % 3 == 1


# one block of 64 tokens (V < W); the last block short, B padded to 32; three row blocks of 16;
# persistent programs: two over three blocks (the short one included), one over both blocks,
# one over batch 1's one block, two over batch 1's three blocks (its one row finished alone),
# as many as the blocks (one each, in reverse order on odd steps)
@pytest.mark.parametrize(
    "batch, vocab, max_rows, programs",
    [
        (1, 64, 64, 0),
        (20, 300, 64, 0),
        (40, 130, 16, 0),
        (20, 300, 64, 2),
        (40, 130, 16, 1),
        (1, 64, 64, 4),
        (1, 300, 16, 2),
        (3, 300, 16, 5),
    ],
)
def test_tiles_then_pick_give_the_xla_samplers_tokens_and_corrected_logits(batch, vocab, max_rows, programs):
    rank, gamma = 32, 2
    z, w1, w2, base = _exact_inputs(batch, gamma, vocab, rank, seed=vocab + batch)
    base = jnp.where(jnp.isnan(base), base, base * 0.25)  # keep the race away from certainty
    zp = jnp.zeros((padded_rows(batch), rank), z.dtype).at[:batch].set(z)
    temps, greedy = _rows(batch, seed=batch)
    keys = S.row_keys(jax.random.key(vocab), batch)
    t, g, words = padded_walk_inputs(temps, greedy, keys, gamma)
    tuning = TileRaceTuning(max_rows=max_rows, chunk=16, programs=programs)
    bias = (np.asarray(z, np.float64) @ np.asarray(w2, np.float64).T).astype(jnp.bfloat16)  # exact, then rounded
    corrected = None
    for step in range(gamma):
        score, token, corrected = race_tiles(
            zp, w2, base, corrected, t, g, words, step, batch=batch, interpret=INTERPRET, tuning=tuning
        )
        blocks = -(-vocab // S.race_width(vocab))
        columns = min(programs, blocks) if programs else blocks
        assert score.shape == token.shape == (padded_rows(batch), columns)
        if batch == 1:  # the one row finished alone: the padding rows' outputs written, not left as they were
            assert np.all(np.asarray(score)[1:] == -np.inf) and not np.asarray(token)[1:].any()
        tokens, e = pick_raced_tiles(score, token, corrected, w1, t, g, words, step, batch=batch, interpret=INTERPRET)
        logits = base[:, step].astype(jnp.float32) + jnp.asarray(bias, jnp.float32)
        want = _sample_step(logits, temps, greedy, S.step_keys(keys, step), race_dtype=base.dtype)
        np.testing.assert_array_equal(np.asarray(tokens[:batch]), np.asarray(want))
        # in float32: NaN positions compare equal whatever the NaN's bits
        want_kept = logits.astype(base.dtype).astype(jnp.float32)
        np.testing.assert_array_equal(np.asarray(corrected[:, step], np.float32), np.asarray(want_kept))
        np.testing.assert_array_equal(np.asarray(e[:batch]), np.asarray(w1)[np.asarray(want)])
        assert not np.asarray(e[batch:]).any()  # padding rows: zero latents

        # odd steps read the blocks in reverse program order; each block's outputs keep their
        # places; a persistent program's column is its rows' best over the blocks it took
        plain = dataclasses.replace(tuning, programs=0, alternate=False)
        per_block = race_tiles(
            zp, w2, base, corrected, t, g, words, step, batch=batch, interpret=INTERPRET, tuning=plain
        )  # fmt: skip
        per_block = [np.asarray(x, np.float32)[:batch] for x in per_block]
        np.testing.assert_array_equal(per_block[2], np.asarray(corrected, np.float32))
        sampling = ~np.asarray(greedy)
        np.testing.assert_array_equal(
            per_block[1][sampling], np.broadcast_to(np.arange(blocks), per_block[1][sampling].shape)
        )
        persistent = programs > 0
        want_columns = _program_bests(*per_block[:2], columns, odd=step % 2 == 1) if persistent else per_block[:2]
        for got, ref in zip((score, token), want_columns, strict=True):
            np.testing.assert_array_equal(np.asarray(got, np.float32)[:batch], ref)


def _program_bests(score, key, programs, *, odd):
    """NumPy reference of the persistent programs' columns from each block's ``(score, key)``
    ``[B, NB]``: program ``p`` takes blocks ``p, p + P, …`` (on odd steps ``NB − 1 − p, …``)
    and keeps each row's highest score, on a tie its lowest key."""
    blocks = score.shape[1]
    best = np.full((score.shape[0], programs), -np.inf, np.float32), np.full((score.shape[0], programs), np.inf)
    for p in range(programs):
        mine = [blocks - 1 - j if odd else j for j in range(p, blocks, programs)]
        for row in range(score.shape[0]):
            pairs = sorted((-score[row, j], key[row, j]) for j in mine)  # highest score, then lowest key
            best[0][row, p], best[1][row, p] = -pairs[0][0], pairs[0][1]
    return best[0], best[1].astype(np.float32)


def test_ties_nan_and_all_minus_inf_rows():
    """The planted rows of :func:`draft_testing.planted_race_rows`, as the race kernel and XLA pick them."""
    base, greedy, want = planted_race_rows()
    batch, _, vocab = base.shape
    rank = 16
    zp = jnp.zeros((16, rank), jnp.bfloat16)  # no bias
    w = jnp.zeros((vocab, rank), jnp.bfloat16)
    t, g, words = padded_walk_inputs(jnp.ones(batch), greedy, S.row_keys(jax.random.key(0), batch), 1)
    base = base.astype(jnp.bfloat16)
    score, token, corrected = race_tiles(zp, w, base, None, t, g, words, 0, batch=batch, interpret=INTERPRET)
    tokens, _ = pick_raced_tiles(score, token, corrected, w, t, g, words, 0, batch=batch, interpret=INTERPRET)
    np.testing.assert_array_equal(np.asarray(tokens[:batch]), want)


def _block_scores(base, temps, words):
    """The XLA sampler's blocks' race scores ``[B, NB]`` for one step: :func:`sampling.block_mass`
    of ``kept · RN(1/T)``, ``-inf`` past ``V`` and for NaN, then :func:`sampling.block_scores`."""
    batch, vocab = base.shape
    width = S.race_width(vocab)
    blocks = -(-vocab // width)
    y = base.astype(jnp.float32) * S.inverse_temperatures(temps)[:, None]
    y = jnp.full((batch, blocks * width), -jnp.inf).at[:, :vocab].set(jnp.where(jnp.isnan(y), -jnp.inf, y))
    top, mass = S.block_mass(y.reshape(batch, blocks, width))
    return np.asarray(S.block_scores(top, mass, words))


@pytest.mark.parametrize("programs", [0, 1])
def test_edge_rows_get_the_xla_samplers_block_scores_and_tokens(programs):
    """The rows of :func:`draft_testing.edge_race_rows`: each sampling row's block scores (one
    column per block) or best block (one program) are the XLA sampler's, the overflowing row's
    ``+inf`` included, and the tokens too."""
    base, temps, greedy = edge_race_rows()
    batch, _, vocab = base.shape
    rank = 16
    zp, w = jnp.zeros((16, rank), jnp.bfloat16), jnp.zeros((vocab, rank), jnp.bfloat16)  # no bias
    tuning = TileRaceTuning(max_rows=16, chunk=16, programs=programs)
    sampling = ~np.asarray(greedy)
    for seed in range(4):
        keys = S.row_keys(jax.random.key(seed), batch)
        t, g, words = padded_walk_inputs(temps, greedy, keys, 1)
        score, token, corrected = race_tiles(
            zp, w, base, None, t, g, words, 0, batch=batch, interpret=INTERPRET, tuning=tuning
        )
        got = np.asarray(score)[:batch][sampling], np.asarray(token)[:batch][sampling]
        want = _block_scores(base[:, 0], temps, S._key_words(S.step_keys(keys, 0)))[sampling]
        assert np.isinf(want[-1]).all()  # the overflowing row
        # within a float32 step or so, should the GPU's exp and log differ from XLA's; inf where XLA's is
        if programs == 0:  # one column per block
            np.testing.assert_allclose(got[0], want, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(got[1], np.broadcast_to(np.arange(want.shape[1]), want.shape))
        else:  # the one program's best over the blocks: the highest score, the lowest block on a tie
            np.testing.assert_allclose(got[0][:, 0], want.max(1), rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(got[1][:, 0], want.argmax(1))
        tokens, _ = pick_raced_tiles(score, token, corrected, w, t, g, words, 0, batch=batch, interpret=INTERPRET)
        want = _sample_step(base[:, 0].astype(jnp.float32), temps, greedy, S.step_keys(keys, 0), race_dtype=base.dtype)
        np.testing.assert_array_equal(np.asarray(tokens[:batch]), np.asarray(want))


def _walk_inputs(cfg, batch, seed, gamma=3):
    """Base logits and hidden states for a ``gamma``-step walk (fewer interpreted steps than the preset's γ)."""
    k = jax.random.split(jax.random.key(seed), 4)
    base = (2 * jax.random.normal(k[0], (batch, gamma, cfg.vocab_size))).astype(jnp.bfloat16)
    hidden = jax.random.normal(k[1], (batch, gamma, cfg.hidden_size)).astype(jnp.bfloat16)
    bonus = jax.random.randint(k[2], (batch,), 0, cfg.vocab_size)
    return base, hidden, bonus, S.row_keys(k[3], batch)


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_tiled_walk_equals_the_xla_walk(head_type):
    """Tokens and corrected logits equal the XLA walk's (``markov_walk`` + ``sample_step``) for
    every head, greedy and sampling rows; where the biases' summation orders could part (gated
    and RNN latents are not exact), the corrected logits may differ by a unit of bf16 and the
    tokens from the first such step on."""
    cfg, head = _tiny_head(head_type)
    batch = 5
    base, hidden, bonus, keys = _walk_inputs(cfg, batch, seed=3)
    temps, greedy = _rows(batch, seed=4)

    def pick(step, logits):
        return _sample_step(logits, temps, greedy, S.step_keys(keys, step), race_dtype=base.dtype)

    want, want_corrected = jax.jit(lambda: markov_walk(head, base, hidden, bonus, pick, keep_dtype=base.dtype))()
    got, corrected = tiled_race_walk(head, base, hidden, bonus, temps, greedy, keys, interpret=INTERPRET)
    gamma = base.shape[1]
    assert got.shape == (batch, gamma) and got.dtype == jnp.int32
    assert corrected.shape == base.shape and corrected.dtype == base.dtype
    got, want = np.asarray(got), np.asarray(want)
    corrected, want_corrected = (np.asarray(x, np.float32) for x in (corrected, want_corrected))
    if head_type == "vanilla":  # exact latents and tables: the same bias in any order
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(corrected, want_corrected)
        return
    for b in range(batch):  # up to the first differing token the rows walk the same way
        differ = np.nonzero(got[b] != want[b])[0]
        upto = differ[0] + 1 if differ.size else gamma
        np.testing.assert_allclose(corrected[b, :upto], want_corrected[b, :upto], rtol=2**-7, atol=2**-7)


def test_propose_takes_the_tiled_kernels_and_keeps_its_tokens(monkeypatch):
    """``propose`` of a mixed batch under ``pallas`` runs two tiled kernels per step and no race
    kernel, and drafts the tokens and corrected logits it drafts with the XLA sampler."""
    cfg, graphdef, args = tiny_round("mixed", gamma=3)
    monkeypatch.setenv(RACE_ENV, "xla")
    blocks, names = {}, {}
    for choice in ("xla", "pallas"):
        monkeypatch.setenv(TILE_RACE_ENV, choice)
        fn = lambda *a: propose(graphdef, *a)  # noqa: E731
        jaxpr = str(jax.make_jaxpr(fn)(*args))
        names[choice] = (jaxpr.count("name=race_tiles"), jaxpr.count("name=pick_raced_tiles"))
        blocks[choice] = jax.jit(fn)(*args)
    assert names == {"xla": (0, 0), "pallas": (cfg.gamma, cfg.gamma)}
    got, want = blocks["pallas"], blocks["xla"]
    np.testing.assert_array_equal(np.asarray(got.draft_tokens), np.asarray(want.draft_tokens))
    assert got.corrected_logits.shape == (4, cfg.gamma, cfg.vocab_size)
    # random bf16 tables: the bias sums' order may move a logit by a unit of bf16
    np.testing.assert_allclose(
        np.asarray(got.corrected_logits, np.float32),
        np.asarray(want.corrected_logits, np.float32),
        rtol=2**-7,
        atol=2**-10,
    )
    np.testing.assert_array_equal(np.asarray(got.greedy_mask), np.asarray(want.greedy_mask))


def test_choice_support_tuning_and_bad_inputs(monkeypatch):
    monkeypatch.delenv(TILE_RACE_ENV, raising=False)
    assert tile_race_choice() == "auto"
    on_gpu = jax.default_backend() == "gpu"
    v = 151936
    first, last = TILE_RACE_AUTO_BATCHES
    assert use_tile_race_kernel(256, jnp.bfloat16, v, first) == (on_gpu, False)
    assert use_tile_race_kernel(256, jnp.bfloat16, v, last) == (on_gpu, False)
    for batch in [b for b in (first - 1, last + 1) if b >= 1]:  # the race kernel was as fast or faster there
        assert use_tile_race_kernel(256, jnp.bfloat16, v, batch) == (False, False)
    monkeypatch.setenv(TILE_RACE_ENV, " Pallas ")
    assert use_tile_race_kernel(256, jnp.bfloat16, v, 128) == (True, INTERPRET)  # forced at any batch
    assert use_tile_race_kernel(256, jnp.float32, v, 8) == (False, False)  # TF32 products: not XLA's GEMM
    assert use_tile_race_kernel(24, jnp.bfloat16, v, 8) == (False, False)
    assert use_tile_race_kernel(256, jnp.bfloat16, 100, 8) == (False, False)  # no race block of 100
    monkeypatch.setenv(TILE_RACE_ENV, "xla")
    assert use_tile_race_kernel(256, jnp.bfloat16, v, 8) == (False, False)
    monkeypatch.setenv(TILE_RACE_ENV, "cuda")
    with pytest.raises(ValueError, match="DSPARK_JAX_TILE_RACE='cuda' is invalid"):
        tile_race_choice()
    assert tile_race_supported(16, jnp.float16, 64) and not tile_race_supported(16, jnp.float16, 96)

    for field, value in (("max_rows", 48), ("chunk", 8), ("warps", 3), ("stages", 0), ("max_rows", True)):
        with pytest.raises(ValueError, match=f"{field}="):
            TileRaceTuning(**{field: value})
    with pytest.raises(TypeError, match="alternate=1"):
        TileRaceTuning(alternate=1)
    for value in (-1, 2.0, True):
        with pytest.raises(ValueError, match=f"programs={value!r} is invalid: must be an integer >= 0"):
            TileRaceTuning(programs=value)
    # the persistent programs by batch: each row of the table from the batch after the row
    # before it up to its own, none beyond the last row
    first = 1
    for (last, programs), after in zip(TILE_RACE_PROGRAMS, [*TILE_RACE_PROGRAMS[1:], (None, 0)], strict=True):
        assert tile_race_tuning(first).programs == programs == tile_race_tuning(last).programs
        assert tile_race_tuning(last + 1).programs == after[1]
        first = last + 1
    assert dataclasses.replace(tile_race_tuning(32), programs=0) == TileRaceTuning()
    assert TileRaceTuning().warps_for(32) == 4 and TileRaceTuning().warps_for(64) == 8
    assert TileRaceTuning(warps=2).warps_for(128) == 2

    z, _, w2, base = _exact_inputs(2, 1, 64, 16, seed=0)
    zp = jnp.zeros((16, 16), z.dtype).at[:2].set(z)
    t, g, words = padded_walk_inputs(jnp.ones(2), jnp.zeros(2, bool), S.row_keys(jax.random.key(0), 2), 1)
    args = (t, g, words, 0)
    with pytest.raises(ValueError, match=r"base has shape \(2, 1, 64\)"):
        race_tiles(zp, w2, base, None, *args, batch=3, interpret=True)
    with pytest.raises(ValueError, match=r"z has shape \(2, 16\)"):
        race_tiles(z, w2, base, None, *args, batch=2, interpret=True)
    with pytest.raises(ValueError, match="rank=16, dtype=float32 and vocab=64 are not supported"):
        race_tiles(zp.astype(jnp.float32), w2.astype(jnp.float32), base, None, *args, batch=2, interpret=True)
    with pytest.raises(ValueError, match=r"temperatures has shape \(2,\): must be \(16,\)"):
        race_tiles(zp, w2, base, None, t[:2], g, words, 0, batch=2, interpret=True)
    with pytest.raises(ValueError, match=r"words has shape \(2, 1, 2\): must be \(2, γ, BR\)"):
        race_tiles(zp, w2, base, None, t, g, words[:, :, :2], 0, batch=2, interpret=True)
    with pytest.raises(ValueError, match=r"corrected has shape \(2, 1, 64\) and dtype float32"):
        race_tiles(zp, w2, base, base.astype(jnp.float32), *args, batch=2, interpret=True)
    with pytest.raises(TypeError, match="tuning="):
        race_tiles(zp, w2, base, None, *args, batch=2, interpret=True, tuning="fast")


def test_block_race_takes_the_kept_logits_not_their_float32_sums():
    """Sampling rows race ``softmax(kept / T)`` with the corrected logits kept in the base
    logits' dtype. Sixteen rows at ``T = 2⁻¹²`` whose only finite logits are tokens ``a`` (race
    block 0) and ``b`` (rows 0–7: block 0 too; rows 8–15: block 1), base logit 1 each, ``a``
    with a bias of ``2⁻⁹`` (``z · w2``: exact): the float32 sum ``1 + 2⁻⁹`` is kept as 1, so the
    two tokens (and, for rows 8–15, the two blocks' masses) are equal and each is the pick with
    probability 1/2; a block race on the float32 sums would give block 0 a mass ``e⁸`` times
    block 1's (``a`` in more than 99.9 % of the rows). Checked: picks are ``a`` or ``b``,
    ``b`` is drawn in both groups (fixed seed), and the XLA sampler picks the same."""
    batch, vocab, rank, a = 16, 256, 16, 10
    width = S.race_width(vocab)
    b = np.where(np.arange(batch) < 8, a + 10, width + 10)
    base = np.full((batch, 1, vocab), -np.inf)
    base[:, 0, a] = 1.0
    base[np.arange(batch), 0, b] = 1.0
    base = jnp.asarray(base, jnp.bfloat16)
    zp = jnp.zeros((padded_rows(batch), rank), jnp.bfloat16).at[:batch, 0].set(1.0)
    w2 = jnp.zeros((vocab, rank), jnp.bfloat16).at[a, 0].set(2.0**-9)
    temps, greedy = S.clamp_temperatures(jnp.full((batch,), 2.0**-12, jnp.float32)), jnp.zeros(batch, bool)
    keys = S.row_keys(jax.random.key(7), batch)
    t, g, words = padded_walk_inputs(temps, greedy, keys, 1)
    tuning = TileRaceTuning(max_rows=16, chunk=16)
    score, token, corrected = race_tiles(
        zp, w2, base, None, t, g, words, 0, batch=batch, interpret=INTERPRET, tuning=tuning
    )
    tokens, _ = pick_raced_tiles(score, token, corrected, w2, t, g, words, 0, batch=batch, interpret=INTERPRET)
    tokens = np.asarray(tokens[:batch])
    sums = base[:, 0].astype(jnp.float32) + jnp.zeros((batch, vocab)).at[:, a].set(2.0**-9)
    np.testing.assert_array_equal(
        np.asarray(corrected[:, 0], np.float32), np.asarray(sums.astype(jnp.bfloat16), np.float32)
    )
    assert np.all((tokens == a) | (tokens == b)), tokens
    assert (tokens[:8] == b[:8]).any() and (tokens[8:] == b[8:]).any(), tokens
    want = _sample_step(sums, temps, greedy, S.step_keys(keys, 0), race_dtype=base.dtype)
    np.testing.assert_array_equal(tokens, np.asarray(want))


def test_padded_walk_inputs_make_the_padding_rows_greedy_at_temperature_one():
    """:func:`padded_walk_inputs` pads to ``BR`` rows: the real rows' temperatures, greedy flags
    and every step's key words (:func:`~dspark_jax.race_kernel.step_key_words`, transposed to
    ``[2, γ, BR]``) as given; the padding rows greedy (the pick kernel never reads a greedy
    padding row's corrected logits), at temperature 1, with zero key words."""
    batch, gamma = 3, 2
    temps, greedy = _rows(batch, seed=1)
    keys = S.row_keys(jax.random.key(2), batch)
    t, g, words = padded_walk_inputs(temps, greedy, keys, gamma)
    total = padded_rows(batch)
    assert (t.shape, g.shape, words.shape) == ((total,), (total,), (2, gamma, total))
    assert (t.dtype, g.dtype, words.dtype) == (jnp.float32, jnp.int32, jnp.uint32)
    np.testing.assert_array_equal(np.asarray(t[:batch]), np.asarray(temps))
    np.testing.assert_array_equal(np.asarray(g[:batch]), np.asarray(greedy, np.int32))
    assert np.all(np.asarray(t[batch:]) == 1.0) and np.all(np.asarray(g[batch:]) == 1)
    assert not np.asarray(words[:, :, batch:]).any()
    for k in range(gamma):
        np.testing.assert_array_equal(np.asarray(words[:, k, :batch]).T, np.asarray(S._key_words(S.step_keys(keys, k))))
