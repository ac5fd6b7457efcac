"""Configuration of the DSpark draft and of the reference Qwen3 target.

Both configs are frozen, keyword-only dataclasses that validate themselves in
``__post_init__``; every bad value raises a ``ValueError`` naming the field, the
value and what is allowed.

Conventions (see ``DSPARK_SPEC.md`` §1–2):

* ``block_size`` is γ, the number of draft tokens proposed per round.
* ``sample_from_anchor=True`` (DeepSpec, default): γ query rows
  ``[bonus, MASK × (γ−1)]``; slot ``k`` predicts the token at ``anchor + k + 1``.
* ``sample_from_anchor=False`` (DFlash / speculators): γ+1 query rows
  ``[bonus, MASK × γ]``; the anchor row's output is dropped.
* In ``config.json`` files ``block_size`` counts the query rows the draft was trained
  with (DFlash's "block size 16" is the anchor plus 15 drafts), so a DFlash-layout file
  stores γ+1; :meth:`DraftConfig.from_hf_config` and :meth:`DraftConfig.to_hf_config`
  convert. When a file does not state ``sample_from_anchor``, its producer's default
  applies: DeepSpec files (they carry ``markov_rank``) use the anchor layout, DFlash
  and speculators files the DFlash layout.
* ``target_layer_ids`` use the DeepSpec convention: id ``i`` is the output of target
  decoder layer ``i`` (HF ``hidden_states[i + 1]``), ``-1`` the embedding output.
  Speculators exports store ``i + 1``; :meth:`DraftConfig.from_hf_config` shifts them.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from typing import TYPE_CHECKING, Any

import jax.numpy as jnp

if TYPE_CHECKING:
    from jax.typing import DTypeLike

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# slot layout name -> sample_from_anchor
LAYOUTS = {"anchor": True, "dflash": False}
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ValueError(f"{field}={value!r} is invalid: {allowed}")


def is_integer(value: Any) -> bool:
    """Whether ``value`` is an integer (a Python int or any ``numbers.Integral``), bools excluded."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """Whether ``value`` is a real number (Python or NumPy, any ``numbers.Real``), bools excluded."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def positive_int(name: str, value: Any) -> int:
    """``value`` as an ``int``: a Python or NumPy integer (not a bool) ``>= 1``.

    Raises:
      ValueError: ``value`` is anything else (the message names ``name``).
    """
    if not is_integer(value) or value < 1:
        _fail(name, value, "must be an integer >= 1")
    return int(value)


def check_seed(name: str, value: Any) -> int:
    """``value`` as an ``int``: a Python or NumPy integer (not a bool) in ``[0, 2³² − 1]``, the
    seeds NumPy's generators and ``jax.random.key`` both take.

    Raises:
      ValueError: ``value`` is anything else (the message names ``name``).
    """
    if not is_integer(value) or not 0 <= value <= 2**32 - 1:
        _fail(name, value, "must be an integer in [0, 2**32 - 1]")
    return int(value)


def normalise_numbers(cfg: Any) -> None:
    """Turns NumPy scalars in a config's ``int`` and ``float`` fields into Python numbers.

    Reads the dataclass's (string) annotations; values of any other type are left for
    the config's checks to refuse. The dataclasses are frozen, hence ``object.__setattr__``.

    Args:
      cfg: a config dataclass, from its ``__post_init__``.
    """
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, bool) or type(value) in (int, float):
            continue
        if f.type in ("int", "int | None") and is_integer(value):
            object.__setattr__(cfg, f.name, int(value))
        elif f.type == "float" and is_real(value):
            object.__setattr__(cfg, f.name, float(value))


