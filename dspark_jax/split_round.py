"""A folded draft round dispatched as a few consecutive executables.

Shape legend: B batch, R query rows (γ or γ+1), H hidden, L draft layers, C capacity,
N cache slots, KVH key/value heads, D head dim.

On a GPU, XLA runs each jitted program as one CUDA graph (command buffer). Launching it
costs host time that grows with the graph's node count, and when the caller still holds
the previous round's outputs, the new outputs land at other addresses and XLA first
updates the graph's nodes (measured on the H200 host with the 8B draft: 100–540 µs of
update for a 153–181 node round, on top of the launch). The device waits for all of it:
a round's latency is that host time plus the device time.

:class:`SplitRound` runs the same maths as :func:`~dspark_jax.proposal.propose` in
pieces cut at layer boundaries: the backbone pieces (the first one embeds the block in the
graph; by default layers 0, 1 and 2 one per piece, then layers 3–4, :data:`PIECE_LAYERS`) and
``head`` (final norm, base logits, the Markov walk with in-graph sampling, confidence). The
device starts once the small first graph is launched, and the host launches the next pieces
while the device runs the earlier ones (short pieces first, so that each launch fits behind the
device work already queued: README notes 33 and 64). On GPUs each piece is compiled ahead of
time per input signature,
reads only the draft leaves it uses (:meth:`SplitRound.pruned`) and is kept with a twin called
in turn (:class:`Alternating`), so that a caller holding the previous block does not make
XLA update the pieces' graphs (without twins, on the H200, every piece's graph was updated on
every such call).
Between pieces only the ``[B, R, H]`` residual stream passes, on the device; nothing
returns to the host. Each piece is compiled once per batch shape, like the one-program
round, and the backbone pieces are shared by the greedy-only and the sampling round.

On GPUs the backbone pieces of some batches are compiled with cuBLAS GEMMs instead of XLA's
Triton ones (:func:`backbone_compile_options`, :data:`BACKBONE_GEMM_ENV`): faster there in the
round, though XLA's autotuner, which times each GEMM alone, picks Triton (README note 53).

The pieces are the pure functions :func:`~dspark_jax.proposal.backbone_stage` and
:func:`~dspark_jax.proposal.head_stage`; :func:`~dspark_jax.proposal.propose_with` chains
the same two in one program, so both forms compute the same tokens (tested; with bf16 the
logits may differ by bf16 rounding, as XLA may keep a layer's output in float32 inside one
program's fusion while between pieces it is stored in the compute dtype; where the backbone
runs cuBLAS GEMMs and the one program Triton ones, the sums' order differs too, and a near-tie
between two tokens may then go either way).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.experimental.serialize_executable import deserialize_and_load, serialize

from dspark_jax.cache import ContextCache
from dspark_jax.config import check_flag
from dspark_jax.draft import DSparkDraft, check_draft
from dspark_jax.kernel_choice import env_choice
from dspark_jax.proposal import DraftBlock, backbone_stage, check_shapes, head_stage

BACKBONE_GEMM_ENV = "DSPARK_JAX_BACKBONE_GEMM"
"""Environment variable choosing the backbone pieces' GEMMs: ``auto`` (default: cuBLAS on GPU
backends at :data:`CUBLAS_BATCHES`, XLA's choice at the others), ``xla`` (XLA's choice at every
batch: its autotuned Triton GEMMs, cuBLAS where its autotuner prefers it) or ``cublas`` (XLA's
Triton GEMMs off at every batch and backend; off GPUs the option changes nothing)."""

BACKBONE_GEMM_CHOICES = ("auto", "xla", "cublas")

CUBLAS_BATCHES = frozenset({8, 16, 64, 128})
"""The batches whose backbone pieces ``auto`` compiles with cuBLAS GEMMs. Measured on the H200
with the 8B draft (README note 53), split greedy round, cuBLAS against XLA's choice, pipelined:
−0.11, −0.09 and −0.09 to −0.12 ms per round at batches 8, 16 and 64; slower at 1, 2, 4 (+0.05
to +0.09 ms) and 32 (+0.03 to +0.04). At 128 (README note 80, two processes of 240 interleaved
calls): −0.10 and −0.13 ms pipelined, −0.04 and −0.06 waited, 0.16 ms less device time. Other
batch sizes keep XLA's choice."""


