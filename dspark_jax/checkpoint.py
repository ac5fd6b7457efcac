"""DSpark draft checkpoints in the DeepSpec / Hugging Face format.

A checkpoint is a folder with ``config.json`` (read by
:meth:`~dspark_jax.config.DraftConfig.from_hf_config`) and the tensors, either in one
``model.safetensors`` or in shards listed by ``model.safetensors.index.json`` (without
an index, every ``*.safetensors`` file in the folder is read). Tensor names follow the
PyTorch module tree of ``DSPARK_SPEC.md`` §2, with an optional ``model.`` prefix;
PyTorch ``Linear`` weights are ``[out, in]`` and become flax ``[in, out]`` kernels.

The borrowed ``embed_tokens`` / ``lm_head`` come from, in order: the arrays the caller
passes, the attached target, the copies stored in the checkpoint. Every mismatch
between the file, the config and the caller's flags raises a ``ValueError`` before any
array is materialised on the device; a tensor that is not floating point, or not finite
after the cast to the parameter dtype, is refused as it is read.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.config import DTYPES, LAYOUTS, DraftConfig, check_flag, read_json_file
from dspark_jax.draft import DSparkDraft, check_draft, check_finite_table
from dspark_jax.safetensors_io import (
    INDEX_NAME,
    WEIGHTS_NAME,
    cast_weight,
    finish_interrupted_save,
    folder_path,
    open_safetensors,
    read_index,
    write_tensors,
)
from dspark_jax.sampling import check_dtypes

CONFIG_NAME = "config.json"
EMBED_NAME = "embed_tokens.weight"
LM_HEAD_NAME = "lm_head.weight"
STS_NAME = "confidence_head.sts_temperature"
_PREFIX = "model."

Path = str | os.PathLike


# ------------------------------------------------------------------------ naming
def tensor_name(keys: tuple[Any, ...]) -> tuple[str, bool]:
    """Maps an NNX state path to its checkpoint name.

    Args:
      keys: the path, e.g. ``("layers", 0, "self_attn", "q_proj", "kernel")``.

    Returns:
      ``(name, transpose)``: the DeepSpec tensor name (no ``model.`` prefix) and
      whether the array is a flax kernel stored transposed (PyTorch ``[out, in]``).
    """
    parts = [str(k) for k in keys]
    if parts[-1] == "kernel":
        return ".".join([*parts[:-1], "weight"]), True
    if parts[-1] in ("embed_tokens", "lm_head", "markov_w1", "markov_w2"):
        return ".".join([*parts, "weight"]), False
    return ".".join(parts), False


def _flatten(tree: dict, prefix: tuple = ()) -> Iterator[tuple[tuple, Any]]:
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _flatten(value, (*prefix, key))
        else:
            yield (*prefix, key), value


def _set_leaf(tree: dict, keys: tuple, value: Any) -> None:
    for key in keys[:-1]:
        tree = tree[key]
    tree[keys[-1]] = value


# ------------------------------------------------------------------------ reading
class _TensorFiles:
    """Name → (file, stored name) over one or many safetensors files; reads lazily."""

    def __init__(self, folder: str):
        self.folder = folder
        stored = read_index(folder)
        if stored is None:
            paths = sorted(glob.glob(os.path.join(glob.escape(folder), "*.safetensors")))
            if not paths:
                raise ValueError(
                    f"checkpoint folder {folder!r} has no {WEIGHTS_NAME}, no {INDEX_NAME} and no *.safetensors file"
                )
            stored = {}
            for path in paths:
                with open_safetensors(path) as f:
                    stored[path] = list(f.keys())
        self.location: dict[str, tuple[str, str]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path, names in stored.items():
            with open_safetensors(path) as f:
                present = set(f.keys())
                shard = os.path.basename(path)
                unlisted = sorted(present - set(names))
                if unlisted:
                    # Like load_target: a tensor the index does not map is not silently dropped.
                    raise ValueError(
                        f"tensor {unlisted[0]!r} is in shard {shard!r} but the index does not map it there"
                    )
                for raw in names:
                    if raw not in present:
                        raise ValueError(f"tensor {raw!r} is listed for {shard!r} but not stored in it")
                    name = raw[len(_PREFIX) :] if raw.startswith(_PREFIX) else raw
                    if name in self.location:
                        raise ValueError(
                            f"tensor {name!r} is stored twice (as {self.location[name][1]!r} and {raw!r}); "
                            f"the {_PREFIX!r} prefix is optional but names must be unique without it"
                        )
                    self.location[name] = (path, raw)
                    self.shapes[name] = tuple(f.get_slice(raw).get_shape())

    @property
    def names(self) -> set[str]:
        """The stored tensor names, without the optional ``model.`` prefix."""
        return set(self.location)

    def get(self, name: str) -> np.ndarray:
        """The tensor ``name`` (as :attr:`names` lists it) read from its file, as stored."""
        path, raw = self.location[name]
        with open_safetensors(path) as f:
            return f.get_tensor(raw)

    def get_weight(self, name: str, dtype: Any, transpose: bool = False) -> jax.Array:
        """The tensor (transposed to a flax kernel if asked) cast to ``dtype``; refuses
        integer, bool and non-finite tensors (:func:`~dspark_jax.safetensors_io.cast_weight`)."""
        array = self.get(name)
        return cast_weight(name, array.T if transpose else array, dtype, self.folder)


def _shape(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _check_layout(cfg: DraftConfig, raw: dict[str, Any], layout: str | None) -> None:
    if layout is None:
        return
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(
            f"layout={layout!r} is invalid: must be one of {sorted(LAYOUTS)} or None (the checkpoint's own layout)"
        )
    if LAYOUTS[layout] == cfg.sample_from_anchor:
        return
    if "sample_from_anchor" in raw:
        source = f"sets sample_from_anchor={raw['sample_from_anchor']!r}"
    else:
        default = cfg.sample_from_anchor
        source = f"does not set sample_from_anchor, and its producer's default is sample_from_anchor={default}"
    raise ValueError(
        f"layout={layout!r} contradicts the checkpoint: its config.json {source} (layout={cfg.layout!r}). "
        "A draft run with the wrong slot layout accepts about one token per round, so the loader refuses "
        "rather than guess; pass layout=None or the checkpoint's layout."
    )


def _check_target(cfg: DraftConfig, target: Any) -> None:
    tcfg = getattr(target, "config", None)
    if tcfg is None:
        return
    if tcfg.hidden_size != cfg.hidden_size:
        raise ValueError(
            f"target hidden_size={tcfg.hidden_size} does not fit the draft: must equal the draft's "
            f"hidden_size={cfg.hidden_size}"
        )
    if tcfg.vocab_size < cfg.vocab_size:
        raise ValueError(
            f"target vocab_size={tcfg.vocab_size} does not fit the draft: must be >= the draft's "
            f"vocab_size={cfg.vocab_size}"
        )
    depth = tcfg.num_hidden_layers
    if cfg.num_target_layers is not None and cfg.num_target_layers != depth:
        raise ValueError(
            f"target num_hidden_layers={depth} does not fit the draft: it was trained on a target with "
            f"num_target_layers={cfg.num_target_layers}"
        )
    if cfg.target_layer_ids[-1] >= depth:
        raise ValueError(
            f"target num_hidden_layers={depth} does not fit the draft: its target_layer_ids="
            f"{list(cfg.target_layer_ids)} need num_hidden_layers >= {cfg.target_layer_ids[-1] + 1}"
        )


def _check_heads(cfg: DraftConfig, names: set[str]) -> None:
    """Refuses a config whose head flags disagree with the tensors present."""
    markov = sorted(n for n in names if n.startswith("markov_head."))
    if cfg.markov_rank == 0 and markov:
        raise ValueError(
            f"head type mismatch: config.json has markov_rank=0 (no Markov head) but the checkpoint has "
            f"Markov head tensors {markov}"
        )
    if cfg.markov_rank > 0 and markov:
        gated = [n for n in markov if n.startswith("markov_head.gate_proj.")]
        rnn = [n for n in markov if n.startswith("markov_head.joint_proj.")]
        if gated and rnn:
            raise ValueError(f"head type mismatch: the checkpoint has both gated {gated} and rnn {rnn} Markov tensors")
        found = "gated" if gated else "rnn" if rnn else "vanilla"
        if found != cfg.markov_head_type:
            evidence = gated or rnn or ["no gate_proj / joint_proj tensors"]
            raise ValueError(
                f"head type mismatch: config.json says markov_head_type={cfg.markov_head_type!r} but the "
                f"checkpoint holds a {found!r} Markov head ({', '.join(evidence)})"
            )
    confidence = sorted(n for n in names if n.startswith("confidence_head."))
    if not cfg.enable_confidence_head and confidence:
        raise ValueError(
            f"head type mismatch: config.json has enable_confidence_head=False but the checkpoint has "
            f"confidence head tensors {confidence}"
        )


def _check_tables(target: Any, embed_tokens: Any, lm_head: Any) -> None:
    """Refuses borrowed tables that are not floating-point arrays or hold NaN or inf,
    before anything is read.

    The finiteness check reads each concrete table once (on the host for NumPy, on the
    device for jax.Array), small next to reading the checkpoint; traced tables are skipped.
    """
    for name, table in (("embed_tokens", embed_tokens), ("lm_head", lm_head)):
        where = name
        if table is None and target is not None:
            if not hasattr(target, name):
                raise TypeError(
                    f"target ({type(target).__name__}) has no {name}: it must be an object with embed_tokens and "
                    f"lm_head [V', H] arrays (a Qwen3Target, for example), or pass {name}=... yourself"
                )
            table, where = getattr(target, name), f"target.{name}"
        if table is not None and not isinstance(table, (jax.Array, np.ndarray)):
            raise TypeError(
                f"{where} must be a [V', H] array (jax.Array or numpy.ndarray) or None, got {type(table).__name__}"
            )
        if table is None or isinstance(table, jax.core.Tracer):
            continue
        check_dtypes({where: (table, jnp.floating)})
        check_finite_table(where, table)


def _check_sts_temperature(files: _TensorFiles) -> None:
    """Refuses a stored STS temperature that is not finite and > 0.

    The confidence is ``sigmoid(score / T)``: ``T = 0`` makes it 0, 1 or NaN, ``T < 0``
    inverts it, a non-finite ``T`` flattens it to 0.5 or NaN.
    """
    if STS_NAME not in files.names:
        return
    values = np.asarray(files.get(STS_NAME), np.float64)
    if not (np.all(np.isfinite(values)) and np.all(values > 0)):
        raise ValueError(
            f"tensor {STS_NAME!r} holds {values.tolist()}: every entry must be a finite number > 0 "
            "(the confidence is sigmoid(score / temperature))"
        )


def _borrowed(
    cfg: DraftConfig,
    raw: dict[str, Any],
    files: _TensorFiles,
    target: Any,
    embed_tokens: jax.Array | None,
    lm_head: jax.Array | None,
) -> tuple[Any, Any]:
    """Picks each borrowed table: the caller's array, the target's, or the name of the
    checkpoint's tensor (a ``str``, read only after every check has passed)."""
    embed = embed_tokens
    if embed is None and target is not None:
        embed = target.embed_tokens
    if embed is None and EMBED_NAME in files.names:
        embed = EMBED_NAME
    if embed is None:
        raise ValueError(
            f"no embed_tokens for the draft: the checkpoint has no {EMBED_NAME!r}; attach the target "
            "(target=...) or pass embed_tokens=[V, H]"
        )
    head = lm_head
    if head is None and target is not None:
        head = target.lm_head
    if head is None and LM_HEAD_NAME in files.names:
        head = LM_HEAD_NAME
    if head is None and raw.get("tie_word_embeddings") is True:
        head = embed
    if head is None:
        raise ValueError(
            f"no lm_head for the draft: the checkpoint has no {LM_HEAD_NAME!r} and config.json does not set "
            "tie_word_embeddings=true; attach the target (target=...) or pass lm_head=[V, H]"
        )
    return embed, head


