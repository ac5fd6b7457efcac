"""The reference Qwen3 target: cached decoding, HF checkpoints, pairing with a draft."""

from __future__ import annotations

import functools
import json
import os
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from flax import nnx

from dspark_jax.config import DraftConfig, TargetConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.target import Qwen3Target, check_pair, load_target, save_target

V, H, L = 20, 16, 2


def _cfg(**kw) -> TargetConfig:
    base = dict(
        hidden_size=H,
        intermediate_size=24,
        num_hidden_layers=L,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=V,
        rope_theta=10_000.0,
    )
    return TargetConfig(**(base | kw))


def _draft_cfg(**kw) -> DraftConfig:
    base = dict(
        hidden_size=H,
        intermediate_size=24,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=V,
        block_size=3,
        mask_token_id=V - 1,
        target_layer_ids=(-1, L - 1),
        markov_rank=4,
    )
    return DraftConfig(**(base | kw))


# ---------------------------------------------------------------- NumPy reference
def _hf_tensors(cfg: TargetConfig, seed: int) -> dict[str, np.ndarray]:
    """Random HF-named tensors in the PyTorch ``[out, in]`` layout."""
    rng = np.random.default_rng(seed)
    d, nh, kvh, i = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size

    def w(*shape):
        return (0.3 * rng.standard_normal(shape)).astype(np.float32)

    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": 1 + w(H)}
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = w(V, H)
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."
        t[p + "self_attn.q_proj.weight"] = w(nh * d, H)
        t[p + "self_attn.k_proj.weight"] = w(kvh * d, H)
        t[p + "self_attn.v_proj.weight"] = w(kvh * d, H)
        t[p + "self_attn.o_proj.weight"] = w(H, nh * d)
        if cfg.attention_bias:
            for n, width in (("q", nh * d), ("k", kvh * d), ("v", kvh * d), ("o", H)):
                t[p + f"self_attn.{n}_proj.bias"] = w(width)
        t[p + "self_attn.q_norm.weight"] = 1 + w(d)
        t[p + "self_attn.k_norm.weight"] = 1 + w(d)
        t[p + "mlp.gate_proj.weight"] = w(i, H)
        t[p + "mlp.up_proj.weight"] = w(i, H)
        t[p + "mlp.down_proj.weight"] = w(H, i)
        t[p + "input_layernorm.weight"] = 1 + w(H)
        t[p + "post_attention_layernorm.weight"] = 1 + w(H)
    return t


def _rms(x, w, eps):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _rope(x, pos, theta):  # x [S, heads, D]
    d = x.shape[-1]
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv  # [S, D/2]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _numpy_forward(t: dict[str, np.ndarray], cfg: TargetConfig, tokens: list[int], *, residuals: list | None = None):
    """Logits ``[S, V]`` of one sequence, written from the Qwen3 equations.

    ``residuals``, when given, receives the residual stream ``[S, H]``: the embeddings,
    then the stream after each layer (before any norm), ``L + 1`` arrays.
    """
    t = {k: v.astype(np.float64) for k, v in t.items()}
    eps, d = cfg.rms_norm_eps, cfg.head_dim
    nh, kvh = cfg.num_attention_heads, cfg.num_key_value_heads
    s = len(tokens)
    pos = np.arange(s, dtype=np.float64)
    x = t["model.embed_tokens.weight"][tokens]
    if residuals is not None:
        residuals.append(x)
    causal = np.tril(np.ones((s, s), bool))
    for layer in range(cfg.num_hidden_layers):
        p = f"model.layers.{layer}."

        def lin(a, name, p=p):
            out = a @ t[p + name + ".weight"].T
            return out + t[p + name + ".bias"] if p + name + ".bias" in t else out

        a = _rms(x, t[p + "input_layernorm.weight"], eps)
        q = _rms(lin(a, "self_attn.q_proj").reshape(s, nh, d), t[p + "self_attn.q_norm.weight"], eps)
        k = _rms(lin(a, "self_attn.k_proj").reshape(s, kvh, d), t[p + "self_attn.k_norm.weight"], eps)
        v = lin(a, "self_attn.v_proj").reshape(s, kvh, d)
        q, k = _rope(q, pos, cfg.rope_theta), _rope(k, pos, cfg.rope_theta)
        heads = []
        for h in range(nh):
            g = h // (nh // kvh)
            scores = np.where(causal, q[:, h] @ k[:, g].T / np.sqrt(d), -np.inf)
            w = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((w / w.sum(-1, keepdims=True)) @ v[:, g])
        x = x + lin(np.concatenate(heads, axis=-1), "self_attn.o_proj")
        m = _rms(x, t[p + "post_attention_layernorm.weight"], eps)
        gate = lin(m, "mlp.gate_proj")
        x = x + lin(gate / (1 + np.exp(-gate)) * lin(m, "mlp.up_proj"), "mlp.down_proj")
        if residuals is not None:
            residuals.append(x)
    head = t["model.embed_tokens.weight"] if cfg.tie_word_embeddings else t["lm_head.weight"]
    return _rms(x, t["model.norm.weight"], eps) @ head.T


