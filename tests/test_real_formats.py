"""The library's readers against the files users actually have today (tiny shapes, real field names).

Each fixture keeps the field names and nesting of a public file and shrinks only the sizes:

* ``Qwen/Qwen3-8B`` ``config.json`` (transformers 4.51 era: ``torch_dtype``, ``rope_theta``,
  ``rope_scaling: null``, ``use_sliding_window: false``, ``sliding_window: null``,
  ``max_window_layers``), and the same model saved by transformers 5 (``dtype``,
  ``rope_parameters``, ``layer_types``; ``Qwen3Config`` in huggingface/transformers
  ``src/transformers/models/qwen3/configuration_qwen3.py``).
* z-lab DFlash drafts (``z-lab/Qwen3-8B-DFlash-b16`` and later revisions, read by
  z-lab/dflash ``dflash/model.py``): the legacy layout (``block_size`` and ``rope_theta`` at the
  top, ``dflash_config: {mask_token_id, target_layer_ids}``) and the nested layout of the
  June 2026 revisions (``dflash_config.block_size``, ``rope_parameters``, ``layer_types`` with
  ``sliding_attention`` layers, ``sliding_window``).
* vllm-project/speculators exports (``src/speculators/models/dflash/config.py`` and
  ``.../dspark/config.py``): ``speculators_model_type``, ``transformer_layer_config`` (a
  transformers-5 ``Qwen3Config`` dict), ``aux_hidden_state_layer_ids``, ``draft_vocab_size``,
  ``target_hidden_size``, ``sliding_window_non_causal``, ``projector_type`` and the
  ``speculators_config`` block (``proposal_methods[].speculative_tokens``, ``verifier``), as in
  the published ``RedHatAI/*-speculator.dspark`` configs.
* DeepSpec's flat DSpark config (``architectures: ["Qwen3DSparkModel"]``, ``markov_rank``,
  ``markov_head_type``, ``enable_confidence_head``, ``confidence_head_with_markov``,
  ``num_anchors``; the source config speculators' ``DSparkConverter`` reads).
* A Qwen3 ``tokenizer.json`` ``added_tokens`` list (special and non-special added tokens).

Tests named ``test_gap_…`` pin what stop 58's audit of these formats found read wrongly
without a message (they failed on the code before it): causal or sliding-window draft layers,
DFlash scales and DFlash-2 fields, a missing DFlash ``block_size``, a speculators proposal
longer than γ, the Domino projector, and target features only ``load_target`` refused.
"""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import TRAINING_TARGET
from flax import nnx

from dspark_jax.checkpoint import load_draft, save_draft
from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.target import Qwen3Target, load_target, save_target
from dspark_jax.tokenizer import QWEN_PATTERN, Tokenizer, bytes_to_unicode, load_tokenizer

# ----------------------------------------------------------------------------- fixtures


def qwen3_8b_config() -> dict:
    """Qwen/Qwen3-8B config.json as released (transformers 4.51.0), every field kept."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 4096,
        "initializer_range": 0.02,
        "intermediate_size": 12288,
        "max_position_embeddings": 40960,
        "max_window_layers": 36,
        "model_type": "qwen3",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 1000000,
        "sliding_window": None,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.51.0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": 151936,
    }


def qwen3_8b_config_v5() -> dict:
    """The same model saved by transformers 5: ``dtype`` for ``torch_dtype``, the RoPE base inside
    ``rope_parameters``, ``layer_types`` written out (all full attention)."""
    hf = qwen3_8b_config()
    for name in ("rope_theta", "rope_scaling", "torch_dtype"):
        hf.pop(name)
    hf.update(
        dtype="bfloat16",
        rope_parameters={"rope_theta": 1000000, "rope_type": "default"},
        layer_types=["full_attention"] * 36,
        transformers_version="5.0.0",
    )
    return hf


def zlab_legacy() -> dict:
    """z-lab DFlash draft config, legacy layout (Qwen3-4B-DFlash-b16 era), tiny sizes."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": 16,
        "dflash_config": {"mask_token_id": 60, "target_layer_ids": [1, 3]},
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "num_target_layers": 5,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000,
        "rms_norm_eps": 1e-06,
        "tie_word_embeddings": True,
        "vocab_size": 64,
        "dtype": "bfloat16",
        "layer_types": ["full_attention", "full_attention"],
    }