def check_flag(name: str, value: Any, *, none_allowed: bool = False) -> None:
    """Raises ``TypeError`` unless ``value`` is a bool (or None where ``none_allowed``): a string
    such as "no" would be true."""
    if not (isinstance(value, bool) or (none_allowed and value is None)):
        allowed = "True, False or None" if none_allowed else "True or False"
        raise TypeError(f"{name}={value!r} is invalid: must be {allowed}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(name, value, "must be True or False")


def _check_positive_number(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        _fail(name, value, "must be a finite number > 0")


def _check_dtype(name: str, value: Any) -> None:
    if not isinstance(value, str) or value not in DTYPES:
        _fail(name, value, f"must be one of {sorted(DTYPES)}")


# The shape fields every Qwen3-style transformer config has (a target's config is one with them).
SHAPE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "max_position_embeddings",
)


def _check_common(cfg: Any) -> None:
    """Checks the fields a Qwen3-style transformer config shares."""
    for name in SHAPE_FIELDS:
        positive_int(name, getattr(cfg, name))
    if cfg.num_attention_heads % cfg.num_key_value_heads:
        _fail(
            "num_key_value_heads",
            cfg.num_key_value_heads,
            f"must divide num_attention_heads={cfg.num_attention_heads}",
        )
    if cfg.head_dim % 2:
        _fail("head_dim", cfg.head_dim, "must be even (rotary embedding pairs halves)")
    _check_positive_number("rms_norm_eps", cfg.rms_norm_eps)
    _check_positive_number("rope_theta", cfg.rope_theta)
    _check_bool("attention_bias", cfg.attention_bias)
    _check_dtype("dtype", cfg.dtype)
    _check_dtype("param_dtype", cfg.param_dtype)


# HF Qwen3 fields read by both configs, with their defaults.
_TRANSFORMER_FIELDS = {
    "hidden_size": None,
    "intermediate_size": None,
    "num_hidden_layers": None,
    "num_attention_heads": None,
    "num_key_value_heads": None,
    "head_dim": None,
    "vocab_size": None,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "max_position_embeddings": 40960,
}


# A config.json that leaves out a head's width or the KV head count is read one way by Hugging
# Face's Qwen3Config (its class defaults: head_dim 128, 32 KV heads; transformers' to_diff_dict
# drops fields equal to them, as speculators' exports do) and another by LlamaConfig
# (hidden_size // num_attention_heads, one KV head per query head). A file naming its
# model_type is read as that class reads it; any other is read only where both agree (a
# released Qwen3 size of 32 heads of 128, say), and must state the field where they differ.
QWEN3_DEFAULT_HEAD_DIM = 128
QWEN_DEFAULT_KV_HEADS = 32


def _unstated_head_field(name: str, hf: dict[str, Any], where: str) -> int:
    """``head_dim`` or ``num_key_value_heads`` for a file that leaves it out (or null)."""
    # Checked first: the division would raise ZeroDivisionError or a raw TypeError.
    heads = positive_int("num_attention_heads", hf["num_attention_heads"])
    if name == "num_key_value_heads" and name in hf:
        return heads  # an explicit null: one KV head per query head in every convention
    if name == "head_dim":
        qwen3, llama = QWEN3_DEFAULT_HEAD_DIM, positive_int("hidden_size", hf["hidden_size"]) // heads
        llama_rule = f"hidden_size // num_attention_heads = {llama}"
    else:
        qwen3, llama = QWEN_DEFAULT_KV_HEADS, heads
        llama_rule = f"num_attention_heads = {llama}"
    model_type = hf.get("model_type")
    if model_type in ("qwen3", "llama"):
        return qwen3 if model_type == "qwen3" else llama
    if qwen3 != llama:
        raise ValueError(
            f"{where} does not state {name!r}, and the conventions for a missing {name} differ: "
            f"Hugging Face's Qwen3Config reads {qwen3}, LlamaConfig {llama_rule}; "
            f"state {name} in the file (or its model_type, 'qwen3' or 'llama')"
        )
    return llama


# The RoPE dict of a config.json: transformers 5 writes ``rope_parameters`` (with
# ``rope_theta`` inside it), transformers 4 ``rope_scaling`` (``rope_theta`` beside it).
ROPE_DICTS = ("rope_parameters", "rope_scaling")


def _check_rope_dicts(hf: dict[str, Any]) -> dict[str, Any]:
    """Refuses RoPE scaling in either RoPE dict and returns the ``rope_theta`` each states.

    A dict is plain RoPE when its ``rope_type`` (or older ``type``) is absent or
    ``"default"`` and it holds nothing but that and ``rope_theta`` (the draft and the
    reference target implement plain RoPE only; yarn, linear, llama3 … are refused, as is a
    per-layer-type nesting).

    Returns:
      ``{"rope_parameters.rope_theta": value, …}`` for each dict that states one.
    """
    thetas = {}
    for name in ROPE_DICTS:
        rope = hf.get(name)
        if rope is None:
            continue
        plain = isinstance(rope, dict) and rope.get("rope_type", rope.get("type", "default")) == "default"
        if not plain or set(rope) - {"rope_type", "type", "rope_theta"}:
            _fail(
                name,
                rope,
                "rope scaling is not supported (the draft and the reference target implement plain RoPE); "
                "must be null or {'rope_type': 'default', 'rope_theta': θ}",
            )
        if rope.get("rope_theta") is not None:
            thetas[f"{name}.rope_theta"] = rope["rope_theta"]
    return thetas


def _rope_theta(hf: dict[str, Any], where: str) -> Any:
    """The file's RoPE base: ``rope_theta`` or the one inside its RoPE dict, which must agree.

    A file stating none is refused: Hugging Face's class defaults differ across versions and
    models (1e4, 1e6), and a wrong base is a different model.
    """
    thetas = _check_rope_dicts(hf)
    if hf.get("rope_theta") is not None:
        thetas = {"rope_theta": hf["rope_theta"], **thetas}
    if not thetas:
        raise ValueError(
            f"{where} does not state the RoPE base: expected 'rope_theta' (or 'rope_parameters': "
            "{'rope_type': 'default', 'rope_theta': θ}, as transformers 5 writes it); it is not guessed, "
            "since the defaults differ across Hugging Face versions and models"
        )
    (first, value), *others = thetas.items()
    for name, other in others:
        if other != value:
            raise ValueError(f"{first}={value!r} and {name}={other!r} disagree: a config must give one RoPE base")
    return value


def _transformer_kwargs(hf: dict[str, Any], where: str) -> dict[str, Any]:
    out = {"rope_theta": _rope_theta(hf, where)}
    for name, default in _TRANSFORMER_FIELDS.items():
        if name in hf and hf[name] is not None:
            out[name] = hf[name]
        elif (
            name in ("head_dim", "num_key_value_heads")
            and "num_attention_heads" in hf
            and (name == "num_key_value_heads" or "hidden_size" in hf)
        ):
            out[name] = _unstated_head_field(name, hf, where)
        elif default is None:
            raise ValueError(f"{where} is missing the required field {name!r}")
        else:
            out[name] = default
    return out


def read_json_file(path: str | os.PathLike) -> Any:
    """Parses a JSON file.

    Raises:
      ValueError: the file is not valid JSON (or not text), naming its path.
    """
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:  # json.JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{os.fspath(path)!r} is not valid JSON: {e}") from e


def _read_json(path: str | os.PathLike) -> Any:
    path = os.fspath(path)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"config path {path!r} does not exist: expected a config.json or its folder")
    return read_json_file(path)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TargetConfig:
    """A dense Qwen3 target (Hugging Face ``Qwen3ForCausalLM`` fields).

    NumPy integer and float scalars are accepted and stored as Python numbers.

    Raises:
      ValueError: a field is invalid, naming it, its value and what is allowed.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    tie_word_embeddings: bool = False
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        normalise_numbers(self)
        _check_common(self)
        _check_bool("tie_word_embeddings", self.tie_word_embeddings)

    @property
    def jnp_dtype(self) -> DTypeLike:
        """``dtype`` as a JAX dtype: the compute dtype of activations and caches."""
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self) -> DTypeLike:
        """``param_dtype`` as a JAX dtype: the dtype parameters are stored in."""
        return DTYPES[self.param_dtype]

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> TargetConfig:
        """Builds the config from a Hugging Face Qwen3 ``config.json`` dict.

        Args:
          hf: the parsed ``config.json``.
          **overrides: fields to set regardless of the file (``dtype`` for example).

        Raises:
          TypeError: ``hf`` is not a dict.
          ValueError: a required field is missing or a value is invalid (a
            ``tie_word_embeddings`` that is not a JSON boolean, for example).
        """
        if not isinstance(hf, dict):
            raise TypeError(f"hf config must be a dict, got {type(hf).__name__}")
        _check_target_features(hf)
        kwargs = _transformer_kwargs(hf, "target config")
        tie = hf.get("tie_word_embeddings")
        # Strict, like every boolean field: bool("false") would be True.
        kwargs["tie_word_embeddings"] = False if tie is None else tie
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> TargetConfig:
        """Reads ``config.json`` from ``path`` (a file or its folder).

        Raises:
          ValueError: the file is missing or not valid JSON, or as :meth:`from_hf_config`.
        """
        return cls.from_hf_config(_read_json(path), **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The Hugging Face ``config.json`` form (``model_type`` ``"qwen3"``; read back by
        :meth:`from_hf_config`): ``dtype`` is written as ``torch_dtype``, ``param_dtype`` dropped."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.pop("param_dtype")
        out["torch_dtype"] = out.pop("dtype")
        out["model_type"] = "qwen3"
        out["architectures"] = ["Qwen3ForCausalLM"]
        return out


@dataclasses.dataclass(frozen=True, kw_only=True)
class DraftConfig:
    """The DSpark draft: a DFlash-style backbone plus Markov and confidence heads.

    ``hidden_size`` equals the target's (the draft borrows its embedding and lm_head).
    ``num_target_layers`` is the depth of the target the draft was trained for, or
    ``None`` when the checkpoint does not say (then it is checked on attaching a target).
    NumPy integer and float scalars are accepted and stored as Python numbers.

    Raises:
      ValueError: a field is invalid, naming it, its value and what is allowed.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    attention_bias: bool = False
    max_position_embeddings: int = 40960
    block_size: int = 7
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    num_target_layers: int | None = None
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = False
    confidence_head_with_markov: bool = False
    sample_from_anchor: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"

    def __post_init__(self) -> None:
        normalise_numbers(self)
        _check_common(self)
        positive_int("block_size", self.block_size)
        if not is_integer(self.mask_token_id) or not 0 <= self.mask_token_id < self.vocab_size:
            _fail(
                "mask_token_id",
                self.mask_token_id,
                f"must be a token id inside the embedding, 0 <= id < vocab_size={self.vocab_size}",
            )
        ids = self.target_layer_ids
        if isinstance(ids, (list, tuple)):
            # Frozen: a list becomes a tuple (the config stays hashable), NumPy integers ints.
            ids = tuple(int(i) if is_integer(i) else i for i in ids)
            object.__setattr__(self, "target_layer_ids", ids)
        if not isinstance(ids, tuple) or not ids or not all(is_integer(i) for i in ids):
            _fail("target_layer_ids", ids, "must be a non-empty sequence of integers")
        if any(b <= a for a, b in zip(ids[:-1], ids[1:], strict=True)):
            _fail("target_layer_ids", ids, "must be strictly increasing")
        if ids[0] < -1:
            _fail("target_layer_ids", ids, "must be >= -1 (-1 is the embedding output)")
        if self.num_target_layers is not None:
            positive_int("num_target_layers", self.num_target_layers)
            if ids[-1] >= self.num_target_layers:
                _fail(
                    "target_layer_ids",
                    ids,
                    f"must lie inside the target's depth, -1 <= id < num_target_layers={self.num_target_layers}",
                )
        if not is_integer(self.markov_rank) or self.markov_rank < 0:
            _fail("markov_rank", self.markov_rank, "must be an integer >= 0 (0 = DFlash-style, no Markov head)")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            _fail("markov_head_type", self.markov_head_type, f"must be one of {MARKOV_HEAD_TYPES}")
        for name in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
            _check_bool(name, getattr(self, name))
        if self.confidence_head_with_markov and not self.enable_confidence_head:
            _fail("confidence_head_with_markov", True, "needs enable_confidence_head=True")
        if self.confidence_head_with_markov and self.markov_rank == 0:
            _fail("confidence_head_with_markov", True, "needs a Markov head (markov_rank > 0)")

    # ------------------------------------------------------------------ derived
    @property
    def gamma(self) -> int:
        """γ: draft tokens per round."""
        return self.block_size

    @property
    def num_query_rows(self) -> int:
        """Rows the backbone runs per block: γ, or γ+1 with the anchor row dropped."""
        return self.block_size + (0 if self.sample_from_anchor else 1)

    @property
    def num_fused_layers(self) -> int:
        """K: target layers concatenated into the context features."""
        return len(self.target_layer_ids)

    @property
    def has_markov_head(self) -> bool:
        """True when ``markov_rank > 0`` (a DFlash-style draft, rank 0, has none)."""
        return self.markov_rank > 0

    @property
    def layout(self) -> str:
        """The slot layout: ``"anchor"`` (DeepSpec, γ rows) or ``"dflash"`` (γ+1 rows)."""
        return "anchor" if self.sample_from_anchor else "dflash"

    @property
    def jnp_dtype(self) -> DTypeLike:
        """``dtype`` as a JAX dtype: the compute dtype of activations and caches."""
        return DTYPES[self.dtype]

    @property
    def jnp_param_dtype(self) -> DTypeLike:
        """``param_dtype`` as a JAX dtype: the dtype parameters are stored in."""
        return DTYPES[self.param_dtype]

    # -------------------------------------------------------------- construction
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> DraftConfig:
        """Builds the config from a DeepSpec, DFlash or speculators ``config.json`` dict.

        The file's ``block_size`` counts query rows, so a DFlash-layout file's value is
        γ+1 and becomes ``block_size=γ`` here; see the module docstring for the layout a
        file gets when it does not state ``sample_from_anchor``.

        Args:
          hf: the parsed ``config.json``.
          **overrides: fields to set regardless of the file (``dtype`` for example), in
            this class's terms (``block_size`` is γ).

        Raises:
          TypeError: ``hf`` is not a dict.
          ValueError: a required field is missing, a value is invalid, or the file sets
            ``rope_scaling`` (the draft implements plain RoPE).
        """
        if not isinstance(hf, dict):
            raise TypeError(f"hf config must be a dict, got {type(hf).__name__}")
        kwargs = _speculators_kwargs(hf) if "speculators_model_type" in hf else _deepspec_kwargs(hf)
        for name in ("mask_token_id", "target_layer_ids"):
            if name not in kwargs and name not in overrides:
                raise ValueError(f"draft config is missing the required field {name!r}")
        if isinstance(kwargs.get("target_layer_ids"), (list, tuple)):
            kwargs["target_layer_ids"] = tuple(kwargs["target_layer_ids"])
        if "block_size" in kwargs and "block_size" not in overrides:
            anchor = overrides.get("sample_from_anchor", kwargs["sample_from_anchor"])
            kwargs["block_size"] = _gamma_from_rows(kwargs["block_size"], anchor)
        kwargs.update(overrides)
        return cls(**kwargs)

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> DraftConfig:
        """Reads ``config.json`` from ``path`` (a file, or the checkpoint folder).

        Raises:
          ValueError: the file is missing or not valid JSON, or as :meth:`from_hf_config`.
        """
        return cls.from_hf_config(_read_json(path), **overrides)

    def to_hf_config(self) -> dict[str, Any]:
        """The DeepSpec ``config.json`` form (read back by :meth:`from_hf_config`).

        ``block_size`` is written as the number of query rows and ``sample_from_anchor``
        always explicitly, so the file is unambiguous for every reader.
        """
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["target_layer_ids"] = list(self.target_layer_ids)
        out["block_size"] = self.num_query_rows
        out.pop("param_dtype")
        out["torch_dtype"] = out.pop("dtype")
        out["model_type"] = "qwen3"
        out["architectures"] = ["DSparkDraftModel"]
        return out


