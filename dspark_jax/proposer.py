"""Serving wrapper: batch buckets, ahead-of-time compilation and the memory gate.

Shape legend: B rows of a call, Bp its bucket (power of two, or ``max_batch``), S request
slots of the context cache, C capacity, L draft layers, KVH key/value heads, D head dim,
γ draft slots, V vocabulary.

:class:`Proposer` plays the role of CUDA-graph capture in sglang: :meth:`Proposer.precompile`
compiles every program a (bucket, mode) round needs with ``jax.jit(...).lower(...).compile()``
and keeps them, so serving calls never trace or compile again. A round is dispatched as the
pieces of :class:`~dspark_jax.split_round.SplitRound` (the backbone in two pieces, shared by
both modes, then the mode's head), so the device starts while the host still launches the
later pieces. Modes:

* greedy-only folded (every batch whose rows are all greedy);
* sampling folded (batches with a sampling row), when the memory gate allows it
  (:mod:`dspark_jax.memory_gate`, which compares the two heads' memory); otherwise sampling
  batches run the eager path (:func:`dspark_jax.proposal.run_eager`), which ``precompile``
  warms per bucket.

A call's per-row inputs (slots, bonus tokens, context lengths, temperatures, top-k, keys)
travel to the device packed in one array: one host-to-device copy per call; inputs already
on the device (a serving loop's next anchor tokens) are packed there, by the first backbone
piece itself (its device-input form, built by ``precompile`` or at a bucket's first such
call), and read back for the checks only after the round is launched.

Context cache and buckets: the cache holds ``S`` request slots (``[L, S, C, KVH, D]``,
fixed at construction) and a call names the slot of each row (``slots [B]``, default
``0..B−1``). The compiled round passes the slots to the draft, so any subset of requests
can be drafted together: on GPUs the attention kernel reads those rows in place; the XLA
path (CPUs, float32 caches) gathers them, copying ``2·L·Bp·C·KVH·D·itemsize`` bytes per
round. Padded rows read slot 0 with
``prefix_len = 0``, bonus 0 and greedy settings; every row's computation is independent
of the others, so padding never changes the real rows, which are sliced back out with
precompiled slicers.

Persistent compilation cache (survives restarts; set it before the first compile)::

    jax.config.update("jax_compilation_cache_dir", "/path/to/jax_cache")
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)  # cache every entry
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

With it, a restarted server's ``precompile()`` loads executables instead of compiling
them. jax still traces and lowers a program to look it up in that cache, so the Proposer
also keeps its compiled programs in an :class:`~dspark_jax.executable_store.ExecutableStore`
(by default the ``dspark_jax`` folder of that directory), keyed without tracing: a restart
loads them back with no tracing, lowering or compiling (:class:`CompileCounter` counts
nothing; the store's ``hits`` count them).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import warnings
from collections.abc import Callable, Container, Iterable, Iterator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.cache import ContextCache, resolve_cache_dtype
from dspark_jax.config import check_flag, positive_int
from dspark_jax.draft import DSparkDraft, check_draft
from dspark_jax.executable_store import ExecutableStore, default_directory
from dspark_jax.memory_gate import (
    GIB,
    FoldedSampling,
    GateDecision,
    force_hint,
    plan_folded_sampling,
    sampling_extra_bytes,
)
from dspark_jax.packed_inputs import (
    BONUS_COL,
    CALL_ARGS,
    INT_COLUMNS,
    KEY_COL,
    PREFIX_COL,
    SLOT_COL,
    TOP_K_COL,
    call_inputs,
    check_mode,
    fetched,
    pack_on_device,
    pack_on_host,
    row_ints,
    sampling_rows,
    unpack,
)
from dspark_jax.proposal import DraftBlock, run_eager, validate_proposal_inputs
from dspark_jax.race_kernel import use_race_kernel
from dspark_jax.sampling import TOP_K_ALL, TOP_K_MAX, key_rows
from dspark_jax.split_round import Alternating, SplitRound, backbone_compile_options

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_LOWERING = "/jax/core/compile/jaxpr_to_mlir_module_duration"
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts XLA compilations while active (a context manager).

    Listens to public ``jax.monitoring`` events: ``backend_compiles`` counts executables
    built (``/jax/core/compile/backend_compile_duration`` wraps both an XLA compile and a
    load from the persistent compilation cache), ``cache_hits`` how many of those were
    loads, and ``lowerings`` every jaxpr lowered to MLIR (each jit cache miss lowers).

    Example::

        with CompileCounter() as counter:
            proposer(cache, bonus, prefix_lens, temps, top_k, key)
        assert counter.count == 0
    """

    def __init__(self):
        self.backend_compiles = 0
        self.cache_hits = 0
        self.lowerings = 0

    @property
    def count(self) -> int:
        """Executables built or loaded from the persistent cache."""
        return self.backend_compiles

    def _on_duration(self, event: str, duration: float, **kwargs: Any) -> None:
        del duration, kwargs
        if event == _BACKEND_COMPILE:
            self.backend_compiles += 1
        elif event == _LOWERING:
            self.lowerings += 1

    def _on_event(self, event: str, **kwargs: Any) -> None:
        del kwargs
        if event == _CACHE_HIT:
            self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._on_duration)
        jax.monitoring.register_event_listener(self._on_event)
        return self

    def __exit__(self, *exc: Any) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_duration)
        jax.monitoring.unregister_event_listener(self._on_event)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """``(1, 2, 4, …, max_batch)``: powers of two below ``max_batch``, then ``max_batch``.

    Raises:
      ValueError: ``max_batch`` is not an integer >= 1 (a Python or NumPy integer).
    """
    max_batch = positive_int("max_batch", max_batch)
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def _gather(cache: ContextCache, slots: jax.Array) -> ContextCache:
    return ContextCache(k=cache.k[:, slots], v=cache.v[:, slots])  # [L, Bp, C, KVH, D]


