"""RWKV-7 (x070) time-mix and blocks, and the ARWKV-style block of RFA: float64 fwd + hand bwd.

Activations are ``[B, T, C]`` with ``C = n_head * N``; per-head views are ``[B, T, H, N]``.
Linear weights are ``[out, in]`` (``y = x @ W.T``); the low-rank matrices are ``[in, out]``
(``xw @ w1``, ``@ w2``). The equations are DESIGN.md's "The equations (x070)".
"""

from __future__ import annotations

import numpy as np

from .common import seeded_uniform
from .mlp import (
    channel_mix_bwd_np,
    channel_mix_fwd_np,
    init_channel_mix_params,
    init_swiglu_params,
    outer_sum,
    swiglu_bwd_np,
    swiglu_fwd_np,
    token_shift_bwd_np,
    token_shift_np,
)
from .norms import (
    group_norm_bwd_np,
    group_norm_fwd_np,
    layer_norm_bwd_np,
    layer_norm_fwd_np,
    rms_norm_bwd_np,
    rms_norm_fwd_np,
)
from .wkv7 import wkv7_bwd_np, wkv7_np

__all__ = [
    "DECAY_SCALE",
    "arwkv_block_bwd_np",
    "arwkv_block_fwd_np",
    "init_arwkv_block_params",
    "init_channel_mix_params",
    "init_rwkv7_block_params",
    "init_swiglu_params",
    "init_time_mix_params",
    "rwkv7_block_bwd_np",
    "rwkv7_block_fwd_np",
    "time_mix_bwd_np",
    "time_mix_fwd_np",
]

DECAY_SCALE = np.exp(-0.5)  # log_w = -DECAY_SCALE * sigmoid(.), so the decay w lies in (0.545, 1)
KK_NORM_FLOOR = 1e-12  # torch's F.normalize eps
LN_X_EPS = 64e-5  # 1e-5 * head_size_divisor^2 with head_size_divisor = 8
LAYER_NORM_EPS = 1e-5
RMS_NORM_EPS = 1e-6


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def _heads(x: np.ndarray, n_head: int) -> np.ndarray:
    """``[B, T, C] -> [B, T, H, N]``."""
    return x.reshape(*x.shape[:-1], n_head, -1)


def _merge(x: np.ndarray) -> np.ndarray:
    """``[B, T, H, N] -> [B, T, C]``."""
    return x.reshape(*x.shape[:-2], -1)


def _sum_bt(x: np.ndarray) -> np.ndarray:
    """Sum over the batch and time axes (gradient of a per-channel parameter)."""
    return x.sum(axis=(0, 1))


def _lerp_names(use_gate: bool) -> tuple[str, ...]:
    return ("r", "w", "k", "v", "a", "g") if use_gate else ("r", "w", "k", "v", "a")


def _low_rank_bwd(x, m1, m2, hid, dhid_dpre, d_out):
    """Backward of ``act(x @ m1) @ m2`` where hid = act(x @ m1), dhid_dpre = act'(x @ m1).

    Returns (dx, d_m1, d_m2).
    """
    d_pre = (d_out @ m2.T) * dhid_dpre
    return d_pre @ m1.T, outer_sum(x, d_pre), outer_sum(hid, d_out)