def _check_target_features(hf: dict[str, Any]) -> None:
    """Refuses a target config.json asking for what the reference Qwen3 target does not implement."""
    for field, bad, allowed in (
        ("model_type", hf.get("model_type", "qwen3") != "qwen3", '"qwen3" (or absent)'),
        ("hidden_act", hf.get("hidden_act", "silu") != "silu", '"silu" (or absent)'),
        ("use_sliding_window", hf.get("use_sliding_window") not in (None, False), "false: attention is global"),
    ):
        if bad:
            _fail(field, hf[field], f"not supported by the reference Qwen3 target, must be {allowed}")


# z-lab/dflash's dflash_config entries that change the computation, with their neutral values.
_DFLASH_NEUTRAL = {
    "input_embedding_scale": (None, 1),
    "output_multiplier": (None, 1),
    "projector_type": (None, "dflash"),
}
# DFlash-2 (grouped causal convolutions, candidate selector) and speculators' Domino fields.
_DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
# z-lab/dflash reads a missing block_size as 16 query rows.
ZLAB_DEFAULT_BLOCK_ROWS = 16


def _check_draft_attention(hf: dict[str, Any], where: str) -> None:
    """Refuses causal or sliding-window draft attention: the draft attends to the whole block
    and the whole context. In z-lab/dflash a ``sliding_attention`` layer is causal inside the
    block and windowed, as is every layer when ``is_causal`` is true; speculators' sliding
    layers are causal unless ``sliding_window_non_causal``, and windowed either way."""
    types = hf.get("layer_types")
    if types is not None and (not isinstance(types, list) or any(t != "full_attention" for t in types)):
        _fail(
            f"{where}layer_types",
            types,
            "only 'full_attention' layers are supported (a 'sliding_attention' draft layer is causal and "
            "windowed; this draft attends to the whole block and context)",
        )
    if hf.get("use_sliding_window") not in (None, False):
        _fail(f"{where}use_sliding_window", hf["use_sliding_window"], "must be false or absent (no sliding window)")
    if hf.get("is_causal") not in (None, False):
        _fail(f"{where}is_causal", hf["is_causal"], "must be false or absent (the block attention is bidirectional)")


