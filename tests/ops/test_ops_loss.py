"""The fused head + cross-entropy against the float64 oracle: loss and both gradients, with
ignored tokens, a vocabulary that is not a multiple of the block, bf16 inputs, a quantized head
(against MLX's dense loss over its dequantized weights), and under mx.compile."""

import mlx_rwkvx.ops as ops

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from oracle.common import rel_err
from oracle.lm import head_cross_entropy_bwd_np, head_cross_entropy_fwd_np

FWD_TOL, GRAD_TOL = 2e-6, 1e-5  # DESIGN.md, float32 ops
IGNORE = -100


def _case(B=2, T=9, C=16, V=50, seed=0, ignored=3):
    rng = np.random.default_rng(seed)
    h = rng.standard_normal((B, T, C))
    W = 0.5 * rng.standard_normal((V, C))
    targets = rng.integers(0, V, (B, T))
    flat = targets.reshape(-1)
    flat[rng.choice(flat.size, ignored, replace=False)] = IGNORE
    return h, W, flat.reshape(B, T)


def _ours(h, W, targets, dtype=mx.float32, block=16):
    hm, Wm = mx.array(h.astype(np.float32)).astype(dtype), mx.array(W.astype(np.float32))
    tm = mx.array(targets)

    def loss(h_, W_):
        total, count = ops.cross_entropy_head(h_, W_, tm, ignore_index=IGNORE, block=block)
        return total

    total, count = ops.cross_entropy_head(hm, Wm, tm, ignore_index=IGNORE, block=block)
    dh, dW = mx.grad(loss, argnums=(0, 1))(hm, Wm)
    return total.item(), count.item(), dh, dW


@pytest.mark.parametrize("block", [16, 50, 7, 4096])
def test_matches_oracle(block):
    h, W, targets = _case()
    total, count, dh, dW = _ours(h, W, targets, block=block)
    want, cache = head_cross_entropy_fwd_np(h, W, targets, IGNORE)
    n = int((targets != IGNORE).sum())
    assert count == n
    assert abs(total / count - want) <= FWD_TOL * abs(want)
    # the op returns the sum: its gradients are the mean's times the count
    dh_ref, dW_ref = head_cross_entropy_bwd_np(cache, float(n))
    assert rel_err(np.array(dh), dh_ref) <= GRAD_TOL
    assert rel_err(np.array(dW), dW_ref) <= GRAD_TOL


def test_bf16_hidden_states():
    h, W, targets = _case(seed=1)
    total, count, dh, dW = _ours(h, W, targets, dtype=mx.bfloat16)
    assert dh.dtype == mx.bfloat16
    hb = np.array(mx.array(h.astype(np.float32)).astype(mx.bfloat16).astype(mx.float32))
    want, cache = head_cross_entropy_fwd_np(hb.astype(np.float64), W, targets, IGNORE)
    dh_ref, dW_ref = head_cross_entropy_bwd_np(cache, float(count))
    assert abs(total / count - want) <= 2e-2 * abs(want)  # DESIGN.md, bf16 inputs
    assert rel_err(np.array(dh.astype(mx.float32)), dh_ref) <= 5e-2
    assert rel_err(np.array(dW), dW_ref) <= 5e-2


def test_nothing_counted():
    h, W, targets = _case()
    total, count, dh, dW = _ours(h, W, np.full_like(targets, IGNORE))
    assert total == 0.0 and count == 0
    assert not np.any(np.array(dh)) and not np.any(np.array(dW))


def test_quantized_head():
    # a frozen INT8 head: the loss and dh equal MLX's dense loss over the dequantized weights
    h, W, targets = _case(C=64, V=300, seed=3)
    q = nn.QuantizedLinear.from_linear(_linear(W), group_size=64, bits=8)
    hm, tm = mx.array(h.astype(np.float32)), mx.array(targets)

    def fused(h_):
        total, _ = ops.cross_entropy_head(
            h_, q.weight, tm, scales=q.scales, biases=q.biases, bits=8, block=128
        )
        return total

    def dense(h_):
        logits = q(h_)
        counted = tm != IGNORE
        ce = nn.losses.cross_entropy(logits, mx.where(counted, tm, 0), reduction="none")
        return mx.where(counted, ce, 0.0).sum()

    assert abs(fused(hm).item() - dense(hm).item()) <= FWD_TOL * abs(dense(hm).item())
    assert rel_err(np.array(mx.grad(fused)(hm)), np.array(mx.grad(dense)(hm))) <= GRAD_TOL


def _linear(W):
    layer = nn.Linear(W.shape[1], W.shape[0], bias=False)
    layer.weight = mx.array(W.astype(np.float32))
    return layer


def test_under_compile_equals_eager():
    h, W, targets = _case(seed=4)
    hm, Wm, tm = mx.array(h.astype(np.float32)), mx.array(W.astype(np.float32)), mx.array(targets)

    def loss(h_, W_):
        return ops.cross_entropy_head(h_, W_, tm, ignore_index=IGNORE, block=16)[0]

    grad = mx.value_and_grad(loss, argnums=(0, 1))
    (a, ga), (b, gb) = grad(hm, Wm), mx.compile(grad)(hm, Wm)
    assert abs(a.item() - b.item()) <= 1e-6 * abs(a.item())
    for x, y in zip(ga, gb, strict=True):
        assert rel_err(np.array(x), np.array(y)) <= 1e-6


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(targets=mx.zeros((2, 8), dtype=mx.int32)), "targets must be integers of shape"),
        (dict(targets=mx.zeros((2, 9))), "targets must be integers"),
        (dict(weight=mx.zeros((50, 8))), r"weight has shape \(50, 8\), expected \[V, 16\]"),
        (dict(h=mx.zeros((2, 9, 16), dtype=mx.int32)), "h has dtype"),
        (dict(block=0), "block must be an int >= 1"),
        (dict(bits=8), "needs its scales and biases"),
    ],
)
def test_bad_arguments(change, message):
    args = dict(
        h=mx.zeros((2, 9, 16)), weight=mx.zeros((50, 16)), targets=mx.zeros((2, 9), mx.int32)
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        ops.cross_entropy_head(args.pop("h"), args.pop("weight"), args.pop("targets"), **args)
