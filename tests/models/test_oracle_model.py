"""The whole-model float64 oracle (tests/oracle/model.py): its hand backward, chained through
every block's backward and the v_first accumulation, against central finite differences."""

from __future__ import annotations

import numpy as np
import pytest
from oracle.common import rel_err
from oracle.model import ModelSpec, init_model_params, model_bwd_np, model_fwd_np

B, T = 2, 9  # three MoBA chunks of 4: the last chunk's queries choose 1 of 2 earlier chunks
FD_EPS = 3e-5
# |FD - <g, u>| / (||g|| ||u||) along a random direction u, FD the five-point stencil. Measured
# <= 3.2e-7: roundoff (~1e-16 |L| / eps) against the tiny gradients of the decay lerps, and the
# kink of relu^2's second derivative at larger eps. A wrong gradient shows up at ~rel / sqrt(size).
DIR_TOL = 3e-6
SPECS = {
    # attention blocks between RWKV blocks: v_first crosses them
    "rwkv_x": ModelSpec(
        vocab_size=11, hidden_size=8, block_types=["rwkv7", "moba", "rwkv7", "rwkv7", "moba"]
    ),
    "rfa_tied": ModelSpec(
        vocab_size=11,
        hidden_size=8,
        block_types=["qwen2", "rwkv7", "qwen2", "rwkv7", "rwkv7"],
        rwkv_norm="rms",
        rwkv_ffn="swiglu",
        use_gate=False,
        use_ln_x=False,
        ln0=False,
        final_norm="rms",
        tie_embeddings=True,
    ),
}


def _setup(name, seed=0):
    spec = SPECS[name]
    rng = np.random.default_rng(seed)
    p = init_model_params(rng, spec)
    tokens = rng.integers(0, spec.vocab_size, (B, T))
    tokens[0, :3] = 5  # a repeated token: embedding gradients accumulate
    H, N = spec.n_heads, spec.head_size
    states = {
        i: 0.3 * rng.standard_normal((B, H, N, N))
        for i, kind in enumerate(spec.block_types)
        if kind == "rwkv7"
    }
    return spec, p, tokens, states, rng


def _moved(p, states, key, delta):
    """(p, states) with ``delta`` added to the parameter or initial state named ``key``."""
    p, states = dict(p), dict(states)
    if key.endswith(".state"):
        i = int(key.split(".")[1])
        states[i] = states[i] + delta
    else:
        p[key] = p[key] + delta
    return p, states


def _fourth_order_fd(f, eps):
    """f'(0) by the five-point stencil: truncation error O(eps^4)."""
    return (8 * (f(eps) - f(-eps)) - (f(2 * eps) - f(-2 * eps))) / (12 * eps)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_model_grads_vs_finite_differences(name):
    spec, p, tokens, states, rng = _setup(name)
    logits, cache = model_fwd_np(tokens, p, spec, states=states)
    sel = cache["selections"]
    if "moba" in spec.block_types:
        # the selection is sparse somewhere (not every query sees every earlier chunk)
        assert any(not m[..., 8:, :4].all() or not m[..., 8:, 4:8].all() for m in sel.values())
    d_logits = rng.standard_normal(logits.shape)
    grads = model_bwd_np(cache, d_logits)

    def loss(p_, states_):
        out, _ = model_fwd_np(tokens, p_, spec, states=states_, selections=sel)
        return float(np.sum(out * d_logits))

    wanted = set(p) | {f"layers.{i}.state" for i in states}
    assert set(grads) == wanted
    errors = {}
    for key in sorted(wanted):
        g = grads[key]
        assert np.any(g), f"vacuous: the gradient of {key} is all zero"
        for _ in range(2):
            u = rng.standard_normal(g.shape)
            fd = _fourth_order_fd(lambda s, k=key, u=u: loss(*_moved(p, states, k, s * u)), FD_EPS)
            err = abs(fd - np.sum(g * u)) / (np.linalg.norm(g) * np.linalg.norm(u))
            errors[key] = max(errors.get(key, 0.0), err)
    bad = {k: e for k, e in errors.items() if e > DIR_TOL}
    assert not bad, f"directional derivative mismatch: {bad}"


def test_model_zero_states_and_v_first_path():
    """Zero initial states equal no states; and the v_first of the first RWKV block reaches a
    later one: changing block 0's value projection changes block 2's output even when block 1
    is attention."""
    spec, p, tokens, states, _ = _setup("rwkv_x")
    zeros = {i: np.zeros_like(s) for i, s in states.items()}
    a, _ = model_fwd_np(tokens, p, spec)
    b, _ = model_fwd_np(tokens, p, spec, states=zeros)
    assert rel_err(b, a) == 0.0
    _, cache = model_fwd_np(tokens, p, spec)
    d = np.ones_like(a)
    g = model_bwd_np(cache, d)
    # block 0's value weight gets gradient through its own v and through v_first of blocks 2, 3
    p0 = dict(p)
    p0["layers.2.att.v0"] = p["layers.2.att.v0"] - 100.0  # block 2 ignores v_first (mix -> 0)
    p0["layers.3.att.v0"] = p["layers.3.att.v0"] - 100.0
    _, cache0 = model_fwd_np(tokens, p0, spec)
    g0 = model_bwd_np(cache0, d)
    assert rel_err(g0["layers.0.att.W_v"], g["layers.0.att.W_v"]) > 1e-3