def zlab_nested(layer_types=("sliding_attention", "full_attention")) -> dict:
    """z-lab DFlash draft config, nested layout of the June 2026 revisions: ``block_size`` inside
    ``dflash_config``, the RoPE base in ``rope_parameters``, mostly sliding layers."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 32,
        "num_hidden_layers": len(layer_types),
        "intermediate_size": 48,
        "num_attention_heads": 4,
        "rms_norm_eps": 1e-6,
        "vocab_size": 64,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "head_dim": 8,
        "tie_word_embeddings": False,
        "num_target_layers": 5,
        "sliding_window": 4096,
        "dflash_config": {"block_size": 16, "mask_token_id": 61, "target_layer_ids": [1, 2, 4]},
        "rope_parameters": {"rope_theta": 10_000_000.0, "rope_type": "default"},
        "layer_types": list(layer_types),
    }


def speculators_dspark(*, sliding: bool = False) -> dict:
    """A speculators DSpark export shaped like the published RedHatAI ``*-speculator.dspark``
    config.json (speculators 0.7, transformers 5.14), tiny sizes."""
    layers = 2
    return {
        "architectures": ["DSparkDraftModel"],
        "auto_map": {"": "config.DSparkSpeculatorConfig"},
        "aux_hidden_state_layer_ids": [2, 4, 5],
        "block_size": 8,
        "confidence_head_with_markov": True,
        "draft_vocab_size": 64,
        "dtype": "bfloat16",
        "enable_confidence_head": True,
        "markov_head_type": "vanilla",
        "markov_rank": 4,
        "mask_token_id": 62,
        "sample_from_anchor": True,
        "sliding_window_non_causal": False,
        "speculators_config": {
            "algorithm": "dspark",
            "default_proposal_method": "greedy",
            "proposal_methods": [
                {"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": 8, "verifier_accept_k": 1}
            ],
            "verifier": {"architectures": ["Qwen3ForCausalLM"], "name_or_path": "Qwen/Qwen3-8B"},
        },
        "speculators_model_type": "dspark",
        "speculators_version": "0.7.0.dev141",
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {
            "attention_bias": False,
            "attention_dropout": 0.0,
            "head_dim": 8,
            "hidden_act": "silu",
            "hidden_size": 32,
            "initializer_range": 0.02,
            "intermediate_size": 48,
            "layer_types": ["sliding_attention" if sliding else "full_attention"] * layers,
            "max_position_embeddings": 4096,
            "max_window_layers": 28,
            "model_type": "qwen3",
            "num_attention_heads": 4,
            "num_hidden_layers": layers,
            "num_key_value_heads": 2,
            "rms_norm_eps": 1e-05,
            "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "sliding_window": 2048 if sliding else None,
            "tie_word_embeddings": False,
            "use_cache": True,
            "use_sliding_window": sliding,
            "vocab_size": 64,
        },
        "transformers_version": "5.14.1",
    }


def speculators_dflash() -> dict:
    """A speculators DFlash export (``DFlashSpeculatorConfig``: ``projector_type``,
    ``shift_label``, ``sliding_window_non_causal``, no Markov fields), tiny sizes."""
    hf = speculators_dspark()
    for name in ("markov_rank", "markov_head_type", "enable_confidence_head", "confidence_head_with_markov"):
        hf.pop(name)
    hf.pop("sample_from_anchor")
    hf.update(
        architectures=["DFlashSpeculator"],
        speculators_model_type="dflash",
        projector_type="dflash",
        shift_label=False,
        pure_draft_prefix_len=1,
    )
    hf["speculators_config"]["algorithm"] = "dflash"
    hf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    return hf


def deepspec_flat() -> dict:
    """DeepSpec's own DSpark config: algorithm fields flat at the top level (no dflash_config),
    as speculators' DSparkConverter reads it."""
    return {
        "model_type": "qwen3",
        "architectures": ["Qwen3DSparkModel"],
        "block_size": 16,
        "mask_token_id": 63,
        "target_layer_ids": [1, 2, 4],
        "num_anchors": 512,
        "markov_rank": 8,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rope_theta": 1000000,
        "torch_dtype": "bfloat16",
    }


# ----------------------------------------------------------------------------- target


