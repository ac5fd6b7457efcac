"""STS calibration of the confidence head: one temperature per draft position.

The confidence head predicts, for each slot ``k`` of a block, the chance that the target
accepts draft ``d_k`` once ``d_1 … d_{k−1}`` were accepted: ``sigmoid(z_k / T_k)`` with raw
score ``z_k`` and the step-dependent temperature ``T_k`` (``sts_temperature``, 1 until
fitted; ``DSPARK_SPEC.md`` §2). :func:`fit_sts_temperature` fits ``T`` on held-out text,
teacher-forced (the text's own tokens as the accepted prefix), against one of two labels:

* ``"sampling"``: ``Σ_v min(p_k, q_k)``, the chance that rejection sampling at T = 1
  accepts a draft drawn from ``q_k`` (the training label, ``clamp(1 − ½·TV)``);
* ``"greedy"``: ``1`` where ``argmax q_k == argmax p_k``, else ``0``: what greedy
  decoding accepts.

Each ``T_k`` minimises the mean binary cross-entropy of ``sigmoid(z_k / T_k)`` against
the labels: a logistic regression through the origin in ``a = 1 / T_k``, convex, solved by
Newton's method in float64. Shape legend: N blocks, γ draft slots.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import jax.numpy as jnp
import numpy as np

from dspark_jax.config import check_flag
from dspark_jax.draft import check_draft
from dspark_jax.draft_training import block_acceptance, map_heldout_blocks

if TYPE_CHECKING:
    from dspark_jax.draft import DSparkDraft
    from dspark_jax.target import Target

CALIBRATION_LABELS = ("sampling", "greedy")


@dataclasses.dataclass(frozen=True)
class StsFit:
    """A fitted STS temperature and what it changed.

    Attributes:
      temperatures: ``[γ]`` ``T_k`` (finite, > 0).
      labels: ``"sampling"`` or ``"greedy"``.
      bce_before: ``[γ]`` mean binary cross-entropy per slot with the draft's temperatures
        as they were.
      bce_after: ``[γ]`` the same with ``temperatures``.
      predicted: ``[γ]`` mean calibrated confidence per slot.
      observed: ``[γ]`` mean label per slot.
      blocks: teacher-forced blocks the fit read.
    """

    temperatures: list[float]
    labels: str
    bce_before: list[float]
    bce_after: list[float]
    predicted: list[float]
    observed: list[float]
    blocks: int


def _bce(a: np.ndarray, z: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Mean over rows of BCE(sigmoid(a·z), y): ``[N, γ]`` scores and labels, ``[γ]`` slopes."""
    x = a * z
    return np.mean(np.logaddexp(0.0, x) - y * x, axis=0)


def fit_temperatures(scores: np.ndarray, labels: np.ndarray, *, iters: int = 50) -> np.ndarray:
    """Per-column temperature minimising the mean BCE of ``sigmoid(scores / T)`` against ``labels``.

    Args:
      scores: ``[N, γ]`` raw confidence scores.
      labels: ``[N, γ]`` targets in ``[0, 1]`` (soft labels allowed).
      iters: at most this many Newton steps (each halved until the loss does not rise);
        the fit stops once every step is below ``1e-10`` of its slope.

    Returns:
      ``[γ]`` float64 temperatures, finite and > 0.

    Raises:
      ValueError: shapes differ or are not ``[N >= 1, γ]``, a value is not finite, a
        label lies outside ``[0, 1]``, or no positive temperature lowers a column's
        cross-entropy below its value at ``1 / T = 0`` (``mean((½ − y)·z) >= 0``): its scores
        are biased (the fit has no offset) or do not rank its labels, which temperature
        scaling cannot fix.
    """
    z, y = np.asarray(scores, np.float64), np.asarray(labels, np.float64)
    if z.ndim != 2 or z.shape != y.shape or z.shape[0] < 1:
        raise ValueError(f"scores {z.shape} and labels {y.shape} must both be [N >= 1, γ]")
    if not (np.isfinite(z).all() and np.isfinite(y).all()):
        raise ValueError("scores and labels must be finite")
    if ((y < 0) | (y > 1)).any():
        raise ValueError("labels must lie in [0, 1]")
    # The loss is convex in the slope a; at a = 0 its derivative is mean((½ − y)·z).
    slope_at_zero = np.mean((0.5 - y) * z, axis=0)  # [γ]
    downhill = slope_at_zero < 0  # [γ] the loss falls for small a > 0
    if not downhill.all():
        k = int(np.argmin(downhill))
        raise ValueError(
            f"slot {k + 1}: no positive temperature lowers the cross-entropy of sigmoid(score / T) against its "
            f"labels (mean((1/2 - label) * score) = {slope_at_zero[k]:.4g}, not < 0): its confidence scores "
            "are biased or do not rank its labels, and temperature scaling (no offset) cannot fix that"
        )
    a = np.ones(z.shape[1])
    for _ in range(iters):
        s = 1.0 / (1.0 + np.exp(-a * z))
        grad = np.mean((s - y) * z, axis=0)
        hess = np.mean(s * (1 - s) * z * z, axis=0) + 1e-12
        step = grad / hess
        if np.all(np.abs(step) <= 1e-10 * a):  # converged
            break
        loss = _bce(a, z, y)
        t = np.ones_like(a)
        for _ in range(30):  # halve where the full step would leave a > 0 or raise the loss
            trial = a - t * step
            bad = (trial <= 0) | (_bce(trial, z, y) > loss)
            if not bad.any():
                break
            t = np.where(bad, t / 2, t)
        a = np.where((a - t * step) > 0, a - t * step, a)
    return 1.0 / a


