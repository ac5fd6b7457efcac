"""The PyTorch baseline of ``dspark-jax bench``: the same draft round, eager and as a CUDA graph.

Only the benchmark imports this module (in a subprocess), and it is the only module of
the package that imports PyTorch (the ``bench`` extra: ``pip install dspark-jax[bench]``).

The round matches :func:`dspark_jax.proposal.propose` at the benchmark's shapes: embed
``[bonus, MASK × (γ−1)]``, the backbone layers over ``context`` cached keys and values
plus the block (non-causal), the final norm, the lm_head, the γ-step Markov walk
(greedy argmax, or the exponential race ``argmax(logits / T − log E)`` for sampling rows,
with fresh ``Exp(1)`` noise per step) and the confidence head. Greedy batches run a
greedy-only program, as sglang captures one; mixed and sampling batches run the full one.
Weights are random, created on the device.

Shape legend: B batch, R query rows (γ), C context capacity, H hidden, NH query heads,
KVH key/value heads, G = NH / KVH, D head dim, I intermediate, V vocabulary, r Markov rank.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from dspark_jax.bench import MODES, SHAPES, BenchShapes, draft_config

_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


class TorchDraft:
    """Random-weight draft tensors at the preset's shapes (PyTorch ``Linear`` layout ``[out, in]``)."""

    def __init__(self, d: dict[str, Any], *, device: torch.device, seed: int = 0):
        self.d = d
        self.device = device
        self.dtype = _DTYPES[d["param_dtype"]]
        gen = torch.Generator(device=device).manual_seed(seed)
        h, i, nh, kvh, hd = (
            d["hidden_size"],
            d["intermediate_size"],
            d["num_attention_heads"],
            d["num_key_value_heads"],
            d["head_dim"],
        )
        v, r = d["vocab_size"], d["markov_rank"]

        def w(*shape, dtype=None):
            return torch.randn(*shape, generator=gen, device=device, dtype=dtype or self.dtype) * 0.02

        def ones(n):
            return torch.ones(n, device=device, dtype=self.dtype)

        self.embed = w(v, h)
        self.lm_head = self.embed  # tied, as the JAX benchmark's random draft borrows one table
        self.layers = [
            {
                "in_norm": ones(h),
                "wq": w(nh * hd, h),
                "wk": w(kvh * hd, h),
                "wv": w(kvh * hd, h),
                "wo": w(h, nh * hd),
                "q_norm": ones(hd),
                "k_norm": ones(hd),
                "post_norm": ones(h),
                "wg": w(i, h),
                "wu": w(i, h),
                "wd": w(h, i),
            }
            for _ in range(d["num_hidden_layers"])
        ]
        self.norm = ones(h)
        self.w1 = w(v, r)
        self.w2 = w(v, r)
        self.conf_w = w(1, h + r, dtype=torch.float32)
        self.conf_b = torch.zeros(1, device=device, dtype=torch.float32)
        half = hd // 2
        self.inv_freq = 1.0 / (
            d.get("rope_theta", 1_000_000.0) ** (torch.arange(0, half, device=device).float() / half)
        )


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * x32).to(x.dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox rotary embedding; ``x [B, S, heads, D]``, ``cos/sin [B, S, 1, D/2]``."""
    x32 = x.float()
    x1, x2 = x32.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def draft_round(
    m: TorchDraft,
    ctx_k: torch.Tensor,
    ctx_v: torch.Tensor,
    ctx_mask: torch.Tensor,
    bonus: torch.Tensor,
    prefix_lens: torch.Tensor,
    temps: torch.Tensor,
    greedy: torch.Tensor,
    *,
    fold_sampling: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One draft round.

    Args:
      m: the weights.
      ctx_k, ctx_v: ``[L, B, C, KVH, D]`` context keys and values.
      ctx_mask: ``[B, C]`` bool, True for visible context positions.
      bonus: ``[B]`` int64 anchor tokens.
      prefix_lens: ``[B]`` int64.
      temps: ``[B]`` float32 temperatures (clamped).
      greedy: ``[B]`` bool greedy rows.
      fold_sampling: False runs the greedy-only program.

    Returns:
      ``(tokens [B, γ] int64, corrected [B, γ, V] in the model dtype (or [B, γ, 0]), confidence [B, γ])``.
    """
    d = m.d
    b = bonus.shape[0]
    g_len = d["block_size"]
    nh, kvh, hd = d["num_attention_heads"], d["num_key_value_heads"], d["head_dim"]
    grp = nh // kvh
    ids = torch.cat([bonus[:, None], torch.full((b, g_len - 1), d["mask_token_id"], device=m.device)], dim=1)
    positions = prefix_lens[:, None] + torch.arange(g_len, device=m.device)  # [B, R]
    angles = positions.float()[..., None] * m.inv_freq  # [B, R, D/2]
    cos, sin = angles.cos()[:, :, None], angles.sin()[:, :, None]
    mask = torch.cat([ctx_mask, torch.ones(b, g_len, dtype=torch.bool, device=m.device)], dim=1)
    mask = mask[:, None, None, :]  # [B, 1, 1, C+R]
    x = m.embed[ids]  # [B, R, H]
    for i, lw in enumerate(m.layers):
        a = _rms(x, lw["in_norm"])
        q = _rope(_rms(F.linear(a, lw["wq"]).view(b, g_len, nh, hd), lw["q_norm"]), cos, sin)
        k = _rope(_rms(F.linear(a, lw["wk"]).view(b, g_len, kvh, hd), lw["k_norm"]), cos, sin)
        v = F.linear(a, lw["wv"]).view(b, g_len, kvh, hd)
        keys = torch.cat([ctx_k[i], k], dim=1).transpose(1, 2)  # [B, KVH, C+R, D]
        values = torch.cat([ctx_v[i], v], dim=1).transpose(1, 2)
        # Grouped query heads share a KV head: fold the group into the query rows.
        qg = q.view(b, g_len, kvh, grp, hd).permute(0, 2, 3, 1, 4).reshape(b, kvh, grp * g_len, hd)
        att = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)  # [B, KVH, G·R, D]
        att = att.view(b, kvh, grp, g_len, hd).permute(0, 3, 1, 2, 4).reshape(b, g_len, nh * hd)
        x = x + F.linear(att, lw["wo"])
        hmid = _rms(x, lw["post_norm"])
        x = x + F.linear(F.silu(F.linear(hmid, lw["wg"])) * F.linear(hmid, lw["wu"]), lw["wd"])
    hidden = _rms(x, m.norm)  # [B, γ, H]
    base = F.linear(hidden, m.lm_head)  # [B, γ, V]
    prev = bonus
    tokens, corrected, prevs = [], [], []
    for step in range(g_len):
        prevs.append(prev)
        logits = base[:, step].float() + F.linear(m.w1[prev], m.w2).float()  # [B, V]
        if fold_sampling:  # kept in the model dtype; sampling rows race on the kept values
            kept = logits.to(base.dtype)
            noise = torch.empty_like(logits).exponential_()
            raced = kept.float() / temps[:, None] - noise.log()
            prev = torch.where(greedy[:, None], logits, raced).argmax(-1)
            corrected.append(kept)
        else:
            prev = logits.argmax(-1)
        tokens.append(prev)
    prev_embed = m.w1[torch.stack(prevs, dim=1)]  # [B, γ, r]
    conf_in = torch.cat([hidden.float(), prev_embed.float()], dim=-1)
    confidence = torch.sigmoid(F.linear(conf_in, m.conf_w, m.conf_b))[..., 0]
    corrected_t = torch.stack(corrected, dim=1) if fold_sampling else base.new_zeros((b, g_len, 0))
    return torch.stack(tokens, dim=1), corrected_t, confidence


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, iters: int, warmup: int = 3) -> dict[str, float]:
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    p10, med, p90 = np.percentile(times, [10, 50, 90])
    return {"median_ms": float(med), "p10_ms": float(p10), "p90_ms": float(p90), "iters": iters}


