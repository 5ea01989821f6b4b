"""The float64 oracle of norms, FFNs, RWKV-7 time-mix and blocks: hand backward vs finite
differences, and sequences split in two (carrying the token shift and the state) vs one call."""

import numpy as np
import pytest
from oracle.common import check_grads, rel_err
from oracle.mlp import (
    channel_mix_bwd_np,
    channel_mix_fwd_np,
    init_channel_mix_params,
    init_swiglu_params,
    swiglu_bwd_np,
    swiglu_fwd_np,
)
from oracle.norms import (
    group_norm_bwd_np,
    group_norm_fwd_np,
    layer_norm_bwd_np,
    layer_norm_fwd_np,
    rms_norm_bwd_np,
    rms_norm_fwd_np,
)
from oracle.rwkv7 import (
    DECAY_SCALE,
    arwkv_block_bwd_np,
    arwkv_block_fwd_np,
    init_arwkv_block_params,
    init_rwkv7_block_params,
    init_time_mix_params,
    rwkv7_block_bwd_np,
    rwkv7_block_fwd_np,
    time_mix_bwd_np,
    time_mix_fwd_np,
)

B, C, H, F = 2, 8, 2, 12
# Central-difference step. Some gradients are ~1e-4 of the loss's scale (r_k and the decay lerps
# in a block, log_w at decay 1e-4); at eps 1e-6 roundoff (~1e-16 |L| / eps) brings their error
# near tol. At 1e-5 roundoff is ten times smaller and truncation (~eps^2) still far below tol.
FD_EPS = 1e-5
N = C // H
LOW_RANK = {"Dw": 4, "Da": 3, "Dv": 3, "Dg": 4}
TS = [1, 3, 17]
ARWKV = {"use_gate": False, "use_ln_x": False}
TM_VARIANTS = {
    "layer0": (0, {}),
    "layer2": (2, {}),
    "layer0_arwkv": (0, ARWKV),
    "layer2_arwkv": (2, ARWKV),
}
BLOCKS = {
    "rwkv7": (rwkv7_block_fwd_np, rwkv7_block_bwd_np, init_rwkv7_block_params),
    "arwkv": (arwkv_block_fwd_np, arwkv_block_bwd_np, init_arwkv_block_params),
}
TM_ACTS = ("x", "x_prev", "state", "v_first")
BLOCK_ACTS = ("h", "shift_att", "shift_ffn", "state", "v_first")


def _uniform(rng, shape, scale=1.0):
    return scale * (rng.random(shape) - 0.5)


def _split(inputs, acts):
    return {k: v for k, v in inputs.items() if k in acts}, {
        k: v for k, v in inputs.items() if k not in acts
    }


@pytest.mark.parametrize("T", TS)
def test_layer_norm_grads(T):
    rng = np.random.default_rng(T)
    inputs = {
        "x": rng.standard_normal((B, T, C)),
        "w": _uniform(rng, C, 0.2) + 1.0,
        "b": _uniform(rng, C, 0.2),
    }

    def fwd(i):
        y, cache = layer_norm_fwd_np(i["x"], i["w"], i["b"])
        return (y,), cache

    def bwd(cache, d):
        return dict(zip(("x", "w", "b"), layer_norm_bwd_np(cache, d[0]), strict=True))

    check_grads(fwd, bwd, inputs, eps=FD_EPS)


@pytest.mark.parametrize("T", TS)
def test_rms_norm_grads(T):
    rng = np.random.default_rng(T)
    inputs = {"x": rng.standard_normal((B, T, C)), "w": _uniform(rng, C, 0.2) + 1.0}

    def fwd(i):
        y, cache = rms_norm_fwd_np(i["x"], i["w"])
        return (y,), cache

    def bwd(cache, d):
        return dict(zip(("x", "w"), rms_norm_bwd_np(cache, d[0]), strict=True))

    check_grads(fwd, bwd, inputs, eps=FD_EPS)


@pytest.mark.parametrize("T", TS)
def test_group_norm_grads(T):
    rng = np.random.default_rng(T)
    inputs = {
        "x": rng.standard_normal((B, T, C)),
        "w": _uniform(rng, C, 0.2) + 1.0,
        "b": _uniform(rng, C, 0.2),
    }

    def fwd(i):
        y, cache = group_norm_fwd_np(i["x"], i["w"], i["b"], H)
        return (y,), cache

    def bwd(cache, d):
        return dict(zip(("x", "w", "b"), group_norm_bwd_np(cache, d[0]), strict=True))

    check_grads(fwd, bwd, inputs, eps=FD_EPS)


