"""Float64 oracle of the attention pieces: RoPE, causal GQA attention, MoBA, Qwen2 attention.

Layouts: activations ``[B, T, H, D]`` (batch, time, head, head dim); queries have ``Hq`` heads,
keys and values ``Hkv`` heads with ``Hq % Hkv == 0`` (GQA: query head ``h`` reads kv head
``h // (Hq // Hkv)``). Attention probabilities are ``[B, Hq, T, S]``.
"""

from __future__ import annotations

import numpy as np

NEG_INF = -np.inf


def rope_cos_sin(positions, head_dim: int, theta: float) -> tuple[np.ndarray, np.ndarray]:
    """Hugging Face tables: ``inv_freq = theta ** (-arange(0, D, 2) / D)``, both halves equal.

    Returns ``cos, sin`` of shape ``[T, D]`` (``[T, D/2]`` angles repeated for the two halves).
    """
    inv_freq = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [D/2]
    angles = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, D/2]
    angles = np.concatenate([angles, angles], axis=-1)  # [T, D]
    return np.cos(angles), np.sin(angles)


def rotate_half(x: np.ndarray) -> np.ndarray:
    """``concat(-x2, x1)`` over the last axis, with ``x1, x2`` its two halves."""
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def rope_np(x: np.ndarray, positions, theta: float) -> np.ndarray:
    """Qwen2 RoPE (non-interleaved): ``y = x cos + rotate_half(x) sin``.

    x ``[B, T, H, D]``; positions ``[T]`` integers (may start anywhere, e.g. after a KV cache).
    """
    cos, sin = rope_cos_sin(positions, x.shape[-1], theta)  # [T, D]
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return x * cos + rotate_half(x) * sin


def rope_bwd_np(dy: np.ndarray, positions, theta: float) -> np.ndarray:
    """Backward of ``rope_np``: ``rotate_half`` is linear with transpose ``-rotate_half``."""
    cos, sin = rope_cos_sin(positions, dy.shape[-1], theta)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return dy * cos - rotate_half(dy * sin)


