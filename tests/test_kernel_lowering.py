"""Every Pallas kernel lowers to Triton for CUDA on any backend, the CPU CI's included.

``jax.export`` with ``platforms=["cuda"]`` runs the Pallas → Triton lowering without a GPU,
so a primitive the Triton lowering lacks (a boolean ``any`` reduction, say) fails here
rather than on the first GPU run. Not covered: Triton's own compilation to PTX and the
kernels' numbers (the interpreter tests and the H200 runs check those).
"""

import contextlib
import re

import jax
import jax.numpy as jnp
import pytest
from jax import export

from dspark_jax.attention_kernel import (
    CONTEXT_KERNEL_PARAMS,
    MERGE_KERNEL_PARAMS,
    MERGE_TILE_KERNEL_PARAMS,
    attend_block,
)
from dspark_jax.greedy_kernel import GreedyTuning, greedy_markov_walk, greedy_tiles
from dspark_jax.kernel_choice import triton_params
from dspark_jax.mlp_kernel import MlpTuning, swiglu
from dspark_jax.qk_norm_kernel import qk_norm_rope
from dspark_jax.race_kernel import RaceTuning, race_step

TRITON = "__gpu$xla.gpu.triton"
S = jax.ShapeDtypeStruct


# The GPU the kernels are lowered for where none is attached: jax 0.10 falls back to compute
# capability 9.0 by itself; jax 0.11 asks for an abstract device and raises without one.
ABSTRACT_GPU = {"device_kind": "NVIDIA H200", "num_cores": 132, "platform": "cuda"}


def abstract_gpu():
    """A context in which Pallas's Triton lowering sees :data:`ABSTRACT_GPU` (nothing where a
    GPU is attached: the lowering reads the real one)."""
    if any(d.platform == "gpu" for d in jax.devices()):
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(**ABSTRACT_GPU)
    return jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((1,), ("gpus",), abstract_device=device))


def cuda_module(fn, *args) -> str:
    """``fn`` lowered for CUDA (Pallas kernels through Triton), as StableHLO text."""
    checks = [export.DisabledSafetyCheck.custom_call(TRITON)]
    with abstract_gpu():
        return export.export(jax.jit(fn), platforms=["cuda"], disabled_checks=checks)(*args).mlir_module()


def triton_calls_for_cuda(fn, *args) -> int:
    """The number of Triton calls in ``fn`` lowered for CUDA."""
    return cuda_module(fn, *args).count(f"@{TRITON}(")


@pytest.mark.parametrize("dtype, per_program", [(jnp.bfloat16, 1), (jnp.float32, 1), (jnp.bfloat16, 4)])
def test_race_step_lowers_for_cuda(dtype, per_program):
    """Two kernels per step (the pass over the blocks, then the pick), and no Philox hash left
    to XLA: emulated in XLA (shifts of 16-bit halves), it made the sampling heads' programs
    several times larger and their compilation slower on the H200 (README note 47)."""
    b, g, v = 8, 7, 2500
    rows = [S((b,), jnp.float32), S((b,), jnp.bool_), S((b, g, 2), jnp.uint32)]

    def first(base, bias, t, greedy, words):  # a new corrected buffer
        return race_step(base, bias, None, t, greedy, words, 0, tuning=RaceTuning(blocks_per_program=per_program))

    def later(base, bias, corrected, t, greedy, words):  # the buffer aliased in place
        return race_step(base, bias, corrected, t, greedy, words, 3, tuning=RaceTuning(blocks_per_program=per_program))

    base, bias = S((b, g, v), dtype), S((b, v), dtype)
    for fn, args in ((first, (base, bias, *rows)), (later, (base, bias, base, *rows))):
        lines = cuda_module(fn, *args).splitlines()
        kernels = [line for line in lines if f"@{TRITON}(" in line]  # each carries its kernel's IR
        assert len(kernels) == 2
        assert not any("shift_right_logical" in line for line in lines if line not in kernels)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (6, 3)])  # 3 KV heads: the padded tiles