def time_mix_fwd_np(
    x: np.ndarray,
    p: dict,
    *,
    n_head: int,
    rwkv_index: int,
    x_prev=None,
    state=None,
    v_first=None,
    use_gate: bool = True,
    use_ln_x: bool = True,
):
    """RWKV-7 time-mix of the normalised block input x ``[B, T, C]``.

    x_prev ``[B, C]``: token-shift carry (None = zeros); state ``[B, H, N, N]``: initial WKV
    state (None = zeros); v_first ``[B, T, C]``: layer 0's v, an input for rwkv_index > 0.
    ``use_gate=False`` drops the g gate (and x_g, g1, g2), ``use_ln_x=False`` the per-head
    group-norm (ARWKV). Returns (out ``[B, T, C]``, x_last ``[B, C]``, state_out, v_first_out,
    cache); v_first_out is v for layer 0 and the v_first passed in otherwise.
    """
    B, T, C = x.shape
    H = n_head
    x_prev = np.zeros((B, C)) if x_prev is None else x_prev
    xx = token_shift_np(x, x_prev) - x  # [B, T, C]
    lerp = {n: x + xx * p[f"x_{n}"] for n in _lerp_names(use_gate)}
    c = {"p": p, "H": H, "rwkv_index": rwkv_index, "use_gate": use_gate, "use_ln_x": use_ln_x}
    c.update(xx=xx, lerp=lerp, state=state)

    r = lerp["r"] @ p["W_r"].T
    k_raw = lerp["k"] @ p["W_k"].T
    v_raw = lerp["v"] @ p["W_v"].T
    w_hid = np.tanh(lerp["w"] @ p["w1"])  # [B, T, Dw]
    w_sig = _sigmoid(p["w0"] + w_hid @ p["w2"])
    log_w = -DECAY_SCALE * w_sig
    a_hid = lerp["a"] @ p["a1"]  # [B, T, Da]
    a = _sigmoid(p["a0"] + a_hid @ p["a2"])
    c.update(r=r, k_raw=k_raw, v_raw=v_raw, w_hid=w_hid, w_sig=w_sig, log_w=log_w)
    c.update(a_hid=a_hid, a=a)

    kk_raw = _heads(k_raw * p["k_k"], H)  # [B, T, H, N]
    kk_norm = np.maximum(np.linalg.norm(kk_raw, axis=-1, keepdims=True), KK_NORM_FLOOR)
    kk = kk_raw / kk_norm
    k = k_raw * (1.0 + (a - 1.0) * p["k_a"])
    c.update(kk=kk, kk_norm=kk_norm, k=k)

    if rwkv_index == 0:
        v = v_raw
        v_first_out = v
    else:
        v_hid = lerp["v"] @ p["v1"]  # [B, T, Dv]
        v_sig = _sigmoid(p["v0"] + v_hid @ p["v2"])
        v = v_raw + (v_first - v_raw) * v_sig
        v_first_out = v_first
        c.update(v_hid=v_hid, v_sig=v_sig, v_first=v_first)
    c["v"] = v

    wkv_args = (_heads(r, H), _heads(log_w, H), _heads(k, H), _heads(v, H), -kk, kk * _heads(a, H))
    y, state_out = wkv7_np(*wkv_args, state)
    y = _merge(y)
    c["wkv_args"] = wkv_args
    if use_ln_x:
        y, c["ln_x"] = group_norm_fwd_np(y, p["ln_x_w"], p["ln_x_b"], H, eps=LN_X_EPS)
    bonus_coef = (_heads(r, H) * _heads(k, H) * p["r_k"]).sum(axis=-1)  # [B, T, H]
    o = y + _merge(bonus_coef[..., None] * _heads(v, H))
    c.update(bonus_coef=bonus_coef, o=o)

    if use_gate:
        g_hid = _sigmoid(lerp["g"] @ p["g1"])  # [B, T, Dg]
        g = g_hid @ p["g2"]
        c.update(g_hid=g_hid, g=g)
        o = o * g
    c["o_gated"] = o
    out = o @ p["W_o"].T
    return out, x[:, -1].copy(), state_out, v_first_out, c


def _output_bwd(c: dict, d_out: np.ndarray, grads: dict, d_lerp: dict):
    """From d_out back to o = y_normed + bonus: returns (d_y_wkv, d_r, d_k, d_v) ``[B, T, C]``."""
    p, H = c["p"], c["H"]
    grads["W_o"] = outer_sum(d_out, c["o_gated"])
    d_o = d_out @ p["W_o"]  # [B, T, C]
    if c["use_gate"]:
        d_g = d_o * c["o"]
        d_o = d_o * c["g"]
        d_lerp_g, grads["g1"], grads["g2"] = _low_rank_bwd(
            c["lerp"]["g"], p["g1"], p["g2"], c["g_hid"], c["g_hid"] * (1.0 - c["g_hid"]), d_g
        )
        d_lerp["g"] = d_lerp_g
    d_bonus = _heads(d_o, H)  # [B, T, H, N]
    r, k, v = _heads(c["r"], H), _heads(c["k"], H), _heads(c["v"], H)
    d_coef = (d_bonus * v).sum(axis=-1, keepdims=True)  # [B, T, H, 1]
    d_r = _merge(d_coef * k * p["r_k"])
    d_k = _merge(d_coef * r * p["r_k"])
    d_v = _merge(c["bonus_coef"][..., None] * d_bonus)
    grads["r_k"] = _sum_bt(d_coef * r * k)
    d_y = d_o
    if c["use_ln_x"]:
        d_y, grads["ln_x_w"], grads["ln_x_b"] = group_norm_bwd_np(c["ln_x"], d_o)
    return d_y, d_r, d_k, d_v


