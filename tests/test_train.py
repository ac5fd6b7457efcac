"""The draft and target trainers, the corpus, and the loss against NumPy references."""

import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from draft_testing import TRAINING_TARGET
from flax import nnx

from dspark_jax import draft_training
from dspark_jax.corpus import is_held_out, list_stdlib_files, load_corpus
from dspark_jax.draft import DSparkDraft
from dspark_jax.draft_training import (
    DraftTrainConfig,
    block_loss_terms,
    check_draft_fits,
    default_draft_config,
    distillation_data,
    draft_blocks,
    draft_loss,
    evaluate_draft,
    sample_anchors,
    train_draft,
)
from dspark_jax.target_training import TargetTrainConfig, train_target
from dspark_jax.training import cast_params, load_train_state, lr_schedule, make_optimizer

VOCAB = TRAINING_TARGET.vocab_size
MASK = VOCAB - 1


def _stream(n: int, seed: int = 0) -> np.ndarray:
    """A learnable token stream: each token is a fixed random successor of the one before.

    The target learns it to a peaked distribution within a few steps, so the draft's TV
    falls quickly and the confidence labels move far enough for BCE to fall clearly.
    """
    succ = np.random.default_rng(seed).permutation(VOCAB - 1)
    out = np.zeros(n, np.int64)
    for i in range(1, n):
        out[i] = succ[out[i - 1]]
    return out


TOKENS = _stream(6000)
TARGET_CFG = TRAINING_TARGET
DRAFT_CFG = default_draft_config(TARGET_CFG, mask_token_id=MASK, gamma=4, markov_rank=8, num_layers=1)


@pytest.fixture(scope="module")
def target():
    """A tiny target trained for a few steps, so its distributions are peaked and worth copying."""
    result = train_target(
        TARGET_CFG, TOKENS, TargetTrainConfig(steps=60, batch_size=8, seq_len=32, lr=1e-2), progress=False
    )
    losses = result.history["loss"]
    assert losses[-1] < losses[0] - 0.5, losses  # the target learned the successor table
    return result.model


def _tcfg(**kw):
    base = dict(steps=50, batch_size=4, seq_len=24, anchors_per_seq=6, lr=3e-3, log_every=1)
    base.update(kw)
    return DraftTrainConfig(**base)