def test_qk_norm_rope_lowers_for_cuda(heads, kv_heads):
    b, s, d = 2, 8, 64

    def fn(qkv, qw, kw, rotary):
        return qk_norm_rope(qkv, qw, kw, rotary, num_heads=heads, num_kv_heads=kv_heads, eps=1e-6)

    args = [S((b, s, (heads + 2 * kv_heads) * d), jnp.bfloat16), S((d,), jnp.bfloat16), S((d,), jnp.bfloat16)]
    rotary = S((b, s, d), jnp.float32)
    assert triton_calls_for_cuda(fn, *args, rotary) == 1
    assert _launch_settings(cuda_module(fn, *args, rotary)) == [(4, 1)]


@pytest.mark.parametrize("rows, hidden, inter", [(8, 4096, 12288), (5, 48, 80)])  # the 8B layer; masked tails
def test_swiglu_lowers_for_cuda(rows, hidden, inter):
    args = [S((rows, hidden), jnp.bfloat16), S((hidden, inter), jnp.bfloat16), S((hidden, inter), jnp.bfloat16)]
    assert triton_calls_for_cuda(swiglu, *args) == 1
    tuning = MlpTuning()
    assert _launch_settings(cuda_module(swiglu, *args)) == [(tuning.warps or 4, tuning.stages)]


# one kernel, or key ranges + merge; 16 heads per KV head: the merge on the tensor cores
@pytest.mark.parametrize("splits, kernels, nh", [(1, 1, 4), (2, 2, 4), (2, 2, 32)])
def test_attend_block_lowers_for_cuda(splits, kernels, nh):
    b, s, kvh, d, layers, slots, capacity = 2, 8, 2, 64, 2, 3, 128

    def fn(q, k, v, cache_k, cache_v, lens, slot):
        kw = dict(cache_k=cache_k, cache_v=cache_v, prefix_lens=lens, layer=1, slots=slot, splits=splits)
        return attend_block(q, k, v, **kw)

    own = S((b, s, kvh, d), jnp.bfloat16)
    cache = S((layers, slots, capacity, kvh, d), jnp.bfloat16)
    ints = S((b,), jnp.int32)
    args = (S((b, s, nh, d), jnp.bfloat16), own, own, cache, cache, ints, ints)
    assert triton_calls_for_cuda(fn, *args) == kernels
    merge_layout = MERGE_KERNEL_PARAMS if nh // kvh < 16 else MERGE_TILE_KERNEL_PARAMS  # the merge's own layout
    merge = [merge_layout] if kernels == 2 else []
    assert _launch_settings(cuda_module(fn, *args)) == [CONTEXT_KERNEL_PARAMS, *merge]


@pytest.mark.parametrize("head_type, batch", [("vanilla", 3), ("rnn", 130)])  # rnn: latents in XLA
def test_greedy_walk_lowers_for_cuda(head_type, batch):
    """Two kernels per step and no GEMM left to XLA for a vanilla head: the ``[B, V]`` bias is
    never formed outside the kernels."""
    from flax import nnx

    from dspark_jax import bench_workload
    from dspark_jax.presets import load_preset

    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16", markov_head_type=head_type)
    head = nnx.merge(*bench_workload.build_draft(cfg)).markov_head
    g, v, h = cfg.gamma, cfg.vocab_size, cfg.hidden_size

    def fn(base, hidden, bonus):
        return greedy_markov_walk(head, base, hidden, bonus)

    args = (S((batch, g, v), jnp.bfloat16), S((batch, g, h), jnp.bfloat16), S((batch,), jnp.int32))
    text = cuda_module(fn, *args)
    assert text.count("call @greedy_tiles(") == g and text.count("call @pick_tiles") == g  # one each per step
    kernels = [line for line in text.splitlines() if f"@{TRITON}(" in line]
    outside = [line for line in text.splitlines() if line not in kernels and "dot_general" in line]
    assert (len(outside) == 0) == (head_type == "vanilla")  # the RNN head's own projection stays in XLA


