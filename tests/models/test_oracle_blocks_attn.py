"""Tests of the attention blocks' oracle (oracle/blocks_attn.py): the Qwen2 block and the MoBA
block, hand backward vs finite differences, and sequences split in two vs one call."""

from __future__ import annotations

import numpy as np
import pytest
from oracle.attention import causal_mask
from oracle.blocks_attn import (
    init_moba_block_params,
    init_qwen2_block_params,
    moba_block_bwd_np,
    moba_block_fwd_np,
    qwen2_block_bwd_np,
    qwen2_block_fwd_np,
)
from oracle.common import check_grads, rel_err

QWEN_BLOCK = dict(n_q_heads=4, n_kv_heads=2, rope_theta=1e4)


def qwen2_block_pair(pos0=0, with_cache=False):
    def fwd(d):
        kv = (d["k_prev"], d["v_prev"]) if with_cache else None
        p = {k: v for k, v in d.items() if k not in ("h", "k_prev", "v_prev")}
        out, _, cache = qwen2_block_fwd_np(d["h"], p, pos0=pos0, kv_cache=kv, **QWEN_BLOCK)
        return (out,), cache

    return fwd, lambda cache, d_outs: qwen2_block_bwd_np(cache, d_outs[0])


def qwen2_block_inputs(seed, B, T, S0=0):
    rng = np.random.default_rng(seed)
    d = {"h": rng.standard_normal((B, T, 8)), **init_qwen2_block_params(rng, 8, 4, 2, 4, 12)}
    if S0:
        d["k_prev"] = rng.standard_normal((B, S0, 2, 4))
        d["v_prev"] = rng.standard_normal((B, S0, 2, 4))
    return d


@pytest.mark.parametrize("B,T", [(2, 3), (1, 17)])
def test_qwen2_block_grads(B, T):
    d = qwen2_block_inputs(T, B, T)
    errors = check_grads(*qwen2_block_pair(), d)
    assert set(errors) == set(d)


def test_qwen2_block_grads_with_kv_cache():
    d = qwen2_block_inputs(3, 2, 3, S0=4)
    errors = check_grads(*qwen2_block_pair(pos0=4, with_cache=True), d)
    assert set(errors) == set(d)


def test_qwen2_block_split_equals_one_call():
    d = qwen2_block_inputs(4, 2, 17)
    h = d.pop("h")
    full, (k_full, _), _ = qwen2_block_fwd_np(h, d, **QWEN_BLOCK)
    first, kv, _ = qwen2_block_fwd_np(h[:, :6], d, **QWEN_BLOCK)
    second, (k_all, _), _ = qwen2_block_fwd_np(h[:, 6:], d, pos0=6, kv_cache=kv, **QWEN_BLOCK)
    assert rel_err(np.concatenate([first, second], axis=1), full) <= 1e-13
    assert rel_err(k_all, k_full) <= 1e-15


MOBA_BLOCK = dict(n_head=2, chunk_size=4)


def moba_block_inputs(seed, B, T):
    rng = np.random.default_rng(seed)
    return {
        "h": rng.standard_normal((B, T, 8)),
        "shift_ffn": rng.standard_normal((B, 8)),
        **init_moba_block_params(rng, 8, 12),
    }


def moba_block_pair(top_k, selection):
    def fwd(d):
        p = {k: v for k, v in d.items() if k not in ("h", "shift_ffn")}
        out, shift, cache = moba_block_fwd_np(
            d["h"], p, top_k=top_k, shift_ffn=d["shift_ffn"], selection=selection, **MOBA_BLOCK
        )
        return (out, shift), cache

    return fwd, lambda cache, d_outs: moba_block_bwd_np(cache, d_outs[0], d_outs[1])


@pytest.mark.parametrize("B,T,top_k", [(2, 1, 1), (2, 3, 1), (1, 17, 1), (2, 9, 0)])
def test_moba_block_grads_pinned_selection(B, T, top_k):
    d = moba_block_inputs(T + top_k, B, T)
    fwd, bwd = moba_block_pair(top_k, None)
    selection = fwd(d)[1]["selection"]
    if T == 17:  # the real sparse case
        assert selection.sum() < causal_mask(T, T).sum() * B * MOBA_BLOCK["n_head"]
    keys = [k for k in d if not (T == 1 and k in ("attn.W_q", "attn.W_k"))]
    # eps 1e-5: the shift_ffn gradient is small (it reaches token 0 only, through x_k), so at
    # eps 1e-6 the loss's rounding error over eps dominates its central difference (~2e-6).
    errors = check_grads(*moba_block_pair(top_k, selection), d, keys=keys, eps=1e-5)
    assert "shift_ffn" in errors


def test_moba_block_shift_defaults_to_zeros():
    d = moba_block_inputs(5, 2, 5)
    h, p = d.pop("h"), {k: v for k, v in d.items() if k != "shift_ffn"}
    out_none, shift_none, _ = moba_block_fwd_np(h, p, top_k=1, **MOBA_BLOCK)
    out_zero, shift_zero, _ = moba_block_fwd_np(
        h, p, top_k=1, shift_ffn=np.zeros((2, 8)), **MOBA_BLOCK
    )
    assert rel_err(out_none, out_zero) == 0.0 and rel_err(shift_none, shift_zero) == 0.0
    out_shift, _, _ = moba_block_fwd_np(h, p, top_k=1, shift_ffn=d["shift_ffn"], **MOBA_BLOCK)
    assert rel_err(out_shift[:, 1:], out_zero[:, 1:]) == 0.0  # the carry feeds token 0 only
    assert rel_err(out_shift[:, 0], out_zero[:, 0]) > 1e-3
