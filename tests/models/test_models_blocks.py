"""Each block of mlx_rwkvx.models against the float64 oracle: outputs (every carry included) and
MLX-autograd gradients w.r.t. every parameter, the input and the initial carries.

Blocks come from ``Model(cfg)`` (the seeded init). DESIGN.md: a block in float32 is within
1e-5 (forward) and 1e-4 (gradients) of the oracle, norm-wise per tensor.
"""

from __future__ import annotations

from mlx_rwkvx.models import Model, ModelConfig, rfa_config
from mlx_rwkvx.ops.moba import moba_selection, selection_mask

import mlx.core as mx
import numpy as np
import pytest
from helpers import LOW_RANK, rwkv7_cfg
from helpers.model_params import (
    assert_close,
    flat_params,
    from_oracle,
    grads_of,
    oracle_params,
    to_mx,
)
from oracle.blocks_attn import (
    moba_block_bwd_np,
    moba_block_fwd_np,
    qwen2_block_bwd_np,
    qwen2_block_fwd_np,
)
from oracle.rwkv7 import (
    arwkv_block_bwd_np,
    arwkv_block_fwd_np,
    rwkv7_block_bwd_np,
    rwkv7_block_fwd_np,
)

# DESIGN.md: (forward, gradients) of a block, float32 and bfloat16 (weights, activations and
# cotangents in bf16; the WKV state float32). The oracle gets the same bf16-rounded values.
TOLS = {"float32": (1e-5, 1e-4), "bfloat16": (2e-2, 5e-2)}
B = 2
TS = [1, 7, 17]
RWKV_CFGS = {
    "rwkv7": lambda: rwkv7_cfg(3, vocab_size=16, **LOW_RANK),
    "arwkv": lambda: rfa_config(
        vocab_size=16,
        hidden_size=32,
        head_size=16,
        block_types=["rwkv7"] * 3,
        intermediate_size=48,
        **LOW_RANK,
    ),
}