# batch 1 finishes its one real row alone (README note 77); persistent programs (note 86)
@pytest.mark.parametrize(
    "head_type, batch, max_rows, programs",
    [("vanilla", 1, 32, 0), ("vanilla", 3, 64, 0), ("gated", 40, 16, 0), ("vanilla", 3, 64, 3), ("gated", 40, 16, 2)],
)
def test_tiled_race_walk_lowers_for_cuda(head_type, batch, max_rows, programs):
    """Two kernels per step (tiles, then the pick) and, for a vanilla head, no GEMM left to XLA:
    the ``[B, V]`` bias is never formed outside the kernels; several row blocks per race block too."""
    from flax import nnx

    from dspark_jax import bench_workload
    from dspark_jax.presets import load_preset
    from dspark_jax.sampling import row_keys
    from dspark_jax.tile_race_kernel import TileRaceTuning, tiled_race_walk

    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16", markov_head_type=head_type)
    head = nnx.merge(*bench_workload.build_draft(cfg)).markov_head
    g, v, h = cfg.gamma, cfg.vocab_size, cfg.hidden_size
    tuning = TileRaceTuning(max_rows=max_rows, programs=programs)

    def fn(base, hidden, bonus, temps, greedy):
        keys = row_keys(jax.random.key(0), batch)
        return tiled_race_walk(head, base, hidden, bonus, temps, greedy, keys, tuning=tuning)

    args = (S((batch, g, v), jnp.bfloat16), S((batch, g, h), jnp.bfloat16), S((batch,), jnp.int32))
    text = cuda_module(fn, *args, S((batch,), jnp.float32), S((batch,), jnp.bool_))
    # the first step makes the corrected logits, the others update them in place: two functions
    assert len(re.findall(r"call @race_tiles(_\d+)?\(", text)) == g
    assert len(re.findall(r"call @pick_raced_tiles(_\d+)?\(", text)) == g
    kernels = [line for line in text.splitlines() if f"@{TRITON}(" in line]
    outside = [line for line in text.splitlines() if line not in kernels and "dot_general" in line]
    assert (len(outside) == 0) == (head_type == "vanilla")  # the gated head's gate stays in XLA


def _launch_settings(text: str) -> list[tuple[int, int]]:
    """``(num_warps, num_stages)`` of each Triton call in a lowered module, in order."""
    warps = [int(w) for w in re.findall(r"num_warps = (\d+)", text)]
    stages = [int(s) for s in re.findall(r"num_stages = (\d+)", text)]
    return list(zip(warps, stages, strict=True))


def test_each_kernel_launches_with_its_layout():
    """The warps and pipeline stages each kernel asks for (its tuning, or its fixed layout) reach
    the Triton call; through the interpreter no compiler parameters are passed at all."""
    b, g, v = 3, 2, 300
    tuning = GreedyTuning(warps=2, stages=4)

    def greedy(z, w2, base):
        return greedy_tiles(z, w2, base, 0, batch=b, tuning=tuning)

    z, w2, base = S((16, 32), jnp.bfloat16), S((v, 32), jnp.bfloat16), S((b, g, v), jnp.bfloat16)
    assert _launch_settings(cuda_module(greedy, z, w2, base)) == [(2, 4)]

    def race(base, bias, t, greedy_rows, words):
        return race_step(base, bias, None, t, greedy_rows, words, 0, tuning=RaceTuning(warps=1, pick_warps=4))

    rows = [S((8,), jnp.float32), S((8,), jnp.bool_), S((8, 7, 2), jnp.uint32)]
    text = cuda_module(race, S((8, 7, 2500), jnp.bfloat16), S((8, 2500), jnp.bfloat16), *rows)
    assert _launch_settings(text) == [(1, 1), (4, 1)]  # the block kernel, then the pick kernel
    assert triton_params(8, 3, interpret=True) == {}
