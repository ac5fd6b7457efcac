"""SplitRound: the folded round as front → rest → head executables equals the one-program round."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import random_draft, tiny_config
from flax import nnx

from dspark_jax import bench_workload, split_round
from dspark_jax.attention_kernel import ATTENTION_ENV
from dspark_jax.presets import load_preset
from dspark_jax.proposal import backbone_stage, propose
from dspark_jax.proposer import CompileCounter
from dspark_jax.sampling import TOP_K_ALL
from dspark_jax.split_round import (
    BACKBONE_GEMM_ENV,
    CUBLAS_BATCHES,
    Alternating,
    SplitRound,
    backbone_compile_options,
    layer_ranges,
    twin_program,
)

CAPACITY = 16


@pytest.fixture(scope="module")
def three_layers():
    """A 3-layer tiny draft, a 4-row context cache and one mixed call's inputs."""
    draft = random_draft(tiny_config(num_hidden_layers=3), seed=4)
    cache = bench_workload.random_context(draft.cfg, 4, CAPACITY, jax.random.key(5))
    inputs = dict(
        bonus=jnp.array([1, 9, 30, 0], jnp.int32),
        prefix_lens=jnp.array([5, 0, 9, 12], jnp.int32),
        temperatures=jnp.array([0.0, 0.8, 1.3, 0.0], jnp.float32),
        top_k=jnp.array([1, TOP_K_ALL, 20, TOP_K_ALL], jnp.int32),
    )
    return draft, cache, inputs


def _assert_same_block(a, b, rtol=1e-7):
    np.testing.assert_array_equal(np.asarray(a.draft_tokens), np.asarray(b.draft_tokens))
    np.testing.assert_array_equal(np.asarray(a.greedy_mask), np.asarray(b.greedy_mask))
    np.testing.assert_allclose(np.asarray(a.corrected_logits), np.asarray(b.corrected_logits), rtol=rtol, atol=1e-5)
    np.testing.assert_allclose(np.asarray(a.confidence), np.asarray(b.confidence), rtol=rtol, atol=1e-6)
    assert a.corrected_logits.shape == b.corrected_logits.shape


def test_layer_ranges_cover_every_layer_once():
    assert layer_ranges(5) == ((0, 1), (1, 2), (2, 3), (3, 5))  # the default, PIECE_LAYERS
    assert layer_ranges(5, 1) == ((0, 1), (1, 5))
    assert layer_ranges(5, 3) == ((0, 3), (3, 5))
    assert layer_ranges(5, (2, 1)) == ((0, 2), (2, 3), (3, 5))
    assert layer_ranges(5, (1, 1, 1, 1, 1, 1)) == tuple((i, i + 1) for i in range(5))
    assert layer_ranges(3, (1, 4, 1)) == ((0, 1), (1, 3))  # cut short at the last layer
    assert layer_ranges(1, 1) == ((0, 1),)
    assert layer_ranges(1) == ((0, 1),)
    assert layer_ranges(2, 7) == ((0, 2),)
    for bad in (0, -1, 1.5, True, (), (1, 0), (1, True), [1, 1], "1"):
        with pytest.raises(ValueError, match=r"piece_layers=.* is invalid: must be an integer >= 1 or a non-empty"):
            layer_ranges(5, bad)


