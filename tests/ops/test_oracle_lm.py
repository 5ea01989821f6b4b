"""Tests of the LM-ends oracle: embedding, head, cross-entropy, head + cross-entropy."""

from __future__ import annotations

import numpy as np
import pytest
from oracle.common import check_grads, rel_err, seeded_uniform
from oracle.lm import (
    cross_entropy_bwd_np,
    cross_entropy_fwd_np,
    embedding_bwd_np,
    embedding_fwd_np,
    head_bwd_np,
    head_cross_entropy_bwd_np,
    head_cross_entropy_fwd_np,
    head_fwd_np,
)

V, C = 11, 8


def targets_with_ignored(rng, B, T, ignore_index=-100):
    targets = rng.integers(0, V, size=(B, T))
    targets[rng.random((B, T)) < 0.3] = ignore_index
    targets[0, 0] = 3  # at least one counted token
    return targets


def test_embedding_lookup_and_scatter_add():
    emb = np.arange(V * C, dtype=np.float64).reshape(V, C)
    tokens = np.array([[2, 5, 2], [0, 2, 10]])
    out = embedding_fwd_np(emb, tokens)
    np.testing.assert_array_equal(out[1, 2], emb[10])
    d_out = np.ones((2, 3, C))
    d_emb = embedding_bwd_np(d_out, tokens, V)
    np.testing.assert_array_equal(d_emb[:, 0], [1, 0, 3, 0, 0, 1, 0, 0, 0, 0, 1])


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 17)])
def test_embedding_grads(B, T):
    rng = np.random.default_rng(T)
    tokens = rng.integers(0, 4, size=(B, T))  # few ids: repeats
    check_grads(
        lambda d: ((embedding_fwd_np(d["emb"], tokens),), None),
        lambda _, d_outs: {"emb": embedding_bwd_np(d_outs[0], tokens, V)},
        {"emb": seeded_uniform(rng, (V, C), 0.3)},
    )


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 17)])
def test_head_grads(B, T):
    rng = np.random.default_rng(T)
    inputs = {"h": rng.standard_normal((B, T, C)), "W_head": seeded_uniform(rng, (V, C), 0.3)}

    def bwd(d, d_outs):
        return dict(zip(("h", "W_head"), head_bwd_np(d["h"], d["W_head"], d_outs[0]), strict=True))

    check_grads(lambda d: ((head_fwd_np(d["h"], d["W_head"]),), d), bwd, inputs)


def test_cross_entropy_hand_value():
    logits = np.array([[[0.0, 0.0, np.log(2.0)], [5.0, 1.0, 2.0]]])  # softmax row 0: 1/4,1/4,1/2
    loss, cache = cross_entropy_fwd_np(logits, np.array([[2, -100]]))
    assert abs(loss - np.log(2.0)) <= 1e-15
    d = cross_entropy_bwd_np(cache)
    np.testing.assert_allclose(d[0, 0], [0.25, 0.25, -0.5], atol=1e-15)
    assert not np.any(d[0, 1])


def test_cross_entropy_large_logits_and_custom_ignore_index():
    logits = np.array([[[1000.0, 0.0], [0.0, 1000.0], [3.0, 3.0]]])
    loss, _ = cross_entropy_fwd_np(logits, np.array([[0, 0, -1]]), ignore_index=-1)
    assert np.isfinite(loss) and abs(loss - 500.0) <= 1e-12


def test_cross_entropy_all_ignored_is_zero():
    logits = np.random.default_rng(0).standard_normal((2, 3, V))
    loss, cache = cross_entropy_fwd_np(logits, np.full((2, 3), -100))
    assert loss == 0.0
    assert not np.any(cross_entropy_bwd_np(cache, 2.5))


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 17)])
def test_cross_entropy_grads(B, T):
    rng = np.random.default_rng(T)
    targets = targets_with_ignored(rng, B, T)
    logits = 3.0 * rng.standard_normal((B, T, V))

    def fwd(d):
        loss, cache = cross_entropy_fwd_np(d["logits"], targets)
        return (loss,), cache

    check_grads(
        fwd, lambda c, d_outs: {"logits": cross_entropy_bwd_np(c, d_outs[0])}, {"logits": logits}
    )


@pytest.mark.parametrize("B,T", [(2, 1), (2, 3), (1, 17)])
def test_head_cross_entropy_grads(B, T):
    rng = np.random.default_rng(T + 100)
    targets = targets_with_ignored(rng, B, T)
    inputs = {"h": rng.standard_normal((B, T, C)), "W_head": seeded_uniform(rng, (V, C), 2.0)}

    def fwd(d):
        loss, cache = head_cross_entropy_fwd_np(d["h"], d["W_head"], targets)
        return (loss,), cache

    def bwd(cache, d_outs):
        return dict(zip(("h", "W_head"), head_cross_entropy_bwd_np(cache, d_outs[0]), strict=True))

    check_grads(fwd, bwd, inputs)


def test_head_cross_entropy_matches_composition():
    rng = np.random.default_rng(5)
    targets = targets_with_ignored(rng, 2, 17)
    h, W = rng.standard_normal((2, 17, C)), seeded_uniform(rng, (V, C), 2.0)
    loss, cache = head_cross_entropy_fwd_np(h, W, targets)
    logits = h @ W.T
    counted = targets != -100
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    ref = -np.mean([logp[b, t, targets[b, t]] for b, t in zip(*np.nonzero(counted), strict=True)])
    assert abs(loss - ref) <= 1e-14 * abs(ref)
    dh, dW = head_cross_entropy_bwd_np(cache)
    ce_loss, ce_cache = cross_entropy_fwd_np(logits, targets)
    dh_ref, dW_ref = head_bwd_np(h, W, cross_entropy_bwd_np(ce_cache))
    assert ce_loss == loss and rel_err(dh, dh_ref) == 0.0 and rel_err(dW, dW_ref) == 0.0
    assert not np.any(dh[~counted])