def _write_hf(path, cfg: TargetConfig, tensors: dict[str, np.ndarray]) -> None:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg.to_hf_config(), f)
    safetensors.numpy.save_file(tensors, os.path.join(path, "model.safetensors"))


@functools.partial(jax.jit, static_argnames=("graphdef", "feature_layers"))
def _jit_forward(graphdef, state, tokens, positions, cache, valid, feature_layers=()):
    return nnx.merge(graphdef, state)(tokens, positions, cache, valid=valid, feature_layers=feature_layers)


def _forward(target, tokens, positions, cache, valid=None, feature_layers=()):
    """The target's forward, compiled (eager NNX calls are slow on a busy CPU)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    valid = jnp.ones(tokens.shape, bool) if valid is None else jnp.asarray(valid)
    graphdef, state = nnx.split(target)
    return _jit_forward(graphdef, state, tokens, jnp.asarray(positions, jnp.int32), cache, valid, feature_layers)


def _logits(target, tokens):
    logits, _, _ = _forward(target, [tokens], np.arange(len(tokens))[None], target.init_cache(1, 16))
    return np.asarray(logits[0])


# ---------------------------------------------------------------------- tests
@pytest.mark.parametrize(
    "kw", [dict(tie_word_embeddings=False), dict(tie_word_embeddings=True, attention_bias=True)], ids=["untied", "tied"]
)
def test_hand_written_hf_checkpoint_matches_numpy_forward(tmp_path, kw):
    cfg = _cfg(**kw)
    tensors = _hf_tensors(cfg, seed=1)
    _write_hf(tmp_path, cfg, tensors)
    target = load_target(tmp_path)
    tokens = [3, 17, 0, 9, 9, 12, 5]
    np.testing.assert_allclose(_logits(target, tokens), _numpy_forward(tensors, cfg, tokens), atol=2e-4, rtol=2e-4)
    assert (target.head is None) == cfg.tie_word_embeddings


@pytest.mark.parametrize("layers", [(-1, 0, 1, 3), (3, -1, 2)], ids=["in-order", "shuffled"])
def test_features_are_the_residual_stream_before_any_norm(tmp_path, layers):
    """``feature_layers`` taps, concatenated in the order asked: −1 the embeddings (unscaled),
    layer ``i`` the residual stream after it (before the next layer's input_layernorm, and
    for the last layer before the final norm), each checked against the NumPy forward."""
    cfg = _cfg(num_hidden_layers=4)
    tensors = _hf_tensors(cfg, seed=4)
    _write_hf(tmp_path, cfg, tensors)
    target = load_target(tmp_path)
    tokens = [3, 17, 0, 9, 9, 12, 5]
    residuals = []
    want_logits = _numpy_forward(tensors, cfg, tokens, residuals=residuals)
    assert len(residuals) == cfg.num_hidden_layers + 1
    logits, features, _ = _forward(
        target, [tokens], np.arange(len(tokens))[None], target.init_cache(1, 8), feature_layers=layers
    )
    assert features.shape == (1, len(tokens), len(layers) * H)
    want = np.concatenate([residuals[i + 1] for i in layers], axis=-1)
    np.testing.assert_allclose(np.asarray(features[0]), want, atol=2e-4, rtol=2e-4)
    np.testing.assert_allclose(np.asarray(logits[0]), want_logits, atol=2e-4, rtol=2e-4)


def test_cached_incremental_decoding_equals_full_forward():
    cfg = _cfg()
    target = Qwen3Target(cfg, rngs=nnx.Rngs(0))
    tokens = np.asarray([[4, 8, 15, 16, 2, 3, 11, 7], [1, 0, 19, 5, 5, 6, 12, 3]])
    positions = np.broadcast_to(np.arange(8), (2, 8))
    full, full_feats, _ = _forward(target, tokens, positions, target.init_cache(2, 12), feature_layers=(-1, 1))
    cache = target.init_cache(2, 12)
    pieces, feats = [], []
    for lo in range(0, 8, 2):  # a short prefill, then two-token verify steps
        out, f, cache = _forward(
            target, tokens[:, lo : lo + 2], positions[:, lo : lo + 2], cache, feature_layers=(-1, 1)
        )
        pieces.append(out)
        feats.append(f)
    np.testing.assert_allclose(np.concatenate(pieces, 1), full, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(np.concatenate(feats, 1), full_feats, atol=1e-5, rtol=1e-5)


def test_invalid_rows_are_not_cached_and_stale_future_entries_are_not_seen():
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    _, _, cache = _forward(target, [[1, 2, 3]], np.arange(3)[None], target.init_cache(1, 8))
    # Garbage at positions 2..4, as rejected drafts leave behind; then decode over them.
    _, _, junk = _forward(target, [[9, 9, 9]], np.arange(2, 5)[None], cache)
    out, _, after = _forward(target, [[6, 7, 8]], np.arange(2, 5)[None], junk, valid=[[True, False, False]])
    ref, _, _ = _forward(target, [[1, 2, 6]], np.arange(3)[None], target.init_cache(1, 8))
    np.testing.assert_allclose(out[0, 0], ref[0, 2], atol=1e-5)
    np.testing.assert_array_equal(after.k[:, :, 3:], junk.k[:, :, 3:])  # invalid rows left the cache alone
    assert not np.array_equal(after.k[:, :, 2], junk.k[:, :, 2])


@pytest.mark.parametrize("tied", [False, True])
def test_save_load_round_trip_single_and_sharded(tmp_path, tied):
    target = Qwen3Target(_cfg(tie_word_embeddings=tied), rngs=nnx.Rngs(3))
    tokens = [1, 5, 9, 2]
    save_target(target, tmp_path / "single")
    save_target(target, tmp_path / "sharded", max_shard_bytes=4000)
    shards = [f for f in os.listdir(tmp_path / "sharded") if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(tmp_path / "sharded" / "model.safetensors.index.json")
    names = set(safetensors.numpy.load_file(str(tmp_path / "single" / "model.safetensors")))
    assert ("lm_head.weight" in names) != tied
    for sub in ("single", "sharded"):
        loaded = load_target(tmp_path / sub)
        np.testing.assert_array_equal(_logits(loaded, tokens), _logits(target, tokens))


def test_saving_over_an_older_checkpoint_replaces_its_files(tmp_path):
    old = Qwen3Target(_cfg(), rngs=nnx.Rngs(3))
    new = Qwen3Target(_cfg(), rngs=nnx.Rngs(4))
    tokens = [1, 5, 9, 2]
    save_target(old, tmp_path, max_shard_bytes=4000)
    save_target(new, tmp_path)  # unsharded: the old shards and their index must go
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    np.testing.assert_array_equal(_logits(load_target(tmp_path), tokens), _logits(new, tokens))
    with pytest.raises(ValueError, match="max_shard_bytes=0 is invalid"):
        save_target(new, tmp_path, max_shard_bytes=0)


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary_files(tmp_path, monkeypatch):
    from dspark_jax import safetensors_io

    old = Qwen3Target(_cfg(), rngs=nnx.Rngs(3))
    save_target(old, tmp_path)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    real, calls = safetensors_io.save_file, []

    def save_file(*args, **kwargs):  # a full disk at the second shard
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors_io, "save_file", save_file)
    new = Qwen3Target(_cfg(num_hidden_layers=3), rngs=nnx.Rngs(4))
    with pytest.raises(OSError, match="No space left on device"):
        save_target(new, tmp_path, max_shard_bytes=4000)
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before
    tokens = [1, 5, 9, 2]
    np.testing.assert_array_equal(_logits(load_target(tmp_path), tokens), _logits(old, tokens))


def test_a_save_killed_while_moving_its_files_is_finished_by_the_next_target_load(tmp_path, monkeypatch):
    from dspark_jax import safetensors_io

    save_target(Qwen3Target(_cfg(), rngs=nnx.Rngs(3)), tmp_path, max_shard_bytes=4000)
    new = Qwen3Target(_cfg(num_hidden_layers=3), rngs=nnx.Rngs(4))
    real = os.replace

    def replace(src, dst):  # killed at the first file moved into place
        if os.path.dirname(dst) == str(tmp_path):
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(safetensors_io.os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        save_target(new, tmp_path)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="finished a save that was cut short"):
        loaded = load_target(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["config.json", "model.safetensors"]
    tokens = [1, 5, 9, 2]
    np.testing.assert_array_equal(_logits(loaded, tokens), _logits(new, tokens))


def test_saved_linear_weights_use_the_out_in_layout(tmp_path):
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(3))
    save_target(target, tmp_path)
    t = safetensors.numpy.load_file(str(tmp_path / "model.safetensors"))
    kernel = np.asarray(target.layers[0].mlp.gate_proj.kernel.get_value())  # [in, out]
    np.testing.assert_array_equal(t["model.layers.0.mlp.gate_proj.weight"], kernel.T)


def test_bfloat16_checkpoint_loads_as_bfloat16(tmp_path):
    cfg = _cfg()
    tensors = {k: v.astype(ml_dtypes.bfloat16) for k, v in _hf_tensors(cfg, seed=2).items()}
    _write_hf(tmp_path, cfg, tensors)
    target = load_target(tmp_path, dtype="bfloat16")
    assert target.embed_tokens.dtype == jnp.bfloat16
    np.testing.assert_array_equal(
        np.asarray(target.layers[1].self_attn.k_proj.kernel.get_value()).astype(np.float32),
        tensors["model.layers.1.self_attn.k_proj.weight"].astype(np.float32).T,
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.1.mlp.up_proj.weight"), "missing tensors.*layers.1.mlp.up_proj"),
        (lambda t: t.update({"model.layers.0.extra.weight": np.zeros(3, np.float32)}), "unexpected.*extra"),
        (
            lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": np.zeros((H, 32), np.float32)}),
            r"q_proj.weight.*shape \(16, 32\).*expected \(32, 16\)",
        ),
    ],
    ids=["missing", "unexpected", "misshapen"],
)
def test_bad_checkpoints_raise_naming_the_tensor(tmp_path, edit, message):
    cfg = _cfg()
    tensors = _hf_tensors(cfg, seed=0)
    edit(tensors)
    _write_hf(tmp_path, cfg, tensors)
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path)


def test_missing_files_and_unsupported_config_raise(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        load_target(tmp_path)
    hf = _cfg().to_hf_config()
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf, f)
    with pytest.raises(ValueError, match="neither model.safetensors"):
        load_target(tmp_path)
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf | {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, f)
    with pytest.raises(ValueError, match="rope_scaling"):
        load_target(tmp_path)
    # transformers 5 writes the RoPE dict as rope_parameters: scaling there is refused too,
    # naming the file, and so is a file with no RoPE base at all
    scaled = {k: v for k, v in hf.items() if k != "rope_theta"} | {
        "rope_parameters": {"rope_type": "yarn", "factor": 4.0}
    }
    for bad, message in (
        (scaled, "rope_parameters={'rope_type': 'yarn'"),
        ({**scaled, "rope_parameters": None}, "RoPE base"),
    ):
        with open(tmp_path / "config.json", "w") as f:
            json.dump(bad, f)
        with pytest.raises(
            ValueError, match=re.escape(f"{str(tmp_path / 'config.json')!r}: ") + ".*" + re.escape(message)
        ):
            load_target(tmp_path)


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(hidden_size=32, num_attention_heads=4), "hidden_size=32"),
        (dict(vocab_size=V + 4, mask_token_id=V), "draft vocab_size=24 .* vocab_size=20$"),
        (dict(vocab_size=V - 4, mask_token_id=V - 5), "draft vocab_size=16 .* smaller vocabulary can load and propose"),
        (dict(target_layer_ids=(0, L)), "target_layer_ids"),
        (dict(num_target_layers=L + 3, target_layer_ids=(0, 1)), "num_target_layers=5"),
    ],
)
def test_check_pair_rejects_a_draft_that_does_not_fit(kw, message):
    check_pair(_draft_cfg(), _cfg())
    with pytest.raises(ValueError, match=message):
        check_pair(_draft_cfg(**kw), _cfg())


@pytest.mark.parametrize("tied", [False, True])
def test_draft_shares_the_targets_embedding_and_lm_head(tied):
    target = Qwen3Target(_cfg(tie_word_embeddings=tied), rngs=nnx.Rngs(0))
    draft = DSparkDraft(_draft_cfg(), rngs=nnx.Rngs(1), embed_tokens=target.embed_tokens, lm_head=target.lm_head)
    assert draft.embed_tokens.get_value() is target.embed_tokens
    assert draft.lm_head.get_value() is target.lm_head
    assert (target.lm_head is target.embed_tokens) == tied
    # Split states hold the same buffers, not copies.
    _, t_state = nnx.split(target)
    _, d_state = nnx.split(draft)
    t_leaves = {id(x) for x in jax.tree.leaves(t_state)}
    assert id(d_state["embed_tokens"].get_value()) in t_leaves
    assert id(d_state["lm_head"].get_value()) in t_leaves


# ---------------------------------------------------------------- input validation
def _eager_inputs(b=1, s=4, capacity=8):
    return jnp.zeros((b, s), jnp.int32), jnp.broadcast_to(jnp.arange(s), (b, s)), capacity


@pytest.mark.parametrize(
    "edit, error, message",
    [
        (lambda t, p, c, v: (t[0], p[0], c, v), ValueError, r"tokens has shape \(4,\)"),
        (lambda t, p, c, v: (t.astype(float), p, c, v), TypeError, "tokens has dtype float32"),
        (lambda t, p, c, v: (t, p[:, :1], c, v), ValueError, r"positions has shape \(1, 1\)"),
        (lambda t, p, c, v: (t, p + 0.5, c, v), TypeError, "positions has dtype float32"),
        (lambda t, p, c, v: (t, p, c, v[:, :1]), ValueError, r"valid has shape \(1, 1\)"),
        (lambda t, p, c, v: (t, p, c, v.astype(jnp.int32)), TypeError, "valid has dtype int32"),
    ],
    ids=["1d-tokens", "float-tokens", "broadcast-positions", "float-positions", "valid-shape", "int-valid"],
)
def test_forward_refuses_misshapen_or_mistyped_inputs_while_tracing(edit, error, message):
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    tokens, positions, capacity = _eager_inputs()
    args = edit(tokens, positions, target.init_cache(1, capacity), jnp.ones(tokens.shape, bool))
    graphdef, state = nnx.split(target)
    with pytest.raises(error, match=message):
        _jit_forward(graphdef, state, *args)


def test_forward_refuses_a_cache_of_another_batch():
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    tokens, positions, _ = _eager_inputs(b=3)
    with pytest.raises(ValueError, match=r"cache has k \(2, 1, 8, 2, 8\).*batch B=3"):
        _forward(target, tokens, positions, target.init_cache(1, 8))


@pytest.mark.parametrize(
    "layers, error, message",
    [((True,), TypeError, "feature_layers=\\(True,\\)"), ((0, L), ValueError, "ids \\[2\\]"), (1, TypeError, "=1")],
    ids=["bool", "too-deep", "not-a-tuple"],
)
def test_forward_refuses_bad_feature_layers(layers, error, message):
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    tokens, positions, capacity = _eager_inputs()
    with pytest.raises(error, match=message):
        target(tokens, positions, target.init_cache(1, capacity), feature_layers=layers)


def test_forward_accepts_python_lists_and_numpy_arrays():
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    ref, _, _ = _forward(target, [[1, 2, 3]], [[0, 1, 2]], target.init_cache(1, 4))
    from_lists, _, _ = target([[1, 2, 3]], np.asarray([[0, 1, 2]]), target.init_cache(1, 4))
    np.testing.assert_allclose(from_lists, ref, atol=1e-5)


@pytest.mark.parametrize(
    "tokens, positions, message",
    [
        ([[1, V]], [[0, 1]], f"tokens hold ids 1..{V}: expected 0 <= id < vocab_size={V}"),
        ([[-1, 2]], [[0, 1]], "tokens hold ids -1..2"),
        ([[1, 2]], [[7, 8]], "positions hold 7..8: expected 0 <= position < cache capacity=8"),
        ([[1, 2]], [[-1, 0]], "positions hold -1..0"),
    ],
    ids=["id-V", "id-negative", "past-capacity", "negative-position"],
)
def test_eager_forward_refuses_out_of_range_values(tokens, positions, message):
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=message):
        target(jnp.asarray(tokens), jnp.asarray(positions), target.init_cache(1, 8))
    # Padding entries are not checked.
    target(jnp.asarray(tokens), jnp.asarray(positions), target.init_cache(1, 8), valid=jnp.zeros((1, 2), bool))


@pytest.mark.parametrize(
    "batch, capacity, message", [(0, 8, "batch=0"), (1, 0, "capacity=0"), (1, -1, "capacity=-1"), (1.5, 8, "batch=1.5")]
)
def test_init_cache_refuses_empty_or_non_integer_sizes(batch, capacity, message):
    target = Qwen3Target(_cfg(), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=f"{message} is invalid: must be an integer >= 1"):
        target.init_cache(batch, capacity)


@pytest.mark.parametrize(
    "field, value", [("model_type", "llama"), ("hidden_act", "gelu"), ("use_sliding_window", True)]
)
def test_load_target_refuses_config_fields_it_does_not_implement(tmp_path, field, value):
    cfg = _cfg()
    _write_hf(tmp_path, cfg, _hf_tensors(cfg, seed=0))
    hf = cfg.to_hf_config()
    with open(tmp_path / "config.json", "w") as f:
        json.dump(hf | {field: value}, f)
    with pytest.raises(
        ValueError, match=f"{field}={value!r} is invalid: not supported by the reference Qwen3 target, must be"
    ):
        load_target(tmp_path)
    with open(tmp_path / "config.json", "w") as f:  # absent is fine
        json.dump({k: v for k, v in hf.items() if k != field}, f)
    load_target(tmp_path)


@pytest.mark.parametrize(
    "value, dtype, message",
    [
        (np.ones(H, np.int32), None, "has dtype int32: expected a floating-point dtype"),
        (np.ones(H, bool), None, "has dtype bool"),
        (np.full(H, np.nan, np.float32), None, "not finite after the cast to float32: NaN or inf"),
        (np.full(H, 1e30, np.float32), "float16", "not finite after the cast to float16: values overflow"),
    ],
    ids=["int", "bool", "nan", "overflow"],
)
def test_load_target_refuses_non_float_or_non_finite_weights(tmp_path, value, dtype, message):
    cfg = _cfg()
    _write_hf(tmp_path, cfg, _hf_tensors(cfg, seed=0) | {"model.norm.weight": value})
    with pytest.raises(ValueError, match=f"'model.norm.weight'.*{message}"):
        load_target(tmp_path, dtype=dtype)


def test_load_target_names_the_unreadable_file(tmp_path):
    cfg = _cfg()
    _write_hf(tmp_path, cfg, _hf_tensors(cfg, seed=0))
    config = str(tmp_path / "config.json")
    for text, message in (("{oops", "is not valid JSON"), ("[1, 2]", "holds a JSON list")):
        with open(config, "w") as f:
            f.write(text)
        with pytest.raises(ValueError, match=f"{re.escape(config)}.*{message}"):
            load_target(tmp_path)
    with open(config, "w") as f:
        json.dump(cfg.to_hf_config(), f)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text("{oops")
    with pytest.raises(ValueError, match=f"{re.escape(str(index))}.*is not valid JSON"):
        load_target(tmp_path)
    index.unlink()
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(ValueError, match=f"{re.escape(str(weights))}.*not a readable safetensors file"):
        load_target(tmp_path)


@pytest.mark.parametrize(
    "draft, target, message",
    [("target", "draft", "draft_cfg must be a DraftConfig, got TargetConfig"), ("draft", None, "target_cfg.*NoneType")],
    ids=["swapped", "none"],
)
def test_check_pair_refuses_configs_of_the_wrong_type(draft, target, message):
    cfgs = {"draft": _draft_cfg(), "target": _cfg(), None: None}
    with pytest.raises(TypeError, match=message):
        check_pair(cfgs[draft], cfgs[target])


def test_save_target_refuses_a_path_that_is_a_file(tmp_path):
    path = tmp_path / "afile"
    path.write_text("")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}' exists and is not a folder"):
        save_target(Qwen3Target(_cfg(), rngs=nnx.Rngs(0)), path)


def test_save_and_load_name_a_model_or_path_of_the_wrong_kind(tmp_path):
    from dspark_jax.checkpoint import load_draft

    with pytest.raises(TypeError, match="target must be a Qwen3Target, got object"):
        save_target(object(), tmp_path / "out")
    assert not (tmp_path / "out").exists()
    for load in (load_target, load_draft):
        with pytest.raises(TypeError, match=r"path must be a str or os.PathLike \(a checkpoint folder\), got NoneType"):
            load(None)


def test_a_stored_dtype_that_is_not_a_name_falls_back_to_float32(tmp_path):
    cfg = _cfg()
    _write_hf(tmp_path, cfg, _hf_tensors(cfg, seed=1))
    with open(tmp_path / "config.json") as f:
        hf = json.load(f)
    hf["torch_dtype"] = ["bfloat16"]  # not one of the dtype names: ignored, as an unknown name is
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert load_target(tmp_path).embed_tokens.dtype == jnp.float32


def test_an_index_mapping_a_tensor_to_the_wrong_shard_or_to_no_file_is_named(tmp_path):
    """A tensor listed for the wrong shard was reported as missing; a shard name that is not a
    string failed in ``os.path.join``."""
    import json

    save_target(Qwen3Target(_cfg(), rngs=nnx.Rngs(3)), tmp_path, max_shard_bytes=4000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    wrong = next(s for s in shards if s != index["weight_map"]["lm_head.weight"])
    moved = {**index, "weight_map": {**index["weight_map"], "lm_head.weight": wrong}}
    index_path.write_text(json.dumps(moved))
    with pytest.raises(ValueError, match=f"tensor 'lm_head.weight' is listed for '{wrong}' .* but not stored in it"):
        load_target(tmp_path)
    index_path.write_text(json.dumps({**index, "weight_map": {**index["weight_map"], "lm_head.weight": 5}}))
    with pytest.raises(ValueError, match="maps tensor 'lm_head.weight' to 5: expected the file name of a shard"):
        load_target(tmp_path)


def _edit_config(path, **fields) -> None:
    """Sets (or, with ``None``, removes) fields of the checkpoint's ``config.json``."""
    config = path / "config.json"
    hf = json.loads(config.read_text())
    for name, value in fields.items():
        if value is None:
            hf.pop(name, None)
        else:
            hf[name] = value
    config.write_text(json.dumps(hf))


