"""STS calibration: the temperature fit against a brute force, and on the bundled pair."""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dspark_jax.bundled import load_bundled
from dspark_jax.calibration import fit_sts_temperature, fit_temperatures
from dspark_jax.checkpoint import load_draft, save_draft
from dspark_jax.cli import main
from dspark_jax.draft import DSparkDraft
from dspark_jax.draft_training import block_acceptance, map_heldout_blocks


def _sigmoid(x):
    return 1 / (1 + np.exp(-x))


def test_fit_recovers_each_columns_temperature_from_soft_labels():
    rng = np.random.default_rng(0)
    z = rng.normal(0.5, 2.0, (4000, 4))
    want = np.array([1.7, 0.5, 3.0, 1.0])
    np.testing.assert_allclose(fit_temperatures(z, _sigmoid(z / want)), want, rtol=1e-6)


def test_fit_minimises_the_cross_entropy_of_hard_labels_over_a_grid():
    """Bernoulli labels: the fitted slope is the grid's best (the loss is convex in 1 / T), and
    with 50,000 rows it lands within 4 % of the temperature that drew them (the slope's
    standard error, 1 / sqrt(N · mean(s(1 − s)·z²)), is under 1 % for both)."""
    rng = np.random.default_rng(1)
    z = rng.normal(0.0, 3.0, (50_000, 2))
    drawn = np.array([2.0, 0.7])
    y = (rng.random(z.shape) < _sigmoid(z / drawn)).astype(np.float64)
    got = fit_temperatures(z, y)
    s = _sigmoid(z / drawn)
    assert (1 / np.sqrt(len(z) * np.mean(s * (1 - s) * z * z, axis=0)) * drawn < 0.01).all()
    for k in range(2):
        slopes = np.linspace(0.8, 1.2, 201) / drawn[k]  # ±20 % around the slope that drew them
        x = slopes[:, None] * z[None, :, k]
        loss = np.mean(np.logaddexp(0, x) - y[None, :, k] * x, axis=1)
        best = slopes[np.argmin(loss)]
        assert abs(1 / got[k] - best) <= slopes[1] - slopes[0], (got[k], 1 / best)
    np.testing.assert_allclose(got, drawn, rtol=0.04)


@pytest.mark.parametrize(
    ("scores", "labels", "message"),
    [
        (np.ones((3, 2)), np.ones((3, 3)) * 0.5, r"scores \(3, 2\) and labels \(3, 3\) must both be \[N >= 1, γ\]"),
        (np.ones(3), np.ones(3), r"must both be \[N >= 1, γ\]"),
        (np.array([[np.nan, 1.0]]), np.array([[0.5, 0.5]]), "must be finite"),
        (np.array([[1.0, 1.0]]), np.array([[1.5, 0.5]]), r"labels must lie in \[0, 1\]"),
        (  # slot 2 scores high where its labels are low
            np.array([[2.0, 2.0], [-2.0, -2.0]]),
            np.array([[0.9, 0.1], [0.1, 0.9]]),
            r"slot 2: no positive temperature lowers the cross-entropy .* = 0\.8, not < 0\): its confidence "
            r"scores are biased or do not rank its labels, and temperature scaling \(no offset\) cannot fix that",
        ),
        (  # slot 1 ranks its labels (higher score, more often 1) but every score sits far above 0
            np.array([[5.0], [4.0], [3.0], [2.0]]),
            np.array([[0.6], [0.4], [0.2], [0.0]]),
            r"slot 1: no positive temperature .* = 0\.45, not < 0\): its confidence scores are biased",
        ),
    ],
)
def test_fit_refuses_what_no_temperature_can_calibrate(scores, labels, message):
    with pytest.raises(ValueError, match=message):
        fit_temperatures(scores, labels)


def _without_confidence_head(draft, target) -> DSparkDraft:
    """A draft of ``draft``'s shape whose config has no confidence head."""
    return DSparkDraft(
        dataclasses.replace(draft.cfg, enable_confidence_head=False, confidence_head_with_markov=False),
        rngs=nnx.Rngs(0),
        embed_tokens=target.embed_tokens,
        lm_head=target.lm_head,
    )


@pytest.fixture(scope="module")
def bundled():
    target, draft, tokenizer = load_bundled("dspark")
    tokens = np.asarray(tokenizer.encode("def add(a, b):\n    return a + b\n\n\n" * 40), np.int32)
    return target, draft, tokens


