"""save_draft / load_draft: round trips, hand-written DeepSpec checkpoints, every refusal."""

from __future__ import annotations

import json
import os
import re
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import np_reference as ref
import numpy as np
import pytest
from draft_testing import EMBED_ROWS, TINY, jit_apply, random_draft, rel_err, tiny_config
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from dspark_jax import checkpoint, safetensors_io
from dspark_jax.cache import context_mask
from dspark_jax.checkpoint import INDEX_NAME, WEIGHTS_NAME, load_draft, save_draft
from dspark_jax.config import TargetConfig
from dspark_jax.draft import DSparkDraft
from dspark_jax.markov import markov_walk
from dspark_jax.target import Qwen3Target

TOL = 1e-5


@pytest.fixture(autouse=True)
def highest_precision():
    with jax.default_matmul_precision("highest"):
        yield


def _leaves(draft) -> dict:
    return {path: np.asarray(jax.device_get(v[...])) for path, v in nnx.to_flat_state(nnx.state(draft))}


def assert_identical(a, b) -> None:
    la, lb = _leaves(a), _leaves(b)
    assert la.keys() == lb.keys()
    for path in la:
        assert la[path].dtype == lb[path].dtype, path
        np.testing.assert_array_equal(la[path], lb[path], err_msg=str(path))
    assert a.cfg == b.cfg


def _tables(draft) -> dict:
    return {"embed_tokens": draft.embed_tokens[...], "lm_head": draft.lm_head[...]}


# ------------------------------------------------------------------ round trips
@pytest.mark.parametrize(
    "overrides",
    [
        {"markov_head_type": "rnn"},
        {"markov_head_type": "gated", "dtype": "bfloat16", "param_dtype": "bfloat16"},
        {"markov_rank": 0, "confidence_head_with_markov": False, "sample_from_anchor": False},
    ],
    ids=["rnn-f32", "gated-bf16", "dflash-no-head"],
)
def test_saved_draft_loads_back_identical(overrides, tmp_path):
    cfg = tiny_config(**overrides)
    draft = random_draft(cfg, seed=1)
    assert save_draft(draft, tmp_path) == [WEIGHTS_NAME]
    loaded = load_draft(tmp_path, dtype=cfg.param_dtype, **_tables(draft))
    assert_identical(draft, loaded)


def test_bfloat16_tensors_are_stored_as_bfloat16(tmp_path):
    draft = random_draft(tiny_config(dtype="bfloat16", param_dtype="bfloat16"), seed=2)
    save_draft(draft, tmp_path)
    with safe_open(os.path.join(tmp_path, WEIGHTS_NAME), "numpy") as f:
        assert f.get_tensor("fc.weight").dtype == ml_dtypes.bfloat16
        # The confidence head keeps float32 parameters in a bfloat16 draft.
        assert f.get_tensor("confidence_head.proj.weight").dtype == np.float32


def test_borrowed_tables_are_saved_only_when_asked(tmp_path):
    draft = random_draft(tiny_config(), seed=3)
    save_draft(draft, tmp_path / "without")
    with pytest.raises(ValueError, match="no embed_tokens for the draft"):
        load_draft(tmp_path / "without")
    save_draft(draft, tmp_path / "with", include_borrowed=True)
    assert_identical(draft, load_draft(tmp_path / "with"))


def test_sharded_save_writes_an_index_and_loads_back_identical(tmp_path):
    draft = random_draft(tiny_config(markov_head_type="rnn"), seed=4)
    files = save_draft(draft, tmp_path, max_shard_bytes=8_000, include_borrowed=True)
    assert len(files) > 2 and all(f.startswith("model-") for f in files)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert sorted(set(index["weight_map"].values())) == sorted(files)
    assert_identical(draft, load_draft(tmp_path))
    # Saving unsharded into the same folder replaces the shards and their index.
    save_draft(draft, tmp_path, include_borrowed=True)
    assert sorted(p for p in os.listdir(tmp_path) if p != "config.json") == [WEIGHTS_NAME]
    assert_identical(draft, load_draft(tmp_path))


def test_the_index_total_size_is_the_bytes_of_every_tensor_in_the_shards(tmp_path):
    """``metadata.total_size`` counts bytes (bfloat16 weights 2 each, the float32 confidence
    head 4), as the Hugging Face index does, not elements."""
    draft = random_draft(tiny_config(dtype="bfloat16", param_dtype="bfloat16"), seed=6)
    files = save_draft(draft, tmp_path, max_shard_bytes=8_000, include_borrowed=True)
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    nbytes, dtypes = 0, set()
    for file in files:
        for tensor in load_file(str(tmp_path / file)).values():
            nbytes += tensor.nbytes
            dtypes.add(tensor.dtype)
    assert dtypes == {np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)}
    assert index["metadata"]["total_size"] == nbytes


