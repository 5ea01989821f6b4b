"""Tests of the attention oracle (oracle/attention.py): RoPE, causal GQA attention, MoBA, Qwen2
attention. Its blocks are tested in tests/models/test_oracle_blocks_attn.py."""

from __future__ import annotations

import numpy as np
import pytest
from oracle.attention import (
    causal_attention_bwd_np,
    causal_attention_fwd_np,
    causal_mask,
    moba_attention_bwd_np,
    moba_attention_fwd_np,
    moba_attention_loop_np,
    moba_gates_np,
    moba_selection_np,
    qwen2_attention_bwd_np,
    qwen2_attention_fwd_np,
    rope_bwd_np,
    rope_np,
)
from oracle.common import check_grads, rel_err, seeded_uniform

QKV = ("q", "k", "v")


def qkv_inputs(seed, B, T, Hq, Hkv, D, S=None):
    rng = np.random.default_rng(seed)
    S = T if S is None else S
    return {
        "q": rng.standard_normal((B, T, Hq, D)),
        "k": rng.standard_normal((B, S, Hkv, D)),
        "v": rng.standard_normal((B, S, Hkv, D)),
    }


def causal_pair(mask=None, scale=None):
    def fwd(d):
        out, cache = causal_attention_fwd_np(d["q"], d["k"], d["v"], scale=scale, mask=mask)
        return (out,), cache

    def bwd(cache, d_outs):
        return dict(zip(QKV, causal_attention_bwd_np(cache, d_outs[0]), strict=True))

    return fwd, bwd


def moba_pair(chunk_size, top_k, selection):
    def fwd(d):
        out, cache = moba_attention_fwd_np(
            d["q"], d["k"], d["v"], chunk_size=chunk_size, top_k=top_k, selection=selection
        )
        return (out,), cache

    def bwd(cache, d_outs):
        return dict(zip(QKV, moba_attention_bwd_np(cache, d_outs[0]), strict=True))

    return fwd, bwd


def attention_loop(q, k, v, allowed, scale):
    """Plain per-(b, head, t) softmax over the allowed keys: ``allowed [B, Hq, T, S]``."""
    B, T, Hq, D = q.shape
    group = Hq // k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(Hq):
            for t in range(T):
                keys = np.flatnonzero(allowed[b, h, t])
                if keys.size == 0:
                    continue
                s = scale * (k[b, keys, h // group] @ q[b, t, h])
                w = np.exp(s - s.max())
                out[b, t, h] = (w / w.sum()) @ v[b, keys, h // group]
    return out


def min_gate_gap(q, k, chunk_size, top_k):
    """Smallest gap between the top_k-th and next earlier-chunk gate over all ranked queries."""
    gates = moba_gates_np(q, k, chunk_size=chunk_size)  # [B, Hq, T, n_chunks]
    gap = np.inf
    for t in range(q.shape[1]):
        own = t // chunk_size
        if 0 < top_k < own:
            ranked = -np.sort(-gates[:, :, t, :own], axis=-1)
            gap = min(gap, float(np.min(ranked[..., top_k - 1] - ranked[..., top_k])))
    return gap


# RoPE


def test_rope_hand_value():
    x = np.array([1.0, 0.0]).reshape(1, 1, 1, 2)
    y = rope_np(x, np.array([1]), 10000.0)  # D = 2: inv_freq = [1], angle = 1 rad
    np.testing.assert_allclose(y.reshape(2), [np.cos(1.0), np.sin(1.0)], rtol=0, atol=1e-15)


def test_rope_matches_complex_rotation():
    rng = np.random.default_rng(0)
    B, T, H, D, theta = 2, 5, 3, 8, 1e4
    x = rng.standard_normal((B, T, H, D))
    positions = 7 + np.arange(T)
    half = D // 2
    z = x[..., :half] + 1j * x[..., half:]
    freqs = np.array([theta ** (-2.0 * i / D) for i in range(half)])
    z = z * np.exp(1j * positions[None, :, None, None] * freqs)
    ref = np.concatenate([z.real, z.imag], axis=-1)
    assert rel_err(rope_np(x, positions, theta), ref) <= 1e-14


def test_rope_preserves_norms():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 17, 3, 8))
    y = rope_np(x, 100 + np.arange(17), 1e6)
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)


def test_rope_dot_depends_only_on_offset():
    rng = np.random.default_rng(2)
    D, theta = 8, 1e4
    q = rng.standard_normal((1, 1, 1, D))
    k = rng.standard_normal((1, 1, 1, D))

    def score(p_q, p_k):
        return float(np.sum(rope_np(q, [p_q], theta) * rope_np(k, [p_k], theta)))

    for offset in (0, 1, 3, -2):
        ref = score(50 + offset, 50)
        for base in (0, 7, 1000):
            assert abs(score(base + offset, base) - ref) <= 1e-12 * max(1.0, abs(ref))
    assert abs(score(3, 0) - score(4, 0)) > 1e-3


