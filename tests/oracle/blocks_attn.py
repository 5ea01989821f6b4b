"""Float64 oracle of the two attention blocks: RFA's Qwen2 block and RWKV-X's MoBA block.

Hidden states are ``[B, T, C]``. Parameters are flat dicts with the module paths as keys
(``'attn.W_q'``, ``'mlp.W_gate'``, ...); the backward returns the same keys plus ``'h'``.
"""

from __future__ import annotations

import numpy as np

from .attention import (
    moba_attention_bwd_np,
    moba_attention_fwd_np,
    qwen2_attention_bwd_np,
    qwen2_attention_fwd_np,
)
from .common import seeded_uniform
from .mlp import channel_mix_bwd_np, channel_mix_fwd_np, swiglu_bwd_np, swiglu_fwd_np
from .norms import layer_norm_bwd_np, layer_norm_fwd_np, rms_norm_bwd_np, rms_norm_fwd_np


def sub_params(p: dict, prefix: str) -> dict:
    """The entries of ``p`` under ``prefix + '.'``, with the prefix stripped."""
    return {k[len(prefix) + 1 :]: v for k, v in p.items() if k.startswith(prefix + ".")}


def prefixed(grads: dict, prefix: str, names) -> dict:
    """``{prefix.name: grads[name]}`` for the given names."""
    return {f"{prefix}.{n}": grads[n] for n in names}


def qwen2_block_fwd_np(
    h, p, *, n_q_heads, n_kv_heads, rope_theta, rms_eps=1e-6, pos0=0, kv_cache=None
):
    """Qwen2 decoder block: ``h += Attn(RMSNorm(h)); h += SwiGLU(RMSNorm(h))``.

    h ``[B, T, C]``; p: 'ln1_w', 'ln2_w' ``[C]``, 'attn.*' (see ``qwen2_attention_fwd_np``),
    'mlp.W_gate', 'mlp.W_up' ``[F, C]``, 'mlp.W_down' ``[C, F]``. ``kv_cache = (k_prev, v_prev)``
    ``[B, S0, Hkv, D]`` and ``pos0`` continue a sequence.
    Returns ``(h_out [B, T, C], (k_all, v_all), cache)``.
    """
    x1, ln1_cache = rms_norm_fwd_np(h, p["ln1_w"], rms_eps)
    att, kv, att_cache = qwen2_attention_fwd_np(
        x1,
        sub_params(p, "attn"),
        n_q_heads=n_q_heads,
        n_kv_heads=n_kv_heads,
        rope_theta=rope_theta,
        pos0=pos0,
        kv_cache=kv_cache,
    )
    h1 = h + att
    x2, ln2_cache = rms_norm_fwd_np(h1, p["ln2_w"], rms_eps)
    mlp_out, mlp_cache = swiglu_fwd_np(x2, sub_params(p, "mlp"))
    cache = dict(ln1=ln1_cache, attn=att_cache, ln2=ln2_cache, mlp=mlp_cache, p=p)
    return h1 + mlp_out, kv, cache


def qwen2_block_bwd_np(cache, d_h):
    """Backward of ``qwen2_block_fwd_np``: 'h', every parameter, and 'k_prev', 'v_prev' when a
    KV cache was given."""
    p = cache["p"]
    g_mlp = swiglu_bwd_np(cache["mlp"], d_h)
    d_x2 = g_mlp["x"]
    d_h1, d_ln2_w = rms_norm_bwd_np(cache["ln2"], d_x2)
    d_h1 = d_h1 + d_h
    g_att = qwen2_attention_bwd_np(cache["attn"], d_h1)
    d_h0, d_ln1_w = rms_norm_bwd_np(cache["ln1"], g_att["x"])
    grads = {"h": d_h0 + d_h1, "ln1_w": d_ln1_w, "ln2_w": d_ln2_w}
    grads.update(prefixed(g_att, "attn", sub_params(p, "attn")))
    grads.update(prefixed(g_mlp, "mlp", sub_params(p, "mlp")))
    for name in ("k_prev", "v_prev"):
        if name in g_att:
            grads[name] = g_att[name]
    return grads