def test_released_qwen3_8b_config_reads_as_the_model():
    """Qwen/Qwen3-8B's config.json: every shape, the RoPE base and the untied head."""
    cfg = TargetConfig.from_hf_config(qwen3_8b_config())
    assert (cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers) == (4096, 12288, 36)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (32, 8, 128)
    assert (cfg.vocab_size, cfg.max_position_embeddings, cfg.rms_norm_eps) == (151936, 40960, 1e-6)
    assert cfg.rope_theta == 1_000_000 and cfg.tie_word_embeddings is False


def test_transformers5_qwen3_config_reads_like_the_transformers4_one():
    """transformers 5 writes ``dtype`` and ``rope_parameters`` (no top-level ``rope_theta``) and
    lists ``layer_types``; the config is the same model."""
    assert TargetConfig.from_hf_config(qwen3_8b_config_v5()) == TargetConfig.from_hf_config(qwen3_8b_config())


@pytest.mark.parametrize(
    "field, value",
    [("use_sliding_window", True), ("hidden_act", "gelu"), ("model_type", "llama")],
)
def test_gap_target_config_refuses_what_load_target_refuses(field, value):
    """Gap: ``load_target`` refuses these, but ``TargetConfig.from_hf_config`` /
    ``from_pretrained`` (public) accepted them and built a config for a different model."""
    hf = qwen3_8b_config_v5() | {field: value}
    if field == "use_sliding_window":
        hf["sliding_window"] = 4096
    with pytest.raises(ValueError, match=field):
        TargetConfig.from_hf_config(hf)


@pytest.mark.parametrize("shard", [False, True], ids=["single", "sharded"])
def test_load_target_reads_a_transformers5_checkpoint_folder(tmp_path, shard):
    """A transformers 5 save: ``dtype`` (no ``torch_dtype``) sets the parameter dtype,
    ``rope_parameters`` the RoPE base; single-file and sharded (index) layouts."""
    target = Qwen3Target(TRAINING_TARGET, rngs=nnx.Rngs(0))  # 2 layers, a tied embedding
    save_target(target, tmp_path, max_shard_bytes=4096 if shard else None)
    assert (tmp_path / ("model.safetensors.index.json" if shard else "model.safetensors")).is_file()
    hf = json.loads((tmp_path / "config.json").read_text())
    rope = hf.pop("rope_theta")
    hf.pop("torch_dtype")
    hf.update(
        dtype="bfloat16",
        rope_parameters={"rope_theta": rope, "rope_type": "default"},
        layer_types=["full_attention"] * 2,
        use_sliding_window=False,
        sliding_window=None,
        max_window_layers=2,
        hidden_act="silu",
        transformers_version="5.0.0",
    )
    (tmp_path / "config.json").write_text(json.dumps(hf))
    loaded = load_target(tmp_path)
    assert loaded.config.dtype == "bfloat16" and loaded.config.rope_theta == rope
    assert loaded.embed_tokens.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(loaded.embed_tokens, np.float32),
        np.asarray(jnp.asarray(target.embed_tokens).astype(jnp.bfloat16), np.float32),
    )


# ----------------------------------------------------------------------------- z-lab DFlash


def test_zlab_legacy_config_reads_as_dflash():
    """Legacy z-lab layout: 16 query rows = anchor + 15 drafts, DFlash layout, no Markov head."""
    cfg = DraftConfig.from_hf_config(zlab_legacy())
    assert cfg.gamma == 15 and cfg.num_query_rows == 16 and cfg.sample_from_anchor is False
    assert cfg.target_layer_ids == (1, 3) and cfg.mask_token_id == 60 and cfg.num_target_layers == 5
    assert cfg.markov_rank == 0 and cfg.rope_theta == 1_000_000


def test_zlab_nested_config_with_full_attention_reads_block_size_and_rope_from_their_new_places():
    """June 2026 layout (all layers full attention): ``dflash_config.block_size`` and
    ``rope_parameters.rope_theta``."""
    cfg = DraftConfig.from_hf_config(zlab_nested(layer_types=("full_attention", "full_attention")))
    assert cfg.gamma == 15 and cfg.rope_theta == 10_000_000.0
    assert cfg.target_layer_ids == (1, 2, 4) and cfg.mask_token_id == 61


