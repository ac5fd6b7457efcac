"""The folded-sampling memory gate: fold sampling into the compiled round only if it fits.

Folding sampling into the compiled draft round costs, at the largest batch bucket,
the exponential noise ``[max_bs, V]`` float32 plus the corrected logits
``[max_bs, γ, V]`` that the accept step needs (``DSPARK_SPEC.md`` §3). dspark_jax keeps
the corrected logits in the model dtype (``logits_itemsize``: 2 for bfloat16, as the spec's
estimate assumes), so the closed form is ``max_bs·V·4 + max_bs·γ·V·logits_itemsize`` bytes.
Where the fused race kernel draws the walk's noise (:mod:`dspark_jax.race_kernel`, GPUs), no
noise array exists (``noise_itemsize = 0``): the closed form is then the corrected logits
alone (measured on the H200 at ``max_bs`` 128 while they were kept in float32: the sampling
round's peak 544,538,624 bytes above the greedy round's, exactly ``128·7·151936·4``).

The closed form decides before anything is compiled. Once the largest bucket's round is
compiled, XLA's memory analysis replaces it (:func:`sampling_extra_bytes`). With bf16 logits
on the H200 at ``max_bs`` 128 it predicted 272,276,992 bytes, and folding sampling raised the
largest own peak of the round's programs by exactly that (the closed form: 272,269,312).

``FoldedSampling``:

* ``OFF`` — greedy-only folding; sampling batches take the eager path.
* ``FORCE`` — fold sampling regardless of memory.
* ``AUTO`` (default) — fold sampling only when the device keeps at least ``headroom``
  (1 GiB) free after the estimate; otherwise behave as ``OFF`` and warn once, naming
  how to force it (:func:`force_hint`): ``folded_sampling="force"`` when the mode came
  from the argument, ``DSPARK_JAX_FOLDED_SAMPLING=FORCE`` otherwise.

The mode comes from the argument, else from the environment variable
``DSPARK_JAX_FOLDED_SAMPLING`` (``off`` / ``auto`` / ``force``, any case), else AUTO.
"""

from __future__ import annotations

import dataclasses
import enum
import os
from typing import Any

import jax

from dspark_jax.config import is_integer, positive_int

ENV_VAR = "DSPARK_JAX_FOLDED_SAMPLING"
GIB = 1 << 30


class FoldedSampling(enum.Enum):
    """Whether sampling rows are folded into the compiled draft round."""

    OFF = "off"
    AUTO = "auto"
    FORCE = "force"

    @classmethod
    def resolve(cls, mode: FoldedSampling | str | None = None) -> FoldedSampling:
        """The mode from ``mode``, else ``$DSPARK_JAX_FOLDED_SAMPLING``, else AUTO.

        Raises:
          ValueError: an unknown mode string (naming the argument or the variable).
        """
        if isinstance(mode, cls):
            return mode
        source = "folded_sampling"
        if mode is None:
            mode = os.environ.get(ENV_VAR)
            source = ENV_VAR
            if mode is None or mode.strip() == "":
                return cls.AUTO
        if isinstance(mode, str):
            try:
                return cls(mode.strip().lower())
            except ValueError:
                pass
        allowed = ", ".join(m.value for m in cls)
        raise ValueError(f"{source}={mode!r} is invalid: must be one of {allowed} (any case)")


def force_hint(mode: FoldedSampling | str | None) -> str:
    """How to force folding, for a warning about an AUTO gate that turned it off.

    Args:
      mode: the ``folded_sampling`` argument the mode was resolved from (None: it came from
        ``$DSPARK_JAX_FOLDED_SAMPLING`` or the default).

    Returns:
      ``'pass folded_sampling="force"'`` when the argument was given (the argument overrides
      the environment variable, so setting it would do nothing), else
      ``'set DSPARK_JAX_FOLDED_SAMPLING=FORCE (or pass folded_sampling="force")'``.
    """
    if mode is not None:
        return 'pass folded_sampling="force"'
    return f'set {ENV_VAR}=FORCE (or pass folded_sampling="force")'


