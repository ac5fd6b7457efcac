"""Serving wrapper: batch buckets, ahead-of-time compilation and the memory gate.

Shape legend: B rows of a call, Bp its bucket (power of two, or ``max_batch``), S request
slots of the context cache, C capacity, L draft layers, KVH key/value heads, D head dim,
γ draft slots, V vocabulary.

:class:`Proposer` plays the role of CUDA-graph capture in sglang: :meth:`Proposer.precompile`
compiles one executable per (bucket, mode) with ``jax.jit(...).lower(...).compile()``
and keeps them, so serving calls never trace or compile again. Modes:

* greedy-only folded (every batch whose rows are all greedy);
* sampling folded (batches with a sampling row), when the memory gate allows it
  (:mod:`dspark_jax.memory_gate`); otherwise sampling batches run the eager path
  (:func:`dspark_jax.proposal.run_eager`), which ``precompile`` warms per bucket.

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
them (:class:`CompileCounter` reports those loads as ``cache_hits``).
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from dspark_jax.cache import ContextCache
from dspark_jax.draft import DSparkDraft
from dspark_jax.memory_gate import (
    ENV_VAR,
    GIB,
    FoldedSampling,
    GateDecision,
    plan_folded_sampling,
    sampling_extra_bytes,
)
from dspark_jax.proposal import DraftBlock, propose, run_eager, validate_proposal_inputs
from dspark_jax.sampling import TOP_K_ALL

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
    """``(1, 2, 4, …, max_batch)``: powers of two below ``max_batch``, then ``max_batch``."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"max_batch={max_batch!r} is invalid: must be an integer >= 1")
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return (*out, max_batch)


def _gather(cache: ContextCache, slots: jax.Array) -> ContextCache:
    return ContextCache(k=cache.k[:, slots], v=cache.v[:, slots])  # [L, Bp, C, KVH, D]


def _keys(key_data: jax.Array, per_row: jax.Array) -> jax.Array:
    """Raw per-row keys ``[Bp, n]``: given ones, or ``fold_in(key, b)`` of one broadcast key."""
    rows = jnp.arange(key_data.shape[0], dtype=jnp.uint32)
    folded = jax.vmap(jax.random.fold_in)(jax.random.wrap_key_data(key_data), rows)
    return jnp.where(per_row, key_data, jax.random.key_data(folded))


def _folded_round(
    graphdef, treedef, fold_sampling, leaves, cache, slots, bonus, prefix_lens, temperatures, top_k, key_data, per_row
):
    # The state travels as a flat list of arrays: flattening an nnx.State on every call costs
    # milliseconds of host time, a list almost nothing.
    # The slots go to the draft, not through a gather: the GPU attention kernel reads the
    # requests' context where it lies (the XLA path gathers inside the draft).
    return propose(
        graphdef,
        jax.tree.unflatten(treedef, leaves),
        cache,
        bonus,
        prefix_lens,
        temperatures,
        top_k,
        _keys(key_data, per_row),
        fold_sampling=fold_sampling,
        slots=slots,
    )


def _eager_inputs(cache, slots, key_data, per_row):
    return _gather(cache, slots), _keys(key_data, per_row)