def load_draft(
    path: Path,
    *,
    target: Any = None,
    embed_tokens: jax.Array | None = None,
    lm_head: jax.Array | None = None,
    dtype: str | None = None,
    layout: str | None = None,
) -> DSparkDraft:
    """Loads a DeepSpec / DFlash / speculators draft checkpoint.

    Args:
      path: the checkpoint folder.
      target: an object with ``embed_tokens`` / ``lm_head`` ``[V', H]`` arrays (e.g.
        :class:`~dspark_jax.target.Qwen3Target`); when it has a ``config``, its hidden
        size, vocabulary and depth are checked against the draft's.
      embed_tokens: ``[V', H]``; overrides the target's and the checkpoint's.
      lm_head: ``[V', H]``; overrides the target's and the checkpoint's.
      dtype: compute and parameter dtype (``"float32"``, ``"bfloat16"``, ``"float16"``);
        ``None`` keeps float32. The confidence head stays float32.
      layout: the slot layout the caller expects, ``"anchor"`` (``sample_from_anchor``
        true, γ rows) or ``"dflash"`` (γ+1 rows); a contradiction with the checkpoint
        raises. ``None`` takes the checkpoint's.

    Returns:
      The draft, with the checkpoint's parameters and the borrowed tables.

    Raises:
      TypeError: ``embed_tokens`` or ``lm_head`` (the caller's or the target's) is not an
        array or not floating point, or ``target`` lacks ``embed_tokens`` / ``lm_head``
        where they would be borrowed.
      ValueError: a missing or malformed ``config.json`` (named with its path), a bad
        config, a ``dtype`` or ``layout`` that is not one of the allowed names, a layout
        contradiction, a target that does not fit, a borrowed table holding NaN or inf,
        a head type that does not match the tensors, missing, unexpected or misshapen
        tensors (each named with the checkpoint's and the expected shape), a shard
        holding a tensor its index does not map there, an unreadable (truncated or
        corrupt) safetensors file, a tensor that is not floating point or not finite
        after the cast to its parameter dtype, or a ``confidence_head.sts_temperature``
        that is not finite and > 0.
    """
    folder = folder_path(path)
    if os.path.isdir(folder):
        finish_interrupted_save(folder)  # a save cut short while moving its files
    config_path = os.path.join(folder, CONFIG_NAME)
    if not os.path.isfile(config_path):
        raise ValueError(f"checkpoint path {folder!r} has no {CONFIG_NAME}: expected a checkpoint folder")
    raw = read_json_file(config_path)
    if dtype is not None and (not isinstance(dtype, str) or dtype not in DTYPES):
        raise ValueError(f"dtype={dtype!r} is invalid: must be one of {sorted(DTYPES)} or None (float32)")
    overrides = {} if dtype is None else {"dtype": dtype, "param_dtype": dtype}
    cfg = DraftConfig.from_hf_config(raw, **overrides)
    _check_layout(cfg, raw, layout)
    _check_tables(target, embed_tokens, lm_head)
    _check_target(cfg, target)
    files = _TensorFiles(folder)
    _check_heads(cfg, files.names)
    embed, head = _borrowed(cfg, raw, files, target, embed_tokens, lm_head)

    def shaped(table: Any) -> Any:
        if isinstance(table, str):  # a stored table, still on disk
            return jax.ShapeDtypeStruct(files.shapes[table], cfg.jnp_param_dtype)
        return jax.ShapeDtypeStruct(table.shape, table.dtype)

    abstract = nnx.eval_shape(
        lambda e, h: DSparkDraft(cfg, rngs=nnx.Rngs(0), embed_tokens=e, lm_head=h), shaped(embed), shaped(head)
    )
    graphdef, state = nnx.split(abstract)
    pure = nnx.to_pure_dict(state)
    expected = {}
    for keys, leaf in _flatten(pure):
        name, transpose = tensor_name(keys)
        expected[name] = (keys, leaf, transpose)
    optional = {STS_NAME}

    problems = []
    for name, (_, leaf, transpose) in sorted(expected.items()):
        if name in (EMBED_NAME, LM_HEAD_NAME):  # checked by DSparkDraft against the draft's shapes
            continue
        want = leaf.shape[::-1] if transpose else leaf.shape
        if name not in files.names:
            if name not in optional:
                problems.append(f"missing tensor {name!r}: expected shape {_shape(want)}")
        elif files.shapes[name] != tuple(want):
            hint = ""
            if name == "confidence_head.proj.weight":
                hint = f" (confidence_head_with_markov={cfg.confidence_head_with_markov} in config.json)"
            problems.append(
                f"tensor {name!r} has shape {_shape(files.shapes[name])} in the checkpoint, expected "
                f"{_shape(want)}{' (PyTorch [out, in] layout)' if transpose else ''}{hint}"
            )
    for name in sorted(files.names - set(expected)):
        problems.append(f"unexpected tensor {name!r} with shape {_shape(files.shapes[name])}")
    if problems:
        raise ValueError(f"checkpoint {folder!r} does not match its config.json:\n  " + "\n  ".join(problems))
    _check_sts_temperature(files)

    # Only now are arrays materialised on the device: the stored tables first (a tied
    # lm_head is the same array), then the draft's own tensors.
    if isinstance(embed, str):
        embed = files.get_weight(embed, cfg.jnp_param_dtype)
    head = embed if isinstance(head, str) and head == EMBED_NAME else head
    if isinstance(head, str):
        head = files.get_weight(head, cfg.jnp_param_dtype)
    borrowed = {EMBED_NAME: embed, LM_HEAD_NAME: head}
    for name, (keys, leaf, transpose) in expected.items():
        if name in borrowed:
            value = borrowed[name]
        elif name in files.names:
            value = files.get_weight(name, leaf.dtype, transpose)
        else:
            value = jnp.ones(leaf.shape, leaf.dtype)  # an absent STS temperature is 1
        _set_leaf(pure, keys, value)
    nnx.replace_by_pure_dict(state, pure)
    return nnx.merge(graphdef, state)