def fit_sts_temperature(
    draft: DSparkDraft,
    target: Target,
    tokens: np.ndarray,
    *,
    labels: str = "sampling",
    batches: int = 8,
    batch_size: int = 8,
    seq_len: int = 256,
    seed: int = 1,
    apply: bool = True,
) -> StsFit:
    """Fits the draft's ``sts_temperature`` on a token stream (held-out text).

    Args:
      draft: a :class:`~dspark_jax.draft.DSparkDraft` with a confidence head.
      target: its target.
      tokens: ``[N]`` int32 token stream.
      labels: ``"sampling"`` (the chance T = 1 accepts) or ``"greedy"`` (argmax match).
      batches, batch_size, seq_len: how much text to read; anchors at every 4th position.
      seed: window sampling seed.
      apply: write the fitted temperatures into the draft (``save_draft`` then saves them).

    Returns:
      A :class:`StsFit`.

    Raises:
      ValueError: no confidence head, ``labels`` not one of :data:`CALIBRATION_LABELS`,
        counts below 1, a ``seq_len`` with no room for a block or past either model's
        positions, a bad token stream, or scores that no temperature calibrates.
      TypeError: ``draft`` is not a :class:`~dspark_jax.draft.DSparkDraft`.
    """
    check_draft(draft)
    check_flag("apply", apply)
    if draft.confidence_head is None:
        raise ValueError("the draft has no confidence head (enable_confidence_head=False): nothing to calibrate")
    if labels not in CALIBRATION_LABELS:
        raise ValueError(f"labels={labels!r} is invalid: expected one of {CALIBRATION_LABELS}")

    def score(blocks):
        accept, match = block_acceptance(blocks)  # [N, γ] each
        return blocks["confidence_logits"], accept if labels == "sampling" else match

    parts = map_heldout_blocks(
        draft, target, tokens, score, batches=batches, batch_size=batch_size, seq_len=seq_len, seed=seed
    )
    z = np.concatenate([np.asarray(s, np.float64) for s, _ in parts])  # [N, γ]
    y = np.clip(np.concatenate([np.asarray(t, np.float64) for _, t in parts]), 0.0, 1.0)
    before = np.asarray(draft.confidence_head.sts_temperature[...], np.float64)  # [γ]
    fitted = fit_temperatures(z, y)
    if apply:
        draft.confidence_head.sts_temperature.set_value(jnp.asarray(fitted, jnp.float32))
    return StsFit(
        temperatures=fitted.tolist(),
        labels=labels,
        bce_before=_bce(1.0 / before, z, y).tolist(),
        bce_after=_bce(1.0 / fitted, z, y).tolist(),
        predicted=np.mean(1.0 / (1.0 + np.exp(-z / fitted)), axis=0).tolist(),
        observed=y.mean(0).tolist(),
        blocks=int(z.shape[0]),
    )
