"""The training loop both trainers share (``dspark_jax.training``): schedule, optimizer,
token windows, config checks and ``fit``'s logging, time limit and divergence checks."""

import json
import math
import os
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dspark_jax import training
from dspark_jax.draft_training import DraftTrainConfig
from dspark_jax.training import CHECKPOINT_META, check_token_stream, fit, lr_schedule, make_optimizer, sample_windows


def _reference_schedule(step: int, steps: int, lr: float, warmup: int) -> float:
    """Linear warmup from 0 over ``warmup`` steps, then cosine decay to 0 at ``steps``."""
    if step < warmup:
        return lr * step / warmup
    return lr * 0.5 * (1 + math.cos(math.pi * min(step - warmup, steps - warmup) / (steps - warmup)))


@pytest.mark.parametrize("warmup_frac", [0.037, 0.035, 0.0])
def test_lr_schedule_warms_up_over_the_rounded_fraction_of_the_steps(warmup_frac):
    """The warmup lasts ``max(1, round(warmup_frac · steps))`` steps: 3.7 rounds to 4 (not 3)."""
    steps, lr = 100, 1.0
    warmup = max(1, round(warmup_frac * steps))
    sched = lr_schedule(steps, lr, warmup_frac)
    got = [float(sched(s)) for s in range(steps + 1)]
    want = [_reference_schedule(s, steps, lr, warmup) for s in range(steps + 1)]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_weight_decay_shrinks_the_parameters_by_the_scheduled_rate():
    """With zero gradients AdamW's step is ``−lr_t · weight_decay · p`` (decoupled decay);
    ``make_optimizer`` passes its ``weight_decay`` on."""
    steps, lr, decay = 10, 0.5, 0.1
    opt = make_optimizer(steps, lr, warmup_frac=0.2, weight_decay=decay)
    params = {"w": jnp.asarray([2.0, -4.0])}
    state = opt.init(params)
    want = np.asarray(params["w"], np.float64)
    for step in range(4):
        updates, state = opt.update({"w": jnp.zeros(2)}, state, params)
        params = jax.tree.map(lambda p, u: p + u, params, updates)
        want = want * (1 - _reference_schedule(step, steps, lr, warmup=2) * decay)
    np.testing.assert_allclose(params["w"], want, rtol=1e-6)
    assert not np.allclose(want, [2.0, -4.0])


def test_windows_reach_the_last_tokens_of_the_stream():
    """Window starts cover ``0 … len − seq_len``: the stream's last ``seq_len`` tokens are a window."""
    tokens = np.arange(9, dtype=np.int32)
    windows = sample_windows(tokens, 400, 8, np.random.default_rng(0))
    assert {tuple(w) for w in windows} == {tuple(range(8)), tuple(range(1, 9))}


def test_a_token_id_equal_to_the_vocabulary_size_is_refused():
    with pytest.raises(ValueError, match=re.escape("must lie in [0, vocab_size=16)")):
        check_token_stream(np.array([0, 3, 16], np.int32), seq_len=2, vocab_size=16)
    assert check_token_stream(np.array([0, 3, 15], np.int64), seq_len=2, vocab_size=16).dtype == np.int32


def test_a_warmup_over_the_whole_run_is_refused():
    with pytest.raises(ValueError, match=re.escape("warmup_frac=1.0 is invalid: must lie in [0, 1)")):
        DraftTrainConfig(warmup_frac=1.0)


# --------------------------------------------------------------------------- fit
def _fit(step_fn, *, steps, log_every, record_every_step, checkpoint_dir=None, resume=False, max_seconds=None):
    tcfg = types.SimpleNamespace(steps=steps, log_every=log_every, checkpoint_every=0)
    return fit(
        step_fn, {"w": jnp.ones(2)}, (), tcfg, name="test", run_meta={}, checkpoint_dir=checkpoint_dir,
        resume=resume, progress=False, max_seconds=max_seconds, end=steps, record_every_step=record_every_step,
    )  # fmt: skip


def _losses(params, opt_state, step):
    return params, opt_state, {"loss": jnp.float32(100.0 - step)}


@pytest.mark.parametrize("record_every_step", [False, True])
def test_history_holds_the_logged_steps_and_always_the_last(record_every_step):
    """Logged steps are the multiples of ``log_every`` and the last step; with
    ``record_every_step`` every step is recorded whatever ``log_every`` is."""
    _, history, done, _ = _fit(_losses, steps=5, log_every=2, record_every_step=record_every_step)
    logged = [1, 2, 3, 4, 5] if record_every_step else [2, 4, 5]
    assert done == 5 and history["loss"] == [100.0 - (s - 1) for s in logged]