@pytest.mark.parametrize("labels", ["sampling", "greedy"])
def test_sts_fit_lowers_each_slots_cross_entropy_and_applies_and_saves_its_temperatures(bundled, labels, tmp_path):
    target, bundled_draft, tokens = bundled
    draft = nnx.clone(bundled_draft)
    fit = fit_sts_temperature(draft, target, tokens, labels=labels, batches=1, batch_size=2, seq_len=48)
    gamma = draft.cfg.gamma
    assert fit.labels == labels and fit.blocks == 2 * len(range(1, 48 - draft.cfg.num_query_rows, 4))
    assert len(fit.temperatures) == gamma and all(np.isfinite(fit.temperatures)) and min(fit.temperatures) > 0
    assert all(after <= before + 1e-12 for before, after in zip(fit.bce_before, fit.bce_after, strict=True))
    assert len(fit.predicted) == len(fit.observed) == gamma
    assert all(0 <= o <= 1 for o in fit.observed)
    np.testing.assert_allclose(draft.confidence_head.sts_temperature[...], fit.temperatures, rtol=1e-6)
    again = fit_sts_temperature(draft, target, tokens, labels=labels, batches=1, batch_size=2, seq_len=48)
    np.testing.assert_allclose(again.temperatures, fit.temperatures, rtol=1e-9)  # raw scores: the old T is not read
    np.testing.assert_allclose(again.bce_before, fit.bce_after, rtol=1e-6)  # … except as the starting point
    save_draft(draft, tmp_path / "calibrated")
    loaded = load_draft(tmp_path / "calibrated", target=target)
    np.testing.assert_allclose(loaded.confidence_head.sts_temperature[...], fit.temperatures, rtol=1e-6)


def test_each_label_kind_fits_the_acceptance_it_names(bundled):
    """``"sampling"`` fits the chance T = 1 accepts (``Σ min(p, q)``), ``"greedy"`` the argmax
    match; swapping them passed every other test (each only checks that the fit helps)."""
    target, draft, tokens = bundled
    windows = dict(batches=1, batch_size=2, seq_len=48, seed=1)
    [(accept, match)] = map_heldout_blocks(draft, target, tokens, block_acceptance, **windows)
    assert not np.allclose(np.mean(accept, 0), np.mean(match, 0), atol=1e-3)  # the two differ here
    for labels, want in (("sampling", accept), ("greedy", match)):
        fit = fit_sts_temperature(draft, target, tokens, labels=labels, apply=False, **windows)
        np.testing.assert_allclose(fit.observed, np.mean(np.clip(want, 0, 1), 0), rtol=1e-6, atol=1e-7)


def test_sts_fit_without_apply_leaves_the_draft_alone(bundled):
    target, draft, tokens = bundled
    before = np.asarray(draft.confidence_head.sts_temperature[...])
    fit = fit_sts_temperature(draft, target, tokens, labels="greedy", batches=1, batch_size=2, seq_len=48, apply=False)
    assert not np.allclose(fit.temperatures, before)
    np.testing.assert_array_equal(draft.confidence_head.sts_temperature[...], before)


def test_sts_fit_refuses_bad_settings_by_name(bundled):
    target, draft, tokens = bundled
    with pytest.raises(ValueError, match=r"labels='argmax' is invalid: expected one of \('sampling', 'greedy'\)"):
        fit_sts_temperature(draft, target, tokens, labels="argmax")
    shortest = draft.cfg.num_query_rows + 2
    with pytest.raises(ValueError, match=f"seq_len={shortest - 1} is invalid: must be an integer >= {shortest}"):
        fit_sts_temperature(draft, target, tokens, seq_len=shortest - 1)
    with pytest.raises(ValueError, match=r"seq_len=513 exceeds max_position_embeddings \(draft 512, target 512\)"):
        fit_sts_temperature(draft, target, tokens, seq_len=513)  # ran quietly past the positions the models know
    with pytest.raises(ValueError, match="batches=0 is invalid"):
        fit_sts_temperature(draft, target, tokens, batches=0)
    with pytest.raises(TypeError, match="draft must be a DSparkDraft"):
        fit_sts_temperature(target, target, tokens)
    no_head = _without_confidence_head(draft, target)
    with pytest.raises(ValueError, match="the draft has no confidence head"):
        fit_sts_temperature(no_head, target, jnp.asarray(tokens))


