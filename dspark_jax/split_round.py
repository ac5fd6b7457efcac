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
pieces cut at layer boundaries: ``front`` (the in-graph embedding and the first
``front_layers`` layers), ``rest`` (the remaining layers) and ``head`` (final norm, base
logits, the Markov walk with in-graph sampling, confidence). The device starts once the
small ``front`` graph is launched, and the host launches the next pieces (and updates the
``head``'s graph, whose outputs are the round's) while the device runs the earlier ones.
Between pieces only the ``[B, R, H]`` residual stream passes, on the device; nothing
returns to the host. Each piece is compiled once per batch shape, like the one-program
round, and the backbone pieces are shared by the greedy-only and the sampling round.

With ``stable_outputs=True`` a fourth, small piece ``publish`` writes the round's
:class:`~dspark_jax.proposal.DraftBlock`: the head stores its results in one packed
``[B, W]`` uint32 array of a size no block field has, which only ``publish`` reads and
which is freed when the call returns, so the allocator hands the head the same addresses
every round and XLA never updates the head's graph, even while the caller holds earlier
blocks; only ``publish``'s few copy nodes are updated. It costs a device copy of the
``[B, γ, V]`` float32 logits when sampling is folded.

The pieces are the pure functions :func:`~dspark_jax.proposal.backbone_stage` and
:func:`~dspark_jax.proposal.head_stage`; :func:`~dspark_jax.proposal.propose_with` chains
the same two in one program, so both forms compute the same tokens (tested).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from dspark_jax.cache import ContextCache
from dspark_jax.draft import DSparkDraft
from dspark_jax.proposal import DraftBlock, backbone_stage, check_shapes, head_stage


def layer_ranges(num_layers: int, front_layers: int) -> tuple[tuple[int, int], ...]:
    """The backbone pieces' layer ranges ``(start, stop)``: ``[0, f)`` then ``[f, L)`` if not empty.

    Args:
      num_layers: ``L``.
      front_layers: ``f``, layers in the first piece (``>= 1``).

    Raises:
      ValueError: ``front_layers`` is not an integer >= 1.
    """
    if isinstance(front_layers, bool) or not isinstance(front_layers, int) or front_layers < 1:
        raise ValueError(f"front_layers={front_layers!r} is invalid: must be an integer >= 1")
    front = min(front_layers, num_layers)
    return ((0, front),) if front == num_layers else ((0, front), (front, num_layers))


def _small_columns(gamma: int) -> int:
    """Columns of the packed block before the logits: tokens, confidence, mask, temperature,
    padded to a multiple of 64 (at least 256 bytes a row: a size no other field has)."""
    return -(-(2 * gamma + 2) // 64) * 64


def pack_block(block: DraftBlock) -> jax.Array:
    """``DraftBlock`` → ``[B, S + γ·V']`` uint32 (``S`` = :func:`_small_columns`, ``V'`` = 0
    or ``V``): tokens, confidence bits (zero-padded to γ), mask, temperature bits, then the
    logits' bits. Bit patterns, not float values, so nothing is rounded or flushed."""
    tokens = block.draft_tokens
    b, gamma = tokens.shape

    def bits(x):
        return jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)

    conf = jnp.pad(block.confidence, ((0, 0), (0, gamma - block.confidence.shape[1])))
    small = [
        tokens.astype(jnp.uint32),  # [B, γ]
        bits(conf),  # [B, γ]
        block.greedy_mask.astype(jnp.uint32)[:, None],  # [B, 1]
        bits(block.temperatures)[:, None],  # [B, 1]
    ]
    small = jnp.concatenate(small, axis=1)
    small = jnp.pad(small, ((0, 0), (0, _small_columns(gamma) - small.shape[1])))
    return jnp.concatenate([small, bits(block.corrected_logits).reshape(b, -1)], axis=1)


