"""``dspark-jax bench --walk`` at tiny shapes on a CPU: rows, token checks, table (no timing assertions)."""

import dataclasses
import os

import numpy as np
import pytest
from flax import nnx

from dspark_jax import bench, bench_walk
from dspark_jax.race_kernel import RACE_ENV


def _draft(**changes):
    cfg = dataclasses.replace(bench.draft_config(bench.SHAPES["tiny"]), **changes)
    return nnx.merge(*bench.build_draft(cfg))


@pytest.fixture(scope="module")
def tiny_draft():
    return _draft()


def test_walk_rows_cover_every_batch_mode_and_path_with_equal_tokens(tiny_draft, monkeypatch):
    monkeypatch.setenv(RACE_ENV, "xla")
    rows = bench_walk.bench_walk(tiny_draft, batches=(1, 3), modes=bench.MODES, iters=2)
    seen = [(r["batch"], r["mode"], r["path"]) for r in rows]
    expected = [(b, "greedy", "greedy_only") for b in (1, 3)] + [(b, m, "folded") for b in (1, 3) for m in bench.MODES]
    assert sorted(seen) == sorted(expected)  # no folded_xla row: the kernel is off
    gamma = tiny_draft.cfg.block_size
    for r in rows:
        assert not r["kernel"]
        assert r["median_ms"] > 0 and r["pipelined_ms"] > 0
        assert r["step_us"] == pytest.approx(1e3 * r["pipelined_ms"] / gamma)
        assert r["tokens_compared"] == r["batch"] * gamma and r["tokens_differ"] == 0
        assert r["tokens_reference"] == ("greedy_only" if r["mode"] == "greedy" else "folded")


def test_walk_times_the_kernel_against_the_xla_sampler_and_their_tokens_agree(tiny_draft, monkeypatch):
    monkeypatch.setenv(RACE_ENV, "pallas")  # the Pallas interpreter on a CPU
    rows = bench_walk.bench_walk(tiny_draft, batches=(2,), modes=("greedy", "sampling"), iters=1)
    by_path = {(r["mode"], r["path"]): r for r in rows}
    assert set(by_path) == {
        ("greedy", "greedy_only"),
        ("greedy", "folded"),
        ("greedy", "folded_xla"),
        ("sampling", "folded"),
        ("sampling", "folded_xla"),
    }
    assert by_path[("sampling", "folded")]["kernel"] and not by_path[("sampling", "folded_xla")]["kernel"]
    assert all(r["tokens_differ"] == 0 for r in rows)
    assert os.environ[RACE_ENV] == "pallas"  # the xla path's setting was undone


def test_walk_inputs_have_the_draft_shapes(tiny_draft):
    cfg = tiny_draft.cfg
    x = bench_walk.walk_inputs(tiny_draft, 4)
    assert x["base"].shape == (4, cfg.block_size, cfg.vocab_size) and x["base"].dtype == cfg.jnp_dtype
    assert x["hidden"].shape == (4, cfg.block_size, cfg.hidden_size)
    assert x["bonus"].shape == (4,) and int(np.max(x["bonus"])) < cfg.vocab_size


def test_walk_needs_a_markov_head():
    with pytest.raises(ValueError, match="markov_head is None"):
        bench_walk.bench_walk(
            _draft(markov_rank=0, confidence_head_with_markov=False), batches=(1,), modes=("greedy",), iters=1
        )


def test_walk_table_gives_step_ratios_and_names_differing_tokens():
    row = dict(median_ms=0.5, pipelined_ms=0.35, tokens_compared=14)
    rows = [
        {**row, "batch": 2, "mode": "greedy", "path": "greedy_only", "step_us": 50.0, "tokens_differ": 0,
         "tokens_reference": "greedy_only"},
        {**row, "batch": 2, "mode": "sampling", "path": "folded", "step_us": 60.0, "tokens_differ": 3,
         "tokens_reference": "folded"},
    ]  # fmt: skip
    lines = bench_walk.format_walk(rows)
    assert "Markov walk alone" in lines[0]
    assert "1.000" in lines[2] and "same (vs greedy_only)" in lines[2]
    assert "1.200" in lines[3] and "3/14 differ (vs folded)" in lines[3]
    assert bench_walk.format_walk([]) == []
    assert "Markov walk alone" in bench.format_table({"walk": rows})