def _check_dflash_extras(settings: dict[str, Any], where: str) -> None:
    """Refuses DFlash settings that change the computation and are not implemented."""
    for name, neutral in _DFLASH_NEUTRAL.items():
        if name in settings and settings[name] not in neutral:
            _fail(f"{where}{name}", settings[name], f"not supported, must be one of {list(neutral)} or absent")
    softcap = settings.get("final_logit_softcapping")
    if softcap is not None and (not is_real(softcap) or softcap > 0):
        _fail(f"{where}final_logit_softcapping", softcap, "logit soft-capping is not supported: must be null or absent")
    present = [name for name in _DFLASH2_FIELDS if settings.get(name) is not None]
    if present:
        _fail(
            f"{where}{present[0]}",
            settings[present[0]],
            "a DFlash-2 draft (convolutions, candidate selector) is not supported",
        )
    if settings.get("shift_label") not in (None, False):
        _fail(f"{where}shift_label", settings["shift_label"], "shifted training targets (Domino) are not supported")


def _gamma_from_rows(rows: Any, sample_from_anchor: Any) -> Any:
    """γ from a file's ``block_size`` (query rows; the DFlash layout counts the anchor)."""
    if sample_from_anchor is not False or not is_integer(rows):
        return rows
    if rows < 2:
        _fail(
            "block_size",
            rows,
            "a DFlash-layout config (sample_from_anchor=False) counts the anchor row, so it must be >= 2",
        )
    return int(rows) - 1


