"""MoBA attention ops against the float64 oracle, the dense reference, and step-by-step decode.

The oracle gets the float32 selection (a near-tie between two gates could otherwise pick a
different chunk in float64), except in the test of the selection rule itself.
"""

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.ops import moba as M
from mlx_rwkvx.ops.dispatch import KERNEL
from mlx_rwkvx.ops.moba import blockwise

import mlx.core as mx
import numpy as np
import pytest
from oracle.attention import (
    causal_attention_fwd_np,
    moba_attention_bwd_np,
    moba_attention_fwd_np,
    moba_gates_np,
    moba_selection_np,
)
from oracle.common import rel_err

IMPLS = {"blockwise": M.moba_attention_blockwise, "ref": M.moba_attention_ref}
FWD_TOL, GRAD_TOL = 2e-6, 1e-5
# (B, T, Hq, Hkv, D, chunk_size, top_k)
CASES = {
    "sparse": (2, 33, 4, 2, 8, 4, 2),
    "T<chunk": (1, 7, 2, 2, 8, 16, 2),
    "T%chunk!=0": (1, 50, 2, 2, 16, 8, 3),
    "chunk=1": (1, 23, 4, 2, 8, 1, 3),
    "top_k=0": (1, 40, 2, 2, 8, 8, 0),
    "top_k>=chunks": (1, 40, 2, 1, 8, 8, 5),
    "gqa_one_kv": (2, 37, 4, 1, 8, 5, 1),
    "T=1": (2, 1, 2, 2, 8, 4, 2),
}


def make(case, seed=0, dtype=mx.float32):
    B, T, Hq, Hkv, D, cs, top_k = case
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal(s) for s in [(B, T, Hq, D), (B, T, Hkv, D), (B, T, Hkv, D)]]
    mx_arrays = [mx.array(x.astype(np.float32)).astype(dtype) for x in arrays]
    exact = [np.array(x.astype(mx.float32)).astype(np.float64) for x in mx_arrays]
    return exact, mx_arrays, cs, top_k


def pinned_oracle(exact, mx_arrays, cs, top_k, d_out):
    q, k, _ = mx_arrays
    sel = M.moba_selection(q, k, chunk_size=cs, top_k=top_k)
    mask = None if sel is None else np.array(M.selection_mask(sel, q.shape[1], q.shape[1], cs))
    out, cache = moba_attention_fwd_np(*exact, chunk_size=cs, top_k=top_k, selection=mask)
    return out, moba_attention_bwd_np(cache, d_out)


def check(impl, case, *, dtype=mx.float32, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL):
    exact, args, cs, top_k = make(case, dtype=dtype)
    d_out = np.random.default_rng(1).standard_normal(exact[0].shape)
    out_ref, grads_ref = pinned_oracle(exact, args, cs, top_k, d_out)
    d_mx = mx.array(d_out.astype(np.float32))

    def f(q, k, v):
        return impl(q, k, v, chunk_size=cs, top_k=top_k)

    out = f(*args)
    grads = mx.grad(lambda *a: (f(*a).astype(mx.float32) * d_mx).sum(), argnums=(0, 1, 2))(*args)
    assert out.dtype == dtype and all(g.dtype == dtype for g in grads)
    errors = {"out": rel_err(np.array(out.astype(mx.float32)), out_ref)}
    for name, g, r in zip(("dq", "dk", "dv"), grads, grads_ref, strict=True):
        errors[name] = rel_err(np.array(g.astype(mx.float32)), r)
    bad = {n: e for n, e in errors.items() if not e <= (fwd_tol if n == "out" else grad_tol)}
    assert not bad, f"norm-wise relative errors over tolerance: {bad} (all: {errors})"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES)
def test_matches_oracle(impl, case):
    check(IMPLS[impl], CASES[case])


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_low_precision_inputs(dtype):
    check(M.moba_attention_blockwise, CASES["sparse"], dtype=dtype, fwd_tol=2e-2, grad_tol=5e-2)


def test_larger_blockwise():
    check(M.moba_attention_blockwise, (1, 300, 4, 2, 32, 16, 3))


