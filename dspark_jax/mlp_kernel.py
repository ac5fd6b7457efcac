"""The draft layers' gate and up projections and SwiGLU as one Pallas (Triton) kernel for few rows.

Shape legend: M rows (batch × block rows), BR rows per program (``M`` padded to a power of two,
at least 16, at most :attr:`MlpTuning.rows`), H hidden size, I intermediate size, T intermediate
columns per program, K hidden columns per step of a program's loop.

With few rows (a draft round at small batches: 8 rows per request) the MLP's GEMMs are weight
streams. XLA runs ``silu(x @ gate) * (x @ up)`` as two GEMMs and an elementwise kernel; on the
H200 at the 8B shapes the two GEMMs stream their 2 × 100 MB at 3.9–4.0 TB/s (README note 69).
:func:`swiglu` reads both weights in one pass: program ``(i, j)`` owns row block ``i`` (``BR``
rows; one block up to 64 rows) and intermediate columns ``[j·T, (j+1)·T)``, walks the hidden size
in steps of ``K`` with the rows' activations and the two weight tiles, accumulates both products
in float32 on the tensor cores and stores ``silu(g) · u`` for its rows and columns. Rows past
``M`` and columns past ``I`` are masked (zeros in, nothing stored).

Rounding: each product is rounded to the model dtype, as XLA's GEMMs store them; the SwiGLU of
the two rounded values is computed in float32 and rounded once (XLA's elementwise fusion may
round ``silu(g)`` first or not: the kernel and the XLA path agree to the model dtype's rounding).

:func:`swiglu_supported` says when the kernel applies (a 16-bit dtype; ``H`` and ``I`` at
least 16) and :func:`use_mlp_kernel` whether this trace uses it (:data:`MLP_ENV`; by default on
GPU backends up to :data:`MLP_AUTO_MAX_ROWS` rows).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from dspark_jax.attention_kernel import _load, _store, _whole
from dspark_jax.config import check_flag
from dspark_jax.kernel_choice import (
    KERNEL_CHOICES,
    check_tile_layout,
    env_choice,
    kernel_mode,
    pow2_ceil,
    triton_params,
)

if TYPE_CHECKING:
    from dspark_jax.layers import MLP

MLP_ENV = "DSPARK_JAX_MLP"
"""Environment variable choosing the draft MLP's gate/up projections: ``auto`` (default: the
kernel on GPUs when :func:`swiglu_supported`, up to :data:`MLP_AUTO_MAX_ROWS` rows), ``xla``
(never) or ``pallas`` (wherever supported, any row count; the Pallas interpreter off GPUs)."""

MLP_CHOICES = KERNEL_CHOICES

MLP_AUTO_MAX_ROWS = 64
"""The most rows (batch × block rows) ``auto`` runs :func:`swiglu` for: batches up to 8 at γ = 7.
Measured on the H200 at the 8B shapes (README note 69): faster than XLA's two GEMMs and
elementwise kernel at 8 and 64 rows; at 256 rows the GEMMs are compute-bound and cuBLAS's
Hopper kernels run them near the matmul rate."""

_WARP_COUNTS = (1, 2, 4, 8)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MlpTuning:
    """How :func:`swiglu` lays its work out on the GPU; the values do not depend on it.

    Attributes:
      tile: intermediate columns per program ``T``, a power of two >= 16.
      chunk: hidden columns per loop step ``K``, a power of two >= 16.
      warps: warps per program (None: 4).
      stages: Triton pipeline stages of the loop.
      rows: the most rows per program, a power of two >= 16 (more rows run as several row
        blocks, each reading the weights again: two ``[rows, T]`` float32 accumulators must fit
        in a program's registers).

    The defaults are the fastest of the settings measured on the H200 at 8 and 64 rows (README
    note 69: 36 settings of tile, chunk, warps and stages).
    """

    tile: int = 128
    chunk: int = 64
    warps: int | None = None
    stages: int = 4
    rows: int = 64

    def __post_init__(self):
        check_tile_layout(self, ("tile", "chunk", "rows"), _WARP_COUNTS)


MLP_TUNING = MlpTuning()
"""The :class:`MlpTuning` :func:`swiglu` uses unless given one."""


def mlp_choice() -> str:
    """The value of :data:`MLP_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(MLP_ENV)


def swiglu_supported(dtype: jnp.dtype, hidden: int, intermediate: int) -> bool:
    """True when the kernel applies: a 16-bit dtype (the tensor cores' bfloat16/float16 products,
    as XLA's GEMMs compute them) and ``H``, ``I`` at least 16."""
    half = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    return half and hidden >= 16 and intermediate >= 16


def use_mlp_kernel(dtype: jnp.dtype, rows: int, hidden: int, intermediate: int) -> tuple[bool, bool]:
    """``(use the kernel, through the interpreter)`` for this trace, from :func:`mlp_choice`
    (``auto``: up to :data:`MLP_AUTO_MAX_ROWS` rows)."""
    wanted = rows <= MLP_AUTO_MAX_ROWS or mlp_choice() == "pallas"
    return kernel_mode(MLP_ENV, swiglu_supported(dtype, hidden, intermediate) and wanted)


def _swiglu_kernel(x_ref, g_ref, u_ref, o_ref, *, rows, tile, chunk):
    """Program ``(i, j)``: ``x_ref [M, H]``, ``g_ref``/``u_ref [H, I]`` → ``o_ref [M, I]`` rows
    ``[i·BR, (i+1)·BR)``, columns ``[j·T, (j+1)·T)`` (rows past ``M`` and columns past ``I`` masked)."""
    count, hidden = x_ref.shape
    inter = g_ref.shape[1]
    first_row, start = pl.program_id(0) * rows, pl.program_id(1) * tile
    row_ok = first_row + jax.lax.broadcasted_iota(jnp.int32, (rows, 1), 0) < count  # [BR, 1]
    col_ok = start + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1) < inter  # [1, T]
    cols, row_ids = pl.ds(start, tile), pl.ds(first_row, rows)
    padded = count % rows != 0  # some row block holds rows past M

    def step(k, carry):
        acc_g, acc_u = carry
        first = pl.multiple_of(k * chunk, chunk)
        at = pl.ds(first, chunk)
        k_ok = None if hidden % chunk == 0 else first + jax.lax.broadcasted_iota(jnp.int32, (1, chunk), 1) < hidden
        x_mask = row_ok if padded else None
        if k_ok is not None:
            x_mask = k_ok if x_mask is None else x_mask & k_ok
        x = _load(x_ref, (row_ids, at), x_mask)  # [BR, K]
        w_mask = None
        if k_ok is not None or inter % tile:
            w_mask = (jnp.reshape(k_ok, (chunk, 1)) if k_ok is not None else True) & col_ok  # [K, T]
        g = _load(g_ref, (at, cols), w_mask)  # [K, T]
        u = _load(u_ref, (at, cols), w_mask)
        acc_g = acc_g + jax.lax.dot(x, g, preferred_element_type=jnp.float32)
        acc_u = acc_u + jax.lax.dot(x, u, preferred_element_type=jnp.float32)
        return acc_g, acc_u

    zero = jnp.zeros((rows, tile), jnp.float32)
    acc_g, acc_u = jax.lax.fori_loop(0, pl.cdiv(hidden, chunk), step, (zero, zero))
    dtype = o_ref.dtype
    g = acc_g.astype(dtype).astype(jnp.float32)  # rounded as XLA's GEMMs store the products
    u = acc_u.astype(dtype).astype(jnp.float32)
    out = (g * jax.nn.sigmoid(g) * u).astype(dtype)  # [BR, T]
    mask = None if not padded and inter % tile == 0 else row_ok & col_ok
    _store(o_ref, (row_ids, cols), out, mask)


@functools.partial(jax.jit, static_argnames=("interpret", "tuning"))
def swiglu(
    x: jax.Array,
    gate: jax.Array,
    up: jax.Array,
    *,
    interpret: bool = False,
    tuning: MlpTuning | None = None,
) -> jax.Array:
    """``silu(x @ gate) · (x @ up)`` in one kernel.

    Args:
      x: ``[M, H]`` activations.
      gate, up: ``[H, I]`` the two projections' kernels (``nnx.Linear`` layout), ``x``'s dtype.
      interpret: run through the Pallas interpreter (any backend).
      tuning: the layout (None: :data:`MLP_TUNING`).

    Returns:
      ``[M, I]`` in ``x.dtype``.

    Raises:
      ValueError: shapes or dtypes that do not fit together or that the kernel does not support,
        or ``x`` has no rows (``M = 0``).
      TypeError: ``x``, ``gate`` or ``up`` is not an array (a list), ``interpret`` is not a bool
        (a string such as "no" would be true), or ``tuning`` is not an :class:`MlpTuning`.
    """
    check_flag("interpret", interpret)
    tuning = MLP_TUNING if tuning is None else tuning
    if not isinstance(tuning, MlpTuning):
        raise TypeError(f"tuning={tuning!r} is invalid: must be an MlpTuning or None")
    for name, value in (("x", x), ("gate", gate), ("up", up)):
        if not isinstance(value, jax.Array):  # a tracer here: jit has turned NumPy arrays into arrays
            raise TypeError(f"swiglu: {name} has type {type(value).__name__}: expected a jax.Array or numpy.ndarray")
    if x.ndim != 2 or gate.ndim != 2 or gate.shape[0] != x.shape[1] or up.shape != gate.shape:
        raise ValueError(
            f"swiglu got x {tuple(x.shape)}, gate {tuple(gate.shape)}, up {tuple(up.shape)}: expected x [M, H] "
            "and gate, up [H, I]"
        )
    if gate.dtype != x.dtype or up.dtype != x.dtype:
        raise ValueError(f"swiglu got x {x.dtype}, gate {gate.dtype}, up {up.dtype}: must be one dtype")
    count, hidden = x.shape
    inter = gate.shape[1]
    if count < 1:
        raise ValueError(f"swiglu got x {tuple(x.shape)}: expected [M, H] with M >= 1 rows")
    if not swiglu_supported(x.dtype, hidden, inter):
        raise ValueError(f"dtype={x.dtype}, H={hidden}, I={inter} are not supported: see swiglu_supported")
    rows = min(max(16, pow2_ceil(count)), tuning.rows)
    tile, chunk = min(tuning.tile, pow2_ceil(inter)), min(tuning.chunk, pow2_ceil(hidden))  # tails masked
    kernel = functools.partial(_swiglu_kernel, rows=rows, tile=tile, chunk=chunk)
    return pl.pallas_call(
        kernel,
        grid=(pl.cdiv(count, rows), pl.cdiv(inter, tile)),  # the row blocks of a tile side by side (L2)
        in_specs=[_whole(x.shape), _whole(gate.shape), _whole(up.shape)],
        out_specs=_whole((count, inter)),
        out_shape=jax.ShapeDtypeStruct((count, inter), x.dtype),
        interpret=interpret,
        name="dspark_swiglu",
        **triton_params(tuning.warps or 4, tuning.stages, interpret),
    )(x, gate, up)


def mlp_forward(mlp: MLP, x: jax.Array, *, interpret: bool = False) -> jax.Array:
    """:class:`~dspark_jax.layers.MLP` ``mlp`` applied to ``x [B, S, H]`` with its gate and up
    projections through :func:`swiglu` (an ``mlp_fn`` of
    :meth:`~dspark_jax.layers.DecoderLayer.with_attention`); the down projection stays XLA's.

    Returns:
      ``[B, S, H]``.
    """
    b, s, h = x.shape
    gate, up = mlp.gate_proj, mlp.up_proj
    for name, proj in (("gate_proj", gate), ("up_proj", up)):
        if proj.bias is not None:
            raise ValueError(f"mlp_forward: {name} has a bias: the kernel computes bias-free projections only")
    dtype = gate.dtype or x.dtype
    kernels = [proj.kernel.get_value().astype(dtype) for proj in (gate, up)]
    hidden = swiglu(x.reshape(b * s, h).astype(dtype), *kernels, interpret=interpret)
    return mlp.down_proj(hidden.reshape(b, s, -1))
