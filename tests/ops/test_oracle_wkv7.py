"""The float64 WKV7 oracle: step loop vs closed form, split calls, hand backward vs finite
differences."""

import numpy as np
import pytest
from oracle.common import check_grads, rel_err
from oracle.wkv7 import (
    WKV7_INPUTS,
    random_wkv7_inputs,
    wkv7_bwd_np,
    wkv7_bwd_np_flat,
    wkv7_fwd_np,
    wkv7_np,
    wkv7_unrolled_np,
)

B, H, N = 2, 2, 4
# Central-difference step. At decay 1e-4 the log_w gradient (scaled by w) is ~1e-4 of the loss's
# scale, so roundoff (~1e-16 |L| / eps) dominates its error: 6e-7 at eps 1e-5, 6e-8 at 1e-4. The
# loss is polynomial in everything but log_w (smooth exp), so truncation (~eps^2) stays ~1e-11.
FD_EPS = 1e-4
DECAY_RANGES = {
    "default": (0.5, 0.999),
    "near_one": (0.9999, 0.9999),
    "tiny": (1e-4, 1e-4),
    "mixed": (1e-4, 0.9999),
}


def _args(inputs):
    return [inputs[name] for name in WKV7_INPUTS]


def test_hand_computed_scalar_case():
    # H = N = 1: S_t = S_{t-1} (w_t + a_t b_t) + v_t k_t, y_t = S_t r_t.
    r, w, k, v, a, b = (
        np.array(x, dtype=np.float64).reshape(1, 2, 1, 1)
        for x in ([2.0, -1.0], [0.5, 0.25], [1.0, 3.0], [4.0, 2.0], [-0.5, 1.0], [0.2, 0.5])
    )
    s0 = np.full((1, 1, 1, 1), 10.0)
    s1 = 10.0 * (0.5 - 0.1) + 4.0
    s2 = s1 * (0.25 + 0.5) + 6.0
    y, s = wkv7_np(r, np.log(w), k, v, a, b, s0)
    np.testing.assert_allclose(y.ravel(), [2.0 * s1, -1.0 * s2], rtol=1e-14)
    np.testing.assert_allclose(s.ravel(), [s2], rtol=1e-14)


@pytest.mark.parametrize("decays", list(DECAY_RANGES))
@pytest.mark.parametrize("T", [1, 3, 17])
def test_step_loop_matches_unrolled(T, decays):
    inputs = random_wkv7_inputs(
        np.random.default_rng(T), B, T, H, N, decay_range=DECAY_RANGES[decays]
    )
    y, s = wkv7_np(*_args(inputs), inputs["state"])
    y_ref, s_ref = wkv7_unrolled_np(*_args(inputs), inputs["state"])
    assert rel_err(y, y_ref) <= 1e-12
    assert rel_err(s, s_ref) <= 1e-12


@pytest.mark.parametrize("T", [1, 3, 17])
def test_state_none_is_zeros(T):
    inputs = random_wkv7_inputs(np.random.default_rng(1), B, T, H, N, with_state=False)
    assert not np.any(inputs["state"])
    y0, s0 = wkv7_np(*_args(inputs), None)
    y1, s1 = wkv7_np(*_args(inputs), inputs["state"])
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(s0, s1)
    dy = np.random.default_rng(2).standard_normal(y0.shape)
    g0 = wkv7_bwd_np(*_args(inputs), None, dy, None)
    g1 = wkv7_bwd_np(*_args(inputs), inputs["state"], dy, np.zeros_like(s0))
    for name in g0:
        np.testing.assert_array_equal(g0[name], g1[name])


@pytest.mark.parametrize("split", [1, 7, 16])
def test_split_in_two_calls_equals_one(split):
    inputs = random_wkv7_inputs(np.random.default_rng(3), B, 17, H, N)
    y, s = wkv7_np(*_args(inputs), inputs["state"])
    head = [x[:, :split] for x in _args(inputs)]
    tail = [x[:, split:] for x in _args(inputs)]
    y1, s1 = wkv7_np(*head, inputs["state"])
    y2, s2 = wkv7_np(*tail, s1)
    assert rel_err(np.concatenate([y1, y2], axis=1), y) <= 1e-13
    assert rel_err(s2, s) <= 1e-13


@pytest.mark.parametrize("decays", list(DECAY_RANGES))
@pytest.mark.parametrize("T", [1, 3, 17])
def test_grads_with_state_and_final_state_cotangent(T, decays):
    inputs = random_wkv7_inputs(
        np.random.default_rng(10 + T), B, T, H, N, decay_range=DECAY_RANGES[decays]
    )
    errors = check_grads(wkv7_fwd_np, wkv7_bwd_np_flat, inputs, seed=T, eps=FD_EPS)
    assert set(errors) == {*WKV7_INPUTS, "state"}


@pytest.mark.parametrize("T", [1, 3, 17])
def test_grads_without_final_state_cotangent(T):
    inputs = random_wkv7_inputs(np.random.default_rng(20 + T), B, T, H, N)

    def fwd(x):
        (y, _), cache = wkv7_fwd_np(x)
        return (y,), cache

    def bwd(cache, d_outs):
        return wkv7_bwd_np_flat(cache, (d_outs[0], None))

    check_grads(fwd, bwd, inputs, seed=T, eps=FD_EPS)


def test_check_catches_a_wrong_backward():
    inputs = random_wkv7_inputs(np.random.default_rng(4), 1, 3, 1, N)

    def swapped(cache, d_outs):
        g = wkv7_bwd_np_flat(cache, d_outs)
        g["a"], g["b"] = g["b"], g["a"]
        return g

    with pytest.raises(AssertionError, match="gradient mismatch"):
        check_grads(wkv7_fwd_np, swapped, inputs, eps=FD_EPS)