@pytest.mark.parametrize(("limit", "shards"), [(80, [["a", "b"]]), (79, [["a"], ["b"]])])
def test_tensors_that_exactly_fill_max_shard_bytes_share_one_shard(limit, shards, tmp_path):
    """Shards hold at most ``max_shard_bytes``: two 40-byte tensors fit one shard of 80
    bytes, and need two at 79."""
    tensors = {"a": np.arange(10, dtype=np.float32), "b": np.ones(10, np.float32)}
    files = safetensors_io.write_tensors(str(tmp_path), tensors, max_shard_bytes=limit)
    assert len(files) == len(shards)
    assert [sorted(load_file(str(tmp_path / file))) for file in files] == shards
    weight_map = json.loads((tmp_path / INDEX_NAME).read_text())["weight_map"]
    assert weight_map == {name: file for file, names in zip(files, shards, strict=True) for name in names}


def test_saved_files_are_readable_as_the_umask_allows_like_config_json(tmp_path):
    """safetensors creates its files 0600; every saved file gets config.json's mode."""
    draft = random_draft(tiny_config(), seed=5)
    files = save_draft(draft, tmp_path, max_shard_bytes=8_000)
    want = os.stat(tmp_path / "config.json").st_mode & 0o777
    assert want & 0o044  # readable by others under the usual umask
    for name in [*files, INDEX_NAME]:
        assert os.stat(tmp_path / name).st_mode & 0o777 == want, name