# --------------------------------------------------------------------------- loss terms
def test_loss_terms_match_numpy_reference():
    rng = np.random.default_rng(0)
    n, g, v = 3, 4, 11
    corrected = rng.normal(size=(n, g, v)).astype(np.float32) * 2
    tlogits = rng.normal(size=(n, g, v)).astype(np.float32) * 2
    gold = rng.integers(0, v, size=(n, g))
    conf = rng.normal(size=(n, g)).astype(np.float32)
    terms = block_loss_terms(jnp.asarray(corrected), jnp.asarray(tlogits), jnp.asarray(gold), jnp.asarray(conf))

    def softmax(x):
        e = np.exp(x - x.max(-1, keepdims=True))
        return e / e.sum(-1, keepdims=True)

    q, p = softmax(corrected.astype(np.float64)), softmax(tlogits.astype(np.float64))
    ce = -np.log(np.take_along_axis(q, gold[..., None], -1)[..., 0])
    tv = np.abs(q - p).sum(-1)
    label = np.clip(1 - 0.5 * tv, 0, 1)
    sig = 1 / (1 + np.exp(-conf.astype(np.float64)))
    bce = -(label * np.log(sig) + (1 - label) * np.log(1 - sig))
    np.testing.assert_allclose(terms["ce"], ce, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(terms["tv"], tv, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(terms["bce"], bce, rtol=1e-5, atol=1e-5)


def _jit_with_models(fn, draft, target):
    """``fn(draft, target, *args)`` compiled over the split models (eager tiny ops are slow)."""
    dg, ds = nnx.split(draft)
    tg, ts = nnx.split(target)
    jitted = jax.jit(lambda ds, ts, *args: fn(nnx.merge(dg, ds), nnx.merge(tg, ts), *args))
    return lambda *args: jitted(ds, ts, *args)


@pytest.mark.parametrize("decay", [4.0, 1.5, float("inf")])
def test_total_loss_uses_the_deepspec_weights(target, decay):
    """Position k weighs exp(−k / position_decay), normalised; an infinite decay weighs positions equally."""
    draft = DSparkDraft(DRAFT_CFG, rngs=nnx.Rngs(1), embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    tcfg = _tcfg(position_decay=decay)

    def both(d, t, tokens, anchors):
        return draft_loss(d, t, tokens, anchors, tcfg), draft_blocks(d, t, tokens, anchors)

    tokens = jnp.asarray(TOKENS[:48].reshape(2, 24), jnp.int32)
    anchors = jnp.asarray([[1, 5, 10], [3, 7, 19]], jnp.int32)
    (loss, metrics), blocks = _jit_with_models(both, draft, target)(tokens, anchors)
    terms = block_loss_terms(blocks["corrected"], blocks["target_logits"], blocks["gold"], blocks["confidence_logits"])
    w = np.ones(4) if decay == float("inf") else np.exp(-np.arange(4) / decay)
    w = w / w.sum()
    mean = {k: float(np.mean(np.sum(np.asarray(v) * w, -1))) for k, v in terms.items()}
    np.testing.assert_allclose(float(loss), 0.1 * mean["ce"] + 0.9 * mean["tv"] + mean["bce"], rtol=1e-5)
    np.testing.assert_allclose(float(metrics["tv"]), mean["tv"], rtol=1e-5)


def test_masked_training_blocks_match_a_draft_that_sees_only_the_prefix(target):
    """Each anchor's block must see exactly the target features of positions < anchor."""
    draft = DSparkDraft(DRAFT_CFG, rngs=nnx.Rngs(2), embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    tokens = jnp.asarray(TOKENS[100:124][None], jnp.int32)  # [1, 24]
    anchors = [3, 18]
    blocks = _jit_with_models(draft_blocks, draft, target)(tokens, jnp.asarray([anchors], jnp.int32))
    for i, a in enumerate(anchors):
        # Independent path: the target runs the prefix alone, whose features are the whole context.
        def reference(d, t, tokens, a=a):
            _, feats, _ = t(
                tokens[:, :a], jnp.arange(a)[None], t.init_cache(1, a), feature_layers=DRAFT_CFG.target_layer_ids
            )
            ctx_k, ctx_v = d.context_kv(feats, jnp.arange(a)[None])
            hidden = d(
                d.block_ids(tokens[:, a]),
                positions=d.block_positions(jnp.asarray([a])),
                ctx_k=ctx_k,
                ctx_v=ctx_v,
                ctx_mask=jnp.ones((1, a), bool),
            )
            full_logits, _, _ = t(tokens, jnp.arange(24)[None], t.init_cache(1, 24))
            return d.corrected_logits(d.slots(hidden), tokens[:, a : a + 4])[0], full_logits[0, a : a + 4]

        want, want_target = _jit_with_models(reference, draft, target)(tokens)
        np.testing.assert_allclose(blocks["corrected"][i], want, rtol=2e-4, atol=2e-4)
        np.testing.assert_array_equal(blocks["gold"][i], np.asarray(tokens[0, a + 1 : a + 5]))
        np.testing.assert_allclose(blocks["target_logits"][i], want_target, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("clip_norm", [0.5, float("inf")])
def test_optimizer_clips_the_global_norm_and_an_infinite_clip_norm_never_clips(clip_norm):
    """Two AdamW steps (the first at lr 0, the warmup) on gradients of global norm 13, then 0.25.

    Adam's second update depends on how the two gradients compare, so it shows whether the
    first was clipped to ``clip_norm``; the reference scales each gradient by
    ``min(1, clip_norm / norm)`` by hand before a plain AdamW.
    """
    steps = [{"a": jnp.asarray([3.0, -4.0]), "b": jnp.asarray([[12.0]])}]  # global norm 13
    steps.append(jax.tree.map(lambda g: g / 52.0, steps[0]))  # global norm 0.25
    params = jax.tree.map(jnp.zeros_like, steps[0])

    def run(opt, grads_list):
        state, out = opt.init(params), None
        for grads in grads_list:
            out, state = opt.update(grads, state, params)
        return out

    got = run(make_optimizer(10, 1e-2, warmup_frac=0.0, clip_norm=clip_norm), steps)
    plain = optax.adamw(lr_schedule(10, 1e-2, 0.0), weight_decay=0.0)
    by_hand = [
        jax.tree.map(lambda g, n=n: g * min(1.0, clip_norm / n), grads)
        for grads, n in zip(steps, (13.0, 0.25), strict=True)
    ]
    expected, unclipped = run(plain, by_hand), run(plain, steps)
    for name in params:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5)
        assert np.any(np.asarray(got[name]) != 0)
    assert np.allclose(expected["a"], unclipped["a"], rtol=1e-3) == (clip_norm == float("inf"))


def test_lr_schedule_warms_up_then_decays_to_zero():
    sched = lr_schedule(1000, 6e-4, 0.04)
    assert float(sched(0)) == 0.0
    np.testing.assert_allclose(float(sched(40)), 6e-4, rtol=1e-6)
    np.testing.assert_allclose(float(sched(20)), 3e-4, rtol=1e-6)
    # cosine: halfway through the decay the rate is half the peak
    np.testing.assert_allclose(float(sched(520)), 3e-4, rtol=1e-3)
    assert float(sched(1000)) < 1e-9


# --------------------------------------------------------------------------- training
def test_fifty_steps_lower_every_loss_term(target):
    result = train_draft(target, DRAFT_CFG, TOKENS, _tcfg(), progress=False)
    for name in ("ce", "tv", "bce", "loss"):
        first, last = np.mean(result.history[name][:10]), np.mean(result.history[name][-10:])
        assert last < first, f"{name}: first-10 mean {first:.4f}, last-10 mean {last:.4f}"
    # Borrowed tables are not trained.
    np.testing.assert_array_equal(result.model.embed_tokens[...], target.embed_tokens)


def test_resume_reproduces_the_uninterrupted_run(target, tmp_path):
    tcfg = _tcfg(steps=8)
    straight = train_draft(target, DRAFT_CFG, TOKENS, tcfg, progress=False)
    ckpt = os.fspath(tmp_path / "ckpt")
    first = train_draft(target, DRAFT_CFG, TOKENS, tcfg, checkpoint_dir=ckpt, stop_at=3, progress=False)
    assert first.step == 3
    resumed = train_draft(target, DRAFT_CFG, TOKENS, tcfg, checkpoint_dir=ckpt, resume=True, progress=False)
    assert resumed.step == 8
    np.testing.assert_allclose(resumed.history["loss"], straight.history["loss"][3:], rtol=1e-6, atol=1e-6)
    a = jax.tree.leaves(nnx.state(straight.model, nnx.Param))
    b = jax.tree.leaves(nnx.state(resumed.model, nnx.Param))
    for x, y in zip(a, b, strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-6)


def test_resume_refuses_a_checkpoint_of_other_settings(target, tmp_path):
    ckpt = os.fspath(tmp_path / "ckpt")
    # Same settings as the resume test above, so the compiled step is shared.
    train_draft(target, DRAFT_CFG, TOKENS, _tcfg(steps=8), checkpoint_dir=ckpt, stop_at=1, progress=False)
    with pytest.raises(ValueError, match="other settings"):
        train_draft(target, DRAFT_CFG, TOKENS, _tcfg(steps=9), checkpoint_dir=ckpt, resume=True, progress=False)


# --------------------------------------------------------------------------- bad input
def test_draft_with_another_hidden_size_is_refused():
    import dataclasses

    bad = dataclasses.replace(DRAFT_CFG, hidden_size=48, head_dim=24)
    with pytest.raises(ValueError, match="hidden_size=48"):
        check_draft_fits(bad, TARGET_CFG, 24)


def test_draft_reading_layers_the_target_lacks_is_refused():
    import dataclasses

    bad = dataclasses.replace(DRAFT_CFG, target_layer_ids=(0, 5), num_target_layers=None)
    with pytest.raises(ValueError, match="num_hidden_layers=2"):
        check_draft_fits(bad, TARGET_CFG, 24)


def test_more_anchors_than_a_sequence_offers_are_refused():
    """Anchors lie in 1 … seq_len − rows − 1 and a sequence's are distinct: more cannot be drawn."""
    rows = DRAFT_CFG.num_query_rows
    limit = 24 - rows - 1
    check_draft_fits(DRAFT_CFG, TARGET_CFG, 24, anchors_per_seq=limit)
    want = f"anchors_per_seq={limit + 1} is invalid with seq_len=24 and {rows} query rows: must be <= {limit}"
    with pytest.raises(ValueError, match=re.escape(want)):
        train_draft(
            types.SimpleNamespace(config=TARGET_CFG),
            DRAFT_CFG,
            TOKENS,
            _tcfg(anchors_per_seq=limit + 1),
            progress=False,
        )


def test_each_sequences_anchors_are_distinct_and_in_range():
    """Drawn with replacement, 15 of 16 sequences of the default shape repeated an anchor."""
    for seed, (batch, anchors, seq_len, rows) in enumerate([(16, 32, 256, 7), (50, 12, 20, 7), (3, 1, 9, 7)]):
        got = sample_anchors(np.random.default_rng(seed), batch, anchors, seq_len, rows)
        assert got.dtype == np.int32 and got.shape == (batch, anchors)
        assert got.min() >= 1 and got.max() <= seq_len - rows - 1
        assert all(len(set(row)) == anchors for row in got.tolist())


def test_anchors_as_many_as_the_positions_are_a_permutation_of_them():
    got = sample_anchors(np.random.default_rng(1), 40, 12, 20, 7)  # 12 = 20 − 7 − 1 positions
    np.testing.assert_array_equal(np.sort(got, axis=1), np.broadcast_to(np.arange(1, 13), (40, 12)))
    assert len({tuple(row) for row in got.tolist()}) > 30  # shuffled, not one fixed order


def test_anchor_positions_are_uniform():
    """Without replacement each of the P positions is in a row's A anchors with probability A/P
    (and is its first anchor with probability 1/P), independently across rows: every count over
    ``n`` rows is binomial, and a correct sampler leaves all 2·P of them within 5 standard
    deviations with probability above 1 − 2·18·6e-7."""
    n, anchors, seq_len, rows = 20_000, 5, 24, 5
    positions = seq_len - rows - 1  # 18
    got = sample_anchors(np.random.default_rng(2), n, anchors, seq_len, rows)
    for counts, p in (
        (np.bincount(got.ravel(), minlength=positions + 1)[1:], anchors / positions),
        (np.bincount(got[:, 0], minlength=positions + 1)[1:], 1 / positions),
    ):
        assert counts.size == positions
        np.testing.assert_array_less(np.abs(counts - n * p), 5 * np.sqrt(n * p * (1 - p)))


def test_anchors_are_reproducible_per_generator_state_and_refuse_more_than_the_positions():
    first = sample_anchors(np.random.default_rng((3, 7)), 4, 6, 24, 5)
    np.testing.assert_array_equal(sample_anchors(np.random.default_rng((3, 7)), 4, 6, 24, 5), first)
    assert not np.array_equal(sample_anchors(np.random.default_rng((3, 8)), 4, 6, 24, 5), first)
    want = "anchors=19 is invalid with seq_len=24 and 5 query rows: must be in [0, 18]"
    with pytest.raises(ValueError, match=re.escape(want)):
        sample_anchors(np.random.default_rng(0), 4, 19, 24, 5)


def test_a_diverging_target_run_stops_before_saving_instead_of_returning_nan_weights(tmp_path):
    """A learning rate at float32's edge: the parameters turn NaN within three steps."""
    ckpt = tmp_path / "ckpt"
    tcfg = TargetTrainConfig(steps=3, batch_size=2, seq_len=16, lr=3e38)
    with pytest.raises(ValueError, match=re.escape("target training diverged:")):
        train_target(TARGET_CFG, TOKENS, tcfg, checkpoint_dir=str(ckpt), progress=False)
    assert not (ckpt / "train_state.json").exists()


def test_casting_for_saving_refuses_weights_beyond_the_save_dtype():
    """Finite float32 weights beyond float16's range were saved as inf: a checkpoint that does not load."""
    layer = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    layer.kernel.set_value(layer.kernel.get_value().at[0, 0].set(1e5))
    want = "the trained weights do not fit float16: some are NaN, infinite or beyond its largest value 65504.0"
    with pytest.raises(ValueError, match=re.escape(want)):
        cast_params(layer, "float16")
    assert layer.kernel[...].dtype == jnp.float32  # nothing was cast
    cast_params(layer, "bfloat16")
    assert layer.kernel[...].dtype == jnp.bfloat16 and float(layer.kernel[0, 0]) == 99840.0


def test_empty_corpus_and_short_sequences_are_refused(target):
    with pytest.raises(ValueError, match="empty"):
        train_draft(target, DRAFT_CFG, np.zeros(0, np.int32), _tcfg(), progress=False)
    with pytest.raises(ValueError, match="shorter than a block"):
        train_draft(target, DRAFT_CFG, TOKENS, _tcfg(seq_len=5), progress=False)
    with pytest.raises(ValueError, match="fewer than seq_len"):
        train_draft(target, DRAFT_CFG, TOKENS[:10], _tcfg(), progress=False)
    with pytest.raises(ValueError, match="vocab_size"):
        train_draft(target, DRAFT_CFG, TOKENS + VOCAB, _tcfg(), progress=False)
    with pytest.raises(ValueError, match="steps"):
        _tcfg(steps=0)


def test_evaluation_and_distillation_sizes_are_refused_by_name(target):
    """A ``seq_len`` with no room for one anchor's block used to divide by zero; zero or
    negative counts failed deep inside NumPy."""
    draft = DSparkDraft(DRAFT_CFG, rngs=nnx.Rngs(0))
    shortest = DRAFT_CFG.num_query_rows + 2
    with pytest.raises(ValueError, match=f"seq_len={shortest - 1} is invalid: must be an integer >= {shortest}"):
        evaluate_draft(draft, target, TOKENS, batches=1, batch_size=1, seq_len=shortest - 1)
    for name in ("batches", "batch_size"):
        with pytest.raises(ValueError, match=f"{name}=0 is invalid: must be an integer >= 1"):
            evaluate_draft(draft, target, TOKENS, seq_len=24, **{name: 0})
    out = evaluate_draft(draft, target, TOKENS, batches=1, batch_size=2, seq_len=shortest)
    assert len(out["accept_t1"]) == DRAFT_CFG.gamma and np.isfinite(out["ce"])
    limit = TARGET_CFG.max_position_embeddings  # windows past it ran quietly at positions the models do not know
    with pytest.raises(
        ValueError, match=rf"seq_len={limit + 1} exceeds max_position_embeddings \(draft \d+, target {limit}\)"
    ):
        evaluate_draft(draft, target, TOKENS, batches=1, batch_size=1, seq_len=limit + 1)
    for name, value in (("count", -3), ("batch", 0)):
        with pytest.raises(ValueError, match=f"{name}={value} is invalid: must be an integer >= 1"):
            distillation_data(target, TOKENS, seq_len=12, prompt_len=4, **{"count": 2, name: value})


# --------------------------------------------------------------------------- corpus
def _fake_stdlib(root):
    files = {
        "os.py": "import sys\n",
        "json/__init__.py": '"""JSON."""\n',
        "json/tests/test_x.py": "x = 1\n",
        "test/test_os.py": "y = 2\n",
        "site-packages/pkg/mod.py": "z = 3\n",
        "__pycache__/os.cpython-311.pyc": "",
        "config-3.11-x86_64-linux-gnu/python-config.py": "",
        "_sysconfigdata__linux.py": "",
        "README.txt": "not python\n",
    }
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_corpus_lists_sources_without_tests_or_packages(tmp_path):
    _fake_stdlib(tmp_path)
    assert list_stdlib_files(tmp_path) == ["json/__init__.py", "os.py"]


def test_held_out_split_depends_only_on_the_relative_path(tmp_path):
    _fake_stdlib(tmp_path)
    corpus = load_corpus(tmp_path, held_out_percent=50)
    assert set(corpus.train_files).isdisjoint(corpus.heldout_files)
    assert sorted(corpus.train_files + corpus.heldout_files) == ["json/__init__.py", "os.py"]
    for rel in corpus.heldout_files:
        assert is_held_out(rel, 50)
    # Over many names the held-out share is close to the asked percentage (binomial, 3 sigma).
    names = [f"pkg{i}/mod{i}.py" for i in range(4000)]
    share = np.mean([is_held_out(n, 10) for n in names])
    assert abs(share - 0.10) < 3 * np.sqrt(0.1 * 0.9 / 4000)


def test_corpus_provenance_records_version_and_hashes(tmp_path):
    import platform

    _fake_stdlib(tmp_path)
    info = load_corpus(tmp_path, held_out_percent=50).provenance()
    assert info["python_version"] == platform.python_version()
    assert info["train"]["files"] + info["heldout"]["files"] == 2
    assert len(info["train"]["file_list_sha256"]) == 64


def test_the_real_standard_library_corpus_is_found():
    corpus = load_corpus()
    assert len(corpus.train_files) > 100 and len(corpus.heldout_files) > 10
    assert not any("/test/" in f or f.startswith("test/") for f in corpus.train_files)


# --------------------------------------------------------------------------- config validation
def test_numpy_integer_and_float_settings_are_stored_as_python_numbers():
    tcfg = _tcfg(steps=np.int64(5), seed=np.int64(3), checkpoint_every=np.int32(2), lr=np.float32(0.5))
    assert (tcfg.steps, tcfg.seed, tcfg.checkpoint_every, tcfg.lr) == (5, 3, 2, 0.5)
    assert type(tcfg.steps) is int and type(tcfg.seed) is int and type(tcfg.lr) is float
    target_cfg = TargetTrainConfig(steps=np.int64(7), batch_size=np.uint8(4))
    assert (target_cfg.steps, target_cfg.batch_size) == (7, 4) and type(target_cfg.batch_size) is int


@pytest.mark.parametrize("make", [_tcfg, TargetTrainConfig], ids=["draft", "target"])
@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("weight_decay", -0.1, "must be a finite number >= 0"),
        ("weight_decay", float("nan"), "must be a finite number >= 0"),
        ("seed", -1, "must be an integer >= 0"),
        ("seed", 1.5, "must be an integer >= 0"),
        ("lr", float("inf"), "must be a finite number > 0"),
        ("clip_norm", 0.0, "must be > 0 (inf: no clipping)"),
        ("clip_norm", float("nan"), "must be > 0 (inf: no clipping)"),
        # Finite in float64 but infinite in the optimizer's float32: training saved NaN weights.
        ("lr", 1e39, "must be a finite number > 0 and <= 3.4028234663852886e+38"),
        ("weight_decay", 1e39, "must be a finite number >= 0 and <= 3.4028234663852886e+38"),
        # Beyond what NumPy's generators and jax.random.key take (an OverflowError after BPE training).
        ("seed", 2**63, "must be an integer >= 0 and <= 4294967295"),
        ("seed", 2**32, "must be an integer >= 0 and <= 4294967295"),
        ("steps", 2**31, "must be an integer >= 1 and <= 2147483647"),
        ("batch_size", 2**31, "must be an integer >= 1 and <= 2147483647"),
        ("checkpoint_every", 2**31, "must be an integer >= 0 and <= 2147483647"),
    ],
)
def test_trainer_configs_refuse_bad_shared_settings(make, field, value, allowed):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is invalid: {allowed}")):
        make(**{field: value})


@pytest.mark.parametrize(
    ("field", "value"),
    [("ce_weight", -1.0), ("tv_weight", float("nan")), ("confidence_weight", float("inf")), ("ce_weight", 1e39)],
)
def test_loss_weights_must_be_finite_and_non_negative(field, value):
    with pytest.raises(ValueError, match=re.escape(f"{field}={value!r} is invalid: must be a finite number >= 0")):
        _tcfg(**{field: value})


@pytest.mark.parametrize("value", [0.0, -2.0, float("nan")])
def test_position_decay_must_be_positive(value):
    with pytest.raises(ValueError, match=re.escape(f"position_decay={value!r} is invalid: must be > 0 (inf: equal")):
        _tcfg(position_decay=value)


def test_all_zero_loss_weights_are_refused():
    with pytest.raises(ValueError, match="at least one loss weight must be > 0"):
        _tcfg(ce_weight=0.0, tv_weight=0.0, confidence_weight=0)
    assert _tcfg(ce_weight=0.0, tv_weight=1.0, confidence_weight=0.0).tv_weight == 1.0


@pytest.mark.parametrize("field", ["lr", "position_decay", "weight_decay", "warmup_frac", "tv_weight"])
def test_non_numeric_float_settings_are_type_errors_naming_the_field(field):
    with pytest.raises(TypeError, match=re.escape(f"{field}='4' has type str: must be a number")):
        _tcfg(**{field: "4"})
    with pytest.raises(TypeError, match=re.escape("lr='1e-3' has type str: must be a number")):
        TargetTrainConfig(lr="1e-3")


def test_train_target_checks_the_model_shape_before_training_a_tokenizer(tmp_path, monkeypatch):
    import argparse

    from dspark_jax import target_training

    def must_not_run(*args, **kwargs):
        raise AssertionError("the corpus was read before the settings were checked")

    monkeypatch.setattr("dspark_jax.corpus.load_corpus", must_not_run)
    monkeypatch.setattr("dspark_jax.tokenizer.train_bpe", must_not_run)
    parser = argparse.ArgumentParser()
    target_training.add_arguments(parser)
    out = tmp_path / "out"
    args = parser.parse_args(["--out", str(out), "--heads", "3", "--kv-heads", "2"])
    with pytest.raises(ValueError, match=r"--kv-heads 2 is invalid: must divide --heads 3"):
        target_training.run(args)
    args = parser.parse_args(["--out", str(out), "--seq-len", "600", "--context", "512"])
    with pytest.raises(ValueError, match="--seq-len 600 exceeds the target's --context 512"):
        target_training.run(args)
    assert not out.exists()


def test_a_malformed_training_checkpoint_is_named_with_its_path(tmp_path):
    (tmp_path / "train_state.json").write_text("{")
    with pytest.raises(ValueError, match=re.escape(f"{str(tmp_path / 'train_state.json')!r} is not valid JSON")):
        load_train_state(str(tmp_path), {})


def test_one_anchor_per_sequence_gives_the_gradient_of_that_anchor_repeated(target):
    """One anchor takes its own path (XLA's CPU backend crashed differentiating the vmap over a
    single anchor, below); the same block twice has the same mean loss, so the same gradient."""
    draft = draft_training._new_draft(DRAFT_CFG, target, 0)
    tcfg = _tcfg(anchors_per_seq=1)
    tokens = jnp.asarray(TOKENS[:48].reshape(2, 24))

    def grads(anchors):
        @nnx.jit
        def grad(d, t, a):
            return nnx.grad(lambda d: draft_loss(d, t, tokens, a, tcfg)[0])(d)

        return jax.tree.leaves(grad(draft, target, jnp.asarray(anchors, jnp.int32)))

    for one, two in zip(grads([[5], [9]]), grads([[5, 5], [9, 9]]), strict=True):
        np.testing.assert_allclose(one, two, rtol=2e-5, atol=1e-7)


def test_training_with_one_anchor_per_sequence_runs_on_the_bundled_target():
    """``train-draft --anchors 1`` on the bundled target killed the process (SIGSEGV in XLA's
    CPU backend, differentiating ``draft_blocks``' vmap over one anchor)."""
    from dspark_jax.target import load_target

    bundled = load_target(os.path.join(os.path.dirname(draft_training.__file__), "assets", "target"))
    cfg = default_draft_config(bundled.config, mask_token_id=1, gamma=7, markov_rank=8, num_layers=1)
    tokens = (np.arange(4000) * 7 % bundled.config.vocab_size).astype(np.int32)
    tcfg = DraftTrainConfig(steps=1, batch_size=2, seq_len=32, anchors_per_seq=1)
    result = train_draft(bundled, cfg, tokens, tcfg, progress=False)
    assert np.isfinite(result.history["loss"]).all()


def test_acceptance_stats_chain_the_slots_acceptances_as_written():
    """Hand-made blocks, ``γ = 2``: slot 0's draft puts all its mass on the target's first
    choice of two equal ones (accept ½, argmax match), slot 1's on the target's second choice
    (accept p₀, no match); τ chains them: ``1 + a₀ + a₀a₁``, greedy ``1 + 1 + 1·0``."""
    p1 = 1.0 / (1.0 + np.e)  # softmax([0, 1])[0]
    blocks = {
        "corrected": jnp.array([[[0.0, -jnp.inf], [0.0, -jnp.inf]]]),  # q = [1, 0] at both slots
        "target_logits": jnp.array([[[0.0, 0.0], [0.0, 1.0]]]),
    }
    stats = draft_training.acceptance_stats(blocks)
    np.testing.assert_allclose(stats["accept_t1"], [0.5, p1], rtol=1e-6)
    np.testing.assert_array_equal(stats["match_greedy"], [1.0, 0.0])
    np.testing.assert_allclose(float(stats["tau_t1"]), 1.0 + 0.5 + 0.5 * p1, rtol=1e-6)
    assert float(stats["tau_greedy"]) == 2.0


def test_distillation_data_is_half_greedy_half_sampled():
    """Even rows are the target's greedy continuation, odd rows its T = 1 samples (DeepSpec
    trains on both); an all-greedy draw passed every other test. An untrained target: flat
    enough that a T = 1 draw leaves the argmax."""
    from dspark_jax.generation import generate
    from dspark_jax.target import Qwen3Target

    target = Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(5))
    out = distillation_data(target, TOKENS, count=4, seq_len=20, prompt_len=6, seed=3)
    prompts = out[:, :6].tolist()
    greedy = generate(target, prompts, max_new_tokens=14, temperature=0.0, key=jax.random.key(0))
    same = [out[j, 6:].tolist() == greedy.tokens[j] for j in range(4)]
    assert same[0] and same[2]
    assert not (same[1] and same[3])  # a T = 1 draw that follows the argmax 28 times: p ≈ 0
    sampled = generate(
        target,
        prompts,
        max_new_tokens=14,
        temperature=[0.0, 1.0, 0.0, 1.0],
        key=jax.random.fold_in(jax.random.key(3), 0),
    )
    np.testing.assert_array_equal(out[:, 6:], np.asarray(sampled.tokens))


# --------------------------------------------------------------------------- fourth mutation audit
def test_a_layer_id_equal_to_the_targets_depth_is_refused():
    """Ids name target layers ``0 … L−1`` (``-1`` the embedding): ``L`` is one past the last."""
    import dataclasses

    depth = TARGET_CFG.num_hidden_layers
    bad = dataclasses.replace(DRAFT_CFG, target_layer_ids=(0, depth), num_target_layers=None)
    with pytest.raises(ValueError, match=re.escape(f"ids must lie in -1 <= id < {depth}")):
        check_draft_fits(bad, TARGET_CFG, 24)
    check_draft_fits(dataclasses.replace(bad, target_layer_ids=(-1, depth - 1)), TARGET_CFG, 24)


def test_a_sequence_longer_than_the_targets_positions_is_refused():
    """Training runs the target over the whole window too, not only the draft."""
    import dataclasses

    short = dataclasses.replace(TARGET_CFG, max_position_embeddings=20)
    assert DRAFT_CFG.max_position_embeddings >= 24
    with pytest.raises(ValueError, match=re.escape("seq_len=24 exceeds max_position_embeddings")):
        check_draft_fits(DRAFT_CFG, short, 24)
    check_draft_fits(DRAFT_CFG, short, 20)


def test_the_default_draft_takes_the_targets_norm_and_rope_and_needs_a_markov_head_for_its_markov_input():
    import dataclasses

    other = dataclasses.replace(TARGET_CFG, rms_norm_eps=3e-5, rope_theta=12345.0, max_position_embeddings=96)
    cfg = default_draft_config(other, mask_token_id=MASK, gamma=4, markov_rank=8, num_layers=1)
    assert (cfg.rms_norm_eps, cfg.rope_theta, cfg.max_position_embeddings) == (3e-5, 12345.0, 96)
    assert cfg.confidence_head_with_markov
    dflash = default_draft_config(other, mask_token_id=MASK, gamma=4, markov_rank=0, num_layers=1)
    assert dflash.enable_confidence_head and not dflash.confidence_head_with_markov


def test_heldout_anchors_are_every_fourth_position_with_context_and_their_block_inside():
    """Like the training anchors (``1 … S − R − 1``): a non-empty context before each."""
    rows = DRAFT_CFG.num_query_rows
    windows = draft_training.heldout_windows(DRAFT_CFG, TARGET_CFG, TOKENS, batches=2, batch_size=3, seq_len=24, seed=0)
    for _, anchors in windows:
        want = [a for a in range(1, 24 - rows) if a % 4 == 1]
        assert anchors.shape == (3, len(want)) and (anchors == want).all()


def test_heldout_scores_average_every_batch(target):
    """Two batches of one window score as one batch of both windows (the same windows, the
    same number of blocks each), not as the first batch alone."""
    draft = draft_training._new_draft(DRAFT_CFG, target, 0)
    two = evaluate_draft(draft, target, TOKENS, batches=2, batch_size=1, seq_len=24, seed=3)
    one = evaluate_draft(draft, target, TOKENS, batches=1, batch_size=2, seq_len=24, seed=3)
    first = evaluate_draft(draft, target, TOKENS, batches=1, batch_size=1, seq_len=24, seed=3)
    for name in ("ce", "tv", "bce", "tau_t1", "tau_greedy", "accept_t1"):
        np.testing.assert_allclose(two[name], one[name], rtol=1e-5, err_msg=name)
    assert not np.allclose(two["ce"], first["ce"], rtol=1e-3)


def test_every_distilled_sequence_reaches_the_batches(target, monkeypatch):
    """The first ``batch_size // 2`` rows of each batch are distilled sequences drawn from all
    of them, the last included; the rest are windows of the text (the step is a recorder)."""
    seen = []

    def recorder(step, args, sizes, **kwargs):
        def run(params, rest, opt_state, tstate, batch, anchors):
            seen.append(np.asarray(batch))
            return params, opt_state, {"loss": jnp.float32(1.0)}

        return run

    monkeypatch.setattr(draft_training, "compile_training_step", recorder)
    assert MASK not in TOKENS  # so a row holding MASK comes from the distilled sequences
    distilled = np.stack([np.tile([MASK, i], 12) for i in range(3)]).astype(np.int32)  # [3, 24]
    train_draft(target, DRAFT_CFG, TOKENS, _tcfg(steps=30, batch_size=4), distilled=distilled, progress=False)
    batches = np.stack(seen)  # [steps, B, S]
    assert batches.shape == (30, 4, 24)
    assert (batches[:, :2, 0] == MASK).all() and set(batches[:, :2, 1].ravel()) == {0, 1, 2}
    assert not (batches[:, 2:] == MASK).any()
