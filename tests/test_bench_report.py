"""The printed table of a ``dspark-jax bench`` result: each number it derives, from hand-made results."""

from dspark_jax import bench_report

_COLUMNS = [
    *("batch", "mode", "path", "median", "p90", "dispatch", "pipelined", "released", "spin", "idle"),
    *("floor", "bound", "x_floor", "floor_copy", "torch_eager", "torch_graph", "graph/jax", "graph/spin"),
]


def _row(**fields):
    row = {"batch": 4, "mode": "greedy", "path": "folded_greedy", "median_ms": 2.0, "p10_ms": 1.5, "p90_ms": 3.0}
    row |= {"dispatch_ms": 0.4, "pipelined_ms": 1.8, "released_median_ms": 1.9, "spin_median_ms": 2.5}
    row |= {"floor_ms": 0.5, "floor_bound": "bytes", "floor_copy_ms": 0.25}
    return row | fields


def _cells(table, batch, mode, path):
    [line] = [x for x in table.splitlines() if x.split()[:3] == [str(batch), mode, path]]
    return dict(zip(_COLUMNS, line.split(), strict=False))


def test_row_ratios_against_the_floor_and_the_torch_graph():
    """``x floor`` = median / floor; ``graph/jax`` = torch graph / median; ``graph/spin`` = torch
    graph / spin median; PyTorch pairs with the greedy-only paths in greedy batches and with the
    folded ones otherwise; p90 is the row's p90."""
    rows = [
        _row(),
        _row(path="folded"),
        _row(mode="mixed", path="folded", median_ms=4.0, spin_median_ms=5.0, floor_ms=2.0),
        _row(mode="mixed", path="folded_greedy"),
    ]
    torch = [
        {"batch": 4, "mode": "greedy", "path": "graph", "median_ms": 1.0},
        {"batch": 4, "mode": "greedy", "path": "eager", "median_ms": 6.0},
        {"batch": 4, "mode": "mixed", "path": "graph", "median_ms": 3.0},
        {"batch": 4, "mode": "mixed", "path": "eager", "median_ms": 7.0},
    ]
    table = bench_report.format_table({"propose": rows, "torch": {"rows": torch}})
    greedy = _cells(table, 4, "greedy", "folded_greedy")
    assert (greedy["p90"], greedy["x_floor"], greedy["floor_copy"]) == ("3.000", "4.00", "0.250")
    assert (greedy["torch_eager"], greedy["torch_graph"]) == ("6.000", "1.000")
    assert (greedy["graph/jax"], greedy["graph/spin"]) == (f"{1 / 2:.2f}", f"{1 / 2.5:.2f}")
    mixed = _cells(table, 4, "mixed", "folded")
    assert (mixed["x_floor"], mixed["torch_graph"], mixed["graph/jax"], mixed["graph/spin"]) == (
        "2.00",
        "3.000",
        f"{3 / 4:.2f}",
        f"{3 / 5:.2f}",
    )
    for mode, path in (("greedy", "folded"), ("mixed", "folded_greedy")):  # not PyTorch's program for that batch
        cells = _cells(table, 4, mode, path)
        assert cells["torch_eager"] == cells["torch_graph"] == cells["graph/jax"] == "-", (mode, path)


def test_pooled_rows_show_the_range_of_the_processes_medians():
    rows = [_row(processes=[{"median_ms": 2.25}, {"median_ms": 1.5}, {"median_ms": 3.125}]), _row(path="folded")]
    lines = bench_report.format_table({"propose": rows, "meta": {"processes": 3}}).splitlines()
    assert next(x for x in lines if "folded_greedy" in x).split()[-1] == "1.500–3.125"
    assert next(x for x in lines if x.split()[2:3] == ["folded"]).split()[-1] == "-"
    assert any(x.startswith("timed in 3 fresh processes") for x in lines)
    single = bench_report.format_table({"propose": [_row()], "meta": {"processes": 1}})
    assert "fresh processes" not in single and "per process" not in single


def test_ceilings_lines_in_decimal_units_and_the_waited_excess():
    """TB/s and TFLOP/s are 10¹² per second; the matmul's waited time minus its back-to-back
    time is signed."""
    ceil = {
        "elementwise_bytes_per_s": 3.3e12,
        "copy_bytes_per_s": 2.2e12,
        "matmul_flops_per_s": 7.5e14,
        "host_roundtrip_ms": 0.125,
        "host_dispatch_ms": 0.0625,
        "matmul_size": 8192,
        "matmul_waited_ms": 1.25,
        "matmul_pipelined_ms": 1.0,
    }
    table = bench_report.format_table({"ceilings": ceil})
    assert "ceilings: elementwise 3.30 TB/s, copy 2.20 TB/s, matmul 750 TFLOP/s" in table
    assert "ready 0.125 ms after the call (the call returns after 0.062 ms)" in table
    assert "ready 1.250 ms after the call and takes 1.000 ms per call back to back: +0.250 ms waited" in table


def test_memory_lines_give_the_largest_peak_in_decimal_gigabytes():
    memory = [
        {
            "batch": 8,
            "in_use_before_bytes": 1_500_000_000,
            "peak_after_first_calls_bytes": 2_000_000_000,
            "peak_after_timing_bytes": 2_750_000_000,
        },
        {
            "batch": 16,
            "in_use_before_bytes": None,
            "peak_after_first_calls_bytes": None,
            "peak_after_timing_bytes": None,
        },
    ]
    lines = bench_report.format_table({"memory": memory}).splitlines()
    assert "memory batch 8: in use before 1.50 GB, device peak after it 2.75 GB" in lines
    assert "memory batch 16: in use before - GB, device peak after it - GB" in lines


def test_board_line_gives_the_clock_median_and_p10_apart():
    board = {
        "samples": 40,
        "sm_clock_mhz_median": 1755.0,
        "sm_clock_mhz_p10": 1605.0,
        "power_w_median": 612.0,
        "power_limit_w": 700.0,
        "power_capped_share": 0.25,
        "thermal_share": 0.0,
        "hw_slowdown_share": 0.5,
    }
    table = bench_report.format_table({"propose": [_row(board=board), _row(path="folded", board=board)]})
    assert (
        "board while batch 4 was timed: SM clock median 1755 MHz (p10 1605), power median 612 W of its 700 W limit, "
        "held at the power cap in 25% of 40 samples, hardware slowdown in 50%"
    ) in table.splitlines()


def test_e2e_line_gives_the_achieved_and_ideal_speed_ups_apart():
    e2e = {
        "batch": 1,
        "target_layers": 36,
        "context": 1024,
        "plain_tokens_per_s": 50.0,
        "plain_step_ms": 20.0,
        "spec_tokens_per_s": 105.0,
        "round_ms": 58.0,
        "tau_measured": 6.1,
        "speedup": 2.1,
        "ideal_speedup": 3.0,
        "propose_ms": 12.0,
        "verify_ms": 30.0,
        "fraction_of_ideal": 0.7,
    }
    table = bench_report.format_table({"e2e": e2e})
    assert (
        "e2e batch 1 (36-layer target, context 1024): plain 50.0 tok/s (20.00 ms/step), speculative 105.0 tok/s "
        "(58.00 ms/round, tau 6.10); speed-up 2.10x against ideal 3.00x (propose 12.00 + verify 30.00 ms) "
        "= 70% of ideal"
    ) in table