@pytest.mark.parametrize("piece_layers", [1, 2, 3, (1, 1)])
@pytest.mark.parametrize("fold_sampling", [True, False])
def test_split_round_equals_one_program_round(three_layers, piece_layers, fold_sampling, monkeypatch):
    draft, cache, inputs = three_layers
    if piece_layers == 2:  # the plain-jit pieces compiled with the cuBLAS option (no effect on the CPU)
        monkeypatch.setenv(BACKBONE_GEMM_ENV, "cublas")
    key = jax.random.key(11)
    graphdef, state = nnx.split(draft)
    whole = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")
    want = whole(graphdef, state, cache, **inputs, key=key, fold_sampling=fold_sampling)
    # plain-jit pieces (the twin programs, GPU's default, are tested below)
    split = SplitRound(draft, piece_layers=piece_layers, twin_programs=False)
    assert len(split.ranges) == {1: 2, 2: 2, 3: 1, (1, 1): 3}[piece_layers]
    got = split(cache, **inputs, key=key, fold_sampling=fold_sampling)
    # on GPUs the cuBLAS pieces sum float32 products in another order than the one program's
    # Triton GEMMs (on the H200: 1.2e-5 apart at most, 8.7e-6 relative)
    rtol = 5e-5 if piece_layers == 2 else 1e-7
    _assert_same_block(got, want, rtol)
    jax.block_until_ready(split(cache, **inputs, key=jax.random.key(12), fold_sampling=fold_sampling))
    _assert_same_block(got, want, rtol)  # a later round never writes into a block the caller holds
    assert list(split._backbones) == [(("xla_gpu_enable_triton_gemm", False),) if piece_layers == 2 else None]
    if fold_sampling:  # the sampling rows really sampled from the folded noise
        assert not np.asarray(got.greedy_mask)[1:3].any()


def test_split_round_with_slots_and_the_kernel_equals_propose_on_gathered_rows(monkeypatch):
    """bf16 cache through the Pallas interpreter: slots read in place across the pieces."""
    monkeypatch.setenv(ATTENTION_ENV, "pallas")
    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = bench_workload.build_draft(cfg)
    draft = nnx.merge(graphdef, state)
    assert cfg.num_hidden_layers >= 2  # both pieces run
    cache = bench_workload.random_context(cfg, 6, 48, jax.random.key(3))
    slots = jnp.array([5, 1, 2], jnp.int32)
    gathered = type(cache)(k=cache.k[:, slots], v=cache.v[:, slots])
    bonus, lens = jnp.array([3, 7, 11], jnp.int32), jnp.array([20, 0, 41], jnp.int32)
    temps, top_k = bench_workload.sampling_params(3, "mixed")
    got = SplitRound(draft)(cache, bonus, lens, temps, top_k, jax.random.key(4), slots=slots)
    whole = jax.jit(lambda c, *a: propose(graphdef, state, c, *a))
    want = whole(gathered, bonus, lens, temps, top_k, jax.random.key(4))
    np.testing.assert_array_equal(np.asarray(got.draft_tokens), np.asarray(want.draft_tokens))
    # bf16: in one program XLA may keep a layer's output in float32 inside a fusion; between
    # pieces it is stored as bf16. The logits agree to bf16 rounding.
    a, b = np.asarray(got.corrected_logits, np.float64), np.asarray(want.corrected_logits, np.float64)
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2


def test_split_round_compiles_once_per_shape(three_layers):
    draft, cache, inputs = three_layers
    split = SplitRound(draft)
    jax.block_until_ready(split(cache, **inputs, key=jax.random.key(0)))
    with CompileCounter() as counter:
        blocks = [split(cache, **inputs, key=jax.random.key(i)) for i in range(1, 6)]
        jax.block_until_ready(blocks)
    assert counter.count == 0
    tokens = {tuple(np.asarray(b.draft_tokens)[1]) for b in blocks}
    assert len(tokens) > 1  # the key reaches the sampling rows


def test_alternating_calls_a_program_and_its_twin_in_turn():
    compiled = jax.jit(lambda x: x * 2 + 1).lower(jnp.zeros(3)).compile()
    twin = twin_program(compiled)
    assert twin is not compiled
    np.testing.assert_array_equal(np.asarray(twin(jnp.arange(3.0))), [1.0, 3.0, 5.0])
    both = Alternating(compiled)
    order = [both._next for _ in range(4) if both(jnp.ones(3)) is not None]
    assert order == [1, 0, 1, 0] and len(both._programs) == 2 and both.compiled is compiled
    single = Alternating(compiled, twin=False)
    assert [single._next for _ in range(2) if single(jnp.ones(3)) is not None] == [0, 0]