# ------------------------------------------------------------------------ writing
def save_draft(
    draft: DSparkDraft,
    path: Path,
    *,
    include_borrowed: bool = False,
    max_shard_bytes: int | None = None,
) -> list[str]:
    """Writes ``config.json`` and the tensors in the DeepSpec format (PyTorch layouts).

    Checkpoint files already in the folder (``model.safetensors``, its index and
    ``model-*-of-*.safetensors`` shards, ``config.json``) are replaced only once every new
    file is written: a failed save leaves the old checkpoint loadable
    (:func:`~dspark_jax.safetensors_io.write_tensors`).

    Args:
      draft: the draft to save.
      path: the folder (created if needed).
      include_borrowed: also write ``embed_tokens.weight`` and ``lm_head.weight`` (the
        target's tables; large, and usually loaded from the target instead).
      max_shard_bytes: split the tensors into shards of at most this many bytes (a
        larger tensor gets a shard of its own) listed by ``model.safetensors.index.json``;
        ``None`` writes one ``model.safetensors``.

    Returns:
      The names of the safetensors files written.

    Raises:
      TypeError: ``draft`` is not a :class:`~dspark_jax.draft.DSparkDraft` or
        ``include_borrowed`` is not a bool (nothing is written).
      ValueError: ``path`` exists and is not a folder, or ``max_shard_bytes`` is not a
        positive integer or ``None`` (nothing is written).
    """
    check_draft(draft)
    check_flag("include_borrowed", include_borrowed)
    folder = folder_path(path)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise ValueError(
            f"draft path {folder!r} exists and is not a folder: expected a folder to write the checkpoint in"
        )
    tensors = {}
    for keys, leaf in _flatten(nnx.to_pure_dict(nnx.state(draft))):
        name, transpose = tensor_name(keys)
        if name in (EMBED_NAME, LM_HEAD_NAME) and not include_borrowed:
            continue
        array = np.asarray(jax.device_get(leaf))
        tensors[name] = np.ascontiguousarray(array.T if transpose else array)

    config = {CONFIG_NAME: draft.cfg.to_hf_config()}
    return write_tensors(folder, tensors, max_shard_bytes=max_shard_bytes, json_files=config)