def test_norm_forwards_against_formulas():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, 5, C)) * 3.0 + 1.0
    w, b = _uniform(rng, C) + 1.0, _uniform(rng, C)
    y, _ = layer_norm_fwd_np(x, np.ones(C), np.zeros(C), eps=0.0)
    np.testing.assert_allclose(y.mean(-1), 0.0, atol=1e-13)
    np.testing.assert_allclose(y.var(-1), 1.0, rtol=1e-12)
    y, _ = rms_norm_fwd_np(x, w, eps=1e-6)
    assert rel_err(y, x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-6) * w) <= 1e-14
    y, _ = group_norm_fwd_np(x, w, b, H, eps=64e-5)
    per_head = [
        layer_norm_fwd_np(
            x[..., h * N : (h + 1) * N], w[h * N : (h + 1) * N], b[h * N : (h + 1) * N], eps=64e-5
        )[0]
        for h in range(H)
    ]
    assert rel_err(y, np.concatenate(per_head, axis=-1)) <= 1e-14


@pytest.mark.parametrize("T", TS)
def test_channel_mix_grads(T):
    rng = np.random.default_rng(T)
    inputs = {
        "x": rng.standard_normal((B, T, C)),
        "x_prev": rng.standard_normal((B, C)),
        **init_channel_mix_params(rng, C, F),
    }

    def fwd(i):
        out, x_last, cache = channel_mix_fwd_np(i["x"], i["x_prev"], i)
        return (out, x_last), cache

    def bwd(cache, d):
        return channel_mix_bwd_np(cache, *d)

    errors = check_grads(fwd, bwd, inputs, eps=FD_EPS)
    assert set(errors) == {"x", "x_prev", "x_k", "W_key", "W_value"}


@pytest.mark.parametrize("T", TS)
def test_swiglu_grads(T):
    rng = np.random.default_rng(T)
    inputs = {"x": rng.standard_normal((B, T, C)), **init_swiglu_params(rng, C, F)}

    def fwd(i):
        out, cache = swiglu_fwd_np(i["x"], i)
        return (out,), cache

    def bwd(cache, d):
        return swiglu_bwd_np(cache, d[0])

    errors = check_grads(fwd, bwd, inputs, eps=FD_EPS)
    assert set(errors) == {"x", "W_gate", "W_up", "W_down"}


def test_decay_is_rfa_softplus_form():
    z = np.linspace(-8.0, 8.0, 33)
    log_w = -DECAY_SCALE / (1.0 + np.exp(-z))
    softplus_form = -np.exp(-np.logaddexp(0.0, -z) - 0.5)
    assert rel_err(log_w, softplus_form) <= 1e-15
    assert np.all(np.exp(log_w) > 0.545) and np.all(log_w < 0.0)


def _tm_inputs(rng, T, rwkv_index, flags):
    p = init_time_mix_params(rng, C, H, rwkv_index=rwkv_index, **LOW_RANK, **flags)
    inputs = {
        "x": rng.standard_normal((B, T, C)),
        "x_prev": rng.standard_normal((B, C)),
        "state": _uniform(rng, (B, H, N, N)),
        **p,
    }
    if rwkv_index > 0:
        inputs["v_first"] = rng.standard_normal((B, T, C))
    return inputs


def _tm_pair(rwkv_index, flags):
    def fwd(i):
        acts, p = _split(i, TM_ACTS)
        *outs, cache = time_mix_fwd_np(
            acts["x"],
            p,
            n_head=H,
            rwkv_index=rwkv_index,
            x_prev=acts["x_prev"],
            state=acts["state"],
            v_first=acts.get("v_first"),
            **flags,
        )
        return tuple(outs), cache

    def bwd(cache, d):
        return time_mix_bwd_np(cache, *d)

    return fwd, bwd


@pytest.mark.parametrize("variant", list(TM_VARIANTS))
@pytest.mark.parametrize("T", TS)
def test_time_mix_grads(T, variant):
    rwkv_index, flags = TM_VARIANTS[variant]
    inputs = _tm_inputs(np.random.default_rng(T), T, rwkv_index, flags)
    errors = check_grads(*_tm_pair(rwkv_index, flags), inputs, seed=T, eps=FD_EPS)
    assert set(errors) == set(inputs)


@pytest.mark.parametrize("variant", list(TM_VARIANTS))
def test_time_mix_split_equals_whole(variant):
    rwkv_index, flags = TM_VARIANTS[variant]
    inputs = _tm_inputs(np.random.default_rng(5), 17, rwkv_index, flags)
    acts, p = _split(inputs, TM_ACTS)
    v_first = acts.get("v_first")
    kw = {"n_head": H, "rwkv_index": rwkv_index, **flags}
    whole = time_mix_fwd_np(
        acts["x"], p, x_prev=acts["x_prev"], state=acts["state"], v_first=v_first, **kw
    )
    carry_x, carry_s, parts = acts["x_prev"], acts["state"], []
    for lo, hi in [(0, 6), (6, 7), (7, 17)]:
        vf = None if v_first is None else v_first[:, lo:hi]
        out, carry_x, carry_s, vf_out, _ = time_mix_fwd_np(
            acts["x"][:, lo:hi], p, x_prev=carry_x, state=carry_s, v_first=vf, **kw
        )
        parts.append((out, vf_out))
    assert rel_err(np.concatenate([o for o, _ in parts], axis=1), whole[0]) <= 1e-13
    assert rel_err(np.concatenate([v for _, v in parts], axis=1), whole[3]) <= 1e-13
    assert rel_err(carry_x, whole[1]) == 0.0
    assert rel_err(carry_s, whole[2]) <= 1e-13


