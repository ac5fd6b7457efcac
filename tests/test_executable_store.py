"""Executable store: a restarted Proposer loads its programs without tracing, lowering or compiling."""

from __future__ import annotations

import os
import warnings

import jax
import numpy as np
import pytest
from draft_testing import random_draft, tiny_config
from proposer_testing import CAPACITY, CFG, forced_proposer, random_call

from dspark_jax import executable_store
from dspark_jax.executable_store import ExecutableStore, default_directory
from dspark_jax.proposer import CompileCounter, Proposer

# max_batch 4: buckets 1, 2, 4, two backbone pieces, two heads and two device packings
# (with and without slots) each, and the slicers to 3 rows (greedy and sampling).
PROGRAMS = 3 * (2 + 2 + 2) + 2


def draft_calls(proposer, cache, seed):
    """Blocks of a greedy and a mixed call at 3 rows (bucket 4, unpadded) and 2 rows."""
    rng = np.random.default_rng(seed)
    blocks = []
    for rows, greedy in ((3, True), (3, False), (2, False)):
        args = random_call(rng, proposer.cfg.vocab_size, rows)
        if greedy:
            args["temperatures"] = np.zeros(rows, np.float32)
        blocks.append(proposer(cache, **args, key=jax.random.key(seed)))
    return [jax.tree.map(np.asarray, b) for b in blocks]


@pytest.fixture(scope="module")
def filled(forced_session):
    """``(draft, cache, store, proposer)``: the session's FORCE proposer filled ``store`` when
    it precompiled (``conftest.py``)."""
    draft, proposer, cache, store = forced_session
    return draft, cache, store, proposer


def assert_same_blocks(got, expected):
    for a, b in zip(got, expected, strict=True):
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            np.testing.assert_array_equal(x, y)


def test_restarted_proposer_loads_every_program_and_drafts_the_same_blocks(filled):
    draft, cache, directory, first = filled
    assert first.store.saves == PROGRAMS and first.store.hits == 0
    assert len(list(directory.glob("*.dsx"))) == PROGRAMS
    second = forced_proposer(draft, directory)
    with CompileCounter() as counter:
        second.precompile(workers=2)
        blocks = draft_calls(second, cache, seed=3)
    assert counter.count == 0 and counter.lowerings == 0
    assert second.store.hits == PROGRAMS and second.store.saves == 0
    # memory analysis works on loaded programs: the gate's refinement is the same
    assert second.gate.compiled_bytes == first.gate.compiled_bytes and second.gate.enabled
    assert_same_blocks(blocks, draft_calls(first, cache, seed=3))
    assert any(not b.greedy_mask.all() for b in blocks)  # a sampling head ran


def copy_store(directory, tmp_path):
    copy = tmp_path / "store"
    copy.mkdir()
    for path in directory.glob("*.dsx"):
        (copy / path.name).write_bytes(path.read_bytes())
    return copy


def test_a_different_shape_misses_the_store_and_compiles(filled, tmp_path):
    draft, _, directory, _ = filled
    copy = copy_store(directory, tmp_path)
    other = forced_proposer(draft, copy, capacity=CAPACITY + 4)  # other cache shape: every piece
    with CompileCounter() as counter:
        other._compile_folded(1, False)
    assert other.store.hits == 0 and counter.count == 2 + 1


def test_key_depends_on_parts_environment_and_configuration(monkeypatch, tmp_path):
    store = ExecutableStore(tmp_path)
    base = store.key("head", 4, True)
    assert store.key("head", 4, True) == base
    assert store.key("head", 8, True) != base
    flags = os.environ.get("XLA_FLAGS")  # the suite's own on CPU-only machines (conftest)
    monkeypatch.setenv("XLA_FLAGS", f"{flags or ''} --xla_dump_to=/nowhere")
    flagged = store.key("head", 4, True)
    assert flagged != base
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path))  # where caches live is no part of it
    assert store.key("head", 4, True) == flagged
    if flags is None:
        monkeypatch.delenv("XLA_FLAGS")
    else:
        monkeypatch.setenv("XLA_FLAGS", flags)
    monkeypatch.delenv("JAX_COMPILATION_CACHE_DIR")
    previous = jax.config.jax_default_matmul_precision  # "highest" (conftest)
    jax.config.update("jax_default_matmul_precision", "bfloat16")
    try:
        assert store.key("head", 4, True) != base
    finally:
        jax.config.update("jax_default_matmul_precision", previous)
    assert store.key("head", 4, True) == base


