"""DraftConfig / TargetConfig: the three config.json forms and every validation message."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import numpy as np
import pytest
from draft_testing import TINY, tiny_config

from dspark_jax.config import DraftConfig, TargetConfig

QWEN3_8B = {
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000,
    "max_position_embeddings": 40960,
    "model_type": "qwen3",
}


def deepspec_dict(**extra) -> dict:
    return {
        **QWEN3_8B,
        "num_hidden_layers": 5,
        "block_size": 7,
        "mask_token_id": 151669,
        "target_layer_ids": [1, 9, 17, 25, 33],
        "num_target_layers": 36,
        "markov_rank": 256,
        "markov_head_type": "vanilla",
        "enable_confidence_head": True,
        "confidence_head_with_markov": True,
        **extra,
    }


def test_deepspec_form_reads_every_draft_field():
    cfg = DraftConfig.from_hf_config(deepspec_dict())
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4096, 32, 8, 128)
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33) and cfg.num_target_layers == 36
    assert (cfg.markov_rank, cfg.markov_head_type) == (256, "vanilla")
    assert cfg.enable_confidence_head and cfg.confidence_head_with_markov
    # DeepSpec files default to the anchor layout: γ = block_size = rows.
    assert cfg.sample_from_anchor and cfg.layout == "anchor"
    assert cfg.gamma == 7 and cfg.num_query_rows == 7 and cfg.num_fused_layers == 5


def test_deepspec_form_with_explicit_dflash_layout_counts_the_anchor_row():
    cfg = DraftConfig.from_hf_config(deepspec_dict(sample_from_anchor=False, block_size=8))
    assert not cfg.sample_from_anchor and cfg.layout == "dflash"
    assert cfg.gamma == 7 and cfg.num_query_rows == 8


def test_nested_dflash_config_form_is_a_headless_dflash_layout_draft():
    hf = {
        **QWEN3_8B,
        "num_hidden_layers": 5,
        "block_size": 16,
        "num_target_layers": 36,
        "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]},
    }
    cfg = DraftConfig.from_hf_config(hf)
    assert cfg.mask_token_id == 151669 and cfg.target_layer_ids == (1, 9, 17, 25, 33)
    assert cfg.markov_rank == 0 and not cfg.has_markov_head
    # DFlash's block size 16 is the anchor plus 15 drafts.
    assert not cfg.sample_from_anchor and cfg.gamma == 15 and cfg.num_query_rows == 16


def test_nested_block_size_is_read_when_the_top_level_has_none():
    hf = {
        **QWEN3_8B,
        "num_hidden_layers": 1,
        "dflash_config": {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [0]},
    }
    assert DraftConfig.from_hf_config(hf).gamma == 7


def test_a_top_level_value_and_a_nested_one_that_disagree_are_refused():
    """Which of the two won was nowhere written (the top level did); equal ones are fine."""
    nested = {"block_size": 8, "mask_token_id": 5, "target_layer_ids": [0]}
    hf = {**QWEN3_8B, "num_hidden_layers": 1, "dflash_config": nested}
    assert DraftConfig.from_hf_config({**hf, "block_size": 8, "target_layer_ids": [0]}).gamma == 7
    for name, other in (("block_size", 16), ("mask_token_id", 6), ("target_layer_ids", [1])):
        says = f"{name}={other!r} and dflash_config.{name}={nested[name]!r} disagree"
        with pytest.raises(ValueError, match=re.escape(says)):
            DraftConfig.from_hf_config({**hf, name: other})


def speculators_dict(**extra) -> dict:
    return {
        "speculators_model_type": "dflash",
        "architectures": ["DFlashSpeculator"],
        "transformer_layer_config": {**QWEN3_8B, "num_hidden_layers": 5},
        "draft_vocab_size": 151936,
        "block_size": 8,
        "mask_token_id": 151669,
        "aux_hidden_state_layer_ids": [2, 10, 18, 26, 34],
        **extra,
    }


def test_speculators_form_shifts_layer_ids_and_uses_the_dflash_layout():
    cfg = DraftConfig.from_hf_config(speculators_dict())
    assert cfg.hidden_size == 4096 and cfg.num_hidden_layers == 5
    assert cfg.target_layer_ids == (1, 9, 17, 25, 33)  # hidden_states index i+1 is layer i
    assert not cfg.sample_from_anchor and cfg.gamma == 7 and cfg.num_query_rows == 8
    assert cfg.markov_rank == 0


def test_speculators_form_honours_sample_from_anchor_and_markov_fields():
    cfg = DraftConfig.from_hf_config(
        speculators_dict(sample_from_anchor=True, block_size=7, markov_rank=256, markov_head_type="rnn")
    )
    assert cfg.sample_from_anchor and cfg.gamma == 7 and cfg.num_query_rows == 7
    assert (cfg.markov_rank, cfg.markov_head_type) == (256, "rnn")


def test_aux_layer_id_zero_is_the_embedding_output():
    cfg = DraftConfig.from_hf_config(speculators_dict(aux_hidden_state_layer_ids=[0, 3]))
    assert cfg.target_layer_ids == (-1, 2)
    deepest = DraftConfig.from_hf_config(speculators_dict(aux_hidden_state_layer_ids=[2, 36], num_target_layers=36))
    assert deepest.target_layer_ids == (1, 35)


@pytest.mark.parametrize("anchor", [True, False])
def test_to_hf_config_round_trips_both_layouts(anchor, tmp_path):
    cfg = tiny_config(sample_from_anchor=anchor, markov_head_type="gated")
    hf = json.loads(json.dumps(cfg.to_hf_config()))
    assert hf["block_size"] == cfg.num_query_rows
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    assert DraftConfig.from_pretrained(tmp_path) == cfg
    assert DraftConfig.from_pretrained(path) == cfg


def test_overrides_replace_file_values():
    cfg = DraftConfig.from_hf_config(deepspec_dict(), dtype="bfloat16", param_dtype="bfloat16", block_size=3)
    assert cfg.dtype == "bfloat16" and cfg.jnp_dtype.__name__ == "bfloat16" and cfg.gamma == 3


def test_list_layer_ids_become_a_hashable_tuple():
    cfg = tiny_config(target_layer_ids=[0, 2])
    assert cfg.target_layer_ids == (0, 2) and hash(cfg) == hash(tiny_config(target_layer_ids=(0, 2)))


def _message(field, value, allowed) -> str:
    return re.escape(f"{field}={value!r} is invalid: ") + ".*" + re.escape(allowed)


# (overrides, field, value, allowed-text)
DRAFT_ERRORS = [
    ({"hidden_size": 0}, "hidden_size", 0, "integer >= 1"),
    ({"intermediate_size": 2.5}, "intermediate_size", 2.5, "integer >= 1"),
    ({"num_hidden_layers": True}, "num_hidden_layers", True, "integer >= 1"),
    ({"num_attention_heads": -4}, "num_attention_heads", -4, "integer >= 1"),
    ({"num_key_value_heads": 3}, "num_key_value_heads", 3, "must divide num_attention_heads=4"),
    ({"head_dim": 7}, "head_dim", 7, "must be even"),
    ({"vocab_size": 0}, "vocab_size", 0, "integer >= 1"),
    ({"max_position_embeddings": 0}, "max_position_embeddings", 0, "integer >= 1"),
    ({"rms_norm_eps": 0.0}, "rms_norm_eps", 0.0, "a finite number > 0"),
    ({"rms_norm_eps": math.inf}, "rms_norm_eps", math.inf, "a finite number > 0"),
    ({"rope_theta": -1.0}, "rope_theta", -1.0, "a finite number > 0"),
    ({"rope_theta": math.inf}, "rope_theta", math.inf, "a finite number > 0"),
    ({"attention_bias": "no"}, "attention_bias", "no", "True or False"),
    ({"dtype": "float64"}, "dtype", "float64", "['bfloat16', 'float16', 'float32']"),
    ({"param_dtype": "int8"}, "param_dtype", "int8", "['bfloat16', 'float16', 'float32']"),
    ({"dtype": ["float32"]}, "dtype", ["float32"], "['bfloat16', 'float16', 'float32']"),
    ({"block_size": 0}, "block_size", 0, "integer >= 1"),
    ({"mask_token_id": 40}, "mask_token_id", 40, "0 <= id < vocab_size=40"),
    ({"mask_token_id": -1}, "mask_token_id", -1, "0 <= id < vocab_size=40"),
    ({"mask_token_id": None}, "mask_token_id", None, "0 <= id < vocab_size=40"),
    ({"target_layer_ids": ()}, "target_layer_ids", (), "non-empty sequence of integers"),
    ({"target_layer_ids": (0, 1.5)}, "target_layer_ids", (0, 1.5), "non-empty sequence of integers"),
    ({"target_layer_ids": (2, 1)}, "target_layer_ids", (2, 1), "strictly increasing"),
    ({"target_layer_ids": (1, 1)}, "target_layer_ids", (1, 1), "strictly increasing"),
    ({"target_layer_ids": (-2, 0)}, "target_layer_ids", (-2, 0), ">= -1 (-1 is the embedding output)"),
    ({"target_layer_ids": (0, 3)}, "target_layer_ids", (0, 3), "-1 <= id < num_target_layers=3"),
    ({"num_target_layers": 0}, "num_target_layers", 0, "integer >= 1"),
    ({"markov_rank": -1}, "markov_rank", -1, "integer >= 0 (0 = DFlash-style, no Markov head)"),
    ({"markov_head_type": "lstm"}, "markov_head_type", "lstm", "('vanilla', 'gated', 'rnn')"),
    ({"enable_confidence_head": 1}, "enable_confidence_head", 1, "True or False"),
    ({"sample_from_anchor": "yes"}, "sample_from_anchor", "yes", "True or False"),
    (
        {"enable_confidence_head": False, "confidence_head_with_markov": True},
        "confidence_head_with_markov",
        True,
        "needs enable_confidence_head=True",
    ),
    ({"markov_rank": 0}, "confidence_head_with_markov", True, "needs a Markov head (markov_rank > 0)"),
]


@pytest.mark.parametrize(("overrides", "field", "value", "allowed"), DRAFT_ERRORS, ids=lambda x: str(x)[:40])
def test_draft_config_rejects_bad_values_naming_field_value_and_allowed(overrides, field, value, allowed):
    with pytest.raises(ValueError, match=_message(field, value, allowed)):
        DraftConfig(**{**TINY, **overrides})


def test_target_config_validates_like_the_draft():
    base = dict(
        hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=4, vocab_size=10,
    )  # fmt: skip
    with pytest.raises(ValueError, match=_message("num_key_value_heads", 3, "must divide num_attention_heads=2")):
        TargetConfig(**{**base, "num_key_value_heads": 3})
    with pytest.raises(ValueError, match=_message("tie_word_embeddings", "yes", "True or False")):
        TargetConfig(**{**base, "tie_word_embeddings": "yes"})
    with pytest.raises(ValueError, match=_message("param_dtype", ["float32"], "['bfloat16', 'float16', 'float32']")):
        TargetConfig(**{**base, "param_dtype": ["float32"]})


HF_ERRORS = [
    (lambda: deepspec_dict(mask_token_id=151936), "mask_token_id", 151936,
     "0 <= id < vocab_size=151936"),
    (lambda: speculators_dict(draft_vocab_size=32000), "draft_vocab_size", 32000,
     "a reduced draft vocabulary (d2t/t2d mapping) is not supported"),
    (lambda: speculators_dict(target_hidden_size=2560), "target_hidden_size", 2560,
     "must equal the draft hidden_size=4096"),
    (lambda: speculators_dict(aux_hidden_state_layer_ids="2,10"), "aux_hidden_state_layer_ids", "2,10",
     "must be a non-empty list of integers"),
    (lambda: speculators_dict(aux_hidden_state_layer_ids=[]), "aux_hidden_state_layer_ids", [],
     "must be a non-empty list of integers"),
    (lambda: speculators_dict(aux_hidden_state_layer_ids=[-1, 3]), "aux_hidden_state_layer_ids", [-1, 3],
     "must be >= 0 (HF hidden_states index 0 is the embedding output)"),
    (lambda: speculators_dict(aux_hidden_state_layer_ids=[3, 1]), "aux_hidden_state_layer_ids", [3, 1],
     "must be strictly increasing"),
    (lambda: speculators_dict(aux_hidden_state_layer_ids=[2, 37], num_target_layers=36),
     "aux_hidden_state_layer_ids", [2, 37], "0 <= id <= num_target_layers=36"),
    (lambda: speculators_dict(block_size=1), "block_size", 1,
     "counts the anchor row, so it must be >= 2"),
    (lambda: deepspec_dict(dflash_config=[1]), "dflash_config", [1], "must be a dict"),
    (lambda: deepspec_dict(target_layer_ids=[1, 9, 17, 25, 36]), "target_layer_ids", (1, 9, 17, 25, 36),
     "num_target_layers=36"),
]  # fmt: skip


def _case_id(value):
    """A parameter's test id: stable between collections (a lambda's repr holds its address)."""
    return "make" if callable(value) else str(value)[:30]


@pytest.mark.parametrize(("make", "field", "value", "allowed"), HF_ERRORS, ids=_case_id)
def test_from_hf_config_rejects_bad_files_naming_field_value_and_allowed(make, field, value, allowed):
    with pytest.raises(ValueError, match=_message(field, value, allowed)):
        DraftConfig.from_hf_config(make())


def test_from_hf_config_names_missing_fields_and_wrong_types(tmp_path):
    without_mask = deepspec_dict()
    del without_mask["mask_token_id"]
    with pytest.raises(ValueError, match="draft config is missing the required field 'mask_token_id'"):
        DraftConfig.from_hf_config(without_mask)
    without_hidden = deepspec_dict()
    del without_hidden["hidden_size"]
    with pytest.raises(ValueError, match="draft config is missing the required field 'hidden_size'"):
        DraftConfig.from_hf_config(without_hidden)
    with pytest.raises(ValueError, match="speculators config needs a 'transformer_layer_config' dict, got NoneType"):
        DraftConfig.from_hf_config(speculators_dict(transformer_layer_config=None))
    with pytest.raises(TypeError, match="hf config must be a dict, got list"):
        DraftConfig.from_hf_config([])
    with pytest.raises(ValueError, match="does not exist: expected a config.json or its folder"):
        DraftConfig.from_pretrained(tmp_path / "nowhere")


@pytest.mark.parametrize(
    "make",
    [
        lambda: deepspec_dict(rope_scaling={"type": "yarn", "factor": 4}),
        lambda: speculators_dict(
            transformer_layer_config={**QWEN3_8B, "num_hidden_layers": 5, "rope_scaling": {"type": "yarn", "factor": 4}}
        ),
    ],
    ids=["deepspec", "speculators"],
)
def test_rope_scaling_in_a_draft_file_is_refused_not_ignored(make):
    with pytest.raises(ValueError, match=_message("rope_scaling", {"type": "yarn", "factor": 4}, "not supported")):
        DraftConfig.from_hf_config(make())
    assert DraftConfig.from_hf_config(deepspec_dict(rope_scaling=None)) == DraftConfig.from_hf_config(deepspec_dict())


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_attention_heads", 0), ("num_attention_heads", "32"), ("hidden_size", "4096")],
    ids=str,
)
@pytest.mark.parametrize("form", ["target", "deepspec", "speculators"])
def test_head_dim_is_derived_only_from_valid_fields(form, field, value):
    def drop_head_dim(hf: dict) -> dict:
        return {k: v for k, v in hf.items() if k != "head_dim"}

    bad = drop_head_dim({**QWEN3_8B, "num_hidden_layers": 5, field: value})
    read = {
        "target": lambda: TargetConfig.from_hf_config(bad),
        "deepspec": lambda: DraftConfig.from_hf_config(drop_head_dim(deepspec_dict(**{field: value}))),
        "speculators": lambda: DraftConfig.from_hf_config(speculators_dict(transformer_layer_config=bad)),
    }[form]
    with pytest.raises(ValueError, match=_message(field, value, "must be an integer >= 1")):
        read()
    assert DraftConfig.from_hf_config(drop_head_dim(deepspec_dict())).head_dim == 128


def test_target_from_hf_config_reads_tie_word_embeddings_strictly():
    hf = {**QWEN3_8B, "num_hidden_layers": 2}
    with pytest.raises(ValueError, match=_message("tie_word_embeddings", "false", "True or False")):
        TargetConfig.from_hf_config({**hf, "tie_word_embeddings": "false"})
    assert TargetConfig.from_hf_config({**hf, "tie_word_embeddings": True}).tie_word_embeddings is True
    assert TargetConfig.from_hf_config({**hf, "tie_word_embeddings": None}).tie_word_embeddings is False
    assert TargetConfig.from_hf_config(hf).tie_word_embeddings is False


def test_numpy_scalars_are_accepted_and_stored_as_python_numbers():
    as_numpy = {k: np.int64(v) if type(v) is int else v for k, v in TINY.items()}
    as_numpy["rope_theta"] = np.float32(10_000.0)
    as_numpy["target_layer_ids"] = tuple(np.int64(i) for i in TINY["target_layer_ids"])
    cfg = DraftConfig(**as_numpy)
    assert cfg == tiny_config(rope_theta=10_000.0)
    assert type(cfg.mask_token_id) is int and type(cfg.vocab_size) is int and type(cfg.rope_theta) is float
    assert all(type(i) is int for i in cfg.target_layer_ids)
    json.dumps(cfg.to_hf_config())  # NumPy scalars would not serialise
    target = TargetConfig(**{**{k: np.int64(v) for k, v in QWEN3_8B.items() if type(v) is int}, "num_hidden_layers": 2})
    assert type(target.hidden_size) is int and target.head_dim == 128
    # A DFlash-layout file's block_size counts the anchor row, NumPy integer or not.
    assert DraftConfig.from_hf_config(deepspec_dict(sample_from_anchor=False, block_size=np.int64(8))).gamma == 7


def test_malformed_config_json_is_named_with_its_path(tmp_path):
    path = tmp_path / "config.json"
    path.write_text("{not json")
    for read in (DraftConfig.from_pretrained, TargetConfig.from_pretrained):
        with pytest.raises(ValueError, match=re.escape(f"{str(path)!r} is not valid JSON")):
            read(tmp_path)


SMALL_QWEN3 = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "vocab_size": 100,
    "rope_theta": 1e6,
}
DRAFT_EXTRA = {"mask_token_id": 99, "target_layer_ids": [0, 1], "num_target_layers": 2, "block_size": 4}


def read_three_forms(hf: dict) -> list:
    """``hf``'s transformer fields read as a target config, a DeepSpec draft config and a
    speculators draft config's ``transformer_layer_config``."""
    return [
        lambda: TargetConfig.from_hf_config(hf),
        lambda: DraftConfig.from_hf_config({**hf, **DRAFT_EXTRA}),
        lambda: DraftConfig.from_hf_config(
            speculators_dict(transformer_layer_config=hf, draft_vocab_size=hf["vocab_size"], mask_token_id=99)
        ),
    ]