@pytest.mark.parametrize("T,pos0", [(1, 0), (3, 5), (17, 0)])
def test_rope_grads(T, pos0):
    rng = np.random.default_rng(T)
    positions = pos0 + np.arange(T)
    x = rng.standard_normal((2, T, 2, 4))
    check_grads(
        lambda d: ((rope_np(d["x"], positions, 1e4),), None),
        lambda _, d_outs: {"x": rope_bwd_np(d_outs[0], positions, 1e4)},
        {"x": x},
    )


# causal attention


@pytest.mark.parametrize(
    "B,T,S",
    [(2, 1, 1), (2, 3, 3), (1, 17, 17), (2, 3, 7), (2, 1, 5)],
)
def test_causal_attention_matches_loop(B, T, S):
    d = qkv_inputs(0, B, T, 4, 2, 4, S)
    out, _ = causal_attention_fwd_np(d["q"], d["k"], d["v"])
    allowed = np.broadcast_to(causal_mask(T, S), (B, 4, T, S))
    ref = attention_loop(d["q"], d["k"], d["v"], allowed, 0.5)
    assert rel_err(out, ref) <= 1e-13


def test_causal_mask_places_queries_last():
    m = causal_mask(2, 4)
    np.testing.assert_array_equal(m, [[1, 1, 1, 0], [1, 1, 1, 1]])


def test_causal_attention_mask_and_empty_rows():
    B, T, Hq = 2, 3, 4
    d = qkv_inputs(1, B, T, Hq, 2, 4)
    mask = np.ones((B, Hq, T, T), dtype=bool)
    mask[0, 1, 2, :] = False  # one query sees nothing: output 0
    mask[1, 3, 2, 1] = False
    out, _ = causal_attention_fwd_np(d["q"], d["k"], d["v"], mask=mask, scale=0.3)
    allowed = mask & causal_mask(T, T)
    assert rel_err(out, attention_loop(d["q"], d["k"], d["v"], allowed, 0.3)) <= 1e-13
    assert not np.any(out[0, 2, 1])


@pytest.mark.parametrize(
    "B,T,S",
    [(2, 1, 1), (2, 3, 3), (1, 17, 17), (2, 3, 7), (2, 1, 5)],
)
def test_causal_attention_grads(B, T, S):
    keys = ["v"] if S == 1 else None  # one key: the output is v, q and k have no gradient
    check_grads(*causal_pair(), qkv_inputs(T + S, B, T, 4, 2, 4, S), keys=keys)


def test_causal_attention_grads_with_mask():
    B, T, S, Hq = 2, 5, 8, 4
    mask = np.random.default_rng(3).random((B, Hq, T, S)) < 0.6
    mask[0, 0, 0, :] = False
    check_grads(*causal_pair(mask=mask, scale=0.7), qkv_inputs(4, B, T, Hq, 2, 4, S))


# MoBA selection


def expected_mask(T, keys_per_query):
    mask = np.zeros((1, 1, T, T), dtype=bool)
    for t, keys in enumerate(keys_per_query):
        mask[0, 0, t, keys] = True
    return mask


def hand_example():
    """chunk_size 2, T 8, one head, D 2. Chunk means: c0 [1, 0], c1 [0, 1], c2 [1, 1]."""
    k = np.array([[1, 0], [1, 0], [0, 2], [0, 0], [2, 2], [0, 0], [5, 5], [9, 9]], float)
    q = np.array([[1, 1]] * 4 + [[1, 1], [0, 1], [1, 0], [-1, 1]], float)
    return q.reshape(1, 8, 1, 2), k.reshape(1, 8, 1, 2)


def test_moba_selection_hand_example_top1():
    q, k = hand_example()
    sel = moba_selection_np(q, k, chunk_size=2, top_k=1)
    want = expected_mask(
        8,
        [
            [0],
            [0, 1],
            [0, 1, 2],  # one earlier chunk, top_k >= 1: all of it
            [0, 1, 2, 3],
            [0, 1, 4],  # gates c0 = 1, c1 = 1: tie, lower index wins
            [2, 3, 4, 5],  # gates 0, 1: c1
            [0, 1, 6],  # gates 1, 0, 1: tie of c0 and c2, c0 wins
            [2, 3, 6, 7],  # gates -1, 1, 0: c1
        ],
    )
    np.testing.assert_array_equal(sel, want)
    np.testing.assert_array_equal(moba_selection_np(q, k, chunk_size=2, top_k=1, scale=0.1), want)


