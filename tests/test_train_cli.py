"""The ``train-draft`` and ``train-target`` command lines refuse bad options before any work.

Loading, corpus reading, BPE training and training are stubbed: a refusal must come
before them, so reaching one is a failure.
"""

import argparse
import dataclasses
import json
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import TRAINING_TARGET
from flax import nnx

from dspark_jax import draft_training, target_training, training
from dspark_jax.calibration import StsFit
from dspark_jax.checkpoint import load_draft
from dspark_jax.draft_training import DraftTrainConfig, default_draft_config, train_draft
from dspark_jax.target import Qwen3Target
from dspark_jax.tokenizer import train_bpe
from dspark_jax.training import CHECKPOINT_META, TrainResult, fit

TARGET_CFG = TRAINING_TARGET


class Reached(Exception):
    """Raised by a stub of expensive work (loading, corpus, BPE, training)."""


def _must_not_run(*args, **kwargs):
    raise Reached("expensive work ran before the options were checked")


@pytest.fixture
def no_work(monkeypatch):
    for name in (
        "dspark_jax.target.load_target",
        "dspark_jax.corpus.load_corpus",
        "dspark_jax.corpus.encode_documents",
        "dspark_jax.tokenizer.train_bpe",
        "dspark_jax.draft_training.train_draft",
        "dspark_jax.target_training.train_target",
    ):
        monkeypatch.setattr(name, _must_not_run)


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def _model_folder(path):
    """A folder with the files ``train-draft`` looks for in ``--target`` before loading it."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    (path / "tokenizer.json").write_text("{}")
    return path


def _draft_args(tmp_path, *extra, out=None):
    target = _model_folder(tmp_path / "target")
    out = tmp_path / "draft" if out is None else out
    return _parse(draft_training, ["--target", str(target), "--out", str(out), "--seq-len", "40", *extra])


# --------------------------------------------------------------------------- train-draft
def test_draft_training_refuses_distilled_data_with_batches_of_one():
    """``batch_size // 2 == 0`` rows would come from the distilled data: it was silently unused."""
    tcfg = DraftTrainConfig(steps=2, batch_size=1, seq_len=24, anchors_per_seq=2)
    draft_cfg = default_draft_config(TARGET_CFG, mask_token_id=31, gamma=4, markov_rank=8, num_layers=1)
    tokens = jnp.arange(100) % 31
    with pytest.raises(ValueError, match=re.escape("batch_size=1 is invalid with distilled data: must be >= 2")):
        train_draft(
            types.SimpleNamespace(config=TARGET_CFG),
            draft_cfg,
            tokens,
            tcfg,
            distilled=tokens[:48].reshape(2, 24),
            progress=False,
        )


def test_train_draft_cli_refuses_distill_with_batch_one(tmp_path, no_work):
    with pytest.raises(ValueError, match=re.escape("--batch 1 is invalid with --distill 4: must be >= 2")):
        draft_training.run(_draft_args(tmp_path, "--distill", "4", "--batch", "1"))


def test_train_draft_cli_refuses_distill_with_no_room_after_the_prompt(tmp_path, no_work):
    with pytest.raises(ValueError, match=re.escape("--seq-len 16 is too short for --distill 2")):
        draft_training.run(_draft_args(tmp_path, "--distill", "2", "--seq-len", "16"))


@pytest.mark.parametrize(
    ("target", "problem"),
    [("missing", "does not exist"), ("afile", "is not a folder"), ("empty", "has no config.json or tokenizer.json")],
)
def test_train_draft_cli_checks_the_target_folder_before_loading(tmp_path, no_work, target, problem):
    """A missing --target was reported as a missing tokenizer path, a file as invalid JSON."""
    (tmp_path / "afile").write_text("x")
    (tmp_path / "empty").mkdir()
    path = str(tmp_path / target)
    args = _parse(draft_training, ["--target", path, "--out", str(tmp_path / "draft")])
    with pytest.raises(ValueError, match=re.escape(f"--target {path!r} {problem}")):
        draft_training.run(args)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--anchors", "300", "--seq-len", "16"], "--anchors 300 is invalid with --seq-len 16: must be <= 8,"),
        (["--anchors", "9", "--seq-len", "16"], "--anchors 9 is invalid with --seq-len 16: must be <= 8,"),
        (
            ["--anchors", "7", "--seq-len", "16", "--gamma", "9"],
            "--anchors 7 is invalid with --seq-len 16: must be <= 6,",
        ),
        (["--seq-len", "8"], "--seq-len 8 is shorter than a block: must be >= 9"),
    ],
    ids=["far-above", "one-above", "gamma", "no-block"],
)
def test_train_draft_cli_refuses_more_anchors_than_positions_before_loading(tmp_path, no_work, extra, message):
    """Anchors lie in 1 … seq_len − rows − 1; more were drawn with replacement, or exhausted memory."""
    with pytest.raises(ValueError, match=re.escape(message)):
        draft_training.run(_draft_args(tmp_path, *extra))


def test_train_draft_cli_counts_anchor_positions_with_the_draft_configs_rows(tmp_path, no_work):
    cfg = default_draft_config(TARGET_CFG, mask_token_id=31, gamma=4, markov_rank=8, num_layers=1)
    path = tmp_path / "dc.json"
    path.write_text(json.dumps({**cfg.to_hf_config(), "sample_from_anchor": False, "block_size": 5}))
    with pytest.raises(ValueError, match=re.escape("--anchors 11 is invalid with --seq-len 16: must be <= 10,")):
        draft_training.run(_draft_args(tmp_path, "--draft-config", str(path), "--anchors", "11", "--seq-len", "16"))