def test_a_file_without_head_dim_or_kv_heads_is_read_where_the_conventions_agree():
    """Hugging Face's ``Qwen3Config`` takes ``head_dim`` 128 and 32 KV heads when a file leaves
    them out, ``LlamaConfig`` ``hidden_size // num_attention_heads`` and one KV head per query
    head: 32 heads over 4096 agree on both, so such a file reads (128, 32) in all three forms."""
    hf = {**SMALL_QWEN3, "hidden_size": 4096, "num_attention_heads": 32}
    for read in read_three_forms(hf):
        cfg = read()
        assert (cfg.head_dim, cfg.num_key_value_heads) == (128, 32)


@pytest.mark.parametrize(
    "stated, field, readings",
    [
        (
            {"num_key_value_heads": 4},
            "head_dim",
            "Qwen3Config reads 128, LlamaConfig hidden_size // num_attention_heads = 16",
        ),
        (
            {"num_key_value_heads": 2, "num_attention_heads": 2},
            "head_dim",
            "reads 128, LlamaConfig hidden_size // num_attention_heads = 32",
        ),
        ({"head_dim": 16}, "num_key_value_heads", "Qwen3Config reads 32, LlamaConfig num_attention_heads = 4"),
    ],
)
def test_a_file_leaving_out_a_field_the_conventions_read_differently_is_refused(stated, field, readings):
    """64 // 4 = 16 (or 64 // 2 = 32) is not Qwen3Config's 128, and 4 KV heads are not its 32:
    no guess, in any of the three forms; the message names the field and both readings."""
    hf = {**SMALL_QWEN3, "num_attention_heads": 4, **stated}
    for read in read_three_forms(hf):
        with pytest.raises(
            ValueError, match=f"does not state '{field}'.*{re.escape(readings)}; state {field} in the file"
        ):
            read()
    stating_it = TargetConfig.from_hf_config({**hf, field: 2})  # the file's own value, whatever it is
    assert getattr(stating_it, field) == 2


