"""The ``train-draft`` and ``train-target`` command lines refuse bad options before any work.

Loading, corpus reading, BPE training and training are stubbed: a refusal must come
before them, so reaching one is a failure.
"""

import argparse
import json
import os
import re
import types

import jax.numpy as jnp
import pytest
from draft_testing import TRAINING_TARGET

from dspark_jax import target_training, train
from dspark_jax.tokenizer import train_bpe
from dspark_jax.train import DraftTrainConfig, default_draft_config, fit, train_draft

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
        "dspark_jax.train.train_draft",
        "dspark_jax.target_training.train_target",
    ):
        monkeypatch.setattr(name, _must_not_run)


def _parse(module, argv):
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    return parser.parse_args(argv)


def _model_folder(path):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text("{}")
    return path


def _draft_args(tmp_path, *extra, out=None):
    target = _model_folder(tmp_path / "target")
    out = tmp_path / "draft" if out is None else out
    return _parse(train, ["--target", str(target), "--out", str(out), "--seq-len", "40", *extra])


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
        train.run(_draft_args(tmp_path, "--distill", "4", "--batch", "1"))


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--distill", "-1"], "--distill -1 is invalid: must be an integer >= 0"),
        (["--distill", "2", "--seq-len", "16"], "--seq-len 16 is too short for --distill 2"),
    ],
    ids=["negative", "no-room-after-prompt"],
)
def test_train_draft_cli_refuses_bad_distill_before_loading(tmp_path, no_work, extra, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        train.run(_draft_args(tmp_path, *extra))


def test_train_draft_cli_refuses_out_equal_to_target(tmp_path, no_work):
    target = _model_folder(tmp_path / "target")
    os.symlink(target, tmp_path / "link")
    for out in (target, tmp_path / "link", tmp_path / "target" / "."):
        args = _parse(train, ["--target", str(target), "--out", str(out)])
        with pytest.raises(ValueError, match=re.escape(f"--out {str(out)!r} is the --target folder")):
            train.run(args)
    assert (target / "config.json").read_text() == "{}"


@pytest.mark.parametrize("module", [train, target_training], ids=["draft", "target"])
def test_training_cli_refuses_an_out_folder_holding_a_model(tmp_path, no_work, module):
    out = _model_folder(tmp_path / "old")
    argv = ["--out", str(out)] + (["--target", str(_model_folder(tmp_path / "target"))] if module is train else [])
    with pytest.raises(ValueError, match=re.escape(f"--out {str(out)!r} already holds a model (config.json)")):
        module.run(_parse(module, argv))
    afile = tmp_path / "afile"
    afile.write_text("x")
    argv[1] = str(afile)
    with pytest.raises(ValueError, match=re.escape(f"--out {str(afile)!r} is an existing file")):
        module.run(_parse(module, argv))


@pytest.mark.parametrize("module", [train, target_training], ids=["draft", "target"])
def test_training_cli_resume_without_a_checkpoint_is_refused_before_any_work(tmp_path, no_work, module):
    out = tmp_path / "fresh"
    argv = ["--out", str(out), "--resume"]
    if module is train:
        argv += ["--target", str(_model_folder(tmp_path / "target"))]
    with pytest.raises(ValueError, match="--resume needs a training checkpoint in --out"):
        module.run(_parse(module, argv))
    assert not out.exists()


def test_train_draft_cli_refuses_shape_flags_with_a_draft_config(tmp_path, no_work):
    args = _draft_args(tmp_path, "--draft-config", "dc.json", "--gamma", "3", "--layers", "1", "--no-confidence")
    with pytest.raises(
        ValueError, match=re.escape("--gamma 3, --layers 1, --no-confidence conflict with --draft-config")
    ):
        train.run(args)


def test_train_draft_cli_refuses_a_draft_config_with_another_mask_id(tmp_path, no_work, monkeypatch):
    cfg = default_draft_config(TARGET_CFG, mask_token_id=5, gamma=4, markov_rank=8, num_layers=1)
    path = tmp_path / "dc.json"
    path.write_text(json.dumps(cfg.to_hf_config()))
    monkeypatch.setattr("dspark_jax.tokenizer.load_tokenizer", lambda path: types.SimpleNamespace(mask_id=31))
    with pytest.raises(
        ValueError, match=re.escape("has mask_token_id=5: must equal the --target tokenizer's mask id 31")
    ):
        train.run(_draft_args(tmp_path, "--draft-config", str(path)))


# --------------------------------------------------------------------------- both
@pytest.mark.parametrize("module", [train, target_training], ids=["draft", "target"])
@pytest.mark.parametrize("value", ["nan", "0", "-5", "inf"])
def test_max_seconds_must_be_a_finite_positive_number(module, value, capsys):
    argv = ["--out", "o", "--max-seconds", value] + (["--target", "t"] if module is train else [])
    with pytest.raises(SystemExit):
        _parse(module, argv)
    assert "must be a finite number of seconds > 0" in capsys.readouterr().err
    assert _parse(module, argv[:2] + ["--max-seconds", "1.5"] + argv[4:]).max_seconds == 1.5


def test_fit_refuses_a_non_positive_time_limit():
    with pytest.raises(ValueError, match=re.escape("max_seconds=0.0 is invalid: must be a finite number > 0")):
        _fit({}, None, max_seconds=0.0)


def _fit(meta, checkpoint_dir, *, resume=False, max_seconds=None):
    def step_fn(params, opt_state, step):
        return params, opt_state, {"loss": jnp.float32(1.0)}

    tcfg = types.SimpleNamespace(steps=2, log_every=1, checkpoint_every=0)
    return fit(
        step_fn,
        {"w": jnp.zeros(2)},
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


def test_resume_mismatch_names_each_differing_setting(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    _fit({"train_config": {"steps": 8, "lr": 0.1}, "model": {"layers": 2}}, ckpt)
    with pytest.raises(ValueError, match="cannot resume") as info:
        _fit({"train_config": {"steps": 9, "lr": 0.1}, "model": {"layers": 3}}, ckpt, resume=True)
    assert "model.layers: checkpoint 2, this run 3; train_config.steps: checkpoint 8, this run 9" in str(info.value)
    assert "lr" not in str(info.value)


# --------------------------------------------------------------------------- train-target
def test_train_target_refuses_a_tiny_vocabulary_before_creating_out(tmp_path, no_work):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=re.escape("--vocab-size 10 is invalid: must be an integer >= 258")):
        target_training.run(_parse(target_training, ["--out", str(out), "--vocab-size", "10"]))
    assert not out.exists()


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


def test_train_target_warns_when_the_bpe_comes_out_smaller(tmp_path, monkeypatch, capsys):
    corpus = types.SimpleNamespace(texts=lambda split: ["ab ab ab\n"], train_files=["a.py"])
    monkeypatch.setattr("dspark_jax.corpus.load_corpus", lambda: corpus)
    monkeypatch.setattr("dspark_jax.corpus.encode_documents", _must_not_run)
    with pytest.raises(Reached):
        target_training.run(_parse(target_training, ["--out", str(tmp_path / "out"), "--vocab-size", "400"]))
    err = capsys.readouterr().err
    assert re.search(r"warning: --vocab-size 400 asked, but the BPE has \d+ ids", err), err