def test_train_draft_cli_refuses_out_equal_to_target(tmp_path, no_work):
    target = _model_folder(tmp_path / "target")
    os.symlink(target, tmp_path / "link")
    for out in (target, tmp_path / "link", tmp_path / "target" / "."):
        args = _parse(draft_training, ["--target", str(target), "--out", str(out)])
        with pytest.raises(ValueError, match=re.escape(f"--out {str(out)!r} is the --target folder")):
            draft_training.run(args)
    assert (target / "config.json").read_text() == "{}"


@pytest.mark.parametrize("module", [draft_training, target_training], ids=["draft", "target"])
def test_training_cli_refuses_an_out_folder_holding_a_model(tmp_path, no_work, module):
    out = _model_folder(tmp_path / "old")
    argv = _module_argv(module, tmp_path, out)
    with pytest.raises(ValueError, match=re.escape(f"--out {str(out)!r} already holds a model (config.json)")):
        module.run(_parse(module, argv))
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv[1] = str(afile)
    with pytest.raises(ValueError, match=re.escape(f"--out {str(afile)!r} is an existing file")):
        module.run(_parse(module, argv))


def _module_argv(module, tmp_path, out):
    target = ["--target", str(_model_folder(tmp_path / "target"))] if module is draft_training else []
    return ["--out", str(out), *target]


@pytest.mark.parametrize("module", [draft_training, target_training], ids=["draft", "target"])
def test_training_cli_refuses_an_out_path_under_a_file_before_any_work(tmp_path, no_work, module):
    """It failed only when the first checkpoint was written, after up to --checkpoint-every steps."""
    (tmp_path / "afile").write_text("x")
    out = tmp_path / "afile" / "sub" / "draft"
    want = f"--out {str(out)!r} cannot be created: {str(tmp_path / 'afile')!r} on its path is a file"
    with pytest.raises(ValueError, match=re.escape(want)):
        module.run(_parse(module, _module_argv(module, tmp_path, out)))


@pytest.mark.parametrize("module", [draft_training, target_training], ids=["draft", "target"])
def test_training_cli_refuses_an_out_folder_it_cannot_write_before_any_work(tmp_path, no_work, module, monkeypatch):
    locked = tmp_path / "locked"
    locked.mkdir()
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(locked) and access(path, mode))
    for out, problem in [
        (locked / "new", f"cannot be created: {str(locked)!r} is not writable"),
        (locked, "is not writable"),
    ]:
        with pytest.raises(ValueError, match=re.escape(f"--out {str(out)!r} {problem}")):
            module.run(_parse(module, _module_argv(module, tmp_path, out)))


@pytest.mark.parametrize("module", [draft_training, target_training], ids=["draft", "target"])
def test_training_cli_resume_without_a_checkpoint_is_refused_before_any_work(tmp_path, no_work, module):
    out = tmp_path / "fresh"
    argv = ["--out", str(out), "--resume"]
    if module is draft_training:
        argv += ["--target", str(_model_folder(tmp_path / "target"))]
    with pytest.raises(ValueError, match="--resume needs a training checkpoint in --out"):
        module.run(_parse(module, argv))
    assert not out.exists()


def test_train_draft_cli_refuses_shape_flags_with_a_draft_config(tmp_path, no_work):
    args = _draft_args(tmp_path, "--draft-config", "dc.json", "--gamma", "3", "--layers", "1", "--no-confidence")
    with pytest.raises(
        ValueError, match=re.escape("--gamma 3, --layers 1, --no-confidence conflict with --draft-config")
    ):
        draft_training.run(args)


def test_train_draft_cli_refuses_a_draft_config_with_another_mask_id(tmp_path, no_work, monkeypatch):
    cfg = default_draft_config(TARGET_CFG, mask_token_id=5, gamma=4, markov_rank=8, num_layers=1)
    path = tmp_path / "dc.json"
    path.write_text(json.dumps(cfg.to_hf_config()))
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    with pytest.raises(
        ValueError, match=re.escape("has mask_token_id=5: must equal the --target tokenizer's mask id 31")
    ):
        draft_training.run(_draft_args(tmp_path, "--draft-config", str(path)))


# --------------------------------------------------------------------------- both
BAD_DRAFT_FLAGS = [
    ("--steps", "0"),
    ("--batch", "0"),
    ("--batch", "2147483648"),
    ("--seq-len", "0"),
    ("--anchors", "0"),
    ("--gamma", "0"),
    ("--markov-rank", "-1"),
    ("--layers", "0"),
    ("--lr", "0"),
    ("--lr", "1e39"),
    ("--seed", "-1"),
    ("--seed", "4294967296"),
    ("--seed", "9223372036854775808"),
    ("--checkpoint-every", "-1"),
    ("--distill", "-1"),
]
BAD_TARGET_FLAGS = [
    ("--vocab-size", "257"),
    ("--hidden-size", "2147483648"),
    ("--intermediate-size", "0"),
    ("--layers", "0"),
    ("--heads", "0"),
    ("--kv-heads", "0"),
    ("--head-dim", "0"),
    ("--context", "0"),
    ("--steps", "0"),
    ("--batch", "0"),
    ("--batch", "2147483648"),
    ("--seq-len", "0"),
    ("--lr", "1e39"),
    ("--lr", "nan"),
    ("--seed", "9223372036854775808"),
    ("--checkpoint-every", "-1"),
]


