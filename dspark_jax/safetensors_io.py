"""Safetensors checkpoint files shared by the draft and target checkpoints.

A checkpoint folder holds its tensors in one ``model.safetensors`` or in shards
``model-XXXXX-of-YYYYY.safetensors`` listed by ``model.safetensors.index.json``
(``{"metadata": {"total_size": …}, "weight_map": {tensor name: shard file}}``), the
Hugging Face layout. Tensor naming is the callers' business
(:mod:`dspark_jax.checkpoint`, :mod:`dspark_jax.target`); opening a file
(:func:`open_safetensors`) and the checks every loaded weight gets (:func:`cast_weight`:
floating point, finite after the cast) are shared.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from dspark_jax.config import read_json_file

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def folder_path(path: Any) -> str:
    """``path`` (a str or ``os.PathLike``) as a str.

    Raises:
      TypeError: naming ``path`` and what it got, where ``os.fspath`` would not name it.
    """
    try:
        return os.fspath(path)
    except TypeError:
        raise TypeError(f"path must be a str or os.PathLike (a checkpoint folder), got {type(path).__name__}") from None


def read_index(folder: str) -> dict[str, list[str]] | None:
    """The shards an index lists, with the tensor names it maps to each.

    Args:
      folder: the checkpoint folder.

    Returns:
      ``{shard path: [tensor name, …]}`` in index order, or ``None`` when the folder has
      no ``model.safetensors.index.json``.

    Raises:
      ValueError: the index is not valid JSON or not an object, has no ``weight_map``, maps a
        tensor to something other than a file name, or lists a shard that does not exist
        (naming the index's path).
    """
    index_path = os.path.join(folder, INDEX_NAME)
    if not os.path.isfile(index_path):
        return None
    index = read_json_file(index_path)
    if not isinstance(index, dict):
        raise ValueError(f"{index_path!r} is not a JSON object: expected {{'weight_map': {{tensor: shard file}}}}")
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"{index_path} has no 'weight_map' dict naming the tensors and their shard files")
    shards: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or os.path.basename(shard) != shard:
            raise ValueError(
                f"{index_path} maps tensor {name!r} to {shard!r}: expected the file name of a shard in the folder"
            )
        shards.setdefault(os.path.join(folder, shard), []).append(name)
    for path in shards:
        if not os.path.isfile(path):
            raise ValueError(f"{index_path} lists shard {os.path.basename(path)!r}, which does not exist")
    return shards


@contextlib.contextmanager
def open_safetensors(path: str) -> Iterator[Any]:
    """``safe_open(path)`` over NumPy arrays, naming ``path`` when the file cannot be read.

    Raises:
      ValueError: the file is not a readable safetensors file (truncated or corrupt).
    """
    try:
        with safe_open(path, framework="numpy") as f:
            yield f
    except SafetensorError as e:
        raise ValueError(f"{path!r} is not a readable safetensors file (truncated or corrupt?): {e}") from e


def cast_weight(name: str, value: np.ndarray, dtype: Any, path: str) -> jax.Array:
    """A checkpoint tensor as a device array of ``dtype``, refusing what the cast would hide.

    Args:
      name: the tensor's name, for the messages.
      value: the tensor as read (already in the module's layout).
      dtype: the parameter dtype (a floating dtype).
      path: the checkpoint, for the messages.

    Raises:
      ValueError: ``value`` is not floating point (an integer or bool tensor would be cast
        silently), or is not finite after the cast: NaN or inf in the file, or finite values
        that overflow ``dtype`` (float16, say).
    """
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise ValueError(f"tensor {name!r} of {path!r} has dtype {value.dtype}: expected a floating-point dtype")
    with np.errstate(over="ignore"):  # an overflow is reported below, naming the tensor
        cast = jnp.asarray(np.asarray(value), dtype)
    if not bool(jnp.isfinite(cast).all()):
        dtype_name = jnp.dtype(dtype).name
        why = "NaN or inf" if not np.isfinite(value).all() else f"values overflow {dtype_name}"
        raise ValueError(f"tensor {name!r} of {path!r} is not finite after the cast to {dtype_name}: {why}")
    return cast


def _checkpoint_files(folder: str) -> set[str]:
    """The names of the tensor files in ``folder``: ``model.safetensors``, its index and shards."""
    patterns = (WEIGHTS_NAME, INDEX_NAME, "model-*-of-*.safetensors")
    where = glob.escape(folder)  # a folder named like "run[1]" is not a pattern
    return {os.path.basename(p) for pattern in patterns for p in glob.glob(os.path.join(where, pattern))}


STAGING_PREFIX = ".saving-"
JOURNAL_NAME = "replace.json"  # in a staging folder: written once every new file is in it


def _move_into_place(folder: str, staging: str) -> None:
    """Moves a complete staging folder's files into ``folder`` as its journal lists them,
    removes the old layout's leftovers, then the staging folder. Idempotent: a file already
    moved or removed (by an earlier, interrupted call) is skipped."""
    journal = _read_journal(staging)
    for file in journal["files"]:
        with contextlib.suppress(FileNotFoundError):
            os.replace(os.path.join(staging, file), os.path.join(folder, file))
    for file in journal["stale"]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, file))
    shutil.rmtree(staging, ignore_errors=True)


def _read_journal(staging: str) -> dict[str, list[str]]:
    """A staging folder's journal, every entry a plain file name a save writes (a checkpoint's
    tensor files, its index, ``*.json``): a journal naming ``../x`` or ``/x`` would move or
    delete files outside the checkpoint folder.

    Raises:
      ValueError: the journal is malformed or names any other path.
    """
    path = os.path.join(staging, JOURNAL_NAME)
    journal = read_json_file(path)
    if not isinstance(journal, dict) or not all(isinstance(journal.get(k), list) for k in ("files", "stale")):
        raise ValueError(f"{path!r} is not a save journal: expected {{'files': [...], 'stale': [...]}}")
    for key in ("files", "stale"):
        for name in journal[key]:
            ok = isinstance(name, str) and os.path.basename(name) == name and name not in ("", ".", "..")
            if not (ok and (fnmatch.fnmatchcase(name, "*.json") or fnmatch.fnmatchcase(name, "*.safetensors"))):
                raise ValueError(
                    f"{path!r} lists {key} entry {name!r}: a save journal names only checkpoint files in the folder "
                    "(*.safetensors, *.json)"
                )
    return journal


def finish_interrupted_save(folder: str) -> list[str]:
    """Completes a save that stopped while its files were being moved into place.

    :func:`write_tensors` writes a journal into its staging folder once every new file is
    written, and only then moves the files; a staging folder with a journal is a complete
    checkpoint whose move was cut short (the process killed, the machine down), which left
    old and new files mixed. Its move is finished here, so the folder holds the new
    checkpoint whole. Staging folders without a journal (a write cut short: the old
    checkpoint is whole) are left alone: another process may be writing them now.

    Args:
      folder: a checkpoint folder (nothing happens if it does not exist).

    Returns:
      The staging folders finished, oldest first (usually none); each one finished is
      also reported with a ``UserWarning``.

    Raises:
      ValueError: a move could not be finished (a read-only folder, say), naming the
        staging folder: the checkpoint's files are mixed until it is.
    """
    stagings = sorted(
        glob.glob(os.path.join(glob.escape(folder), STAGING_PREFIX + "*", JOURNAL_NAME)), key=os.path.getmtime
    )
    done = []
    for journal in stagings:
        staging = os.path.dirname(journal)
        try:
            _move_into_place(folder, staging)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(
                f"checkpoint folder {folder!r} holds a save cut short while its files were moved into place "
                f"({staging!r}); finishing it failed ({err}), so old and new files are mixed: finish it where the "
                "folder is writable (load or save the checkpoint there), or save the checkpoint again"
            ) from err
        warnings.warn(
            f"checkpoint folder {folder!r}: finished a save that was cut short while its files were moved into "
            "place (the folder held old and new files mixed)",
            stacklevel=2,
        )
        done.append(staging)
    return done


def write_tensors(
    folder: str,
    tensors: dict[str, np.ndarray],
    *,
    max_shard_bytes: int | None = None,
    json_files: dict[str, Any] | None = None,
) -> list[str]:
    """Writes ``tensors`` as one ``model.safetensors`` or as indexed shards.

    Checkpoint files already in the folder (``model.safetensors``, its index and
    ``model-*-of-*.safetensors`` shards) are replaced. Every new file is first written in a
    temporary folder inside ``folder``; only when all are written, and a journal naming them
    is in that folder too, are they moved into place (``os.replace``) and the old layout's
    leftover files removed. A failed write (a full disk, say) removes the temporary folder
    and leaves the old checkpoint as it was; a move cut short (the process killed) is
    finished by the next load or save of the folder (:func:`finish_interrupted_save`), so
    old and new files are never read mixed.

    Args:
      folder: the folder (created if needed).
      tensors: name → contiguous array.
      max_shard_bytes: split the tensors, in name order, into shards of at most this many
        bytes (a larger tensor gets a shard of its own) listed by
        ``model.safetensors.index.json``; ``None`` writes one ``model.safetensors``.
      json_files: file name → JSON value (``{"config.json": …}``), written with the tensors
        and replaced with them.

    Returns:
      The names of the safetensors files written.

    Raises:
      ValueError: ``max_shard_bytes`` is not a positive integer or ``None`` (nothing is
        written), or an earlier save cut short could not be finished
        (:func:`finish_interrupted_save`).
      OSError: a file could not be written (the old checkpoint is left as it was) or moved
        into place.
    """
    if max_shard_bytes is not None and (
        isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes < 1
    ):
        raise ValueError(f"max_shard_bytes={max_shard_bytes!r} is invalid: must be an integer >= 1 or None")
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if max_shard_bytes is not None and shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    if max_shard_bytes is None:
        files = [WEIGHTS_NAME]
        texts: dict[str, str] = {}
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
        index = {
            "metadata": {"total_size": sum(a.nbytes for a in tensors.values())},
            "weight_map": {name: file for file, shard in zip(files, shards, strict=True) for name in shard},
        }
        texts = {INDEX_NAME: json.dumps(index, indent=2, sort_keys=True)}
    texts.update((file, json.dumps(value, indent=2)) for file, value in (json_files or {}).items())

    os.makedirs(folder, exist_ok=True)
    finish_interrupted_save(folder)
    staging = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder)
    moving = False
    try:
        # safetensors creates its files 0600; give them the mode open() gives the JSON files
        # (0666 less the umask), read off a probe so that the process's umask is never set.
        probe = os.open(os.path.join(staging, ".mode"), os.O_WRONLY | os.O_CREAT, 0o666)
        mode = os.fstat(probe).st_mode & 0o777
        os.close(probe)
        for file, shard in zip(files, shards, strict=True):
            save_file(shard, os.path.join(staging, file), metadata={"format": "pt"})
            os.chmod(os.path.join(staging, file), mode)
        for file, text in texts.items():
            with open(os.path.join(staging, file), "w") as f:
                f.write(text)
        # The tensor files go first, then their index and the JSON files (config.json); an old
        # index goes before the old shards it lists.
        stale = _checkpoint_files(folder) - set(files) - set(texts)
        journal = {"files": [*files, *texts], "stale": sorted(stale, key=lambda name: (name != INDEX_NAME, name))}
        with open(os.path.join(staging, JOURNAL_NAME + ".tmp"), "w") as f:
            json.dump(journal, f)
        # From here the staging folder is a complete checkpoint: a move cut short is finished
        # by the next load or save (finish_interrupted_save) instead of being thrown away.
        os.replace(os.path.join(staging, JOURNAL_NAME + ".tmp"), os.path.join(staging, JOURNAL_NAME))
        moving = True
        _move_into_place(folder, staging)
    finally:
        if not moving:
            shutil.rmtree(staging, ignore_errors=True)
    return files
