"""The training loop the draft and target trainers share (DSPARK_SPEC.md §6's optimizer).

AdamW with warmup and cosine decay, the checks of a schedule's fields, token windows, the
train-state checkpoint a run resumes from (parameters, optimizer state, step and the
settings it was started with), the memory check and the compiled step before any training,
the output folder's rules, and :func:`fit`, the loop itself: it stops a diverging run before
anything is saved. :mod:`dspark_jax.draft_training` and :mod:`dspark_jax.target_training`
each supply a loss and a batch.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.cli import SEED_MAX, number_flag
from dspark_jax.config import is_integer, is_real, read_json_file

CHECKPOINT_ARRAYS = "train_state.npz"
CHECKPOINT_META = "train_state.json"
MODEL_FILES = ("config.json", "model.safetensors")  # a folder holding one of these holds a model
INT32_MAX = 2**31 - 1  # step counts, token ids, positions and anchors reach the device as int32
FLOAT32_MAX = float(np.finfo(np.float32).max)  # lr, weight decay and loss weights enter float32 maths


def lr_schedule(steps: int, lr: float, warmup_frac: float = 0.04) -> optax.Schedule:
    """Linear warmup from 0 over ``max(1, round(warmup_frac·steps))`` steps, then cosine decay to 0 at ``steps``."""
    warmup = max(1, round(warmup_frac * steps))
    return optax.warmup_cosine_decay_schedule(0.0, lr, warmup, max(steps, warmup + 1), end_value=0.0)


def make_optimizer(
    steps: int, lr: float, *, warmup_frac: float = 0.04, weight_decay: float = 0.0, clip_norm: float = 1.0
) -> optax.GradientTransformation:
    """AdamW on :func:`lr_schedule`, after clipping the gradient's global norm to ``clip_norm``.

    ``clip_norm=float("inf")`` never clips.
    """
    schedule = lr_schedule(steps, lr, warmup_frac)
    return optax.chain(optax.clip_by_global_norm(clip_norm), optax.adamw(schedule, weight_decay=weight_decay))


def check_number(name: str, value: Any) -> None:
    """Raises ``TypeError`` unless ``value`` is a real number (Python or NumPy; not a bool)."""
    if not is_real(value):
        raise TypeError(f"{name}={value!r} has type {type(value).__name__}: must be a number")


def check_weight(name: str, value: Any) -> None:
    """Raises unless ``value`` is a number in ``[0, FLOAT32_MAX]`` (a weight decay or a loss weight).

    Raises:
      TypeError: ``value`` is not a number.
      ValueError: ``value`` is negative, NaN, or beyond float32's range (infinite there).
    """
    check_number(name, value)
    if not 0 <= value <= FLOAT32_MAX:
        raise ValueError(
            f"{name}={value!r} is invalid: must be a finite number >= 0 and <= {FLOAT32_MAX!r} "
            "(float32's largest; the training maths runs in float32)"
        )


def check_schedule_fields(cfg: Any, counts: tuple[str, ...]) -> None:
    """Validates the fields every trainer config shares.

    Args:
      cfg: a trainer config with ``lr``, ``warmup_frac``, ``weight_decay``,
        ``clip_norm``, ``seed`` and ``checkpoint_every``.
      counts: names of its fields that must be integers ``>= 1``.

    Raises:
      TypeError: a float field (``lr``, ``warmup_frac``, ``weight_decay``, ``clip_norm``)
        is not a number, naming it.
      ValueError: naming the first invalid field and what is allowed: counts and
        ``checkpoint_every`` above ``INT32_MAX``, ``seed`` above ``SEED_MAX``, ``lr`` or
        ``weight_decay`` above ``FLOAT32_MAX`` are refused too.
    """
    bounds = [*((name, 1, INT32_MAX) for name in counts), ("checkpoint_every", 0, INT32_MAX), ("seed", 0, SEED_MAX)]
    for name, low, high in bounds:
        value = getattr(cfg, name)
        if not is_integer(value) or not low <= value <= high:
            raise ValueError(f"{name}={value!r} is invalid: must be an integer >= {low} and <= {high}")
    for name in ("lr", "warmup_frac", "weight_decay", "clip_norm"):
        check_number(name, getattr(cfg, name))
    if not 0 < cfg.lr <= FLOAT32_MAX:
        raise ValueError(
            f"lr={cfg.lr!r} is invalid: must be a finite number > 0 and <= {FLOAT32_MAX!r} "
            "(float32's largest; the optimizer runs in float32)"
        )
    if not cfg.clip_norm > 0:  # inf is allowed: no clipping
        raise ValueError(f"clip_norm={cfg.clip_norm!r} is invalid: must be > 0 (inf: no clipping)")
    if not 0 <= cfg.warmup_frac < 1:
        raise ValueError(f"warmup_frac={cfg.warmup_frac!r} is invalid: must lie in [0, 1)")
    check_weight("weight_decay", cfg.weight_decay)


def optimizer_for(tcfg: Any) -> optax.GradientTransformation:
    """:func:`make_optimizer` with a trainer config's steps, lr, warmup_frac, weight_decay and clip_norm."""
    return make_optimizer(
        tcfg.steps, tcfg.lr, warmup_frac=tcfg.warmup_frac, weight_decay=tcfg.weight_decay, clip_norm=tcfg.clip_norm
    )