@pytest.mark.parametrize(
    ("module", "flag", "value"),
    [(draft_training, *bad) for bad in BAD_DRAFT_FLAGS] + [(target_training, *bad) for bad in BAD_TARGET_FLAGS],
    ids=[f"draft{f}={v}" for f, v in BAD_DRAFT_FLAGS] + [f"target{f}={v}" for f, v in BAD_TARGET_FLAGS],
)
def test_training_cli_refuses_numbers_out_of_range_naming_the_flag(module, flag, value, capsys):
    """Plain ``type=int`` let these through to errors naming internal fields (``batch_size=0``),
    to an OverflowError after the tokenizer's training, or to terabyte allocations."""
    argv = ["--out", "o", flag, value] + (["--target", "t"] if module is draft_training else [])
    with pytest.raises(SystemExit):
        _parse(module, argv)
    assert f"argument {flag}: {value!r} is invalid: must be" in capsys.readouterr().err


@pytest.mark.parametrize("module", [draft_training, target_training], ids=["draft", "target"])
def test_training_cli_accepts_the_largest_seed_and_float32_learning_rate(module):
    target = ["--target", "t"] if module is draft_training else []
    argv = ["--out", "o", "--seed", "4294967295", "--lr", "3.4e38", *target]
    args = _parse(module, argv)
    assert (args.seed, args.lr) == (4294967295, 3.4e38)


@pytest.mark.parametrize("module", [draft_training, target_training], ids=["draft", "target"])
@pytest.mark.parametrize("value", ["nan", "0", "-5", "inf"])
def test_max_seconds_must_be_a_finite_positive_number(module, value, capsys):
    argv = ["--out", "o", "--max-seconds", value] + (["--target", "t"] if module is draft_training else [])
    with pytest.raises(SystemExit):
        _parse(module, argv)
    assert "must be a finite number of seconds > 0" in capsys.readouterr().err
    assert _parse(module, argv[:2] + ["--max-seconds", "1.5"] + argv[4:]).max_seconds == 1.5


def test_fit_refuses_a_non_positive_time_limit():
    with pytest.raises(ValueError, match=re.escape("max_seconds=0.0 is invalid: must be a finite number > 0")):
        _fit({}, None, max_seconds=0.0)


def _fit(meta, checkpoint_dir, *, resume=False, max_seconds=None, params=None):
    def step_fn(params, opt_state, step):
        return params, opt_state, {"loss": jnp.float32(1.0)}

    tcfg = types.SimpleNamespace(steps=2, log_every=1, checkpoint_every=0)
    return fit(
        step_fn,
        {"w": jnp.zeros(2)} if params is None else params,
        (),
        tcfg,
        name="test",
        run_meta=meta,
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        progress=False,
        max_seconds=max_seconds,
        end=1 if not resume else 2,
        record_every_step=True,
    )