def test_unreadable_files_warn_compile_again_and_are_replaced(filled, tmp_path):
    draft, cache, directory, first = filled
    copy = copy_store(directory, tmp_path)
    files = sorted(directory.glob("*.dsx"))
    assert len(files) == PROGRAMS
    (copy / files[0].name).write_bytes(b"not a program")
    (copy / files[1].name).write_bytes(files[1].read_bytes()[:-100])  # truncated
    proposer = forced_proposer(draft, copy)
    with pytest.warns(RuntimeWarning, match=r"could not be loaded"):
        proposer.precompile(workers=1)
    assert proposer.store.hits == PROGRAMS - 2 and proposer.store.saves == 2
    assert_same_blocks(draft_calls(proposer, cache, seed=4), draft_calls(first, cache, seed=4))
    again = forced_proposer(draft, copy)
    again.precompile(workers=1)
    assert again.store.hits == PROGRAMS


def test_a_failed_save_warns_and_serving_goes_on(monkeypatch, tmp_path):
    def refuse(compiled):
        raise ValueError("Compilation does not support serialization")

    monkeypatch.setattr(executable_store, "serialize", refuse)
    store = ExecutableStore(tmp_path)
    compiled = jax.jit(lambda x: x + 1).lower(np.zeros(3, np.float32)).compile()
    with pytest.warns(RuntimeWarning, match=r"could not save a program"):
        store.save(store.key("x"), compiled)
    assert store.saves == 0 and not list(tmp_path.iterdir())
    assert store.load(store.key("x")) is None and store.misses == 1


def test_a_failed_write_leaves_no_temporary_file(monkeypatch, tmp_path):
    def refuse(src, dst):
        raise OSError("disk full")

    store = ExecutableStore(tmp_path)
    compiled = jax.jit(lambda x: x * 2).lower(np.zeros(3, np.float32)).compile()
    monkeypatch.setattr(executable_store.os, "replace", refuse)
    with pytest.warns(RuntimeWarning, match=r"could not save a program .*disk full"):
        store.save(store.key("y"), compiled)
    assert store.saves == 0 and not list(tmp_path.iterdir())


def test_default_directory_follows_jax_compilation_cache(tmp_path):
    previous = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    try:
        jax.config.update("jax_compilation_cache_dir", str(tmp_path))
        assert default_directory() == os.path.join(str(tmp_path), "dspark_jax")
        jax.config.update("jax_enable_compilation_cache", False)
        assert default_directory() is None
        jax.config.update("jax_enable_compilation_cache", True)
        jax.config.update("jax_compilation_cache_dir", None)
        assert default_directory() is None
    finally:
        jax.config.update("jax_compilation_cache_dir", previous[0])
        jax.config.update("jax_enable_compilation_cache", previous[1])


@pytest.mark.parametrize("value", [True, 3, ["dir"]])
def test_bad_executable_store_argument_raises(value):
    draft = random_draft(tiny_config(**CFG), seed=0)
    with pytest.raises(TypeError, match=r"executable_store=.* is invalid: must be a directory path"):
        Proposer(draft, max_batch=2, capacity=CAPACITY, executable_store=value)


def test_store_directory_must_be_a_directory(tmp_path):
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ValueError, match=r"directory=.*file' is not a directory"):
        ExecutableStore(path)
    draft = random_draft(tiny_config(**CFG), seed=0)
    with pytest.raises(ValueError, match=r"executable_store=.*file' is invalid: it is not a directory"):
        Proposer(draft, max_batch=2, capacity=CAPACITY, executable_store=path)