_LEAFLESS = ("slicer",)  # programs that read none of the draft's leaves


def _backbone_piece(split: SplitRound, limits: tuple[int, ...], start: int, stop: int, leaves, x, cache, packed):
    """A backbone piece; the first (``start == 0``) also returns ``packed``, so that it is
    copied to the device once, by the first launch, for the later pieces."""
    # The slots go to the draft, not through a gather: the GPU attention kernel reads the
    # requests' context where it lies (the XLA path gathers inside the draft).
    ints = row_ints(packed, limits)
    bonus, prefix_lens, slots = ints[:, BONUS_COL], ints[:, PREFIX_COL], ints[:, SLOT_COL]
    x = split.backbone(leaves, x, cache, bonus, prefix_lens, slots, start=start, stop=stop)
    return (x, packed) if start == 0 else x


def _front_piece(split: SplitRound, limits: tuple[int, ...], stop: int, width: int, leaves, cache, *rows):
    """The first backbone piece of device inputs (README note 62): packs ``rows`` =
    ``(bonus, prefix_lens, temperatures, top_k, slots)`` (``[Bp]`` each, ``slots`` None for
    ``0..Bp−1``) in-graph as :func:`pack_on_device` does, then runs as
    :func:`_backbone_piece` with ``start == 0`` (returns ``(x, packed)``)."""
    packed = pack_on_device(rows[0].shape[0], width, *rows, None)
    return _backbone_piece(split, limits, 0, stop, leaves, None, cache, packed)


class _Front(NamedTuple):
    """A call's per-row inputs on the device, bucket-sized int32 (float32 temperatures),
    for a front program (:func:`_front_piece`) to pack: what ``Proposer._folded_round``
    takes in place of packed inputs."""

    bonus: jax.Array
    prefix_lens: jax.Array
    temperatures: jax.Array
    top_k: jax.Array
    slots: jax.Array | None

    def name(self, bucket: int) -> tuple[Any, ...]:
        return ("front", bucket, self.slots is not None)


def _head_piece(split: SplitRound, limits: tuple[int, ...], fold_sampling: bool, leaves, x, packed, key):
    inp = unpack(limits, packed, key)
    return split.head(
        leaves,
        x,
        inp["bonus"],
        inp["temperatures"],
        inp["top_k"],
        inp["keys"],
        fold_sampling=fold_sampling,
    )


def _eager_inputs(limits, cache, packed, key):
    inp = unpack(limits, packed, key)
    return _gather(cache, inp["slots"]), inp


def _unpad(rows, block):
    return jax.tree.map(lambda x: x[:rows], block)


def _leaves_name(name: tuple[Any, ...]) -> tuple[Any, ...]:
    """A round program's name → the name of the draft leaves it reads (shared by buckets)."""
    if name[0] == "front":
        return ("front",)
    return ("piece", *name[2:]) if name[0] == "piece" else ("head", name[2])


def _call(program: Callable[..., Any], *args: Any) -> Any:
    return program(*args)


class _Compiles:
    """Compiles lowered programs, ``workers`` at a time, and installs them on the calling thread.

    With one worker each program is compiled when it is submitted. With more, a thread pool
    compiles (XLA compiles outside the GIL) while the calling thread goes on lowering: the
    submitted iterators lower each program only when reached (:meth:`Proposer._jobs`).
    Leaving the ``with`` block installs everything still pending (or, on an error, cancels
    what has not started).
    """

    def __init__(self, install: Callable[[tuple[Any, ...], jax.stages.Compiled], None], workers: int):
        self._install = install
        self._pool = concurrent.futures.ThreadPoolExecutor(workers) if workers > 1 else None
        self._pending: dict[tuple[Any, ...], concurrent.futures.Future] = {}

    @property
    def pending(self) -> Container[tuple[Any, ...]]:
        """Names submitted and not installed yet."""
        return self._pending.keys()

    def submit(self, jobs: Iterable[tuple[tuple[Any, ...], Callable[[], jax.stages.Compiled]]]) -> None:
        """Compiles each job (``(name, compile)``: ``compile()`` returns the program)."""
        for name, compile_program in jobs:
            if self._pool is None:
                self._install(name, compile_program())
            else:
                self._pending[name] = self._pool.submit(compile_program)

    def finish(self, names: Iterable[tuple[Any, ...]] | None = None) -> None:
        """Installs ``names`` (default: every pending program) once compiled; names not
        pending (installed already, or loaded from the store) are skipped."""
        for name in list(self._pending) if names is None else names:
            future = self._pending.pop(name, None)
            if future is not None:
                self._install(name, future.result())

    def __enter__(self) -> _Compiles:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        try:
            if exc_type is None:
                self.finish()
        finally:
            if self._pool is not None:
                for future in self._pending.values():
                    future.cancel()
                self._pool.shutdown(wait=True)