def _wkv_bwd(c: dict, d_y, d_state, grads: dict):
    """Through the WKV7 recurrence: returns (d_r, d_log_w, d_k, d_v, d_kk [B, T, H, N], d_a)."""
    H = c["H"]
    gw = wkv7_bwd_np(*c["wkv_args"], c["state"], _heads(d_y, H), d_state)
    grads["state"] = gw["state"]
    kk, a = c["kk"], _heads(c["a"], H)
    d_kk = -gw["a"] + gw["b"] * a  # wkv's a = -kk, b = kk * a
    d_a = _merge(gw["b"] * kk)
    return _merge(gw["r"]), _merge(gw["log_w"]), _merge(gw["k"]), _merge(gw["v"]), d_kk, d_a


def _key_bwd(c: dict, d_k, d_kk, d_a, grads: dict):
    """Through ``k = k_raw (1 + (a - 1) k_a)`` and ``kk = normalize(k_raw k_k)``: (d_k_raw, d_a)."""
    p, a, k_raw = c["p"], c["a"], c["k_raw"]
    d_a = d_a + d_k * k_raw * p["k_a"]
    grads["k_a"] = _sum_bt(d_k * k_raw * (a - 1.0))
    d_k_raw = d_k * (1.0 + (a - 1.0) * p["k_a"])
    kk = c["kk"]
    d_kk_raw = _merge((d_kk - kk * (d_kk * kk).sum(axis=-1, keepdims=True)) / c["kk_norm"])
    grads["k_k"] = _sum_bt(d_kk_raw * k_raw)
    return d_k_raw + d_kk_raw * c["p"]["k_k"], d_a


def _value_bwd(c: dict, d_v, d_v_first, grads: dict, d_lerp: dict):
    """Through the v_first mixing; returns d_v_raw (fills grads['v_first'] for layer > 0)."""
    if c["rwkv_index"] == 0:
        return d_v if d_v_first is None else d_v + d_v_first
    p, v_sig = c["p"], c["v_sig"]
    grads["v_first"] = d_v * v_sig if d_v_first is None else d_v * v_sig + d_v_first
    d_z = d_v * (c["v_first"] - c["v_raw"]) * v_sig * (1.0 - v_sig)
    grads["v0"] = _sum_bt(d_z)
    d_lerp_v, grads["v1"], grads["v2"] = _low_rank_bwd(
        c["lerp"]["v"], p["v1"], p["v2"], c["v_hid"], 1.0, d_z
    )
    d_lerp["v"] += d_lerp_v
    return d_v * (1.0 - v_sig)


def _decay_and_iclr_bwd(c: dict, d_log_w, d_a, grads: dict, d_lerp: dict):
    """Through ``log_w = -DECAY_SCALE sigmoid(w0 + tanh(xw w1) w2)`` and ``a = sigmoid(...)``."""
    p, lerp = c["p"], c["lerp"]
    w_sig, a = c["w_sig"], c["a"]
    d_zw = d_log_w * (-DECAY_SCALE) * w_sig * (1.0 - w_sig)
    grads["w0"] = _sum_bt(d_zw)
    d_lerp["w"], grads["w1"], grads["w2"] = _low_rank_bwd(
        lerp["w"], p["w1"], p["w2"], c["w_hid"], 1.0 - c["w_hid"] ** 2, d_zw
    )
    d_za = d_a * a * (1.0 - a)
    grads["a0"] = _sum_bt(d_za)
    d_lerp["a"], grads["a1"], grads["a2"] = _low_rank_bwd(
        lerp["a"], p["a1"], p["a2"], c["a_hid"], 1.0, d_za
    )


def _token_shift_lerp_bwd(c: dict, d_lerp: dict, d_x_last, grads: dict):
    """Through ``x* = x + (shift(x) - x) mu_*``: fills grads 'x', 'x_prev' and every 'x_*'."""
    p, xx = c["p"], c["xx"]
    dx = np.zeros_like(xx)
    d_xx = np.zeros_like(xx)
    for n, d in d_lerp.items():
        grads[f"x_{n}"] = _sum_bt(d * xx)
        dx += d
        d_xx += d * p[f"x_{n}"]
    d_shift, grads["x_prev"] = token_shift_bwd_np(d_xx)
    dx += d_shift - d_xx
    if d_x_last is not None:
        dx[:, -1] += d_x_last
    grads["x"] = dx