def test_fit_counts_the_loop_time_of_every_session_through_its_checkpoints(tmp_path, monkeypatch):
    """A resumed run's seconds are the first session's (as its checkpoint recorded) plus its own;
    a run resumed with nothing left reports the checkpoint's; an older checkpoint without them
    gives None (unknown) rather than a partial count."""
    clock = [100.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])

    def session(end, *, resume, seconds_per_step):
        def step_fn(params, opt_state, step):
            clock[0] += seconds_per_step
            return params, opt_state, {"loss": jnp.float32(1.0)}

        tcfg = types.SimpleNamespace(steps=3, log_every=1, checkpoint_every=0)
        return fit(
            step_fn, {"w": jnp.zeros(2)}, (), tcfg, name="test", run_meta={}, checkpoint_dir=ckpt,
            resume=resume, progress=False, max_seconds=None, end=end, record_every_step=True,
        )  # fmt: skip

    def recorded():
        with open(os.path.join(ckpt, CHECKPOINT_META)) as f:
            return json.load(f)["seconds"]

    ckpt = str(tmp_path / "ckpt")
    assert session(1, resume=False, seconds_per_step=5.0)[2:] == (1, 5.0)
    assert recorded() == 5.0
    clock[0] += 1000.0  # time between the sessions is not training
    assert session(3, resume=True, seconds_per_step=7.0)[2:] == (3, 19.0)
    assert recorded() == 19.0
    assert session(3, resume=True, seconds_per_step=7.0)[2:] == (3, 19.0)  # finished: nothing ran
    with open(os.path.join(ckpt, CHECKPOINT_META)) as f:
        meta = json.load(f)
    del meta["seconds"]  # written before checkpoints kept their seconds
    with open(os.path.join(ckpt, CHECKPOINT_META), "w") as f:
        json.dump(meta, f)
    assert session(3, resume=True, seconds_per_step=7.0)[3] is None
    meta["seconds"] = -1.0
    with open(os.path.join(ckpt, CHECKPOINT_META), "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match=re.escape("records seconds=-1.0: expected a finite number >= 0")):
        session(3, resume=True, seconds_per_step=7.0)


def test_resume_mismatch_names_each_differing_setting(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _fit({"train_config": {"steps": 8, "lr": 0.1}, "model": {"layers": 2}}, ckpt)
    with pytest.raises(ValueError, match="cannot resume") as info:
        _fit({"train_config": {"steps": 9, "lr": 0.1}, "model": {"layers": 3}}, ckpt, resume=True)
    assert "model.layers: checkpoint 2, this run 3; train_config.steps: checkpoint 8, this run 9" in str(info.value)
    assert "lr" not in str(info.value)


def test_resume_names_a_changed_setting_before_reading_the_arrays(tmp_path):
    """A changed shape used to fail on the array count (``has 1 arrays; this model needs 2``)."""
    ckpt = str(tmp_path / "ckpt")
    _fit({"model": {"layers": 2}}, ckpt)
    bigger = {"w": jnp.zeros(2), "v": jnp.zeros(3)}
    with pytest.raises(ValueError, match=re.escape("cannot resume: model.layers: checkpoint 2, this run 3")):
        _fit({"model": {"layers": 3}}, ckpt, resume=True, params=bigger)


class CountedLoss:
    """A loss whose host reads (``float``) are counted, in the step they belong to."""

    def __init__(self, value, step, reads):
        self.value, self.step, self.reads = value, step, reads

    def __float__(self):
        self.reads.append(self.step)
        return float(self.value)


def _fit_losses(losses, *, nan_params_after=None, checkpoint_dir=None, log_every=1, checkpoint_every=0, record=True):
    """Runs :func:`fit` over ``losses`` (one step each); returns the steps whose loss was read.

    ``nan_params_after``: the step (0-based) whose update leaves NaN parameters.
    """
    reads = []

    def step_fn(params, opt_state, step):
        if step == nan_params_after:
            params = {"w": params["w"] * jnp.nan}
        return params, opt_state, {"loss": CountedLoss(losses[step], step + 1, reads)}

    tcfg = types.SimpleNamespace(steps=len(losses), log_every=log_every, checkpoint_every=checkpoint_every)
    fit(
        step_fn,
        {"w": jnp.ones(2)},
        (),
        tcfg,
        name="test",
        run_meta={},
        checkpoint_dir=checkpoint_dir,
        resume=False,
        progress=False,
        max_seconds=None,
        end=len(losses),
        record_every_step=record,
    )
    return reads


def test_fit_refuses_a_non_finite_loss_naming_the_step_and_the_loss():
    with pytest.raises(ValueError, match=re.escape("test training diverged: the loss became nan at step 2")):
        _fit_losses([1.0, np.nan, 1.0])


def test_fit_refuses_parameters_that_became_non_finite_in_the_last_update(tmp_path):
    """The loss is computed before the update: ``--steps 1 --lr 1e39`` saved NaN weights, exit 0."""
    ckpt = tmp_path / "ckpt"
    want = "test training diverged: the parameters hold NaN or infinite values after step 2 (whose loss was 0.5)"
    with pytest.raises(ValueError, match=re.escape(want)):
        _fit_losses([1.0, 0.5], nan_params_after=1, checkpoint_dir=str(ckpt))
    assert not (ckpt / CHECKPOINT_META).exists()


def test_fit_checks_the_loss_before_each_checkpoint_it_saves(tmp_path):
    """Without reading the loss every step, a checkpoint step used to save whatever it held."""
    ckpt = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=re.escape("the loss became nan at step 2")):
        _fit_losses([1.0, np.nan, 1.0], checkpoint_dir=str(ckpt), log_every=10, checkpoint_every=2, record=False)
    assert not (ckpt / CHECKPOINT_META).exists()


def test_fit_reads_the_loss_only_on_logged_and_checkpointed_steps(tmp_path):
    """The finiteness checks add no host sync per step to a trainer that avoids one."""
    losses = [1.0] * 10
    reads = _fit_losses(losses, checkpoint_dir=str(tmp_path / "ckpt"), log_every=5, checkpoint_every=4, record=False)
    assert reads == [4, 5, 8, 10]
    assert _fit_losses(losses, log_every=5, record=False) == [5, 10]


def _stub_corpus(monkeypatch):
    corpus = types.SimpleNamespace(texts=lambda split: ["ab ab\n"], train_files=["a.py"], provenance=lambda: {})
    monkeypatch.setattr("dspark_jax.corpus.load_corpus", lambda: corpus)
    monkeypatch.setattr("dspark_jax.corpus.encode_documents", lambda tokenizer, texts: np.zeros(64, np.int32))


def test_train_draft_cli_saves_no_draft_whose_heldout_scores_are_not_finite(tmp_path, monkeypatch):
    """Finite but huge parameters (a huge --lr) pass the training checks and score NaN."""
    _stub_corpus(monkeypatch)
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    monkeypatch.setattr("dspark_jax.target.load_target", lambda *a, **k: Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0)))
    monkeypatch.setattr(draft_training, "train_draft", lambda *a, **k: TrainResult(model=None, history={}, step=3))
    monkeypatch.setattr(draft_training, "evaluate_draft", lambda *a, **k: {"ce": np.nan, "tv": 1.0, "bce": np.inf})
    monkeypatch.setattr("dspark_jax.checkpoint.save_draft", _must_not_run)
    want = "draft training diverged: its held-out ce nan, bce inf after step 3; the model was not saved"
    with pytest.raises(ValueError, match=re.escape(want)):
        draft_training.run(_draft_args(tmp_path))
    assert not (tmp_path / "draft").exists()


def test_train_draft_cli_resume_names_a_changed_shape_before_reading_the_corpus(tmp_path, no_work, monkeypatch):
    out = tmp_path / "draft"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / CHECKPOINT_META).write_text(json.dumps({"draft_config": {"block_size": 7}, "step": 1}))
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    monkeypatch.setattr("dspark_jax.target.load_target", lambda *a, **k: types.SimpleNamespace(config=TARGET_CFG))
    with pytest.raises(ValueError, match=re.escape("draft_config.block_size: checkpoint 7, this run 5")):
        draft_training.run(_draft_args(tmp_path, "--resume", "--gamma", "5"))