def sample_windows(tokens: np.ndarray, batch: int, seq_len: int, rng: np.random.Generator) -> np.ndarray:
    """``batch`` random windows of ``seq_len`` consecutive tokens: ``[B, S]`` int32."""
    starts = rng.integers(0, len(tokens) - seq_len + 1, size=batch)
    return tokens[starts[:, None] + np.arange(seq_len)].astype(np.int32)


def check_token_stream(tokens: np.ndarray, seq_len: int, vocab_size: int) -> np.ndarray:
    """Validates a flat training token stream; returns it as int32."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ValueError(f"tokens must be a 1-D integer array, got shape {tokens.shape} dtype {tokens.dtype}")
    if tokens.size == 0:
        raise ValueError("the training corpus is empty: tokens has no elements")
    if tokens.size < seq_len:
        raise ValueError(f"the training corpus has {tokens.size} tokens, fewer than seq_len={seq_len}")
    if tokens.min() < 0 or tokens.max() >= vocab_size:
        raise ValueError(
            f"tokens hold ids in [{tokens.min()}, {tokens.max()}]: must lie in [0, vocab_size={vocab_size})"
        )
    return tokens.astype(np.int32)


def save_train_state(path: str, tree: Any, meta: dict) -> None:
    """Writes every leaf of ``tree`` (parameters, optimizer state) and ``meta`` (step, seed, …).

    ``.npz`` files hold NumPy's own dtypes only: a bfloat16 leaf (a ``param_dtype='bfloat16'``
    run) is stored as its 16-bit pattern (``uint16``) and ``meta``'s ``"dtypes"`` names every
    leaf's dtype, so :func:`load_train_state` reads it back bit for bit.
    """
    os.makedirs(path, exist_ok=True)
    arrays = [np.asarray(x) for x in jax.tree.leaves(tree)]
    stored = {
        f"leaf_{i:05d}": a.view(f"u{a.dtype.itemsize}") if a.dtype.kind == "V" else a  # "V": bfloat16's kind
        for i, a in enumerate(arrays)
    }
    tmp = os.path.join(path, CHECKPOINT_ARRAYS + ".tmp.npz")
    np.savez(tmp, **stored)
    os.replace(tmp, os.path.join(path, CHECKPOINT_ARRAYS))
    dtypes = [a.dtype.name for a in arrays]
    with open(os.path.join(path, CHECKPOINT_META), "w") as f:
        json.dump({**meta, "num_leaves": len(arrays), "dtypes": dtypes}, f, indent=2)


def read_train_meta(path: str) -> dict:
    """The metadata of a checkpoint written by :func:`save_train_state` (no array is read).

    Raises:
      ValueError: the checkpoint is missing, or its metadata is not a JSON object.
    """
    meta_path = os.path.join(path, CHECKPOINT_META)
    if not os.path.isfile(meta_path):
        raise ValueError(f"no training checkpoint in {path!r}: {CHECKPOINT_META} is missing")
    meta = read_json_file(meta_path)
    if not isinstance(meta, dict):
        raise ValueError(f"{meta_path!r} holds a JSON {type(meta).__name__}: expected an object")
    return meta


def check_resume_settings(path: str, run_meta: dict[str, Any]) -> None:
    """Refuses to resume from the checkpoint in ``path`` unless it was written with ``run_meta``'s settings.

    Only the metadata is read, so a changed setting is named before any array is loaded.

    Raises:
      ValueError: the checkpoint is missing or malformed, or a setting differs (naming
        each one with both values).
    """
    meta = read_train_meta(path)
    differ = settings_differences({key: meta.get(key) for key in run_meta}, run_meta)
    if differ:
        raise ValueError(
            f"checkpoint {path!r} was written by a run with other settings; cannot resume: " + "; ".join(differ)
        )


def load_train_state(path: str, like: Any) -> tuple[Any, dict]:
    """Reads a checkpoint written by :func:`save_train_state` into the structure of ``like``.

    Raises:
      ValueError: the checkpoint is missing, its metadata is not a JSON object or names
        malformed dtypes, or its arrays do not fit ``like``.
    """
    meta = read_train_meta(path)
    leaves, treedef = jax.tree.flatten(like)
    if meta["num_leaves"] != len(leaves):
        raise ValueError(f"checkpoint {path!r} has {meta['num_leaves']} arrays; this model needs {len(leaves)}")
    dtypes = meta.get("dtypes")  # absent from checkpoints written before bfloat16 leaves were kept
    if dtypes is not None and not (
        isinstance(dtypes, list) and len(dtypes) == len(leaves) and all(isinstance(d, str) for d in dtypes)
    ):
        raise ValueError(f"checkpoint {path!r} has dtypes={dtypes!r}: expected one dtype name per array")
    with np.load(os.path.join(path, CHECKPOINT_ARRAYS)) as data:
        new = []
        for i, ref in enumerate(leaves):
            value = data[f"leaf_{i:05d}"]
            if dtypes is not None and value.dtype.name != dtypes[i]:  # a bit pattern (save_train_state)
                value = value.view(jnp.dtype(dtypes[i]))
            if value.shape != np.shape(ref):
                raise ValueError(f"checkpoint array {i} has shape {value.shape}; the model needs {np.shape(ref)}")
            new.append(jnp.asarray(value, dtype=jnp.asarray(ref).dtype))
    return jax.tree.unflatten(treedef, new), meta


class Progress:
    """A one-line progress bar on stderr, redrawn in place (no dependency)."""

    def __init__(self, total: int, *, enabled: bool = True, stream=None):
        self.total, self.enabled = total, enabled
        self.stream = stream or sys.stderr
        self.start = time.perf_counter()
        self.first_step: int | None = None

    def update(self, step: int, metrics: dict[str, float]) -> None:
        """Redraws the bar at ``step`` with ``metrics`` and the rate in steps per second since
        the first update (so resuming does not count the skipped steps)."""
        if not self.enabled:
            return
        if self.first_step is None:
            self.first_step, self.start = step, time.perf_counter()
        rate = (step - self.first_step) / max(time.perf_counter() - self.start, 1e-9)
        terms = " ".join(f"{k} {v:.4f}" for k, v in metrics.items())
        self.stream.write(f"\r  step {step}/{self.total} | {terms} | {rate:.1f} step/s ")
        self.stream.flush()

    def close(self) -> None:
        """Ends the bar's line."""
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def settings_differences(saved: Any, wanted: Any, name: str = "") -> list[str]:
    """Each setting that differs between a checkpoint's metadata and this run's, as text.

    Dictionaries are compared key by key (``train_config.steps``); other values whole.

    Returns:
      ``"NAME: checkpoint X, this run Y"`` for every difference, sorted by name; empty
      when the settings agree.
    """
    if isinstance(saved, dict) and isinstance(wanted, dict):
        out = []
        for key in sorted(set(saved) | set(wanted), key=str):
            child = f"{name}.{key}" if name else str(key)
            out += settings_differences(saved.get(key), wanted.get(key), child)
        return out
    return [] if saved == wanted else [f"{name}: checkpoint {saved!r}, this run {wanted!r}"]