def backbone_gemm_choice() -> str:
    """The value of :data:`BACKBONE_GEMM_ENV` (``auto`` when unset).

    Raises:
      ValueError: the variable holds something else.
    """
    return env_choice(BACKBONE_GEMM_ENV, BACKBONE_GEMM_CHOICES)


def backbone_compile_options(batch: int) -> dict[str, Any] | None:
    """XLA compile options for the backbone pieces of a ``batch``-row round: Triton GEMMs off
    (``xla_gpu_enable_triton_gemm=False``, so XLA calls cuBLAS) where
    :func:`backbone_gemm_choice` asks for cuBLAS at this batch, else None (XLA's defaults)."""
    choice = backbone_gemm_choice()
    cublas = choice == "cublas" or (choice == "auto" and jax.default_backend() == "gpu" and batch in CUBLAS_BATCHES)
    return {"xla_gpu_enable_triton_gemm": False} if cublas else None


def twin_program(compiled: jax.stages.Compiled) -> jax.stages.Compiled:
    """A second, independent copy of a compiled program, without compiling again.

    The executable is serialized and loaded back: same code, its own per-executable state
    (on GPUs, its own CUDA graph).
    """
    return deserialize_and_load(*serialize(compiled))


class Alternating:
    """Calls one compiled program and its twin in turn (see :func:`twin_program`).

    Why: XLA records a CUDA graph per executable with the addresses of its buffers and
    updates the graph whenever they moved since its last launch. A caller that keeps the
    previous round's outputs while it runs the next one makes the allocator alternate
    between two sets of output (and intermediate) buffers, so a single executable sees new
    addresses, and is updated, on every call; each of two executables called in turn sees
    the same set on every call it gets. Measured on the H200 with the 8B draft at batch 1
    (XLA's verbose log): 6 graph updates per split round before, none after.

    """

    __slots__ = ("_programs", "_next")

    def __init__(self, compiled: jax.stages.Compiled, *, twin: bool | jax.stages.Compiled = True):
        """Loads the twin (unless ``twin`` is False).

        Args:
          compiled: the program.
          twin: True loads a twin of ``compiled`` (:func:`twin_program`); a compiled
            program is taken as the twin (one loaded from the same serialized executable);
            False keeps the one program (every call runs it).
        """
        if twin is True:
            twin = twin_program(compiled)
        self._programs = (compiled, twin) if twin is not False else (compiled,)
        self._next = 0

    @property
    def compiled(self) -> jax.stages.Compiled:
        """The first program (for ``memory_analysis`` and the like)."""
        return self._programs[0]

    def __call__(self, *args: Any) -> Any:
        i = self._next
        self._next = (i + 1) % len(self._programs)
        return self._programs[i](*args)


def fused_qkv(attn: Any) -> jax.Array | jax.ShapeDtypeStruct:
    """``[H, (NH + 2·KVH)·D]``: an attention module's q, k and v kernels side by side (a
    ``ShapeDtypeStruct`` for an abstract module, e.g. from ``nnx.eval_shape``)."""
    kernels = [proj.kernel.get_value() for proj in (attn.q_proj, attn.k_proj, attn.v_proj)]
    if any(isinstance(k, jax.ShapeDtypeStruct) for k in kernels):
        width = sum(k.shape[-1] for k in kernels)
        return jax.ShapeDtypeStruct((*kernels[0].shape[:-1], width), kernels[0].dtype)
    return jnp.concatenate(kernels, axis=-1)


def _read_leaves(fn: Any, leaves: list[Any], *args: Any) -> tuple[int, ...]:
    """Indices of the ``leaves`` that ``fn(leaves, *args)`` reads (from its jaxpr)."""
    jaxpr = jax.make_jaxpr(fn)(leaves, *args).jaxpr
    read = {id(v) for eqn in jaxpr.eqns for v in eqn.invars} | {id(v) for v in jaxpr.outvars}
    return tuple(i for i, v in enumerate(jaxpr.invars[: len(leaves)]) if id(v) in read)


def _signature(tree: Any) -> tuple[Any, ...]:
    """The treedef and every leaf's ``(shape, dtype, weak_type)``: what a compiled program accepts."""
    leaves, treedef = jax.tree.flatten(tree)
    return treedef, tuple((x.shape, x.dtype, getattr(x, "weak_type", False)) for x in leaves)


