"""The fused context-attention kernel (run through the Pallas interpreter on the CPU)."""

from __future__ import annotations

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from draft_testing import tiny_rounds_per_choice
from np_reference import gqa_attention

from dspark_jax import bench_workload
from dspark_jax.attention_kernel import (
    ATTENTION_ENV,
    TARGET_PROGRAMS,
    attend_block,
    attention_choice,
    context_attention,
    kernel_supported,
    merge_splits,
    num_splits,
    row_layout,
    use_kernel,
)
from dspark_jax.presets import load_preset
from dspark_jax.proposal import propose


def _inputs(seed, *, layers, batch, rows, heads, kv_heads, dim, capacity, dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = jax.random.normal(ks[0], (batch, rows, heads, dim), dtype)
    ck = jax.random.normal(ks[1], (layers, batch, capacity, kv_heads, dim), dtype)
    cv = jax.random.normal(ks[2], (layers, batch, capacity, kv_heads, dim), dtype)
    k = jax.random.normal(ks[3], (batch, rows, kv_heads, dim), dtype)
    v = jax.random.normal(ks[4], (batch, rows, kv_heads, dim), dtype)
    return q, ck, cv, k, v


def _reference(q, ck, cv, k, v, lens, layer):
    """NumPy float64: attention over [context < prefix_len ; the whole block]."""
    q, ck, cv, k, v = (np.asarray(a, np.float64) for a in (q, ck, cv, k, v))
    keys = np.concatenate([ck[layer], k], axis=1)  # [B, C + S, KVH, D]
    values = np.concatenate([cv[layer], v], axis=1)
    c, s = ck.shape[2], q.shape[1]
    visible = np.concatenate([np.arange(c)[None, :] < np.asarray(lens)[:, None], np.ones((len(lens), s), bool)], 1)
    return gqa_attention(q, keys, values, np.broadcast_to(visible[:, None, :], (q.shape[0], s, c + s)))


@pytest.mark.parametrize(
    ("capacity", "lens", "rows", "heads"),
    [
        (40, [30, 0, 40], 7, 8),  # chunk 32: the last chunk overlaps the one before it; 7 rows padded to 8
        (150, [150, 64, 129], 8, 6),  # 3 chunks of 64 (2 ranges: uneven); boundaries at and past a chunk end; G = 3
        (16, [3, 16, 999], 5, 2),  # smallest capacity; a length past the capacity reads all of it; 16 padded rows
    ],
)
@pytest.mark.parametrize("splits", [None, 1, 2, 99])
def test_attend_block_matches_numpy(capacity, lens, rows, heads, splits):
    """``splits``: one range per request (one kernel), two, one per chunk (99 is clamped),
    the default (ranges, then the merging kernel)."""
    q, ck, cv, k, v = _inputs(
        capacity, layers=2, batch=3, rows=rows, heads=heads, kv_heads=2, dim=16, capacity=capacity
    )
    lens = jnp.asarray(lens, jnp.int32)
    for layer in range(2):
        got = attend_block(
            q, k, v, cache_k=ck, cache_v=cv, prefix_lens=lens, layer=layer, interpret=True, splits=splits
        )
        assert got.shape == (3, rows, heads * 16) and got.dtype == q.dtype
        want = _reference(q, ck, cv, k, v, np.minimum(np.asarray(lens), capacity), layer)
        rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert rel < 1e-5, (layer, rel)


def test_merging_kernel_with_a_tile_of_heads_matches_numpy():
    """G = 16 query heads per KV head: the merging kernel's 16 rows take the own keys as one
    tensor-core tile (fewer rows read them one by one)."""
    q, ck, cv, k, v = _inputs(3, layers=1, batch=3, rows=3, heads=32, kv_heads=2, dim=16, capacity=150)
    lens = jnp.asarray([150, 1, 70], jnp.int32)
    got = attend_block(q, k, v, cache_k=ck, cache_v=cv, prefix_lens=lens, layer=0, interpret=True, splits=2)
    want = _reference(q, ck, cv, k, v, np.asarray(lens), 0)
    rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel


def test_num_splits_fills_the_gpu_at_small_batches():
    # the 8B draft: 8 KV heads, capacity 1040 = 17 chunks of 64. TARGET_PROGRAMS / (B · 8) ranges
    # reach the target: 32, 16, 4, 2, 1, 0.25 → at least 1, at most 17 chunks, a power of two below
    assert TARGET_PROGRAMS == 256
    assert [num_splits(b, 8, 1040) for b in (1, 2, 8, 16, 32, 128)] == [16, 16, 4, 2, 1, 1]
    assert num_splits(1, 1, 16) == 1  # one chunk: nothing to split
    assert num_splits(3, 2, 100) == 2  # never more ranges than chunks


def test_merge_splits_matches_one_softmax():
    """Partial softmaxes over disjoint key ranges merge into the softmax over all keys."""
    rng = np.random.default_rng(0)
    scores = rng.normal(size=(2, 1, 3, 4, 10))  # [B, KVH, P, M, keys]
    values = rng.normal(size=(2, 1, 3, 10, 5))  # [B, KVH, P, keys, D]
    scores[0, 0, 1] = -np.inf  # an empty range
    m = np.max(scores, -1)
    m = np.where(np.isfinite(m), m, -1e38)
    p = np.exp(scores - m[..., None])
    o, top, l = merge_splits(
        jnp.asarray(np.einsum("bkpmt,bkptd->bkpmd", p, values), jnp.float32),
        jnp.asarray(m, jnp.float32),
        jnp.asarray(p.sum(-1), jnp.float32),
    )
    flat = scores.transpose(0, 1, 3, 2, 4).reshape(2, 1, 4, 30)
    flat_v = values.reshape(2, 1, 30, 5)
    w = np.exp(flat - flat.max(-1, keepdims=True))
    want = np.einsum("bkmt,bktd->bkmd", w / w.sum(-1, keepdims=True), flat_v)
    np.testing.assert_allclose(np.asarray(o) / np.asarray(l)[..., None], want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(top), flat.max(-1), rtol=1e-6)


def test_context_attention_rejects_bad_splits():
    q, ck, cv, _, _ = _inputs(0, layers=1, batch=1, rows=4, heads=4, kv_heads=1, dim=16, capacity=32)
    qg = q.reshape(1, 4, 1, 4, 16)  # [B, R, KVH, G, D]
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=rf"splits={bad!r} is invalid: must be an integer >= 1"):
            context_attention(qg, ck, cv, jnp.array([5], jnp.int32), layer=0, interpret=True, splits=bad)


