"""Each draft module against the float64 NumPy reference (tests/np_reference.py).

Tolerance: relative error (max abs difference over max abs reference) <= 1e-5 at float32,
with matmuls at "highest" precision; float32 round-off through two layers stays near 1e-6.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import np_reference as ref
import numpy as np
import pytest
from draft_testing import hf_params, jit_apply, random_draft, randomize, rel_err, tiny_config
from flax import nnx

from dspark_jax.cache import context_mask
from dspark_jax.draft import DSparkDraft
from dspark_jax.layers import RMSNorm, attend, attend_with_context, rope
from dspark_jax.markov import markov_walk

TOL = 1e-5


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _rng(seed: int) -> np.random.Generator:
    return np.random.default_rng(seed)


def _f32(x) -> jax.Array:
    return jnp.asarray(x, jnp.float32)


def test_rms_norm_matches_reference():
    norm = RMSNorm(16, eps=1e-6)
    randomize(norm, 0)
    x = _rng(1).standard_normal((2, 3, 16)) * 3.0
    got = norm(_f32(x))
    assert got.dtype == jnp.float32
    assert rel_err(got, ref.rms_norm(x, np.asarray(norm.weight[...]), 1e-6)) <= TOL


def test_rms_norm_adds_eps_inside_the_root():
    """``x / sqrt(mean(x²) + eps)``: an all-zero row gives zeros (not NaN), and a row far
    below ``sqrt(eps)`` is scaled down by eps instead of normalised to unit RMS."""
    eps = 1e-6
    norm = RMSNorm(8, eps=eps)
    x = np.zeros((3, 8))
    x[1] = 1e-4
    x[2] = 1e-4 * _rng(2).standard_normal(8)
    got = np.asarray(norm(_f32(x)), np.float64)
    want = ref.rms_norm(x, np.ones(8), eps)
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got[0], 0.0)
    np.testing.assert_allclose(got[1:], want[1:], rtol=1e-5)
    assert np.abs(got[1] - np.sign(x[1])).min() > 0.5  # not the unit-RMS row eps=0 would give


def test_rms_norm_keeps_bfloat16_input_dtype():
    norm = RMSNorm(8, eps=1e-6, param_dtype=jnp.bfloat16)
    assert norm.weight[...].dtype == jnp.bfloat16
    assert norm(jnp.ones((2, 8), jnp.bfloat16)).dtype == jnp.bfloat16


def test_rope_matches_neox_reference():
    x = _rng(2).standard_normal((2, 5, 3, 16))
    positions = np.array([[0, 1, 2, 3, 4], [17, 18, 7, 9, 123]])
    for theta in (10_000.0, 1_000_000.0):
        got = rope(_f32(x), jnp.asarray(positions), theta)
        assert rel_err(got, ref.rope(x, positions, theta)) <= TOL


def test_rope_at_long_context_positions_stays_within_float32_angle_error():
    x = _rng(2).standard_normal((1, 3, 2, 16))
    positions = np.array([[40000, 40001, 40959]])
    got = rope(_f32(x), jnp.asarray(positions), 1_000_000.0)
    # Angles are float32 (as in Hugging Face): |error| <= position * 2**-23 ~ 5e-3 rad.
    assert rel_err(got, ref.rope(x, positions, 1_000_000.0)) <= 5e-3


@pytest.mark.parametrize(
    ("x_shape", "pos_shape", "message"),
    [
        ((2, 5, 3, 15), (2, 5), r"x has shape \(2, 5, 3, 15\): expected \[B, S, heads, D\] with an even D"),
        ((2, 5, 16), (2, 5), r"x has shape \(2, 5, 16\)"),
        ((2, 5, 3, 16), (5,), r"positions has shape \(5,\): expected \[B, S\] = \(2, 5\) like x"),
    ],
)
def test_rope_refuses_shapes_that_do_not_fit(x_shape, pos_shape, message):
    with pytest.raises(ValueError, match="rope: " + message):
        rope(jnp.zeros(x_shape), jnp.zeros(pos_shape, jnp.int32), 10_000.0)


@pytest.mark.parametrize(
    ("q_shape", "k_shape", "v_shape", "mask_shape", "message"),
    [
        ((2, 3, 4, 8), (2, 6, 2, 8), (2, 6, 2, 4), (2, 3, 6), "expected q .* and k, v of one shape"),
        ((2, 3, 4, 8), (2, 6, 3, 8), (2, 6, 3, 8), (2, 3, 6), "NH=4 a multiple of KVH=3"),
        ((2, 3, 4, 8), (1, 6, 2, 8), (1, 6, 2, 8), (2, 3, 6), "do not fit: same B and D"),
        ((2, 3, 4, 8), (2, 6, 2, 8), (2, 6, 2, 8), (2, 3, 5), r"mask has shape \(2, 3, 5\): expected .* \(2, 3, 6\)"),
    ],
)
def test_attend_refuses_shapes_that_do_not_fit(q_shape, k_shape, v_shape, mask_shape, message):
    q, k, v = jnp.zeros(q_shape), jnp.zeros(k_shape), jnp.zeros(v_shape)
    with pytest.raises(ValueError, match="^attend: .*" + message):
        attend(q, k, v, jnp.ones(mask_shape, bool))


def test_attend_grouped_query_matches_reference_with_masked_keys():
    rng = _rng(3)
    q = rng.standard_normal((2, 3, 4, 8))
    k = rng.standard_normal((2, 6, 2, 8))
    v = rng.standard_normal((2, 6, 2, 8))
    mask = rng.random((2, 3, 6)) < 0.6
    mask[..., 0] = True  # every query sees at least one key
    got = attend(_f32(q), _f32(k), _f32(v), jnp.asarray(mask))
    assert rel_err(got, ref.gqa_attention(q, k, v, mask)) <= TOL


def test_attend_with_context_matches_reference_over_context_then_block():
    rng = _rng(5)
    b, s, c, nh, kvh, d = 2, 3, 7, 4, 2, 8
    q = rng.standard_normal((b, s, nh, d))
    ctx_k, ctx_v = rng.standard_normal((2, b, c, kvh, d))
    k, v = rng.standard_normal((2, b, s, kvh, d))
    ctx_mask = rng.random((b, c)) < 0.6
    ctx_mask[1] = False  # a request with an empty context still sees its own block
    got = attend_with_context(_f32(q), _f32(ctx_k), _f32(ctx_v), jnp.asarray(ctx_mask), _f32(k), _f32(v))
    visible = np.broadcast_to(np.concatenate([ctx_mask, np.ones((b, s), bool)], axis=1)[:, None], (b, s, c + s))
    want = ref.gqa_attention(q, np.concatenate([ctx_k, k], 1), np.concatenate([ctx_v, v], 1), visible)
    assert rel_err(got, want) <= TOL


def test_attend_gives_zeros_to_a_query_that_sees_no_key():
    q = jnp.ones((1, 2, 2, 4))
    kv = jnp.ones((1, 3, 1, 4))
    mask = jnp.array([[[True, False, False], [False, False, False]]])
    out = attend(q, kv, kv, mask)
    assert bool(jnp.all(jnp.isfinite(out))) and bool(jnp.all(out[0, 1] == 0))


def test_mlp_matches_reference():
    cfg = tiny_config()
    mlp = random_draft(cfg, seed=4).layers[1].mlp
    p = {f"mlp.{n}.weight": np.asarray(getattr(mlp, n).kernel[...]).T for n in ("gate_proj", "up_proj", "down_proj")}
    x = _rng(5).standard_normal((2, 3, cfg.hidden_size))
    got = jit_apply(lambda m, x: m(x), mlp, _f32(x))
    assert rel_err(got, ref.mlp(x, p, "mlp.")) <= TOL


@pytest.mark.parametrize("attention_bias", [False, True])
def test_decoder_layer_over_context_and_block_matches_reference(attention_bias):
    cfg = tiny_config(attention_bias=attention_bias)
    draft = random_draft(cfg, seed=6)
    layer = draft.layers[0]
    p = hf_params(draft)
    if attention_bias:
        assert "layers.0.self_attn.o_proj.bias" in p  # Qwen3: o_proj has a bias iff q/k/v do
    rng = _rng(7)
    b, n, r = 2, 5, cfg.block_size
    x = rng.standard_normal((b, r, cfg.hidden_size))
    positions = np.array([[5, 6, 7, 8], [3, 4, 5, 6]])
    ctx_k = rng.standard_normal((b, n, cfg.num_key_value_heads, cfg.head_dim))
    ctx_v = rng.standard_normal((b, n, cfg.num_key_value_heads, cfg.head_dim))
    ctx_mask = np.arange(n)[None] < np.array([[5], [3]])

    def kv_fn(k, v):
        keys = jnp.concatenate([_f32(ctx_k), k], axis=1)
        values = jnp.concatenate([_f32(ctx_v), v], axis=1)
        mask = jnp.concatenate([jnp.asarray(ctx_mask), jnp.ones((b, r), bool)], axis=1)
        return keys, values, jnp.broadcast_to(mask[:, None], (b, r, n + r))

    got = jit_apply(lambda m, x, pos: m(x, pos, kv_fn), layer, _f32(x), jnp.asarray(positions))
    want = ref.decoder_layer(x, positions, ctx_k, ctx_v, ctx_mask, p, 0, cfg)
    assert rel_err(got, want) <= TOL


def test_attention_projections_with_bias_match_reference():
    cfg = tiny_config(attention_bias=True)
    draft = random_draft(cfg, seed=8)
    attn = draft.layers[1].self_attn
    p = hf_params(draft)
    x = _rng(9).standard_normal((2, 3, cfg.hidden_size))
    positions = np.array([[0, 1, 2], [10, 11, 12]])
    q_ref, k_ref, v_ref = ref.project_qkv(x, positions, p, 1, cfg)
    q, k, v = jit_apply(
        lambda m, x, pos: (m.query(x, pos), *m.key_value(x, pos)), attn, _f32(x), jnp.asarray(positions)
    )
    assert rel_err(q, q_ref) <= TOL
    assert rel_err(k, k_ref) <= TOL and rel_err(v, v_ref) <= TOL


def test_context_kv_fuses_then_projects_every_layer():
    cfg = tiny_config()
    draft = random_draft(cfg, seed=10)
    p = hf_params(draft)
    feats = _rng(11).standard_normal((2, 5, cfg.num_fused_layers * cfg.hidden_size))
    positions = np.array([[0, 1, 2, 3, 4], [7, 8, 9, 10, 11]])
    fused, (k, v) = jit_apply(
        lambda d, f, pos: (d.fuse_context(f), d.context_kv(f, pos)), draft, _f32(feats), jnp.asarray(positions)
    )
    assert k.shape == (cfg.num_hidden_layers, 2, 5, cfg.num_key_value_heads, cfg.head_dim)
    k_ref, v_ref = ref.context_kv(feats, positions, p, cfg)
    assert rel_err(fused, ref.fuse_context(feats, p, cfg)) <= TOL
    assert rel_err(k, np.stack(k_ref)) <= TOL and rel_err(v, np.stack(v_ref)) <= TOL


def _draft_forward(draft, bonus, prefix_lens, feats):
    n = feats.shape[1]
    ctx_pos = jnp.broadcast_to(jnp.arange(n), (feats.shape[0], n))
    ctx_k, ctx_v = draft.context_kv(feats, ctx_pos)
    ids = draft.block_ids(bonus)
    positions = draft.block_positions(prefix_lens)
    mask = context_mask(prefix_lens, n)
    hidden = draft(ids, positions=positions, ctx_k=ctx_k, ctx_v=ctx_v, ctx_mask=mask)
    via_embeds = draft(input_embeds=draft.embed(ids), positions=positions, ctx_k=ctx_k, ctx_v=ctx_v, ctx_mask=mask)
    slots = draft.slots(hidden)
    return ids, hidden, via_embeds, slots, draft.base_logits(slots)


@pytest.mark.parametrize("sample_from_anchor", [True, False], ids=["anchor", "dflash"])
def test_full_draft_forward_matches_reference_in_both_slot_layouts(sample_from_anchor):
    cfg = tiny_config(sample_from_anchor=sample_from_anchor)
    draft = random_draft(cfg, seed=12)
    p = hf_params(draft)
    bonus = np.array([3, 17])
    prefix_lens = np.array([6, 2])  # row 1 sees only the first two context tokens
    feats = _rng(13).standard_normal((2, 6, cfg.num_fused_layers * cfg.hidden_size))
    ids, hidden, via_embeds, slots, base = jit_apply(
        _draft_forward, draft, jnp.asarray(bonus), jnp.asarray(prefix_lens), _f32(feats)
    )
    assert ids.shape == (2, cfg.num_query_rows)
    np.testing.assert_array_equal(np.asarray(ids), ref.block_ids(bonus, cfg))
    assert slots.shape == (2, cfg.gamma, cfg.hidden_size)
    assert base.shape == (2, cfg.gamma, cfg.vocab_size)  # cropped from EMBED_ROWS
    slots_ref, base_ref = ref.draft_forward(bonus, prefix_lens, feats, p, cfg)
    assert rel_err(slots, slots_ref) <= TOL
    assert rel_err(base, base_ref) <= TOL
    np.testing.assert_array_equal(np.asarray(via_embeds), np.asarray(hidden))


def test_draft_forward_without_ids_or_embeddings_raises():
    draft = random_draft(tiny_config(), seed=0)
    with pytest.raises(ValueError, match="needs input_ids or input_embeds"):
        draft(positions=jnp.zeros((1, 4), jnp.int32), ctx_k=None, ctx_v=None, ctx_mask=None)


BAD_INPUTS = [
    pytest.param({"input_ids": jnp.zeros((4,), jnp.int32)}, ValueError,
                 "input_ids has shape (4,): expected [B, R]", id="ids-1d"),
    pytest.param({"input_ids": jnp.zeros((1, 4), jnp.float32)}, TypeError,
                 "input_ids has dtype float32: expected an integer dtype", id="ids-float"),
    pytest.param({"input_embeds": jnp.zeros((1, 4, 31))}, ValueError,
                 "input_embeds has shape (1, 4, 31): expected [B, R, H] with H = hidden_size=32", id="embeds-h"),
    pytest.param({"input_embeds": jnp.zeros((4, 32))}, ValueError,
                 "input_embeds has shape (4, 32): expected [B, R, H]", id="embeds-2d"),
    pytest.param({"input_embeds": jnp.zeros((1, 4, 32), jnp.int32)}, TypeError,
                 "input_embeds has dtype int32: expected a floating dtype", id="embeds-int"),
]  # fmt: skip


@pytest.mark.parametrize(("inputs", "error", "message"), BAD_INPUTS)
def test_draft_forward_refuses_ids_or_embeddings_of_the_wrong_shape_or_dtype(inputs, error, message):
    draft = random_draft(tiny_config(), seed=0)
    with pytest.raises(error, match=re.escape(message)):
        draft(**inputs, positions=jnp.zeros((1, 4), jnp.int32), ctx_k=None, ctx_v=None, ctx_mask=None)
    ((name, value),) = inputs.items()
    traced = jax.jit(lambda x: draft.inputs(**{"input_ids": None, "input_embeds": None, name: x}))
    with pytest.raises(error, match=re.escape(message)):  # static checks: the same on tracers
        traced(value)


def test_draft_refuses_a_borrowed_table_smaller_than_the_vocabulary():
    cfg = tiny_config()
    message = r"embed_tokens has shape \(39, 32\): expected \[V, 32\] with V >= vocab_size=40"
    with pytest.raises(ValueError, match=message):
        DSparkDraft(cfg, rngs=nnx.Rngs(0), embed_tokens=jnp.zeros((39, 32)))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("name", ["embed_tokens", "lm_head"])
@pytest.mark.parametrize("as_numpy", [False, True])
def test_draft_refuses_a_borrowed_table_holding_nan_or_inf(bad, name, as_numpy):
    """One non-finite entry anywhere in either table (device or NumPy) is refused at
    construction, naming the table: its logits would be NaN, and the sampled acceptance
    ratio min(1, p / q) with them. An abstract build (``nnx.eval_shape``) is not refused."""
    cfg = tiny_config()
    table = np.zeros((cfg.vocab_size + 3, cfg.hidden_size), np.float32)
    table[cfg.vocab_size + 2, 5] = bad  # the padding rows count too: the table is used whole
    table = table if as_numpy else jnp.asarray(table)
    other = jnp.zeros((cfg.vocab_size, cfg.hidden_size))
    tables = {"embed_tokens": other, "lm_head": other, name: table}
    with pytest.raises(ValueError, match=re.escape(f"{name} holds NaN or inf: expected a finite [V', H] table")):
        DSparkDraft(cfg, rngs=nnx.Rngs(0), **tables)
    abstract = nnx.eval_shape(
        lambda e, h: DSparkDraft(cfg, rngs=nnx.Rngs(0), embed_tokens=e, lm_head=h),
        *(jax.ShapeDtypeStruct(t.shape, t.dtype) for t in (tables["embed_tokens"], tables["lm_head"])),
    )
    assert abstract.embed_tokens.get_value().shape == tables["embed_tokens"].shape


HEADS = ["vanilla", "gated", "rnn"]


@pytest.mark.parametrize("kind", HEADS)
def test_teacher_forced_markov_block_matches_reference(kind):
    cfg = tiny_config(markov_head_type=kind)
    draft = random_draft(cfg, seed=14)
    p = hf_params(draft)
    rng = _rng(15)
    hidden = rng.standard_normal((3, cfg.gamma, cfg.hidden_size))
    prev = rng.integers(0, cfg.vocab_size, (3, cfg.gamma))
    got = draft.corrected_logits(_f32(hidden), jnp.asarray(prev))
    base = hidden @ p["lm_head.weight"][: cfg.vocab_size].T
    want = base + ref.markov_block(kind, p, prev, hidden)
    assert got.dtype == jnp.float32
    assert rel_err(got - _f32(base), want - base) <= TOL
    assert rel_err(got, want) <= TOL


def _greedy(k, logits):
    return jnp.argmax(logits, axis=-1)


def _np_greedy(k, logits):
    return np.argmax(logits, axis=-1)


def _gumbel(cfg, batch):
    return _rng(16).gumbel(size=(cfg.gamma, batch, cfg.vocab_size))


@pytest.mark.parametrize("picker", ["greedy", "sampled"])
@pytest.mark.parametrize("kind", [*HEADS, None])
def test_markov_walk_matches_reference(kind, picker):
    if kind is None:  # DFlash-style: no Markov head, the walk only picks
        cfg = tiny_config(markov_rank=0, confidence_head_with_markov=False)
    else:
        cfg = tiny_config(markov_head_type=kind)
    draft = random_draft(cfg, seed=17)
    p = hf_params(draft)
    rng = _rng(18)
    batch = 3
    hidden = rng.standard_normal((batch, cfg.gamma, cfg.hidden_size))
    base = hidden @ p["lm_head.weight"][: cfg.vocab_size].T
    bonus = rng.integers(0, cfg.vocab_size, batch)
    if picker == "greedy":
        pick, np_pick = _greedy, _np_greedy
    else:
        noise = _gumbel(cfg, batch)  # Gumbel-max sampling at temperature 0.7, noise fixed per step
        noise_j = _f32(noise)

        def pick(k, logits):
            return jnp.argmax(logits / 0.7 + noise_j[k], axis=-1)

        def np_pick(k, logits):
            return np.argmax(logits / 0.7 + noise[k], axis=-1)

    tokens, corrected = markov_walk(draft.markov_head, _f32(base), _f32(hidden), jnp.asarray(bonus), pick)
    tokens_ref, corrected_ref = ref.markov_walk(kind, p, base, hidden, bonus, np_pick)
    assert tokens.dtype == jnp.int32 and corrected.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(tokens), tokens_ref)
    assert rel_err(corrected, corrected_ref) <= TOL
    if kind is not None:
        # The walk feeds its own picks back: teacher-forcing on them gives the same logits.
        prev = np.concatenate([bonus[:, None], tokens_ref[:, :-1]], axis=1)
        forced = draft.corrected_logits(_f32(hidden), jnp.asarray(prev))
        assert rel_err(forced, corrected_ref) <= TOL


def test_markov_lookup_clips_in_the_walk_and_fills_nan_elsewhere():
    """The walk's clipped lookup equals the plain one in range; out of range it takes the
    nearest row, where the default (training, confidence) gives NaN rows."""
    cfg = tiny_config()
    head = random_draft(cfg, seed=21).markov_head
    table = np.asarray(head.markov_w1[...])
    ids = jnp.asarray([0, 5, cfg.vocab_size - 1])
    np.testing.assert_array_equal(np.asarray(head.embed_prev(ids, clip=True)), np.asarray(head.embed_prev(ids)))
    bad = jnp.asarray([-3, cfg.vocab_size, cfg.vocab_size + 7])
    np.testing.assert_array_equal(np.asarray(head.embed_prev(bad, clip=True)), table[[0, -1, -1]])
    assert np.isnan(np.asarray(head.embed_prev(bad[1:]))).all()


def test_markov_lookup_wraps_negative_ids_like_jnp_take():
    """Without ``clip``, ``[-V, 0)`` counts from the end and only ids below ``-V`` are NaN."""
    cfg = tiny_config()
    head = random_draft(cfg, seed=21).markov_head
    table = np.asarray(head.markov_w1[...])
    v = cfg.vocab_size
    np.testing.assert_array_equal(np.asarray(head.embed_prev(jnp.asarray([-1, -v]))), table[[v - 1, 0]])
    assert np.isnan(np.asarray(head.embed_prev(jnp.asarray([-v - 1])))).all()


def test_rnn_state_is_carried_across_steps():
    cfg = tiny_config(markov_head_type="rnn")
    draft = random_draft(cfg, seed=19)
    p = hf_params(draft)
    rng = _rng(20)
    hidden = rng.standard_normal((2, cfg.gamma, cfg.hidden_size))
    prev = rng.integers(0, cfg.vocab_size, (2, cfg.gamma))
    bias = ref.markov_block("rnn", p, prev, hidden)
    # A stateless recomputation of step 2 (state reset to zero) must differ from the carried one.
    _, reset = ref.markov_step("rnn", p, np.zeros((2, cfg.markov_rank)), prev[:, 2], hidden[:, 2])
    assert rel_err(reset, bias[:, 2]) > 1e-3
    got = draft.markov_head.block(jnp.asarray(prev), _f32(hidden))
    assert rel_err(got, bias) <= TOL


@pytest.mark.parametrize("with_markov", [True, False])
def test_confidence_head_with_sts_temperature_matches_reference(with_markov):
    cfg = tiny_config(confidence_head_with_markov=with_markov)
    draft = random_draft(cfg, seed=21)
    p = hf_params(draft)
    temperature = p["confidence_head.sts_temperature"]
    assert not np.allclose(temperature, 1.0)
    assert draft.confidence_head.proj.kernel[...].dtype == jnp.float32
    rng = _rng(22)
    hidden = rng.standard_normal((2, cfg.gamma, cfg.hidden_size))
    prev = rng.integers(0, cfg.vocab_size, (2, cfg.gamma))
    got = draft.confidence(_f32(hidden), jnp.asarray(prev))
    assert got.dtype == jnp.float32 and got.shape == (2, cfg.gamma)
    assert rel_err(got, ref.confidence(p, hidden, prev, with_markov, temperature)) <= TOL


def test_confidence_head_stays_float32_in_a_bfloat16_draft():
    cfg = tiny_config(dtype="bfloat16", param_dtype="bfloat16")
    draft = random_draft(cfg, seed=23)
    assert draft.fc.kernel[...].dtype == jnp.bfloat16
    assert draft.confidence_head.proj.kernel[...].dtype == jnp.float32
    assert draft.confidence_head.sts_temperature[...].dtype == jnp.float32
    hidden = jnp.ones((1, cfg.gamma, cfg.hidden_size), jnp.bfloat16)
    assert draft.confidence(hidden, jnp.zeros((1, cfg.gamma), jnp.int32)).dtype == jnp.float32