def test_gap_zlab_sliding_attention_layers_are_refused():
    """Gap: z-lab's DFlash attention makes a ``sliding_attention`` layer causal inside the block
    (``is_causal`` unset) and windowed; this library's draft attends to the whole block and the
    whole context, so such a file was read as a different model without a word."""
    with pytest.raises(ValueError, match="layer_types"):
        DraftConfig.from_hf_config(zlab_nested())


def test_gap_zlab_is_causal_true_is_refused():
    """Gap: z-lab/dflash reads a top-level ``is_causal`` (true: causal block attention)."""
    with pytest.raises(ValueError, match="is_causal"):
        DraftConfig.from_hf_config(zlab_legacy() | {"is_causal": True})


def test_zlab_is_causal_false_is_the_bidirectional_block():
    assert DraftConfig.from_hf_config(zlab_legacy() | {"is_causal": False}).gamma == 15


@pytest.mark.parametrize(
    "field, value",
    [("input_embedding_scale", 2.0), ("output_multiplier", 0.2), ("final_logit_softcapping", 30.0)],
)
def test_gap_zlab_logit_and_embedding_scales_are_refused(field, value):
    """Gap: z-lab/dflash scales the noise embeddings by ``dflash_config.input_embedding_scale`` and
    the logits by ``output_multiplier`` then soft-caps them; ignoring these proposes from other
    distributions (and breaks the draft q of rejection sampling)."""
    hf = zlab_legacy()
    hf["dflash_config"][field] = value
    with pytest.raises(ValueError, match=field):
        DraftConfig.from_hf_config(hf)


def test_zlab_neutral_scales_are_accepted():
    hf = zlab_legacy()
    hf["dflash_config"].update(input_embedding_scale=1.0, output_multiplier=1.0, final_logit_softcapping=None)
    assert DraftConfig.from_hf_config(hf).gamma == 15


def test_gap_zlab_dflash2_config_is_refused_at_the_config():
    """Gap: a DFlash-2 draft (``DFlash2DraftModel``: grouped causal convolutions and a candidate
    selector configured in ``dflash_config``) was taken for plain DFlash."""
    hf = zlab_legacy()
    hf["architectures"] = ["DFlash2DraftModel"]
    hf["dflash_config"].update(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4)
    with pytest.raises(ValueError, match="DFlash2DraftModel|selector_rank|conv_kernel_size"):
        DraftConfig.from_hf_config(hf)


def test_gap_zlab_file_without_block_size_gets_zlabs_default():
    """Gap: z-lab/dflash reads a missing ``block_size`` as 16 query rows (γ = 15); the library
    gave its own default γ = 7."""
    hf = zlab_legacy()
    hf.pop("block_size")
    assert DraftConfig.from_hf_config(hf).gamma == 15


def test_load_draft_reads_a_zlab_folder(tmp_path):
    """A z-lab-layout folder (``dflash_config``, transformers-5 ``dtype``, tied embeddings, the
    borrowed tables stored) loads with the DFlash slot layout."""
    cfg = DraftConfig.from_hf_config(zlab_legacy())
    rngs = nnx.Rngs(0)
    embed = jnp.asarray(np.random.default_rng(0).normal(size=(64, 32)), jnp.float32)
    draft = DSparkDraft(cfg, rngs=rngs, embed_tokens=embed, lm_head=embed)
    save_draft(draft, tmp_path, include_borrowed=True)
    (tmp_path / "config.json").write_text(json.dumps(zlab_legacy()))
    loaded = load_draft(tmp_path, layout="dflash")
    assert loaded.cfg.gamma == 15 and loaded.cfg.layout == "dflash"
    np.testing.assert_array_equal(np.asarray(loaded.embed_tokens[...]), np.asarray(embed))


# ----------------------------------------------------------------------------- speculators


def test_speculators_dspark_export_reads_correctly():
    """Published speculators DSpark layout (full attention): anchor layout from the file,
    hidden_states indices shifted to layer ids, the backbone from ``transformer_layer_config``
    (transformers-5 ``rope_parameters``), a null ``target_hidden_size`` accepted."""
    cfg = DraftConfig.from_hf_config(speculators_dspark())
    assert cfg.gamma == 8 and cfg.sample_from_anchor is True
    assert cfg.target_layer_ids == (1, 3, 4)
    assert cfg.rope_theta == 10000.0 and cfg.rms_norm_eps == 1e-5
    assert (cfg.markov_rank, cfg.enable_confidence_head, cfg.confidence_head_with_markov) == (4, True, True)