def unpack_block(packed: jax.Array, *, gamma: int, vocab: int, confidence: int) -> DraftBlock:
    """Inverse of :func:`pack_block`: ``vocab`` is ``V'`` (0 without folded sampling),
    ``confidence`` the confidence width (γ or 0)."""
    b = packed.shape[0]
    s = _small_columns(gamma)

    def floats(x):
        return jax.lax.bitcast_convert_type(x, jnp.float32)

    return DraftBlock(
        draft_tokens=packed[:, :gamma].astype(jnp.int32),
        corrected_logits=floats(packed[:, s:]).reshape(b, gamma, vocab),
        greedy_mask=packed[:, 2 * gamma] != 0,
        temperatures=floats(packed[:, 2 * gamma + 1]),
        confidence=floats(packed[:, gamma : gamma + confidence]),
    )


class SplitRound:
    """The folded round as ``front → rest → head`` executables (see the module docstring).

    Example::

        split = SplitRound(draft)
        block = split(cache, bonus, prefix_lens, temperatures, top_k, key)  # a DraftBlock
        block = split(cache, bonus, prefix_lens, temperatures, top_k, key, fold_sampling=False)

    The draft is split once at construction (later changes to the module are not seen).
    Inputs are checked for shape (as :func:`~dspark_jax.proposal.propose` does, on tracers
    too); :func:`~dspark_jax.proposal.validate_proposal_inputs` checks values on the host.
    """

    def __init__(self, draft: DSparkDraft, *, front_layers: int = 1, stable_outputs: bool = False):
        """Splits the draft into its graph and a flat list of its arrays.

        Args:
          draft: the draft module.
          front_layers: layers in the first piece (the rest form the second).
          stable_outputs: write the block through the small ``publish`` piece (see the
            module docstring).
        """
        if not isinstance(stable_outputs, bool):
            raise TypeError(f"stable_outputs={stable_outputs!r} is invalid: must be a bool")
        self.stable_outputs = stable_outputs
        self.cfg = draft.cfg
        self.ranges = layer_ranges(draft.cfg.num_hidden_layers, front_layers)
        self.graphdef, state = nnx.split(draft)
        # A flat list of arrays: flattening an nnx.State on every call costs host time.
        self.leaves, self._treedef = jax.tree.flatten(state)
        self._backbone = jax.jit(self.backbone, static_argnames=("start", "stop"))
        self._head = jax.jit(self.head, static_argnames="fold_sampling")
        self._packed_head = jax.jit(self.packed_head, static_argnames="fold_sampling")
        self._publish = jax.jit(self.publish, static_argnames="fold_sampling")

    def _draft(self, leaves: list[jax.Array]) -> DSparkDraft:
        return nnx.merge(self.graphdef, jax.tree.unflatten(self._treedef, leaves))

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
        return backbone_stage(self._draft(leaves), x, cache, bonus, prefix_lens, start=start, stop=stop, slots=slots)

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

    def packed_head(self, leaves, x, bonus, temperatures, top_k, key, *, fold_sampling: bool) -> jax.Array:
        """Pure: :meth:`head` with its block packed by :func:`pack_block` (``stable_outputs``)."""
        return pack_block(self.head(leaves, x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling))

    def publish(self, packed: jax.Array, *, fold_sampling: bool) -> DraftBlock:
        """Pure: the block of :meth:`packed_head`'s array."""
        cfg = self.cfg
        return unpack_block(
            packed,
            gamma=cfg.gamma,
            vocab=cfg.vocab_size if fold_sampling else 0,
            confidence=cfg.gamma if cfg.enable_confidence_head else 0,
        )

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
        check_shapes(self.cfg, cache, bonus, prefix_lens, temperatures, top_k, key, slots=slots)
        x = None
        for start, stop in self.ranges:
            x = self._backbone(self.leaves, x, cache, bonus, prefix_lens, slots, start=start, stop=stop)
        if not self.stable_outputs:
            return self._head(self.leaves, x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling)
        packed = self._packed_head(self.leaves, x, bonus, temperatures, top_k, key, fold_sampling=fold_sampling)
        return self._publish(packed, fold_sampling=fold_sampling)