# --------------------------------------------------------------------------- train-target
def test_train_target_resume_refuses_another_vocab_size(tmp_path, no_work):
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "train_state.json").write_text("{}")
    tok = train_bpe(["def f(x): return x + x\n" * 3], 270)
    tok.save(str(out / "tokenizer.json"))
    args = _parse(target_training, ["--out", str(out), "--resume", "--vocab-size", "300"])
    want = f"--vocab-size 300 differs from the saved tokenizer {str(out / 'tokenizer.json')!r} of {tok.vocab_size} ids"
    with pytest.raises(ValueError, match=re.escape(want)):
        target_training.run(args)


def test_train_target_resume_names_a_changed_shape_before_reading_the_corpus(tmp_path, no_work):
    out = tmp_path / "out"
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / CHECKPOINT_META).write_text(json.dumps({"target_config": {"hidden_size": 192}}))
    train_bpe(["def f(x): return x + x\n" * 3], 270).save(str(out / "tokenizer.json"))
    args = _parse(target_training, ["--out", str(out), "--resume", "--hidden-size", "64"])
    with pytest.raises(ValueError, match=re.escape("target_config.hidden_size: checkpoint 192, this run 64")):
        target_training.run(args)


def test_train_target_cli_saves_no_model_whose_heldout_loss_is_not_finite(tmp_path, monkeypatch):
    _stub_corpus(monkeypatch)
    tokenizer = types.SimpleNamespace(vocab_size=300, save=lambda path: None)
    monkeypatch.setattr("dspark_jax.tokenizer.train_bpe", lambda texts, size: tokenizer)
    monkeypatch.setattr(target_training, "train_target", lambda *a, **k: TrainResult(model=None, history={}, step=2))
    monkeypatch.setattr(target_training, "heldout_loss", lambda *a, **k: np.nan)
    monkeypatch.setattr("dspark_jax.target.save_target", _must_not_run)
    out = tmp_path / "out"
    want = "target training diverged: its held-out loss nan after step 2; the model was not saved"
    with pytest.raises(ValueError, match=re.escape(want)):
        target_training.run(_parse(target_training, ["--out", str(out), "--vocab-size", "300"]))
    assert not (out / "training.json").exists()


def test_train_target_cli_records_the_loop_time_of_every_session(tmp_path, monkeypatch):
    _stub_corpus(monkeypatch)
    tokenizer = types.SimpleNamespace(vocab_size=300, save=lambda path: None)
    model = Qwen3Target(dataclasses.replace(TARGET_CFG, vocab_size=300), rngs=nnx.Rngs(0))
    result = TrainResult(model=model, history={"loss": [2.5]}, step=2, seconds=42.5)
    monkeypatch.setattr("dspark_jax.tokenizer.train_bpe", lambda texts, size: tokenizer)
    monkeypatch.setattr(target_training, "train_target", lambda *a, **k: result)
    monkeypatch.setattr(target_training, "heldout_loss", lambda *a, **k: 3.0)
    out = tmp_path / "out"
    target_training.run(_parse(target_training, ["--out", str(out), "--vocab-size", "300"]))
    info = json.loads((out / "training.json").read_text())
    assert (info["train_loop_seconds_all_sessions"], info["final_train_loss"], info["heldout_loss"]) == (42.5, 2.5, 3.0)


def test_train_target_warns_when_the_bpe_comes_out_smaller(tmp_path, monkeypatch, capsys):
    corpus = types.SimpleNamespace(texts=lambda split: ["ab ab ab\n"], train_files=["a.py"])
    monkeypatch.setattr("dspark_jax.corpus.load_corpus", lambda: corpus)
    monkeypatch.setattr("dspark_jax.corpus.encode_documents", _must_not_run)
    with pytest.raises(Reached):
        target_training.run(_parse(target_training, ["--out", str(tmp_path / "out"), "--vocab-size", "400"]))
    err = capsys.readouterr().err
    assert re.search(r"warning: --vocab-size 400 asked, but the BPE has \d+ ids", err), err


# --------------------------------------------------------------------------- memory
def _param_count(module) -> int:
    return sum(leaf.size for leaf in jax.tree.leaves(nnx.state(module, nnx.Param)))


def test_training_memory_bound_counts_every_parameter_at_any_depth():
    """The bound, from one- and two-layer traces, equals 16 bytes per parameter of the
    built model plus the step's float32 logits, for a target and a draft of 3 layers."""
    cfg = dataclasses.replace(TARGET_CFG, num_hidden_layers=3)
    tcfg = target_training.TargetTrainConfig(batch_size=2, seq_len=8)
    target = Qwen3Target(cfg, rngs=nnx.Rngs(0))
    want = 16 * _param_count(target) + 4 * 2 * 8 * cfg.vocab_size
    assert target_training.check_target_memory(cfg, tcfg) == want
    draft_cfg = default_draft_config(cfg, mask_token_id=31, gamma=4, markov_rank=8, num_layers=3)
    dcfg = DraftTrainConfig(batch_size=2, seq_len=24, anchors_per_seq=3)
    draft = draft_training._new_draft(draft_cfg, target, 0)
    _, params, _ = nnx.split(draft, nnx.Param, ...)  # what training updates (not the borrowed tables)
    trained = sum(leaf.size for leaf in jax.tree.leaves(params))
    rows = 2 * 3 * draft_cfg.num_query_rows
    assert draft_training.check_draft_memory(draft_cfg, target, dcfg) == 16 * trained + 4 * rows * cfg.vocab_size