class Proposer:
    """Drafts batches of any size up to ``max_batch`` with precompiled executables.

    Example::

        proposer = Proposer(draft, max_batch=8, capacity=1024)
        proposer.precompile()                      # every bucket and mode, once
        block = proposer(cache, bonus, prefix_lens, temperatures, top_k, key, slots=slots)
        proposer.gate                              # the memory gate's decision and numbers
    """

    def __init__(
        self,
        draft: DSparkDraft,
        *,
        max_batch: int,
        capacity: int,
        num_slots: int | None = None,
        cache_dtype: Any = None,
        folded_sampling: FoldedSampling | str | None = None,
        free_bytes: int | None = None,
        headroom: int = GIB,
        unpad: bool = True,
        twin_programs: bool | None = None,
        executable_store: str | os.PathLike[str] | bool | None = None,
    ):
        """Splits the draft and plans the gate (closed form; refined by ``precompile``).

        Args:
          draft: the draft module (split once; later changes to it are not seen).
          max_batch: the largest batch (a Python or NumPy integer, as are ``capacity`` and
            ``num_slots``).
          capacity: ``C``, positions per cache slot.
          num_slots: ``S``, request slots of the cache (default ``max_batch``); a call
            without ``slots`` drafts slots ``0..B−1``, so it needs ``B <= S``.
          cache_dtype: the cache's floating dtype (default the draft's compute dtype).
          folded_sampling: gate mode; None reads ``DSPARK_JAX_FOLDED_SAMPLING`` (default AUTO).
          free_bytes: free memory for the gate; measured when None.
          headroom: bytes the gate keeps free.
          unpad: slice results back to ``B`` rows (one small precompiled slicer per row
            count); False returns the bucket's ``Bp`` rows (rows ``>= B`` are padding) and
            compiles no slicers, for callers that keep bucket shapes through verify.
          twin_programs: keep a twin of every round program and call the two in turn
            (:class:`~dspark_jax.split_round.Alternating`: no CUDA-graph update while the
            caller holds the previous block). Default: on GPU backends.
          executable_store: a directory where compiled programs are saved and loaded back
            without tracing or lowering (:mod:`dspark_jax.executable_store`); None (default)
            uses ``dspark_jax`` inside jax's persistent compilation cache directory when
            that is set at the first compile; False keeps none.

        Raises:
          ValueError: bad ``max_batch``, ``capacity`` or ``num_slots``, an unknown
            ``folded_sampling``, a ``free_bytes`` neither None nor an integer >= 0, or a
            ``headroom`` not an integer >= 0 (:func:`~dspark_jax.memory_gate.plan_folded_sampling`),
            or a float64 ``cache_dtype`` while jax's x64 mode is off.
          TypeError: ``draft`` is not a :class:`~dspark_jax.draft.DSparkDraft`,
            ``executable_store`` not a path, None or False, ``cache_dtype`` not a floating
            dtype, or ``unpad`` / ``twin_programs`` not a bool (a string such as "no" would be
            true).
        """
        check_draft(draft)
        if executable_store is True or not (
            executable_store is None or executable_store is False or isinstance(executable_store, str | os.PathLike)
        ):
            raise TypeError(
                f"executable_store={executable_store!r} is invalid: must be a directory path, None (follow jax's "
                "compilation cache directory) or False (none)"
            )
        # A file where the store should be is named here, not at the first precompile.
        if isinstance(executable_store, str | os.PathLike) and os.path.isfile(executable_store):
            raise ValueError(f"executable_store={os.fspath(executable_store)!r} is invalid: it is not a directory")
        check_flag("unpad", unpad)
        check_flag("twin_programs", twin_programs, none_allowed=True)
        self._store_directory = executable_store
        self.twin_programs = jax.default_backend() == "gpu" if twin_programs is None else twin_programs
        self.cfg = draft.cfg
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        capacity = positive_int("capacity", capacity)
        num_slots = self.max_batch if num_slots is None else positive_int("num_slots", num_slots)
        if capacity < self.cfg.gamma:
            raise ValueError(f"capacity={capacity} is too small: must be >= gamma={self.cfg.gamma}")
        cfg = self.cfg
        self.cache_shape = (cfg.num_hidden_layers, num_slots, capacity, cfg.num_key_value_heads, cfg.head_dim)
        self.cache_dtype = resolve_cache_dtype(cfg, cache_dtype, name="cache_dtype")
        self.graphdef, self.state = nnx.split(draft)
        self._split = SplitRound(draft)
        self._free_bytes = free_bytes
        self._headroom = headroom
        self.unpad = unpad
        self._warned = False
        self._force_hint = force_hint(folded_sampling)  # the warning's advice (see _set_gate)
        # ("piece", bucket, start, stop): a backbone piece; ("head", bucket, sampling): a head;
        # ("front", bucket, slots given): the first piece of device inputs (see _Front).
        self._programs: dict[tuple[Any, ...], Alternating] = {}
        # ("piece", start, stop) / ("head", sampling) / ("front",): the leaves that program reads
        self._sub_leaves: dict[tuple[Any, ...], list[jax.Array]] = {}
        self._eager: dict[int, jax.stages.Compiled] = {}  # bucket -> the eager path's input gather
        self._slicers: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._last_mode: tuple[jax.Array, jax.Array, bool] | None = None  # see _mode_of
        self._set_gate(plan_folded_sampling(folded_sampling, **self._gate_kwargs()))

    # ----------------------------------------------------------------- gate
    def _gate_kwargs(self) -> dict[str, Any]:
        # The compiled race kernel (GPUs, with a Markov head) draws the noise in registers.
        kernel, interpret = use_race_kernel(self.cfg.vocab_size)
        in_registers = self.cfg.markov_rank > 0 and kernel and not interpret
        return dict(
            max_batch=self.max_batch,
            gamma=self.cfg.gamma,
            vocab=self.cfg.vocab_size,
            logits_itemsize=jnp.dtype(self.cfg.jnp_dtype).itemsize,  # kept in the model dtype
            noise_itemsize=0 if in_registers else 4,
            free_bytes=self._free_bytes,
            headroom=self._headroom,
        )

    def _set_gate(self, gate: GateDecision) -> None:
        self.gate = gate
        if gate.mode is FoldedSampling.AUTO and not gate.enabled and not self._warned:
            self._warned = True
            warnings.warn(
                f"dspark_jax: folded sampling disabled ({gate.reason}); sampling batches take the "
                f"eager path: {self._force_hint} to fold them anyway.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------ compiling
    def _packed_spec(self, bucket: int) -> jax.ShapeDtypeStruct:
        """Abstract packed per-row inputs ``[Bp, 6 + n]`` (see :meth:`_pack_inputs`)."""
        return jax.ShapeDtypeStruct((bucket, self._width), jnp.uint32)

    @functools.cached_property
    def _key_spec(self) -> jax.ShapeDtypeStruct:
        return jax.eval_shape(lambda: jax.random.key(0))

    def _cache_spec(self) -> ContextCache:
        cache = jax.ShapeDtypeStruct(self.cache_shape, self.cache_dtype)
        return ContextCache(k=cache, v=cache)

    @functools.cached_property
    def store(self) -> ExecutableStore | None:
        """The executable store (None without one), resolved at the first compile (see
        ``executable_store``); its ``hits``, ``misses`` and ``saves`` count loads and writes."""
        directory = default_directory() if self._store_directory is None else self._store_directory
        return None if directory is None or directory is False else ExecutableStore(directory)

    @functools.cached_property
    def _store_parts(self) -> tuple[Any, ...]:
        """What every program of this Proposer depends on besides its name (store keys)."""
        leaves = tuple((x.shape, str(x.dtype), getattr(x, "weak_type", False)) for x in self._split.leaves)
        state = repr(jax.tree.structure(self.state))
        return repr(self.cfg), self.cache_shape, str(self.cache_dtype), repr(self._key_spec), state, leaves

    def _load(self, name: tuple[Any, ...]) -> jax.stages.Compiled | Alternating | None:
        """The program ``name`` from the executable store (an :class:`Alternating` for round
        programs, whose leaves it also sets), or None."""
        if self.store is None:
            return None
        leafless = name[0] in _LEAFLESS
        copies = 2 if self.twin_programs and not leafless else 1
        got = self.store.load(self.store.key(name, self._store_parts), copies=copies)
        if got is None:
            return None
        programs, kept = got
        if leafless:
            return programs[0]
        self._sub_leaves[_leaves_name(name)] = [self._split.leaves[i] for i in kept]
        return Alternating(programs[0], twin=programs[1] if self.twin_programs else False)

    def _install(self, name: tuple[Any, ...], compiled: jax.stages.Compiled) -> None:
        """Keeps a freshly compiled program (and saves it in the executable store)."""
        leafless = name[0] in _LEAFLESS
        if self.store is not None:
            kept = None if leafless else self._split.kept(_leaves_name(name))
            self.store.save(self.store.key(name, self._store_parts), compiled, extra=kept)
        if name[0] == "slicer":
            self._slicers[name[1], name[3]] = compiled
        else:
            self._programs[name] = Alternating(compiled, twin=self.twin_programs)

    def _jobs(
        self, bucket: int, sampling: bool, skip: Container[tuple[Any, ...]] = ()
    ) -> Iterator[tuple[tuple[Any, ...], Callable[[], jax.stages.Compiled]]]:
        """The programs a (bucket, mode) round needs, has not and ``skip`` does not hold, as
        ``(name, compile)``, each lowered only when the iterator reaches it (so a compile pool
        can compile one while the next is lowered); the backbone pieces compile with
        :func:`~dspark_jax.split_round.backbone_compile_options`.

        A round is the backbone pieces of :class:`~dspark_jax.split_round.SplitRound`
        (shared by both modes) and the mode's head. Programs found in the executable store
        are installed instead (not lowered).
        """
        cfg = self.cfg
        hidden = jax.ShapeDtypeStruct((bucket, cfg.num_query_rows, cfg.hidden_size), cfg.jnp_dtype)
        names = [("piece", bucket, start, stop) for start, stop in self._split.ranges] + [("head", bucket, sampling)]
        for name in names:
            if name in skip:
                continue
            if name[0] == "piece":
                start, stop = name[2:]
                fn = functools.partial(_backbone_piece, self._split, self._limits, start, stop)
                args = (None if start == 0 else hidden, self._cache_spec(), self._packed_spec(bucket))
                job = self._round_job(name, fn, args, backbone_compile_options(bucket))
            else:
                fn = functools.partial(_head_piece, self._split, self._limits, sampling)
                job = self._round_job(name, fn, (hidden, self._packed_spec(bucket), self._key_spec), None)
            if job is not None:
                yield job

    def _round_job(
        self, name: tuple[Any, ...], fn: Callable[..., Any], args: tuple[Any, ...], options: dict[str, Any] | None
    ) -> tuple[tuple[Any, ...], Callable[[], jax.stages.Compiled]] | None:
        """``(name, compile)`` of the round program ``fn(leaves, *args)`` (a backbone piece,
        a front or a head), lowered now over the leaves it reads and compiled with
        ``options``; None where it is compiled already or was found in the executable store
        (then installed)."""
        if name in self._programs:
            return None
        loaded = self._load(name)
        if loaded is not None:
            self._programs[name] = loaded
            return None
        fn, sub = self._split.pruned(_leaves_name(name), fn, *args)
        self._sub_leaves[_leaves_name(name)] = sub
        return name, functools.partial(jax.jit(fn).lower(sub, *args).compile, compiler_options=options)

    def _compile_folded(self, bucket: int, sampling: bool) -> None:
        """Compiles (or loads) what the (bucket, mode) round still lacks."""
        with _Compiles(self._install, 1) as compiles:
            compiles.submit(self._jobs(bucket, sampling))

    def _slicer_name(self, rows: int, sampling: bool) -> tuple[Any, ...]:
        return ("slicer", rows, self.bucket(rows), sampling)

    def _lower_slicer(self, rows: int, sampling: bool) -> jax.stages.Lowered:
        bucket, cfg = self.bucket(rows), self.cfg
        conf = cfg.gamma if cfg.enable_confidence_head else 0
        vocab = cfg.vocab_size if sampling else 0  # the corrected logits, kept in the model dtype
        block = DraftBlock(
            draft_tokens=jax.ShapeDtypeStruct((bucket, cfg.gamma), jnp.int32),
            corrected_logits=jax.ShapeDtypeStruct((bucket, cfg.gamma, vocab), cfg.jnp_dtype),
            greedy_mask=jax.ShapeDtypeStruct((bucket,), jnp.bool_),
            temperatures=jax.ShapeDtypeStruct((bucket,), jnp.float32),
            confidence=jax.ShapeDtypeStruct((bucket, conf), jnp.float32),
        )
        return jax.jit(functools.partial(_unpad, rows)).lower(block)

    def _slicer_jobs(
        self, rows: int, sampling: bool
    ) -> Iterator[tuple[tuple[Any, ...], Callable[[], jax.stages.Compiled]]]:
        """The slicer to ``rows`` rows, lowered when reached, unless it is compiled or in the store."""
        if (rows, sampling) in self._slicers:
            return
        name = self._slicer_name(rows, sampling)
        loaded = self._load(name)
        if loaded is not None:
            self._slicers[rows, sampling] = loaded
            return
        yield name, self._lower_slicer(rows, sampling).compile

    def _compile_slicer(self, rows: int, sampling: bool) -> jax.stages.Compiled:
        with _Compiles(self._install, 1) as compiles:
            compiles.submit(self._slicer_jobs(rows, sampling))
        return self._slicers[rows, sampling]

    def _warm_eager(self, bucket: int) -> None:
        """Compiles the eager path at ``bucket``: its input gather ahead of time, and its
        jitted stages by running them once on zeros of the gathered rows' shape."""
        if bucket in self._eager:
            return
        gather = jax.jit(functools.partial(_eager_inputs, self._limits))
        gather = gather.lower(self._cache_spec(), self._packed_spec(bucket), self._key_spec).compile()
        rows_shape = (self.cache_shape[0], bucket, *self.cache_shape[2:])  # [L, Bp, C, KVH, D]
        rows = ContextCache(k=jnp.zeros(rows_shape, self.cache_dtype), v=jnp.zeros(rows_shape, self.cache_dtype))
        ints = np.zeros((bucket, 4), np.int64)  # slot, bonus, prefix_len 0; no top-k
        ints[:, TOP_K_COL] = TOP_K_ALL
        packed, key = self._pack_inputs(bucket, ints, np.ones(bucket, np.float32), jax.random.key(0))
        self._eager_round(rows, jax.jit(functools.partial(unpack, self._limits))(packed, key))
        self._eager[bucket] = gather

    def _eager_round(self, rows: ContextCache, inp: dict[str, jax.Array]) -> DraftBlock:
        """The eager path over gathered cache rows and unpacked inputs (see :func:`unpack`)."""
        return run_eager(
            self.graphdef,
            self.state,
            rows,
            inp["bonus"],
            inp["prefix_lens"],
            inp["temperatures"],
            inp["top_k"],
            inp["keys"],
        )

    def precompile(self, *, workers: int | None = None) -> GateDecision:
        """Compiles every (bucket, mode), the first pieces of device inputs and the slicers;
        decides the gate with XLA's numbers.

        Programs already in the executable store (see ``executable_store``) are loaded
        instead, and the ones compiled here are saved there.

        Order: the largest bucket's greedy round, then (unless the gate is already closed:
        OFF, or AUTO short of memory by the closed form) its sampling head, whose memory
        analysis (minus the greedy-only head's) refines the gate; then every other bucket's
        backbone pieces and greedy-only head, largest first (the longest compiles start
        first). When the gate allows it, the sampling heads of every bucket follow; then the
        first pieces of device inputs (:meth:`_front_jobs`) and the slicers; where the gate is closed the
        eager path is warmed per bucket at the end. With several workers this thread
        lowers each program while the pool compiles the earlier ones, and waits only for the
        gate's programs before the sampling heads.

        Args:
          workers: programs compiled concurrently from a thread pool (XLA compiles outside
            the GIL). Default: 1 on the CPU backend (on a 2-core box 2 workers took 23.0 s
            against 17.6 s with 1), else ``min(8, cpu_count)`` (on the H200 host 8 workers
            brought the 8B draft's cold precompile from 106 s to 49 s; 49.4 s with the split
            round's pieces).

        Returns:
          The gate decision (also ``self.gate``).

        Raises:
          ValueError: ``workers`` is neither None nor an integer >= 1.
        """
        if workers is None:
            workers = 1 if jax.default_backend() == "cpu" else min(8, os.cpu_count() or 1)
        else:
            workers = positive_int("workers", workers)
        order = sorted(self.buckets, reverse=True)
        top = order[0]
        # The gate compares the larger estimate, so XLA's can only matter when the closed form fits.
        measure = self.gate.mode is FoldedSampling.FORCE or self.gate.enabled
        with _Compiles(self._install, workers) as compiles:
            compiles.submit(self._jobs(top, False))
            if measure:
                compiles.submit(self._jobs(top, True, compiles.pending))
            for bucket in order[1:]:
                compiles.submit(self._jobs(bucket, False, compiles.pending))
            if measure:
                heads = [("head", top, True), ("head", top, False)]
                pieces = [("piece", top, start, stop) for start, stop in self._split.ranges]
                compiles.finish(heads + pieces)
                # The backbone pieces are shared: the heads alone differ between the modes.
                extra = sampling_extra_bytes(
                    *(self._programs[name].compiled for name in heads),
                    tuple(self._programs[name].compiled for name in pieces),
                )
                self._set_gate(plan_folded_sampling(self.gate.mode, compiled_bytes=extra, **self._gate_kwargs()))
                if not self.gate.enabled:
                    del self._programs["head", top, True]
            for bucket in order if self.gate.enabled else ():
                compiles.submit(self._jobs(bucket, True, compiles.pending))
            for bucket in order:
                compiles.submit(self._front_jobs(bucket))
            for rows in range(1, self.max_batch + 1) if self.unpad else ():
                for sampling in (False, True) if rows != self.bucket(rows) else ():
                    compiles.submit(self._slicer_jobs(rows, sampling))
        if not self.gate.enabled:
            for bucket in self.buckets:
                self._warm_eager(bucket)
        return self.gate

    # -------------------------------------------------------------- serving
    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows``."""
        return next(b for b in self.buckets if b >= rows)

    def _pack_inputs(self, bucket: int, ints: np.ndarray, temps: np.ndarray, key: Any) -> tuple[np.ndarray, jax.Array]:
        """:func:`~dspark_jax.packed_inputs.pack_on_host` of a call's checked-later inputs
        (``ints [B, 4]``, ``temps [B]`` as :func:`~dspark_jax.packed_inputs.host_inputs`
        gives them; values outside ``[0, 2³²)`` wrap, which ``_check`` refuses).

        Returns:
          ``(packed, key)``: ``key`` is the call's one typed key (row ``b`` samples with
          ``fold_in(key, b)``), passed to the round as it is, so a key already on the device
          is never copied back to the host; with per-row keys it is a placeholder and the
          keys' data travel in ``packed`` (read on the host: it waits for them).
        """
        row_keys, key = self._round_key(key)
        return pack_on_host(bucket, self._width, ints, temps, row_keys), key

    def _round_key(self, key: Any) -> tuple[Any, jax.Array]:
        """A call's key → ``(per-row keys or None, the typed key the round takes)``: one key
        passes as it is (raw data wrapped); per-row keys (typed ``[B]`` or raw ``[B, n]``, as
        given) travel in the packed inputs and the round gets a placeholder."""
        typed = jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
        if np.ndim(key) == (0 if typed else 1):  # one key for the whole batch
            return None, key if typed else jax.random.wrap_key_data(key)
        return key, self._placeholder_key

    @functools.cached_property
    def _placeholder_key(self) -> jax.Array:
        return jax.random.key(0)

    @functools.cached_property
    def _width(self) -> int:
        """``6 + n``: the packed inputs' columns, ``n`` the words of a raw key."""
        return KEY_COL + int(jax.random.key_data(jax.random.key(0)).shape[-1])

    def _program(self, name: tuple[Any, ...]) -> Alternating:
        if name not in self._programs:
            self._compile_folded(name[1], name[2] if name[0] == "head" else False)
        return self._programs[name]

    def _run_eager(self, bucket, cache, packed, key):
        self._warm_eager(bucket)
        return self._eager_round(*self._eager[bucket](cache, packed, key))

    def __call__(
        self,
        cache: ContextCache,
        bonus: Any,
        prefix_lens: Any,
        temperatures: Any,
        top_k: Any,
        key: Any,
        *,
        slots: Any = None,
        sampling: bool | None = None,
    ) -> DraftBlock:
        """Checks, pads to the bucket, runs the precompiled round and unpads.

        The inputs are packed and the precompiled round launched first; shapes, dtypes, the
        cache, the key and every value are checked while it runs, so a bad call raises before
        any result is returned and its round is dropped (README note 58). Inputs the packing
        cannot take, the eager path and programs not yet compiled are checked first.

        Inputs already on the device (``bonus`` a ``jax.Array``, as a serving loop gets it
        from verification) are packed there, by the round's first piece where they are
        bucket-sized int32 / float32 with one key, so the call neither waits for them nor
        copies them through the host before the round is launched; they are read back to be
        checked after the launch (README notes 59, 62). Pass
        ``sampling`` with them to skip reading the temperatures and top-k before the launch.

        Args:
          cache: the context cache ``[L, S, C, KVH, D]`` (the shape and dtype given at
            construction).
          bonus: ``[B]`` int anchor tokens, ``B <= max_batch``.
          prefix_lens: ``[B]`` int context lengths.
          temperatures: ``[B]`` float (0 = greedy; read in float32, so a positive one below
            float32's smallest, 1.4e-45, is 0 too).
          top_k: ``[B]`` int (``<= 1`` = greedy).
          key: one PRNG key (typed or raw) or per-row keys ``[B]``.
          slots: ``[B]`` cache slot of each row (default ``0..B−1``, which needs
            ``B <= num_slots``).
          sampling: which round to run: True the sampling-capable one (also right for
            greedy rows), False the greedy-only one (a sampling row is then refused), None
            (default) decided from the rows.

        Returns:
          The :class:`~dspark_jax.proposal.DraftBlock` of the ``B`` rows (of the bucket's
          ``Bp`` rows when ``unpad=False``).

        Raises:
          ValueError, TypeError: bad inputs (see :func:`~dspark_jax.proposal.validate_proposal_inputs`),
            a cache of another shape or dtype than this Proposer's, more rows than
            ``num_slots`` without ``slots``, ``sampling`` not a bool or None, or
            ``sampling=False`` with a sampling row.
        """
        if sampling is not None and not isinstance(sampling, bool | np.bool_):
            raise TypeError(f"sampling={sampling!r} is invalid: must be True, False or None (decided from the rows)")
        sampling = None if sampling is None else bool(sampling)
        args = (cache, bonus, prefix_lens, temperatures, top_k, key, slots)
        named = (*zip(CALL_ARGS, args, strict=True), *(("cache", getattr(cache, part, None)) for part in "kv"))
        traced = sorted({name for name, a in named if isinstance(a, jax.core.Tracer)})
        if traced:
            raise TypeError(
                f"Proposer was called with traced {', '.join(traced)} (inside jax.jit, vmap or grad): "
                "it runs precompiled programs from the host; call dspark_jax.propose in traced code instead"
            )
        if isinstance(bonus, jax.Array):
            block = self._device_call(args, sampling)
            if block is not None:
                return block
            args = fetched(args)  # the host path checks them first and names what is wrong
        try:
            rows, ints, temps = call_inputs(args)
            bucket = self.bucket(rows)  # StopIteration above max_batch
            packed, key = self._pack_inputs(bucket, ints, temps, args[5])
        except Exception:  # inputs the packing cannot take: the checks name the field
            self._check(args, None, None)
            raise
        rows_sample = bool(sampling_rows(ints[:, TOP_K_COL], temps).any())
        if sampling is False and rows_sample:
            self._check(args, ints, temps)
            check_mode(False, ints, temps)
        sampling = rows_sample if sampling is None else sampling
        eager = sampling and not self.gate.enabled
        if eager or not self._ready(bucket, sampling):
            self._check(args, ints, temps)  # before the eager path or any compile
            run = self._run_eager if eager else functools.partial(self._folded_round, sampling=sampling)
            block = run(bucket, cache, packed, key)
        else:
            try:
                block = self._folded_round(bucket, cache, packed, key, sampling)
            except TypeError:  # a cache the programs do not take
                self._check(args, ints, temps)
                raise
            self._check(args, ints, temps)  # while the device runs (note 58)
        return self._unpadded(rows, bucket, sampling, block)

    def _device_call(self, args: tuple[Any, ...], sampling: bool | None) -> DraftBlock | None:
        """The round of inputs already on the device (README notes 59 and 62), or None where
        the host path must take the call: the eager path, programs not yet compiled, inputs
        no front program takes (other row counts or dtypes, per-row keys: packed on the host,
        since packing them on the device would compile while serving), or inputs the host
        path refuses, naming the field."""
        cache, bonus, prefix_lens, temperatures, top_k, key, slots = args
        try:
            bucket = self.bucket(bonus.shape[0])
            if sampling is None:
                sampling = self._mode_of(temperatures, top_k)
            if (sampling and not self.gate.enabled) or not self._ready(bucket, sampling):
                return None
            row_keys, round_key = self._round_key(key)
            inputs = _Front(bonus, prefix_lens, temperatures, top_k, slots)
            if row_keys is not None or not self._front_takes(bucket, inputs):
                return None  # packed on the host instead: nothing compiles while serving
        except Exception:  # the host path raises what is wrong, naming the field
            return None
        if inputs.name(bucket) not in self._programs:  # once per bucket, unless precompiled
            with _Compiles(self._install, 1) as compiles:
                compiles.submit(self._front_jobs(bucket, (slots is not None,)))
        try:
            block = self._folded_round(bucket, cache, inputs, round_key, sampling)
        except Exception:  # e.g. a cache the programs do not take: the host path names it
            return None
        host = fetched(args)  # waits for the inputs (not for the round), copies them to the host
        try:
            rows, ints, temps = call_inputs(host)
        except Exception:
            self._check(host, None, None)
            raise
        self._check(host, ints, temps)
        check_mode(sampling, ints, temps)
        return self._unpadded(rows, bucket, sampling, block)

    def _front_takes(self, bucket: int, rows: _Front) -> bool:
        """Whether a front program takes these inputs: bucket-sized int32 arrays (float32
        temperatures), slots given or not, as :meth:`_front_jobs` compiles them."""
        want = (jnp.int32, jnp.int32, jnp.float32, jnp.int32, jnp.int32)
        return all(
            a is None or (isinstance(a, jax.Array) and a.shape == (bucket,) and a.dtype == dtype)
            for a, dtype in zip(rows, want, strict=True)
        )

    def _mode_of(self, temperatures: Any, top_k: Any) -> bool:
        """Whether a row samples: one read of the two arrays before the launch (~0.1 ms on the
        H200's host), kept for the next call that passes the same two (immutable) arrays, as
        a serving loop does while its batch is unchanged."""
        last = self._last_mode
        if last is not None and last[0] is temperatures and last[1] is top_k:
            return last[2]
        temps, ks = (np.asarray(a) for a in jax.device_get((temperatures, top_k)))
        sampling = bool(sampling_rows(ks, temps).any())
        if isinstance(temperatures, jax.Array) and isinstance(top_k, jax.Array):
            self._last_mode = (temperatures, top_k, sampling)
        return sampling

    def _front_jobs(
        self, bucket: int, slots: tuple[bool, ...] = (False, True)
    ) -> Iterator[tuple[tuple[Any, ...], Callable[[], jax.stages.Compiled]]]:
        """The bucket's first backbone piece of device inputs (:func:`_front_piece`), for
        bucket-sized int32 / float32 inputs with slots given and not (``slots``), unless
        compiled or in the store; compiled with the backbone's options. ``precompile``
        builds them; otherwise a bucket's first device call compiles the one it needs."""
        ints, temps = jax.ShapeDtypeStruct((bucket,), jnp.int32), jax.ShapeDtypeStruct((bucket,), jnp.float32)
        stop = self._split.ranges[0][1]
        fn = functools.partial(_front_piece, self._split, self._limits, stop, self._width)
        for with_slots in slots:
            args = (self._cache_spec(), ints, ints, temps, ints, ints if with_slots else None)
            job = self._round_job(("front", bucket, with_slots), fn, args, backbone_compile_options(bucket))
            if job is not None:
                yield job

    def _unpadded(self, rows: int, bucket: int, sampling: bool, block: DraftBlock) -> DraftBlock:
        if rows == bucket or not self.unpad:
            return block
        return self._compile_slicer(rows, sampling)(block)

    def _check(self, args: tuple[Any, ...], ints: np.ndarray | None, temps: np.ndarray | None) -> None:
        """Raises unless a call's inputs are valid (README note 58).

        A valid call passes a few shape and dtype comparisons and one vectorised range
        test; the full validator's ~40 small NumPy calls cost ~0.1 ms of host time on the
        H200's host, and even these are made while a launched round runs. A call they refuse
        goes through :func:`~dspark_jax.proposal.validate_proposal_inputs`, which names the
        field, the value and what is allowed.

        Args:
          args: the call's ``(cache, bonus, prefix_lens, temperatures, top_k, key, slots)``.
          ints: ``[B, 4]`` int64 slot, bonus, prefix_len and top_k as packed (a uint64 beyond
            int64 wrapped negative), or None where the packing failed.
          temps: ``[B]`` float32 temperatures as packed, or None.

        Raises:
          ValueError, TypeError: as ``validate_proposal_inputs``, a cache of another shape
            or dtype than this Proposer's, or more rows than ``num_slots`` without ``slots``.
        """
        cache, bonus, prefix_lens, temperatures, top_k, key, slots = args
        columns = [np.asarray(v) for v in (slots, bonus, prefix_lens, top_k) if v is not None]
        raw_temps = np.asarray(temperatures)
        rows = ints.shape[0] if ints is not None else 0
        shaped = (
            0 < rows <= self.max_batch
            and isinstance(cache, ContextCache)
            and all(tuple(a.shape) == self.cache_shape and a.dtype == self.cache_dtype for a in (cache.k, cache.v))
            and all(a.shape == (rows,) and a.dtype.kind in "iu" for a in columns)
            and raw_temps.shape == (rows,)
            and (raw_temps.dtype.kind in "iu" or jnp.issubdtype(raw_temps.dtype, jnp.floating))  # bf16 too
        )
        if shaped:
            key_rows(key, rows)  # a bad key raises its TypeError
            # NaN fails both comparisons; negatives (and wrapped uint64) fail ``>= 0``
            if ((ints >= 0) & (ints <= self._limits)).all() and ((temps >= 0) & (temps < np.inf)).all():
                return
        rows = np.shape(bonus)[0] if np.ndim(bonus) == 1 else 0
        num_slots = self.cache_shape[1]
        if slots is None and num_slots < rows <= self.max_batch:
            raise ValueError(
                f"batch size B={rows} (len(bonus)) is too large for a call without slots: its rows use cache slots "
                f"0..B-1, and this Proposer's cache has num_slots={num_slots}; pass slots ([B] slot ids in "
                f"[0, {num_slots}))"
            )
        validate_proposal_inputs(  # raises for what was refused above
            self.cfg,
            cache,
            bonus,
            prefix_lens,
            temperatures,
            top_k,
            key,
            slots=np.arange(rows) if slots is None else slots,
            max_batch=self.max_batch,
        )
        if not all(tuple(a.shape) == self.cache_shape and a.dtype == self.cache_dtype for a in (cache.k, cache.v)):
            raise ValueError(
                f"cache has k {tuple(cache.k.shape)} {cache.k.dtype} and v {tuple(cache.v.shape)} {cache.v.dtype}: "
                f"this Proposer was built for {self.cache_shape} {self.cache_dtype} (num_slots, capacity and "
                "cache_dtype at construction)"
            )
        if ints is None:
            return  # the caller re-raises the packing's own error
        allowed = ", ".join(f"{n} in [0, {hi}]" for n, hi in zip(INT_COLUMNS, self._limits, strict=True))
        raise ValueError(  # not reached: the validator refuses every value refused above
            f"per-row inputs out of range: rows ({', '.join(INT_COLUMNS)}) = {ints.tolist()}, allowed {allowed}; "
            f"temperatures {temps.tolist()} must be >= 0 and finite"
        )

    def _ready(self, bucket: int, sampling: bool) -> bool:
        """Whether the (bucket, mode) round's programs are compiled (or loaded)."""
        return ("head", bucket, sampling) in self._programs and all(
            ("piece", bucket, start, stop) in self._programs for start, stop in self._split.ranges
        )

    @functools.cached_property
    def _limits(self) -> tuple[int, int, int, int]:
        """The largest slot, bonus, prefix_len and top_k a call may pass."""
        num_slots, capacity = self.cache_shape[1:3]
        return num_slots - 1, self.cfg.vocab_size - 1, capacity - self.cfg.gamma, TOP_K_MAX

    def _folded_round(
        self,
        bucket: int,
        cache: ContextCache,
        packed: np.ndarray,
        key: jax.Array,
        sampling: bool,
        run: Callable[..., Any] = _call,
    ) -> DraftBlock:
        """The compiled round of a bucket: the backbone pieces, then the mode's head.

        ``packed``: the packed inputs (NumPy or on the device), or a :class:`_Front` of
        device inputs, which the bucket's front program packs in place of the first piece.
        ``run(program, *args)`` makes each call (the bench wraps it to measure each
        program's own peak memory).
        """
        # NumPy in: the first piece copies it to the device on its own C++ path and hands
        # the device copy on (one transfer, no Python jax.device_put before the launch)
        x = None
        for start, stop in self._split.ranges:
            if start == 0 and isinstance(packed, _Front):
                x, packed = run(self._programs[packed.name(bucket)], self._sub_leaves["front",], cache, *packed)
                continue
            x = run(
                self._program(("piece", bucket, start, stop)), self._sub_leaves["piece", start, stop], x, cache, packed
            )
            if start == 0:
                x, packed = x
        return run(self._program(("head", bucket, sampling)), self._sub_leaves["head", sampling], x, packed, key)
