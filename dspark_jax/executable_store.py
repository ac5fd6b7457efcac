"""Compiled programs kept on disk and loaded back without tracing or lowering.

jax's persistent compilation cache saves XLA's compile, not jax's own work: its key hashes
the lowered program, so a restarted server's precompile still traces and lowers every
program before it can look one up. On a 2-core CPU (tiny draft, ``max_batch`` 128, a warm
cache: 7.8 s) that tracing and lowering were about 85 % of the time, loading the rest.

An :class:`ExecutableStore` keys a program by what determines it before any tracing, and
keeps the serialized executable (:func:`jax.experimental.serialize_executable.serialize`)
under that key, one file per program. The key (:meth:`ExecutableStore.key`) hashes:

* the source of every module of this package (a changed line changes every key);
* the versions of Python, NumPy, jax, jaxlib and flax, and of the installed jax plugins and
  NVIDIA libraries;
* the backend, its platform version and every device's kind;
* jax's configuration (all options but the compilation cache's own) and the environment
  variables that reach XLA, jax or this package (``XLA_*``, ``JAX_*``, ``DSPARK_*``);
* what the caller passes: the program's name and the shapes and dtypes of its arguments.

A file that cannot be read or loaded is reported once (``RuntimeWarning``) and treated as
missing: the program is compiled again and the file replaced. A directory that cannot be
created, like a file that cannot be saved, is reported once and the program only compiled.
Nothing is evicted: every change of the key (a new version of this package, say) writes a
new set of files, and deleting the directory clears it. Loading runs code from the files,
so the directory must be as trusted as jax's own cache.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import os
import pickle
import platform
import secrets
import warnings
from pathlib import Path
from typing import Any

import flax
import jax
import jaxlib
import numpy as np
from jax.experimental.serialize_executable import deserialize_and_load, serialize

_ENV_PREFIXES = ("XLA_", "JAX_", "DSPARK_")
# installed distributions whose versions can change a compiled program (jax's CUDA/TPU plugins,
# the NVIDIA libraries XLA loads)
_DIST_PREFIXES = ("jax", "flax", "numpy", "ml-dtypes", "ml_dtypes", "libtpu", "nvidia-")
_SUFFIX = ".dsx"
_PACKAGE = Path(__file__).resolve().parent


@functools.cache
def _installed() -> tuple[Any, ...]:
    """This package's source digest, Python's version and the relevant distributions' versions
    (read once per process: none of them changes under a running process)."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    dists = sorted(
        (d.metadata["Name"].lower(), d.version)
        for d in importlib.metadata.distributions()
        if (d.metadata["Name"] or "").lower().startswith(_DIST_PREFIXES)
    )
    versions = (np.__version__, jax.__version__, jaxlib.__version__, flax.__version__)
    return digest.hexdigest(), platform.python_version(), versions, tuple(dists)


def environment() -> tuple[Any, ...]:
    """Everything outside a program's arguments that may change what jax builds for it."""
    config = tuple(
        (name, repr(value))
        for name, value in sorted(jax.config.values.items())
        if "compilation_cache" not in name and "persistent_cache" not in name
    )
    env = tuple(
        (name, value)
        for name, value in sorted(os.environ.items())
        if name.startswith(_ENV_PREFIXES) and name != "JAX_COMPILATION_CACHE_DIR"
    )
    devices = jax.devices()
    backend = (jax.default_backend(), devices[0].client.platform_version, tuple(d.device_kind for d in devices))
    return _installed(), backend, config, env


def default_directory() -> str | None:
    """``dspark_jax`` inside jax's persistent compilation cache directory, when that is set and enabled."""
    base = jax.config.jax_compilation_cache_dir
    if not base or not jax.config.jax_enable_compilation_cache:
        return None
    return os.path.join(base, "dspark_jax")


class ExecutableStore:
    """Serialized compiled programs in a directory, one file per key.

    Example::

        store = ExecutableStore("/path/to/store")
        key = store.key("head", 8, sampling)          # anything with a stable repr
        got = store.load(key, copies=2)               # None, or ([compiled, compiled], extra)
        if got is None:
            compiled = jax.jit(fn).lower(*args).compile()
            store.save(key, compiled, extra=kept)

    Attributes:
      directory: where the files are.
      available: False when ``directory`` could not be created: every :meth:`load` is then a
        miss and :meth:`save` writes nothing.
      hits, misses, saves: counts of :meth:`load` results and :meth:`save` writes.
    """

    def __init__(self, directory: str | os.PathLike[str]):
        """Creates ``directory`` if needed.

        A directory that cannot be created (a read-only parent, say) is reported once
        (``RuntimeWarning``) and the store runs without it, as after a failed save: the
        store only saves time.

        Raises:
          ValueError: ``directory`` exists and is not a directory.
        """
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise ValueError(f"executable store directory={str(self.directory)!r} is not a directory")
        self.hits = self.misses = self.saves = 0
        self._warned = False
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            self.available = False
            self._warn(f"could not create the directory {self.directory} ({err!r}); running without a store")
        else:
            self.available = True

    def key(self, *parts: Any) -> str:
        """The hex key of a program: ``parts`` (its name and argument shapes, by ``repr``)
        together with :func:`environment`."""
        return hashlib.sha256(repr((environment(), parts)).encode()).hexdigest()

    def _path(self, key: str) -> Path:
        return self.directory / f"{key}{_SUFFIX}"

    def _warn(self, message: str) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(f"dspark_jax executable store: {message}", RuntimeWarning, stacklevel=3)

    def load(self, key: str, *, copies: int = 1) -> tuple[list[jax.stages.Compiled], Any] | None:
        """Loads the program under ``key``.

        Args:
          key: from :meth:`key`.
          copies: independent executables loaded from the file (each its own state, e.g.
            its own CUDA graph; see :class:`~dspark_jax.split_round.Alternating`).

        Returns:
          ``(programs, extra)``, or None when there is no such file or it cannot be loaded.
        """
        path = self._path(key)
        if not self.available or not path.exists():
            self.misses += 1
            return None
        try:
            payload, in_tree, out_tree, extra = pickle.loads(path.read_bytes())
            programs = [deserialize_and_load(payload, in_tree, out_tree) for _ in range(copies)]
        except Exception as err:  # noqa: BLE001 - any unreadable file is a miss: compile again
            self._warn(f"{path} could not be loaded ({err!r}); compiling the program again")
            self.misses += 1
            return None
        self.hits += 1
        return programs, extra

    def save(self, key: str, compiled: jax.stages.Compiled, *, extra: Any = None) -> None:
        """Writes ``compiled`` (and the picklable ``extra``) under ``key``; atomic (a
        temporary file renamed), so a concurrent reader sees the old file or the new one.
        The file's mode is ``0o666 & ~umask``, so users sharing the directory share its programs."""
        if not self.available:
            return
        created = None
        try:
            payload, in_tree, out_tree = serialize(compiled)
            data = pickle.dumps((payload, in_tree, out_tree, extra))
            # os.open's mode goes through the umask (NamedTemporaryFile's 0600 would not share)
            tmp_path = self.directory / f"{key}.{secrets.token_hex(8)}.tmp"
            fd = os.open(tmp_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            created = tmp_path
            with os.fdopen(fd, "wb") as tmp:
                tmp.write(data)
            os.replace(tmp_path, self._path(key))
        except Exception as err:  # noqa: BLE001 - the store only saves time: serving goes on without it
            if created is not None:
                created.unlink(missing_ok=True)
            self._warn(f"could not save a program in {self.directory} ({err!r})")
            return
        self.saves += 1