@pytest.mark.parametrize("splits", [1, 2])
def test_context_attention_of_an_empty_context_is_zero(splits):
    q, ck, cv, _, _ = _inputs(0, layers=1, batch=2, rows=4, heads=4, kv_heads=1, dim=16, capacity=32)
    qg = q.reshape(2, 4, 1, 4, 16)  # [B, R, KVH, G, D]
    o, m, l = context_attention(qg, ck, cv, jnp.array([0, 5], jnp.int32), layer=0, interpret=True, splits=splits)
    assert np.all(np.asarray(o[0]) == 0) and np.all(np.asarray(l[0]) == 0)
    assert np.all(np.asarray(m[0]) < -1e30) and np.all(np.isfinite(np.asarray(m[0])))
    assert np.all(np.asarray(l[1]) >= 1.0)  # the row max contributes exp(0) = 1


def test_context_attention_rejects_a_query_layout_the_kernel_cannot_tile():
    q, ck, cv, _, _ = _inputs(0, layers=1, batch=1, rows=4, heads=4, kv_heads=1, dim=16, capacity=32)
    lens = jnp.array([5], jnp.int32)
    for bad in (q.reshape(1, 4, 1, 4, 16)[:, :3], q.reshape(1, 4, 1, 4, 16)[:, :2], q, q[0]):
        with pytest.raises(
            ValueError, match=r"q has shape .*: expected \[B, R, KVH, G, D\] with R and G powers of two"
        ):
            context_attention(bad, ck, cv, lens, layer=0, interpret=True)


def test_row_layout_pads_to_power_of_two_tiles():
    assert row_layout(7, 4) == (8, 4)  # the 8B draft: 32 query rows per program
    assert row_layout(8, 5) == (8, 8)  # 40 heads over 8 KV heads (the 14B draft)
    assert row_layout(2, 1) == (16, 1)
    assert row_layout(1, 32) == (1, 32)