@dataclasses.dataclass(frozen=True, kw_only=True)
class GateDecision:
    """The gate's decision and the numbers behind it (all sizes in bytes).

    Attributes:
      mode: the resolved mode.
      enabled: True when sampling is folded into the compiled round.
      closed_form_bytes: ``max_bs·V·noise_itemsize + max_bs·γ·V·logits_itemsize``.
      compiled_bytes: what folding sampling adds to the compiled round at the largest
        bucket according to XLA's memory analysis, or None when not measured.
      free_bytes: free memory on the device (or host RAM on CPU), or None when unknown.
      headroom: bytes that must stay free.
      reason: one line saying why.
    """

    mode: FoldedSampling
    enabled: bool
    closed_form_bytes: int
    compiled_bytes: int | None
    free_bytes: int | None
    headroom: int
    reason: str

    @property
    def needed_bytes(self) -> int:
        """The estimate the gate compares: XLA's once the round is compiled, else the closed form."""
        return _needed(self.closed_form_bytes, self.compiled_bytes)


def closed_form_bytes(
    *, max_batch: int, gamma: int, vocab: int, logits_itemsize: int = 4, noise_itemsize: int = 4
) -> int:
    """``max_bs·V·noise_itemsize`` (float32 noise; 0 where the race kernel draws it in
    registers) plus ``max_bs·γ·V·logits_itemsize`` (corrected logits)."""
    return max_batch * vocab * noise_itemsize + max_batch * gamma * vocab * logits_itemsize


def free_device_bytes(device: Any = None) -> int | None:
    """Free memory on ``device`` (default: the first device).

    Uses ``device.memory_stats()`` (``bytes_limit − bytes_in_use``) where the backend
    reports it; on CPU, ``MemAvailable`` from ``/proc/meminfo``, else
    ``os.sysconf`` available pages. None when nothing is known.
    """
    device = device or jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def executable_bytes(compiled: Any) -> int | None:
    """Bytes an executable allocates while it runs: its scratch area plus its outputs that
    do not reuse a donated argument (XLA gives both their own buffers, live at once); None
    where the backend gives no memory analysis."""
    try:
        stats = compiled.memory_analysis()
    except (NotImplementedError, RuntimeError, AttributeError):
        return None
    if stats is None:
        return None
    aliased = int(getattr(stats, "alias_size_in_bytes", 0) or 0)
    return int(stats.temp_size_in_bytes) + int(stats.output_size_in_bytes) - aliased


def sampling_extra_bytes(sampling: Any, greedy: Any, others: tuple[Any, ...] = ()) -> int | None:
    """What folding sampling adds to a round's peak memory, per XLA's memory analysis.

    Each executable of a round allocates its footprint (scratch area + fresh outputs) while
    it runs, and the round's peak is the largest footprint of the programs it runs one after
    another: the backbone pieces (``others``), then the head. So sampling adds
    ``footprint(sampling head) − max(footprint(greedy head), footprints of others)``, at
    least 0. On the H200 at the 8B shapes and ``max_bs`` 128 (bf16 logits): backbone pieces
    99.6 and 107.0 MB, greedy head 352.1 MB, sampling head 624.4 MB, and each program's own
    peak, measured alone, within 816 bytes of its footprint. A smaller head than a piece
    (the tiny drafts on the CPU) leaves the piece to set the round's peak.

    Args:
      sampling, greedy: the two compiled heads of one bucket (or the two whole rounds).
      others: the other executables the round runs in sequence (the backbone pieces).

    Returns:
      Bytes (≥ 0), or None when any executable reports no memory analysis.
    """
    footprints = [executable_bytes(c) for c in (sampling, greedy, *others)]
    if None in footprints:
        return None
    return max(footprints[0] - max(footprints[1:]), 0)