def _np(x) -> np.ndarray:
    return np.array(x.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("style", sorted(RWKV_CFGS))
def test_rwkv_block_with_a_zero_kk_head(style):
    """A head whose ``k * k_k`` is zero (k_k = 0 in a model built without an init): finite
    gradients, the oracle's (F.normalize's: 1 / floor there). MLX's ``linalg.norm`` has a 0/0
    gradient at zero, which made every gradient before such a block NaN."""
    test_rwkv_block(style, 2, 17, "float32", zero_head=True)


def _check_grads(block, kind, g_params, g_acts, ref, act_names, what, dtype, may_be_zero=()):
    """Our gradients (parameters by path, activations by name) against the oracle's."""
    names = list(flat_params(block))
    ours = {**{k: g_params[k] for k in names}, **{k: g_acts[k] for k in act_names}}
    want = {**from_oracle(ref, names, kind=kind), **{k: ref[k] for k in act_names}}
    return assert_close(ours, want, TOLS[dtype][1], f"{what} {dtype} gradients", may_be_zero)


def _in_dtype(block, arrays: dict, dtype: str) -> tuple[dict, dict]:
    """Cast ``block`` to ``dtype``; ``arrays`` as MLX arrays of that dtype (a WKV state stays
    float32) and, for the oracle, as float64 copies of exactly those values."""
    dt = getattr(mx, dtype)
    block.set_dtype(dt)
    mx_arrays = {k: to_mx(v, mx.float32 if k == "state" else dt) for k, v in arrays.items()}
    return mx_arrays, {k: _np(v) for k, v in mx_arrays.items()}


WHEN = [(T, "float32") for T in TS] + [(17, "bfloat16")]


@pytest.mark.parametrize(("T", "dtype"), WHEN)
@pytest.mark.parametrize("rwkv_index", [0, 2])
@pytest.mark.parametrize("style", sorted(RWKV_CFGS))
def test_rwkv_block(style, rwkv_index, T, dtype, zero_head=False):
    """RWKV7Block (and its ARWKV variant) with every carry given: token shifts, WKV state and
    (index > 0) v_first; cotangents on every output, v_first included."""
    cfg = RWKV_CFGS[style]()
    block = Model(cfg, seed=rwkv_index + 1).layers[rwkv_index]
    C, H, N = cfg.hidden_size, cfg.n_heads, cfg.head_size
    if zero_head:  # the first head's k_k = 0: its kk is zero, the normalisation at its floor
        block.tmix.k_k = block.tmix.k_k * (mx.arange(C) >= N)
    arwkv = style == "arwkv"
    rng = np.random.default_rng(10 * T + rwkv_index)
    acts = {
        "h": rng.standard_normal((B, T, C)),
        "shift_att": rng.standard_normal((B, C)),
        "state": 0.3 * rng.standard_normal((B, H, N, N)),
    }
    if not arwkv:
        acts["shift_ffn"] = rng.standard_normal((B, C))
    if rwkv_index > 0:
        acts["v_first"] = 0.5 * rng.standard_normal((B, T, C))

    def run(a):
        state = {"tmix_shift": a["shift_att"][:, None], "wkv": a["state"]}
        if not arwkv:
            state["ffn_shift"] = a["shift_ffn"][:, None]
        assert block.state_problem(state, B) is None
        v_first = a["v_first"].reshape(B, T, H, N) if "v_first" in a else None
        h, v_first, new = block(a["h"], v_first, state)
        outs = {"h": h, "v_first": v_first.reshape(B, T, C), "shift_att": new["tmix_shift"][:, 0]}
        outs["state"] = new["wkv"]
        if not arwkv:
            outs["shift_ffn"] = new["ffn_shift"][:, 0]
        return outs

    mx_acts, acts = _in_dtype(block, acts, dtype)
    p = oracle_params(block, kind="rwkv7")
    fwd, bwd = (arwkv_block_fwd_np, arwkv_block_bwd_np)
    if not arwkv:
        fwd, bwd = rwkv7_block_fwd_np, rwkv7_block_bwd_np
    h, (sa, sf, st), vf, cache = fwd(
        acts["h"],
        p,
        n_head=H,
        rwkv_index=rwkv_index,
        shift_att=acts["shift_att"],
        shift_ffn=acts.get("shift_ffn"),
        state=acts["state"],
        v_first=acts.get("v_first"),
    )
    ref = {"h": h, "v_first": vf, "shift_att": sa, "state": st}
    if not arwkv:
        ref["shift_ffn"] = sf
    outs = run(mx_acts)
    assert outs["h"].dtype == getattr(mx, dtype) and outs["state"].dtype == mx.float32
    assert_close(outs, ref, TOLS[dtype][0], f"{style} block {rwkv_index} {dtype} outputs")

    mx_cot, cot = _in_dtype(block, {k: rng.standard_normal(v.shape) for k, v in ref.items()}, dtype)

    def loss(a):
        o = run(a)
        return sum((o[k] * mx_cot[k]).sum() for k in mx_cot)

    g_params, g_acts = grads_of(block, loss, mx_acts)
    g_ref = bwd(
        cache,
        cot["h"],
        cot["shift_att"],
        cot.get("shift_ffn"),
        cot["state"],
        cot["v_first"],
    )
    _check_grads(
        block, "rwkv7", g_params, g_acts, g_ref, list(acts), f"{style} {rwkv_index}", dtype
    )


def _moba_cfg(top_k):
    return ModelConfig(
        vocab_size=16,
        hidden_size=32,
        head_size=16,
        block_types=["rwkv7", "moba"],
        intermediate_size=48,
        moba_chunk_size=4,
        moba_top_k=top_k,
        **LOW_RANK,
    )


def _moba_mask(block, h: mx.array) -> np.ndarray:
    """The block's own MoBA selection on its q, k, as the oracle's ``[B, Hq, T, T]`` mask."""
    attn = block.attn
    B_, T, _ = h.shape
    x1 = block.ln1(h)
    shape = (B_, T, attn.n_heads, attn.head_dim)
    q, k = attn.q_proj(x1).reshape(shape), attn.k_proj(x1).reshape(shape)
    sel = moba_selection(q, k, chunk_size=attn.chunk_size, top_k=attn.top_k)
    mask = selection_mask(sel, T, T, attn.chunk_size)
    return np.broadcast_to(np.array(mask), (B_, attn.n_heads, T, T)).copy()


@pytest.mark.parametrize(
    ("T", "top_k", "with_cache", "dtype"),
    [
        (1, 1, True, "float32"),
        (7, 1, True, "float32"),
        (17, 1, True, "float32"),
        (17, 1, False, "float32"),
        (17, 8, True, "float32"),
        (17, 1, True, "bfloat16"),
    ],
)
def test_moba_block(T, top_k, with_cache, dtype):
    """MobaBlock with its selection pinned to the one it makes on its own q, k (top_k 1 over 4
    earlier chunks at T=17: sparse; top_k 8: every chunk). ``with_cache``: a fresh state
    carrying a channel-mix token shift."""
    cfg = _moba_cfg(top_k)
    block = Model(cfg, seed=3).layers[1]
    C, Hq = cfg.hidden_size, cfg.n_q_heads
    rng = np.random.default_rng(T + top_k)
    acts = {"h": rng.standard_normal((B, T, C))}
    if with_cache:
        acts["shift_ffn"] = rng.standard_normal((B, C))
    mx_acts, acts = _in_dtype(block, acts, dtype)
    mask = _moba_mask(block, mx_acts["h"])
    causal = np.tril(np.ones((T, T), dtype=bool))
    if T == 17 and top_k == 1:
        assert (mask != causal).any(), "expected a sparse selection"

    def run(a):
        state = block.init_state(B)
        if with_cache:
            state["ffn_shift"] = a["shift_ffn"][:, None]
        h, _, new = block(a["h"], None, state)
        return {"h": h, **({"shift_ffn": new["ffn_shift"][:, 0]} if with_cache else {})}

    p = oracle_params(block, kind="moba")
    h, sf, cache = moba_block_fwd_np(
        acts["h"],
        p,
        n_head=Hq,
        chunk_size=cfg.moba_chunk_size,
        top_k=top_k,
        shift_ffn=acts.get("shift_ffn"),
        selection=mask,
    )
    ref = {"h": h, **({"shift_ffn": sf} if with_cache else {})}
    assert_close(run(mx_acts), ref, TOLS[dtype][0], f"moba block {dtype} outputs")

    mx_cot, cot = _in_dtype(block, {k: rng.standard_normal(v.shape) for k, v in ref.items()}, dtype)

    def loss(a):
        o = run(a)
        return sum((o[k] * mx_cot[k]).sum() for k in mx_cot)

    g_params, g_acts = grads_of(block, loss, mx_acts)
    g_ref = moba_block_bwd_np(cache, cot["h"], cot.get("shift_ffn"))
    # one key per query at T=1: the softmax is constant, q and k get no gradient
    zero = ("attn.q_proj.weight", "attn.k_proj.weight") if T == 1 else ()
    _check_grads(block, "moba", g_params, g_acts, g_ref, list(acts), "moba block", dtype, zero)


@pytest.mark.parametrize(("T", "dtype"), WHEN)
@pytest.mark.parametrize("prefix", [0, 5])
def test_qwen2_block(prefix, T, dtype):
    """Qwen2Block (GQA 4 query / 2 KV heads, RoPE) alone and after a KV-cache prefix of rotated
    keys: RoPE positions continue from the cache offset; gradients reach the cached keys."""
    cfg = rfa_config(
        vocab_size=16,
        hidden_size=32,
        head_size=16,
        block_types=["qwen2"],
        intermediate_size=48,
        n_q_heads=4,
        n_kv_heads=2,
        attn_head_dim=8,
        rope_theta=1e4,
    )
    block = Model(cfg, seed=5).layers[0]
    C, Hkv, D = cfg.hidden_size, cfg.n_kv_heads, cfg.attn_head_dim
    rng = np.random.default_rng(T + 100 * prefix)
    acts = {"h": rng.standard_normal((B, T, C))}
    if prefix:
        acts["k_prev"] = rng.standard_normal((B, prefix, Hkv, D))
        acts["v_prev"] = rng.standard_normal((B, prefix, Hkv, D))
    mx_acts, acts = _in_dtype(block, acts, dtype)

    def run(a):
        state = block.init_state(B)
        if prefix:
            state = {"keys": a["k_prev"].transpose(0, 2, 1, 3)}
            state["values"] = a["v_prev"].transpose(0, 2, 1, 3)
        h, _, new = block(a["h"], None, state)
        keys, values = (new[n].transpose(0, 2, 1, 3) for n in ("keys", "values"))
        return {"h": h, "k_all": keys, "v_all": values}

    p = oracle_params(block, kind="qwen2")
    kv = (acts["k_prev"], acts["v_prev"]) if prefix else None
    h, (k_all, v_all), cache = qwen2_block_fwd_np(
        acts["h"],
        p,
        n_q_heads=cfg.n_q_heads,
        n_kv_heads=Hkv,
        rope_theta=cfg.rope_theta,
        rms_eps=cfg.rms_norm_eps,
        pos0=prefix,
        kv_cache=kv,
    )
    ref = {"h": h, "k_all": k_all, "v_all": v_all}
    assert_close(run(mx_acts), ref, TOLS[dtype][0], f"qwen2 {dtype} outputs")

    mx_cot, cot = _in_dtype(block, {"h": rng.standard_normal(h.shape)}, dtype)
    mx_d_h, d_h = mx_cot["h"], cot["h"]
    g_params, g_acts = grads_of(block, lambda a: (run(a)["h"] * mx_d_h).sum(), mx_acts)
    g_ref = qwen2_block_bwd_np(cache, d_h)
    zero = ()
    if T == 1 and not prefix:  # one key: the softmax is constant, q and k get no gradient
        zero = tuple(f"self_attn.{n}_proj.{w}" for n in "qk" for w in ("weight", "bias"))
    _check_grads(block, "qwen2", g_params, g_acts, g_ref, list(acts), "qwen2 block", dtype, zero)


@pytest.mark.parametrize("kind", ["rwkv7", "moba", "qwen2"])
def test_name_map_is_a_bijection(kind):
    """Every parameter of each block maps to a distinct oracle name and back, and covers the
    oracle's parameters of that block exactly."""
    from helpers.model_params import BLOCK_NAMES, to_oracle

    cfgs = {
        "rwkv7": (RWKV_CFGS["rwkv7"](), 1),
        "moba": (_moba_cfg(1), 1),
        "qwen2": (
            rfa_config(vocab_size=16, hidden_size=32, head_size=16, block_types=["qwen2"]),
            0,
        ),
    }
    cfg, i = cfgs[kind]
    block = Model(cfg).layers[i]
    ours = flat_params(block)
    p = to_oracle(ours, kind=kind)
    assert len(p) == len(ours)
    back = from_oracle(p, list(ours), kind=kind)
    for k, v in ours.items():
        np.testing.assert_array_equal(back[k], _np(v))
    assert len(set(o for o, _ in BLOCK_NAMES[kind].values())) == len(BLOCK_NAMES[kind])