def test_twin_programs_match_propose_and_compile_once(three_layers):
    """Twins (forced on; by default on GPUs only): same blocks as one program, call after call."""
    draft, cache, inputs = three_layers
    graphdef, state = nnx.split(draft)
    whole = jax.jit(propose, static_argnums=0, static_argnames="fold_sampling")
    split = SplitRound(draft, twin_programs=True)
    assert split.twin_programs and not SplitRound(draft, twin_programs=False).twin_programs
    got = [split(cache, **inputs, key=jax.random.key(i), fold_sampling=i % 2 == 0) for i in range(2)]
    with CompileCounter() as counter:
        for i in range(2, 6):  # each program and its twin run at least once
            got.append(split(cache, **inputs, key=jax.random.key(i), fold_sampling=i % 2 == 0))
        jax.block_until_ready(got)
    assert counter.count == 0
    # host values of the same signature (NumPy, lists) reuse the programs
    host = {k: np.asarray(v).tolist() for k, v in inputs.items() if k != "temperatures"}
    temps = np.asarray(inputs["temperatures"])
    got.append(split(cache, **host, temperatures=temps, key=jax.random.key(6), fold_sampling=True))
    assert len(split._pieces) == 1 and len(split._heads) == 2  # the backbone is shared by both modes
    for i, block in enumerate(got):
        want = whole(graphdef, state, cache, **inputs, key=jax.random.key(i), fold_sampling=i % 2 == 0)
        _assert_same_block(block, want)  # also: no later round wrote into a held block


def test_host_lists_work_without_twin_programs_too(three_layers):
    """Without twins (the CPU default) lists failed on an unrelated AttributeError."""
    draft, cache, inputs = three_layers
    split = SplitRound(draft, twin_programs=False)
    host = {k: np.asarray(v).tolist() for k, v in inputs.items()}
    got = split(cache, **host, key=jax.random.key(3))
    _assert_same_block(got, split(cache, **inputs, key=jax.random.key(3)))


CUBLAS = {"xla_gpu_enable_triton_gemm": False}


def test_backbone_gemm_choice_per_batch_and_backend(monkeypatch):
    monkeypatch.delenv(BACKBONE_GEMM_ENV, raising=False)
    monkeypatch.setattr(split_round.jax, "default_backend", lambda: "cpu")
    assert CUBLAS_BATCHES and all(backbone_compile_options(b) is None for b in (1, 8, 16, 64, 128))
    monkeypatch.setattr(split_round.jax, "default_backend", lambda: "gpu")
    for batch in (1, 2, 4, 8, 16, 32, 64, 128, 12):
        assert backbone_compile_options(batch) == (CUBLAS if batch in CUBLAS_BATCHES else None), batch
    monkeypatch.setenv(BACKBONE_GEMM_ENV, "XLA")
    assert all(backbone_compile_options(b) is None for b in CUBLAS_BATCHES)
    monkeypatch.setenv(BACKBONE_GEMM_ENV, "cublas")
    assert backbone_compile_options(1) == CUBLAS
    monkeypatch.setenv(BACKBONE_GEMM_ENV, "triton")
    with pytest.raises(ValueError, match=r"DSPARK_JAX_BACKBONE_GEMM='triton' is invalid: must be one of"):
        backbone_compile_options(8)