def test_gap_speculators_sliding_window_layers_are_refused():
    """Gap: the published RedHatAI DSpark export has ``layer_types`` all ``sliding_attention`` with
    ``use_sliding_window: true`` and ``sliding_window_non_causal: false`` (causal, windowed block
    attention in speculators); it was read as full bidirectional attention."""
    with pytest.raises(ValueError, match="layer_types|sliding"):
        DraftConfig.from_hf_config(speculators_dspark(sliding=True))


def test_speculators_dflash_export_reads_as_dflash():
    """``DFlashSpeculatorConfig``: block_size 8 rows = anchor + 7 drafts (its proposal's
    ``speculative_tokens`` 7), no Markov head."""
    cfg = DraftConfig.from_hf_config(speculators_dflash())
    assert cfg.gamma == 7 and cfg.sample_from_anchor is False and cfg.markov_rank == 0


def test_gap_speculators_proposal_longer_than_gamma_is_refused():
    """Gap: a DSpark export that does not state ``sample_from_anchor`` but proposes
    ``speculative_tokens`` = ``block_size`` drafts is an anchor-layout draft; read with the DFlash
    default it lost a draft slot and shifted every slot by one."""
    hf = speculators_dspark()
    hf.pop("sample_from_anchor")
    with pytest.raises(ValueError, match="speculative_tokens"):
        DraftConfig.from_hf_config(hf)


def test_speculators_proposal_within_gamma_is_accepted():
    hf = speculators_dspark()
    hf.pop("sample_from_anchor")
    hf["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 7
    assert DraftConfig.from_hf_config(hf).gamma == 7


@pytest.mark.parametrize(
    "field, value", [("projector_type", "domino"), ("shift_label", True)], ids=["domino", "shift-label"]
)
def test_gap_speculators_domino_projector_is_refused(field, value):
    """Gap: speculators' Domino projector (``projector_type: "domino"``, which sets
    ``shift_label``) adds a correction head and shifts the training targets by one position."""
    hf = speculators_dflash() | {field: value}
    with pytest.raises(ValueError, match=field):
        DraftConfig.from_hf_config(hf)


def test_speculators_reduced_draft_vocabulary_is_refused():
    hf = speculators_dflash() | {"draft_vocab_size": 32}
    with pytest.raises(ValueError, match="draft_vocab_size"):
        DraftConfig.from_hf_config(hf)


# ----------------------------------------------------------------------------- DeepSpec


def test_deepspec_flat_config_reads_as_dspark():
    """DeepSpec's flat config: the anchor layout (γ = block_size), Markov and confidence heads,
    ``target_layer_ids`` as layer ids; ``num_anchors`` (training only) ignored."""
    cfg = DraftConfig.from_hf_config(deepspec_flat())
    assert cfg.gamma == 16 and cfg.sample_from_anchor is True
    assert cfg.target_layer_ids == (1, 2, 4)
    assert (cfg.markov_rank, cfg.markov_head_type) == (8, "vanilla")
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov


# ----------------------------------------------------------------------------- tokenizer


def test_qwen3_added_tokens_special_or_not_encode_as_one_id(tmp_path):
    """Qwen3's ``added_tokens`` mixes special (``<|im_start|>``) and non-special (``<think>``)
    entries, each with ``normalized: false``; Hugging Face splits both out of the text as one id."""
    char = bytes_to_unicode()
    vocab = {c: b for b, c in char.items()}
    data = Tokenizer(vocab, [], [], pattern=QWEN_PATTERN, normalizer="NFC").to_json()
    data["model"].update(continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    data["post_processor"] = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    added = [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True), ("<think>", False)]
    data["added_tokens"] = [
        {
            "id": 256 + j,
            "content": content,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": special,
        }
        for j, (content, special) in enumerate(added)
    ]
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(data))
    tok = load_tokenizer(path)
    ids = tok.encode("<|im_start|>a<think>b<|im_end|>")
    assert ids == [257, vocab["a"], 259, vocab["b"], 258]
    assert tok.decode(ids) == "<|im_start|>a<think>b<|im_end|>"
    assert tok.eos_id == 256
