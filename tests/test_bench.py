"""The benchmark runs at tiny shapes on a CPU and reports what it promises (no timing assertions)."""

import argparse
import copy
import functools
import json
import os
import re
import types
import weakref

import jax
import numpy as np
import pytest

from dspark_jax import bench, bench_compile, bench_e2e, bench_report, bench_timing, bench_workload
from dspark_jax.cpu_awake import CpuAwake, host_cpus
from dspark_jax.gpu_power import PowerSampler
from dspark_jax.greedy_kernel import GREEDY_ENV
from dspark_jax.mlp_kernel import MLP_ENV
from dspark_jax.race_kernel import race_supported
from dspark_jax.split_round import BACKBONE_GEMM_ENV, SplitRound

_ON_GPU = jax.default_backend() == "gpu"


# SplitRound instance -> (DSPARK_JAX_GREEDY, DSPARK_JAX_MLP) when it was first called in tiny_result
_FIRST_CALL_ENV: dict[int, tuple[str | None, str | None]] = {}
# --awake: the CpuAwake instances the run entered, and how many spinners ran at each SplitRound call
_AWAKE: list[CpuAwake] = []
_SPINNERS_AT_CALL: list[int] = []


@pytest.fixture(scope="module")
def tiny_result(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "result.json"
    argv = ["--shapes", "tiny", "--batches", "1", "--iters", "2", "--eager-iters", "1"]
    argv += ["--no-torch", "--no-compile", "--e2e", "--gemm", "xla", "--cuts", "2"]
    argv += ["--versus", "greedy=xla, mlp=pallas", "--awake", "--profile", "--idle-ms", "0.5", "--out", str(out)]
    before = os.environ.get(BACKBONE_GEMM_ENV)
    original_call = SplitRound.__call__

    def recording_call(self, *args, **kwargs):
        _FIRST_CALL_ENV.setdefault(id(self), (os.environ.get(GREEDY_ENV), os.environ.get(MLP_ENV)))
        _SPINNERS_AT_CALL.append(sum(len(a.pids) for a in _AWAKE))
        return original_call(self, *args, **kwargs)

    original_enter = CpuAwake.__enter__

    def recorded_profile(fn, *, iters, top=80):  # the real trace costs ~0.3 s a row on a CPU
        jax.block_until_ready(fn())
        return {"calls": iters, "device_busy_ms": 0.0, "launches_per_call": 0.0, "kernels": [], "recorded": True}

    def recording_enter(self):
        _AWAKE.append(self)
        return original_enter(self)

    with pytest.MonkeyPatch.context() as patch:
        # recorded, so the context restores the variable the run sets (delenv of an unset name
        # records nothing, and the executable store's keys of later tests include DSPARK_*)
        patch.setenv(BACKBONE_GEMM_ENV, "auto")
        for variable in (GREEDY_ENV, MLP_ENV):
            patch.delenv(variable, raising=False)
        patch.setattr(SplitRound, "__call__", recording_call)
        patch.setattr(CpuAwake, "__enter__", recording_enter)
        patch.setattr(bench_timing, "profile_kernels", recorded_profile)
        # a board that answers as a power-capped GPU does (a CPU has no NVML to read)
        board = (lambda: (690.0, 1620.0, 0x4), 700.0)
        patch.setattr(bench, "PowerSampler", functools.partial(PowerSampler, reader=board, interval_s=0.001))
        assert bench.main(argv) == 0
        assert os.environ[BACKBONE_GEMM_ENV] == "xla"
        assert GREEDY_ENV not in os.environ and MLP_ENV not in os.environ  # --versus restores them
    assert os.environ.get(BACKBONE_GEMM_ENV) == before
    return json.loads(out.read_text())


def test_awake_runs_a_spinner_per_cpu_while_timing_and_stops_them(tiny_result):
    assert tiny_result["meta"]["awake_spinners"] == len(host_cpus())
    assert _AWAKE and _SPINNERS_AT_CALL and set(_SPINNERS_AT_CALL) == {len(host_cpus())}
    assert all(a.pids == [] for a in _AWAKE)  # stopped after the timed stages
    assert f"timed with {len(host_cpus())} spinners" in bench_report.format_table(tiny_result)


def test_tiny_run_times_every_batch_mode_and_path(tiny_result):
    rows = tiny_result["propose"]
    seen = {(r["batch"], r["mode"], r["path"]) for r in rows}
    assert (1, "greedy", "folded_greedy") in seen and (1, "greedy", "jit_static") in seen
    assert (1, "greedy", "split_greedy") in seen
    for mode in bench_workload.MODES:
        for path in ("folded", "split", "proposer", "proposer_device", "eager"):
            assert (1, mode, path) in seen
    # --cuts 2: the split paths again with the tiny draft's two layers in one backbone piece
    assert (1, "greedy", "split_greedy@2") in seen
    assert {(1, mode, "split@2") for mode in bench_workload.MODES} <= seen
    assert not any(p.endswith("@1|1") for _, _, p in seen)  # the default cut is not timed twice unasked
    # --versus greedy=xla,mlp=pallas: the split paths again, each round traced with its choice set
    for label, env in (("greedy=xla", {GREEDY_ENV: "xla"}), ("mlp=pallas", {MLP_ENV: "pallas"})):
        assert (1, "greedy", f"split_greedy@{label}") in seen
        assert {(1, mode, f"split@{label}") for mode in bench_workload.MODES} <= seen
        assert all(r["traced_with"] == env for r in rows if r["path"].endswith(label))
    first_calls = sorted(_FIRST_CALL_ENV.values(), key=str)
    assert first_calls.count(("xla", None)) == 1 and first_calls.count((None, "pallas")) == 1
    assert set(first_calls) == {("xla", None), (None, "pallas"), (None, None)}  # the others: the run's own
    for r in rows:
        assert r["median_ms"] > 0 and r["p10_ms"] <= r["median_ms"] <= r["p90_ms"]
        assert r["released_median_ms"] > 0 and r["pipelined_ms"] > 0 and r["spin_median_ms"] > 0
        if r["path"] != "eager":  # --idle-ms 0.5: the interleaved paths timed after idle too
            assert r["idle_median_ms"] > 0
            board = r["board"]
            assert board["samples"] >= 1 and board["power_capped_share"] == 1.0 and board["power_limit_w"] == 700.0
            assert board["sm_clock_mhz_median"] == 1620.0 and board["thermal_share"] == 0.0
        if "@" in r["path"]:  # same inputs and key as the default cut: same tokens
            assert r["tokens_compared"] > 0 and r["tokens_differ"] == 0, r
        if r["path"].startswith(("folded", "split")):
            assert r["floor_ms"] > 0 and r["floor_bound"] in ("bytes", "flops")


def test_profile_covers_every_mode_of_the_compiled_paths(tiny_result):
    profiled = {(r["mode"], r["path"]) for r in tiny_result["propose"] if "profile" in r}
    for mode in bench_workload.MODES:
        for path in ("folded", "split", "split@2", "split@greedy=xla"):
            assert (mode, path) in profiled, (mode, path)
    assert not any(path.startswith(("proposer", "eager")) for _, path in profiled)
    assert all(r["profile"].get("recorded") for r in tiny_result["propose"] if "profile" in r)


def test_profile_kernels_reads_a_trace_and_reports_per_call_fields():
    f = jax.jit(lambda x: x * 2.0 + 1.0)
    x = jax.numpy.zeros((64,), jax.numpy.float32)
    result = bench_timing.profile_kernels(lambda: f(x), iters=3)
    assert result["calls"] == 3
    assert set(result) == {"calls", "device_busy_ms", "launches_per_call", "kernels"}
    if _ON_GPU:  # one fused kernel per call
        assert result["device_busy_ms"] > 0 and result["launches_per_call"] >= 1 and result["kernels"]
    else:  # a CPU trace has no device plane
        assert result["device_busy_ms"] == 0.0 and result["kernels"] == []


def test_tiny_run_reports_ceilings_and_end_to_end(tiny_result):
    ceil = tiny_result["ceilings"]
    for name in ("elementwise_bytes_per_s", "copy_bytes_per_s", "matmul_flops_per_s"):
        assert ceil[name] > 0
    # each sample's dispatch is part of its round trip, so the medians keep that order
    assert 0 < ceil["host_dispatch_ms"] <= ceil["host_roundtrip_ms"]
    assert ceil["matmul_waited_ms"] > 0 and ceil["matmul_pipelined_ms"] > 0
    rate = 2 * ceil["matmul_size"] ** 3 / (ceil["matmul_pipelined_ms"] * 1e-3)
    assert ceil["matmul_flops_per_s"] == pytest.approx(rate)
    e2e = tiny_result["e2e"]
    assert 1.0 <= e2e["tau_measured"] <= 8.0
    for name in ("plain_tokens_per_s", "spec_tokens_per_s", "ideal_speedup", "fraction_of_ideal"):
        assert e2e[name] > 0
    assert tiny_result["meta"]["shapes"] == "tiny"
    # auto: the race kernel on GPUs (the tiny vocabulary is supported), the XLA sampler elsewhere
    assert race_supported(bench_workload.draft_config(bench_workload.SHAPES["tiny"]).vocab_size)
    assert tiny_result["meta"]["race"] == "auto" and tiny_result["meta"]["race_kernel"] is _ON_GPU
    # the tiled race kernels take 16-bit heads only, as the greedy ones
    assert tiny_result["meta"]["tile_race"] == "auto" and tiny_result["meta"]["tile_race_kernel"] == []
    # the greedy kernels take 16-bit heads only: never for the float32 tiny shapes
    assert tiny_result["meta"]["greedy"] == "auto" and tiny_result["meta"]["greedy_kernel"] == []
    # the MLP kernel takes 16-bit dtypes only: never for the float32 tiny shapes
    assert tiny_result["meta"]["mlp"] == "auto" and tiny_result["meta"]["mlp_kernel"] == []
    assert tiny_result["meta"]["command"].split()[:4] == ["dspark-jax", "bench", "--shapes", "tiny"]


def test_table_has_a_line_per_timed_row(tiny_result):
    table = bench_report.format_table(tiny_result)
    assert "propose latency" in table and "ceilings:" in table and "e2e batch 1" in table
    assert "host: a trivial jitted op is ready" in table
    assert f"host: the {tiny_result['ceilings']['matmul_size']}³ product, one kernel, is ready" in table
    kernel = "race Pallas kernel per step" if _ON_GPU else "XLA"  # float32 tiny shapes: no tiled kernels
    assert f"folded walk's sampling step: {kernel} (DSPARK_JAX_TILE_RACE=auto, DSPARK_JAX_RACE=auto)" in table
    meta = tiny_result["meta"]
    table = bench_report.format_table({**tiny_result, "meta": {**meta, "tile_race_kernel": [1, 8]}})
    assert f"folded walk's sampling step: two tiled Pallas kernels per step at batches [1, 8], {kernel} at" in table
    assert "greedy-only walk's step: XLA (DSPARK_JAX_GREEDY=auto)" in table  # float32 tiny shapes
    table = bench_report.format_table({**tiny_result, "meta": {**meta, "greedy_kernel": [1, 8]}})
    assert "greedy-only walk's step: two Pallas kernels per step at batches [1, 8], XLA at the others" in table
    assert "draft MLP's gate/up projections and SwiGLU: XLA (DSPARK_JAX_MLP=auto)" in bench_report.format_table(
        tiny_result
    )
    table = bench_report.format_table({**tiny_result, "meta": {**tiny_result["meta"], "mlp_kernel": [1, 8]}})
    assert "SwiGLU: one Pallas kernel per layer at batches [1, 8], XLA at the others (DSPARK_JAX_MLP=auto)" in table
    assert "split round's backbone GEMMs: XLA's choice (DSPARK_JAX_BACKBONE_GEMM=xla)" in bench_report.format_table(
        tiny_result
    )
    table = bench_report.format_table(
        {**tiny_result, "meta": {**tiny_result["meta"], "backbone_gemm": "auto", "backbone_cublas": [8]}}
    )
    assert (
        "split round's backbone GEMMs: cuBLAS at batches [8], XLA's choice at the others "
        "(DSPARK_JAX_BACKBONE_GEMM=auto)" in table
    )
    table = bench_report.format_table(tiny_result)
    timed = [line for line in table.splitlines() if line.split()[:1] == ["1"]]
    assert len(timed) == len(tiny_result["propose"])


def test_every_path_picks_the_tokens_of_the_first_path(tiny_result):
    """Same inputs and key: the folded, split, static, Proposer and eager rounds agree token for
    token (greedy and sampling rows), and the table says so."""
    gamma = bench_workload.draft_config(bench_workload.SHAPES["tiny"]).gamma
    rows = tiny_result["propose"]
    for r in rows:
        assert r["tokens_compared"] == r["batch"] * gamma and r["tokens_differ"] == 0, r
    refs = {(r["mode"], r["path"]): r["tokens_reference"] for r in rows}
    assert refs[("greedy", "split_greedy")] == refs[("greedy", "eager")] == "folded_greedy"
    assert refs[("sampling", "split")] == refs[("sampling", "eager")] == "folded"
    assert refs[("mixed", "proposer")] == refs[("mixed", "proposer_device")] == "split (the Proposer's slots)"
    assert "every path picks the same tokens as the first path of its batch and mode" in bench_report.format_table(
        tiny_result
    )


def test_token_parity_counts_differing_tokens_and_the_table_names_them(tiny_result):
    reference = {}
    block = types.SimpleNamespace(draft_tokens=np.array([[1, 2, 3], [4, 5, 6]]))
    assert bench._token_parity(reference, "mixed", "folded", block)["tokens_differ"] == 0
    other = types.SimpleNamespace(draft_tokens=np.array([[1, 2, 9], [4, 0, 6]]))
    got = bench._token_parity(reference, "mixed", "split", other)
    # mixed at batch 2: row 0 samples, row 1 is greedy
    assert got == {
        "tokens_reference": "folded",
        "tokens_differ": 2,
        "tokens_compared": 6,
        "tokens_differ_sampling_rows": 1,
    }
    # with corrected logits: the gap between the own and the reference's token at each
    # differing greedy row's first differing step (row 1 step 1: 0 vs 5); the sampling
    # row 0 (step 2: 9 vs 3, a gap of 7) is counted, not measured
    logits = np.zeros((2, 3, 10), np.float32)
    logits[0, 2, 9], logits[0, 2, 3] = 12.0, 5.0
    logits[1, 1, 0], logits[1, 1, 5] = 1.0, 4.0
    logits[1, 2, 6] = 99.0  # a later step: not looked at
    with_logits = types.SimpleNamespace(draft_tokens=other.draft_tokens, corrected_logits=logits)
    assert bench._token_parity(reference, "mixed", "eager", with_logits)["tokens_logit_gap"] == 3.0
    greedy_ref = {}
    bench._token_parity(greedy_ref, "greedy", "folded", block)
    got = bench._token_parity(greedy_ref, "greedy", "eager", with_logits)
    assert got["tokens_logit_gap"] == 7.0 and "tokens_differ_sampling_rows" not in got
    sampling_ref = {}
    bench._token_parity(sampling_ref, "sampling", "folded", block)
    got = bench._token_parity(sampling_ref, "sampling", "eager", with_logits)
    assert got["tokens_differ_sampling_rows"] == 2 and "tokens_logit_gap" not in got
    no_logits = types.SimpleNamespace(draft_tokens=other.draft_tokens, corrected_logits=np.zeros((2, 3, 0)))
    assert "tokens_logit_gap" not in bench._token_parity(reference, "mixed", "split_greedy", no_logits)
    result = copy.deepcopy(tiny_result)
    row = next(r for r in result["propose"] if (r["mode"], r["path"]) == ("mixed", "split"))
    row["tokens_differ"] = 3
    table = bench_report.format_table(result)
    assert "draft tokens DIFFER" in table and "batch 1 mixed split: 3 of 7 against folded" in table
    assert "logit gap" not in table
    row["tokens_logit_gap"] = 0.03125
    table = bench_report.format_table(result)
    assert "batch 1 mixed split: 3 of 7 against folded (logit gap 0.0312 in greedy rows)" in table
    assert "near-tie" in table and "sampling rows:" not in table
    assert "every path picks the same tokens" not in table
    row["tokens_differ_sampling_rows"] = 2
    table = bench_report.format_table(result)
    assert "3 of 7 against folded (logit gap 0.0312 in greedy rows; 2 sampling rows)" in table
    assert "sampling rows: each token wins the race of its logits and its noise" in table


def test_forced_accept_distribution_has_the_requested_mean():
    for tau in (1.5, 4.0, 6.17, 7.9):
        probs = bench_e2e.forced_accept_probs(tau, 7)
        assert probs.shape == (8,) and np.all(probs > 0)
        np.testing.assert_allclose(probs.sum(), 1.0, rtol=1e-12)
        np.testing.assert_allclose(probs @ np.arange(8) + 1, tau, rtol=1e-9)
    with pytest.raises(ValueError, match="tau"):
        bench_e2e.forced_accept_probs(9.0, 7)


def test_round_cost_counts_weights_markov_context_and_logits():
    cfg = bench_workload.draft_config(bench_workload.SHAPES["8b"])
    greedy = bench_workload.round_cost(cfg, 1, 1024, folded_sampling=False)
    folded = bench_workload.round_cost(cfg, 1, 1024, folded_sampling=True)
    h, i, v = 4096, 12288, 151936
    layer = 2 * (h * 32 * 128 * 2 + h * 8 * 128 * 2 + 3 * h * i)  # bf16 bytes of one layer
    expected = 5 * layer + v * h * 2 + 7 * v * 256 * 2 + 2 * 5 * 1024 * 8 * 128 * 2 + 7 * h * 2
    assert greedy["bytes"] == expected
    assert folded["bytes"] - greedy["bytes"] == 7 * v * 2  # the corrected logits, kept in bf16
    # The paper-scale round reads about 3.74 GB at batch 1 (the roofline).
    assert 3.7e9 < greedy["bytes"] < 3.8e9


def test_floor_is_the_larger_of_the_two_bounds():
    cost = {"bytes": 2e9, "flops": 1e12}
    assert bench_workload.floor_ms(cost, 1e12, 1e15) == (2.0, "bytes")
    assert bench_workload.floor_ms(cost, 1e13, 1e14) == (10.0, "flops")


def test_bad_batches_are_refused_before_anything_runs():
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", "--batches", "0"])
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", "--modes", "greedy,bogus"])


@pytest.mark.parametrize(
    ("flag", "text", "says"),
    [
        ("--batches", "2,1,2", "'2,1,2' is invalid: 2 given more than once"),
        ("--modes", "greedy,mixed,greedy", "'greedy,mixed,greedy' is invalid: 'greedy' given more than once"),
        ("--paths", "split,folded,split,folded", "is invalid: 'split', 'folded' given more than once"),
    ],
)
def test_a_list_flag_naming_a_value_twice_is_refused(monkeypatch, capsys, flag, text, says):
    """``--batches 2,1,2`` timed batch 2 twice (its rows and memory row doubled); a mode or path
    named twice was dropped silently by the compiled paths (and doubled by the Proposer's)."""
    monkeypatch.setattr(bench, "run", lambda args: pytest.fail("the flags were accepted"))
    with pytest.raises(SystemExit):
        bench.main(["--shapes", "tiny", flag, text])
    assert f"argument {flag}: " in (err := capsys.readouterr().err) and says in err, err


def test_e2e_settings_and_the_output_file_are_refused_before_any_stage(monkeypatch, tmp_path):
    """``--tau`` and ``--e2e-layers`` without ``--e2e`` were ignored silently; an ``--out`` in a
    missing folder, or a folder, failed with FileNotFoundError / IsADirectoryError when the first
    stage's result was saved."""

    def measured(*args, **kwargs):
        raise AssertionError("the run reached the timed stage")

    monkeypatch.setattr(bench, "_measure", measured)
    base = ["--shapes", "tiny", "--batches", "1", "--no-torch", "--no-compile"]
    for flag, value in (("--tau", "3"), ("--e2e-layers", "3")):
        with pytest.raises(ValueError, match=f"^{flag} is only used with --e2e: add --e2e, or drop {flag}$"):
            bench.main([*base, flag, value])
    for out in (tmp_path / "missing" / "b.json", tmp_path):
        with pytest.raises(ValueError, match=r"^--out=.* is invalid: must be a file path in an existing folder$"):
            bench.main([*base, "--out", str(out)])
    access = os.access
    monkeypatch.setattr(os, "access", lambda path, mode: os.fspath(path) != str(tmp_path) and access(path, mode))
    with pytest.raises(ValueError, match=r"^--out=.* cannot be written: .* is not writable$"):
        bench.main([*base, "--out", str(tmp_path / "b.json")])


def test_an_xla_flag_xla_does_not_know_is_refused_by_name(monkeypatch):
    """An unknown name in ``--xla-flags`` aborted the process at the backend's start with exit
    status 1 and XLA's fatal log line; it is now tried in a child process first."""
    monkeypatch.setattr(bench, "_measure", lambda *a, **k: pytest.fail("the run reached the timed stage"))
    monkeypatch.delenv("XLA_FLAGS", raising=False)
    want = "--xla-flags '--xla_no_such_flag=1': XLA refuses it (Unknown flag in XLA_FLAGS: --xla_no_such_flag=1)"
    with pytest.raises(ValueError, match="^" + re.escape(want) + "$"):
        bench.main(["--shapes", "tiny", "--no-torch", "--no-compile", "--xla-flags=--xla_no_such_flag=1"])
    assert "XLA_FLAGS" not in os.environ
    bench.check_xla_flags("--xla_gpu_enable_pdl=true")  # a known flag passes, GPU-only or not
    bad_value = "--xla_cpu_enable_fast_math=abc"  # XLA's reason, not a line of its flag list
    with pytest.raises(ValueError, match=re.escape("Couldn't interpret value abc for flag xla_cpu_enable_fast_math")):
        bench.check_xla_flags(bad_value)
    monkeypatch.setenv("XLA_FLAGS", "--xla_not_a_flag=2")  # the environment's own, named as such
    with pytest.raises(ValueError, match=re.escape("the XLA_FLAGS environment variable '--xla_not_a_flag=2'")):
        bench.check_xla_flags("--xla_gpu_enable_pdl=true")


def test_zero_or_negative_counts_are_refused_not_replaced_by_the_preset():
    """``--iters 0`` (and 0 for the other counts) used to fall back to the preset's value
    silently; every count is now checked as given, and ``--tau`` before any stage runs."""
    base = ["--shapes", "tiny", "--batches", "1", "--no-torch", "--no-compile"]
    for flag, value, allowed in (
        ("--iters", "0", ">= 1"),
        ("--max-batch", "0", ">= 1"),
        ("--e2e-layers", "0", ">= 1"),
        ("--eager-iters", "-1", ">= 0"),
    ):
        with pytest.raises(ValueError, match=f"{flag}={value} is invalid: must be {allowed}"):
            bench.main([*base, flag, value])
    for tau in ("1.0", "8.0"):
        with pytest.raises(ValueError, match=f"--tau={tau} is invalid: must lie strictly between 1 and gamma"):
            bench.main([*base, "--e2e", "--tau", tau])


def test_idle_timing_sleeps_before_each_call_and_reports_its_median(monkeypatch):
    """``idle_s`` adds a loop of calls, each after that long a sleep; without it, none."""
    calls, sleeps = [], []
    monkeypatch.setattr(bench_timing.time, "sleep", lambda s: sleeps.append(s))

    def call():
        calls.append(len(sleeps))  # the sleeps so far
        return np.zeros(1)

    plain = bench_timing.time_call(call, iters=4, warmup=1)
    assert "idle_median_ms" not in plain and sleeps == []
    calls.clear()
    got = bench_timing.time_call(call, iters=4, warmup=1, idle_s=0.003)
    assert got["idle_median_ms"] > 0 and sleeps == [0.003] * 4
    assert calls[-4:] == [1, 2, 3, 4]  # each idle call right after its own sleep
    assert len(calls) == 1 + 4 * 4 + 4  # warm-up, the four loops, then the idle loop
    with pytest.raises(ValueError, match="idle_s=-0.001 is invalid"):
        bench_timing.time_calls({"a": call}, iters=2, idle_s=-0.001)
    with pytest.raises(ValueError, match="idle_s=nan is invalid"):
        bench_timing.time_call(call, iters=2, idle_s=float("nan"))


def test_table_reports_idle_medians_and_the_board(tiny_result):
    table = bench_report.format_table(tiny_result)
    assert tiny_result["meta"]["idle_ms"] == 0.5 and "idle = median when the device idles" in table
    row = next(r for r in tiny_result["propose"] if r["path"] == "split_greedy")
    line = next(x for x in table.splitlines() if x.split()[:3] == ["1", "greedy", "split_greedy"])
    assert f"{row['idle_median_ms']:.3f}" in line.split()
    assert (
        "board while batch 1 was timed: SM clock median 1620 MHz (p10 1620), power median 690 W of its 700 W "
        f"limit, held at the power cap in 100% of {row['board']['samples']} samples"
    ) in table
    hot = copy.deepcopy(tiny_result)
    for r in hot["propose"]:
        if "board" in r:
            r["board"].update(thermal_share=0.25, power_limit_w=None)
    hot_table = bench_report.format_table(hot)
    assert "power median 690 W, held at the power cap" in hot_table and ", thermal slowdown in 25%" in hot_table
    for r in hot["propose"]:
        r.pop("board", None)
    assert "board while" not in bench_report.format_table(hot)


def _timed_row(batch, path, latency, dispatch):
    samples = {
        "latency": latency,
        "dispatch": dispatch,
        "pipelined": [sum(latency) * 0.9],
        "pipelined_calls": [len(latency)],
        "released": latency,
        "spin": latency,
    }
    return {"batch": batch, "mode": "greedy", "path": path, **bench_timing._summary(samples), "samples": samples}


def test_pool_samples_recomputes_each_row_over_every_process():
    """The pooled statistics are those of all processes' samples together, not a mean of medians."""
    a = [_timed_row(1, "split", [1.0, 1.1, 1.2], [0.3, 0.3, 0.3]), {"batch": 1, "mode": "greedy", "path": "x"}]
    b = [_timed_row(1, "split", [2.0, 2.1, 2.2], [0.5, 0.6, 0.7]), {"batch": 1, "mode": "greedy", "path": "x"}]
    c = [_timed_row(1, "split", [1.15, 1.16, 5.0], [0.4, 0.4, 0.4]), {"batch": 1, "mode": "greedy", "path": "x"}]
    pooled = bench_timing.pool_samples([a, b, c])
    row = pooled[0]
    everything = [1.0, 1.1, 1.2, 2.0, 2.1, 2.2, 1.15, 1.16, 5.0]
    assert row["median_ms"] == pytest.approx(np.median(everything)) and row["iters"] == 9
    assert row["dispatch_ms"] == pytest.approx(0.4)
    assert row["pipelined_ms"] == pytest.approx(0.9 * sum(everything) / 9)
    assert [p["median_ms"] for p in row["processes"]] == pytest.approx([1.1, 2.1, 1.16])
    assert "samples" not in row and pooled[1] == a[1]  # an untimed row passes through
    with pytest.raises(ValueError, match=r"process 1 has 0 rows for batch, mode, path \(1, 'greedy', 'split'\)"):
        bench_timing.pool_samples([a, b[1:]])
    bare = [{k: v for k, v in b[0].items() if k != "samples"}]
    with pytest.raises(ValueError, match="lack their samples"):
        bench_timing.pool_samples([a[:1], bare])


def test_processes_time_the_paths_in_fresh_processes_and_pool_them(tmp_path):
    """--processes 2: two timing processes, each row's samples pooled, their own medians kept."""
    out = tmp_path / "p.json"
    argv = ["--shapes", "tiny", "--batches", "1", "--iters", "2", "--eager-iters", "0", "--modes", "greedy"]
    argv += ["--paths", "split_greedy", "--no-torch", "--no-compile", "--processes", "2", "--out", str(out)]
    assert bench.main(argv) == 0
    result = json.loads(out.read_text())
    # The timing processes report the backend this process runs on (the H200's "gpu" there).
    assert result["meta"]["processes"] == 2 and result["meta"]["backend"] == jax.default_backend()
    (row,) = result["propose"]
    assert row["iters"] == 4 and len(row["processes"]) == 2 and "samples" not in row
    own = [p["median_ms"] for p in row["processes"]]  # equal-sized samples: the pooled median lies between
    assert min(own) - 1e-9 <= row["median_ms"] <= max(own) + 1e-9
    table = bench_report.format_table(result)
    assert "timed in 2 fresh processes" in table and "per process" in table
    assert f"{min(own):.3f}–{max(own):.3f}" in table  # the range of the processes' own medians
    with pytest.raises(ValueError, match="--processes=0 is invalid: must be >= 1"):
        bench.main(argv[:-4] + ["--processes", "0"])


def test_a_failed_timing_process_stops_the_run_with_its_error(monkeypatch, tmp_path):
    """A timing process that exits non-zero raises RuntimeError naming it, with its stderr."""

    def failing(cmd, **kwargs):
        assert cmd[cmd.index("--timing-child") + 1] == "0" and "--timing-out" in cmd
        return types.SimpleNamespace(returncode=3, stderr="Traceback ...\nValueError: boom")

    monkeypatch.setattr(bench.subprocess, "run", failing)
    argv = ["--shapes", "tiny", "--batches", "1", "--iters", "2", "--eager-iters", "0", "--no-torch", "--no-compile"]
    with pytest.raises(RuntimeError, match="timing process 0 failed \\(exit 3\\):\nTraceback ...\nValueError: boom"):
        bench.main([*argv, "--processes", "2", "--out", str(tmp_path / "p.json")])


def test_idle_ms_out_of_range_is_refused():
    for value in ("-1", "2000"):
        with pytest.raises(ValueError, match=f"--idle-ms={float(value)} is invalid: must be in \\[0, 1000\\]"):
            bench.main(["--shapes", "tiny", "--batches", "1", "--idle-ms", value, "--no-torch", "--no-compile"])


def _previous_result_held(**time_call_kwargs) -> list[bool]:
    """Per call of ``time_call(**time_call_kwargs)``, in order: whether the previous call's
    result was still alive while this call ran."""
    held = []
    last = [None]

    def call():
        held.append(last[0] is not None and last[0]() is not None)
        result = np.zeros(1)
        last[0] = weakref.ref(result)
        return result

    bench_timing.time_call(call, **time_call_kwargs)
    return held


def test_warm_up_calls_hold_the_previous_result_as_the_waited_loop_does():
    """Each warm-up call, like each waited call after it, runs while the previous result is
    still held (XLA then records its CUDA graphs for that allocation pattern before the loop)."""
    held = _previous_result_held(iters=4, warmup=3)
    assert held[:7] == [False] + [True] * 6  # 3 warm-up calls, then the 4 waited ones


def test_time_calls_interleaves_rounds_and_merges_their_samples():
    """Each round times every call in turn; the statistics cover all rounds' calls."""
    order = []

    def make(name):
        def call():
            order.append(name)
            return np.zeros(1)

        return call

    got = bench_timing.time_calls({"a": make("a"), "b": make("b")}, iters=5, rounds=2)  # 3 calls per loop and round
    per_round = 3 + 4 * 3  # warm-up + latency, pipelined, released and spin loops
    assert order == (["a"] * per_round + ["b"] * per_round) * 2
    for stats in got.values():
        assert stats["iters"] == 6 and "samples" not in stats  # raw samples only when asked for
        assert 0 < stats["p10_ms"] <= stats["median_ms"] <= stats["p90_ms"] and stats["pipelined_ms"] > 0
    kept = bench_timing.time_calls({"a": make("a")}, iters=4, rounds=2, samples=True)["a"]["samples"]
    assert len(kept["latency"]) == 4 and len(kept["spin"]) == 4 and kept["pipelined_calls"] == [2, 2]
    with pytest.raises(ValueError, match="rounds >= 1 and iters >= 1, got rounds=0"):
        bench_timing.time_calls({"a": make("a")}, iters=5, rounds=0)


def test_table_states_the_gate_prediction_against_the_measured_peak():
    """The gate line (from a precompile run's measured peaks) gives the signed error."""
    memory = {"batch": 128, "in_use_before_bytes": 6_500_000_000, "greedy_round_peak_bytes": 440_000_000}
    memory |= {"sampling_round_peak_bytes": 640_000_000, "sampling_extra_bytes": 200_000_000}
    gate = {"closed_form_bytes": 272_000_000, "compiled_bytes": 210_000_000, "needed_bytes": 210_000_000}
    cached = {"workers": 8, "buckets": [], "rest_seconds": 2.0, "total_seconds": 2.0, "process_seconds": 9.0}
    result = {"compile": {"cached": {**cached, "gate": gate, "memory": memory}}}
    [line] = [x for x in bench_report.format_table(result).splitlines() if x.startswith("memory gate")]
    assert "adds 0.200 GB" in line and "greedy 0.440 GB, sampling 0.640 GB" in line
    assert "gate predicts 0.210 GB (+5.0 % of the measured" in line
    assert "closed form 0.272 GB, XLA's estimate 0.210 GB" in line


def test_own_peak_sees_a_call_below_an_earlier_larger_peak(monkeypatch):
    """A fake allocator: an earlier transient left the peak at 1000 with 600 in use. A call
    that needs 150 more would not move the peak; with ballast it raises it by exactly 150."""
    state = {"bytes_in_use": 600, "peak_bytes_in_use": 1000}
    monkeypatch.setattr(bench_compile, "memory_stat", state.get)

    def allocate(nbytes):
        state["bytes_in_use"] += nbytes
        state["peak_bytes_in_use"] = max(state["peak_bytes_in_use"], state["bytes_in_use"])
        return nbytes

    def call(need):
        def run():
            state["peak_bytes_in_use"] = max(state["peak_bytes_in_use"], state["bytes_in_use"] + need)
            return jax.numpy.zeros(())

        return run

    small, ballast = bench_compile.own_peak(call(150), [], allocate)
    assert (small, ballast, state["bytes_in_use"]) == (150, [400], 1000)
    large, ballast = bench_compile.own_peak(call(420), ballast, allocate)
    assert (large, ballast, state["bytes_in_use"]) == (420, [400, 150], 1150)
    monkeypatch.setattr(bench_compile, "memory_stat", lambda name: None)
    made = []
    assert bench_compile.own_peak(lambda: made.append(1) or jax.numpy.zeros(()), [], allocate) == (None, [])
    assert made == [1]  # no statistics: the call is still made


def test_round_peak_is_the_largest_program_each_at_its_least():
    # two programs (a piece, a head), three rounds each; the allocator only ever adds
    peaks = {"greedy": [100, 360, 150, 440, 100, 352], "sampling": [100, 624, 148, 625, 101, 700]}
    out = bench_compile.round_peaks(peaks, programs=2)
    assert out == {"greedy_round_peak_bytes": 352, "sampling_round_peak_bytes": 624, "sampling_extra_bytes": 272}
    # a piece larger than the greedy head sets the greedy round's peak
    out = bench_compile.round_peaks({"greedy": [400, 350], "sampling": [400, 624]}, programs=2)
    assert out["sampling_extra_bytes"] == 224
    unknown = bench_compile.round_peaks({"greedy": [None, 3], "sampling": [1, 2]}, programs=2)
    assert unknown["greedy_round_peak_bytes"] is None and unknown["sampling_extra_bytes"] is None


def test_compile_worker_measures_each_program_of_both_rounds(monkeypatch):
    """The precompile run's memory measurement, with a stand-in for the device's statistics:
    each program's "own peak" is the bytes of what it returns."""

    def own_peak(call, ballast, allocate=None):
        result = jax.block_until_ready(call())
        return sum(leaf.nbytes for leaf in jax.tree.leaves(result)), ballast

    monkeypatch.setattr(bench_compile, "own_peak", own_peak)
    thresholds = ("jax_persistent_cache_min_compile_time_secs", "jax_persistent_cache_min_entry_size_bytes")
    before = [getattr(jax.config, name) for name in thresholds]
    out = bench_compile._compile_worker(bench_workload.SHAPES["tiny"], 1, workers=1, measure_memory=True)
    # jax's configuration as it was (the executable store's keys include it: later tests load)
    assert [getattr(jax.config, name) for name in thresholds] == before != [0.0, 0]
    mem, cfg = out["memory"], bench_workload.draft_config(bench_workload.SHAPES["tiny"])
    programs = len(out["memory"]["greedy_program_peaks_bytes"]) // bench_compile.MEMORY_REPEATS
    assert programs >= 2 and len(mem["sampling_program_peaks_bytes"]) == programs * bench_compile.MEMORY_REPEATS
    corrected = cfg.gamma * cfg.vocab_size * np.dtype(cfg.jnp_dtype).itemsize  # one row's corrected logits
    heads = [mem[f"{mode}_program_peaks_bytes"][programs - 1] for mode in ("sampling", "greedy")]
    assert heads[0] - heads[1] == corrected  # the heads' outputs differ by the corrected logits alone
    assert mem["sampling_round_peak_bytes"] - mem["greedy_round_peak_bytes"] == mem["sampling_extra_bytes"] > 0
    assert out["gate"]["enabled"] and out["gate"]["needed_bytes"] == out["gate"]["compiled_bytes"]


@pytest.mark.parametrize(
    "flag, text, parsed, bads, message, needing_split",
    [
        ("cuts", "1:1,1,1", ((1,), (1, 1, 1)), ("", "1:", "0", "1,x", "1,-1"), "must be ':'-separated cuts", "1"),
        (
            "versus",
            "mlp=xla, tile-race=pallas",
            (("mlp", "xla"), ("tile_race", "pallas")),
            ("", "mlp", "mlp=cuda", "cuda=xla", "mlp=xla,"),
            "",
            "mlp=xla",
        ),
    ],
)
def test_split_path_flags_parse_and_need_a_split_path(capsys, flag, text, parsed, bads, message, needing_split):
    """``--cuts`` and ``--versus`` parse their values, refuse bad ones by name, and add split
    paths only: without one in ``--paths`` the run stops."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    assert getattr(parser.parse_args([f"--{flag}", text]), flag) == parsed
    assert getattr(parser.parse_args([]), flag) == ()
    for bad in bads:
        with pytest.raises(SystemExit):
            parser.parse_args([f"--{flag}", bad])
        assert f"--{flag}={bad!r} is invalid: {message}" in capsys.readouterr().err
    with pytest.raises(ValueError, match=f"--{flag} times the split paths: add split_greedy or split to --paths"):
        bench.main(["--shapes", "tiny", "--no-torch", "--no-compile", "--paths", "folded", f"--{flag}", needing_split])


def test_kernel_choice_flags_parse_every_choice_and_refuse_others(capsys):
    """Each ``--attention``/``--tile-race``/``--race``/``--greedy``/``--mlp``/``--gemm`` flag takes
    its variable's choices only (``run`` then sets the variable)."""
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    for flag, choices, variable, _ in bench.ENV_FLAGS:
        option = f"--{flag.replace('_', '-')}"
        assert getattr(parser.parse_args([]), flag) is None
        for choice in choices:
            assert getattr(parser.parse_args([option, choice]), flag) == choice
        with pytest.raises(SystemExit):
            parser.parse_args([option, "cuda"])
        assert f"argument {option}: invalid choice: 'cuda'" in capsys.readouterr().err
        assert f"(sets {variable};" in " ".join(parser.format_help().split())
    assert ("mlp", ("auto", "xla", "pallas"), "DSPARK_JAX_MLP") in {f[:3] for f in bench.ENV_FLAGS}


def test_compile_stage_precompiles_cold_then_loads_every_program_from_the_cache(tmp_path):
    """The bench's compile stage (two fresh ``python -m dspark_jax.bench_compile`` processes
    sharing one cache): the cold run compiles and saves every program, the cached run loads
    all of them and compiles none, then measures memory at the largest bucket."""
    out = bench_compile.bench_compile(bench_workload.SHAPES["tiny"], 2, str(tmp_path), workers=1)
    cold, cached = out["cold"], out["cached"]
    assert "error" not in cold and "error" not in cached, out
    assert cold["store"]["hits"] == 0 and cold["store"]["saves"] > 0
    assert cached["store"] == {"hits": cold["store"]["saves"], "saves": 0}
    assert [(b["batch"], b["fold_sampling"]) for b in cold["buckets"]] == [(1, False), (1, True), (2, False), (2, True)]
    assert cached["memory"]["batch"] == 2 and cached["gate"]["enabled"]
    assert cached["process_seconds"] >= cached["total_seconds"] > 0


def test_e2e_layers_give_the_draft_fused_ids_inside_a_shallower_target():
    """``--e2e-layers``: the draft's own ids where they fit, else spread evenly (strictly
    increasing Python ints), with the embedding output when one layer short; fewer refused."""
    tiny = bench_workload.draft_config(bench_workload.SHAPES["tiny"])  # fuses (0, 1, 3)
    assert bench_e2e.fused_layer_ids(tiny, 4) == (0, 1, 3)
    assert bench_e2e.fused_layer_ids(tiny, 3) == (0, 1, 2)
    assert bench_e2e.fused_layer_ids(tiny, 2) == (-1, 0, 1)
    with pytest.raises(ValueError, match=r"target_layers=1 is invalid: the draft fuses 3 target layers"):
        bench_e2e.fused_layer_ids(tiny, 1)
    big = bench_workload.draft_config(bench_workload.SHAPES["8b"])  # fuses (1, 9, 17, 25, 33)
    for layers in range(4, 40):
        ids = bench_e2e.fused_layer_ids(big, layers)
        assert len(ids) == 5 and all(type(i) is int for i in ids), ids
        assert all(b > a for a, b in zip(ids[:-1], ids[1:], strict=True)), ids
        assert ids[0] >= -1 and ids[-1] < layers, (layers, ids)
    assert bench_e2e.fused_layer_ids(big, 9) == (0, 2, 4, 6, 8)
    assert bench_e2e.fused_layer_ids(big, 36) == (1, 9, 17, 25, 33)
    out = bench_e2e.bench_e2e(bench_workload.SHAPES["tiny"], target_layers=2, tau=2.0, rounds=2)
    assert out["target_layers"] == 2 and out["plain_step_ms"] > 0 and out["round_ms"] > 0


def test_e2e_layers_too_few_for_the_fused_layers_are_refused_before_any_stage(monkeypatch):
    """``--e2e --e2e-layers 1`` ran every stage, then printed ``e2e failed: ValueError(...)`` and
    exited 0."""

    def measured(*args, **kwargs):
        raise AssertionError("the run reached the timed stage")

    monkeypatch.setattr(bench, "_measure", measured)
    base = ["--shapes", "tiny", "--batches", "1", "--no-torch", "--no-compile", "--e2e"]
    with pytest.raises(ValueError, match=r"^--e2e-layers=1 is invalid: must be >= 2 \(the tiny draft fuses 3 "):
        bench.main([*base, "--e2e-layers", "1"])


def test_a_failed_e2e_stage_makes_the_run_exit_non_zero(monkeypatch, capsys):
    """The table said ``e2e failed: …`` and the command exited 0."""

    def measured(args, shapes, batches, iters, eager_iters, result):
        result["e2e"] = {"error": "RuntimeError('out of memory')"}  # as _measure records a failed e2e stage

    monkeypatch.setattr(bench, "_measure", measured)
    monkeypatch.setattr(bench, "format_table", lambda result: f"e2e failed: {result['e2e']['error']}")
    assert bench.main(["--shapes", "tiny", "--batches", "1", "--no-torch", "--no-compile", "--e2e"]) == 1
    assert "e2e failed: RuntimeError('out of memory')" in capsys.readouterr().out


# --------------------------------------------------------------------------- mutation audit: timing statistics
def test_summary_statistics_are_numpys_over_the_samples():
    """``_summary``: p10/median/p90 are NumPy's percentiles of the waited latencies, dispatch,
    released, spin and idle their medians (not means), pipelined the total over the calls."""
    rng = np.random.default_rng(3)
    samples = {
        "latency": list(rng.lognormal(0.0, 0.6, 23)),
        "dispatch": list(rng.lognormal(-2.0, 0.8, 23)),
        "pipelined": [7.0, 11.0],
        "pipelined_calls": [10, 13],
        "released": list(rng.lognormal(0.1, 0.7, 23)),
        "spin": list(rng.lognormal(0.2, 0.9, 23)),
        "idle": list(rng.lognormal(-0.3, 0.9, 23)),
    }
    got = bench_timing._summary(samples)
    assert got["p10_ms"] == pytest.approx(np.percentile(samples["latency"], 10))
    assert got["median_ms"] == pytest.approx(np.median(samples["latency"]))
    assert got["p90_ms"] == pytest.approx(np.percentile(samples["latency"], 90))
    for key, name in (("dispatch_ms", "dispatch"), ("released_median_ms", "released"), ("spin_median_ms", "spin")):
        assert got[key] == pytest.approx(np.median(samples[name])), key
        assert got[key] != pytest.approx(np.mean(samples[name])), key  # skewed samples: median and mean differ
    assert got["idle_median_ms"] == pytest.approx(np.median(samples["idle"]))
    assert got["pipelined_ms"] == pytest.approx(18.0 / 23)
    assert got["iters"] == 23


class _ScriptedClock:
    """A stand-in for ``time`` whose clock moves only when the timed call runs: ``dispatch_s``
    inside the call, ``wait_s`` more while its result is waited for."""

    def __init__(self, dispatch_s, wait_s):
        self.now, self.dispatch_s, self.wait_s, self.sleeps = 100.0, dispatch_s, wait_s, []

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.sleeps.append(seconds)

    def call(self):
        self.now += self.dispatch_s
        return self._Result(self)

    class _Result:
        def __init__(self, clock):
            self.clock = clock

        def block_until_ready(self):
            self.clock.now += self.clock.wait_s
            return self


def test_time_call_reports_milliseconds_of_each_loop_from_a_scripted_clock(monkeypatch):
    """With a clock that moves 4 ms while a call dispatches and 6 ms while its result is waited
    for: latency 10 ms (from the call to the result), dispatch 4 ms (until the call returns),
    pipelined (4·n + 6) / n ms per call, released, spin and idle 10 ms each."""
    clock = _ScriptedClock(0.004, 0.006)
    monkeypatch.setattr(bench_timing, "time", clock)
    n = 5
    got = bench_timing.time_call(clock.call, iters=n, warmup=2, idle_s=0.25, samples=True)
    assert got["median_ms"] == pytest.approx(10.0) and got["p10_ms"] == pytest.approx(10.0)
    assert got["dispatch_ms"] == pytest.approx(4.0)
    assert got["pipelined_ms"] == pytest.approx((4.0 * n + 6.0) / n)
    for key in ("released_median_ms", "spin_median_ms", "idle_median_ms"):
        assert got[key] == pytest.approx(10.0), key
    assert got["samples"]["pipelined"] == [pytest.approx(4.0 * n + 6.0)] and got["samples"]["pipelined_calls"] == [n]
    assert clock.sleeps == [0.25] * n and got["iters"] == n


def test_released_calls_run_with_the_previous_result_dropped():
    """``released_median_ms``: in that loop alone no earlier result is alive during a call (the
    waited, pipelined and spin loops hold the previous one)."""
    held = _previous_result_held(iters=2, warmup=1)
    # warm-up, 2 waited, 2 pipelined, 2 released, 2 spin-waited
    assert held == [False, True, True, True, True, False, False, True, True]


def test_pool_samples_refuses_a_process_with_a_row_twice():
    """A process that timed a (batch, mode, path) twice cannot be pooled row for row."""
    a = [_timed_row(1, "split", [1.0, 1.1], [0.3, 0.3])]
    b = [_timed_row(1, "split", [2.0, 2.1], [0.5, 0.6]), _timed_row(1, "split", [3.0, 3.1], [0.5, 0.6])]
    with pytest.raises(ValueError, match=r"process 1 has 2 rows for batch, mode, path \(1, 'greedy', 'split'\)"):
        bench_timing.pool_samples([a, b])


def test_measure_ceilings_derives_each_rate_from_its_definition(monkeypatch):
    """Bandwidths are (read + written) bytes over the back-to-back time of a pass over the
    ``nbytes`` buffer, the matmul rate 2·m³ FLOPs over its back-to-back time, the host's times
    the trivial op's median and dispatch, the matmul's waited time its median."""
    nbytes, m = 1 << 14, 16
    seen = []

    def fake_time_call(fn, *, iters, **kwargs):
        out = jax.block_until_ready(fn())
        k = len(seen)
        seen.append((out.shape, out.dtype, out.nbytes))
        return {
            "median_ms": 1.0 + k,
            "p10_ms": 0.5 + k,
            "p90_ms": 9.0 + k,
            "dispatch_ms": 0.25 + k,
            "pipelined_ms": 0.1 * (k + 1),
        }

    monkeypatch.setattr(bench_timing, "time_call", fake_time_call)
    got = bench_timing.measure_ceilings(nbytes, m, iters=5)
    (elem, copy_, mm, host) = seen
    assert elem[2] == copy_[2] == nbytes and elem[1] == np.float32  # the buffer is nbytes of float32
    assert mm[0] == (m, m) and host[0] == (8,)
    assert got["elementwise_bytes_per_s"] == pytest.approx(2 * nbytes / 0.1e-3)
    assert got["copy_bytes_per_s"] == pytest.approx(2 * nbytes / 0.2e-3)
    assert got["matmul_flops_per_s"] == pytest.approx(2 * m**3 / 0.3e-3)
    assert got["matmul_waited_ms"] == 3.0 and got["matmul_pipelined_ms"] == pytest.approx(0.3)
    assert got["host_roundtrip_ms"] == 4.0 and got["host_dispatch_ms"] == 3.25
    assert got["buffer_bytes"] == nbytes and got["matmul_size"] == m


def test_profile_kernels_sums_the_gpu_streams_events_per_call(monkeypatch, tmp_path):
    """From a (fake) trace: only GPU planes' ``Stream`` lines count; per kernel its total time and
    launches divided by the calls; kernels sorted by time, longest first, ``top`` kept."""
    ev = types.SimpleNamespace

    def line(name, events):
        return ev(name=name, events=[ev(name=n, duration_ns=d) for n, d in events])

    planes = [
        ev(
            name="/device:GPU:0",
            lines=[
                line("Stream #14(Compute)", [("small", 1e6), ("big", 3e6), ("big", 3e6), ("tiny", 0.2e6)]),
                line("XLA Ops", [("op_not_a_kernel", 50e6)]),
            ],
        ),
        ev(name="/host:CPU", lines=[line("Stream #1", [("host", 70e6)])]),
    ]

    def start_trace(directory, **kwargs):
        with open(os.path.join(directory, "t.xplane.pb"), "wb") as f:
            f.write(b"")

    monkeypatch.setattr(jax.profiler, "start_trace", start_trace)
    monkeypatch.setattr(jax.profiler, "stop_trace", lambda: None)
    monkeypatch.setattr(jax.profiler, "ProfileData", types.SimpleNamespace(from_file=lambda path: ev(planes=planes)))
    got = bench_timing.profile_kernels(lambda: np.zeros(1), iters=2, top=2)
    assert got["calls"] == 2
    assert got["device_busy_ms"] == pytest.approx((1 + 3 + 3 + 0.2) / 2)
    assert got["launches_per_call"] == pytest.approx(4 / 2)
    assert [k["name"] for k in got["kernels"]] == ["big", "small"]
    assert got["kernels"][0]["ms_per_call"] == pytest.approx(3.0) and got["kernels"][0]["count_per_call"] == 1.0
    assert got["kernels"][1]["ms_per_call"] == pytest.approx(0.5) and got["kernels"][1]["count_per_call"] == 0.5


# --------------------------------------------------------------------------- mutation audit: workload and floors
def test_sampling_rows_and_parameters_follow_their_definition():
    """``mixed``: the first ``max(1, B // 2)`` rows sample (T = 1, every token), the rest are
    greedy (T = 0, top-k 1); ``greedy`` none, ``sampling`` all."""
    from dspark_jax.sampling import TOP_K_ALL

    for batch in range(1, 8):
        for mode, n in (("greedy", 0), ("mixed", max(1, batch // 2)), ("sampling", batch)):
            want = np.array([i < n for i in range(batch)])
            np.testing.assert_array_equal(bench_workload.mode_sampling_rows(batch, mode), want)
            temps, top_k = bench_workload.sampling_params(batch, mode)
            np.testing.assert_array_equal(np.asarray(temps), np.where(want, 1.0, 0.0))
            np.testing.assert_array_equal(np.asarray(top_k), np.where(want, TOP_K_ALL, 1))


def test_round_cost_flops_and_per_request_bytes_follow_the_definitions():
    """The FLOPs (2 per multiply-add: layer matmuls over B·R rows, QK and PV against the context
    plus the block, the lm_head and the Markov walk over γ steps) and the bytes that grow with
    the batch or the activation dtype, at batch 3 with float32 activations and bf16 weights."""
    import dataclasses

    cfg = bench_workload.draft_config(bench_workload.SHAPES["tiny"])
    cfg = dataclasses.replace(cfg, dtype="float32", param_dtype="bfloat16")
    batch, context = 3, 40
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, kvh, v, r, g = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size, cfg.markov_rank, cfg.gamma
    layers, rows = cfg.num_hidden_layers, batch * cfg.num_query_rows
    per_layer = h * nh * d + h * kvh * d * 2 + nh * d * h + 3 * h * i  # q, k, v, o and the MLP
    flops = (
        2 * rows * layers * per_layer
        + 2 * 2 * rows * layers * nh * d * (context + cfg.num_query_rows)
        + 2 * batch * g * v * h
        + 2 * batch * g * v * r
    )
    greedy = bench_workload.round_cost(cfg, batch, context, folded_sampling=False)
    folded = bench_workload.round_cost(cfg, batch, context, folded_sampling=True)
    assert greedy["flops"] == folded["flops"] == flops
    assert greedy["bytes_parts"]["context_kv"] == 2 * layers * batch * context * kvh * d * 4  # float32 activations
    assert greedy["bytes_parts"]["embed_rows"] == rows * h * 2  # bf16 weights
    assert folded["bytes"] - greedy["bytes"] == batch * g * v * 4  # the corrected logits, every request's


def test_random_inputs_hold_context_positions_per_request():
    cfg = bench_workload.draft_config(bench_workload.SHAPES["tiny"])
    inp = bench_workload.random_inputs(cfg, 3, 20, 32, seed=1)
    np.testing.assert_array_equal(np.asarray(inp["prefix_lens"]), [20, 20, 20])
    bonus = np.asarray(inp["bonus"])
    assert bonus.shape == (3,) and ((bonus >= 0) & (bonus < cfg.vocab_size)).all()
    assert inp["cache"].k.shape == (cfg.num_hidden_layers, 3, 32, cfg.num_key_value_heads, cfg.head_dim)


# --------------------------------------------------------------------------- mutation audit: e2e
def test_fused_layer_ids_round_the_even_spread_half_up():
    """Where the draft's own ids do not fit: ``n`` ids from 0 to L − 1 spread evenly, each
    rounded half up (exact fractions here, so the reference has no float error)."""
    from fractions import Fraction

    big = bench_workload.draft_config(bench_workload.SHAPES["8b"])
    n = big.num_fused_layers
    for layers in range(n, big.target_layer_ids[-1] + 1):
        want = tuple(int(Fraction(k * (layers - 1), n - 1) + Fraction(1, 2)) for k in range(n))
        assert bench_e2e.fused_layer_ids(big, layers) == want, layers


def test_e2e_numbers_follow_their_definitions_from_scripted_clocks(monkeypatch):
    """``bench_e2e`` with a clock that moves by a scripted, uneven step at every reading and a
    fixed propose time: plain step and verify are medians of the timed (not warm-up) steps,
    plain tokens/s the batch over their mean, τ the mean accepted length of the forced draws
    (replayed here from the same keys), speculative tokens/s every accepted token over the
    rounds' total time, the ideal speed-up τ·t_plain / (t_propose + t_verify)."""
    rounds, tau, seed = 5, 3.3, 0
    steps = [1e-3 * (1 + (k * k * 7) % 13) for k in range(200)]
    readings = iter(np.cumsum(steps))
    monkeypatch.setattr(bench_e2e, "time", types.SimpleNamespace(perf_counter=lambda: float(next(readings))))
    monkeypatch.setattr(bench_e2e, "time_call", lambda fn, iters: {"median_ms": 0.7})
    got = bench_e2e.bench_e2e(bench_workload.SHAPES["tiny"], target_layers=4, tau=tau, rounds=rounds, seed=seed)

    def timed(first, warmup, count):
        """Readings from index ``first``: ``warmup`` untimed starts, then (start, end) pairs; the
        interval of a pair is the step taken at its end reading."""
        ends = [first + warmup + 2 * j + 1 for j in range(count)]
        return [steps[e] * 1e3 for e in ends], first + warmup + 2 * count

    plain, nxt = timed(0, 3, 2 * rounds)
    verify, nxt = timed(nxt, 3, rounds)
    spec, nxt = timed(nxt, 3, rounds)
    gamma = bench_workload.draft_config(bench_workload.SHAPES["tiny"]).gamma
    probs = jax.numpy.asarray(bench_e2e.forced_accept_probs(tau, gamma), jax.numpy.float32)
    keys = jax.random.split(jax.random.key(seed + 3), rounds + 3)
    accepted = [
        int(jax.random.choice(jax.random.split(keys[i])[1], gamma + 1, (1,), p=probs)[0]) + 1
        for i in range(3, rounds + 3)
    ]
    # the test can tell a mean from a median in both
    assert np.mean(accepted) != np.median(accepted) and np.median(plain) != np.mean(plain)
    assert got["tau_measured"] == pytest.approx(np.mean(accepted))
    assert got["plain_step_ms"] == pytest.approx(np.median(plain))
    assert got["verify_ms"] == pytest.approx(np.median(verify)) and got["propose_ms"] == 0.7
    assert got["round_ms"] == pytest.approx(np.median(spec))
    assert got["plain_tokens_per_s"] == pytest.approx(1e3 / np.mean(plain))
    assert got["spec_tokens_per_s"] == pytest.approx(sum(accepted) * 1e3 / sum(spec))
    ideal = np.mean(accepted) * np.median(plain) / (0.7 + np.median(verify))
    assert got["ideal_speedup"] == pytest.approx(ideal)
    speedup = (sum(accepted) * 1e3 / sum(spec)) / (1e3 / np.mean(plain))
    assert got["speedup"] == pytest.approx(speedup) and got["fraction_of_ideal"] == pytest.approx(speedup / ideal)


# --------------------------------------------------------------------------- mutation audit: compile stage
def test_round_peak_is_unknown_for_a_partial_round_and_gate_error_for_no_growth():
    """Peaks that are not whole rounds of ``programs`` programs give no round peak; a measured
    growth of 0 (or less) is said, not divided by."""
    out = bench_compile.round_peaks({"greedy": [100, 200, 150], "sampling": [100, 300]}, programs=2)
    assert out["greedy_round_peak_bytes"] is None and out["sampling_round_peak_bytes"] == 300
    assert out["sampling_extra_bytes"] is None
    assert bench_compile.gate_error(5, {"sampling_extra_bytes": 0}) == "measured growth 0"
    assert bench_compile.gate_error(150, {"sampling_extra_bytes": 200}) == "-25.0 % of the measured"


# --------------------------------------------------------------------------- mutation audit: bench's stages
def test_bench_propose_rows_carry_their_paths_floors_and_the_idle_and_rounds_asked_for(monkeypatch):
    """Each row's floor is max(bytes / elementwise bandwidth, FLOPs / matmul rate) of its own
    round (greedy-only paths without the corrected logits), ``floor_copy`` the same with the
    copy bandwidth; the interleaved timing gets ``idle_ms`` in seconds and ``min(3, iters)``
    rounds; batches run in ascending order."""
    cfg = bench_workload.draft_config(bench_workload.SHAPES["tiny"])
    graphdef, state = bench_workload.build_draft(cfg)
    asked = []

    def fake_time_calls(calls, *, iters, rounds, idle_s, samples):
        asked.append({"iters": iters, "rounds": rounds, "idle_s": idle_s})
        return {k: {"median_ms": 2.0, "p10_ms": 1.0, "p90_ms": 3.0} for k in calls}

    monkeypatch.setattr(bench, "time_calls", fake_time_calls)
    ceilings = {"elementwise_bytes_per_s": 2e9, "copy_bytes_per_s": 5e9, "matmul_flops_per_s": 3e10}
    rows, memory = bench.bench_propose(
        cfg,
        graphdef,
        state,
        batches=(2, 1),
        context=16,
        iters=2,
        eager_iters=0,
        ceilings=ceilings,
        profile=False,
        modes=("greedy", "mixed"),
        paths=("folded_greedy", "folded"),
        idle_ms=0.75,
    )
    assert asked == [{"iters": 2, "rounds": 2, "idle_s": pytest.approx(0.75e-3)}] * 2
    assert [m["batch"] for m in memory] == [1, 2] and [r["batch"] for r in rows] == [1, 1, 1, 2, 2, 2]
    for r in rows:
        cost = bench_workload.round_cost(cfg, r["batch"], 16, folded_sampling=r["path"] == "folded")
        assert (r["bytes"], r["flops"]) == (cost["bytes"], cost["flops"])
        by_bytes, by_flops = cost["bytes"] / 2e9 * 1e3, cost["flops"] / 3e10 * 1e3
        assert r["floor_ms"] == pytest.approx(max(by_bytes, by_flops))
        assert r["floor_bound"] == ("bytes" if by_bytes >= by_flops else "flops")
        assert r["floor_copy_ms"] == pytest.approx(max(cost["bytes"] / 5e9 * 1e3, by_flops))


def test_run_derives_eager_iters_and_the_compile_bucket_and_checks_its_bounds(monkeypatch):
    """``--eager-iters`` defaults to max(2, iters // 10); the compile stage precompiles up to the
    largest batch; ``--e2e-layers`` one below the fused layers, ``--idle-ms 1000`` and ``--cuts`` /
    ``--versus`` with either split path alone are allowed."""
    seen = {}

    def measured(args, shapes, batches, iters, eager_iters, result):
        seen.update(batches=batches, iters=iters, eager_iters=eager_iters, e2e_layers=args.e2e_layers)

    monkeypatch.setattr(bench, "_measure", measured)
    monkeypatch.setattr(bench, "format_table", lambda result: "")

    def compiled(shapes, max_batch, cache_dir, workers):
        seen.update(compiled=max_batch)
        return {}

    monkeypatch.setattr(bench, "bench_compile", compiled)
    base = ["--shapes", "tiny", "--no-torch"]
    for iters, eager in (("5", 2), ("30", 3), ("47", 4)):
        assert bench.main([*base, "--no-compile", "--batches", "1", "--iters", iters]) == 0
        assert seen["eager_iters"] == eager, iters
    assert bench.main([*base, "--batches", "2,8,4", "--iters", "2"]) == 0
    assert seen["compiled"] == 8
    fused = bench_workload.draft_config(bench_workload.SHAPES["tiny"]).num_fused_layers
    assert bench.main([*base, "--no-compile", "--e2e", "--e2e-layers", str(fused - 1), "--idle-ms", "1000"]) == 0
    assert seen["e2e_layers"] == fused - 1
    for path in ("split_greedy", "split"):  # either split path is enough for --cuts and --versus
        assert bench.main([*base, "--no-compile", "--paths", path, "--cuts", "2", "--versus", "mlp=xla"]) == 0


def test_processes_run_numbered_timing_children_and_pool_every_childs_samples(monkeypatch, tmp_path):
    """``--processes 3``: children 0, 1, 2 (e2e, the walk and the profiles only in child 0), every
    child's samples pooled, the rest of the result from child 0."""
    children = []

    def fake_run(cmd, **kwargs):
        i = int(cmd[cmd.index("--timing-child") + 1])
        children.append(i)
        row = _timed_row(1, "split", [1.0 + i, 2.0 + i, 3.0 + i], [0.1, 0.1, 0.1])
        result = {"meta": {"child": i}, "propose": [row], "ceilings": {"from": i}}
        with open(cmd[cmd.index("--timing-out") + 1], "w") as f:
            json.dump(result, f)
        return types.SimpleNamespace(returncode=0, stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setattr(bench, "format_table", lambda result: "")
    out = tmp_path / "p.json"
    assert bench.main(["--shapes", "tiny", "--no-torch", "--no-compile", "--processes", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert children == [0, 1, 2] and result["meta"]["child"] == 0 and result["ceilings"] == {"from": 0}
    (row,) = result["propose"]
    assert row["iters"] == 9 and row["median_ms"] == pytest.approx(np.median([1, 2, 3, 2, 3, 4, 3, 4, 5]))
    assert [p["median_ms"] for p in row["processes"]] == [2.0, 3.0, 4.0]

    stages = {}
    monkeypatch.setattr(bench, "_measure", lambda args, *a, **k: stages.update({args.timing_child: args.e2e}))
    for child in (0, 1):
        argv = ["--shapes", "tiny", "--no-torch", "--no-compile", "--e2e", "--timing-child", str(child)]
        assert bench.main([*argv, "--timing-out", str(tmp_path / f"c{child}.json")]) == 0
    assert stages == {0: True, 1: False}