def time_mix_bwd_np(cache: dict, d_out, d_x_last=None, d_state=None, d_v_first=None) -> dict:
    """Backward of ``time_mix_fwd_np``.

    d_out ``[B, T, C]``; d_x_last ``[B, C]``, d_state ``[B, H, N, N]`` and d_v_first ``[B, T, C]``
    are the cotangents of the other outputs (None = zeros). Layer 0: d_v_first (accumulated from
    later layers) flows into v and there is no 'v_first' key; layer > 0: 'v_first' is the
    gradient w.r.t. the v_first input. Also 'x', 'x_prev', 'state' and every key of p.
    """
    c, p = cache, cache["p"]
    grads: dict = {}
    d_lerp: dict = {}
    d_y, d_r, d_k, d_v = _output_bwd(c, d_out, grads, d_lerp)
    dr_w, d_log_w, dk_w, dv_w, d_kk, d_a = _wkv_bwd(c, d_y, d_state, grads)
    d_r, d_k, d_v = d_r + dr_w, d_k + dk_w, d_v + dv_w
    d_k_raw, d_a = _key_bwd(c, d_k, d_kk, d_a, grads)
    d_lerp["r"] = d_r @ p["W_r"]
    d_lerp["k"] = d_k_raw @ p["W_k"]
    grads["W_r"] = outer_sum(d_r, c["lerp"]["r"])
    grads["W_k"] = outer_sum(d_k_raw, c["lerp"]["k"])
    d_lerp["v"] = np.zeros_like(d_v)
    d_v_raw = _value_bwd(c, d_v, d_v_first, grads, d_lerp)
    d_lerp["v"] += d_v_raw @ p["W_v"]
    grads["W_v"] = outer_sum(d_v_raw, c["lerp"]["v"])
    _decay_and_iclr_bwd(c, d_log_w, d_a, grads, d_lerp)
    _token_shift_lerp_bwd(c, d_lerp, d_x_last, grads)
    return grads


def _prefixed(p: dict, prefix: str) -> dict:
    return {k[len(prefix) :]: v for k, v in p.items() if k.startswith(prefix)}


def _block_fwd(h, p, arwkv, n_head, rwkv_index, shift_att, shift_ffn, state, v_first):
    """``h = h + TMix(norm1(h)); h = h + FFN(norm2(h))`` for either block kind."""
    if arwkv:
        x1, ln1 = rms_norm_fwd_np(h, p["ln1_w"], eps=RMS_NORM_EPS)
    else:
        x1, ln1 = layer_norm_fwd_np(h, p["ln1_w"], p["ln1_b"], eps=LAYER_NORM_EPS)
    att, shift_att_out, state_out, v_first_out, tm = time_mix_fwd_np(
        x1,
        _prefixed(p, "att."),
        n_head=n_head,
        rwkv_index=rwkv_index,
        x_prev=shift_att,
        state=state,
        v_first=v_first,
        use_gate=not arwkv,
        use_ln_x=not arwkv,
    )
    h1 = h + att
    if arwkv:
        x2, ln2 = rms_norm_fwd_np(h1, p["ln2_w"], eps=RMS_NORM_EPS)
        ffn, ffn_cache = swiglu_fwd_np(x2, _prefixed(p, "ffn."))
        shift_ffn_out = None
    else:
        x2, ln2 = layer_norm_fwd_np(h1, p["ln2_w"], p["ln2_b"], eps=LAYER_NORM_EPS)
        ffn, shift_ffn_out, ffn_cache = channel_mix_fwd_np(x2, shift_ffn, _prefixed(p, "ffn."))
    cache = {
        "arwkv": arwkv,
        "rwkv_index": rwkv_index,
        "ln1": ln1,
        "ln2": ln2,
        "tm": tm,
        "ffn": ffn_cache,
    }
    return h1 + ffn, (shift_att_out, shift_ffn_out, state_out), v_first_out, cache