# --------------------------------------------------------------------------- command line
def test_calibrate_command_writes_a_draft_carrying_the_fitted_temperatures(tmp_path, capsys):
    out = tmp_path / "calibrated"
    argv = ["calibrate", "--out", str(out), "--labels", "greedy", "--batches", "1", "--batch-size", "2"]
    assert main([*argv, "--seq-len", "48"]) == 0
    printed = capsys.readouterr().out
    info = json.loads((out / "calibration.json").read_text())
    fit = info["fit"]
    assert fit["labels"] == "greedy" and len(fit["temperatures"]) == 7
    rows = re.findall(r"^\| (\d) \| (\d+\.\d{4}) \|", printed, flags=re.M)
    assert [int(k) for k, _ in rows] == list(range(1, 8))
    np.testing.assert_allclose([float(t) for _, t in rows], fit["temperatures"], atol=5e-5)
    target, _, _ = load_bundled("dspark")
    loaded = load_draft(out, target=target)
    np.testing.assert_allclose(loaded.confidence_head.sts_temperature[...], fit["temperatures"], rtol=1e-6)
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"


def test_calibrate_command_refuses_an_out_holding_a_model_and_a_draft_without_a_confidence_head(
    bundled, tmp_path, capsys
):
    target, draft, _ = bundled
    taken = tmp_path / "taken"
    save_draft(draft, taken)
    assert main(["calibrate", "--out", str(taken)]) == 2
    err = capsys.readouterr().err
    assert f"--out {str(taken)!r} already holds a model (config.json, model.safetensors): give a new folder\n" in err
    no_head = _without_confidence_head(draft, target)
    save_draft(no_head, tmp_path / "no_head")
    assert main(["calibrate", "--draft", str(tmp_path / "no_head"), "--out", str(tmp_path / "out")]) == 2
    assert "has no confidence head (enable_confidence_head=False): nothing to calibrate" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_fit_refuses_a_slot_whose_cross_entropy_is_flat_at_zero_slope():
    """``mean((½ − y)·z) = 0``: the loss does not fall for any small 1 / T > 0 (labels of ½
    everywhere here), so no temperature is fitted (not merely a negative slope is refused)."""
    with pytest.raises(ValueError, match=r"slot 2: no positive temperature .* = 0, not < 0\)"):
        fit_temperatures(np.array([[1.0, 1.0], [-1.0, -1.0]]), np.array([[0.9, 0.5], [0.1, 0.5]]))


def test_sts_fit_reports_its_predictions_and_cross_entropies_at_the_temperatures(bundled):
    """``predicted`` is the mean of ``sigmoid(z / T)`` at the fitted ``T``; ``bce_before`` and
    ``bce_after`` the mean BCE against the labels at the draft's own (set to uneven values here,
    not 1) and the fitted temperatures, from the raw scores read here independently."""
    target, bundled_draft, tokens = bundled
    draft = nnx.clone(bundled_draft)
    gamma = draft.cfg.gamma
    draft.confidence_head.sts_temperature.set_value(jnp.linspace(0.5, 2.0, gamma, dtype=jnp.float32))
    windows = dict(batches=1, batch_size=2, seq_len=48, seed=1)
    [z] = map_heldout_blocks(draft, target, tokens, lambda blocks: blocks["confidence_logits"], **windows)
    [(_, match)] = map_heldout_blocks(draft, target, tokens, block_acceptance, **windows)
    z, y = np.asarray(z, np.float64), np.clip(np.asarray(match, np.float64), 0, 1)
    before = np.asarray(draft.confidence_head.sts_temperature[...], np.float64)
    fit = fit_sts_temperature(draft, target, tokens, labels="greedy", apply=False, **windows)
    fitted = np.asarray(fit.temperatures)

    def bce(t):
        x = z / t
        return np.mean(np.logaddexp(0, x) - y * x, axis=0)

    np.testing.assert_allclose(fit.predicted, np.mean(_sigmoid(z / fitted), axis=0), rtol=1e-6)
    np.testing.assert_allclose(fit.bce_after, bce(fitted), rtol=1e-6)
    np.testing.assert_allclose(fit.bce_before, bce(before), rtol=1e-6)


def test_calibrate_command_saves_the_weights_in_the_save_dtype(tmp_path):
    """The calibrated draft's weights are stored in ``--save-dtype`` (float16 by default), not only
    named so in its config: every tensor of ``model.safetensors`` has that dtype but the fitted
    temperatures, which the checkpoint keeps in float32."""
    out = tmp_path / "calibrated"
    argv = ["calibrate", "--out", str(out), "--labels", "greedy", "--batches", "1", "--batch-size", "2"]
    assert main([*argv, "--seq-len", "48"]) == 0
    raw = (out / "model.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    dtypes = {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}
    assert dtypes.pop("confidence_head.sts_temperature") == "F32"  # the fitted temperatures stay float32
    assert set(dtypes.values()) == {"F16"}, dtypes
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
