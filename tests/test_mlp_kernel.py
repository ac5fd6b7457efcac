"""The SwiGLU kernel (Pallas interpreter on the CPU, compiled on GPUs) against a NumPy reference and XLA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import rel_err, tiny_config, tiny_rounds_per_choice

from dspark_jax.mlp_kernel import (
    MLP_AUTO_MAX_ROWS,
    MLP_ENV,
    MlpTuning,
    mlp_choice,
    mlp_forward,
    swiglu,
    swiglu_supported,
    use_mlp_kernel,
)

INTERPRET = jax.default_backend() != "gpu"  # on GPUs the compiled kernel
BF16_ULP = 2.0**-7  # one unit in the last place of a bfloat16 value in [1, 2)


def _inputs(rows, hidden, inter, seed=0, dtype=jnp.bfloat16):
    kx, kg, ku = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (rows, hidden)).astype(dtype)
    gate = (jax.random.normal(kg, (hidden, inter)) / np.sqrt(hidden)).astype(dtype)
    up = (jax.random.normal(ku, (hidden, inter)) / np.sqrt(hidden)).astype(dtype)
    return x, gate, up


def _np_swiglu(x, gate, up):
    """From the equations, float64: ``g = x·gate``, ``u = x·up``, each rounded to bfloat16 as a
    GEMM stores it, then ``g · sigmoid(g) · u``."""
    x, gate, up = (np.asarray(a, np.float64) for a in (x, gate, up))
    g = np.asarray(jnp.asarray(x @ gate, jnp.float32).astype(jnp.bfloat16), np.float64)
    u = np.asarray(jnp.asarray(x @ up, jnp.float32).astype(jnp.bfloat16), np.float64)
    return g / (1.0 + np.exp(-g)) * u


# rows padded (1 → 16, 24 → 32), hidden and intermediate tails masked (48, 80), several programs,
# several row blocks
@pytest.mark.parametrize(
    "rows, hidden, inter, tuning",
    [
        (8, 64, 256, MlpTuning(tile=64, chunk=32)),
        (1, 48, 80, MlpTuning(tile=32, chunk=32)),
        (24, 32, 48, None),
        (16, 128, 128, MlpTuning(tile=16, chunk=16, stages=2, warps=2)),
        (40, 32, 64, MlpTuning(tile=32, chunk=16, rows=16)),  # three row blocks, the last one padded
        (130, 32, 48, None),  # three row blocks of 64
    ],
)
def test_swiglu_matches_numpy_and_xla(rows, hidden, inter, tuning):
    x, gate, up = _inputs(rows, hidden, inter, seed=rows + hidden)
    got = swiglu(x, gate, up, interpret=INTERPRET, tuning=tuning)
    assert got.shape == (rows, inter) and got.dtype == jnp.bfloat16
    # float32 sums in another order than float64: a product may round one unit the other way
    assert rel_err(got, _np_swiglu(x, gate, up)) <= 2 * BF16_ULP
    want = jax.jit(lambda x, g, u: jax.nn.silu(x @ g) * (x @ u))(x, gate, up)
    assert rel_err(got, want) <= 2 * BF16_ULP


def test_propose_with_the_kernel_matches_the_xla_path(monkeypatch):
    """The whole round, bf16 tiny draft, every layer's MLP through the kernel: same tokens,
    logits within bf16 rounding."""
    _, blocks = tiny_rounds_per_choice(monkeypatch, MLP_ENV)
    a, b = blocks["xla"], blocks["pallas"]
    np.testing.assert_array_equal(np.asarray(a.draft_tokens), np.asarray(b.draft_tokens))
    la, lb = np.asarray(a.corrected_logits, np.float64), np.asarray(b.corrected_logits, np.float64)
    assert np.linalg.norm(la - lb) / np.linalg.norm(la) < 2e-2  # another rounding, same maths


def test_propose_traces_the_kernel_only_when_chosen(monkeypatch):
    from draft_testing import tiny_round

    from dspark_jax import propose

    cfg, graphdef, args = tiny_round("greedy", gamma=2)
    counts = {}
    for choice in ("xla", "pallas"):
        monkeypatch.setenv(MLP_ENV, choice)
        jaxpr = str(jax.make_jaxpr(lambda *a: propose(graphdef, *a, fold_sampling=False))(*args))
        counts[choice] = jaxpr.count("name=swiglu")  # calls of the jitted kernel
    assert counts == {"xla": 0, "pallas": cfg.num_hidden_layers}


def test_choice_support_tuning_and_bad_inputs(monkeypatch):
    monkeypatch.delenv(MLP_ENV, raising=False)
    assert mlp_choice() == "auto"
    on_gpu = jax.default_backend() == "gpu"
    assert use_mlp_kernel(jnp.bfloat16, MLP_AUTO_MAX_ROWS, 4096, 12288) == (on_gpu, False)
    assert use_mlp_kernel(jnp.bfloat16, MLP_AUTO_MAX_ROWS + 1, 4096, 12288) == (False, False)  # cuBLAS's
    monkeypatch.setenv(MLP_ENV, " Pallas ")
    assert use_mlp_kernel(jnp.bfloat16, 1024, 4096, 12288) == (True, INTERPRET)  # forced at any row count
    assert use_mlp_kernel(jnp.float32, 8, 4096, 12288) == (False, False)  # TF32 products: not XLA's GEMM
    assert use_mlp_kernel(jnp.float16, 8, 8, 12288) == (False, False)
    monkeypatch.setenv(MLP_ENV, "xla")
    assert use_mlp_kernel(jnp.bfloat16, 8, 4096, 12288) == (False, False)
    monkeypatch.setenv(MLP_ENV, "cublas")
    with pytest.raises(ValueError, match="DSPARK_JAX_MLP='cublas' is invalid"):
        mlp_choice()
    assert swiglu_supported(jnp.float16, 16, 16) and not swiglu_supported(jnp.bfloat16, 16, 8)

    for field, value in (("tile", 48), ("chunk", 8), ("warps", 16), ("stages", 0), ("chunk", True), ("rows", 8)):
        with pytest.raises(ValueError, match=f"{field}="):
            MlpTuning(**{field: value})

    x, gate, up = _inputs(4, 32, 48)
    with pytest.raises(ValueError, match=r"x \(4, 32\), gate \(32, 48\), up \(32, 40\)"):
        swiglu(x, gate, up[:, :40], interpret=True)
    with pytest.raises(ValueError, match=r"x \(4, 16\), gate \(32, 48\)"):
        swiglu(x[:, :16], gate, up, interpret=True)
    with pytest.raises(ValueError, match="x bfloat16, gate float32, up bfloat16: must be one dtype"):
        swiglu(x, gate.astype(jnp.float32), up, interpret=True)
    with pytest.raises(ValueError, match="dtype=float32, H=32, I=48 are not supported"):
        swiglu(*(a.astype(jnp.float32) for a in (x, gate, up)), interpret=True)
    with pytest.raises(TypeError, match="tuning="):
        swiglu(x, gate, up, interpret=True, tuning="fast")


def test_mlp_forward_is_the_module_through_the_kernel_and_refuses_a_bias():
    from flax import nnx

    from dspark_jax.layers import MLP

    cfg = tiny_config(dtype="bfloat16", param_dtype="bfloat16")
    mlp = MLP(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 5, cfg.hidden_size)).astype(jnp.bfloat16)
    got, want = mlp_forward(mlp, x, interpret=INTERPRET), jax.jit(lambda x: mlp(x))(x)
    assert got.shape == want.shape == x.shape and got.dtype == jnp.bfloat16
    assert rel_err(got, want) <= 4 * BF16_ULP  # the down projection of a product rounded another way
    mlp.up_proj.bias = nnx.Param(jnp.ones((cfg.intermediate_size,), jnp.bfloat16))
    with pytest.raises(ValueError, match="up_proj has a bias"):
        mlp_forward(mlp, x, interpret=True)


def test_swiglu_refuses_no_rows_a_string_flag_and_lists():
    """``M = 0`` was a Pallas discharge error; ``interpret='no'`` ran the interpreter (a true string)."""
    x, gate, up = _inputs(4, 32, 48)
    with pytest.raises(ValueError, match=r"swiglu got x \(0, 32\): expected \[M, H\] with M >= 1 rows"):
        swiglu(x[:0], gate, up, interpret=True)
    with pytest.raises(TypeError, match="interpret='no' is invalid: must be True or False"):
        swiglu(x, gate, up, interpret="no")
    with pytest.raises(TypeError, match="swiglu: x has type list"):
        swiglu(np.asarray(x, np.float32).tolist(), gate, up, interpret=True)


def test_mlp_tuning_takes_numpy_integers_and_refuses_floats():
    tuning = MlpTuning(tile=np.int64(64), warps=np.int32(2), stages=np.int64(3), rows=np.int16(32))
    assert tuning == MlpTuning(tile=64, warps=2, stages=3, rows=32)
    assert all(type(getattr(tuning, f)) is int for f in ("tile", "warps", "stages", "rows"))  # stored as ints
    for field, value in (("warps", 4.0), ("warps", True), ("tile", 64.0), ("stages", 3.0)):
        with pytest.raises(ValueError, match=f"{field}={value!r} is invalid"):
            MlpTuning(**{field: value})


def test_each_product_is_rounded_to_the_model_dtype_before_the_swiglu():
    """``g = x·gate`` and ``u = x·up`` are each rounded to bfloat16 (as XLA's GEMMs store them)
    before ``silu(g) · u``. One row ``x = [1, 2⁻⁹, 0, …]``: columns 0–15 have ``g = g₀ + 2⁻⁹``
    (``g₀ = 1 + k/128``, rounding to ``g₀``) and ``u = 1``; columns 16–31 ``g = 1`` and
    ``u = u₀ + 2⁻⁹`` (rounding to ``u₀``). The output equals, bit for bit, the float64 SwiGLU of
    the rounded products rounded once to bfloat16; in each group some columns' outputs differ
    from those of the unrounded products (checked here), so a kernel skipping either rounding
    fails."""
    hidden, inter = 16, 32
    k = np.arange(16)
    x = np.zeros((1, hidden))
    x[0, :2] = [1.0, 2.0**-9]
    gate, up = np.zeros((hidden, inter)), np.zeros((hidden, inter))
    gate[0, :16], gate[1, :16], up[0, :16] = 1 + k / 128, 1.0, 1.0  # g = g₀ + 2⁻⁹, u = 1
    gate[0, 16:], up[0, 16:], up[1, 16:] = 1.0, 1 + k / 128, 1.0  # g = 1, u = u₀ + 2⁻⁹
    x, gate, up = (jnp.asarray(a, jnp.bfloat16) for a in (x, gate, up))
    got = swiglu(x, gate, up, interpret=INTERPRET, tuning=MlpTuning(tile=16, chunk=16))

    def bf16(a):
        return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16), np.float64)

    exact_g = np.asarray(x, np.float64) @ np.asarray(gate, np.float64)  # exact in float32 too
    exact_u = np.asarray(x, np.float64) @ np.asarray(up, np.float64)
    want = bf16(_np_swiglu(x, gate, up))  # the rounded products' SwiGLU, rounded once
    np.testing.assert_array_equal(np.asarray(got, np.float64), want)
    for rounded_g, rounded_u, cols in ((False, True, slice(0, 16)), (True, False, slice(16, 32))):
        g = bf16(exact_g) if rounded_g else exact_g
        u = bf16(exact_u) if rounded_u else exact_u
        unrounded = bf16(g / (1.0 + np.exp(-g)) * u)
        assert (unrounded[:, cols] != want[:, cols]).any()  # the test can tell