def _fail_on_second_write(monkeypatch):
    """Makes the second safetensors file written raise ``OSError(ENOSPC)`` (a full disk)."""
    real = safetensors_io.save_file
    calls = []

    def save_file(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(*args, **kwargs)

    monkeypatch.setattr(safetensors_io, "save_file", save_file)


class _Killed(BaseException):
    """Stands for the process being killed: no ``except Exception`` or cleanup catches it."""


@pytest.mark.parametrize("old_shards", [None, 8_000], ids=["over-single", "over-sharded"])
def test_a_save_killed_while_moving_its_files_is_finished_by_the_next_load(old_shards, tmp_path, monkeypatch):
    """A save cut short between two of its ``os.replace`` calls left old and new files mixed
    (a new shard beside the old config); the next load now finishes the move first."""
    old = random_draft(tiny_config(markov_head_type="rnn"), seed=5)
    save_draft(old, tmp_path, include_borrowed=True, max_shard_bytes=old_shards)
    real, moved = os.replace, []

    def replace(src, dst):
        if os.path.dirname(dst) == str(tmp_path):  # a file moved into the checkpoint folder
            if len(moved) == 1:
                raise _Killed
            moved.append(dst)
        return real(src, dst)

    monkeypatch.setattr(safetensors_io.os, "replace", replace)
    new = random_draft(tiny_config(markov_head_type="gated", block_size=3), seed=6)
    with pytest.raises(_Killed):
        save_draft(new, tmp_path, include_borrowed=True, max_shard_bytes=6_000)
    monkeypatch.undo()
    assert json.loads((tmp_path / "config.json").read_text())["markov_head_type"] == "rnn"  # mixed: old config
    assert len([p for p in os.listdir(tmp_path) if p.startswith(".saving-")]) == 1
    with pytest.warns(UserWarning, match="finished a save that was cut short while its files were moved"):
        loaded = load_draft(tmp_path)
    assert_identical(new, loaded)
    assert sorted(os.listdir(tmp_path)) == sorted(["config.json", INDEX_NAME, *checkpoint_files(tmp_path)])


def test_a_cut_short_save_that_cannot_be_finished_is_named(tmp_path, monkeypatch):
    draft = random_draft(tiny_config(), seed=5)
    save_draft(draft, tmp_path, include_borrowed=True)
    staging = tmp_path / ".saving-x"
    staging.mkdir()
    (staging / WEIGHTS_NAME).write_bytes((tmp_path / WEIGHTS_NAME).read_bytes())
    (staging / safetensors_io.JOURNAL_NAME).write_text(json.dumps({"files": [WEIGHTS_NAME], "stale": []}))

    def replace(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(safetensors_io.os, "replace", replace)
    want = f"checkpoint folder {str(tmp_path)!r} holds a save cut short while its files were moved into place "
    with pytest.raises(ValueError, match=re.escape(want + f"({str(staging)!r}); finishing it failed")):
        load_draft(tmp_path)
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="finished a save"):
        assert_identical(draft, load_draft(tmp_path))
    assert not staging.exists()


@pytest.mark.parametrize("entry", ["../victim.safetensors", "/tmp/elsewhere.json", "sub/model.safetensors", "x.py"])
def test_a_journal_naming_a_path_outside_the_folder_is_refused_and_nothing_is_touched(entry, tmp_path):
    """A journal is read from the folder it finishes: ``"stale": ["../victim.txt"]`` deleted that
    file during an ordinary load."""
    folder = tmp_path / "ckpt"
    draft = random_draft(tiny_config(), seed=5)
    save_draft(draft, folder, include_borrowed=True)
    victim = tmp_path / "victim.safetensors"
    victim.write_text("keep me")
    staging = folder / ".saving-x"
    staging.mkdir()
    (staging / safetensors_io.JOURNAL_NAME).write_text(json.dumps({"files": [], "stale": [entry]}))
    with pytest.raises(ValueError, match=re.escape(f"lists stale entry {entry!r}: a save journal names only")):
        load_draft(folder)
    assert victim.read_text() == "keep me" and staging.exists()


def test_a_folder_named_like_a_glob_pattern_loses_its_old_layout_on_a_new_save(tmp_path):
    """In ``run[1]`` the old index was not found (its name read as a pattern) and stayed beside
    the new single file: loads read the old weights through it."""
    folder = tmp_path / "run[1]"
    old, new = random_draft(tiny_config(), seed=5), random_draft(tiny_config(), seed=6)
    save_draft(old, folder, include_borrowed=True, max_shard_bytes=8_000)
    save_draft(new, folder, include_borrowed=True)
    assert sorted(os.listdir(folder)) == ["config.json", WEIGHTS_NAME]
    assert_identical(new, load_draft(folder))


def test_the_commands_checkpoint_check_finishes_a_first_save_cut_short(tmp_path, monkeypatch):
    """A folder whose first save was killed before ``config.json`` moved was refused as
    having no ``config.json`` before the loader could finish the move."""
    from dspark_jax.cli import check_checkpoint

    real = os.replace

    def replace(src, dst):  # killed at the first file moved into place
        if os.path.dirname(dst) == str(tmp_path):
            raise _Killed
        return real(src, dst)

    draft = random_draft(tiny_config(), seed=5)
    monkeypatch.setattr(safetensors_io.os, "replace", replace)
    with pytest.raises(_Killed):
        save_draft(draft, tmp_path, include_borrowed=True)
    monkeypatch.undo()
    assert not (tmp_path / "config.json").exists()
    with pytest.warns(UserWarning, match="finished a save that was cut short"):
        check_checkpoint("--draft", str(tmp_path))
    assert_identical(draft, load_draft(tmp_path))


def checkpoint_files(folder):
    return [p for p in os.listdir(folder) if p.endswith(".safetensors")]


@pytest.mark.parametrize("old_shards", [None, 8_000], ids=["over-single", "over-sharded"])
def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary_files(old_shards, tmp_path, monkeypatch):
    old = random_draft(tiny_config(markov_head_type="rnn"), seed=5)
    save_draft(old, tmp_path, include_borrowed=True, max_shard_bytes=old_shards)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    _fail_on_second_write(monkeypatch)
    new = random_draft(tiny_config(markov_head_type="gated", block_size=3), seed=6)
    with pytest.raises(OSError, match="No space left on device"):
        save_draft(new, tmp_path, include_borrowed=True, max_shard_bytes=6_000)
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before
    assert_identical(old, load_draft(tmp_path))
    monkeypatch.undo()
    save_draft(new, tmp_path, include_borrowed=True, max_shard_bytes=6_000)  # over it: the old layout goes
    index = json.loads((tmp_path / INDEX_NAME).read_text())
    assert sorted(os.listdir(tmp_path)) == sorted({"config.json", INDEX_NAME, *index["weight_map"].values()})
    assert_identical(new, load_draft(tmp_path))


def test_save_rejects_a_bad_shard_size(tmp_path):
    with pytest.raises(ValueError, match="max_shard_bytes=0 is invalid: must be an integer >= 1 or None"):
        save_draft(random_draft(tiny_config()), tmp_path, max_shard_bytes=0)


# --------------------------------------------------- hand-written DeepSpec files
def deepspec_config(**extra) -> dict:
    hf = {**TINY, "target_layer_ids": list(TINY["target_layer_ids"]), "model_type": "qwen3"}
    hf.update({"markov_head_type": "rnn", **extra})
    return hf


def deepspec_tensors(hf: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Every tensor of spec §2 under its DeepSpec name, PyTorch [out, in] layouts, float32."""
    rng = np.random.default_rng(seed)
    h, i, d = hf["hidden_size"], hf["intermediate_size"], hf["head_dim"]
    nh, kvh, r = hf["num_attention_heads"], hf["num_key_value_heads"], hf["markov_rank"]
    k = len(hf["target_layer_ids"])

    def w(*shape, scale=0.3):
        return (scale * rng.standard_normal(shape)).astype(np.float32)

    def norm(n):
        return (1.0 + 0.3 * rng.standard_normal(n)).astype(np.float32)

    t = {"fc.weight": w(h, k * h), "hidden_norm.weight": norm(h), "norm.weight": norm(h)}
    for n in range(hf["num_hidden_layers"]):
        p = f"layers.{n}."
        t |= {
            p + "self_attn.q_proj.weight": w(nh * d, h),
            p + "self_attn.k_proj.weight": w(kvh * d, h),
            p + "self_attn.v_proj.weight": w(kvh * d, h),
            p + "self_attn.o_proj.weight": w(h, nh * d),
            p + "self_attn.q_norm.weight": norm(d),
            p + "self_attn.k_norm.weight": norm(d),
            p + "mlp.gate_proj.weight": w(i, h),
            p + "mlp.up_proj.weight": w(i, h),
            p + "mlp.down_proj.weight": w(h, i),
            p + "input_layernorm.weight": norm(h),
            p + "post_attention_layernorm.weight": norm(h),
        }
    if r:
        t["markov_head.markov_w1.weight"] = w(hf["vocab_size"], r, scale=1.0)
        t["markov_head.markov_w2.weight"] = w(hf["vocab_size"], r, scale=1.0)
        if hf["markov_head_type"] == "gated":
            t |= {"markov_head.gate_proj.weight": w(r, h + r), "markov_head.gate_proj.bias": w(r)}
        if hf["markov_head_type"] == "rnn":
            t |= {"markov_head.joint_proj.weight": w(3 * r, 2 * r + h), "markov_head.joint_proj.bias": w(3 * r)}
    if hf["enable_confidence_head"]:
        width = h + (r if hf["confidence_head_with_markov"] else 0)
        t |= {"confidence_head.proj.weight": w(1, width), "confidence_head.proj.bias": w(1)}
        gamma = hf["block_size"] - (0 if hf.get("sample_from_anchor", True) else 1)  # the file counts rows
        t["confidence_head.sts_temperature"] = rng.uniform(0.5, 2.0, gamma).astype(np.float32)
    t["embed_tokens.weight"] = w(EMBED_ROWS, h, scale=0.5)
    t["lm_head.weight"] = w(EMBED_ROWS, h, scale=0.5)
    return t


def write_checkpoint(folder, hf: dict, tensors: dict, *, prefix: str = "model.", shards: int = 1) -> None:
    """Writes the files by hand (safetensors + json), PyTorch names with the ``model.`` prefix."""
    os.makedirs(folder, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(hf))
    named = {(n if n == "lm_head.weight" else prefix + n): a for n, a in tensors.items()}
    if shards == 1:
        save_file(named, str(folder / WEIGHTS_NAME))
        return
    names = sorted(named)
    weight_map = {}
    for s in range(shards):
        file = f"part-{s}.safetensors"
        part = {n: named[n] for n in names[s::shards]}
        save_file(part, str(folder / file))
        weight_map |= dict.fromkeys(part, file)
    (folder / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _forward(draft, bonus, prefix_lens, feats):
    n = feats.shape[1]
    ctx_k, ctx_v = draft.context_kv(feats, jnp.broadcast_to(jnp.arange(n), (2, n)))
    hidden = draft(
        draft.block_ids(bonus),
        positions=draft.block_positions(prefix_lens),
        ctx_k=ctx_k,
        ctx_v=ctx_v,
        ctx_mask=context_mask(prefix_lens, n),
    )
    slots = draft.slots(hidden)
    return slots, draft.base_logits(slots)


@pytest.mark.parametrize("anchor", [True, False], ids=["anchor", "dflash"])
def test_hand_written_deepspec_checkpoint_matches_the_reference(anchor, tmp_path):
    hf = deepspec_config(sample_from_anchor=anchor, block_size=TINY["block_size"] + (0 if anchor else 1))
    tensors = deepspec_tensors(hf, seed=5)
    write_checkpoint(tmp_path, hf, tensors)
    draft = load_draft(tmp_path, layout="anchor" if anchor else "dflash")
    cfg = draft.cfg
    assert cfg.gamma == TINY["block_size"] and cfg.sample_from_anchor == anchor
    p = {n: a.astype(np.float64) for n, a in tensors.items()}
    rng = np.random.default_rng(6)
    bonus, prefix_lens = np.array([3, 17]), np.array([5, 2])
    feats = rng.standard_normal((2, 5, cfg.num_fused_layers * cfg.hidden_size))
    slots, base = jit_apply(
        _forward, draft, jnp.asarray(bonus), jnp.asarray(prefix_lens), jnp.asarray(feats, jnp.float32)
    )
    slots_ref, base_ref = ref.draft_forward(bonus, prefix_lens, feats, p, cfg)
    assert rel_err(slots, slots_ref) <= TOL
    assert rel_err(base, base_ref) <= TOL
    tokens, corrected = markov_walk(
        draft.markov_head, base, slots, jnp.asarray(bonus), lambda k, x: jnp.argmax(x, axis=-1)
    )
    tokens_ref, corrected_ref = ref.markov_walk("rnn", p, base_ref, slots_ref, bonus, lambda k, x: np.argmax(x, -1))
    np.testing.assert_array_equal(np.asarray(tokens), tokens_ref)
    assert rel_err(corrected, corrected_ref) <= TOL
    prev = np.concatenate([bonus[:, None], tokens_ref[:, :-1]], axis=1)
    conf = draft.confidence(slots, jnp.asarray(prev))
    conf_ref = ref.confidence(p, slots_ref, prev, True, p["confidence_head.sts_temperature"])
    assert rel_err(conf, conf_ref) <= TOL


def test_sharded_hand_written_checkpoint_loads_like_the_single_file(tmp_path):
    hf = deepspec_config()
    tensors = deepspec_tensors(hf, seed=7)
    write_checkpoint(tmp_path / "one", hf, tensors, prefix="")
    write_checkpoint(tmp_path / "three", hf, tensors, shards=3)
    assert len([f for f in os.listdir(tmp_path / "three") if f.endswith(".safetensors")]) == 3
    assert_identical(load_draft(tmp_path / "one"), load_draft(tmp_path / "three"))


def test_missing_sts_temperature_means_one(tmp_path):
    hf = deepspec_config()
    tensors = deepspec_tensors(hf)
    del tensors["confidence_head.sts_temperature"]
    write_checkpoint(tmp_path, hf, tensors)
    np.testing.assert_array_equal(load_draft(tmp_path).confidence_head.sts_temperature[...], np.ones(4))


def test_load_casts_to_the_requested_dtype_but_keeps_the_confidence_head_float32(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    draft = load_draft(tmp_path, dtype="bfloat16")
    assert draft.cfg.dtype == "bfloat16" and draft.fc.kernel[...].dtype == jnp.bfloat16
    assert draft.embed_tokens[...].dtype == jnp.bfloat16
    assert draft.confidence_head.proj.kernel[...].dtype == jnp.float32
    with pytest.raises(ValueError, match=r"dtype='float64' is invalid: must be one of \['bfloat16', 'float16'"):
        load_draft(tmp_path, dtype="float64")


# ----------------------------------------------------------------- refusals
def _broken(tmp_path, *, hf_extra=None, drop=(), add=None, reshape=None):
    hf = deepspec_config(**(hf_extra or {}))
    tensors = deepspec_tensors(deepspec_config())
    for name in drop:
        del tensors[name]
    tensors |= add or {}
    for name, shape in (reshape or {}).items():
        tensors[name] = np.zeros(shape, np.float32)
    write_checkpoint(tmp_path, hf, tensors)
    return tmp_path


def test_misshapen_tensor_is_named_with_both_shapes(tmp_path):
    path = _broken(tmp_path, reshape={"layers.1.mlp.up_proj.weight": (32, 48)})
    message = "tensor 'layers.1.mlp.up_proj.weight' has shape [32, 48] in the checkpoint, expected [48, 32] (PyTorch"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_draft(path)


def test_misshapen_tensor_is_refused_before_any_weight_reaches_the_device(tmp_path, monkeypatch):
    path = _broken(tmp_path, reshape={"fc.weight": (32, 95)})  # the file also stores both borrowed tables
    cast = []
    real = checkpoint.cast_weight
    monkeypatch.setattr(checkpoint, "cast_weight", lambda name, *args: cast.append(name) or real(name, *args))
    with pytest.raises(ValueError, match=re.escape("tensor 'fc.weight' has shape [32, 95] in the checkpoint")):
        load_draft(path)
    assert cast == []
    load_draft(_broken(tmp_path / "fine"))
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight"} <= set(cast)


def test_markov_rank_mismatch_is_a_shape_error(tmp_path):
    path = _broken(tmp_path, reshape={"markov_head.markov_w2.weight": (40, 16)})
    with pytest.raises(
        ValueError,
        match=re.escape("'markov_head.markov_w2.weight' has shape [40, 16] in the checkpoint, expected [40, 8]"),
    ):
        load_draft(path)


def test_confidence_input_width_mismatch_points_at_the_markov_flag(tmp_path):
    path = _broken(tmp_path, reshape={"confidence_head.proj.weight": (1, 32)})
    with pytest.raises(
        ValueError, match=re.escape("expected [1, 40] (PyTorch [out, in] layout) (confidence_head_with_markov=True")
    ):
        load_draft(path)


def test_missing_tensor_is_named_with_its_shape(tmp_path):
    path = _broken(tmp_path, drop=["layers.0.self_attn.k_norm.weight"])
    with pytest.raises(
        ValueError, match=re.escape("missing tensor 'layers.0.self_attn.k_norm.weight': expected shape [8]")
    ):
        load_draft(path)


def test_unexpected_tensor_is_named_with_its_shape(tmp_path):
    path = _broken(tmp_path, add={"d2t": np.zeros(40, np.float32)})
    with pytest.raises(ValueError, match=re.escape("unexpected tensor 'd2t' with shape [40]")):
        load_draft(path)


HEAD_MISMATCHES = [
    (
        {"markov_head_type": "vanilla"},
        (),
        "config.json says markov_head_type='vanilla' but the checkpoint holds a 'rnn' Markov head "
        "(markov_head.joint_proj.bias, markov_head.joint_proj.weight)",
    ),
    (
        {},
        ("markov_head.joint_proj.weight", "markov_head.joint_proj.bias"),
        "config.json says markov_head_type='rnn' but the checkpoint holds a 'vanilla' Markov head "
        "(no gate_proj / joint_proj tensors)",
    ),
    (
        {"markov_rank": 0, "confidence_head_with_markov": False},
        (),
        "config.json has markov_rank=0 (no Markov head) but the checkpoint has Markov head tensors",
    ),
    (
        {"enable_confidence_head": False, "confidence_head_with_markov": False},
        (),
        "config.json has enable_confidence_head=False but the checkpoint has confidence head tensors",
    ),
]


@pytest.mark.parametrize(
    ("hf_extra", "drop", "message"), HEAD_MISMATCHES, ids=["vanilla-vs-rnn", "rnn-no-joint", "rank0", "no-conf"]
)
def test_head_type_that_does_not_match_the_tensors_is_refused(hf_extra, drop, message, tmp_path):
    path = _broken(tmp_path, hf_extra=hf_extra, drop=drop)
    with pytest.raises(ValueError, match="head type mismatch: " + re.escape(message)):
        load_draft(path)


def test_gated_config_with_rnn_tensors_is_refused(tmp_path):
    path = _broken(tmp_path, hf_extra={"markov_head_type": "gated"})
    with pytest.raises(ValueError, match=re.escape("markov_head_type='gated' but the checkpoint holds a 'rnn'")):
        load_draft(path)


def test_mask_id_outside_the_embedding_is_refused(tmp_path):
    path = _broken(tmp_path, hf_extra={"mask_token_id": 40})
    with pytest.raises(
        ValueError,
        match=re.escape(
            "mask_token_id=40 is invalid: must be a token id inside the embedding, 0 <= id < vocab_size=40"
        ),
    ):
        load_draft(path)


def test_layout_that_contradicts_the_config_is_refused(tmp_path):
    path = _broken(tmp_path, hf_extra={"sample_from_anchor": True})
    message = (
        "layout='dflash' contradicts the checkpoint: its config.json sets sample_from_anchor=True (layout='anchor')"
    )
    with pytest.raises(ValueError, match=re.escape(message)):
        load_draft(path, layout="dflash")
    assert load_draft(path, layout="anchor").cfg.sample_from_anchor
    with pytest.raises(
        ValueError, match=re.escape("layout='deepspec' is invalid: must be one of ['anchor', 'dflash']")
    ):
        load_draft(path, layout="deepspec")


def test_layout_is_checked_against_the_producer_default_when_the_file_is_silent(tmp_path):
    hf = {k: v for k, v in deepspec_config().items() if not k.startswith(("markov", "confidence", "enable"))}
    tensors = {
        n: a for n, a in deepspec_tensors(deepspec_config()).items() if not n.startswith(("markov", "confidence"))
    }
    hf["block_size"] = 5  # a DFlash file: anchor + 4 drafts
    write_checkpoint(tmp_path, hf, tensors)
    assert load_draft(tmp_path).cfg.gamma == 4
    message = "its config.json does not set sample_from_anchor, and its producer's default is sample_from_anchor=False"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_draft(tmp_path, layout="anchor")


def test_borrowed_tables_come_from_caller_then_target_then_checkpoint(tmp_path):
    hf = deepspec_config()
    tensors = deepspec_tensors(hf)
    write_checkpoint(tmp_path, hf, tensors)
    from_file = load_draft(tmp_path)
    np.testing.assert_array_equal(from_file.lm_head[...], tensors["lm_head.weight"])
    other = jnp.full((EMBED_ROWS, 32), 0.25)
    target = types.SimpleNamespace(embed_tokens=other, lm_head=other * 2)
    from_target = load_draft(tmp_path, target=target)
    assert from_target.embed_tokens[...] is other
    explicit = load_draft(tmp_path, target=target, lm_head=other * 3)
    np.testing.assert_array_equal(explicit.lm_head[...], other * 3)
    np.testing.assert_array_equal(explicit.embed_tokens[...], other)


def test_missing_borrowed_tables_raise_unless_tied(tmp_path):
    hf = deepspec_config()
    tensors = deepspec_tensors(hf)
    del tensors["lm_head.weight"]
    write_checkpoint(tmp_path / "untied", hf, tensors)
    with pytest.raises(ValueError, match="no lm_head for the draft: the checkpoint has no 'lm_head.weight'"):
        load_draft(tmp_path / "untied")
    write_checkpoint(tmp_path / "tied", {**hf, "tie_word_embeddings": True}, tensors)
    tied = load_draft(tmp_path / "tied")
    np.testing.assert_array_equal(tied.lm_head[...], tied.embed_tokens[...])


def _target_config(**overrides) -> TargetConfig:
    base = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, vocab_size=EMBED_ROWS,
    )  # fmt: skip
    return TargetConfig(**{**base, **overrides})


def test_attached_qwen3_target_lends_its_tables(tmp_path):
    hf = deepspec_config()
    tensors = deepspec_tensors(hf)
    del tensors["embed_tokens.weight"], tensors["lm_head.weight"]
    write_checkpoint(tmp_path, hf, tensors)
    # Built abstractly and filled with ones: only its tables matter here.
    graphdef, state = nnx.split(
        nnx.eval_shape(lambda: Qwen3Target(_target_config(tie_word_embeddings=True), rngs=nnx.Rngs(0)))
    )
    target = nnx.merge(graphdef, jax.tree.map(lambda x: jnp.full(x.shape, 0.5, x.dtype), state))
    draft = load_draft(tmp_path, target=target)
    np.testing.assert_array_equal(draft.embed_tokens[...], target.embed_tokens)
    np.testing.assert_array_equal(draft.lm_head[...], target.lm_head)


TARGET_MISFITS = [
    (
        {"hidden_size": 64, "num_attention_heads": 8},
        "target hidden_size=64 does not fit the draft: must equal the draft's hidden_size=32",
    ),
    ({"vocab_size": 39}, "target vocab_size=39 does not fit the draft: must be >= the draft's vocab_size=40"),
    (
        {"num_hidden_layers": 4},
        "target num_hidden_layers=4 does not fit the draft: it was trained on a target with num_target_layers=3",
    ),
]


@pytest.mark.parametrize(("overrides", "message"), TARGET_MISFITS, ids=["hidden", "vocab", "depth"])
def test_target_that_does_not_fit_is_refused(overrides, message, tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    tables = jnp.zeros((EMBED_ROWS, 32))
    target = types.SimpleNamespace(config=_target_config(**overrides), embed_tokens=tables, lm_head=tables)
    with pytest.raises(ValueError, match=re.escape(message)):
        load_draft(tmp_path, target=target)


def test_shallow_target_is_refused_when_the_config_omits_its_depth(tmp_path):
    hf = deepspec_config(num_target_layers=None)
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    tables = jnp.zeros((EMBED_ROWS, 32))
    target = types.SimpleNamespace(config=_target_config(num_hidden_layers=2), embed_tokens=tables, lm_head=tables)
    with pytest.raises(ValueError, match=re.escape("its target_layer_ids=[-1, 0, 2] need num_hidden_layers >= 3")):
        load_draft(tmp_path, target=target)


def test_unreadable_folders_are_refused(tmp_path):
    with pytest.raises(ValueError, match="has no config.json: expected a checkpoint folder"):
        load_draft(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(deepspec_config()))
    with pytest.raises(ValueError, match="has no model.safetensors, no model.safetensors.index.json"):
        load_draft(tmp_path)


def test_a_name_stored_with_and_without_the_prefix_is_refused(tmp_path):
    hf = deepspec_config()
    tensors = deepspec_tensors(hf)
    write_checkpoint(tmp_path, hf, tensors)
    # Without an index every *.safetensors file is read: model.norm.weight and norm.weight collide.
    save_file({"norm.weight": tensors["norm.weight"]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="tensor 'norm.weight' is stored twice"):
        load_draft(tmp_path)


def test_an_index_that_names_absent_shards_or_tensors_is_refused(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf), shards=2)
    good = json.loads((tmp_path / INDEX_NAME).read_text())
    bad_shard = {"weight_map": {**good["weight_map"], "model.norm.weight": "part-9.safetensors"}}
    (tmp_path / INDEX_NAME).write_text(json.dumps(bad_shard))
    with pytest.raises(ValueError, match="lists shard 'part-9.safetensors', which does not exist"):
        load_draft(tmp_path)
    bad_name = {"weight_map": {**good["weight_map"], "model.extra.weight": "part-0.safetensors"}}
    (tmp_path / INDEX_NAME).write_text(json.dumps(bad_name))
    message = "tensor 'model.extra.weight' is listed for 'part-0.safetensors' but not stored in it"
    with pytest.raises(ValueError, match=message):
        load_draft(tmp_path)


@pytest.mark.parametrize("bad", [0.0, -1.0, np.nan, np.inf], ids=["zero", "negative", "nan", "inf"])
def test_sts_temperature_that_is_not_finite_and_positive_is_refused(bad, tmp_path):
    temperature = np.array([1.0, bad, 1.5, 2.0], np.float32)
    _broken(tmp_path, add={"confidence_head.sts_temperature": temperature})
    message = f"tensor 'confidence_head.sts_temperature' holds {temperature.astype(np.float64).tolist()}"
    with pytest.raises(ValueError, match=re.escape(message) + ".*finite number > 0"):
        load_draft(tmp_path)


def test_a_shard_holding_a_tensor_its_index_does_not_map_is_refused(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf), shards=2)
    shard = str(tmp_path / "part-0.safetensors")
    save_file({**load_file(shard), "model.extra.weight": np.zeros(3, np.float32)}, shard)
    with pytest.raises(ValueError, match="tensor 'model.extra.weight' is in shard 'part-0.safetensors' but the index"):
        load_draft(tmp_path)


@pytest.mark.parametrize("where", ["sub", ".."])
def test_an_index_naming_a_shard_outside_the_folder_is_refused(where, tmp_path):
    """Only plain file names in the checkpoint folder: ``sub/x`` or ``../x`` is refused even
    where that file exists."""
    folder = tmp_path / "ckpt"
    hf = deepspec_config()
    write_checkpoint(folder, hf, deepspec_tensors(hf), shards=2)
    os.makedirs(folder / where, exist_ok=True)
    os.replace(folder / "part-0.safetensors", folder / where / "part-0.safetensors")
    index = json.loads((folder / INDEX_NAME).read_text())
    moved = f"{where}/part-0.safetensors"
    index["weight_map"] = {n: moved if s == "part-0.safetensors" else s for n, s in index["weight_map"].items()}
    (folder / INDEX_NAME).write_text(json.dumps(index))
    first = next(n for n, s in index["weight_map"].items() if s == moved)
    message = f"maps tensor {first!r} to {moved!r}: expected the file name of a shard in the folder"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_draft(folder)


def test_a_malformed_shard_index_is_named_with_its_path(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf), shards=2)
    index = tmp_path / "model.safetensors.index.json"
    for text, says in (("{", "is not valid JSON"), ("[]", "is not a JSON object")):
        index.write_text(text)
        with pytest.raises(ValueError, match=says) as err:
            load_draft(tmp_path)
        assert str(index) in str(err.value)


def test_borrowed_tables_that_are_not_arrays_are_type_errors(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    table = np.zeros((EMBED_ROWS, 32), np.float32)
    with pytest.raises(TypeError, match=r"target \(SimpleNamespace\) has no embed_tokens: it must be an object with"):
        load_draft(tmp_path, target=types.SimpleNamespace())
    with pytest.raises(TypeError, match=r"target \(SimpleNamespace\) has no lm_head"):
        load_draft(tmp_path, target=types.SimpleNamespace(embed_tokens=table))
    with pytest.raises(TypeError, match=r"embed_tokens must be a \[V', H\] array .* got list"):
        load_draft(tmp_path, embed_tokens=table.tolist())
    with pytest.raises(TypeError, match=r"target.lm_head must be a \[V', H\] array .* got str"):
        load_draft(tmp_path, target=types.SimpleNamespace(embed_tokens=table, lm_head="table"))
    # A target without tables is fine when the caller passes both.
    load_draft(tmp_path, target=types.SimpleNamespace(), embed_tokens=table, lm_head=table)


def test_malformed_config_json_is_named_with_its_path(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=re.escape(f"{str(tmp_path / 'config.json')!r} is not valid JSON")):
        load_draft(tmp_path)


@pytest.mark.parametrize(
    "name, value, dtype, message",
    [
        ("norm.weight", np.ones(32, np.int32), None, "has dtype int32: expected a floating-point dtype"),
        ("norm.weight", np.ones(32, bool), None, "has dtype bool: expected a floating-point dtype"),
        ("norm.weight", np.full(32, np.nan, np.float32), None, "not finite after the cast to float32: NaN or inf"),
        (
            "norm.weight",
            np.full(32, 1e30, np.float32),
            "float16",
            "not finite after the cast to float16: values overflow",
        ),
        ("layers.0.mlp.up_proj.weight", np.ones((48, 32), np.int32), None, "has dtype int32"),
        ("embed_tokens.weight", np.ones((EMBED_ROWS, 32), np.int32), None, "has dtype int32"),
    ],
    ids=["int", "bool", "nan", "overflow", "int-kernel", "int-stored-table"],
)
def test_load_draft_refuses_non_float_or_non_finite_weights(name, value, dtype, message, tmp_path):
    _broken(tmp_path, add={name: value})
    with pytest.raises(ValueError, match=re.escape(f"tensor {name!r} of {str(tmp_path)!r} ") + ".*" + message):
        load_draft(tmp_path, dtype=dtype)


def test_borrowed_tables_must_be_floating_and_finite(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    table = np.zeros((EMBED_ROWS, 32), np.float32)
    with pytest.raises(TypeError, match="embed_tokens has dtype int32: expected a floating dtype"):
        load_draft(tmp_path, embed_tokens=table.astype(np.int32), lm_head=table)
    with pytest.raises(TypeError, match="target.lm_head has dtype bool: expected a floating dtype"):
        load_draft(tmp_path, target=types.SimpleNamespace(embed_tokens=table, lm_head=table > 0))
    with pytest.raises(ValueError, match=re.escape("lm_head holds NaN or inf: expected a finite [V', H] table")):
        load_draft(tmp_path, lm_head=np.full_like(table, np.nan))
    with pytest.raises(ValueError, match=re.escape("embed_tokens holds NaN or inf")):
        load_draft(tmp_path, embed_tokens=jnp.asarray(table).at[3, 4].set(jnp.inf))
    with pytest.raises(TypeError, match="lm_head has dtype int32: expected a floating dtype"):
        DSparkDraft(tiny_config(), rngs=nnx.Rngs(0), lm_head=jnp.zeros((EMBED_ROWS, 32), jnp.int32))


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_unreadable_safetensors_file_is_named_with_its_path(damage, tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    weights = tmp_path / WEIGHTS_NAME
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"garbage123456789")
    with pytest.raises(ValueError, match=re.escape(f"{str(weights)!r} is not a readable safetensors file")):
        load_draft(tmp_path)


def test_dtype_and_layout_that_are_not_names_are_refused(tmp_path):
    hf = deepspec_config()
    write_checkpoint(tmp_path, hf, deepspec_tensors(hf))
    with pytest.raises(ValueError, match=re.escape("dtype=['float32'] is invalid: must be one of ['bfloat16'")):
        load_draft(tmp_path, dtype=["float32"])
    with pytest.raises(
        ValueError, match=re.escape("layout=['anchor'] is invalid: must be one of ['anchor', 'dflash']")
    ):
        load_draft(tmp_path, layout=["anchor"])


def test_save_draft_refuses_bad_arguments_before_writing(tmp_path):
    draft = random_draft(tiny_config(), seed=8)
    save_draft(draft, tmp_path)
    before = {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)}
    target = Qwen3Target(_target_config(), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="draft must be a DSparkDraft, got Qwen3Target"):
        save_draft(target, tmp_path)
    with pytest.raises(TypeError, match=re.escape("include_borrowed='no' is invalid: must be True or False")):
        save_draft(draft, tmp_path, include_borrowed="no")
    assert {p: (tmp_path / p).read_bytes() for p in os.listdir(tmp_path)} == before
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(ValueError, match=f"{re.escape(str(afile))}' exists and is not a folder"):
        save_draft(draft, afile)