@pytest.mark.parametrize(
    "model_type, want",
    [("qwen3", (128, 32)), ("llama", (80, 32))],
)
def test_a_file_naming_its_model_type_reads_a_missing_head_field_as_that_class_does(model_type, want):
    """transformers' ``to_diff_dict`` (speculators' exports) drops fields equal to the class
    defaults: a Qwen3-4B-shaped layer config (hidden 2560, 32 heads) without ``head_dim`` is
    ``Qwen3Config``'s 128, a Llama one ``hidden_size // num_attention_heads`` = 80; a missing
    KV count is Qwen3Config's 32 and LlamaConfig's one per query head (32 here), in all three
    forms (the two draft forms for Llama: the target is Qwen3 only). Without ``model_type`` the
    two readings of ``head_dim`` differ, so it is refused."""
    hf = {**SMALL_QWEN3, "hidden_size": 2560, "num_attention_heads": 32, "model_type": model_type}
    forms = read_three_forms(hf)
    for read in forms if model_type == "qwen3" else forms[1:]:
        cfg = read()
        assert (cfg.head_dim, cfg.num_key_value_heads) == want
    for read in read_three_forms(without(hf, "model_type")):
        with pytest.raises(ValueError, match=re.escape("does not state 'head_dim'")):
            read()


def test_a_null_kv_head_count_is_one_kv_head_per_query_head():
    """``"num_key_value_heads": null`` means one KV head per query head to Qwen3Config and
    LlamaConfig alike (unlike a missing field), so it reads as the head count."""
    hf = {**SMALL_QWEN3, "num_attention_heads": 4, "head_dim": 16, "num_key_value_heads": None}
    for read in read_three_forms(hf):
        assert read().num_key_value_heads == 4


