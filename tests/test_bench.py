"""The benchmark runs at tiny shapes on a CPU and reports what it promises (no timing assertions)."""

import json

import jax
import numpy as np
import pytest

from dspark_jax import bench
from dspark_jax.race_kernel import race_supported

_ON_GPU = jax.default_backend() == "gpu"


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "result.json"
    argv = ["--shapes", "tiny", "--batches", "1", "--iters", "2", "--eager-iters", "1"]
    argv += ["--no-torch", "--no-compile", "--e2e", "--out", str(out)]
    assert bench.main(argv) == 0
    return json.loads(out.read_text())


def test_tiny_run_times_every_batch_mode_and_path(tiny_result):
    rows = tiny_result["propose"]
    seen = {(r["batch"], r["mode"], r["path"]) for r in rows}
    assert (1, "greedy", "folded_greedy") in seen and (1, "greedy", "jit_static") in seen
    assert (1, "greedy", "split_greedy") in seen
    for mode in bench.MODES:
        for path in ("folded", "split", "proposer", "eager"):
            assert (1, mode, path) in seen
    for r in rows:
        assert r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["released_median_ms"] > 0 and r["pipelined_ms"] > 0 and r["spin_median_ms"] > 0
        if r["path"].startswith(("folded", "split")):
            assert r["floor_ms"] > 0 and r["floor_bound"] in ("bytes", "flops")


def test_tiny_run_reports_ceilings_and_end_to_end(tiny_result):
    ceil = tiny_result["ceilings"]
    for name in ("elementwise_bytes_per_s", "copy_bytes_per_s", "matmul_flops_per_s"):
        assert ceil[name] > 0
    # each sample's dispatch is part of its round trip, so the medians keep that order
    assert 0 < ceil["host_dispatch_ms"] <= ceil["host_roundtrip_ms"]
    e2e = tiny_result["e2e"]
    assert 1.0 <= e2e["tau_measured"] <= 8.0
    for name in ("plain_tokens_per_s", "spec_tokens_per_s", "ideal_speedup", "fraction_of_ideal"):
        assert e2e[name] > 0
    assert tiny_result["meta"]["shapes"] == "tiny"
    # auto: the race kernel on GPUs (the tiny vocabulary is supported), the XLA sampler elsewhere
    assert race_supported(bench.draft_config(bench.SHAPES["tiny"]).vocab_size)
    assert tiny_result["meta"]["race"] == "auto" and tiny_result["meta"]["race_kernel"] is _ON_GPU
    assert tiny_result["meta"]["command"].split()[:4] == ["dspark-jax", "bench", "--shapes", "tiny"]


def test_table_has_a_line_per_timed_row(tiny_result):
    table = bench.format_table(tiny_result)
    assert "propose latency" in table and "ceilings:" in table and "e2e batch 1" in table
    assert "host: a trivial jitted op is ready" in table
    kernel = "fused Pallas kernel per step" if _ON_GPU else "XLA"
    assert f"folded walk's sampling step: {kernel} (DSPARK_JAX_RACE=auto)" in table
    timed = [line for line in table.splitlines() if line.split()[:1] == ["1"]]
    assert len(timed) == len(tiny_result["propose"])


def test_forced_accept_distribution_has_the_requested_mean():
    for tau in (1.5, 4.0, 6.17, 7.9):
        probs = bench.forced_accept_probs(tau, 7)
        assert probs.shape == (8,) and np.all(probs > 0)
        np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-12)
        np.testing.assert_allclose(probs @ np.arange(8) + 1, tau, rtol=1e-9)
    with pytest.raises(ValueError, match="tau"):
        bench.forced_accept_probs(9.0, 7)


def test_round_cost_counts_weights_markov_context_and_logits():
    cfg = bench.draft_config(bench.SHAPES["8b"])
    greedy = bench.round_cost(cfg, 1, 1024, folded_sampling=False)
    folded = bench.round_cost(cfg, 1, 1024, folded_sampling=True)
    h, i, v = 4096, 12288, 151936
    layer = 2 * (h * 32 * 128 * 2 + h * 8 * 128 * 2 + 3 * h * i)  # bf16 bytes of one layer
    expected = 5 * layer + v * h * 2 + 7 * v * 256 * 2 + 2 * 5 * 1024 * 8 * 128 * 2 + 7 * h * 2
    assert greedy["bytes"] == expected
    assert folded["bytes"] - greedy["bytes"] == 7 * v * 2  # the corrected logits, kept in bf16
    # The paper-scale round reads about 3.74 GB at batch 1 (the roofline).
    assert 3.7e9 < greedy["bytes"] < 3.8e9


def test_floor_is_the_larger_of_the_two_bounds():
    cost = {"bytes": 2e9, "flops": 1e12}
    assert bench.floor_ms(cost, 1e12, 1e15) == (2.0, "bytes")
    assert bench.floor_ms(cost, 1e13, 1e14) == (10.0, "flops")


def test_bad_batches_are_refused_before_anything_runs():
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", "--batches", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", "--modes", "greedy,bogus"])


def test_time_calls_interleaves_rounds_and_merges_their_samples():
    """Each round times every call in turn; the statistics cover all rounds' calls."""
    order = []

    def make(name):
        def call():
            order.append(name)
            return np.zeros(1)

        return call

    got = bench.time_calls({"a": make("a"), "b": make("b")}, iters=5, rounds=2)  # 3 calls per loop and round
    per_round = 3 + 4 * 3  # warm-up + latency, pipelined, released and spin loops
    assert order == ["a"] * per_round + ["b"] * per_round + ["a"] * (per_round - 1) + ["b"] * (per_round - 1)
    for stats in got.values():
        assert stats["iters"] == 6
        assert 0 < stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"] and stats["pipelined_ms"] > 0
    with pytest.raises(ValueError, match="rounds >= 1 and iters >= 1, got rounds=0"):
        bench.time_calls({"a": make("a")}, iters=5, rounds=0)
