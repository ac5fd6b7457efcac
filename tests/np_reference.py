"""Float64 NumPy reference of the DSpark draft, written from DSPARK_SPEC.md §2.

Independent of dspark_jax: parameters come as a dict keyed by the DeepSpec checkpoint
names in PyTorch layouts (``Linear`` weights ``[out, in]``), and every equation is
spelled out here with explicit loops where the module vectorises. Shapes: B batch,
S/R rows, N context tokens, H hidden, NH/KVH heads, D head dim, V vocab, r rank.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Params = dict[str, np.ndarray]


def f64(x) -> np.ndarray:
    return np.asarray(x, dtype=np.float64)


def linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """PyTorch ``Linear``: ``x @ Wᵀ + b`` with ``W`` stored ``[out, in]``."""
    y = f64(x) @ f64(weight).T
    return y if bias is None else y + f64(bias)


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    x = f64(x)
    return f64(weight) * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def rope(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Neox rotary embedding: dims ``i`` and ``i + D/2`` form a rotated pair.

    Args:
      x: ``[B, S, heads, D]``.
      positions: ``[B, S]``.
    """
    x = f64(x)
    d = x.shape[-1]
    out = np.empty_like(x)
    for i in range(d // 2):
        freq = theta ** (-2.0 * i / d)
        angle = f64(positions)[:, :, None] * freq  # [B, S, 1]
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i] = a * np.cos(angle) - b * np.sin(angle)
        out[..., i + d // 2] = b * np.cos(angle) + a * np.sin(angle)
    return out


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    z = np.exp(x - np.max(x, axis=axis, keepdims=True))
    return z / np.sum(z, axis=axis, keepdims=True)


def gqa_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """Grouped-query attention, one query head at a time.

    Args:
      q: ``[B, S, NH, D]``; k, v: ``[B, L, KVH, D]``; visible: ``[B, S, L]`` bool.

    Returns:
      ``[B, S, NH * D]``.
    """
    b, s, nh, d = q.shape
    group = nh // k.shape[2]
    out = np.zeros((b, s, nh, d))
    for h in range(nh):
        kh, vh = k[:, :, h // group], v[:, :, h // group]  # [B, L, D]
        scores = np.einsum("bsd,bld->bsl", q[:, :, h], kh) / np.sqrt(d)
        scores = np.where(visible, scores, -np.inf)
        out[:, :, h] = np.einsum("bsl,bld->bsd", softmax(scores), vh)
    return out.reshape(b, s, nh * d)


def mlp(x: np.ndarray, p: Params, prefix: str) -> np.ndarray:
    gate = linear(x, p[prefix + "gate_proj.weight"])
    up = linear(x, p[prefix + "up_proj.weight"])
    silu = gate / (1.0 + np.exp(-gate))
    return linear(silu * up, p[prefix + "down_proj.weight"])


def _bias(p: Params, name: str) -> np.ndarray | None:
    return p.get(name)


def project_qkv(x: np.ndarray, positions: np.ndarray, p: Params, layer: int, cfg) -> tuple:
    """Layer ``layer``'s normed, roped q ``[B, S, NH, D]`` and k, v ``[B, S, KVH, D]`` of ``x``."""
    pre = f"layers.{layer}.self_attn."
    b, s, _ = x.shape
    d, eps, theta = cfg.head_dim, cfg.rms_norm_eps, cfg.rope_theta
    q = linear(x, p[pre + "q_proj.weight"], _bias(p, pre + "q_proj.bias")).reshape(b, s, -1, d)
    k = linear(x, p[pre + "k_proj.weight"], _bias(p, pre + "k_proj.bias")).reshape(b, s, -1, d)
    v = linear(x, p[pre + "v_proj.weight"], _bias(p, pre + "v_proj.bias")).reshape(b, s, -1, d)
    q = rope(rms_norm(q, p[pre + "q_norm.weight"], eps), positions, theta)
    k = rope(rms_norm(k, p[pre + "k_norm.weight"], eps), positions, theta)
    return q, k, v


def fuse_context(features: np.ndarray, p: Params, cfg) -> np.ndarray:
    """``hidden_norm(fc(features))``: ``[B, N, K·H]`` → ``[B, N, H]``."""
    return rms_norm(linear(features, p["fc.weight"]), p["hidden_norm.weight"], cfg.rms_norm_eps)


def context_kv(features: np.ndarray, positions: np.ndarray, p: Params, cfg) -> tuple[list, list]:
    """Per-layer context keys and values (lists of ``[B, N, KVH, D]``)."""
    ctx = fuse_context(features, p, cfg)
    ks, vs = [], []
    for layer in range(cfg.num_hidden_layers):
        _, k, v = project_qkv(ctx, positions, p, layer, cfg)
        ks.append(k)
        vs.append(v)
    return ks, vs


def decoder_layer(
    x: np.ndarray,
    positions: np.ndarray,
    ctx_k: np.ndarray,
    ctx_v: np.ndarray,
    ctx_mask: np.ndarray,
    p: Params,
    layer: int,
    cfg,
) -> np.ndarray:
    """One draft layer: block rows attend (non-causally) over ``[context ; block]``.

    Args:
      x: ``[B, R, H]``; positions: ``[B, R]``; ctx_k, ctx_v: ``[B, C, KVH, D]``;
      ctx_mask: ``[B, C]`` bool.
    """
    pre = f"layers.{layer}."
    a = rms_norm(x, p[pre + "input_layernorm.weight"], cfg.rms_norm_eps)
    q, k, v = project_qkv(a, positions, p, layer, cfg)
    keys = np.concatenate([ctx_k, k], axis=1)
    values = np.concatenate([ctx_v, v], axis=1)
    rows = x.shape[1]
    visible = np.concatenate([ctx_mask, np.ones((x.shape[0], rows), bool)], axis=1)  # [B, C + R]
    visible = np.repeat(visible[:, None, :], rows, axis=1)
    attn = gqa_attention(q, keys, values, visible)
    x = x + linear(attn, p[pre + "self_attn.o_proj.weight"], _bias(p, pre + "self_attn.o_proj.bias"))
    return x + mlp(rms_norm(x, p[pre + "post_attention_layernorm.weight"], cfg.rms_norm_eps), p, pre + "mlp.")


def draft_hidden(
    block_ids: np.ndarray,
    positions: np.ndarray,
    ctx_k: list,
    ctx_v: list,
    ctx_mask: np.ndarray,
    p: Params,
    cfg,
) -> np.ndarray:
    """Embeds ``[B, R]`` block ids with the borrowed table and runs every layer + final norm."""
    x = f64(p["embed_tokens.weight"])[block_ids]
    for layer in range(cfg.num_hidden_layers):
        x = decoder_layer(x, positions, ctx_k[layer], ctx_v[layer], ctx_mask, p, layer, cfg)
    return rms_norm(x, p["norm.weight"], cfg.rms_norm_eps)


def block_ids(bonus: np.ndarray, cfg) -> np.ndarray:
    """``[bonus, MASK × (γ−1)]`` (anchor layout) or ``[bonus, MASK × γ]`` (DFlash layout)."""
    rows = cfg.block_size if cfg.sample_from_anchor else cfg.block_size + 1
    ids = np.full((bonus.shape[0], rows), cfg.mask_token_id, np.int64)
    ids[:, 0] = bonus
    return ids


def draft_forward(
    bonus: np.ndarray,
    prefix_lens: np.ndarray,
    ctx_features: np.ndarray,
    p: Params,
    cfg,
) -> tuple[np.ndarray, np.ndarray]:
    """One drafting pass from scratch: context features of positions ``0..N−1``.

    Args:
      bonus: ``[B]``; prefix_lens: ``[B]`` valid context lengths (``<= N``);
      ctx_features: ``[B, N, K·H]``.

    Returns:
      ``(slot hidden [B, γ, H], base logits [B, γ, V])``.
    """
    b, n, _ = ctx_features.shape
    ctx_pos = np.broadcast_to(np.arange(n), (b, n))
    ks, vs = context_kv(ctx_features, ctx_pos, p, cfg)
    ids = block_ids(bonus, cfg)
    positions = prefix_lens[:, None] + np.arange(ids.shape[1])
    ctx_mask = np.arange(n)[None, :] < prefix_lens[:, None]
    hidden = draft_hidden(ids, positions, ks, vs, ctx_mask, p, cfg)
    slots = hidden if cfg.sample_from_anchor else hidden[:, 1:]
    logits = slots @ f64(p["lm_head.weight"])[: cfg.vocab_size].T
    return slots, logits


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def markov_step(kind: str, p: Params, state: np.ndarray, prev: np.ndarray, h: np.ndarray) -> tuple:
    """One Markov step: ``(new state [B, r], bias [B, V])`` for previous tokens ``[B]``."""
    w1, w2 = f64(p["markov_head.markov_w1.weight"]), f64(p["markov_head.markov_w2.weight"])
    e = w1[prev]  # [B, r]
    if kind == "vanilla":
        z = e
    elif kind == "gated":
        x = np.concatenate([h, e], -1)
        g = sigmoid(linear(x, p["markov_head.gate_proj.weight"], p["markov_head.gate_proj.bias"]))
        z = g * e
    elif kind == "rnn":
        x = np.concatenate([state, e, h], -1)
        out = linear(x, p["markov_head.joint_proj.weight"], p["markov_head.joint_proj.bias"])
        r = e.shape[-1]
        g, c, o = out[:, :r], out[:, r : 2 * r], out[:, 2 * r :]
        state = sigmoid(g) * state + (1.0 - sigmoid(g)) * np.tanh(c)
        z = np.tanh(o)
    else:
        raise ValueError(kind)
    return state, z @ w2.T


def markov_block(kind: str, p: Params, prev: np.ndarray, hidden: np.ndarray) -> np.ndarray:
    """Teacher-forced bias ``[B, γ, V]`` for ``prev [B, γ]``, the RNN state carried over γ."""
    b, gamma = prev.shape
    state = np.zeros((b, p["markov_head.markov_w1.weight"].shape[1]))
    out = []
    for k in range(gamma):
        state, bias = markov_step(kind, p, state, prev[:, k], f64(hidden[:, k]))
        out.append(bias)
    return np.stack(out, axis=1)


def markov_walk(
    kind: str | None,
    p: Params,
    base: np.ndarray,
    hidden: np.ndarray,
    bonus: np.ndarray,
    pick: Callable[[int, np.ndarray], np.ndarray],
) -> tuple[np.ndarray, np.ndarray]:
    """The sequential walk: step ``k`` biases ``base[:, k]`` by the token picked at ``k − 1``.

    Returns:
      ``(tokens [B, γ], corrected logits [B, γ, V])``.
    """
    b, gamma, _ = base.shape
    prev = np.asarray(bonus)
    state = None if kind is None else np.zeros((b, p["markov_head.markov_w1.weight"].shape[1]))
    tokens, corrected = [], []
    for k in range(gamma):
        logits = f64(base[:, k])
        if kind is not None:
            state, bias = markov_step(kind, p, state, prev, f64(hidden[:, k]))
            logits = logits + bias
        prev = pick(k, logits)
        tokens.append(prev)
        corrected.append(logits)
    return np.stack(tokens, axis=1), np.stack(corrected, axis=1)


def confidence(
    p: Params, hidden: np.ndarray, prev: np.ndarray, with_markov: bool, temperature: np.ndarray
) -> np.ndarray:
    """``sigmoid(proj([h ; markov_w1[prev]]) / T_k)`` per slot: ``[B, γ]``."""
    x = f64(hidden)
    if with_markov:
        x = np.concatenate([x, f64(p["markov_head.markov_w1.weight"])[prev]], -1)
    raw = linear(x, p["confidence_head.proj.weight"], p["confidence_head.proj.bias"])[..., 0]
    return sigmoid(raw / f64(temperature))