def test_moba_selection_hand_example_top2():
    q, k = hand_example()
    sel = moba_selection_np(q, k, chunk_size=2, top_k=2)
    want = expected_mask(
        8,
        [
            [0],
            [0, 1],
            [0, 1, 2],
            [0, 1, 2, 3],
            [0, 1, 2, 3, 4],
            [0, 1, 2, 3, 4, 5],
            [0, 1, 4, 5, 6],
            [2, 3, 4, 5, 6, 7],
        ],
    )
    np.testing.assert_array_equal(sel, want)


def test_moba_gates_hand_example():
    q, k = hand_example()
    gates = moba_gates_np(q, k, chunk_size=2)
    np.testing.assert_allclose(gates[0, 0, 7], [-1.0, 1.0, 0.0, 0.0], atol=1e-15)
    np.testing.assert_allclose(gates[0, 0, 6], [1.0, 0.0, 1.0, 7.0], atol=1e-15)


def test_moba_selection_per_head_gqa():
    q, k = hand_example()
    q2 = np.concatenate([q, -q], axis=2)  # two query heads share the one kv head
    sel = moba_selection_np(q2, k, chunk_size=2, top_k=1)
    np.testing.assert_array_equal(sel[:, :1], moba_selection_np(q, k, chunk_size=2, top_k=1))
    np.testing.assert_array_equal(sel[0, 1, 5], [1, 1, 0, 0, 1, 1, 0, 0])  # -[0,1]: c0 wins
    np.testing.assert_array_equal(sel[0, 1, 7], [1, 1, 0, 0, 0, 0, 1, 1])  # gates 1,-1,0: c0


# MoBA attention forward


MOBA_CONFIGS = [  # B, T, Hq, Hkv, D, chunk_size, top_k
    (2, 3, 4, 2, 4, 4, 1),  # T < chunk_size
    (2, 17, 4, 2, 4, 4, 1),  # sparse, T not a multiple of chunk_size
    (1, 17, 4, 2, 4, 3, 2),
    (2, 16, 2, 2, 4, 4, 2),
    (1, 17, 4, 2, 4, 1, 2),  # chunk_size 1
    (2, 17, 4, 2, 4, 4, 0),  # top_k 0: full causal
    (2, 17, 4, 2, 4, 4, 10),  # top_k >= chunks: full causal
    (2, 1, 4, 2, 4, 2, 1),
]


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cs,top_k", MOBA_CONFIGS)
def test_moba_dense_matches_loop(B, T, Hq, Hkv, D, cs, top_k):
    d = qkv_inputs(T * 10 + cs, B, T, Hq, Hkv, D)
    assert min_gate_gap(d["q"], d["k"], cs, top_k) > 1e-8
    out, _ = moba_attention_fwd_np(d["q"], d["k"], d["v"], chunk_size=cs, top_k=top_k)
    ref = moba_attention_loop_np(d["q"], d["k"], d["v"], chunk_size=cs, top_k=top_k)
    assert rel_err(out, ref) <= 1e-12


def test_moba_real_sparse_case_is_sparse_and_differs_from_causal():
    d = qkv_inputs(5, 2, 17, 4, 2, 4)
    sel = moba_selection_np(d["q"], d["k"], chunk_size=4, top_k=1)
    assert sel.sum() < causal_mask(17, 17).sum() * 2 * 4
    out, _ = moba_attention_fwd_np(d["q"], d["k"], d["v"], chunk_size=4, top_k=1)
    full, _ = causal_attention_fwd_np(d["q"], d["k"], d["v"])
    assert rel_err(out, full) > 1e-2
    assert rel_err(out[:, :8], full[:, :8]) <= 1e-15  # queries with <= 1 earlier chunk


@pytest.mark.parametrize("cs,top_k", [(4, 0), (4, -1), (4, 4), (4, 100), (17, 1), (40, 2)])
def test_moba_full_cases_equal_causal(cs, top_k):
    d = qkv_inputs(6, 2, 17, 4, 2, 4)
    out, _ = moba_attention_fwd_np(d["q"], d["k"], d["v"], chunk_size=cs, top_k=top_k)
    full, _ = causal_attention_fwd_np(d["q"], d["k"], d["v"])
    assert rel_err(out, full) <= 1e-15


def test_moba_pinned_selection_is_used_as_is():
    d = qkv_inputs(7, 1, 9, 2, 1, 4)
    sel = np.broadcast_to(causal_mask(9, 9), (1, 2, 9, 9)).copy()
    sel[0, 0, 8, :4] = False
    out, _ = moba_attention_fwd_np(d["q"], d["k"], d["v"], chunk_size=2, top_k=1, selection=sel)
    ref, _ = causal_attention_fwd_np(d["q"], d["k"], d["v"], mask=sel)
    assert rel_err(out, ref) == 0.0


