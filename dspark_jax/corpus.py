"""An offline text corpus that exists on every machine: the Python standard library's sources.

Files are the ``.py`` sources (code, comments and docstrings, ``pydoc_data`` included)
under ``sysconfig.get_paths()['stdlib']``, enumerated in sorted order of their path
relative to that root, without test suites, installed packages, build configuration
and byte-code caches. The train / held-out split is decided per file from the SHA-256
of its relative path, so a file is held out on every Python version that has it and
never enters training. :meth:`Corpus.provenance` records the Python version, the root
and a hash of the file list and contents.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import platform
import sysconfig
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from dspark_jax.tokenizer import Tokenizer

# Directory names skipped anywhere under the root.
EXCLUDED_DIRS = frozenset(
    {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "lib-dynload", "turtledemo"}
)
HELD_OUT_PERCENT = 10


def stdlib_root() -> str:
    """The standard library folder of the running Python."""
    return sysconfig.get_paths()["stdlib"]


def list_stdlib_files(root: str | os.PathLike | None = None) -> list[str]:
    """Sorted ``/``-separated paths, relative to ``root``, of the corpus's ``.py`` files."""
    root = os.fspath(root or stdlib_root())
    if not os.path.isdir(root):
        raise ValueError(f"corpus root {root!r} is not a folder")
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS and not d.startswith("config-")]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py") and not name.startswith("_sysconfigdata"):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                out.append(rel.replace(os.sep, "/"))
    return sorted(out)


def is_held_out(relpath: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """Whether a file (by its relative path) belongs to the held-out split."""
    digest = hashlib.sha256(relpath.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 100 < percent


@dataclasses.dataclass(frozen=True, kw_only=True)
class Corpus:
    """The standard-library corpus, split into train and held-out files."""

    root: str
    train_files: tuple[str, ...]
    heldout_files: tuple[str, ...]
    held_out_percent: int = HELD_OUT_PERCENT

    def __post_init__(self):
        if not isinstance(self.root, str) or not os.path.isdir(self.root):
            raise ValueError(f"root={self.root!r} is invalid: must be an existing folder")
        for name in ("train_files", "heldout_files"):
            files = getattr(self, name)
            if isinstance(files, str) or not all(isinstance(f, str) for f in files):
                raise TypeError(f"{name} must be a sequence of file paths relative to root, got {files!r:.80}")
        if isinstance(self.held_out_percent, bool) or not isinstance(self.held_out_percent, int):
            raise TypeError(f"held_out_percent={self.held_out_percent!r} is invalid: must be an integer")
        if not 0 <= self.held_out_percent <= 100:
            raise ValueError(f"held_out_percent={self.held_out_percent!r} is invalid: must lie in [0, 100]")

    def files(self, split: str) -> tuple[str, ...]:
        """The files of one split, ``"train"`` or ``"heldout"`` (paths relative to ``root``).

        Raises:
          ValueError: ``split`` is neither.
        """
        if split == "train":
            return self.train_files
        if split == "heldout":
            return self.heldout_files
        raise ValueError(f"split={split!r} is invalid: must be 'train' or 'heldout'")

    def texts(self, split: str) -> list[str]:
        """The documents of one split, in file order (undecodable bytes replaced)."""
        out = []
        for rel in self.files(split):
            with open(os.path.join(self.root, rel), encoding="utf-8", errors="replace") as f:
                text = f.read()
            if text.strip():
                out.append(text)
        return out

    def provenance(self) -> dict:
        """Where the text came from: Python version, root, split rule and content hashes."""
        info = {
            "source": "Python standard library .py sources (tests, site-packages excluded)",
            "python_version": platform.python_version(),
            "python_implementation": platform.python_implementation(),
            "root": self.root,
            "excluded_dirs": sorted(EXCLUDED_DIRS) + ["config-*"],
            "split_rule": f"held out iff int(sha256(relpath)[:8]) % 100 < {self.held_out_percent}",
        }
        for split in ("train", "heldout"):
            files = self.files(split)
            listing = hashlib.sha256("\n".join(files).encode("utf-8"))
            content = hashlib.sha256()
            size = 0
            for rel in files:
                with open(os.path.join(self.root, rel), "rb") as f:
                    data = f.read()
                content.update(hashlib.sha256(data).digest())
                size += len(data)
            info[split] = {
                "files": len(files),
                "bytes": size,
                "file_list_sha256": listing.hexdigest(),
                "content_sha256": content.hexdigest(),
            }
        return info


def load_corpus(root: str | os.PathLike | None = None, held_out_percent: int = HELD_OUT_PERCENT) -> Corpus:
    """Enumerates the corpus under ``root`` (default: this Python's standard library)."""
    if isinstance(held_out_percent, bool) or not isinstance(held_out_percent, int) or not 0 < held_out_percent < 100:
        raise ValueError(f"held_out_percent={held_out_percent!r} is invalid: must be an integer in 1..99")
    root = os.fspath(root or stdlib_root())
    files = list_stdlib_files(root)
    if not files:
        raise ValueError(f"corpus root {root!r} holds no .py files outside the excluded folders")
    held = tuple(f for f in files if is_held_out(f, held_out_percent))
    train = tuple(f for f in files if not is_held_out(f, held_out_percent))
    return Corpus(root=root, train_files=train, heldout_files=held, held_out_percent=held_out_percent)


def encode_documents(tokenizer: Tokenizer, texts: Sequence[str]) -> np.ndarray:
    """Token ids of all documents, each followed by ``<|endoftext|>``: ``[N]`` int32.

    Raises:
      TypeError: ``texts`` is one string (or bytes) rather than an iterable of documents,
        or a document is not a str.
    """
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"texts must be an iterable of str documents, got a {type(texts).__name__}: wrap it in a list")
    texts = list(texts)
    for i, text in enumerate(texts):
        if not isinstance(text, str):
            raise TypeError(f"texts[{i}] is a {type(text).__name__}: every document must be a str")
    eos = tokenizer.eos_id
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer.encode(text))
        ids.append(eos)
    return np.asarray(ids, np.int32)