def test_selection_rule_matches_oracle_without_near_ties():
    exact, (q, k, _), cs, top_k = make((2, 60, 4, 2, 8, 6, 3), seed=3)
    gates = moba_gates_np(exact[0], exact[1], chunk_size=cs)
    earlier = np.sort(gates[..., : 60 // cs], axis=-1)
    assert np.min(np.diff(earlier, axis=-1)) > 1e-6  # no near-tie: float32 ranks as float64
    sel = M.moba_selection(q, k, chunk_size=cs, top_k=top_k)
    ours = np.array(M.selection_mask(sel, 60, 60, cs))
    assert np.array_equal(ours, moba_selection_np(exact[0], exact[1], chunk_size=cs, top_k=top_k))


def test_ties_go_to_the_lower_chunk():
    # chunks 0 and 2 have the same keys, so the same mean: equal gates for every query
    cs, D = 4, 8
    rng = np.random.default_rng(0)
    k = rng.standard_normal((1, 16, 1, D))
    k[:, 8:12] = k[:, 0:4]
    q = np.abs(rng.standard_normal((1, 16, 1, D)))
    k[:, 4:8] = -np.abs(k[:, 4:8])  # chunk 1 scores low
    k[:, 0:4] = np.abs(k[:, 0:4])
    k[:, 8:12] = k[:, 0:4]
    idx, valid = M.moba_selection(mx.array(q), mx.array(k), chunk_size=cs, top_k=1)
    assert np.array(idx)[0, 12:, 0, 0].tolist() == [0, 0, 0, 0]
    assert np.array(valid)[0, 12:].all()
    oracle = moba_selection_np(q, k, chunk_size=cs, top_k=1)
    ours = np.array(M.selection_mask((idx, valid), 16, 16, cs))
    assert np.array_equal(ours, oracle)


@pytest.mark.parametrize("top_k", [0, 3, 100])
def test_full_coverage_is_dense_causal_attention(top_k):
    # top_k <= 0 or >= the number of earlier chunks: plain causal attention
    exact, args, cs, _ = make((1, 24, 2, 2, 8, 8, top_k))
    dense, _ = causal_attention_fwd_np(*exact)
    out = M.moba_attention_blockwise(*args, chunk_size=cs, top_k=top_k)
    assert rel_err(np.array(out), dense) <= FWD_TOL


def test_blockwise_equals_dense_reference_on_a_larger_case():
    _, args, _, _ = make((1, 200, 4, 2, 16, 16, 2), seed=5)
    a = M.moba_attention_blockwise(*args, chunk_size=16, top_k=2)
    b = M.moba_attention_ref(*args, chunk_size=16, top_k=2)
    assert rel_err(np.array(a), np.array(b)) <= FWD_TOL


@pytest.mark.parametrize("case", ["sparse", "top_k=0", "top_k>=chunks", "chunk=1", "T<chunk"])
def test_decode_step_by_step_equals_full_forward(case):
    _, (q, k, v), cs, top_k = make(CASES[case], seed=7)
    full = M.moba_attention_blockwise(q, k, v, chunk_size=cs, top_k=top_k)
    B, _, Hkv, D = k.shape
    cache = M.empty_kv(B, Hkv, D, k.dtype)
    outs = []
    for t in range(q.shape[1]):
        cache = M.append_kv(*cache, k[:, t : t + 1], v[:, t : t + 1], cs)
        outs.append(M.moba_decode(q[:, t : t + 1], *cache, chunk_size=cs, top_k=top_k))
    assert rel_err(np.array(mx.concatenate(outs, axis=1)), np.array(full)) <= FWD_TOL


def test_prefill_in_pieces_equals_one_prefill():
    _, (q, k, v), cs, top_k = make((1, 45, 4, 2, 8, 4, 2), seed=2)
    full = M.moba_attention_blockwise(q, k, v, chunk_size=cs, top_k=top_k)
    cache = M.empty_kv(1, 2, 8, k.dtype)
    outs = []
    for start, stop in [(0, 3), (3, 20), (20, 21), (21, 45)]:
        cache = M.append_kv(*cache, k[:, start:stop], v[:, start:stop], cs)
        keys, values = M.time_major(cache[0]), M.time_major(cache[1])
        outs.append(M.moba_attention(q[:, start:stop], keys, values, chunk_size=cs, top_k=top_k))
    assert rel_err(np.array(mx.concatenate(outs, axis=1)), np.array(full)) <= FWD_TOL
    assert rel_err(np.array(M.time_major(cache[0])), np.array(k)) == 0.0
    # every chunk's key sum, the last partial one included, equals a sum over the keys
    sums = np.array(cache[2])  # [B, Hkv, n_chunks, D]
    keys = np.array(k.astype(mx.float32))
    for c in range(sums.shape[2]):
        want = keys[:, c * cs : (c + 1) * cs].sum(axis=1)  # [B, Hkv, D]
        assert np.allclose(sums[:, :, c], want, atol=1e-5)


def test_dispatcher_env(monkeypatch):
    _, args, cs, top_k = make(CASES["sparse"])
    for choice, impl in IMPLS.items():
        monkeypatch.setenv(M.ENV_VAR, choice)
        out = M.moba_attention(*args, chunk_size=cs, top_k=top_k)
        assert mx.array_equal(out, impl(*args, chunk_size=cs, top_k=top_k))
    monkeypatch.setenv(M.ENV_VAR, "dense")
    with pytest.raises(ValueError, match="MLX_RWKVX_MOBA='dense'"):
        M.moba_attention(*args, chunk_size=cs, top_k=top_k)


BAD = [
    (dict(chunk_size=0), "chunk_size must be an int >= 1"),
    (dict(chunk_size=2.5), "chunk_size must be an int >= 1"),
    (dict(q=(1, 8, 3, 8)), "q has 3 heads, not a multiple of the 2 heads"),
    (dict(k=(1, 8, 2, 4)), "k has shape \\(1, 8, 2, 4\\), expected \\[1, S >= 8, Hkv >= 1, 8\\]"),
    (dict(v=(1, 8, 1, 8)), "v has shape \\(1, 8, 1, 8\\), expected"),
    (dict(k=(1, 5, 2, 8), v=(1, 5, 2, 8)), "k has shape \\(1, 5, 2, 8\\)"),
    (dict(dtype_k=mx.float16), "k has dtype mlx.core.float16, expected mlx.core.float32"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_arguments(impl, case):
    change, message = BAD[case]
    shapes = {"q": (1, 8, 4, 8), "k": (1, 8, 2, 8), "v": (1, 8, 2, 8)}
    shapes.update({n: s for n, s in change.items() if n in shapes})
    q, k, v = (mx.zeros(shapes[n]) for n in ("q", "k", "v"))
    if "dtype_k" in change:
        k = k.astype(change["dtype_k"])
    with pytest.raises(ValueError, match=message):
        IMPLS[impl](q, k, v, chunk_size=change.get("chunk_size", 4), top_k=2)


def test_forcing_a_missing_kernel_is_an_error(monkeypatch):
    _, args, cs, top_k = make(CASES["sparse"])
    monkeypatch.setenv(M.ENV_VAR, "kernel")
    monkeypatch.setattr(M.DISPATCH, "kernels", lambda key=None: ())
    with pytest.raises(
        UserError, match="moba: MLX_RWKVX_[A-Z0-9]+='kernel', but .* no moba kernel"
    ):
        M.moba_attention(*args, chunk_size=cs, top_k=top_k)
    monkeypatch.delenv(M.ENV_VAR)
    with pytest.raises(UserError, match="moba: impl='kernel', but this device has no"):
        M.moba_attention(*args, chunk_size=cs, top_k=top_k, impl="kernel")


def test_kernel_self_check(monkeypatch):
    # a kernel that is wrong on this device is dropped after one warning; a right one is used
    import warnings

    _, args, cs, top_k = make(CASES["sparse"])
    monkeypatch.delenv(M.ENV_VAR, raising=False)
    monkeypatch.setattr(M.DISPATCH, "kernels", lambda key=None: (KERNEL,))
    used = []

    def wrong(q, k, v, chunk_size, top_k, scale=None):
        used.append("wrong")
        return blockwise.attention(q, k, v, chunk_size, top_k, scale) * 1.01

    monkeypatch.setattr(M.DISPATCH, "impls", {**M.DISPATCH.impls, KERNEL: wrong})
    monkeypatch.setattr(M.DISPATCH, "results", {})
    with pytest.warns(RuntimeWarning, match="moba kernel .* disagrees with the blockwise path"):
        out = M.moba_attention(*args, chunk_size=cs, top_k=top_k)
    assert mx.array_equal(out, M.moba_attention_blockwise(*args, chunk_size=cs, top_k=top_k))
    used.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        M.moba_attention(*args, chunk_size=cs, top_k=top_k)
    assert not used

    def right(q, k, v, chunk_size, top_k, scale=None):
        used.append("right")
        return blockwise.attention(q, k, v, chunk_size, top_k, scale)

    monkeypatch.setattr(M.DISPATCH, "impls", {**M.DISPATCH.impls, KERNEL: right})
    monkeypatch.setattr(M.DISPATCH, "results", {})
    M.moba_attention(*args, chunk_size=cs, top_k=top_k)
    assert used and M.DISPATCH.results == {(KERNEL, (8, mx.float32)): True}


@pytest.mark.parametrize("case", ["sparse", "top_k=0", "T%chunk!=0"])
def test_under_compile_equals_eager(case):
    # forward and gradients of the compiled op equal the eager ones
    _, args, cs, top_k = make(CASES[case], seed=3)

    def loss(q, k, v):
        out = M.moba_attention(q, k, v, chunk_size=cs, top_k=top_k)
        return (out * out).sum()

    grad = mx.value_and_grad(loss, argnums=(0, 1, 2))
    eager_loss, eager_grads = grad(*args)
    comp_loss, comp_grads = mx.compile(grad)(*args)
    assert abs(comp_loss.item() - eager_loss.item()) <= 1e-6 * abs(eager_loss.item())
    for name, a, b in zip("qkv", comp_grads, eager_grads, strict=True):
        assert rel_err(np.array(a), np.array(b)) <= 1e-6, name


def test_argument_checks_run_once_per_call(monkeypatch):
    checks = []
    real = M.check_inputs
    monkeypatch.setattr(M, "check_inputs", lambda *a: checks.append(1) or real(*a))
    _, args, cs, top_k = make(CASES["sparse"])
    M.moba_attention(*args, chunk_size=cs, top_k=top_k)
    assert checks == [1]