def _deepspec_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """Reads the DeepSpec form and the DFlash form with its nested ``dflash_config``."""
    kwargs = _transformer_kwargs(hf, "draft config")
    nested = hf.get("dflash_config") or {}
    if not isinstance(nested, dict):
        _fail("dflash_config", nested, "must be a dict")
    _check_draft_attention(hf, "")
    if any("DFlash2" in str(a) for a in hf.get("architectures") or ()):
        _fail(
            "architectures", hf["architectures"], "a DFlash-2 draft (convolutions, candidate selector) is not supported"
        )
    _check_dflash_extras(hf, "")
    _check_dflash_extras(nested, "dflash_config.")
    for name in ("block_size", "mask_token_id", "target_layer_ids"):
        if name in hf and name in nested and hf[name] != nested[name]:
            raise ValueError(
                f"{name}={hf[name]!r} and dflash_config.{name}={nested[name]!r} disagree: a draft config must "
                "give one value (they name the same setting)"
            )
        if name in hf:
            kwargs[name] = hf[name]
        elif name in nested:
            kwargs[name] = nested[name]
    for name in (
        "num_target_layers",
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
        "sample_from_anchor",
    ):
        if name in hf:
            kwargs[name] = hf[name]
    # A file without Markov fields is a DFlash checkpoint: no Markov head, DFlash layout.
    is_deepspec = "markov_rank" in hf
    if not is_deepspec and "block_size" not in kwargs:
        kwargs["block_size"] = ZLAB_DEFAULT_BLOCK_ROWS  # z-lab/dflash's default, in query rows
    kwargs.setdefault("markov_rank", 0)
    kwargs.setdefault("sample_from_anchor", is_deepspec)
    return kwargs