def moba_block_fwd_np(h, p, *, n_head, chunk_size, top_k, shift_ffn=None, selection=None):
    """RWKV-X attention block: ``h += W_o MoBA(LN1(h)); h += ChannelMix(LN2(h))``.

    h ``[B, T, C]``; p: 'ln1_w', 'ln1_b', 'ln2_w', 'ln2_b' ``[C]`` (LayerNorm eps 1e-5),
    'attn.W_q', 'attn.W_k', 'attn.W_v', 'attn.W_o' ``[C, C]`` (no bias, ``n_head`` heads of
    ``D = C / n_head``, no positional encoding, scale ``1/sqrt(D)``), 'ffn.x_k' ``[C]``,
    'ffn.W_key' ``[F, C]``, 'ffn.W_value' ``[C, F]``. ``shift_ffn`` ``[B, C]`` is the previous
    token's LN2 output (None = zeros); ``selection`` pins the MoBA mask.
    Returns ``(h_out [B, T, C], shift_ffn_out [B, C], cache)``; ``cache['selection']`` is the
    mask used.
    """
    B, T, C = h.shape
    x1, ln1_cache = layer_norm_fwd_np(h, p["ln1_w"], p["ln1_b"])
    q, k, v = (
        (x1 @ p[f"attn.W_{n}"].T).reshape(B, T, n_head, C // n_head) for n in ("q", "k", "v")
    )
    att, att_cache = moba_attention_fwd_np(
        q, k, v, chunk_size=chunk_size, top_k=top_k, selection=selection
    )
    att_flat = att.reshape(B, T, C)
    h1 = h + att_flat @ p["attn.W_o"].T
    x2, ln2_cache = layer_norm_fwd_np(h1, p["ln2_w"], p["ln2_b"])
    ffn_out, x_last, ffn_cache = channel_mix_fwd_np(x2, shift_ffn, sub_params(p, "ffn"))
    cache = dict(
        p=p,
        x1=x1,
        att_flat=att_flat,
        ln1=ln1_cache,
        attn=att_cache,
        ln2=ln2_cache,
        ffn=ffn_cache,
        selection=att_cache["selection"],
    )
    return h1 + ffn_out, x_last, cache


def moba_block_bwd_np(cache, d_h, d_shift_ffn=None):
    """Backward of ``moba_block_fwd_np`` (selection fixed): 'h', 'shift_ffn' and every
    parameter. ``d_shift_ffn`` is the cotangent of the returned ``shift_ffn_out``."""
    p, x1 = cache["p"], cache["x1"]
    B, T, C = d_h.shape
    g_ffn = channel_mix_bwd_np(cache["ffn"], d_h, d_shift_ffn)
    d_h1, d_ln2_w, d_ln2_b = layer_norm_bwd_np(cache["ln2"], g_ffn["x"])
    d_h1 = d_h1 + d_h
    grads = {"attn.W_o": np.einsum("btc,bte->ce", d_h1, cache["att_flat"])}
    d_att = (d_h1 @ p["attn.W_o"]).reshape(cache["attn"]["q"].shape)
    d_x1 = np.zeros_like(x1)
    for n, d in zip("qkv", moba_attention_bwd_np(cache["attn"], d_att), strict=True):
        d = d.reshape(B, T, C)
        grads[f"attn.W_{n}"] = np.einsum("bte,btc->ec", d, x1)
        d_x1 += d @ p[f"attn.W_{n}"]
    d_h0, d_ln1_w, d_ln1_b = layer_norm_bwd_np(cache["ln1"], d_x1)
    grads.update(
        h=d_h0 + d_h1,
        shift_ffn=g_ffn["x_prev"],
        ln1_w=d_ln1_w,
        ln1_b=d_ln1_b,
        ln2_w=d_ln2_w,
        ln2_b=d_ln2_b,
    )
    grads.update(prefixed(g_ffn, "ffn", ("x_k", "W_key", "W_value")))
    return grads


def init_norm(rng, C: int, prefix: str, with_bias: bool) -> dict:
    """Norm gamma ``1 + 0.2 u`` and (LayerNorm) beta ``0.2 u``, ``u ~ uniform(-0.5, 0.5)``."""
    p = {f"{prefix}_w": seeded_uniform(rng, (C,), 0.2, offset=1.0)}
    if with_bias:
        p[f"{prefix}_b"] = seeded_uniform(rng, (C,), 0.2)
    return p


def init_qwen2_block_params(rng, C, n_q_heads, n_kv_heads, head_dim, F) -> dict:
    """Foundry's non-degenerate init: projections ``0.3 u``, Q/K/V biases ``0.5 u``."""
    hq, hkv = n_q_heads * head_dim, n_kv_heads * head_dim
    p = {**init_norm(rng, C, "ln1", False), **init_norm(rng, C, "ln2", False)}
    p["attn.W_q"] = seeded_uniform(rng, (hq, C), 0.3)
    p["attn.b_q"] = seeded_uniform(rng, (hq,), 0.5)
    p["attn.W_k"] = seeded_uniform(rng, (hkv, C), 0.3)
    p["attn.b_k"] = seeded_uniform(rng, (hkv,), 0.5)
    p["attn.W_v"] = seeded_uniform(rng, (hkv, C), 0.3)
    p["attn.b_v"] = seeded_uniform(rng, (hkv,), 0.5)
    p["attn.W_o"] = seeded_uniform(rng, (C, hq), 0.3)
    p["mlp.W_gate"] = seeded_uniform(rng, (F, C), 0.3)
    p["mlp.W_up"] = seeded_uniform(rng, (F, C), 0.3)
    p["mlp.W_down"] = seeded_uniform(rng, (C, F), 0.3)
    return p


def init_moba_block_params(rng, C, F) -> dict:
    """Foundry's non-degenerate init: projections ``0.3 u``, channel-mix lerp ``0.5 u``."""
    p = {**init_norm(rng, C, "ln1", True), **init_norm(rng, C, "ln2", True)}
    for n in ("q", "k", "v", "o"):
        p[f"attn.W_{n}"] = seeded_uniform(rng, (C, C), 0.3)
    p["ffn.x_k"] = seeded_uniform(rng, (C,), 0.5)
    p["ffn.W_key"] = seeded_uniform(rng, (F, C), 0.3)
    p["ffn.W_value"] = seeded_uniform(rng, (C, F), 0.3)
    return p