def test_pieces_take_only_the_leaves_they_read(three_layers, monkeypatch):
    draft, cache, inputs = three_layers
    split = SplitRound(draft, twin_programs=True, piece_layers=1)
    monkeypatch.setenv(BACKBONE_GEMM_ENV, "cublas")  # on the CPU the option changes nothing
    asked, compile_program = [], jax.stages.Lowered.compile
    monkeypatch.setattr(
        jax.stages.Lowered,
        "compile",
        lambda self, compiler_options=None, **kw: (
            asked.append(compiler_options) or compile_program(self, compiler_options, **kw)
        ),
    )
    jax.block_until_ready(split(cache, **inputs, key=jax.random.key(0)))
    assert asked == [CUBLAS, CUBLAS, None]  # front, rest, then the head with XLA's defaults
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(nnx.state(draft))[0]]
    paths += [f"['layers'][{i}]['fused_qkv']" for i in range(len(draft.layers))]  # after the state's leaves
    assert len(paths) == len(split.leaves)
    read = {name: {paths[i] for i in kept} for name, kept in split._kept.items()}
    assert set(read) == {("piece", 0, 1), ("piece", 1, 3), ("head", True)}

    def layers(names):
        return {int(p.split("['layers']")[1].split("]")[0].strip("[")) for p in names if "['layers']" in p}

    assert layers(read["piece", 0, 1]) == {0} and layers(read["piece", 1, 3]) == {1, 2}
    assert not layers(read["head", True]) and read["head", True]
    assert all(0 < len(r) < len(paths) for r in read.values())
    # the projections read the fused q/k/v kernels, never the state's own
    everything = set().union(*read.values())
    assert {p for p in paths if "fused_qkv" in p} <= everything
    assert not any(
        proj in p for p in everything for proj in ("q_proj']['kernel", "k_proj']['kernel", "v_proj']['kernel")
    )


def test_a_piece_missing_a_leaf_it_reads_fails_loudly(three_layers):
    draft, cache, inputs = three_layers
    split = SplitRound(draft, twin_programs=True)
    split._kept["head", True] = ()  # as if the head read no weights
    with pytest.raises(TypeError, match="ShapeDtypeStruct"):  # a stand-in reached the maths
        split(cache, **inputs, key=jax.random.key(0))


def test_bad_shapes_and_ranges_are_rejected(three_layers):
    draft, cache, inputs = three_layers
    split = SplitRound(draft)
    bad = dict(inputs, bonus=inputs["bonus"][:3])
    with pytest.raises(ValueError, match=r"prefix_lens has shape \(4,\): expected \[3\] like bonus"):
        split(cache, **bad, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"slots has shape \(2,\): expected \[4\] like bonus"):
        split(cache, **inputs, key=jax.random.key(0), slots=jnp.array([0, 1]))
    x = jnp.zeros((4, draft.cfg.num_query_rows, draft.cfg.hidden_size), draft.cfg.jnp_dtype)
    with pytest.raises(ValueError, match=r"x must be None exactly when start == 0"):
        backbone_stage(draft, x, cache, inputs["bonus"], inputs["prefix_lens"], start=0)
    with pytest.raises(ValueError, match=r"x must be None exactly when start == 0"):
        backbone_stage(draft, None, cache, inputs["bonus"], inputs["prefix_lens"], start=1)
    with pytest.raises(
        ValueError, match=r"layer range start=2, stop=4 is invalid: must satisfy 0 <= start <= stop <= 3"
    ):
        backbone_stage(draft, x, cache, inputs["bonus"], inputs["prefix_lens"], start=2, stop=4)


def test_a_draft_or_flags_of_the_wrong_type_are_refused_at_construction(three_layers):
    """``twin_programs="no"`` was true (the Proposer refused it); None in place of the draft
    failed on a missing attribute."""
    draft = three_layers[0]
    with pytest.raises(TypeError, match=r"draft must be a DSparkDraft, got NoneType"):
        SplitRound(None)
    with pytest.raises(TypeError, match=r"twin_programs='no' is invalid: must be True, False or None"):
        SplitRound(draft, twin_programs="no")
    for fuse in ("no", None, 1):
        with pytest.raises(TypeError, match=rf"fuse_qkv={fuse!r} is invalid: must be True or False"):
            SplitRound(draft, fuse_qkv=fuse)