def test_the_time_limit_stops_and_checkpoints_the_run(tmp_path, monkeypatch):
    """Each step takes 10 s on a fake clock; ``max_seconds=25`` stops after the step that
    passes it (the third), and that step is checkpointed."""
    clock = [0.0]
    monkeypatch.setattr(training.time, "perf_counter", lambda: clock[0])

    def step_fn(params, opt_state, step):
        clock[0] += 10.0
        return _losses(params, opt_state, step)

    ckpt = str(tmp_path / "ckpt")
    _, history, done, seconds = _fit(step_fn, steps=10, log_every=100, record_every_step=False, checkpoint_dir=ckpt,
                                     max_seconds=25.0)  # fmt: skip
    assert (done, seconds, history["loss"]) == (3, 30.0, [98.0])
    with open(os.path.join(ckpt, CHECKPOINT_META)) as f:
        assert json.load(f)["step"] == 3


def test_a_finished_run_resumed_reports_its_checkpoints_seconds_however_long_the_call(tmp_path, monkeypatch):
    """Resuming a run with no step left runs no training: its seconds are the checkpoint's,
    not the checkpoint's plus the time the call itself took."""
    clock = [0.0]

    def tick():
        clock[0] += 5.0  # every read of the clock takes 5 s
        return clock[0]

    monkeypatch.setattr(training.time, "perf_counter", tick)
    ckpt = str(tmp_path / "ckpt")
    _fit(_losses, steps=2, log_every=1, record_every_step=True, checkpoint_dir=ckpt)
    with open(os.path.join(ckpt, CHECKPOINT_META)) as f:
        recorded = json.load(f)["seconds"]
    *_, again = _fit(_losses, steps=2, log_every=1, record_every_step=True, checkpoint_dir=ckpt, resume=True)
    assert again == recorded > 0


def test_parameters_that_turn_nan_at_the_last_step_stop_a_run_without_checkpoints():
    """The parameters are checked at the end too, not only before a checkpoint: a run with
    no checkpoint folder whose last step made them NaN (at a finite loss) is refused."""

    def step_fn(params, opt_state, step):
        params = jax.tree.map(lambda p: p * jnp.nan, params) if step == 2 else params
        return params, opt_state, {"loss": jnp.float32(1.0)}

    with pytest.raises(ValueError, match=re.escape("the parameters hold NaN or infinite values after step 3")):
        _fit(step_fn, steps=3, log_every=10, record_every_step=False)


# --------------------------------------------------------------------------- train state
def test_train_state_round_trips_bfloat16_leaves_bit_for_bit(tmp_path):
    """A ``param_dtype='bfloat16'`` run could not resume: ``.npz`` stored its leaves as raw
    2-byte records that NumPy could not cast back (``No cast function available``)."""
    rng = np.random.default_rng(0)
    tree = {
        "w": jnp.asarray(rng.normal(size=(3, 5)), jnp.bfloat16),
        "b": jnp.asarray(rng.normal(size=()), jnp.bfloat16),
        "mu": jnp.asarray(rng.normal(size=4), jnp.float32),
        "count": jnp.asarray(7, jnp.int32),
    }
    training.save_train_state(str(tmp_path), tree, {"step": 3})
    like = jax.tree.map(jnp.zeros_like, tree)
    back, meta = training.load_train_state(str(tmp_path), like)
    assert meta["step"] == 3
    for name, leaf in tree.items():
        assert back[name].dtype == leaf.dtype
        np.testing.assert_array_equal(
            np.asarray(back[name]).reshape(-1).view(np.uint8), np.asarray(leaf).reshape(-1).view(np.uint8)
        )


def test_a_bfloat16_run_resumes_where_an_uninterrupted_run_ends(tmp_path):
    """``fit`` over a bfloat16 parameter: two steps, a checkpoint, one more on resume, equal
    to three steps in one go."""

    def step_fn(params, opt_state, step):
        return jax.tree.map(lambda p: (p * 0.5 + 1).astype(p.dtype), params), opt_state, {"loss": jnp.float32(1.0)}

    def run(end, **kw):
        tcfg = types.SimpleNamespace(steps=3, log_every=1, checkpoint_every=0)
        params = {"w": jnp.asarray([0.3, -2.7], jnp.bfloat16)}
        return fit(step_fn, params, (), tcfg, name="test", run_meta={}, progress=False, max_seconds=None, end=end,
                   record_every_step=True, **kw)[0]  # fmt: skip

    whole = run(3, checkpoint_dir=None, resume=False)
    ckpt = str(tmp_path / "ckpt")
    run(2, checkpoint_dir=ckpt, resume=False)
    resumed = run(3, checkpoint_dir=ckpt, resume=True)
    assert resumed["w"].dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(resumed["w"], np.float32), np.asarray(whole["w"], np.float32))


def test_malformed_dtypes_in_a_train_state_are_named(tmp_path):
    tree = {"w": jnp.ones(2, jnp.bfloat16)}
    training.save_train_state(str(tmp_path), tree, {"step": 1})
    path = os.path.join(str(tmp_path), CHECKPOINT_META)
    with open(path) as f:
        meta = json.load(f)
    meta["dtypes"] = "bfloat16"
    with open(path, "w") as f:
        json.dump(meta, f)
    with pytest.raises(ValueError, match=re.escape("has dtypes='bfloat16': expected one dtype name per array")):
        training.load_train_state(str(tmp_path), tree)
