"""``dspark-jax eval`` on the bundled pair (small scale) and its pieces."""

import json

import numpy as np
import pytest

from dspark_jax.bundled import TARGET_DIR
from dspark_jax.cli import main
from dspark_jax.corpus import load_corpus
from dspark_jax.evaluate import format_tables, heldout_prompts
from dspark_jax.tokenizer import load_tokenizer


def test_eval_reports_tau_for_both_drafts(tmp_path, capsys):
    path = tmp_path / "eval.json"
    argv = ["eval", "--prompts", "2", "--prompt-len", "16", "--max-new", "16", "--temperatures", "1"]
    assert main([*argv, "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| DSpark / DFlash-style |" in out
    results = json.loads(path.read_text())["results"]
    assert set(results) == {"DSpark", "DFlash-style"}
    for per_temperature in results.values():
        r = per_temperature["1.0"]
        assert 1.0 <= r["tau"] <= 8.0  # at least the bonus, at most γ + 1
        acc = r["acceptance_by_position"]
        assert len(acc) == 7 and all(a >= b for a, b in zip(acc, acc[1:], strict=False))


def test_heldout_prompts_come_from_heldout_files_only():
    tok = load_tokenizer(TARGET_DIR)
    prompts = heldout_prompts(tok, count=4, length=24, seed=3)
    assert [len(p) for p in prompts] == [24] * 4
    heldout = "".join(load_corpus().texts("heldout"))
    for p in prompts:
        assert tok.decode(p) in heldout
    with pytest.raises(ValueError, match="count"):
        heldout_prompts(tok, count=0, length=8)


def test_tables_show_ratio_against_the_baseline():
    def entry(tau):
        return {"tau": tau, "acceptance_by_position": list(np.linspace(0.5, 0.1, 7))}

    results = {"A": {0.0: entry(3.0), 1.0: entry(2.2)}, "B": {0.0: entry(2.0), 1.0: entry(2.0)}}
    text = format_tables(results)
    assert "| A / B | 1.500× | 1.100× |" in text
    assert "| A | 3.000 | 2.200 |" in text