@pytest.fixture
def uncreatable(tmp_path):
    """A store directory that cannot be created: under a read-only parent, or (as root, whom
    permissions do not stop) under a regular file."""
    if os.geteuid() == 0:
        parent = tmp_path / "afile"
        parent.write_text("x")
        yield parent / "store"
        return
    parent = tmp_path / "readonly"
    parent.mkdir()
    parent.chmod(0o555)
    try:
        yield parent / "store"
    finally:
        parent.chmod(0o755)


def test_a_directory_that_cannot_be_created_warns_once_and_runs_without_a_store(uncreatable):
    compiled = jax.jit(lambda x: x + 1).lower(np.zeros(3, np.float32)).compile()
    with pytest.warns(RuntimeWarning, match=rf"could not create the directory {uncreatable} \(.*Error"):
        store = ExecutableStore(uncreatable)
    assert not store.available
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once: the saves and loads below are silent
        store.save(store.key("x"), compiled)
        assert store.load(store.key("x")) is None
    assert (store.hits, store.misses, store.saves) == (0, 1, 0)
    assert not uncreatable.exists()
    proposer = Proposer(
        random_draft(tiny_config(**CFG), seed=0), max_batch=2, capacity=CAPACITY, executable_store=uncreatable
    )
    with pytest.warns(RuntimeWarning, match=r"could not create the directory"):
        assert proposer.store is not None and not proposer.store.available


def test_saved_programs_are_readable_by_other_users_as_the_umask_allows(tmp_path):
    store = ExecutableStore(tmp_path)
    compiled = jax.jit(lambda x: x - 1).lower(np.zeros(3, np.float32)).compile()
    previous = os.umask(0o022)
    try:
        store.save(store.key("z"), compiled)
    finally:
        os.umask(previous)
    (path,) = tmp_path.iterdir()
    assert path.suffix == ".dsx" and path.stat().st_mode & 0o777 == 0o644


def test_a_draft_of_another_config_but_the_same_shapes_misses_the_store(filled, tmp_path):
    """The config is part of every key: a mask id, RoPE base or norm epsilon is compiled into
    the programs as a constant, so a draft with the same shapes must not load another's."""
    draft, _, directory, _ = filled
    for change in (dict(mask_token_id=draft.cfg.mask_token_id - 1), dict(rope_theta=draft.cfg.rope_theta * 2)):
        other = random_draft(tiny_config(**CFG, **change), seed=0)
        where = tmp_path / next(iter(change))
        where.mkdir()
        proposer = forced_proposer(other, copy_store(directory, where))
        with CompileCounter() as counter:
            proposer._compile_folded(1, False)
        assert proposer.store.hits == 0 and counter.count == 2 + 1, change


def test_a_dspark_environment_variable_is_part_of_the_key(monkeypatch, tmp_path):
    """``DSPARK_JAX_*`` variables choose kernels (here the context attention), so they change
    what is compiled: a program saved under one choice must not load under another."""
    from dspark_jax.attention_kernel import ATTENTION_ENV

    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    store = ExecutableStore(tmp_path)
    base = store.key("head", 4, True)
    monkeypatch.setenv(ATTENTION_ENV, "xla")
    xla = store.key("head", 4, True)
    monkeypatch.setenv(ATTENTION_ENV, "pallas")
    pallas = store.key("head", 4, True)
    assert len({base, xla, pallas}) == 3
    monkeypatch.delenv(ATTENTION_ENV)
    assert store.key("head", 4, True) == base


def test_a_corrupt_file_is_a_miss_and_warns_once_for_every_failure(tmp_path):
    store = ExecutableStore(tmp_path)
    first, second = store.key("a"), store.key("b")
    (tmp_path / f"{first}.dsx").write_bytes(b"not a program")
    (tmp_path / f"{second}.dsx").write_bytes(b"\x80\x04 truncated pickle")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # a repeated warning is not hidden by the filters
        assert store.load(first) is None
        assert (store.hits, store.misses) == (0, 1)
        assert store.load(second, copies=2) is None
        assert (store.hits, store.misses, store.saves) == (0, 2, 0)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "could not be loaded" in messages[0] and first in messages[0]