def _speculators_kwargs(hf: dict[str, Any]) -> dict[str, Any]:
    """Reads the speculators export form (nested transformer config, shifted layer ids)."""
    layer_cfg = hf.get("transformer_layer_config")
    if not isinstance(layer_cfg, dict):
        raise ValueError(f"speculators config needs a 'transformer_layer_config' dict, got {type(layer_cfg).__name__}")
    _check_rope_dicts(hf)  # the outer dict's own RoPE entries (the layers read the inner one's)
    _check_draft_attention(hf, "")
    _check_draft_attention(layer_cfg, "transformer_layer_config.")
    _check_dflash_extras(hf, "")
    kwargs = _transformer_kwargs(layer_cfg, "transformer_layer_config")
    draft_vocab = hf.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != kwargs["vocab_size"]:
        _fail(
            "draft_vocab_size",
            draft_vocab,
            f"a reduced draft vocabulary (d2t/t2d mapping) is not supported; must equal "
            f"transformer_layer_config.vocab_size={kwargs['vocab_size']}",
        )
    target_hidden = hf.get("target_hidden_size")
    if target_hidden is not None and target_hidden != kwargs["hidden_size"]:
        _fail(
            "target_hidden_size",
            target_hidden,
            f"must equal the draft hidden_size={kwargs['hidden_size']} (the draft borrows the target's embedding)",
        )
    for name in ("block_size", "mask_token_id", "sample_from_anchor", "num_target_layers"):
        if name in hf:
            kwargs[name] = hf[name]
    if "aux_hidden_state_layer_ids" in hf:
        # Speculators count HF hidden_states (0 = embeddings); DeepSpec counts layers.
        # Checked here, before the shift, so that a message names the file's field and values.
        ids = hf["aux_hidden_state_layer_ids"]
        field = "aux_hidden_state_layer_ids"
        if not isinstance(ids, (list, tuple)) or not ids or not all(is_integer(i) for i in ids):
            _fail(field, ids, "must be a non-empty list of integers (HF hidden_states indices)")
        if any(b <= a for a, b in zip(ids[:-1], ids[1:], strict=True)):
            _fail(field, ids, "must be strictly increasing")
        if ids[0] < 0:
            _fail(field, ids, "must be >= 0 (HF hidden_states index 0 is the embedding output)")
        depth = kwargs.get("num_target_layers")
        if is_integer(depth) and depth >= 1 and ids[-1] > depth:
            _fail(field, ids, f"must lie inside the target's depth, 0 <= id <= num_target_layers={depth}")
        kwargs["target_layer_ids"] = tuple(i - 1 for i in ids)
    for name in (
        "markov_rank",
        "markov_head_type",
        "enable_confidence_head",
        "confidence_head_with_markov",
    ):
        if name in hf:
            kwargs[name] = hf[name]
    kwargs.setdefault("markov_rank", 0)
    # Speculators exports default to the DFlash slot layout.
    kwargs.setdefault("sample_from_anchor", False)
    _check_speculative_tokens(hf, kwargs)
    return kwargs


def _check_speculative_tokens(hf: dict[str, Any], kwargs: dict[str, Any]) -> None:
    """Refuses a ``speculators_config`` proposal of more tokens than the draft's γ: a file that
    proposes ``block_size`` tokens without stating ``sample_from_anchor`` is an anchor-layout
    draft that the DFlash default would read one slot short and shifted."""
    block = hf.get("speculators_config")
    methods = block.get("proposal_methods") if isinstance(block, dict) else None
    rows = kwargs.get("block_size")
    if not isinstance(methods, list) or not is_integer(rows):
        return
    gamma = rows - (0 if kwargs["sample_from_anchor"] is True else 1)
    for j, method in enumerate(methods):
        tokens = method.get("speculative_tokens") if isinstance(method, dict) else None
        if is_integer(tokens) and tokens > gamma:
            _fail(
                f"speculators_config.proposal_methods[{j}].speculative_tokens",
                tokens,
                f"exceeds the draft's {gamma} draft tokens per round (block_size={rows}, "
                f"sample_from_anchor={kwargs['sample_from_anchor']}); state sample_from_anchor in the file",
            )