def test_kernel_supported_and_choice(monkeypatch):
    assert kernel_supported(jnp.bfloat16, 128, 1040)
    assert not kernel_supported(jnp.float32, 128, 1040)  # Triton would round float32 products through tf32
    assert not kernel_supported(jnp.bfloat16, 96, 1040)  # tiles need a power-of-two head dim
    assert not kernel_supported(jnp.bfloat16, 128, 8)
    monkeypatch.delenv(ATTENTION_ENV, raising=False)
    assert attention_choice() == "auto"
    assert use_kernel(jnp.bfloat16, 128, 64) == (jax.default_backend() == "gpu", False)
    monkeypatch.setenv(ATTENTION_ENV, " Pallas ")
    assert use_kernel(jnp.bfloat16, 128, 64) == (True, jax.default_backend() != "gpu")
    assert use_kernel(jnp.float32, 128, 64) == (False, False)
    monkeypatch.setenv(ATTENTION_ENV, "xla")
    assert use_kernel(jnp.bfloat16, 128, 64) == (False, False)
    monkeypatch.setenv(ATTENTION_ENV, "triton")
    with pytest.raises(ValueError, match="DSPARK_JAX_ATTENTION='triton' is invalid"):
        attention_choice()


def test_propose_with_the_kernel_matches_the_xla_path(monkeypatch):
    """The whole round, bf16 tiny draft: same tokens, logits within bf16 rounding."""
    _, blocks = tiny_rounds_per_choice(monkeypatch, ATTENTION_ENV)
    a, b = blocks["xla"], blocks["pallas"]
    np.testing.assert_array_equal(np.asarray(a.draft_tokens), np.asarray(b.draft_tokens))
    la, lb = np.asarray(a.corrected_logits, np.float64), np.asarray(b.corrected_logits, np.float64)
    assert np.linalg.norm(la - lb) / np.linalg.norm(la) < 2e-2


def test_kernel_reads_request_slots_in_place():
    """``slots`` picks cache rows inside the kernel: same as gathering them first."""
    q, ck, cv, k, v = _inputs(5, layers=2, batch=3, rows=7, heads=8, kv_heads=2, dim=16, capacity=48)
    big_k = jax.random.normal(jax.random.key(9), (2, 5, 48, 2, 16))  # 5 slots, rows 3, 0, 4 serve the batch
    big_v = jax.random.normal(jax.random.key(10), (2, 5, 48, 2, 16))
    slots = jnp.array([3, 0, 4], jnp.int32)
    lens = jnp.array([48, 17, 2], jnp.int32)
    for layer in range(2):
        got = attend_block(
            q, k, v, cache_k=big_k, cache_v=big_v, prefix_lens=lens, layer=layer, slots=slots, interpret=True
        )
        want = _reference(q, big_k[:, slots], big_v[:, slots], k, v, np.asarray(lens), layer)
        rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
        assert rel < 1e-5, (layer, rel)


def test_propose_with_slots_equals_propose_on_gathered_rows(monkeypatch):
    cfg = load_preset("tiny", dtype="bfloat16", param_dtype="bfloat16")
    graphdef, state = bench_workload.build_draft(cfg)
    cache = bench_workload.random_context(cfg, 6, 48, jax.random.key(3))
    slots = jnp.array([5, 1, 2], jnp.int32)
    gathered = type(cache)(k=cache.k[:, slots], v=cache.v[:, slots])
    bonus, lens = jnp.array([3, 7, 11], jnp.int32), jnp.array([20, 0, 41], jnp.int32)
    temps, top_k = bench_workload.sampling_params(3, "mixed")
    for choice in ("xla", "pallas"):
        monkeypatch.setenv(ATTENTION_ENV, choice)
        step = jax.jit(lambda c, s, *a: propose(graphdef, state, c, *a, slots=s))
        plain = jax.jit(lambda c, *a: propose(graphdef, state, c, *a))
        a = step(cache, slots, bonus, lens, temps, top_k, jax.random.key(4))
        b = plain(gathered, bonus, lens, temps, top_k, jax.random.key(4))
        np.testing.assert_array_equal(np.asarray(a.draft_tokens), np.asarray(b.draft_tokens))
        np.testing.assert_array_equal(np.asarray(a.corrected_logits), np.asarray(b.corrected_logits))
    with pytest.raises(ValueError, match=r"slots has shape \(2,\): expected \[3\] like bonus"):
        propose(graphdef, state, cache, bonus, lens, temps, top_k, jax.random.key(4), slots=slots[:2])