def _block_bwd(cache, d_h, d_shift_att, d_shift_ffn, d_state, d_v_first) -> dict:
    arwkv = cache["arwkv"]
    grads: dict = {}
    if arwkv:
        g_ffn = swiglu_bwd_np(cache["ffn"], d_h)
        d_x2, grads["ln2_w"] = rms_norm_bwd_np(cache["ln2"], g_ffn["x"])
    else:
        g_ffn = channel_mix_bwd_np(cache["ffn"], d_h, d_shift_ffn)
        d_x2, grads["ln2_w"], grads["ln2_b"] = layer_norm_bwd_np(cache["ln2"], g_ffn["x"])
        grads["shift_ffn"] = g_ffn["x_prev"]
    d_h1 = d_h + d_x2
    g_att = time_mix_bwd_np(cache["tm"], d_h1, d_shift_att, d_state, d_v_first)
    if arwkv:
        d_x1, grads["ln1_w"] = rms_norm_bwd_np(cache["ln1"], g_att["x"])
    else:
        d_x1, grads["ln1_w"], grads["ln1_b"] = layer_norm_bwd_np(cache["ln1"], g_att["x"])
    grads["h"] = d_h1 + d_x1
    grads["shift_att"] = g_att["x_prev"]
    for name in ("state", "v_first"):
        if name in g_att:
            grads[name] = g_att[name]
    act = {"x", "x_prev", "state", "v_first"}
    grads.update({f"att.{k}": v for k, v in g_att.items() if k not in act})
    grads.update({f"ffn.{k}": v for k, v in g_ffn.items() if k not in ("x", "x_prev")})
    return grads


def rwkv7_block_fwd_np(
    h: np.ndarray,
    p: dict,
    *,
    n_head: int,
    rwkv_index: int,
    shift_att=None,
    shift_ffn=None,
    state=None,
    v_first=None,
):
    """RWKV-7 block: ``h = h + TMix(LN1(h)); h = h + CMix(LN2(h))``, LayerNorm eps 1e-5.

    h ``[B, T, C]``; p: 'ln1_w', 'ln1_b', 'ln2_w', 'ln2_b' and the time-mix / channel-mix
    parameters prefixed 'att.' / 'ffn.'. shift_att / shift_ffn ``[B, C]`` are the token-shift
    carries of the LN1 / LN2 outputs, state ``[B, H, N, N]`` the WKV state (None = zeros).
    Returns (h_out, (shift_att_out, shift_ffn_out, state_out), v_first_out, cache).
    """
    return _block_fwd(h, p, False, n_head, rwkv_index, shift_att, shift_ffn, state, v_first)


def rwkv7_block_bwd_np(
    cache: dict, d_h, d_shift_att=None, d_shift_ffn=None, d_state=None, d_v_first=None
) -> dict:
    """Backward of ``rwkv7_block_fwd_np``: 'h', 'shift_att', 'shift_ffn', 'state', 'v_first'
    (layer > 0 only, as in ``time_mix_bwd_np``) and every key of p."""
    return _block_bwd(cache, d_h, d_shift_att, d_shift_ffn, d_state, d_v_first)


def arwkv_block_fwd_np(
    h: np.ndarray,
    p: dict,
    *,
    n_head: int,
    rwkv_index: int,
    shift_att=None,
    shift_ffn=None,
    state=None,
    v_first=None,
):
    """ARWKV-style RWKV block of RFA: RMSNorm (eps 1e-6, 'ln1_w', 'ln2_w'), time-mix without
    g gate and ln_x, SwiGLU ('ffn.W_gate', 'ffn.W_up', 'ffn.W_down').

    Same signature and return structure as ``rwkv7_block_fwd_np``; there is no FFN token shift,
    so shift_ffn must be None and shift_ffn_out is None.
    """
    if shift_ffn is not None:
        raise ValueError("arwkv_block_fwd_np: SwiGLU has no token shift; pass shift_ffn=None")
    return _block_fwd(h, p, True, n_head, rwkv_index, shift_att, None, state, v_first)


def arwkv_block_bwd_np(
    cache: dict, d_h, d_shift_att=None, d_shift_ffn=None, d_state=None, d_v_first=None
) -> dict:
    """Backward of ``arwkv_block_fwd_np``: 'h', 'shift_att', 'state', 'v_first' (layer > 0) and
    every key of p. d_shift_ffn must be None (there is no FFN token shift)."""
    if d_shift_ffn is not None:
        raise ValueError("arwkv_block_bwd_np: SwiGLU has no token shift; pass d_shift_ffn=None")
    return _block_bwd(cache, d_h, d_shift_att, None, d_state, d_v_first)