def test_time_mix_none_carries_are_zeros():
    inputs = _tm_inputs(np.random.default_rng(6), 3, 0, {})
    acts, p = _split(inputs, TM_ACTS)
    a = time_mix_fwd_np(acts["x"], p, n_head=H, rwkv_index=0)
    b = time_mix_fwd_np(
        acts["x"], p, n_head=H, rwkv_index=0, x_prev=np.zeros((B, C)), state=np.zeros((B, H, N, N))
    )
    for u, v in zip(a[:4], b[:4], strict=True):
        np.testing.assert_array_equal(u, v)


def test_check_catches_a_wrong_time_mix_backward():
    fwd, bwd = _tm_pair(2, {})

    def wrong(cache, d):
        g = bwd(cache, d)
        g["k_a"] = g["k_a"] * 1.001
        return g

    inputs = _tm_inputs(np.random.default_rng(7), 3, 2, {})
    with pytest.raises(AssertionError, match="k_a"):
        check_grads(fwd, wrong, inputs, keys=["k_a", "x"])


def _block_inputs(rng, kind, T, rwkv_index):
    p = BLOCKS[kind][2](rng, C, H, F, rwkv_index=rwkv_index, **LOW_RANK)
    inputs = {
        "h": rng.standard_normal((B, T, C)),
        "shift_att": rng.standard_normal((B, C)),
        "state": _uniform(rng, (B, H, N, N)),
        **p,
    }
    if kind == "rwkv7":
        inputs["shift_ffn"] = rng.standard_normal((B, C))
    if rwkv_index > 0:
        inputs["v_first"] = rng.standard_normal((B, T, C))
    return inputs


def _block_pair(kind, rwkv_index):
    block_fwd, block_bwd, _ = BLOCKS[kind]

    def fwd(i):
        acts, p = _split(i, BLOCK_ACTS)
        h, carries, v_first, cache = block_fwd(
            acts["h"],
            p,
            n_head=H,
            rwkv_index=rwkv_index,
            shift_att=acts["shift_att"],
            shift_ffn=acts.get("shift_ffn"),
            state=acts["state"],
            v_first=acts.get("v_first"),
        )
        return (h, *carries, v_first), cache

    def bwd(cache, d):
        d_h, d_shift_att, d_shift_ffn, d_state, d_v_first = d
        return block_bwd(cache, d_h, d_shift_att, d_shift_ffn, d_state, d_v_first)

    return fwd, bwd


@pytest.mark.parametrize("rwkv_index", [0, 1])
@pytest.mark.parametrize("kind", list(BLOCKS))
@pytest.mark.parametrize("T", TS)
def test_block_grads(T, kind, rwkv_index):
    inputs = _block_inputs(np.random.default_rng(T + 3 * rwkv_index), kind, T, rwkv_index)
    errors = check_grads(*_block_pair(kind, rwkv_index), inputs, seed=T, eps=FD_EPS)
    assert set(errors) == set(inputs)


@pytest.mark.parametrize("rwkv_index", [0, 1])
@pytest.mark.parametrize("kind", list(BLOCKS))
def test_block_split_equals_whole(kind, rwkv_index):
    inputs = _block_inputs(np.random.default_rng(8), kind, 17, rwkv_index)
    fwd, _ = _block_pair(kind, rwkv_index)
    whole, _ = fwd(inputs)
    carries = {k: inputs.get(k) for k in ("shift_att", "shift_ffn", "state")}
    h_parts, vf_parts = [], []
    for lo, hi in [(0, 1), (1, 9), (9, 17)]:
        part = {**inputs, **carries, "h": inputs["h"][:, lo:hi]}
        if rwkv_index > 0:
            part["v_first"] = inputs["v_first"][:, lo:hi]
        (h, shift_att, shift_ffn, state, vf), _ = fwd(part)
        carries = {"shift_att": shift_att, "shift_ffn": shift_ffn, "state": state}
        h_parts.append(h)
        vf_parts.append(vf)
    assert rel_err(np.concatenate(h_parts, axis=1), whole[0]) <= 1e-13
    assert rel_err(np.concatenate(vf_parts, axis=1), whole[4]) <= 1e-13
    assert rel_err(carries["state"], whole[3]) <= 1e-13
    assert rel_err(carries["shift_att"], whole[1]) == 0.0
    if kind == "rwkv7":
        assert rel_err(carries["shift_ffn"], whole[2]) == 0.0
    else:
        assert carries["shift_ffn"] is None and whole[2] is None