def _capture(fn, device: torch.device):
    """Captures ``fn`` in a CUDA graph (after warming it up on a side stream)."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def copy_bandwidth(nbytes: int, device: torch.device, iters: int) -> float:
    """Bytes per second (read plus written) of a device-to-device ``copy_`` of ``nbytes``."""
    src = torch.randn(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    t = _time(lambda: dst.copy_(src), device, iters)["median_ms"]
    return 2 * nbytes / (t * 1e-3)


def _bench_batch(m: TorchDraft, shapes: BenchShapes, batch: int, iters: int) -> list[dict[str, Any]]:
    d, device = m.d, m.device
    capacity = shapes.context + 2 * d["block_size"]
    shape = (d["num_hidden_layers"], batch, capacity, d["num_key_value_heads"], d["head_dim"])
    ctx_k = torch.randn(shape, device=device, dtype=m.dtype)
    ctx_v = torch.randn(shape, device=device, dtype=m.dtype)
    prefix = torch.full((batch,), shapes.context, device=device)
    ctx_mask = torch.arange(capacity, device=device)[None, :] < prefix[:, None]
    bonus = torch.randint(0, d["vocab_size"], (batch,), device=device)
    rows = []
    for mode in MODES:
        n_sample = {"greedy": 0, "mixed": max(1, batch // 2), "sampling": batch}[mode]
        greedy = torch.arange(batch, device=device) >= n_sample
        temps = torch.ones(batch, device=device)
        fold = mode != "greedy"

        def fn(greedy=greedy, temps=temps, fold=fold):
            return draft_round(m, ctx_k, ctx_v, ctx_mask, bonus, prefix, temps, greedy, fold_sampling=fold)

        rows.append({"batch": batch, "mode": mode, "path": "eager", **_time(fn, device, max(3, iters // 2))})
        if device.type == "cuda":
            graph = _capture(fn, device)
            rows.append({"batch": batch, "mode": mode, "path": "graph", **_time(graph.replay, device, iters)})
            del graph
    return rows


def draft_fields(shapes: BenchShapes) -> dict[str, Any]:
    """The benchmark draft's config as a plain dict (what :class:`TorchDraft` reads)."""
    cfg = draft_config(shapes)
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}


def bench(shapes: BenchShapes, batches: tuple[int, ...], iters: int) -> dict[str, Any]:
    """Times the round per batch and mode, eager and (on CUDA) as a CUDA graph."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    m = TorchDraft(draft_fields(shapes), device=device)
    with torch.inference_mode():
        rows = [row for batch in batches for row in _bench_batch(m, shapes, batch, iters)]
    out = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "rows": rows,
    }
    if device.type == "cuda":
        out["copy_bytes_per_s"] = copy_bandwidth(shapes.ceiling_bytes, device, max(5, iters // 5))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m dspark_jax.bench_torch``: prints the result as one JSON line."""
    parser = argparse.ArgumentParser(prog="python -m dspark_jax.bench_torch", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--batches", default=None, help="comma-separated batch sizes")
    parser.add_argument("--iters", type=int, default=None)
    args = parser.parse_args(argv)
    shapes = SHAPES[args.shapes]
    batches = tuple(int(b) for b in args.batches.split(",")) if args.batches else shapes.batches
    print(json.dumps(bench(shapes, batches, args.iters or shapes.iters)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