def init_time_mix_params(
    rng: np.random.Generator,
    C: int,
    n_head: int,
    *,
    Dw: int,
    Da: int,
    Dv: int,
    Dg: int,
    rwkv_index: int,
    use_gate: bool = True,
    use_ln_x: bool = True,
) -> dict:
    """Foundry's non-degenerate time-mix init: matrices uniform(-0.5, 0.5) * 0.3; lerps,
    w0/a0/v0/k_k/k_a/r_k * 0.5; ln_x gamma 1 + 0.2 u, beta 0.2 u. v0/v1/v2 only for
    rwkv_index > 0, x_g/g1/g2 only with use_gate, ln_x_w/ln_x_b only with use_ln_x."""
    N = C // n_head
    p = {f"x_{n}": seeded_uniform(rng, (C,), 0.5) for n in _lerp_names(use_gate)}
    for name in ("W_r", "W_k", "W_v", "W_o"):
        p[name] = seeded_uniform(rng, (C, C), 0.3)
    low_rank = {"w": Dw, "a": Da}
    if rwkv_index > 0:
        low_rank["v"] = Dv
    for n, D in low_rank.items():
        p[f"{n}0"] = seeded_uniform(rng, (C,), 0.5)
        p[f"{n}1"] = seeded_uniform(rng, (C, D), 0.3)
        p[f"{n}2"] = seeded_uniform(rng, (D, C), 0.3)
    if use_gate:
        p["g1"] = seeded_uniform(rng, (C, Dg), 0.3)
        p["g2"] = seeded_uniform(rng, (Dg, C), 0.3)
    p["k_k"] = seeded_uniform(rng, (C,), 0.5)
    p["k_a"] = seeded_uniform(rng, (C,), 0.5)
    p["r_k"] = seeded_uniform(rng, (n_head, N), 0.5)
    if use_ln_x:
        p["ln_x_w"] = seeded_uniform(rng, (C,), 0.2, offset=1.0)
        p["ln_x_b"] = seeded_uniform(rng, (C,), 0.2)
    return p


def init_rwkv7_block_params(
    rng: np.random.Generator,
    C: int,
    n_head: int,
    F: int,
    *,
    Dw: int,
    Da: int,
    Dv: int,
    Dg: int,
    rwkv_index: int,
) -> dict:
    """Params of ``rwkv7_block_fwd_np``: LN1/LN2 (gamma 1 + 0.2 u, beta 0.2 u), 'att.', 'ffn.'."""
    p = {
        "ln1_w": seeded_uniform(rng, (C,), 0.2, offset=1.0),
        "ln1_b": seeded_uniform(rng, (C,), 0.2),
        "ln2_w": seeded_uniform(rng, (C,), 0.2, offset=1.0),
        "ln2_b": seeded_uniform(rng, (C,), 0.2),
    }
    att = init_time_mix_params(rng, C, n_head, Dw=Dw, Da=Da, Dv=Dv, Dg=Dg, rwkv_index=rwkv_index)
    p.update({f"att.{k}": v for k, v in att.items()})
    p.update({f"ffn.{k}": v for k, v in init_channel_mix_params(rng, C, F).items()})
    return p


def init_arwkv_block_params(
    rng: np.random.Generator,
    C: int,
    n_head: int,
    F: int,
    *,
    Dw: int,
    Da: int,
    Dv: int,
    rwkv_index: int,
    Dg=None,
) -> dict:
    """Params of ``arwkv_block_fwd_np``: RMSNorm gammas, 'att.' (no gate, no ln_x), SwiGLU
    'ffn.'. Dg is accepted (and ignored) so both block inits take the same arguments."""
    p = {
        "ln1_w": seeded_uniform(rng, (C,), 0.2, offset=1.0),
        "ln2_w": seeded_uniform(rng, (C,), 0.2, offset=1.0),
    }
    att = init_time_mix_params(
        rng,
        C,
        n_head,
        Dw=Dw,
        Da=Da,
        Dv=Dv,
        Dg=0,
        rwkv_index=rwkv_index,
        use_gate=False,
        use_ln_x=False,
    )
    p.update({f"att.{k}": v for k, v in att.items()})
    p.update({f"ffn.{k}": v for k, v in init_swiglu_params(rng, C, F).items()})
    return p