def test_a_file_without_the_optional_fields_gets_the_configs_own_defaults():
    """A config.json that leaves out ``max_position_embeddings``, ``rms_norm_eps`` and
    ``attention_bias`` reads as the dataclass built in code without them: one default per
    field, whether the config comes from a file or from Python. (These are the released
    Qwen3 checkpoints' values, ``QWEN3_8B`` above; the RoPE base, which changes the model, has
    no file default: see the RoPE tests below.)"""
    hf = {**SMALL_QWEN3, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16}
    from_file = TargetConfig.from_hf_config(hf)
    in_code = TargetConfig(**hf)
    optional = ("max_position_embeddings", "rms_norm_eps", "attention_bias")
    defaults = {f.name: f.default for f in dataclasses.fields(TargetConfig) if f.name in optional}
    assert {name: getattr(from_file, name) for name in optional} == defaults
    assert from_file == in_code
    assert defaults["max_position_embeddings"] == QWEN3_8B["max_position_embeddings"]
    assert (defaults["rms_norm_eps"], defaults["attention_bias"]) == (QWEN3_8B["rms_norm_eps"], False)
    draft = DraftConfig.from_hf_config({**hf, "mask_token_id": 99, "target_layer_ids": [0], "num_target_layers": 2})
    draft_defaults = {f.name: f.default for f in dataclasses.fields(DraftConfig) if f.name in optional}
    assert {name: getattr(draft, name) for name in optional} == draft_defaults == defaults


