"""Trains the small Qwen3-style target on the standard-library corpus (``dspark-jax train-target``).

The command builds everything from the running Python: it enumerates the corpus
(:mod:`dspark_jax.corpus`), trains a byte-level BPE tokenizer on the training split
(:mod:`dspark_jax.tokenizer`), trains the target as a next-token language model with
AdamW, and writes a Hugging Face checkpoint folder (``config.json``, ``model.safetensors``,
``tokenizer.json``) plus ``training.json`` with the data provenance and losses.

Shape legend: B sequences, S sequence length, V vocabulary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from dspark_jax.cli import add_save_dtype, as_flags, number_flag
from dspark_jax.config import TargetConfig, normalise_numbers
from dspark_jax.target import Qwen3Target, Target
from dspark_jax.tokenizer import DEFAULT_SPECIAL_TOKENS
from dspark_jax.training import (
    COUNT,
    COUNT_OR_ZERO,
    INT32_MAX,
    LEARNING_RATE,
    SEED,
    TrainResult,
    cast_params,
    check_heldout_losses,
    check_output_folder,
    check_resume_settings,
    check_schedule_fields,
    check_token_stream,
    check_trainable_dtype,
    check_training_memory,
    compile_training_step,
    fit,
    optimizer_for,
    positive_seconds,
    recorded_value,
    sample_windows,
)

DEFAULT_VOCAB_SIZE = 2048
MIN_VOCAB_SIZE = 256 + len(DEFAULT_SPECIAL_TOKENS)  # every byte and the special tokens


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetTrainConfig:
    """Hyper-parameters of :func:`train_target`.

    NumPy integer and float scalars are accepted and stored as Python numbers.

    Raises:
      TypeError: a float field (``lr``, ``weight_decay`` …) is not a number, naming it.
      ValueError: a field is invalid, naming it, its value and what is allowed.
    """

    steps: int = 3000
    batch_size: int = 64
    seq_len: int = 256
    lr: float = 2e-3
    warmup_frac: float = 0.04
    weight_decay: float = 0.1
    clip_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    checkpoint_every: int = 0

    def __post_init__(self) -> None:
        normalise_numbers(self)
        check_schedule_fields(self, ("steps", "batch_size", "seq_len", "log_every"))
        if self.seq_len < 2:
            raise ValueError(f"seq_len={self.seq_len} is invalid: a language-model window needs >= 2 tokens")


def lm_loss(target: Target, tokens: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy of ``tokens [B, S]`` (predicting ``tokens[:, 1:]``)."""
    b, s = tokens.shape
    inputs = tokens[:, :-1]
    positions = jnp.broadcast_to(jnp.arange(s - 1, dtype=jnp.int32), (b, s - 1))
    logits, _, _ = target(inputs, positions, target.init_cache(b, s - 1))  # [B, S−1, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