PIECE_LAYERS = (1, 1, 1)
"""Layers in each backbone piece but the last, which takes the remaining layers: the 8B draft's
five layers run as 1 | 1 | 1 | 2. Measured on the H200 (README note 64; greedy rounds, 750
interleaved calls per cell in each of six processes, three at batch 128), against 1 | 4: waited
medians −0.061 ms on average at batch 1, −0.037 at 8, −0.005 at 32, −0.056 at 128; back to back
+0.013–0.027 ms (two launches more)."""


def layer_ranges(num_layers: int, piece_layers: int | tuple[int, ...] = PIECE_LAYERS) -> tuple[tuple[int, int], ...]:
    """The backbone pieces' layer ranges ``(start, stop)``, covering ``[0, L)`` in order.

    Args:
      num_layers: ``L``.
      piece_layers: layers in each piece but the last, which takes the rest (an integer ``f``
        means ``(f,)``: ``[0, f)`` then ``[f, L)``); pieces past the last layer are dropped
        and the last one is cut short.

    Raises:
      ValueError: ``piece_layers`` is not an integer >= 1 or a non-empty tuple of them.
    """
    counts = (piece_layers,) if isinstance(piece_layers, int) and not isinstance(piece_layers, bool) else piece_layers
    if (
        not isinstance(counts, tuple)
        or not counts
        or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)
    ):
        raise ValueError(
            f"piece_layers={piece_layers!r} is invalid: must be an integer >= 1 or a non-empty tuple of them"
        )
    # the cut points: the counts' running sums, capped at the last layer
    cuts = sorted({0, num_layers, *(min(total, num_layers) for total in itertools.accumulate(counts))})
    return tuple(zip(cuts[:-1], cuts[1:], strict=True))


