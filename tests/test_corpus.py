"""The standard-library corpus (``dspark_jax.corpus``): its train/held-out split and documents."""

import hashlib

from dspark_jax.corpus import HELD_OUT_PERCENT, Corpus, is_held_out, load_corpus


def _held_out_by_the_rule(relpath: str, percent: int = HELD_OUT_PERCENT) -> bool:
    """The split rule as ``provenance()`` states it: ``int(sha256(relpath)[:8]) % 100 < percent``,
    the first 8 digest bytes read as one number the way the hex digest writes them (most
    significant first)."""
    return int(hashlib.sha256(relpath.encode("utf-8")).hexdigest()[:16], 16) % 100 < percent


def test_the_held_out_split_follows_the_documented_hash_rule(tmp_path):
    paths = [f"pkg{i % 7}/mod_{i}.py" for i in range(300)]
    for percent in (HELD_OUT_PERCENT, 50):
        want = [p for p in paths if _held_out_by_the_rule(p, percent)]
        assert 0 < len(want) < len(paths)
        assert [p for p in paths if is_held_out(p, percent)] == want
    for p in paths[:60]:
        (tmp_path / p).parent.mkdir(exist_ok=True)
        (tmp_path / p).write_text(f"x = {p!r}\n")
    corpus = load_corpus(tmp_path)
    assert set(corpus.heldout_files) == {p for p in paths[:60] if _held_out_by_the_rule(p)}
    assert set(corpus.train_files) == {p for p in paths[:60] if not _held_out_by_the_rule(p)}
    assert "% 100 < 10" in corpus.provenance()["split_rule"]


def test_blank_files_are_not_documents(tmp_path):
    """An empty or whitespace-only file adds no document (hence no ``<|endoftext|>``)."""
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("")
    (tmp_path / "c.py").write_text("  \n\t\n")
    (tmp_path / "d.py").write_text("y = 2\n")
    corpus = Corpus(root=str(tmp_path), train_files=("a.py", "b.py", "c.py"), heldout_files=("c.py", "d.py"))
    assert corpus.texts("train") == ["x = 1\n"]
    assert corpus.texts("heldout") == ["y = 2\n"]