def check_max_seconds(max_seconds: float | None) -> None:
    """Raises ``ValueError`` unless ``max_seconds`` is ``None`` or a finite number ``> 0``."""
    if max_seconds is None:
        return
    if not (is_real(max_seconds) and 0 < max_seconds < math.inf):
        raise ValueError(f"max_seconds={max_seconds!r} is invalid: must be a finite number > 0 or None")


def positive_seconds(text: str) -> float:
    """Argparse type of ``--max-seconds``: a finite number of seconds ``> 0``."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"{text!r} is invalid: must be a finite number of seconds > 0")
    return value


TRAINING_BYTES_PER_PARAM = 16  # float32 weights, gradients and AdamW's two moments


def check_training_memory(
    sizes: str,
    build: Callable[[int], nnx.Module],
    layers: int,
    *,
    activations: tuple[str, int] | None = None,
    free: int | None = None,
) -> int:
    """Refuses, before anything is allocated, a training run that cannot fit in memory.

    The lower bound counts the ``nnx.Param`` leaves of the model at :data:`TRAINING_BYTES_PER_PARAM`
    bytes each, plus the ``activations`` bytes named there (a tensor every step must hold);
    the run needs more. The count comes from ``build(1)`` and ``build(2)``, traced, never
    built (``nnx.eval_shape``): every decoder layer holds the same parameters, so ``layers``
    of them hold ``p(1) + (layers − 1)·(p(2) − p(1))``, at any depth in the same time.

    Args:
      sizes: the settings that set the sizes, named as the user gave them (flags).
      build: makes the model to be trained with the given number of decoder layers.
      layers: the model's decoder layers.
      activations: ``(what, bytes)`` of one step's largest tensor, or ``None``.
      free: the free bytes to compare with; default the first device's
        (:func:`~dspark_jax.memory_gate.free_device_bytes`; no check when unknown).

    Returns:
      The lower bound in bytes.

    Raises:
      ValueError: the lower bound exceeds the free memory, naming ``sizes`` and both parts.
    """
    from dspark_jax.memory_gate import free_device_bytes

    one, two = (
        sum(leaf.size for leaf in jax.tree.leaves(nnx.state(nnx.eval_shape(functools.partial(build, n)), nnx.Param)))
        for n in (1, 2)
    )
    params = one + (layers - 1) * (two - one)
    what, extra = activations or ("", 0)
    need = TRAINING_BYTES_PER_PARAM * params + extra
    free = free_device_bytes() if free is None else free
    if free is not None and need > free:
        parts = f"{params:,} parameters at {TRAINING_BYTES_PER_PARAM} bytes: float32 weights, gradients, AdamW moments"
        if extra:
            parts += f" + {extra / 1e9:.2f} GB of {what}"
        raise ValueError(
            f"{sizes}: training needs at least {need / 1e9:.2f} GB ({parts}), more than the "
            f"{free / 1e9:.2f} GB free on {jax.devices()[0].platform}; lower these sizes"
        )
    return need


def check_trainable_dtype(what: str, cfg: Any) -> None:
    """Raises ``ValueError`` when ``cfg.param_dtype`` is float16, which AdamW cannot train.

    AdamW's ``eps`` (1e-8) and small second moments round to 0 in float16, so its first
    update divides by zero and the parameters become infinite (bfloat16 keeps float32's
    exponent range and trains).
    """
    if cfg.param_dtype == "float16":
        raise ValueError(
            f"{what} param_dtype='float16' cannot be trained: AdamW's eps and small second moments round to 0 in "
            "float16 and the first update makes the parameters infinite; train with param_dtype='float32' (or "
            "'bfloat16') and save as float16 afterwards"
        )


def compile_training_step(step: Callable, args: tuple, sizes: str, *, free: int | None = None) -> Callable:
    """Compiles a jitted training ``step`` for ``args`` and refuses a run it cannot fit.

    XLA's buffer assignment of the compiled step is exact where :func:`check_training_memory`
    is a lower bound: the scratch area (the activations kept for the gradients, the logits,
    the gradients), the outputs that reuse no donated argument, and every leaf of ``args``
    not yet on the device (given as ``jax.ShapeDtypeStruct``: the parameters and optimizer
    state about to be built, the batch). Leaves that are arrays are already allocated, so
    the free memory has counted them. The executables are cached per ``step`` and argument
    shapes, so runs of the same models and settings in one process compile once.

    Args:
      step: a ``jax.jit``-wrapped training step.
      args: its arguments: arrays, or ``jax.ShapeDtypeStruct`` where they do not exist yet.
      sizes: the settings that set the sizes, for the message.
      free: the free bytes to compare with; default the first device's
        (:func:`~dspark_jax.memory_gate.free_device_bytes`; no check when unknown).

    Returns:
      The compiled step, to be called with arrays of ``args``' shapes and dtypes.

    Raises:
      ValueError: the step needs more than the free memory, naming ``sizes`` and the parts.
    """
    from dspark_jax.memory_gate import executable_bytes, free_device_bytes

    leaves, treedef = jax.tree.flatten(args)
    shapes = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype, weak_type=getattr(x, "weak_type", False)) for x in leaves)
    compiled = _compiled_step(step, treedef, shapes)
    scratch = executable_bytes(compiled)
    free = free_device_bytes() if free is None else free
    if scratch is None or free is None:
        return compiled
    pending = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in leaves if not isinstance(x, jax.Array))
    if scratch + pending > free:
        raise ValueError(
            f"{sizes}: one compiled training step needs {(scratch + pending) / 1e9:.2f} GB (XLA's buffers: "
            f"{scratch / 1e9:.2f} GB of activations, logits, gradients and outputs, {pending / 1e9:.2f} GB of "
            f"parameters, optimizer state and batch), more than the {free / 1e9:.2f} GB free on "
            f"{jax.devices()[0].platform}; lower these sizes"
        )
    return compiled


@functools.lru_cache(maxsize=8)
def _compiled_step(step: Callable, treedef: Any, shapes: tuple[jax.ShapeDtypeStruct, ...]) -> Callable:
    return step.lower(*jax.tree.unflatten(treedef, shapes)).compile()


def check_output_folder(out: str, *, resume: bool, flag: str = "--out", resumable: bool = True) -> None:
    """Refuses an output folder that a command would overwrite by accident.

    Args:
      out: the folder the command writes its model (and ``checkpoint/``) into.
      resume: the run continues from ``out/checkpoint``.
      flag: the option that named ``out``, for the messages.
      resumable: the command has ``--resume`` (the messages suggest it).

    Raises:
      ValueError: ``out`` is empty or an existing file; it cannot be created (a file lies on its
        path, or the nearest existing folder is not writable) or is not writable; it
        already holds a model (``config.json`` or ``model.safetensors``) and ``resume``
        is false; or ``resume`` is true and ``out/checkpoint`` holds no training checkpoint.
    """
    if not out:
        raise ValueError(f"{flag} {out!r} is invalid: must be a folder path")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"{flag} {out!r} is an existing file: must be a folder (new, or one to --resume)")
    existing = os.path.abspath(out)
    while not os.path.exists(existing):  # the nearest part of the path that exists
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"{flag} {out!r} cannot be created: {existing!r} on its path is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        if existing == os.path.abspath(out):
            raise ValueError(f"{flag} {out!r} is not writable")
        raise ValueError(f"{flag} {out!r} cannot be created: {existing!r} is not writable")
    if resume:
        meta = os.path.join(out, "checkpoint", CHECKPOINT_META)
        if not os.path.isfile(meta):
            raise ValueError(
                f"--resume needs a training checkpoint in {flag} {out!r}, but {meta!r} is missing: "
                "drop --resume to start a new run"
            )
        return
    held = [name for name in MODEL_FILES if os.path.isfile(os.path.join(out, name))]
    if held:
        hint = ", or --resume to continue its training" if resumable else ""
        raise ValueError(f"{flag} {out!r} already holds a model ({', '.join(held)}): give a new folder{hint}")


def recorded_value(out: str, field: str) -> Any:
    """``field`` of the ``training.json`` an earlier run wrote in ``out``, or None: what a resumed
    run with no step left to run (and no metrics in its checkpoint, written before checkpoints
    kept them) records instead of nothing."""
    path = os.path.join(out, "training.json")
    try:
        info = read_json_file(path) if os.path.isfile(path) else None
    except ValueError:  # unreadable: nothing to carry over
        return None
    return info.get(field) if isinstance(info, dict) else None


def cast_params(module: nnx.Module, dtype: str) -> None:
    """Casts every ``nnx.Param`` of ``module`` in place (float leaves only).

    Raises:
      ValueError: a value is not finite or lies beyond ``dtype``'s range (it would be
        saved as infinite, and such a checkpoint does not load); nothing is cast then.
    """
    target = jnp.dtype(dtype)
    params = [
        var
        for _, var in nnx.iter_graph(module)
        if isinstance(var, nnx.Param) and jnp.issubdtype(var[...].dtype, jnp.floating)
    ]
    largest = float(jnp.finfo(target).max)
    inside = [jnp.all(jnp.abs(var[...]) <= largest) for var in params]  # False for NaN too
    if inside and not bool(jnp.stack(inside).all()):
        raise ValueError(
            f"the trained weights do not fit {dtype}: some are NaN, infinite or beyond its largest value "
            f"{largest!r}, and would be saved as infinite; nothing was saved (a wider --save-dtype may help)"
        )
    for var in params:
        var.set_value(var.get_value().astype(target))


def fit(
    step_fn: Callable[[Any, Any, int], tuple[Any, Any, dict[str, jax.Array]]],
    params: Any,
    opt_state: Any,
    tcfg: Any,
    *,
    name: str,
    run_meta: dict[str, Any],
    checkpoint_dir: str | None,
    resume: bool,
    progress: bool,
    max_seconds: float | None,
    end: int,
    record_every_step: bool,
) -> tuple[Any, dict[str, list[float]], int, float | None]:
    """The training loop both trainers share: resume, step, log, checkpoint, stop.

    Args:
      step_fn: ``(params, opt_state, step) -> (params, opt_state, metrics)``; ``metrics``
        holds scalar arrays, ``"loss"`` among them.
      params, opt_state: the trained leaves and the optimizer state.
      tcfg: the trainer config (``steps``, ``log_every``, ``checkpoint_every``).
      name: what is trained, for the error raised on a non-finite loss.
      run_meta: the settings saved with each checkpoint; resuming needs them equal.
      checkpoint_dir: where the training state is written (every ``checkpoint_every``
        steps, at ``end`` and when out of time); ``None``: nowhere.
      resume: continue from the state in ``checkpoint_dir``.
      progress: draw the progress bar.
      max_seconds: stop (and checkpoint) once the loop has run this long; ``None``: no limit.
      end: the step to stop after (``<= tcfg.steps``).
      record_every_step: read the metrics back every step (else only on logged steps).

    The loss is checked wherever it is read back (every step with ``record_every_step``,
    else on logged steps and checkpoints, so the loop adds no host sync per step), and
    the parameters before each checkpoint and at the end: a non-finite value stops the
    run before anything broken is saved.

    Returns:
      ``(params, history, steps done, seconds)``; ``history`` maps each metric to the values
      read on logged steps (every step with ``record_every_step``). A resumed run with no
      step left to run returns the metrics its last checkpoint was written with.
      ``seconds`` is the loop's time over every session that made these steps: this one's,
      plus what the checkpoint it resumed from recorded (each checkpoint keeps the total at
      its step; steps run after the last checkpoint of a killed session are run again, so
      they do not count); ``None`` when that checkpoint was written before checkpoints kept it.

    Raises:
      ValueError: ``max_seconds`` is not a finite number > 0; on resuming, the checkpoint
        is missing, was written with other ``run_meta`` settings (naming each one that
        differs with both values, before any array is read) or does not fit; or the
        loss or the parameters became NaN or infinite (naming the step and the loss).
    """
    check_max_seconds(max_seconds)
    start = 0
    saved_metrics: dict[str, float] = {}
    saved_seconds: float | None = 0.0
    if resume:
        check_resume_settings(checkpoint_dir, run_meta)
        (params, opt_state), meta = load_train_state(checkpoint_dir, (params, opt_state))
        start = meta["step"]
        saved_metrics = meta.get("metrics") or {}
        saved_seconds = meta.get("seconds")
        if saved_seconds is not None and not (is_real(saved_seconds) and 0 <= saved_seconds < math.inf):
            raise ValueError(
                f"checkpoint {checkpoint_dir!r} records seconds={saved_seconds!r}: expected a finite number >= 0"
            )
    history: dict[str, list[float]] = {}
    bar = Progress(tcfg.steps, enabled=progress)
    started = time.perf_counter()

    def total_seconds() -> float | None:
        return None if saved_seconds is None else saved_seconds + time.perf_counter() - started

    done = start
    for step in range(start, end):
        params, opt_state, metrics = step_fn(params, opt_state, step)
        done = step + 1
        out_of_time = max_seconds is not None and time.perf_counter() - started > max_seconds
        last = done == end or out_of_time
        log = done % tcfg.log_every == 0 or last
        save = bool(checkpoint_dir) and (last or bool(tcfg.checkpoint_every and done % tcfg.checkpoint_every == 0))
        if record_every_step or log or save:
            metrics = {k: float(v) for k, v in metrics.items()}
            if not math.isfinite(metrics["loss"]):
                raise ValueError(
                    f"{name} training diverged: the loss became {metrics['loss']} at step {done}; "
                    "stopped before saving (a smaller lr may help)"
                )
        if record_every_step or log:
            for k, v in metrics.items():
                history.setdefault(k, []).append(v)
        if log:
            bar.update(done, metrics)
        if (save or last) and not all_finite(params):
            raise ValueError(
                f"{name} training diverged: the parameters hold NaN or infinite values after step {done} "
                f"(whose loss was {metrics['loss']}); stopped before saving (a smaller lr may help)"
            )
        if save:
            meta = {**run_meta, "step": done, "metrics": metrics, "seconds": total_seconds()}
            save_train_state(checkpoint_dir, (params, opt_state), meta)
        if out_of_time:
            break
    bar.close()
    if not history and saved_metrics:  # a finished run resumed: nothing ran, report where it ended
        history = {k: [float(v)] for k, v in saved_metrics.items()}
    return params, history, done, (saved_seconds if done == start else total_seconds())


def check_heldout_losses(name: str, losses: dict[str, float], step: int) -> None:
    """Refuses to save a trained model whose held-out losses are not all finite.

    The parameters can stay finite yet too large to run (a huge ``lr``), which only the
    held-out scores, read at the end anyway, show.

    Raises:
      ValueError: naming each non-finite loss and the step the training stopped after.
    """
    bad = [f"{key} {value}" for key, value in losses.items() if not math.isfinite(value)]
    if bad:
        raise ValueError(
            f"{name} training diverged: its held-out {', '.join(bad)} after step {step}; the model was not "
            "saved (a smaller --lr may help)"
        )


def all_finite(tree: Any) -> bool:
    """Whether every leaf of ``tree`` holds only finite values (one host read for the whole tree)."""
    flags = [jnp.isfinite(x).all() for x in jax.tree.leaves(tree)]
    return bool(jnp.stack(flags).all()) if flags else True


@dataclasses.dataclass
class TrainResult:
    """The trained model, the metrics of the steps run, the last step done, and the training
    loop's seconds over every session that made those steps (:func:`fit`; ``None`` where a
    checkpoint resumed from did not record them)."""

    model: nnx.Module
    history: dict[str, list[float]]
    step: int
    seconds: float | None = None


# Argparse types of the trainers' numeric flags: counts and sizes up to int32's largest (step
# counts, token ids, positions and anchors reach the device as int32), seeds up to SEED_MAX,
# the learning rate up to float32's largest (the optimizer runs in float32).
COUNT = number_flag(int, 1, INT32_MAX)
COUNT_OR_ZERO = number_flag(int, 0, INT32_MAX)
SEED = number_flag(int, 0, SEED_MAX)
LEARNING_RATE = number_flag(float, 0, FLOAT32_MAX, open_low=True)