class SplitRound:
    """The folded round as backbone pieces then a head, one executable each (see the module docstring).

    Example::

        split = SplitRound(draft)
        block = split(cache, bonus, prefix_lens, temperatures, top_k, key)  # a DraftBlock
        block = split(cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling=False)

    The draft is split once at construction (later changes to the module are not seen).
    Inputs are checked for shape (as :func:`~dspark_jax.proposal.propose` does, on tracers
    too); :func:`~dspark_jax.proposal.validate_proposal_inputs` checks values on the host.
    """

    def __init__(
        self,
        draft: DSparkDraft,
        *,
        piece_layers: int | tuple[int, ...] = PIECE_LAYERS,
        twin_programs: bool | None = None,
        fuse_qkv: bool = True,
    ):
        """Splits the draft into its graph and a flat list of its arrays.

        Args:
          draft: the draft module.
          piece_layers: layers in each backbone piece but the last (:func:`layer_ranges`).
          twin_programs: compile each piece ahead of time per input signature and call it
            and its twin in turn (:class:`Alternating`), so that a caller holding the
            previous block does not make XLA update the pieces' CUDA graphs. Default: on
            GPU backends (where XLA runs command buffers), off elsewhere (plain ``jax.jit``).
          fuse_qkv: keep each layer's q/k/v kernels side by side in one array
            (:func:`fused_qkv`, made once here) and read the three projections as slices of
            it, so that XLA, which merges the three products at large batches, need not copy
            the weights together on every call (0.13 ms per round at batch 128 on the H200).
            Costs the fused arrays' memory (252 MB for the 8B draft) while the draft's own
            kernels stay alive.

        Raises:
          TypeError: ``draft`` is not a :class:`~dspark_jax.draft.DSparkDraft`, ``twin_programs``
            not a bool or None, or ``fuse_qkv`` not a bool (a string such as "no" would be true).
          ValueError: bad ``piece_layers`` (:func:`layer_ranges`).
        """
        check_draft(draft)
        check_flag("twin_programs", twin_programs, none_allowed=True)
        check_flag("fuse_qkv", fuse_qkv)
        self.twin_programs = jax.default_backend() == "gpu" if twin_programs is None else twin_programs
        # input signature -> the backbone pieces; (signature, fold_sampling) -> the head
        self._pieces: dict[Any, tuple[tuple[Alternating, list[jax.Array]], ...]] = {}
        self._heads: dict[Any, tuple[Alternating, list[jax.Array]]] = {}
        self.cfg = draft.cfg
        self.ranges = layer_ranges(draft.cfg.num_hidden_layers, piece_layers)
        self.graphdef, state = nnx.split(draft)
        # A flat list of arrays: flattening an nnx.State on every call costs host time.
        self.leaves, self._treedef = jax.tree.flatten(state)
        self._num_state = len(self.leaves)
        if fuse_qkv:
            self.leaves += [fused_qkv(layer.self_attn) for layer in draft.layers]  # [H, (NH + 2·KVH)·D] each
        # Stand-ins for the leaves a piece does not read: tracing fails loudly if it does.
        self._placeholders = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in self.leaves]
        self._kept: dict[Any, tuple[int, ...]] = {}  # piece name -> indices of the leaves it reads
        self._backbones: dict[Any, Any] = {}  # compile options -> the jitted backbone
        self._head = jax.jit(self.head, static_argnames="fold_sampling")

    def _draft(self, leaves: list[jax.Array], layers: range = range(0)) -> DSparkDraft:
        """The draft rebuilt from ``leaves``; with ``fuse_qkv`` the q/k/v kernels of the
        ``layers`` it runs are slices of their fused arrays (after the state's leaves), and
        the state's own kernels go unread."""
        draft = nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, leaves[: self._num_state]))
        fused = leaves[self._num_state :]
        for i in layers if fused else ():
            attn, start = draft.layers[i].self_attn, 0
            for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                width = proj.kernel.get_value().shape[-1]
                proj.kernel.set_value(fused[i][:, start : start + width])
                start += width
        return draft

    def kept(self, name: Any) -> tuple[int, ...]:
        """Indices of the leaves that the piece ``name`` reads (found by :meth:`pruned`)."""
        return self._kept[name]

    def pruned(self, name: Any, fn: Any, *args: Any) -> tuple[Any, list[jax.Array]]:
        """``fn(leaves, *args)`` as a function of the leaves it reads only.

        Every array argument costs the dispatch host time, used or not (jax drops unused
        ones from the executable but still parses them: about 0.4 µs each on a 2-core CPU,
        and a piece reads 10–50 of the 8B draft's ~75 leaves).

        Args:
          name: the piece's name; which leaves it reads is found once per name (by tracing
            ``fn`` to a jaxpr) and does not depend on the batch.
          fn: ``fn(leaves, *args)``, pure.
          args: example arguments (arrays or ``ShapeDtypeStruct``).

        Returns:
          ``(sub_fn, sub_leaves)``: ``sub_fn(sub_leaves, *args) == fn(self.leaves, *args)``;
          the other leaves are ``ShapeDtypeStruct`` stand-ins inside ``sub_fn``.
        """
        kept = self._kept.get(name)
        if kept is None:
            kept = self._kept[name] = _read_leaves(fn, self.leaves, *args)

        def sub_fn(sub: list[jax.Array], *rest: Any) -> Any:
            full = list(self._placeholders)
            for i, leaf in zip(kept, sub, strict=True):
                full[i] = leaf
            return fn(full, *rest)

        return sub_fn, [self.leaves[i] for i in kept]

    def backbone(
        self,
        leaves: list[jax.Array],
        x: jax.Array | None,
        cache: ContextCache,
        bonus: jax.Array,
        prefix_lens: jax.Array,
        slots: jax.Array | None,
        *,
        start: int,
        stop: int,
    ) -> jax.Array:
        """Pure: :func:`~dspark_jax.proposal.backbone_stage` over the draft rebuilt from ``leaves``.

        Returns:
          ``[B, R, H]`` the residual stream after layer ``stop − 1``.
        """
        draft = self._draft(leaves, range(start, stop))
        return backbone_stage(draft, x, cache, bonus, prefix_lens, start=start, stop=stop, slots=slots)

    def head(
        self,
        leaves: list[jax.Array],
        x: jax.Array,
        bonus: jax.Array,
        temperatures: jax.Array,
        top_k: jax.Array,
        key: jax.Array,
        *,
        fold_sampling: bool,
    ) -> DraftBlock:
        """Pure: :func:`~dspark_jax.proposal.head_stage` over the draft rebuilt from ``leaves``."""
        return head_stage(self._draft(leaves), x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling)

    def __call__(
        self,
        cache: ContextCache,
        bonus: Any,
        prefix_lens: Any,
        temperatures: Any,
        top_k: Any,
        key: Any,
        *,
        fold_sampling: bool = True,
        slots: Any = None,
    ) -> DraftBlock:
        """Dispatches the pieces back to back and returns the round's (not yet ready) block.

        Args:
          cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling, slots: as in
            :func:`~dspark_jax.proposal.propose_with`.

        Returns:
          The :class:`~dspark_jax.proposal.DraftBlock`.
        """
        # compiled programs take arrays of exactly the signature they were compiled for; lists too
        args = (bonus, prefix_lens, slots, temperatures, top_k, key)
        args = [a if a is None or isinstance(a, jax.Array) else jnp.asarray(a) for a in args]
        bonus, prefix_lens, slots, temperatures, top_k, key = args
        if not self.twin_programs:
            check_shapes(
                self.cfg, cache, bonus, prefix_lens, temperatures, top_k, key, slots=slots, fold_sampling=fold_sampling
            )
            backbone = self._jitted_backbone(backbone_compile_options(jnp.shape(bonus)[0]))
            x = None
            for start, stop in self.ranges:
                x = backbone(self.leaves, x, cache, bonus, prefix_lens, slots, start=start, stop=stop)
            return self._head(self.leaves, x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling)
        sig = _signature((cache, bonus, prefix_lens, slots, temperatures, top_k, key))
        pieces, head = self._pieces.get(sig), self._heads.get((sig, fold_sampling))
        if pieces is None or head is None:
            # a signature seen before passed these checks (they depend on shapes and dtypes only)
            check_shapes(
                self.cfg, cache, bonus, prefix_lens, temperatures, top_k, key, slots=slots, fold_sampling=fold_sampling
            )
            return self._compile_and_run(sig, cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling, slots)
        x = None
        for piece, sub in pieces:
            x = piece(sub, x, cache, bonus, prefix_lens, slots)
        head, sub = head
        return head(sub, x, bonus, temperatures, top_k, key)

    def _jitted_backbone(self, options: dict[str, Any] | None) -> Any:
        """:meth:`backbone` under ``jax.jit`` with these compile options (one per options)."""
        key = None if options is None else tuple(sorted(options.items()))
        if key not in self._backbones:
            self._backbones[key] = jax.jit(self.backbone, static_argnames=("start", "stop"), compiler_options=options)
        return self._backbones[key]

    def _compile_and_run(self, sig, cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling, slots):
        """First call with a signature (and mode): compiles what is missing, runs it."""
        pieces, x = self._pieces.get(sig), None
        compiled = []
        options = backbone_compile_options(bonus.shape[0])
        for i, (start, stop) in enumerate(self.ranges):
            if pieces is None:
                fn = functools.partial(_backbone_fn, self, start, stop)
                sub_fn, sub = self.pruned(("piece", start, stop), fn, x, cache, bonus, prefix_lens, slots)
                lowered = jax.jit(sub_fn).lower(sub, x, cache, bonus, prefix_lens, slots)
                compiled.append((Alternating(lowered.compile(compiler_options=options)), sub))
            piece, sub = (pieces or compiled)[i]
            x = piece(sub, x, cache, bonus, prefix_lens, slots)
        if pieces is None:
            self._pieces[sig] = tuple(compiled)
        head = self._heads.get((sig, fold_sampling))
        if head is None:
            fn = functools.partial(_head_fn, self, fold_sampling)
            sub_fn, sub = self.pruned(("head", fold_sampling), fn, x, bonus, temperatures, top_k, key)
            lowered = jax.jit(sub_fn).lower(sub, x, bonus, temperatures, top_k, key)
            head = self._heads[sig, fold_sampling] = (Alternating(lowered.compile()), sub)
        head, sub = head
        return head(sub, x, bonus, temperatures, top_k, key)


def _backbone_fn(split: SplitRound, start: int, stop: int, leaves, x, cache, bonus, prefix_lens, slots):
    return split.backbone(leaves, x, cache, bonus, prefix_lens, slots, start=start, stop=stop)


def _head_fn(split: SplitRound, fold_sampling: bool, leaves, x, bonus, temperatures, top_k, key):
    return split.head(leaves, x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling)
