"""The printed table of a ``dspark-jax bench`` result."""

from __future__ import annotations

from typing import Any

from dspark_jax.attention_kernel import ATTENTION_ENV
from dspark_jax.bench_compile import MEMORY_REPEATS, gate_error
from dspark_jax.greedy_kernel import GREEDY_ENV
from dspark_jax.mlp_kernel import MLP_ENV
from dspark_jax.race_kernel import RACE_ENV
from dspark_jax.split_round import BACKBONE_GEMM_ENV
from dspark_jax.tile_race_kernel import TILE_RACE_ENV


def _parity_note(row: dict[str, Any]) -> str:
    """The table's note on a row's differing tokens: the greedy rows' logit gap and the
    number of differing sampling rows, where known."""
    notes = [f"logit gap {row['tokens_logit_gap']:.3g} in greedy rows"] if "tokens_logit_gap" in row else []
    n = row.get("tokens_differ_sampling_rows", 0)
    notes += [f"{n} sampling row{'s' if n > 1 else ''}"] if n else []
    return f" ({'; '.join(notes)})" if notes else ""


def _fmt(value: Any, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def _process_range(row: dict[str, Any]) -> str:
    """``lo–hi`` of a pooled row's per-process medians (``-`` for a row timed in one process)."""
    medians = [p["median_ms"] for p in row.get("processes", [])]
    return f"{min(medians):.3f}–{max(medians):.3f}" if medians else "-"


def _board_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One line per batch on what the GPU board did while that batch was timed (rows' ``board``)."""
    lines, seen = [], set()
    for r in rows:
        board = r.get("board")
        if board is None or r["batch"] in seen:
            continue
        seen.add(r["batch"])
        limit = f" of its {board['power_limit_w']:.0f} W limit" if board.get("power_limit_w") else ""
        slowdowns = "".join(
            f", {name} in {board[key]:.0%}"
            for key, name in (("thermal_share", "thermal slowdown"), ("hw_slowdown_share", "hardware slowdown"))
            if board.get(key)
        )
        lines.append(
            f"board while batch {r['batch']} was timed: SM clock median {board['sm_clock_mhz_median']:.0f} MHz "
            f"(p10 {board['sm_clock_mhz_p10']:.0f}), power median {board['power_w_median']:.0f} W{limit}, "
            f"held at the power cap in {board['power_capped_share']:.0%} of {board['samples']} samples{slowdowns}"
        )
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The printed summary of a :func:`dspark_jax.bench.main` result."""
    lines = []
    ceil = result.get("ceilings")
    if ceil:
        lines.append(
            f"ceilings: elementwise {ceil['elementwise_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
            f"matmul {ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s "
            "(floor = max(bytes / elementwise bandwidth, FLOPs / matmul rate); floor_copy uses the copy bandwidth)"
        )
        if "host_roundtrip_ms" in ceil:
            lines.append(
                f"host: a trivial jitted op is ready {ceil['host_roundtrip_ms']:.3f} ms after the call "
                f"(the call returns after {ceil['host_dispatch_ms']:.3f} ms)"
            )
        if "matmul_waited_ms" in ceil:
            lines.append(
                f"host: the {ceil['matmul_size']}³ product, one kernel, is ready {ceil['matmul_waited_ms']:.3f} ms "
                f"after the call and takes {ceil['matmul_pipelined_ms']:.3f} ms per call back to back: "
                f"{ceil['matmul_waited_ms'] - ceil['matmul_pipelined_ms']:+.3f} ms waited"
            )
    meta = result.get("meta", {})
    if meta.get("awake_spinners"):
        lines.append(f"host: timed with {meta['awake_spinners']} spinners at nice 19 keeping the CPUs awake (--awake)")
    if meta.get("processes", 1) > 1:
        lines.append(
            f"timed in {meta['processes']} fresh processes one after another, every call's samples pooled "
            "(--processes; each process's own medians: the JSON rows' processes)"
        )
    if "attention" in meta:
        kernel = "fused Pallas kernel" if meta.get("attention_kernel") else "XLA"
        lines.append(f"draft context attention: {kernel} ({ATTENTION_ENV}={meta['attention']})")
    if "race" in meta:
        race = "race Pallas kernel per step" if meta.get("race_kernel") else "XLA"
        on = meta.get("tile_race_kernel") or []
        kernel = f"two tiled Pallas kernels per step at batches {on}, {race} at the others" if on else race
        choices = f"{TILE_RACE_ENV}={meta.get('tile_race', '-')}, {RACE_ENV}={meta['race']}"
        lines.append(f"folded walk's sampling step: {kernel} ({choices})")
    if "greedy" in meta:
        on = meta.get("greedy_kernel") or []
        kernel = f"two Pallas kernels per step at batches {on}, XLA at the others" if on else "XLA"
        lines.append(f"greedy-only walk's step: {kernel} ({GREEDY_ENV}={meta['greedy']})")
    if "mlp" in meta:
        on = meta.get("mlp_kernel") or []
        kernel = f"one Pallas kernel per layer at batches {on}, XLA at the others" if on else "XLA"
        lines.append(f"draft MLP's gate/up projections and SwiGLU: {kernel} ({MLP_ENV}={meta['mlp']})")
    if "backbone_gemm" in meta:
        on = meta.get("backbone_cublas") or []
        gemms = f"cuBLAS at batches {on}, XLA's choice at the others" if on else "XLA's choice"
        lines.append(f"split round's backbone GEMMs: {gemms} ({BACKBONE_GEMM_ENV}={meta['backbone_gemm']})")
    torch_rows = {(r["batch"], r["mode"], r["path"]): r["median_ms"] for r in result.get("torch", {}).get("rows", [])}
    width = max([15] + [len(r["path"]) for r in result.get("propose", [])])  # the path column
    pooled = any("processes" in r for r in result.get("propose", []))  # --processes: their medians' range
    header = (
        f"{'batch':>5} {'mode':<8} {'path':<{width}} {'median':>8} {'p90':>8} {'dispatch':>8} {'pipelined':>9} "
        f"{'released':>8} {'spin':>7} {'idle':>7} "
        f"{'floor':>7} {'bound':<5} {'x floor':>7} {'floor_copy':>10} {'torch eager':>11} {'torch graph':>11} "
        f"{'graph/jax':>9} {'graph/spin':>10}" + (f" {'per process':>13}" if pooled else "")
    )
    lines += [
        "propose latency, ms: median and p90 of calls waited for one by one; dispatch = host time per call; "
        "pipelined = per call when dispatched back to back; released = median when the previous result is "
        "dropped before each call; spin = median when each call is waited for by polling, as "
        "torch.cuda.synchronize waits (graph/spin compares the two on that footing); idle = median when the "
        "device idles --idle-ms before each call (its clock not held down by the board's power cap)"
        + ("; per process = the range of the timing processes' own medians (--processes)" if pooled else ""),
        header,
        "-" * len(header),
    ]
    for r in result.get("propose", []):
        key = (r["batch"], r["mode"])
        # PyTorch runs a greedy-only program for greedy batches, the full one otherwise.
        paired = r["path"] in (("folded_greedy", "split_greedy") if r["mode"] == "greedy" else ("folded", "split"))
        graph = torch_rows.get((*key, "graph")) if paired else None
        lines.append(
            f"{r['batch']:>5} {r['mode']:<8} {r['path']:<{width}} {r['median_ms']:>8.3f} {r['p90_ms']:>8.3f} "
            f"{r['dispatch_ms']:>8.3f} {r['pipelined_ms']:>9.3f} {_fmt(r.get('released_median_ms')):>8} "
            f"{_fmt(r.get('spin_median_ms')):>7} {_fmt(r.get('idle_median_ms')):>7} "
            f"{_fmt(r.get('floor_ms')):>7} "
            f"{r.get('floor_bound', '-'):<5} "
            f"{_fmt(r['median_ms'] / r['floor_ms'] if r.get('floor_ms') else None, '.2f'):>7} "
            f"{_fmt(r.get('floor_copy_ms')):>10} "
            f"{_fmt(torch_rows.get((*key, 'eager')) if paired else None):>11} "
            f"{_fmt(graph):>11} {_fmt(graph / r['median_ms'] if graph else None, '.2f'):>9} "
            f"{_fmt(graph / r['spin_median_ms'] if graph and r.get('spin_median_ms') else None, '.2f'):>10}"
            + (f" {_process_range(r):>13}" if pooled else "")
        )
    lines += _board_lines(result.get("propose", []))
    compared = [r for r in result.get("propose", []) if r.get("tokens_compared")]
    differing = [r for r in compared if r["tokens_differ"]]
    if differing:
        lines.append(
            "draft tokens DIFFER from the first path of the same batch and mode (same inputs and key): "
            + "; ".join(
                f"batch {r['batch']} {r['mode']} {r['path']}: {r['tokens_differ']} of {r['tokens_compared']} "
                f"against {r['tokens_reference']}" + _parity_note(r)
                for r in differing
            )
        )
        if any("tokens_logit_gap" in r for r in differing):
            lines.append(
                "  logit gap: the largest |logit(own token) - logit(reference's token)| in the path's own corrected "
                "logits at each differing greedy row's first differing step (about one bf16 step: a near-tie)"
            )
        if any("tokens_differ_sampling_rows" in r for r in differing):
            lines.append(
                "  sampling rows: each token wins the race of its logits and its noise, so the logits alone cannot "
                "tell a near-tie from a disagreement"
            )
    elif compared:
        lines.append(
            f"draft tokens: every path picks the same tokens as the first path of its batch and mode "
            f"(same inputs and key; {len(compared)} rows)"
        )
    if "error" in result.get("torch", {}):
        lines.append(f"torch baseline failed: {result['torch']['error'].strip().splitlines()[-1]}")
    comp = result.get("compile")
    if comp:
        for run in ("cold", "cached"):
            c = comp.get(run, {})
            if "error" in c:
                lines.append(f"precompile ({run}): failed: {c['error'].strip().splitlines()[-1]}")
            elif c:
                per = ", ".join(
                    f"{b['batch']}{'s' if b['fold_sampling'] else 'g'} {b['seconds']:.1f}" for b in c["buckets"]
                )
                per = f"per bucket, s = sampling folded, g = greedy-only: {per}; the rest" if per else "precompile()"
                store = c.get("store")
                store = f"; executable store: {store['hits']} loaded, {store['saves']} saved" if store else ""
                lines.append(
                    f"precompile ({run}, {c.get('workers', 1)} worker(s)): {c['total_seconds']:.1f} s "
                    f"(process {c['process_seconds']:.1f} s); {per} {c['rest_seconds']:.1f} s{store}"
                )
        mem = comp.get("cached", {}).get("memory")
        if mem and mem.get("sampling_extra_bytes") is not None:
            gate = comp["cached"]["gate"]
            lines.append(
                f"memory gate at batch {mem['batch']}: folded sampling adds {mem['sampling_extra_bytes'] / 1e9:.3f} GB "
                f"to the measured peak (the largest own peak of a round's programs, each the least of "
                f"{MEMORY_REPEATS} rounds: greedy "
                f"{_gb(mem['greedy_round_peak_bytes']):.3f} GB, "
                f"sampling {_gb(mem['sampling_round_peak_bytes']):.3f} GB; "
                f"in use before {_gb(mem['in_use_before_bytes']):.2f} GB); "
                f"gate predicts {_gb(gate['needed_bytes']):.3f} GB ({gate_error(gate['needed_bytes'], mem)}; "
                f"closed form {_gb(gate['closed_form_bytes']):.3f} GB, XLA's estimate "
                f"{_fmt(_gb(gate['compiled_bytes']))} GB)"
            )
    for m in result.get("memory", []):
        peaks = [v for k, v in m.items() if k.startswith("peak_after_") and v is not None]
        lines.append(
            f"memory batch {m['batch']}: in use before {_fmt(_gb(m.get('in_use_before_bytes')), '.2f')} GB, "
            f"device peak after it {_fmt(_gb(max(peaks)) if peaks else None, '.2f')} GB"
        )
    if result.get("walk"):
        from dspark_jax.bench_walk import format_walk  # it imports this module

        lines.extend(format_walk(result["walk"]))
    e2e = result.get("e2e")
    if e2e and "error" in e2e:
        lines.append(f"e2e failed: {e2e['error']}")
    elif e2e:
        lines.append(
            f"e2e batch {e2e['batch']} ({e2e['target_layers']}-layer target, context {e2e['context']}): "
            f"plain {e2e['plain_tokens_per_s']:.1f} tok/s ({e2e['plain_step_ms']:.2f} ms/step), "
            f"speculative {e2e['spec_tokens_per_s']:.1f} tok/s ({e2e['round_ms']:.2f} ms/round, "
            f"tau {e2e['tau_measured']:.2f}); speed-up {e2e['speedup']:.2f}x against ideal "
            f"{e2e['ideal_speedup']:.2f}x (propose {e2e['propose_ms']:.2f} + verify {e2e['verify_ms']:.2f} ms) "
            f"= {100 * e2e['fraction_of_ideal']:.0f}% of ideal"
        )
    return "\n".join(lines)


def _gb(value: int | None) -> float | None:
    return None if value is None else value / 1e9