@pytest.mark.parametrize(
    ("stored", "want"),
    [
        (dict(torch_dtype="bfloat16"), "bfloat16"),
        (dict(torch_dtype=None, dtype="float16"), "float16"),
        (dict(torch_dtype="bfloat16", dtype="float16"), "bfloat16"),  # torch_dtype first
        (dict(torch_dtype="float64"), "float32"),  # not a dtype the target runs in
        (dict(torch_dtype=None), "float32"),
    ],
    ids=["torch_dtype", "dtype", "both", "unknown-name", "none"],
)
def test_load_target_without_a_dtype_takes_the_checkpoints_torch_dtype_or_dtype(tmp_path, stored, want):
    cfg = _cfg()
    tensors = _hf_tensors(cfg, seed=4)
    _write_hf(tmp_path, cfg, tensors)
    _edit_config(tmp_path, **stored)
    target = load_target(tmp_path)
    assert target.config.dtype == target.config.param_dtype == want
    kernel = target.layers[0].mlp.up_proj.kernel.get_value()
    assert kernel.dtype == target.embed_tokens.dtype == jnp.dtype(want)
    np.testing.assert_array_equal(
        np.asarray(kernel), tensors["model.layers.0.mlp.up_proj.weight"].T.astype(jnp.dtype(want))
    )