def test_train_target_refuses_a_model_beyond_free_memory_before_building_it(monkeypatch):
    monkeypatch.setattr("dspark_jax.memory_gate.free_device_bytes", lambda device=None: 1000)
    monkeypatch.setattr(target_training, "Qwen3Target", _must_not_run_outside_tracing(target_training.Qwen3Target))
    tcfg = target_training.TargetTrainConfig(steps=1, batch_size=2, seq_len=8)
    want = f"hidden_size={TARGET_CFG.hidden_size}, intermediate_size={TARGET_CFG.intermediate_size}, "
    with pytest.raises(
        ValueError, match=re.escape(want) + r".*training needs at least \d+\.\d\d GB .* more than the 0\.00 GB free"
    ):
        target_training.train_target(TARGET_CFG, np.zeros(64, np.int32), tcfg, progress=False)


def _must_not_run_outside_tracing(cls):
    """``cls``, but building one for real (outside ``nnx.eval_shape``) raises :class:`Reached`."""

    def build(cfg, *, rngs):
        module = cls(cfg, rngs=rngs)
        if not isinstance(jax.tree.leaves(nnx.state(module))[0], jax.core.Tracer):
            raise Reached("the model was built before its memory was checked")
        return module

    return build


def test_train_target_cli_refuses_sizes_beyond_free_memory_before_any_work(tmp_path, no_work, monkeypatch):
    """The vocabulary counted (258) is the smallest the tokenizer can have, not the default 2048:
    the message says so."""
    monkeypatch.setattr("dspark_jax.memory_gate.free_device_bytes", lambda device=None: 8 * 10**9)
    out = tmp_path / "out"
    args = _parse(target_training, ["--out", str(out), "--hidden-size", "1000000"])
    want = (
        "--hidden-size 1000000, --intermediate-size 576, --layers 4, --heads 4, --kv-heads 2, --head-dim 48, "
        "--batch 64, --seq-len 256 (vocabulary 258, the smallest the tokenizer can come out with): "
        "training needs at least 151.74 GB (9,483,000,384 parameters "
    )
    platform = jax.devices()[0].platform  # the device whose free memory was read
    free = rf".*more than the 8\.00 GB free on {platform}; lower these sizes"
    with pytest.raises(ValueError, match=re.escape(want) + free):
        target_training.run(args)
    assert not out.exists()


def test_train_draft_cli_refuses_sizes_beyond_free_memory_before_reading_the_corpus(tmp_path, no_work, monkeypatch):
    monkeypatch.setattr("dspark_jax.memory_gate.free_device_bytes", lambda device=None: 8 * 10**9)
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    monkeypatch.setattr("dspark_jax.target.load_target", lambda *a, **k: Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0)))
    want = "--layers, --markov-rank, --gamma (100000 layers, Markov rank 64, γ 7), --batch 16, --anchors 32: "
    with pytest.raises(ValueError, match=re.escape(want) + "training needs at least"):
        draft_training.run(_draft_args(tmp_path, "--layers", "100000"))
    assert not (tmp_path / "draft").exists()


def test_compiled_step_check_counts_xla_buffers_and_arguments_not_yet_allocated():
    """The need is the executable's scratch and unaliased outputs (XLA's analysis) plus the
    bytes of the arguments given as shapes; arrays already on the device are not counted."""
    step = jax.jit(lambda w, x: (w - 0.1 * x.T @ jnp.tanh(x @ w), jnp.sum(x @ w)), donate_argnums=(0,))
    w, x = jnp.ones((64, 32), jnp.float32), jax.ShapeDtypeStruct((128, 64), jnp.float32)
    stats = step.lower(w, x).compile().memory_analysis()
    need = stats.temp_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + 128 * 64 * 4
    compiled = training.compile_training_step(step, (w, x), "width=32", free=need)
    xs = jnp.linspace(-1.0, 1.0, 128 * 64, dtype=jnp.float32).reshape(128, 64)
    jax.tree.map(np.testing.assert_allclose, compiled(jnp.ones((64, 32)), xs), step(jnp.ones((64, 32)), xs))
    with pytest.raises(ValueError, match=r"width=32: one compiled training step needs \d+\.\d\d GB .* more than"):
        training.compile_training_step(step, (w, x), "width=32", free=need - 1)


def _free_after_the_lower_bound(monkeypatch, bound):
    """Free memory that passes the parameter bound by one byte (the step needs more)."""
    monkeypatch.setattr("dspark_jax.memory_gate.free_device_bytes", lambda device=None: bound + 1)


def test_train_target_refuses_a_step_beyond_free_memory_before_training(monkeypatch):
    tcfg = target_training.TargetTrainConfig(steps=1, batch_size=4, seq_len=32)
    _free_after_the_lower_bound(monkeypatch, target_training.check_target_memory(TARGET_CFG, tcfg, sizes="x"))
    monkeypatch.setattr(target_training, "fit", _must_not_run)
    want = f"vocab_size={TARGET_CFG.vocab_size}, batch_size=4, seq_len=32: one compiled training step needs"
    with pytest.raises(ValueError, match=re.escape(want) + r".* GB of activations, logits, gradients and outputs"):
        target_training.train_target(TARGET_CFG, np.zeros(64, np.int32), tcfg, progress=False)