def _unpad(rows, block):
    return jax.tree.map(lambda x: x[:rows], block)


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
    ):
        """Splits the draft and plans the gate (closed form; refined by ``precompile``).

        Args:
          draft: the draft module (split once; later changes to it are not seen).
          max_batch: the largest batch.
          capacity: ``C``, positions per cache slot.
          num_slots: ``S``, request slots of the cache (default ``max_batch``).
          cache_dtype: the cache dtype (default the draft's compute dtype).
          folded_sampling: gate mode; None reads ``DSPARK_JAX_FOLDED_SAMPLING`` (default AUTO).
          free_bytes: free memory for the gate; measured when None.
          headroom: bytes the gate keeps free.
          unpad: slice results back to ``B`` rows (one small precompiled slicer per row
            count); False returns the bucket's ``Bp`` rows (rows ``>= B`` are padding) and
            compiles no slicers, for callers that keep bucket shapes through verify.
        """
        self.cfg = draft.cfg
        self.buckets = batch_buckets(max_batch)
        self.max_batch = max_batch
        num_slots = max_batch if num_slots is None else num_slots
        for name, value in (("capacity", capacity), ("num_slots", num_slots)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} is invalid: must be an integer >= 1")
        if capacity < self.cfg.gamma:
            raise ValueError(f"capacity={capacity} is too small: must be >= gamma={self.cfg.gamma}")
        cfg = self.cfg
        self.cache_shape = (cfg.num_hidden_layers, num_slots, capacity, cfg.num_key_value_heads, cfg.head_dim)
        self.cache_dtype = jnp.dtype(cache_dtype or cfg.jnp_dtype)
        self.graphdef, self.state = nnx.split(draft)
        self._leaves, self._treedef = jax.tree.flatten(self.state)
        self._free_bytes = free_bytes
        self._headroom = headroom
        self.unpad = unpad
        self._warned = False
        self._folded: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._eager: dict[int, jax.stages.Compiled] = {}  # bucket -> the eager path's input gather
        self._slicers: dict[tuple[int, bool], jax.stages.Compiled] = {}
        self._set_gate(plan_folded_sampling(folded_sampling, **self._gate_kwargs()))

    # ----------------------------------------------------------------- gate
    def _gate_kwargs(self) -> dict[str, Any]:
        return dict(
            max_batch=self.max_batch,
            gamma=self.cfg.gamma,
            vocab=self.cfg.vocab_size,
            free_bytes=self._free_bytes,
            headroom=self._headroom,
        )

    def _set_gate(self, gate: GateDecision) -> None:
        self.gate = gate
        if gate.mode is FoldedSampling.AUTO and not gate.enabled and not self._warned:
            self._warned = True
            warnings.warn(
                f"dspark_jax: folded sampling disabled ({gate.reason}); sampling batches take the "
                f"eager path. Set {ENV_VAR}=FORCE to fold them anyway.",
                RuntimeWarning,
                stacklevel=3,
            )

    # ------------------------------------------------------------ compiling
    def _specs(self, bucket: int) -> tuple[Any, ...]:
        """Abstract inputs of the compiled round at ``bucket`` rows."""
        cache = jax.ShapeDtypeStruct(self.cache_shape, self.cache_dtype)
        n = int(jax.random.key_data(jax.random.key(0)).shape[-1])
        i32 = jax.ShapeDtypeStruct((bucket,), jnp.int32)
        return (
            ContextCache(k=cache, v=cache),
            i32,
            i32,
            i32,
            jax.ShapeDtypeStruct((bucket,), jnp.float32),
            i32,
            jax.ShapeDtypeStruct((bucket, n), jnp.uint32),
            jax.ShapeDtypeStruct((), jnp.bool_),
        )

    def _lower_folded(self, bucket: int, sampling: bool) -> jax.stages.Lowered:
        fn = jax.jit(functools.partial(_folded_round, self.graphdef, self._treedef, sampling))
        return fn.lower(self._leaves, *self._specs(bucket))

    def _compile_folded(self, bucket: int, sampling: bool) -> jax.stages.Compiled:
        if (bucket, sampling) not in self._folded:
            self._folded[bucket, sampling] = self._lower_folded(bucket, sampling).compile()
        return self._folded[bucket, sampling]

    def _lower_slicer(self, rows: int, sampling: bool) -> jax.stages.Lowered:
        bucket, cfg = self.bucket(rows), self.cfg
        conf = cfg.gamma if cfg.enable_confidence_head else 0
        block = DraftBlock(
            draft_tokens=jax.ShapeDtypeStruct((bucket, cfg.gamma), jnp.int32),
            corrected_logits=jax.ShapeDtypeStruct((bucket, cfg.gamma, cfg.vocab_size if sampling else 0), jnp.float32),
            greedy_mask=jax.ShapeDtypeStruct((bucket,), jnp.bool_),
            temperatures=jax.ShapeDtypeStruct((bucket,), jnp.float32),
            confidence=jax.ShapeDtypeStruct((bucket, conf), jnp.float32),
        )
        return jax.jit(functools.partial(_unpad, rows)).lower(block)

    def _compile_slicer(self, rows: int, sampling: bool) -> jax.stages.Compiled:
        if (rows, sampling) not in self._slicers:
            self._slicers[rows, sampling] = self._lower_slicer(rows, sampling).compile()
        return self._slicers[rows, sampling]

    @staticmethod
    def _compile_many(jobs: dict[Any, jax.stages.Lowered], store: dict[Any, Any], workers: int) -> None:
        """Compiles lowered programs into ``store``, up to ``workers`` at a time (XLA
        compiles outside the GIL; lowering already happened on this thread)."""
        if workers <= 1 or len(jobs) <= 1:
            store.update({name: lowered.compile() for name, lowered in jobs.items()})
            return
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            futures = {name: pool.submit(lowered.compile) for name, lowered in jobs.items()}
            store.update({name: future.result() for name, future in futures.items()})

    def _warm_eager(self, bucket: int) -> None:
        """Compiles the eager path at ``bucket``: its input gather ahead of time, and its
        jitted stages by running them once on zeros of the gathered rows' shape."""
        if bucket in self._eager:
            return
        cache_spec, slots_spec, *_, key_spec, flag_spec = self._specs(bucket)
        gather = jax.jit(_eager_inputs).lower(cache_spec, slots_spec, key_spec, flag_spec).compile()
        rows_shape = (self.cache_shape[0], bucket, *self.cache_shape[2:])  # [L, Bp, C, KVH, D]
        rows = ContextCache(k=jnp.zeros(rows_shape, self.cache_dtype), v=jnp.zeros(rows_shape, self.cache_dtype))
        zeros = np.zeros(bucket, np.int32)
        _, bonus, prefix_lens, temperatures, top_k, key_data, _ = self._pad_inputs(
            bucket, zeros, zeros, np.ones(bucket, np.float32), np.full(bucket, TOP_K_ALL), jax.random.key(0), zeros
        )
        run_eager(self.graphdef, self.state, rows, bonus, prefix_lens, temperatures, top_k, jnp.asarray(key_data))
        self._eager[bucket] = gather

    def precompile(self, *, workers: int | None = None) -> GateDecision:
        """Compiles every (bucket, mode) and the slicers; decides the gate with XLA's numbers.

        Greedy-only executables for every bucket first, together with — unless the gate is
        already closed (OFF, or AUTO short of memory by the closed form) — the sampling
        executable at ``max_batch``, whose memory analysis (minus the greedy-only one's)
        refines the gate. When the gate allows it, sampling executables for every bucket
        follow; else the eager path is warmed per bucket.

        Args:
          workers: programs compiled concurrently from a thread pool (XLA compiles outside
            the GIL). Default: 1 on the CPU backend (on a 2-core box 2 workers took 23.0 s
            against 17.6 s with 1), else ``min(8, cpu_count)`` (on the H200 host 8 workers
            brought the 8B draft's cold precompile from 106 s to 49 s).

        Returns:
          The gate decision (also ``self.gate``).
        """
        if workers is None:
            workers = 1 if jax.default_backend() == "cpu" else min(8, os.cpu_count() or 1)
        top = self.buckets[-1]
        jobs = {(b, False): self._lower_folded(b, False) for b in self.buckets if (b, False) not in self._folded}
        # The gate compares the larger estimate, so XLA's can only matter when the closed form fits.
        measure = self.gate.mode is FoldedSampling.FORCE or self.gate.enabled
        if measure and (top, True) not in self._folded:
            jobs[top, True] = self._lower_folded(top, True)
        self._compile_many(jobs, self._folded, workers)
        if measure:
            extra = sampling_extra_bytes(self._folded[top, True], self._folded[top, False])
            self._set_gate(plan_folded_sampling(self.gate.mode, compiled_bytes=extra, **self._gate_kwargs()))
            if not self.gate.enabled:
                del self._folded[top, True]
        jobs = {}
        if self.gate.enabled:
            jobs = {(b, True): self._lower_folded(b, True) for b in self.buckets if (b, True) not in self._folded}
        slicers = {
            (rows, sampling): self._lower_slicer(rows, sampling)
            for rows in range(1, self.max_batch + 1)
            for sampling in (False, True)
            if self.unpad and rows != self.bucket(rows) and (rows, sampling) not in self._slicers
        }
        self._compile_many(jobs, self._folded, workers)
        self._compile_many(slicers, self._slicers, workers)
        if not self.gate.enabled:
            for bucket in self.buckets:
                self._warm_eager(bucket)
        return self.gate

    # -------------------------------------------------------------- serving
    def bucket(self, rows: int) -> int:
        """The smallest bucket holding ``rows``."""
        return next(b for b in self.buckets if b >= rows)

    def _pad_inputs(self, bucket, bonus, prefix_lens, temperatures, top_k, key, slots):
        """Host-side padding to ``bucket`` rows; keys become raw ``[Bp, n]`` data."""
        rows = len(bonus)

        def pad(x, dtype, fill=0):
            out = np.full(bucket, fill, dtype)
            out[:rows] = np.asarray(x)
            return out

        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key):
            key = jax.random.key_data(key)
        key = np.asarray(key, np.uint32)
        per_row = key.ndim == 2
        if per_row:
            key_data = np.zeros((bucket, key.shape[-1]), np.uint32)
            key_data[:rows] = key
        else:
            key_data = np.ascontiguousarray(np.broadcast_to(key, (bucket, key.shape[-1])))
        return (
            pad(slots, np.int32),
            pad(bonus, np.int32),
            pad(prefix_lens, np.int32),
            pad(temperatures, np.float32),
            pad(top_k, np.int32),
            key_data,
            np.bool_(per_row),
        )

    def _run_eager(self, bucket, cache, slots, bonus, prefix_lens, temperatures, top_k, key_data, per_row):
        self._warm_eager(bucket)
        rows, keys = self._eager[bucket](cache, slots, key_data, per_row)
        return run_eager(self.graphdef, self.state, rows, bonus, prefix_lens, temperatures, top_k, keys)

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
    ) -> DraftBlock:
        """Validates, pads to the bucket, runs the precompiled round and unpads.

        Args:
          cache: the context cache ``[L, S, C, KVH, D]`` (the shape and dtype given at
            construction).
          bonus: ``[B]`` int anchor tokens, ``B <= max_batch``.
          prefix_lens: ``[B]`` int context lengths.
          temperatures: ``[B]`` float (0 = greedy).
          top_k: ``[B]`` int (``<= 1`` = greedy).
          key: one PRNG key (typed or raw) or per-row keys ``[B]``.
          slots: ``[B]`` cache slot of each row (default ``0..B−1``).

        Returns:
          The :class:`~dspark_jax.proposal.DraftBlock` of the ``B`` rows (of the bucket's
          ``Bp`` rows when ``unpad=False``).
        """
        rows = np.shape(bonus)[0] if np.ndim(bonus) == 1 else 0
        if slots is None:
            slots = np.arange(rows)
        validate_proposal_inputs(
            self.cfg,
            cache,
            bonus,
            prefix_lens,
            temperatures,
            top_k,
            key,
            slots=slots,
            max_batch=self.max_batch,
        )
        if tuple(cache.k.shape) != self.cache_shape or cache.k.dtype != self.cache_dtype:
            raise ValueError(
                f"cache has shape {tuple(cache.k.shape)} and dtype {cache.k.dtype}: this Proposer was built for "
                f"{self.cache_shape} {self.cache_dtype} (num_slots, capacity and cache_dtype at construction)"
            )
        sampling = bool(np.any((np.asarray(top_k) > 1) & (np.asarray(temperatures) > 0)))
        bucket = self.bucket(rows)
        args = self._pad_inputs(bucket, bonus, prefix_lens, temperatures, top_k, key, slots)
        if sampling and not self.gate.enabled:
            block = self._run_eager(bucket, cache, *args)
        else:
            block = self._compile_folded(bucket, sampling)(self._leaves, cache, *args)
        if rows == bucket or not self.unpad:
            return block
        return self._compile_slicer(rows, sampling)(block)