def without(hf: dict, *names: str) -> dict:
    return {k: v for k, v in hf.items() if k not in names}


SHAPE_4_HEADS = {**SMALL_QWEN3, "num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16}


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},  # transformers 5
        {"rope_parameters": {"rope_theta": 5e5}},
        {"rope_scaling": {"rope_type": "default", "rope_theta": 5e5}},  # its alias
        {"rope_theta": 5e5, "rope_parameters": {"rope_type": "default", "rope_theta": 500000}},
        {"rope_theta": 5e5, "rope_scaling": None, "rope_parameters": None},  # transformers 4
        {"rope_theta": 5e5, "rope_parameters": {"type": "default"}},
    ],
)
def test_the_rope_base_is_read_where_transformers_4_or_5_writes_it(rope):
    """transformers 5 moved ``rope_theta`` into ``rope_parameters``: a file stating the base
    there, beside it, or both (equal) reads θ = 5e5 in all three forms, not a default."""
    hf = {**without(SHAPE_4_HEADS, "rope_theta"), **rope}
    for read in read_three_forms(hf):
        assert read().rope_theta == 5e5


@pytest.mark.parametrize(
    "rope, message",
    [
        ({}, "does not state the RoPE base: expected 'rope_theta'"),
        ({"rope_parameters": {"rope_type": "default"}}, "does not state the RoPE base"),
        (
            {"rope_theta": 1e6, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}},
            "rope_theta=1000000.0 and rope_parameters.rope_theta=500000.0 disagree",
        ),
        (
            {"rope_parameters": {"rope_theta": 1e6}, "rope_scaling": {"rope_theta": 1e4}},
            "rope_parameters.rope_theta=1000000.0 and rope_scaling.rope_theta=10000.0 disagree",
        ),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
            "rope_parameters={'rope_type': 'yarn'",
        ),
        (
            {"rope_theta": 1e6, "rope_parameters": {"rope_type": "linear", "factor": 2.0}},
            "rope_parameters={'rope_type': 'linear'",
        ),
        ({"rope_theta": 1e6, "rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_scaling={'type': 'llama3'"),
        (
            {"rope_parameters": {"rope_theta": 1e6, "factor": 4.0}},
            "rope_parameters={'rope_theta': 1000000.0, 'factor': 4.0}",
        ),
        ({"rope_parameters": {"full_attention": {"rope_theta": 1e6}}}, "rope_parameters={'full_attention'"),
        ({"rope_theta": 1e6, "rope_parameters": "default"}, "rope_parameters='default' is invalid"),
    ],
)
def test_a_rope_base_missing_disagreeing_or_scaled_is_refused(rope, message):
    """No RoPE base (Hugging Face's defaults differ: 1e4, 1e6), two that disagree, or RoPE
    scaling of any type (yarn, linear, llama3, extra keys, per-layer-type nesting) in either
    RoPE dict is refused in all three forms, naming the fields; the draft and the reference
    target implement plain RoPE only, so a silent default would be another model."""
    hf = {**without(SHAPE_4_HEADS, "rope_theta"), **rope}
    for read in read_three_forms(hf):
        with pytest.raises(ValueError, match=re.escape(message)):
            read()


def test_a_speculators_files_outer_rope_scaling_is_refused_too():
    """The speculators form's outer dict may carry its own RoPE entries: scaling there is
    refused like scaling in the layers' config."""
    outer = speculators_dict(
        transformer_layer_config=SHAPE_4_HEADS,
        draft_vocab_size=100,
        mask_token_id=99,
        rope_parameters={"rope_type": "yarn", "factor": 4.0},
    )
    with pytest.raises(ValueError, match=re.escape("rope_parameters={'rope_type': 'yarn', 'factor': 4.0} is invalid")):
        DraftConfig.from_hf_config(outer)
