"""Shipped presets: their shapes, the package copy, and the 8B draft's abstract build."""

from __future__ import annotations

import json
import pathlib
import re

import jax
import pytest
from flax import nnx

from dspark_jax.config import DraftConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.presets import list_presets, load_preset, preset_hf_config

ROOT = pathlib.Path(__file__).resolve().parents[1]

# Public Qwen3 target shapes (Hugging Face config.json of Qwen3-4B / 8B / 14B): the draft
# shares the target's hidden size, head layout and vocabulary.
RELEASED = {
    "dspark_qwen3_4b_block7": dict(hidden=2560, heads=32, inter=9728, ids=(1, 9, 17, 25, 33), depth=36),
    "dspark_qwen3_8b_block7": dict(hidden=4096, heads=32, inter=12288, ids=(1, 9, 17, 25, 33), depth=36),
    "dspark_qwen3_14b_block7": dict(hidden=5120, heads=40, inter=17408, ids=(1, 10, 19, 28, 37), depth=40),
}


def test_every_preset_is_listed_and_shipped_inside_the_package():
    assert list_presets() == sorted([*RELEASED, "tiny"])
    for name in list_presets():
        top = (ROOT / "configs" / f"{name}.json").read_bytes()
        packaged = (ROOT / "dspark_jax" / "configs" / f"{name}.json").read_bytes()
        assert top == packaged, f"configs/{name}.json and dspark_jax/configs/{name}.json differ"
    assert sorted(p.stem for p in (ROOT / "configs").glob("*.json")) == list_presets()


@pytest.mark.parametrize("name", sorted(RELEASED))
def test_released_presets_have_the_released_draft_shapes(name):
    want = RELEASED[name]
    cfg = load_preset(name)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.intermediate_size) == (
        want["hidden"],
        want["heads"],
        want["inter"],
    )
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (5, 8, 128)
    assert (cfg.vocab_size, cfg.mask_token_id, cfg.markov_rank, cfg.markov_head_type) == (
        151936,
        151669,
        256,
        "vanilla",
    )
    assert cfg.target_layer_ids == want["ids"] and cfg.num_target_layers == want["depth"]
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    assert cfg.sample_from_anchor and cfg.gamma == 7


def test_preset_files_are_in_the_deepspec_form_they_round_trip_through():
    for name in list_presets():
        cfg = load_preset(name)
        assert DraftConfig.from_hf_config(json.loads(json.dumps(cfg.to_hf_config()))) == cfg
        assert preset_hf_config(name)["block_size"] == cfg.num_query_rows


def test_preset_overrides_and_unknown_names():
    assert load_preset("tiny", dtype="bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match=r"preset='qwen9' is unknown: must be one of \['dspark_qwen3_14b_block7'"):
        load_preset("qwen9")


def closed_form_trainable_params(cfg: DraftConfig) -> int:
    """Parameters the draft owns (``nnx.Param``), from the spec's shapes.

    Counted: per layer q/k/v/o projections, q/k norms, SwiGLU MLP, two layer norms; fc,
    hidden_norm, final norm; the two Markov tables; the confidence head (weight + bias).
    Not counted: the borrowed target ``embed_tokens`` / ``lm_head`` (Borrowed variables,
    2 × V × H) and the STS temperature (a Calibration constant, γ values).
    """
    h, i, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    nh, kvh, k, v, r = (
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.num_fused_layers,
        cfg.vocab_size,
        cfg.markov_rank,
    )
    attention = h * nh * d + 2 * h * kvh * d + nh * d * h + 2 * d
    layer = attention + 3 * h * i + 2 * h
    fusion = k * h * h + h
    markov = 2 * v * r
    confidence = (h + r) + 1
    return cfg.num_hidden_layers * layer + fusion + h + markov + confidence


def test_8b_preset_builds_abstractly_with_the_closed_form_parameter_count():
    cfg = load_preset("dspark_qwen3_8b_block7")
    abstract = nnx.eval_shape(lambda: DSparkDraft(cfg, rngs=nnx.Rngs(0)))
    params = nnx.state(abstract, nnx.Param)
    leaves = jax.tree.leaves(params)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)  # nothing allocated
    counted = sum(x.size for x in leaves)
    assert counted == closed_form_trainable_params(cfg)
    # 5 × 192,946,432 (layers) + 83,886,080 (fc) + 8,192 (norms) + 77,791,232 (Markov) + 4,353 (confidence)
    assert counted == 1_126_422_017


def test_a_malformed_preset_file_is_named_with_its_path(tmp_path, monkeypatch):
    from dspark_jax import presets

    (tmp_path / "broken.json").write_text("{not json")
    monkeypatch.setattr(presets, "_folder", lambda: tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"preset file {str(tmp_path / 'broken.json')!r} is not valid JSON")):
        load_preset("broken")