def make_target_train_step(graphdef: nnx.GraphDef[Target], optimizer: optax.GradientTransformation) -> Callable:
    """The jitted step ``(params, rest, opt_state, tokens) -> (params, opt_state, loss)``."""

    def step(params, rest, opt_state, tokens):
        loss, grads = jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p, rest), tokens))(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(step, donate_argnums=(0, 2))


def check_window_fits(cfg: TargetConfig, seq_len: int) -> None:
    """Raises ``ValueError`` unless ``seq_len``-token training windows fit the target's positions."""
    if seq_len > cfg.max_position_embeddings:
        raise ValueError(
            f"seq_len={seq_len} exceeds the target's max_position_embeddings={cfg.max_position_embeddings}"
        )


def check_target_memory(cfg: TargetConfig, tcfg: TargetTrainConfig, *, sizes: str | None = None) -> int:
    """:func:`~dspark_jax.training.check_training_memory` for a target: its parameters and one
    step's float32 logits ``[batch_size, seq_len, V]``. ``sizes`` names the settings in the
    message (default: the config's and ``tcfg``'s fields)."""
    logits = 4 * tcfg.batch_size * tcfg.seq_len * cfg.vocab_size
    return check_training_memory(
        target_sizes(cfg, tcfg) if sizes is None else sizes,
        lambda n: Qwen3Target(dataclasses.replace(cfg, num_hidden_layers=n), rngs=nnx.Rngs(0)),
        cfg.num_hidden_layers,
        activations=("float32 logits", logits),
    )


def target_sizes(cfg: TargetConfig, tcfg: TargetTrainConfig) -> str:
    """The settings that set a target training run's memory, as the messages name them."""
    return (
        f"hidden_size={cfg.hidden_size}, intermediate_size={cfg.intermediate_size}, "
        f"num_hidden_layers={cfg.num_hidden_layers}, vocab_size={cfg.vocab_size}, "
        f"batch_size={tcfg.batch_size}, seq_len={tcfg.seq_len}"
    )


def train_target(
    cfg: TargetConfig,
    tokens: np.ndarray,
    tcfg: TargetTrainConfig,
    *,
    checkpoint_dir: str | None = None,
    resume: bool = False,
    progress: bool = True,
    max_seconds: float | None = None,
) -> TrainResult:
    """Trains a :class:`~dspark_jax.target.Qwen3Target` as a language model.

    Args:
      cfg: the target config (``seq_len`` must fit ``max_position_embeddings``).
      tokens: ``[N]`` training token stream.
      tcfg: hyper-parameters.
      checkpoint_dir: resumable training state is written there at the end (and every
        ``tcfg.checkpoint_every`` steps); ``None``: nowhere.
      resume: continue from ``checkpoint_dir``.
      progress: draw the progress bar.
      max_seconds: stop (and checkpoint) once the loop has run this long.

    Returns:
      A :class:`~dspark_jax.training.TrainResult` (``history["loss"]``).

    Raises:
      ValueError: ``seq_len`` does not fit the positions, float16 parameters
        (:func:`~dspark_jax.training.check_trainable_dtype`), the model and one step's logits
        cannot fit in free memory (:func:`check_target_memory`) or the compiled step cannot
        (:func:`~dspark_jax.training.compile_training_step`), a bad token stream, ``resume``
        without ``checkpoint_dir``, ``max_seconds`` not a finite number > 0, a checkpoint
        that cannot be resumed (naming the settings that differ), or a loss or parameters
        that become NaN or infinite (naming the step and the loss).
    """
    check_window_fits(cfg, tcfg.seq_len)
    check_trainable_dtype("the target's", cfg)
    check_target_memory(cfg, tcfg)
    tokens = check_token_stream(tokens, tcfg.seq_len, cfg.vocab_size)
    if resume and checkpoint_dir is None:
        raise ValueError("resume=True needs a checkpoint_dir")
    model = Qwen3Target(cfg, rngs=nnx.Rngs(tcfg.seed))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    optimizer = optimizer_for(tcfg)
    batch = jax.ShapeDtypeStruct((tcfg.batch_size, tcfg.seq_len), jnp.int32)
    train_step = compile_training_step(
        make_target_train_step(graphdef, optimizer),
        (params, rest, jax.eval_shape(optimizer.init, params), batch),
        target_sizes(cfg, tcfg),
    )

    def step_fn(params, opt_state, step):
        batch = sample_windows(tokens, tcfg.batch_size, tcfg.seq_len, np.random.default_rng([tcfg.seed, step]))
        params, opt_state, loss = train_step(params, rest, opt_state, batch)
        return params, opt_state, {"loss": loss}

    params, history, done, seconds = fit(
        step_fn,
        params,
        optimizer.init(params),
        tcfg,
        name="target",
        run_meta=target_run_meta(cfg, tcfg),
        checkpoint_dir=checkpoint_dir,
        resume=resume,
        progress=progress,
        max_seconds=max_seconds,
        end=tcfg.steps,
        record_every_step=False,
    )
    nnx.update(model, params)
    return TrainResult(model=model, history={"loss": [], **history}, step=done, seconds=seconds)


def target_run_meta(cfg: TargetConfig, tcfg: TargetTrainConfig) -> dict:
    """The settings a target training checkpoint records; resuming needs them unchanged."""
    return {"train_config": dataclasses.asdict(tcfg), "target_config": cfg.to_hf_config()}


def heldout_loss(
    target: Target, tokens: np.ndarray, *, batches: int = 8, batch_size: int = 16, seq_len: int = 256
) -> float:
    """Mean next-token cross-entropy (nats) on random windows of a held-out stream."""
    tokens = check_token_stream(tokens, seq_len, target.config.vocab_size)
    graphdef, state = nnx.split(target)
    score = jax.jit(lambda state, batch: lm_loss(nnx.merge(graphdef, state), batch))
    rng = np.random.default_rng(1)
    return float(
        np.mean([float(score(state, sample_windows(tokens, batch_size, seq_len, rng))) for _ in range(batches)])
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Registers the ``dspark-jax train-target`` flags."""
    parser.add_argument("--out", required=True, help="output checkpoint folder (new, or --resume)")
    parser.add_argument(
        "--vocab-size",
        type=number_flag(int, MIN_VOCAB_SIZE, INT32_MAX),
        help=f"tokenizer vocabulary, special tokens included, >= {MIN_VOCAB_SIZE} (256 bytes + "
        f"{len(DEFAULT_SPECIAL_TOKENS)} special tokens; default {DEFAULT_VOCAB_SIZE}; with --resume, the saved "
        "tokenizer's)",
    )
    parser.add_argument("--hidden-size", type=COUNT, default=192, help="model width (default 192)")
    parser.add_argument("--intermediate-size", type=COUNT, default=576, help="MLP width (default 576)")
    parser.add_argument("--layers", type=COUNT, default=4, help="decoder layers (default 4)")
    parser.add_argument("--heads", type=COUNT, default=4, help="attention heads (default 4)")
    parser.add_argument("--kv-heads", type=COUNT, default=2, help="key/value heads, dividing --heads (default 2)")
    parser.add_argument("--head-dim", type=COUNT, default=48, help="width of each head, even (default 48)")
    parser.add_argument("--context", type=COUNT, default=512, help="max_position_embeddings")
    parser.add_argument("--steps", type=COUNT, default=3000, help="optimizer steps (default 3000)")
    parser.add_argument("--batch", type=COUNT, default=64, help="windows per step (default 64)")
    parser.add_argument("--seq-len", type=COUNT, default=256, help="tokens per window, <= --context (default 256)")
    parser.add_argument("--lr", type=LEARNING_RATE, default=2e-3, help="peak AdamW learning rate (default 2e-3)")
    parser.add_argument("--seed", type=SEED, default=0, help="initialisation and batch seed (default 0)")
    add_save_dtype(parser, "weights (training runs in float32)")
    parser.add_argument("--checkpoint-every", type=COUNT_OR_ZERO, default=1000, help="0 = only at the end")
    parser.add_argument(
        "--max-seconds", type=positive_seconds, help="stop early after this much training time (seconds > 0)"
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue from OUT/checkpoint (reuses OUT/tokenizer.json)"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar")


TARGET_FLAGS = {
    "hidden_size": "--hidden-size",
    "intermediate_size": "--intermediate-size",
    "num_hidden_layers": "--layers",
    "num_attention_heads": "--heads",
    "num_key_value_heads": "--kv-heads",
    "head_dim": "--head-dim",
    "vocab_size": "--vocab-size",
    "max_position_embeddings": "--context",
    "seq_len": "--seq-len",
    "batch_size": "--batch",
}
"""The ``train-target`` flag behind each config field its messages name."""


def run(args: argparse.Namespace) -> int:
    """``dspark-jax train-target``: tokenizer, training, checkpoint and ``training.json``.

    The vocabulary is the tokenizer's: on ``--resume`` the saved ``OUT/tokenizer.json``;
    otherwise a BPE trained to ``--vocab-size``, which can come out smaller when the
    corpus runs out of repeated pairs (a warning line on stderr names both sizes; the
    model is built for the size the tokenizer has).

    Raises:
      ValueError: ``--out`` is an existing file, cannot be created or written, holds a
        model without ``--resume`` or lacks a training checkpoint with ``--resume``;
        ``--vocab-size`` differs from the saved tokenizer's on ``--resume``; the model or
        training settings are invalid; ``--resume`` meets a checkpoint of other settings.
        All raised before the tokenizer is trained and before anything is written. Also
        when the training diverges (see :func:`~dspark_jax.training.fit` and
        :func:`~dspark_jax.training.check_heldout_losses`): then no model is saved.
    """
    from dspark_jax.corpus import encode_documents, load_corpus
    from dspark_jax.target import save_target
    from dspark_jax.tokenizer import load_tokenizer, train_bpe

    # Validate the settings before the tokenizer's BPE training (seconds) writes anything;
    # the vocabulary size becomes the tokenizer's once it exists.
    check_output_folder(args.out, resume=args.resume)
    tok_path = os.path.join(args.out, "tokenizer.json")
    tokenizer = load_tokenizer(tok_path) if args.resume and os.path.isfile(tok_path) else None
    vocab_size = DEFAULT_VOCAB_SIZE if args.vocab_size is None else args.vocab_size
    if tokenizer is not None:
        if args.vocab_size is not None and args.vocab_size != tokenizer.vocab_size:
            raise ValueError(
                f"--vocab-size {args.vocab_size} differs from the saved tokenizer {tok_path!r} of "
                f"{tokenizer.vocab_size} ids: --resume keeps the saved tokenizer; drop --vocab-size or start anew"
            )
        vocab_size = tokenizer.vocab_size
    with as_flags(TARGET_FLAGS):
        cfg = TargetConfig(
            hidden_size=args.hidden_size,
            intermediate_size=args.intermediate_size,
            num_hidden_layers=args.layers,
            num_attention_heads=args.heads,
            num_key_value_heads=args.kv_heads,
            head_dim=args.head_dim,
            vocab_size=vocab_size,
            max_position_embeddings=args.context,
            rope_theta=10_000.0,
            tie_word_embeddings=True,
        )
        tcfg = TargetTrainConfig(
            steps=args.steps,
            batch_size=args.batch,
            seq_len=args.seq_len,
            lr=args.lr,
            seed=args.seed,
            checkpoint_every=args.checkpoint_every,
        )
        check_window_fits(cfg, tcfg.seq_len)
    # The BPE may come out smaller than asked: until it exists, count the smallest vocabulary.
    known = cfg if tokenizer is not None else dataclasses.replace(cfg, vocab_size=MIN_VOCAB_SIZE)
    flags = "--hidden-size, --intermediate-size, --layers, --heads, --kv-heads, --head-dim, --batch, --seq-len"
    sizes = ", ".join(f"{flag} {getattr(args, flag[2:].replace('-', '_'))}" for flag in flags.split(", "))
    smallest = "" if tokenizer is not None else ", the smallest the tokenizer can come out with"
    check_target_memory(known, tcfg, sizes=f"{sizes} (vocabulary {known.vocab_size}{smallest})")
    checkpoint_dir = os.path.join(args.out, "checkpoint")
    if tokenizer is not None:  # resuming with the saved tokenizer: every setting is known now
        check_resume_settings(checkpoint_dir, target_run_meta(cfg, tcfg))
    os.makedirs(args.out, exist_ok=True)
    corpus = load_corpus()
    train_texts = corpus.texts("train")
    t0 = time.perf_counter()
    if tokenizer is None:
        print(f"training a {vocab_size}-token BPE on {len(train_texts)} files …", file=sys.stderr)
        tokenizer = train_bpe(train_texts, vocab_size)
        if tokenizer.vocab_size < vocab_size:
            print(
                f"warning: --vocab-size {vocab_size} asked, but the BPE has {tokenizer.vocab_size} ids (the corpus "
                f"ran out of pairs that occur twice); the target is built for {tokenizer.vocab_size}",
                file=sys.stderr,
            )
        tokenizer.save(tok_path)
    tokens = encode_documents(tokenizer, train_texts)
    print(f"tokenizer + encoding: {time.perf_counter() - t0:.1f} s, {tokens.size} training tokens", file=sys.stderr)
    cfg = dataclasses.replace(cfg, vocab_size=tokenizer.vocab_size)
    t0 = time.perf_counter()
    result = train_target(
        cfg,
        tokens,
        tcfg,
        checkpoint_dir=checkpoint_dir,
        resume=args.resume,
        progress=not args.quiet,
        max_seconds=args.max_seconds,
    )
    seconds = time.perf_counter() - t0
    heldout = encode_documents(tokenizer, corpus.texts("heldout"))
    held = heldout_loss(result.model, heldout, seq_len=min(args.seq_len, 256))
    check_heldout_losses("target", {"loss": held}, result.step)
    target = result.model
    target.config = dataclasses.replace(cfg, dtype=args.save_dtype, param_dtype=args.save_dtype)
    cast_params(target, args.save_dtype)
    save_target(target, args.out)
    info = {
        "train_config": dataclasses.asdict(tcfg),
        "steps_done": result.step,
        "train_seconds": seconds,
        "train_loop_seconds_all_sessions": result.seconds,
        "train_tokens": int(tokens.size),
        "final_train_loss": (
            result.history["loss"][-1] if result.history.get("loss") else recorded_value(args.out, "final_train_loss")
        ),
        "heldout_loss": held,
        "corpus": corpus.provenance(),
        "tokenizer_vocab_size": tokenizer.vocab_size,
        "jax_version": jax.__version__,
        "device": str(jax.devices()[0]),
    }
    with open(os.path.join(args.out, "training.json"), "w") as f:
        json.dump(info, f, indent=2)
    print(json.dumps({"heldout_loss": held, "final_train_loss": info["final_train_loss"]}))
    return 0