def test_train_draft_refuses_a_step_beyond_free_memory_before_training(monkeypatch):
    target = Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0))
    draft_cfg = default_draft_config(TARGET_CFG, mask_token_id=31, gamma=4, markov_rank=8, num_layers=1)
    tcfg = DraftTrainConfig(steps=1, batch_size=2, seq_len=24, anchors_per_seq=2)
    _free_after_the_lower_bound(monkeypatch, draft_training.check_draft_memory(draft_cfg, target, tcfg, sizes="x"))
    monkeypatch.setattr(draft_training, "fit", _must_not_run)
    want = "batch_size=2, seq_len=24, anchors_per_seq=2: one compiled training step needs"
    with pytest.raises(ValueError, match=re.escape(want)):
        train_draft(target, draft_cfg, np.zeros(64, np.int32), tcfg, progress=False)


def test_training_refuses_float16_parameters_naming_the_field():
    want = "param_dtype='float16' cannot be trained: AdamW's eps and small second moments round to 0"
    cfg = dataclasses.replace(TARGET_CFG, param_dtype="float16")
    tcfg = target_training.TargetTrainConfig(steps=1, batch_size=2, seq_len=8)
    with pytest.raises(ValueError, match="the target's " + re.escape(want)):
        target_training.train_target(cfg, np.zeros(64, np.int32), tcfg, progress=False)
    target = Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0))
    draft_cfg = default_draft_config(TARGET_CFG, mask_token_id=31, gamma=4, markov_rank=8, num_layers=1)
    draft_cfg = dataclasses.replace(draft_cfg, param_dtype="float16")
    with pytest.raises(ValueError, match="the draft's " + re.escape(want)):
        train_draft(
            target,
            draft_cfg,
            np.zeros(64, np.int32),
            DraftTrainConfig(steps=1, seq_len=24, anchors_per_seq=2),
            progress=False,
        )


# --------------------------------------------------------------------------- --calibrate
def test_train_draft_cli_refuses_calibrate_without_a_confidence_head_before_reading_the_corpus(
    tmp_path, no_work, monkeypatch
):
    with pytest.raises(ValueError, match=re.escape("--calibrate greedy is invalid with --no-confidence")):
        draft_training.run(_draft_args(tmp_path, "--calibrate", "greedy", "--no-confidence"))
    cfg = default_draft_config(
        TARGET_CFG, mask_token_id=31, gamma=4, markov_rank=8, num_layers=1, confidence_head=False
    )
    path = tmp_path / "dc.json"
    path.write_text(json.dumps(cfg.to_hf_config()))
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    monkeypatch.setattr("dspark_jax.target.load_target", lambda *a, **k: Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0)))
    want = f"--calibrate sampling is invalid: --draft-config {str(path)!r} has no confidence head"
    with pytest.raises(ValueError, match=re.escape(want)):
        draft_training.run(_draft_args(tmp_path, "--calibrate", "sampling", "--draft-config", str(path)))


def _stub_training(tmp_path, monkeypatch):
    """``train-draft``'s corpus, target, training and evaluation stubbed; returns the target."""
    _stub_corpus(monkeypatch)
    target = Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0))
    cfg = default_draft_config(TARGET_CFG, mask_token_id=31, gamma=4, markov_rank=8, num_layers=1)
    trained = draft_training._new_draft(cfg, target, 0)
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    monkeypatch.setattr("dspark_jax.target.load_target", lambda *a, **k: target)
    result = TrainResult(model=trained, history={}, step=3, seconds=42.5)
    monkeypatch.setattr(draft_training, "train_draft", lambda *a, **k: result)
    monkeypatch.setattr(draft_training, "evaluate_draft", lambda *a, **k: {"ce": 1.0, "tv": 0.5, "bce": 0.6})
    return target


def test_train_draft_cli_calibrates_before_saving_and_records_the_fit(tmp_path, monkeypatch):
    """The trained draft is calibrated on the held-out text, saved with its temperatures, and
    ``training.json`` records the fit (training and the fit itself stubbed: the wiring)."""
    target = _stub_training(tmp_path, monkeypatch)
    calls = []

    def fit(draft, target_, tokens, *, labels, seq_len):
        calls.append((labels, seq_len))
        draft.confidence_head.sts_temperature.set_value(jnp.asarray([0.5, 0.6, 0.7, 0.8], jnp.float32))
        return StsFit([0.5, 0.6, 0.7, 0.8], labels, [0.7] * 4, [0.6] * 4, [0.5] * 4, [0.4] * 4, 12)

    monkeypatch.setattr("dspark_jax.calibration.fit_sts_temperature", fit)
    draft_training.run(
        _draft_args(tmp_path, "--gamma", "4", "--markov-rank", "8", "--layers", "1", "--calibrate", "greedy")
    )
    assert calls == [("greedy", 40)]
    info = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert info["sts_calibration"]["temperatures"] == [0.5, 0.6, 0.7, 0.8]
    assert info["sts_calibration"]["labels"] == "greedy"
    assert info["train_loop_seconds_all_sessions"] == 42.5  # the loop's time over every session (fit)
    saved = load_draft(tmp_path / "draft", target=target)
    np.testing.assert_allclose(saved.confidence_head.sts_temperature[...], [0.5, 0.6, 0.7, 0.8], rtol=1e-6)