def repeat_kv(x: np.ndarray, n_q_heads: int) -> np.ndarray:
    """``[B, S, Hkv, D] -> [B, S, Hq, D]``: kv head ``j`` serves query heads ``j*G .. j*G+G-1``."""
    return np.repeat(x, n_q_heads // x.shape[2], axis=2)


def sum_kv_groups(dx: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """Transpose of ``repeat_kv``: ``[B, S, Hq, D] -> [B, S, Hkv, D]``, summing each group."""
    B, S, Hq, D = dx.shape
    return dx.reshape(B, S, n_kv_heads, Hq // n_kv_heads, D).sum(axis=3)


def causal_mask(T: int, S: int) -> np.ndarray:
    """``[T, S]`` bool: query ``t`` sits at key position ``S - T + t`` and sees keys up to it."""
    q_pos = np.arange(S - T, S)[:, None]
    return np.arange(S)[None, :] <= q_pos


def masked_softmax(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """Softmax over the last axis restricted to ``allowed`` (max-subtracted, float64).

    A row with no allowed key gets all-zero probabilities (its output is 0, its gradient 0).
    """
    s = np.where(allowed, scores, NEG_INF)
    any_allowed = allowed.any(axis=-1, keepdims=True)
    row_max = np.where(any_allowed, s.max(axis=-1, keepdims=True), 0.0)
    e = np.where(allowed, np.exp(s - row_max), 0.0)
    denom = e.sum(axis=-1, keepdims=True)
    return e / np.where(denom > 0.0, denom, 1.0)


def causal_attention_fwd_np(q, k, v, *, scale=None, mask=None):
    """Causal (GQA) softmax attention.

    q ``[B, T, Hq, D]``, k/v ``[B, S, Hkv, D]`` with ``S >= T``: the queries are the last T of
    the S positions (``S > T``: a KV-cache prefix). ``scale`` defaults to ``1/sqrt(D)``.
    ``mask`` ``[B, Hq, T, S]`` bool (True = may attend) is ANDed with causality.
    Returns ``out [B, T, Hq, D]`` and the cache for ``causal_attention_bwd_np``.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    k_rep = repeat_kv(k, Hq)  # [B, S, Hq, D]
    v_rep = repeat_kv(v, Hq)
    allowed = np.broadcast_to(causal_mask(T, S), (B, Hq, T, S))
    if mask is not None:
        allowed = allowed & mask
    scores = scale * np.einsum("bthd,bshd->bhts", q, k_rep)  # [B, Hq, T, S]
    probs = masked_softmax(scores, allowed)
    out = np.einsum("bhts,bshd->bthd", probs, v_rep)  # [B, T, Hq, D]
    cache = dict(q=q, k_rep=k_rep, v_rep=v_rep, probs=probs, scale=scale, n_kv_heads=Hkv)
    return out, cache


def causal_attention_bwd_np(cache, d_out):
    """Backward of ``causal_attention_fwd_np`` (mask fixed): returns ``dq, dk, dv``."""
    q, k_rep, v_rep, probs = cache["q"], cache["k_rep"], cache["v_rep"], cache["probs"]
    scale, Hkv = cache["scale"], cache["n_kv_heads"]
    dv_rep = np.einsum("bhts,bthd->bshd", probs, d_out)  # [B, S, Hq, D]
    dprobs = np.einsum("bthd,bshd->bhts", d_out, v_rep)  # [B, Hq, T, S]
    dscores = probs * (dprobs - np.sum(dprobs * probs, axis=-1, keepdims=True))
    dq = scale * np.einsum("bhts,bshd->bthd", dscores, k_rep)
    dk_rep = scale * np.einsum("bhts,bthd->bshd", dscores, q)
    return dq, sum_kv_groups(dk_rep, Hkv), sum_kv_groups(dv_rep, Hkv)


def chunk_key_means(k: np.ndarray, chunk_size: int) -> np.ndarray:
    """Mean key of each chunk: ``[B, T, Hkv, D] -> [B, n_chunks, Hkv, D]`` (last may be partial)."""
    T = k.shape[1]
    starts = range(0, T, chunk_size)
    return np.stack([k[:, s : s + chunk_size].mean(axis=1) for s in starts], axis=1)


def moba_gates_np(q, k, *, chunk_size):
    """Unscaled MoBA gates ``<q_t, mean key of chunk c>``: ``[B, Hq, T, n_chunks]``.

    Every (t, c) entry is filled; only earlier chunks (``c < t // chunk_size``) are ever ranked.
    A positive scale does not change the ranking, so none is applied.
    """
    means = repeat_kv(chunk_key_means(k, chunk_size), q.shape[2])  # [B, n_chunks, Hq, D]
    return np.einsum("bthd,bchd->bhtc", q, means)


def moba_chunk_selection_np(q, k, *, chunk_size, top_k):
    """Attended chunks per query: ``[B, Hq, T, n_chunks]`` bool (own chunk and chosen earlier ones).

    Earlier chunks are ranked by gate, highest first, ties to the lower chunk index (a stable
    sort of ``-gate``). ``top_k <= 0`` or ``top_k >=`` the number of earlier chunks: all of them.
    """
    gates = moba_gates_np(q, k, chunk_size=chunk_size)
    B, Hq, T, n_chunks = gates.shape
    chosen = np.zeros(gates.shape, dtype=bool)
    for t in range(T):
        own = t // chunk_size
        chosen[:, :, t, own] = True
        if own == 0:
            continue
        if top_k <= 0 or top_k >= own:
            chosen[:, :, t, :own] = True
            continue
        order = np.argsort(-gates[:, :, t, :own], axis=-1, kind="stable")  # [B, Hq, own]
        np.put_along_axis(chosen[:, :, t, :], order[..., :top_k], True, axis=-1)
    return chosen


def moba_selection_np(q, k, *, chunk_size, top_k, scale=None):
    """MoBA key mask ``[B, Hq, T, T]`` bool (True = may attend), causality included.

    q ``[B, T, Hq, D]``, k ``[B, T, Hkv, D]``. Per query t and head: keys ``s <= t`` of t's own
    chunk, plus every key of the ``top_k`` earlier chunks with the highest gates (see
    ``moba_chunk_selection_np``). ``scale`` is accepted for symmetry and ignored (ranking only).
    """
    T = q.shape[1]
    chosen = moba_chunk_selection_np(q, k, chunk_size=chunk_size, top_k=top_k)
    key_chunk = np.arange(T) // chunk_size  # [T]
    mask = chosen[..., key_chunk]  # [B, Hq, T, T]
    return mask & causal_mask(T, T)


def moba_attention_fwd_np(q, k, v, *, chunk_size, top_k, scale=None, selection=None):
    """MoBA sparse attention: causal attention restricted to ``moba_selection_np``'s keys.

    ``selection`` (a precomputed ``[B, Hq, T, T]`` mask) is used as is when given, which pins it
    for finite differences. Returns ``out [B, T, Hq, D]`` and the cache.
    """
    if selection is None:
        selection = moba_selection_np(q, k, chunk_size=chunk_size, top_k=top_k)
    out, cache = causal_attention_fwd_np(q, k, v, scale=scale, mask=selection)
    cache["selection"] = selection
    return out, cache


def moba_attention_bwd_np(cache, d_out):
    """Backward of ``moba_attention_fwd_np`` with the selection held fixed: ``dq, dk, dv``."""
    return causal_attention_bwd_np(cache, d_out)


def moba_attention_loop_np(q, k, v, *, chunk_size, top_k, scale=None):
    """Second, independent MoBA forward: per (b, head, t) rank chunks, gather keys, softmax.

    Slow and plain on purpose; cross-checks the masked dense ``moba_attention_fwd_np``.
    """
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            kh, vh = k[b, :, h // group], v[b, :, h // group]  # [T, D]
            for t in range(T):
                own = t // chunk_size
                chunks = pick_chunks(q[b, t, h], kh, own, chunk_size, top_k)
                keys = [s for c in chunks for s in range(c * chunk_size, (c + 1) * chunk_size)]
                keys += list(range(own * chunk_size, t + 1))
                scores = scale * (kh[keys] @ q[b, t, h])
                w = np.exp(scores - scores.max())
                out[b, t, h] = (w / w.sum()) @ vh[keys]
    return out


def pick_chunks(q_t, k_head, own: int, chunk_size: int, top_k: int) -> list[int]:
    """Earlier chunks (``< own``) one query attends to, by the MoBA rule, for the loop version."""
    if top_k <= 0 or top_k >= own:
        return list(range(own))
    gates = []
    for c in range(own):
        mean = sum(k_head[s] for s in range(c * chunk_size, (c + 1) * chunk_size)) / chunk_size
        gates.append(float(q_t @ mean))
    ranked = sorted(range(own), key=lambda c: (-gates[c], c))
    return sorted(ranked[:top_k])


def qwen2_attention_fwd_np(x, p, *, n_q_heads, n_kv_heads, rope_theta, pos0=0, kv_cache=None):
    """Qwen2 self-attention (Q/K/V biases, RoPE, causal GQA, no output bias).

    x ``[B, T, C]``; p: ``W_q [Hq*D, C]``, ``b_q [Hq*D]``, ``W_k, W_v [Hkv*D, C]``, ``b_k, b_v``,
    ``W_o [C, Hq*D]``. Tokens sit at positions ``pos0 .. pos0+T-1``. ``kv_cache = (k_prev,
    v_prev)`` ``[B, S0, Hkv, D]`` (keys already rotated) is prepended.
    Returns ``out [B, T, C]``, ``(k_all, v_all)`` ``[B, S0+T, Hkv, D]`` and the cache.
    """
    B, T, _ = x.shape
    D = p["W_q"].shape[0] // n_q_heads
    positions = pos0 + np.arange(T)
    q = (x @ p["W_q"].T + p["b_q"]).reshape(B, T, n_q_heads, D)
    k = (x @ p["W_k"].T + p["b_k"]).reshape(B, T, n_kv_heads, D)
    v = (x @ p["W_v"].T + p["b_v"]).reshape(B, T, n_kv_heads, D)
    q_rot = rope_np(q, positions, rope_theta)
    k_rot = rope_np(k, positions, rope_theta)
    S0 = 0 if kv_cache is None else kv_cache[0].shape[1]
    k_all = k_rot if kv_cache is None else np.concatenate([kv_cache[0], k_rot], axis=1)
    v_all = v if kv_cache is None else np.concatenate([kv_cache[1], v], axis=1)
    att, att_cache = causal_attention_fwd_np(q_rot, k_all, v_all)  # [B, T, Hq, D]
    att_flat = att.reshape(B, T, n_q_heads * D)
    out = att_flat @ p["W_o"].T  # [B, T, C]
    cache = dict(
        x=x,
        p=p,
        positions=positions,
        theta=rope_theta,
        S0=S0,
        has_kv=kv_cache is not None,
        att_cache=att_cache,
        att_flat=att_flat,
    )
    return out, (k_all, v_all), cache


def qwen2_attention_bwd_np(cache, d_out):
    """Backward of ``qwen2_attention_fwd_np``.

    Returns a dict with ``x``, every parameter, and ``k_prev``, ``v_prev`` when a KV cache was
    given (the gradient reaching the cached keys/values).
    """
    x, p, S0 = cache["x"], cache["p"], cache["S0"]
    B, T, _ = x.shape
    d_att_flat = d_out @ p["W_o"]  # [B, T, Hq*D]
    grads = {"W_o": np.einsum("btc,bte->ce", d_out, cache["att_flat"])}
    d_att = d_att_flat.reshape(cache["att_cache"]["q"].shape)
    dq_rot, dk_all, dv_all = causal_attention_bwd_np(cache["att_cache"], d_att)
    if cache["has_kv"]:
        grads["k_prev"], grads["v_prev"] = dk_all[:, :S0], dv_all[:, :S0]
    dq = rope_bwd_np(dq_rot, cache["positions"], cache["theta"]).reshape(B, T, -1)
    dk = rope_bwd_np(dk_all[:, S0:], cache["positions"], cache["theta"]).reshape(B, T, -1)
    dv = dv_all[:, S0:].reshape(B, T, -1)
    dx = np.zeros_like(x)
    for name, d in (("q", dq), ("k", dk), ("v", dv)):
        grads[f"W_{name}"] = np.einsum("bte,btc->ec", d, x)
        grads[f"b_{name}"] = d.sum(axis=(0, 1))
        dx += d @ p[f"W_{name}"]
    grads["x"] = dx
    return grads