def test_a_tied_checkpoint_may_store_lm_head_only_as_an_exact_copy_of_the_embedding(tmp_path):
    cfg = _cfg(tie_word_embeddings=True)
    tensors = _hf_tensors(cfg, seed=5)
    embed = tensors["model.embed_tokens.weight"]
    _write_hf(tmp_path / "copy", cfg, tensors | {"lm_head.weight": embed.copy()})
    target = load_target(tmp_path / "copy")
    np.testing.assert_array_equal(np.asarray(target.lm_head), embed)
    tokens = [3, 1, 4]
    np.testing.assert_allclose(_logits(target, tokens), _numpy_forward(tensors, cfg, tokens), rtol=1e-4, atol=1e-4)
    other = embed.copy()
    other[2, 3] += 0.5
    _write_hf(tmp_path / "differs", cfg, tensors | {"lm_head.weight": other})
    message = "tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight"
    with pytest.raises(ValueError, match=message):
        load_target(tmp_path / "differs")


def test_a_tensor_in_a_shard_that_the_index_does_not_map_is_refused(tmp_path):
    """An index that omits a stored tensor is refused, naming the tensor and its shard,
    instead of the tensor being loaded from wherever it lies."""
    save_target(Qwen3Target(_cfg(), rngs=nnx.Rngs(3)), tmp_path, max_shard_bytes=4000)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    index_path.write_text(json.dumps(index))
    message = f"tensor 'model.norm.weight' is in shard '{shard}' but the index does not map it there"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_target(tmp_path)


@pytest.mark.parametrize("where", ["sub", ".."])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(tmp_path, where):
    """Only plain file names in the checkpoint folder: ``sub/x`` or ``../x`` is refused even
    where that file exists."""
    folder = tmp_path / "ckpt"
    save_target(Qwen3Target(_cfg(), rngs=nnx.Rngs(3)), folder, max_shard_bytes=4000)
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"]["model.norm.weight"]
    os.makedirs(folder / where, exist_ok=True)
    os.replace(folder / shard, folder / where / shard)
    moved = f"{where}/{shard}"
    index["weight_map"] = {name: moved if s == shard else s for name, s in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    message = f"maps tensor '{next(n for n, s in index['weight_map'].items() if s == moved)}' to '{moved}': "
    with pytest.raises(ValueError, match=re.escape(message + "expected the file name of a shard in the folder")):
        load_target(folder)