@pytest.mark.parametrize("splits", [1, 2])
def test_kernel_clamps_slots_outside_the_cache(monkeypatch, splits):
    """A jitted caller's slots are not checked on the host: the kernel reads slot 7 of 5 as
    slot 4 and slot −2 as 0 (the XLA gather's clamp), never memory past the cache."""
    from dspark_jax import attention_kernel

    rows_read = []
    walk = attention_kernel._walk_context

    def spy(q, ck_ref, cv_ref, row, *args, **kwargs):
        jax.debug.callback(lambda r: rows_read.append(int(r)), row)
        return walk(q, ck_ref, cv_ref, row, *args, **kwargs)

    monkeypatch.setattr(attention_kernel, "_walk_context", spy)
    q, _, _, k, v = _inputs(6, layers=1, batch=3, rows=7, heads=8, kv_heads=2, dim=16, capacity=48)
    big_k = jax.random.normal(jax.random.key(11), (1, 5, 48, 2, 16))
    big_v = jax.random.normal(jax.random.key(12), (1, 5, 48, 2, 16))
    lens = jnp.array([40, 17, 48], jnp.int32)
    step = jax.jit(
        lambda slots: attend_block(
            q, k, v, cache_k=big_k, cache_v=big_v, prefix_lens=lens, layer=0, slots=slots, interpret=True, splits=splits
        )
    )
    got = step(jnp.array([7, -2, 4], jnp.int32))  # traced slots: not read on the host
    assert rows_read and set(rows_read) <= {0, 4}, sorted(set(rows_read))
    clamped = np.array([4, 0, 4])
    want = _reference(q, big_k[:, clamped], big_v[:, clamped], k, v, np.asarray(lens), 0)
    assert np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want) < 1e-5


def _small_inputs():
    """L=2 layers, B=2 requests of S=3 rows, NH=4 heads over KVH=2, D=16, C=32, N=2 slots."""
    return _inputs(7, layers=2, batch=2, rows=3, heads=4, kv_heads=2, dim=16, capacity=32)


def _attend_block_cases():
    q, ck, cv, k, v = _small_inputs()
    lens = jnp.array([5, 9], jnp.int32)
    ok = dict(q=q, k=k, v=v, cache_k=ck, cache_v=cv, prefix_lens=lens, layer=1, interpret=True)
    f32 = jnp.float32
    return [
        ({"layer": 2}, ValueError, r"layer=2 is invalid: must be an integer in \[0, 2\)"),
        ({"layer": -1}, ValueError, r"layer=-1 is invalid"),
        ({"layer": 1.0}, ValueError, r"layer=1.0 is invalid: must be an integer"),
        ({"layer": "1"}, ValueError, r"layer='1' is invalid"),
        ({"prefix_lens": lens[:1]}, ValueError, r"prefix_lens has shape \(1,\): expected \[B\] = \(2,\)"),
        ({"prefix_lens": lens.astype(f32)}, TypeError, "prefix_lens has dtype float32: expected an integer dtype"),
        ({"prefix_lens": [5, 9]}, TypeError, "prefix_lens has type list"),
        ({"prefix_lens": jnp.array([5, -1])}, ValueError, r"prefix_lens\[1\]=-1 is out of range: must be >= 0"),
        ({"slots": jnp.array([0, 1, 1])}, ValueError, r"slots has shape \(3,\): expected \[B\] = \(2,\)"),
        ({"slots": jnp.array([0.0, 1.0])}, TypeError, "slots has dtype float32: expected an integer dtype"),
        ({"slots": jnp.array([0, 7])}, ValueError, r"slots\[1\]=7 is out of range: must be cache slot ids in \[0, 2\)"),
        (
            {"q": q[..., :8], "k": k[..., :8], "v": v[..., :8]},
            ValueError,
            r"queries' \(KVH, D\) = \(2, 8\) do not fit the cache's \(KVH, D\) = \(2, 16\)",
        ),
        ({"k": k[:, :, :1], "v": v[:, :, :1]}, ValueError, r"queries' \(KVH, D\) = \(1, 16\)"),
        ({"q": q[:, :, :3]}, ValueError, r"NH a multiple of KVH"),
        ({"v": v[:, :2]}, ValueError, r"v has shape \(2, 2, 2, 16\): expected \[B, S, KVH, D\] = \(2, 3, 2, 16\)"),
        ({"q": q[0]}, ValueError, r"expected q \[B, S, NH, D\]"),
        ({"cache_v": cv[:, :, :16]}, ValueError, r"cache_v has shape \(2, 2, 16, 2, 16\): expected cache_k's"),
        ({"cache_k": ck[0], "cache_v": cv[0]}, ValueError, r"cache_k has shape \(2, 32, 2, 16\): expected \[L, N, C"),
        ({"cache_k": ck.astype(jnp.int32), "cache_v": cv.astype(jnp.int32)}, TypeError, "cache_k has dtype int32"),
        ({"cache_v": cv.astype(jnp.bfloat16)}, TypeError, "cache_v has dtype bfloat16: expected cache_k's float32"),
        ({"q": q.astype(jnp.int32)}, TypeError, "q has dtype int32: expected a floating dtype"),
        ({"interpret": "no"}, TypeError, "interpret='no' is invalid: must be True or False"),
        ({"q": np.asarray(q).tolist()}, TypeError, "q has type list"),
    ], ok