def plan_folded_sampling(
    mode: FoldedSampling | str | None = None,
    *,
    max_batch: int,
    gamma: int,
    vocab: int,
    logits_itemsize: int = 4,
    noise_itemsize: int = 4,
    free_bytes: int | None = None,
    compiled_bytes: int | None = None,
    headroom: int = GIB,
) -> GateDecision:
    """Decides whether sampling is folded into the compiled round.

    Args:
      mode: ``FoldedSampling``, its name, or None (environment variable, else AUTO).
      max_batch: the largest batch bucket.
      gamma: drafts per round.
      vocab: ``V``.
      logits_itemsize: bytes per corrected logit: the model dtype's (dspark_jax keeps them in
        the base logits' dtype; the default, 4, is float32's).
      noise_itemsize: bytes per noise value held in memory (4 for the XLA sampler's float32
        noise; 0 where the race kernel draws it in registers).
      free_bytes: free memory; measured with :func:`free_device_bytes` when None.
      compiled_bytes: what folding sampling adds per XLA's memory analysis, if known.
      headroom: bytes that must stay free (1 GiB).

    Returns:
      The :class:`GateDecision`.

    Raises:
      ValueError: an unknown mode; ``max_batch``, ``gamma``, ``vocab`` or ``logits_itemsize``
        not an integer >= 1; ``noise_itemsize`` or ``headroom`` not an integer >= 0;
        ``free_bytes`` or ``compiled_bytes`` neither None nor an integer >= 0 (bools are
        refused everywhere).
    """
    mode = FoldedSampling.resolve(mode)
    sizes = dict(max_batch=max_batch, gamma=gamma, vocab=vocab, logits_itemsize=logits_itemsize)
    max_batch, gamma, vocab, logits_itemsize = (positive_int(name, value) for name, value in sizes.items())
    # a NaN or negative headroom would turn AUTO off (or on) without a word
    noise_itemsize, headroom = _byte_count("noise_itemsize", noise_itemsize), _byte_count("headroom", headroom)
    free_bytes = _byte_count("free_bytes", free_bytes, optional=True)
    compiled_bytes = _byte_count("compiled_bytes", compiled_bytes, optional=True)
    closed = closed_form_bytes(
        max_batch=max_batch, gamma=gamma, vocab=vocab, logits_itemsize=logits_itemsize, noise_itemsize=noise_itemsize
    )
    if free_bytes is None and mode is FoldedSampling.AUTO:
        free_bytes = free_device_bytes()
    return _decide(mode, closed, compiled_bytes, free_bytes, headroom)


def _byte_count(name: str, value: Any, *, optional: bool = False) -> int | None:
    """``value`` as an ``int``: a Python or NumPy integer (not a bool) ``>= 0``, or None where
    ``optional``; raises ``ValueError`` naming ``name`` otherwise."""
    if optional and value is None:
        return None
    if not is_integer(value) or value < 0:
        allowed = "None or an integer >= 0" if optional else "an integer >= 0"
        raise ValueError(f"{name}={value!r} is invalid: must be {allowed} (bytes)")
    return int(value)


def _needed(closed: int, compiled: int | None) -> int:
    return closed if compiled is None else compiled


def _decide(mode: FoldedSampling, closed: int, compiled: int | None, free: int | None, headroom: int) -> GateDecision:
    needed = _needed(closed, compiled)
    if mode is FoldedSampling.OFF:
        enabled, reason = False, "OFF: greedy-only folding; sampling batches run eagerly"
    elif mode is FoldedSampling.FORCE:
        enabled, reason = True, "FORCE: sampling folded regardless of memory"
    elif free is None:
        enabled, reason = False, "AUTO: free memory unknown, so greedy-only folding"
    elif free - needed >= headroom:
        enabled = True
        reason = f"AUTO: {free - needed} bytes stay free after {needed} for sampling (headroom {headroom})"
    else:
        enabled = False
        reason = f"AUTO: only {free - needed} bytes would stay free after {needed} for sampling (headroom {headroom})"
    return GateDecision(
        mode=mode,
        enabled=enabled,
        closed_form_bytes=closed,
        compiled_bytes=compiled,
        free_bytes=free,
        headroom=headroom,
        reason=reason,
    )
