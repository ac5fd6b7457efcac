"""``dspark-jax bench --walk`` at tiny shapes on a CPU: rows, token checks, table (no timing assertions)."""

import argparse
import dataclasses
import os

import jax
import numpy as np
import pytest
from flax import nnx

from dspark_jax import bench, bench_report, bench_walk, bench_workload
from dspark_jax.race_kernel import RACE_ENV, RaceTuning
from dspark_jax.tile_race_kernel import TILE_RACE_ENV


def _draft(**changes):
    cfg = dataclasses.replace(bench_workload.draft_config(bench_workload.SHAPES["tiny"]), **changes)
    return nnx.merge(*bench_workload.build_draft(cfg))


@pytest.fixture(scope="module")
def tiny_draft():
    return _draft()


def test_walk_rows_cover_every_batch_mode_and_path_with_equal_tokens(tiny_draft, monkeypatch):
    monkeypatch.setenv(RACE_ENV, "xla")
    rows = bench_walk.bench_walk(tiny_draft, batches=(3,), modes=bench_workload.MODES, iters=2, profile=True)
    seen = [(r["batch"], r["mode"], r["path"]) for r in rows]
    expected = [(3, "greedy", "greedy_only")] + [(3, m, "folded") for m in bench_workload.MODES]
    assert sorted(seen) == sorted(expected)  # no folded_xla row: the kernel is off
    gamma = tiny_draft.cfg.block_size
    for r in rows:
        assert not r["kernel"]
        assert r["median_ms"] > 0 and r["pipelined_ms"] > 0
        assert r["step_us"] == pytest.approx(1e3 * r["pipelined_ms"] / gamma)
        assert r["tokens_compared"] == r["batch"] * gamma and r["tokens_differ"] == 0
        assert r["tokens_reference"] == ("greedy_only" if r["mode"] == "greedy" else "folded")
        assert r["profile"]["calls"] == 2  # every path and mode profiled; a CPU records no device time
        assert (r["profile"]["device_busy_ms"] > 0) == (jax.default_backend() == "gpu")


def test_walk_times_the_kernel_against_the_xla_sampler_and_their_tokens_agree(monkeypatch):
    monkeypatch.setenv(RACE_ENV, "pallas")  # the Pallas interpreter on a CPU
    tuning = RaceTuning(blocks_per_program=2, warps=1, pick_warps=4)
    draft = _draft(block_size=3)  # γ = 3: fewer interpreted steps
    rows = bench_walk.bench_walk(draft, batches=(2,), modes=("sampling",), iters=1, tunings=(tuning,))
    by_path = {(r["mode"], r["path"]): r for r in rows}
    # float32: no tiled kernel, so no folded_race row
    assert set(by_path) == {("sampling", "folded"), ("sampling", "folded_xla"), ("sampling", "folded_p2w1k4")}
    assert by_path[("sampling", "folded")]["kernel"] == "race" and by_path[("sampling", "folded_xla")]["kernel"] is None
    tuned = by_path[("sampling", "folded_p2w1k4")]
    assert tuned["kernel"] == "race" and tuned["tuning"] == "p2w1k4"
    assert by_path[("sampling", "folded")]["tuning"] is None
    assert all(r["tokens_differ"] == 0 for r in rows)
    assert os.environ[RACE_ENV] == "pallas"  # the xla path's setting was undone


def test_walk_times_the_tiled_kernels_against_the_race_kernel_and_xla(monkeypatch):
    monkeypatch.setenv(RACE_ENV, "pallas")
    monkeypatch.setenv(TILE_RACE_ENV, "pallas")
    draft = _draft(dtype="bfloat16", param_dtype="bfloat16", block_size=3)  # γ = 3: fewer interpreted steps
    rows = bench_walk.bench_walk(draft, batches=(2,), modes=("mixed",), iters=1)
    by_path = {r["path"]: r for r in rows}
    assert {p: r["kernel"] for p, r in by_path.items()} == {
        "folded": "tiles",
        "folded_race": "race",
        "folded_xla": None,
    }
    # bf16 bias sums in another order may move a near-tie; at these shapes none moved
    assert all(r["tokens_differ"] == 0 and r["tokens_reference"] == "folded" for r in rows)
    assert os.environ[TILE_RACE_ENV] == "pallas" and os.environ[RACE_ENV] == "pallas"


def test_greedy_only_walk_drops_the_corrected_logits_as_the_round_does(tiny_draft, monkeypatch):
    monkeypatch.setenv(RACE_ENV, "xla")
    cfg = tiny_draft.cfg
    graphdef, state = nnx.split(tiny_draft.markov_head)
    x = bench_walk.walk_inputs(tiny_draft, 3)
    temps, top_k = bench_workload.sampling_params(3, "greedy")
    args = (graphdef, state, x["base"], x["hidden"], x["bonus"], temps, top_k, x["key"])
    tokens, corrected = bench_walk._walk(*args, fold_sampling=False, tuning=None)
    folded_tokens, folded = bench_walk._walk(*args, fold_sampling=True, tuning=None)
    assert corrected.shape == (3, cfg.block_size, 0)  # not formed: the greedy-only round drops them
    assert folded.shape == (3, cfg.block_size, cfg.vocab_size)
    np.testing.assert_array_equal(np.asarray(tokens), np.asarray(folded_tokens))


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
    assert "Markov walk alone" in bench_report.format_table({"walk": rows})
    assert "busy" not in lines[1]  # no profile, no column
    profiled = [{**rows[0], "profile": {"device_busy_ms": 0.1875}}, rows[1]]
    lines = bench_walk.format_walk(profiled)
    assert "busy = device time per walk" in lines[0] and lines[1].split()[-2:] == ["busy", "tokens"]
    assert "  187.5  same" in lines[2] and "      -  3/14 differ" in lines[3]


def test_race_tunings_flag_parses_and_needs_walk(capsys):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--walk", "--race-tunings", "1:2:8,4:1:16"])
    assert [t.label for t in args.race_tunings] == ["p1w2k8", "p4w1k16"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--race-tunings", "3:2:8"])
    assert "blocks_per_program=3 is invalid" in capsys.readouterr().err
    with pytest.raises(ValueError, match="--race-tunings is only used with --walk"):
        bench.main(["--shapes", "tiny", "--no-torch", "--no-compile", "--race-tunings", "2:2:8"])