@pytest.mark.parametrize("case", range(len(_attend_block_cases()[0])))
def test_attend_block_refuses_bad_inputs_naming_them(case):
    """Each would have read another layer, clamped a slot, truncated a float, broadcast a shape
    or returned NaN (a shorter cache_v) without a word."""
    cases, ok = _attend_block_cases()
    change, error, message = cases[case]
    kw = {**ok, **change}
    with pytest.raises(error, match=message):
        attend_block(kw.pop("q"), kw.pop("k"), kw.pop("v"), **kw)


def test_attend_block_takes_a_numpy_layer_and_traced_inputs():
    q, ck, cv, k, v = _small_inputs()
    lens, slots = jnp.array([5, 9], jnp.int32), jnp.array([1, 0], jnp.int32)
    kw = dict(cache_k=ck, cache_v=cv, interpret=True)
    want = attend_block(q, k, v, prefix_lens=lens, layer=1, slots=slots, **kw)
    got = attend_block(q, k, v, prefix_lens=lens, layer=np.int64(1), slots=slots, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    traced = jax.jit(lambda *a: attend_block(q, k, v, prefix_lens=a[0], layer=1, slots=a[1], **kw))(lens, slots)
    np.testing.assert_allclose(np.asarray(traced), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_context_attention_refuses_bad_inputs_naming_them():
    q, ck, cv, _, _ = _small_inputs()
    rows, group = row_layout(3, 2)
    q5 = jnp.zeros((2, rows, 2, group, 16))  # [B, R, KVH, Gp, D]
    lens = jnp.array([5, 9], jnp.int32)
    cases = [
        ((q5, ck, cv, lens), {"layer": 5}, ValueError, r"layer=5 is invalid: must be an integer in \[0, 2\)"),
        ((q5, ck, cv, lens), {"layer": -3}, ValueError, r"layer=-3 is invalid"),
        ((q5, ck, cv, lens.astype(jnp.float32)), {}, TypeError, "prefix_lens has dtype float32"),
        ((q5, ck, cv, lens, jnp.array([0, 9])), {}, ValueError, r"slots\[1\]=9 is out of range"),
        ((q5[..., :8], ck, cv, lens), {}, ValueError, r"queries' \(KVH, D\) = \(2, 8\)"),
        ((q5[:, :, :1], ck, cv, lens), {}, ValueError, r"queries' \(KVH, D\) = \(1, 16\)"),
        ((jnp.zeros((4, rows, 2, group, 16)), ck, cv, jnp.arange(4)), {}, ValueError, "N=2 slots and q B=4"),
        ((q5, ck, cv[:, :, :16], lens), {}, ValueError, "cache_v has shape"),
        ((q5, ck, cv, lens), {"interpret": "no"}, TypeError, "interpret='no' is invalid"),
    ]
    for args, kw, error, message in cases:
        with pytest.raises(error, match=message):
            context_attention(*args, **{"layer": 1, "interpret": True, **kw})


@pytest.mark.parametrize("splits", [1, 2])
def test_scores_hundreds_apart_stay_finite_and_match_numpy(splits):
    """One context key scores about 400 (``q·k / √D`` with ``q = 10``, ``k = 10``, ``D = 16``),
    the other keys of its chunk, of the next chunk and of the block about ±30: every rescale
    ``exp(m_old − m_new)`` must use the running max over all keys seen so far (chunk to chunk,
    then with the own keys, in the whole kernel and in the merging kernel), or ``exp(≈370)``
    overflows float32 and the rows turn to ``inf``/NaN. Against the float64 reference, relative
    error below 1e-5; random-normal inputs never part the scores far enough to tell."""
    q, ck, cv, k, v = _inputs(8, layers=1, batch=2, rows=3, heads=4, kv_heads=2, dim=16, capacity=128)
    q = jnp.full_like(q, 10.0)
    ck = ck.at[0, :, 3].set(10.0)  # key 3 of both slots and KV heads; 2 chunks of 64
    lens = jnp.asarray([128, 100], jnp.int32)
    got = attend_block(q, k, v, cache_k=ck, cache_v=cv, prefix_lens=lens, layer=0, interpret=True, splits=splits)
    assert np.all(np.isfinite(np.asarray(got)))
    want = _reference(q, ck, cv, k, v, np.asarray(lens), 0)
    rel = np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)
    assert rel < 1e-5, rel


def test_num_splits_is_the_smallest_power_of_two_count_reaching_the_target():
    """``P`` from its definition: ``⌈TARGET_PROGRAMS / (B · KVH)⌉`` ranges (at least 1), at most
    the chunk count, rounded down to a power of two. Batches whose ``B · KVH`` lies strictly
    between 128 and 256 need 2 ranges (the floor of 256 / 160 is 1, its ceiling 2)."""
    for batch, kv_heads, capacity in itertools.product((1, 3, 5, 17, 20, 31, 33, 64), (1, 2, 8), (16, 100, 1040)):
        chunks = -(-capacity // min(64, 1 << (capacity.bit_length() - 1)))
        wanted = min(chunks, max(1, math.ceil(TARGET_PROGRAMS / (batch * kv_heads))))
        assert num_splits(batch, kv_heads, capacity) == 1 << (wanted.bit_length() - 1), (batch, kv_heads, capacity)
    assert num_splits(20, 8, 1040) == 2


def test_a_context_key_weighs_exactly_as_the_same_own_key():
    """The context's probabilities are rounded to the cache dtype before the product with the
    values, as the own keys' are (bf16 cache, float32 queries and output): a context holding
    exact copies of the block's own keys and values (``prefix_len = S``) gives, bit for bit,
    the output of an empty context (each term counted twice, ``2·o / 2·l``); against the
    float64 reference, within bf16 rounding (relative error below 1e-2)."""
    q, ck, cv, k, v = _inputs(9, layers=1, batch=2, rows=4, heads=4, kv_heads=2, dim=16, capacity=16)
    k, v = k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)
    ck = ck.astype(jnp.bfloat16).at[0, :, :4].set(k)  # keys 0–3 of each slot: the block's own
    cv = cv.astype(jnp.bfloat16).at[0, :, :4].set(v)
    kw = dict(cache_k=ck, cache_v=cv, layer=0, interpret=True, splits=1)
    copies = attend_block(q, k, v, prefix_lens=jnp.asarray([4, 4], jnp.int32), **kw)
    alone = attend_block(q, k, v, prefix_lens=jnp.asarray([0, 0], jnp.int32), **kw)
    assert copies.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(copies), np.asarray(alone))
    want = _reference(q.astype(jnp.bfloat16), ck, cv, k, v, np.asarray([4, 4]), 0)
    assert np.linalg.norm(np.asarray(copies, np.float64) - want) / np.linalg.norm(want) < 1e-2