def test_a_failed_calibration_keeps_the_trained_draft_and_names_the_flag(tmp_path, monkeypatch):
    """A fit that failed after training raised the calibration's own message and saved nothing."""
    target = _stub_training(tmp_path, monkeypatch)

    def fit(*args, **kwargs):
        raise ValueError("slot 1: no positive temperature lowers the cross-entropy")

    monkeypatch.setattr("dspark_jax.calibration.fit_sts_temperature", fit)
    out = str(tmp_path / "draft")
    want = "--calibrate sampling failed: slot 1: no positive temperature lowers the cross-entropy; the trained draft "
    with pytest.raises(ValueError, match=re.escape(want + f"was saved uncalibrated in --out {out!r}")):
        draft_training.run(
            _draft_args(tmp_path, "--gamma", "4", "--markov-rank", "8", "--layers", "1", "--calibrate=sampling")
        )
    info = json.loads((tmp_path / "draft" / "training.json").read_text())
    assert info["sts_calibration"] == {"error": want.split("; the")[0]}
    saved = load_draft(out, target=target)
    np.testing.assert_array_equal(saved.confidence_head.sts_temperature[...], np.ones(4, np.float32))


def test_train_target_cli_names_the_flags_of_invalid_model_settings(tmp_path, no_work):
    """The messages named config fields: ``seq_len=32 exceeds the target's
    max_position_embeddings=16``, ``num_key_value_heads=3``."""
    for argv, says in (
        (["--seq-len", "32", "--context", "16"], "--seq-len 32 exceeds the target's --context 16"),
        (["--kv-heads", "3"], "--kv-heads 3 "),
    ):
        with pytest.raises(ValueError, match=re.escape(says)) as err:
            target_training.run(_parse(target_training, ["--out", str(tmp_path / "out"), *argv]))
        assert "num_key_value_heads=" not in str(err.value) and "seq_len=" not in str(err.value)


def test_train_draft_cli_names_draft_config_in_its_loading_errors(tmp_path, no_work):
    """A missing, non-JSON or target ``--draft-config`` was reported without naming the flag."""
    (tmp_path / "bad.json").write_text("#!/bin/sh")
    (tmp_path / "target.json").write_text(json.dumps(dataclasses.asdict(TARGET_CFG)))
    for name in ("missing.json", "bad.json", "target.json"):
        path = str(tmp_path / name)
        with pytest.raises(ValueError, match=f"^--draft-config {re.escape(repr(path))}: "):
            draft_training.run(_draft_args(tmp_path, "--draft-config", path))


def test_resuming_a_finished_run_reports_the_loss_it_ended_with(tmp_path):
    def step_fn(params, opt_state, step):
        return params, opt_state, {"loss": jnp.float32(10.0 - step)}

    def run(resume):
        return fit(
            step_fn,
            {"w": jnp.zeros(2)},
            (),
            types.SimpleNamespace(steps=3, log_every=1, checkpoint_every=0),
            name="test",
            run_meta={"seed": 0},
            checkpoint_dir=str(tmp_path / "ckpt"),
            resume=resume,
            progress=False,
            max_seconds=None,
            end=3,
            record_every_step=False,
        )

    _, first, done, _ = run(resume=False)
    assert done == 3 and first["loss"] == [10.0, 9.0, 8.0]
    _, again, done, _ = run(resume=True)  # nothing left to run
    assert done == 3 and again == {"loss": [8.0]}


def test_a_resumed_run_with_nothing_to_run_keeps_what_training_json_recorded(tmp_path):
    """Checkpoints written before they kept their metrics: a resumed, finished run carries the
    earlier ``training.json``'s values over instead of writing null."""
    assert training.recorded_value(str(tmp_path), "final_train_loss") is None  # no file
    (tmp_path / "training.json").write_text(json.dumps({"final_train_loss": 1.25, "final_metrics": {"loss": 2.0}}))
    assert training.recorded_value(str(tmp_path), "final_train_loss") == 1.25
    assert training.recorded_value(str(tmp_path), "final_metrics") == {"loss": 2.0}
    assert training.recorded_value(str(tmp_path), "absent") is None
    (tmp_path / "training.json").write_text("{not json")
    assert training.recorded_value(str(tmp_path), "final_train_loss") is None


def test_lm_loss_is_the_mean_cross_entropy_of_each_next_token():
    """``lm_loss`` equals a NumPy cross-entropy of the target's own logits: the logits at
    position ``t`` (from ``tokens[:, :t + 1]``) scored against ``tokens[:, t + 1]``, averaged
    over every row and position. Scoring them against ``tokens[:, t]`` (copying the input)
    gives a clearly different number on these random tokens."""
    from draft_testing import randomize

    target = Qwen3Target(TARGET_CFG, rngs=nnx.Rngs(0))
    randomize(target, seed=1)
    tokens = np.random.default_rng(2).integers(0, TARGET_CFG.vocab_size, (2, 7)).astype(np.int32)
    b, s = tokens.shape
    positions = np.broadcast_to(np.arange(s - 1, dtype=np.int32), (b, s - 1))
    logits, _, _ = target(jnp.asarray(tokens[:, :-1]), jnp.asarray(positions), target.init_cache(b, s - 1))
    logits = np.asarray(logits, np.float64)  # [B, S-1, V]

    def cross_entropy(labels):
        top = logits.max(-1, keepdims=True)
        log_z = np.log(np.exp(logits - top).sum(-1)) + top[..., 0]
        return float(np.mean(log_z - np.take_along_axis(logits, labels[..., None], -1)[..., 0]))

    want = cross_entropy(tokens[:, 1:])
    assert abs(cross_entropy(tokens[:, :-1]) - want) > 0.1  # the two labellings are told apart
    got = float(target_training.lm_loss(target, jnp.asarray(tokens)))
    np.testing.assert_allclose(got, want, rtol=1e-5)