@pytest.mark.parametrize("B,T,Hq,Hkv,D,cs,top_k", MOBA_CONFIGS)
def test_moba_grads_pinned_selection(B, T, Hq, Hkv, D, cs, top_k):
    d = qkv_inputs(T * 10 + cs + 1, B, T, Hq, Hkv, D)
    sel = moba_selection_np(d["q"], d["k"], chunk_size=cs, top_k=top_k)
    keys = ["v"] if T == 1 else None
    check_grads(*moba_pair(cs, top_k, sel), d, keys=keys)


# Qwen2 attention


def qwen2_params(rng, C, Hq, Hkv, D):
    return {
        "W_q": seeded_uniform(rng, (Hq * D, C), 0.3),
        "b_q": seeded_uniform(rng, (Hq * D,), 0.5),
        "W_k": seeded_uniform(rng, (Hkv * D, C), 0.3),
        "b_k": seeded_uniform(rng, (Hkv * D,), 0.5),
        "W_v": seeded_uniform(rng, (Hkv * D, C), 0.3),
        "b_v": seeded_uniform(rng, (Hkv * D,), 0.5),
        "W_o": seeded_uniform(rng, (C, Hq * D), 0.3),
    }


QWEN = dict(n_q_heads=4, n_kv_heads=2, rope_theta=1e4)


def qwen2_pair(pos0=0, with_cache=False):
    def fwd(d):
        p = {k: v for k, v in d.items() if k.startswith(("W_", "b_"))}
        kv = (d["k_prev"], d["v_prev"]) if with_cache else None
        out, _, cache = qwen2_attention_fwd_np(d["x"], p, pos0=pos0, kv_cache=kv, **QWEN)
        return (out,), cache

    def bwd(cache, d_outs):
        return qwen2_attention_bwd_np(cache, d_outs[0])

    return fwd, bwd


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 17)])
def test_qwen2_attention_grads(B, T):
    rng = np.random.default_rng(T)
    d = {"x": rng.standard_normal((B, T, 8)), **qwen2_params(rng, 8, 4, 2, 4)}
    keys = ["x", "W_v", "b_v", "W_o"]
    if T > 1:  # with one token the output does not depend on q or k
        keys += ["W_q", "b_q", "W_k", "b_k"]
    check_grads(*qwen2_pair(), d, keys=keys)


@pytest.mark.parametrize("T,S0", [(1, 4), (3, 5)])
def test_qwen2_attention_grads_with_kv_cache(T, S0):
    rng = np.random.default_rng(S0)
    B = 2
    d = {
        "x": rng.standard_normal((B, T, 8)),
        "k_prev": rng.standard_normal((B, S0, 2, 4)),
        "v_prev": rng.standard_normal((B, S0, 2, 4)),
        **qwen2_params(rng, 8, 4, 2, 4),
    }
    errors = check_grads(*qwen2_pair(pos0=S0, with_cache=True), d)
    assert {"k_prev", "v_prev"} <= set(errors)


def test_qwen2_attention_split_equals_one_call():
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 17, 8))
    p = qwen2_params(rng, 8, 4, 2, 4)
    full, (k_full, v_full), _ = qwen2_attention_fwd_np(x, p, **QWEN)
    first, kv, _ = qwen2_attention_fwd_np(x[:, :9], p, **QWEN)
    second, (k_all, v_all), _ = qwen2_attention_fwd_np(x[:, 9:], p, pos0=9, kv_cache=kv, **QWEN)
    assert rel_err(np.concatenate([first, second], axis=1), full) <= 1e-13
    assert rel_err(k_all, k_full) <= 1e-15 and rel_err(v_all, v_full) <= 1e-15
    assert k_full.shape == (2, 17, 2, 4)


def test_qwen2_attention_matches_direct_formula():
    rng = np.random.default_rng(12)
    B, T, C, Hq, Hkv, D = 1, 5, 8, 4, 2, 4
    x = rng.standard_normal((B, T, C))
    p = qwen2_params(rng, C, Hq, Hkv, D)
    out, _, _ = qwen2_attention_fwd_np(x, p, **QWEN)
    pos = np.arange(T)
    q = rope_np((x @ p["W_q"].T + p["b_q"]).reshape(B, T, Hq, D), pos, 1e4)
    k = rope_np((x @ p["W_k"].T + p["b_k"]).reshape(B, T, Hkv, D), pos, 1e4)
    v = (x @ p["W_v"].T + p["b_v"]).reshape(B, T, Hkv, D)
    allowed = np.broadcast_to(causal_mask(T, T), (B, Hq, T, T))
    att = attention_loop(q, k, v, allowed, 1 / np.sqrt(D)).reshape(B, T, Hq * D)
    assert rel_err(out, att @ p["W_o"].T) <= 1e-13
