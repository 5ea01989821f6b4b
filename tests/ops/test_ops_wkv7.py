"""WKV7 ops against the float64 oracle: outputs, final state and all seven gradients.

The kernel's CPU flavour passes the same checks in tests/ops/test_kernels_wkv7.py.
"""

import importlib
import warnings

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.ops.dispatch import KERNEL

import mlx.core as mx
import numpy as np
import pytest
from oracle.common import rel_err
from oracle.wkv7 import WKV7_INPUTS, random_wkv7_inputs, wkv7_bwd_np, wkv7_np

# the package (``mlx_rwkvx.ops.wkv7`` as an attribute is the op itself)
W = importlib.import_module("mlx_rwkvx.ops.wkv7")
IMPLS = {"ref": W.wkv7_ref, "chunked": W.wkv7_chunked}
FWD_TOL, GRAD_TOL = 2e-6, 1e-5  # DESIGN.md, float32 ops
LOW_TOL = {"fwd": 2e-2, "grad": 5e-2}  # DESIGN.md, bf16/fp16 inputs
DECAYS = {
    "typical": (0.5, 0.999),
    "wide": (1e-4, 0.9999),
    "near_one": (0.9999, 0.9999),
}


def to_mx(inputs: dict, dtype=mx.float32) -> list:
    """The seven arguments of wkv7 from an oracle input dict (log_w and state stay float32)."""
    args = [
        mx.array(inputs[n].astype(np.float32)).astype(mx.float32 if n == "log_w" else dtype)
        for n in WKV7_INPUTS
    ]
    return args + [mx.array(inputs["state"].astype(np.float32))]


def as_f64(x: mx.array) -> np.ndarray:
    return np.array(x.astype(mx.float32)).astype(np.float64)


def run(impl, args, dy, d_state):
    """Outputs and the gradients of <dy, y> + <d_state, state_out> w.r.t. all seven inputs."""
    dy_mx = mx.array(dy.astype(np.float32))
    ds_mx = mx.array(d_state.astype(np.float32))

    def loss(*xs):
        y, s = impl(*xs)
        return (y.astype(mx.float32) * dy_mx).sum() + (s * ds_mx).sum()

    y, s = impl(*args)
    grads = mx.grad(loss, argnums=list(range(7)))(*args)
    return y, s, dict(zip((*WKV7_INPUTS, "state"), grads, strict=True))


def compare(impl, inputs, seed, *, fwd_tol, grad_tol, dtype=mx.float32, grad_tols=None):
    rng = np.random.default_rng(seed)
    args = to_mx(inputs, dtype)
    # the oracle sees exactly the (possibly rounded) numbers the op sees
    exact = {n: as_f64(x) for n, x in zip((*WKV7_INPUTS, "state"), args, strict=True)}
    y_ref, s_ref = wkv7_np(*(exact[n] for n in WKV7_INPUTS), exact["state"])
    dy = rng.standard_normal(y_ref.shape)
    d_state = rng.standard_normal(s_ref.shape)
    g_ref = wkv7_bwd_np(*(exact[n] for n in WKV7_INPUTS), exact["state"], dy, d_state)
    y, s, g = run(impl, args, dy, d_state)
    assert y.dtype == dtype and s.dtype == mx.float32
    errors = {"y": rel_err(as_f64(y), y_ref), "state_out": rel_err(as_f64(s), s_ref)}
    bad = {k: e for k, e in errors.items() if not e <= fwd_tol}
    for name in g_ref:
        assert g[name].dtype == args[(*WKV7_INPUTS, "state").index(name)].dtype
        errors[f"d{name}"] = e = rel_err(as_f64(g[name]), g_ref[name])
        tol = (grad_tols or {}).get(name, grad_tol)
        if not e <= tol:
            bad[f"d{name}"] = e
    assert not bad, f"norm-wise relative errors over tolerance: {bad} (all: {errors})"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("T", [1, 17, 63, 100])
@pytest.mark.parametrize("decays", DECAYS)
def test_matches_oracle(impl, T, decays):
    rng = np.random.default_rng(T)
    inputs = random_wkv7_inputs(rng, 2, T, 2, 16, decay_range=DECAYS[decays])
    compare(IMPLS[impl], inputs, T + 1, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL)


@pytest.mark.parametrize("N", [32, 64, 128])
def test_head_sizes_chunked(N):
    inputs = random_wkv7_inputs(np.random.default_rng(N), 1, 40, 2, N, decay_range=(1e-4, 0.9999))
    compare(W.wkv7_chunked, inputs, 0, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL)


@pytest.mark.parametrize("decays", DECAYS)
def test_long_sequence_chunked(decays):
    rng = np.random.default_rng(7)
    inputs = random_wkv7_inputs(rng, 1, 1000, 2, 64, decay_range=DECAYS[decays])
    compare(W.wkv7_chunked, inputs, 1, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL)


@pytest.mark.slow
def test_long_sequence_ref():
    inputs = random_wkv7_inputs(np.random.default_rng(7), 1, 1000, 2, 16)
    compare(W.wkv7_ref, inputs, 1, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL)


@pytest.mark.parametrize("impl", IMPLS)
def test_all_decays_tiny(impl):
    # With every decay at 1e-4, dL/dlog_w = w * (...) is ~1e-4 of the other gradients. The
    # chunked path gets it as a reverse cumulative sum of terms that cancel to that size, so its
    # float32 rounding (~1e-7 of the other gradients) is ~1e-3 of dlog_w: a looser bound for
    # that one tensor there. The step loop and the kernel (tests/ops/test_kernels_wkv7.py) have no
    # such cancellation. Decays of RWKV-7 models are >= exp(-exp(-0.5)) = 0.545.
    inputs = random_wkv7_inputs(np.random.default_rng(3), 2, 40, 2, 16, decay_range=(1e-4, 1e-4))
    tols = {"log_w": 1e-2} if impl == "chunked" else None
    compare(IMPLS[impl], inputs, 2, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, grad_tols=tols)


@pytest.mark.parametrize("L", [32, 64])
@pytest.mark.parametrize("decays", ["wide", "any"])
def test_other_chunk_lengths(monkeypatch, L, decays):
    # the chunk lengths the benchmark compares: 4 and 8 sub-blocks per chunk (the off-diagonal
    # blocks of non-adjacent sub-blocks take the factor between them), ragged T
    monkeypatch.setattr(importlib.import_module("mlx_rwkvx.ops.wkv7.chunk"), "CHUNK", L)
    rng = np.random.default_rng(L)
    inputs = random_wkv7_inputs(rng, 1, 2 * L + 5, 2, 16, decay_range=DECAYS["wide"])
    tols = None
    if decays == "any":
        inputs["log_w"] = rng.uniform(-80.0, 0.0, inputs["log_w"].shape)
        # dlog_w's known limit with tiny decays (ops/wkv7/README.md): a chunk of 64 sums more
        # cancelling terms: 1.3e-5 here
        tols = {"log_w": 3e-5}
    compare(W.wkv7_chunked, inputs, L, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL, grad_tols=tols)


@pytest.mark.parametrize("L", [16, 32, 64])
def test_correlated_keys(monkeypatch, L):
    # keys pointing alike and in-context learning rates near 1 make A_ab's entries near -1:
    # (I - A_ab)^-1 must not form high powers of A, whose entries grow binomially and cancel
    monkeypatch.setattr(importlib.import_module("mlx_rwkvx.ops.wkv7.chunk"), "CHUNK", L)
    rng = np.random.default_rng(L)
    T, N = 2 * L + 5, 16
    inputs = random_wkv7_inputs(rng, 1, T, 2, N, decay_range=(0.99, 0.9999))
    kk = rng.standard_normal((1, 1, 2, N)) + 0.4 * rng.standard_normal((1, T, 2, N))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    inputs["a"], inputs["b"] = -kk, kk * rng.uniform(0.9, 1.0, kk.shape)
    compare(W.wkv7_chunked, inputs, L, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL)


def test_any_decay_is_safe():
    # decays down to 1e-35 per step: LOG_W_MIN (1.1e-7) keeps every factor finite, and what the
    # state keeps of itself differs by less than 1.1e-7, below float32 resolution; outputs and
    # every gradient stay within the float32 bounds of the oracle
    rng = np.random.default_rng(11)
    inputs = random_wkv7_inputs(rng, 1, 70, 2, 16)
    inputs["log_w"] = rng.uniform(-80.0, 0.0, inputs["log_w"].shape)
    compare(W.wkv7_chunked, inputs, 12, fwd_tol=FWD_TOL, grad_tol=GRAD_TOL)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_low_precision_inputs(impl, dtype):
    inputs = random_wkv7_inputs(np.random.default_rng(5), 2, 33, 2, 16)
    compare(IMPLS[impl], inputs, 4, fwd_tol=LOW_TOL["fwd"], grad_tol=LOW_TOL["grad"], dtype=dtype)


def test_chunk_boundaries_and_split_sequences():
    # T around the chunk length, and a sequence run in pieces (state carried) equals one call
    rng = np.random.default_rng(9)
    L = W.CHUNK
    inputs = random_wkv7_inputs(rng, 1, 3 * L + 1, 2, 16)
    args = to_mx(inputs)
    y_all, s_all = W.wkv7_chunked(*args)
    state = args[6]
    pieces = []
    for start, stop in [(0, L - 1), (L - 1, L + 1), (L + 1, 3 * L), (3 * L, 3 * L + 1)]:
        y, state = W.wkv7_chunked(*(x[:, start:stop] for x in args[:6]), state)
        pieces.append(y)
    assert rel_err(as_f64(mx.concatenate(pieces, axis=1)), as_f64(y_all)) <= FWD_TOL
    assert rel_err(as_f64(state), as_f64(s_all)) <= FWD_TOL


def test_state_none_is_zeros():
    inputs = random_wkv7_inputs(np.random.default_rng(1), 1, 20, 2, 16)
    args = to_mx(inputs)
    zeros = mx.zeros_like(args[6])
    for impl in IMPLS.values():
        y0, s0 = impl(*args[:6])
        y1, s1 = impl(*args[:6], zeros)
        assert mx.array_equal(y0, y1) and mx.array_equal(s0, s1)


def test_step_equals_sequence():
    inputs = random_wkv7_inputs(np.random.default_rng(2), 2, 5, 2, 16)
    args = to_mx(inputs)
    y_all, s_all = W.wkv7_chunked(*args)
    state = args[6]
    for t in range(5):
        y, state = W.wkv7_step(*(x[:, t] for x in args[:6]), state)
        assert rel_err(as_f64(y), as_f64(y_all[:, t])) <= FWD_TOL
    assert rel_err(as_f64(state), as_f64(s_all)) <= FWD_TOL


def test_dispatcher_env_and_impl(monkeypatch):
    inputs = random_wkv7_inputs(np.random.default_rng(4), 1, 20, 2, 16)
    args = to_mx(inputs)
    for choice in ("ref", "chunked"):
        monkeypatch.setenv(W.ENV_VAR, choice)
        y, _ = W.wkv7(*args)
        assert mx.array_equal(y, IMPLS[choice](*args)[0])
        monkeypatch.delenv(W.ENV_VAR)
        y, _ = W.wkv7(*args, impl=choice)  # the argument, no environment needed
        assert mx.array_equal(y, IMPLS[choice](*args)[0])
    monkeypatch.setenv(W.ENV_VAR, "fast")
    with pytest.raises(ValueError, match="MLX_RWKVX_WKV7='fast'"):
        W.wkv7(*args)
    with pytest.raises(ValueError, match="impl='fast'"):
        W.wkv7(*args, impl="fast")


def _recording(monkeypatch, names):
    calls = []
    impls = dict(W.DISPATCH.impls)
    for name in names:
        impl = impls[name]
        impls[name] = lambda *xs, impl=impl, name=name: calls.append(name) or impl(*xs)
    monkeypatch.setattr(W.DISPATCH, "impls", impls)
    return calls


def test_dispatcher_default_choice(monkeypatch):
    monkeypatch.delenv(W.ENV_VAR, raising=False)
    monkeypatch.setattr(W.DISPATCH, "kernels", lambda key=None: ())
    calls = _recording(monkeypatch, ["ref", "chunked"])
    for T in (1, W.REF_MAX_T, W.REF_MAX_T + 1, 40):
        W.wkv7(*to_mx(random_wkv7_inputs(np.random.default_rng(T), 1, T, 2, 16)))
    assert calls == ["ref", "ref", "chunked", "chunked"]


def test_argument_checks_run_once_per_call(monkeypatch):
    checks = []
    real = W.check_inputs
    monkeypatch.setattr(W, "check_inputs", lambda *a: checks.append(1) or real(*a))
    W.wkv7(*to_mx(random_wkv7_inputs(np.random.default_rng(1), 1, 40, 2, 16)))
    assert checks == [1]


def test_forcing_a_missing_kernel_is_an_error(monkeypatch):
    monkeypatch.setenv(W.ENV_VAR, "kernel")
    monkeypatch.setattr(W.DISPATCH, "kernels", lambda key=None: ())
    args = to_mx(random_wkv7_inputs(np.random.default_rng(0), 1, 5, 2, 16))
    with pytest.raises(
        UserError, match="wkv7: MLX_RWKVX_[A-Z0-9]+='kernel', but .* no wkv7 kernel"
    ):
        W.wkv7(*args)


def _with_kernel(monkeypatch, kernel):
    """The dispatcher as on a device with ``kernel``, nothing checked yet."""
    monkeypatch.delenv(W.ENV_VAR, raising=False)
    monkeypatch.setattr(W.DISPATCH, "kernels", lambda key=None: (KERNEL,))
    monkeypatch.setattr(W.DISPATCH, "impls", {**W.DISPATCH.impls, KERNEL: kernel})
    monkeypatch.setattr(W.DISPATCH, "results", {})


def test_kernel_failing_self_check_falls_back_with_one_warning(monkeypatch):
    def wrong_kernel(r, log_w, k, v, a, b, state=None):
        y, s = W.wkv7_chunked(r, log_w, k, v, a, b, state)
        return y * 1.01, s

    _with_kernel(monkeypatch, wrong_kernel)
    args = to_mx(random_wkv7_inputs(np.random.default_rng(0), 1, 40, 2, 16))
    with pytest.warns(RuntimeWarning, match="disagrees with the chunked path"):
        y, _ = W.wkv7(*args)
    assert mx.array_equal(y, W.wkv7_chunked(*args)[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        W.wkv7(*args)  # decided once: no second warning


def test_kernel_passing_self_check_is_used(monkeypatch):
    used = []

    def good_kernel(*xs):
        used.append(True)
        return W.wkv7_chunked(*xs)

    _with_kernel(monkeypatch, good_kernel)
    W.wkv7(*to_mx(random_wkv7_inputs(np.random.default_rng(0), 1, 3, 2, 16)))
    assert used and W.DISPATCH.results == {(KERNEL, (16, mx.float32)): True}


def test_prepare_runs_the_self_checks_up_front(monkeypatch):
    from mlx_rwkvx.ops import prepare

    def wrong_kernel(r, log_w, k, v, a, b, state=None):
        y, s = W.wkv7_chunked(r, log_w, k, v, a, b, state)
        return y, s * 0.5

    _with_kernel(monkeypatch, wrong_kernel)
    with pytest.warns(RuntimeWarning, match="disagrees"):
        report = prepare(head_sizes=(16,), dtypes=(mx.float32,))
    assert ("wkv7", KERNEL, 16, mx.float32, False) in report
    assert W.DISPATCH.results == {(KERNEL, (16, mx.float32)): False}


def test_no_self_check_inside_compile(monkeypatch):
    # unchecked kernel inside mx.compile: the MLX path for this trace, one warning, nothing
    # decided; outside the trace the check then runs as usual
    used = []

    def good_kernel(*xs):
        used.append(True)
        return W.wkv7_chunked(*xs)

    _with_kernel(monkeypatch, good_kernel)
    args = to_mx(random_wkv7_inputs(np.random.default_rng(2), 1, 24, 2, 16))
    with pytest.warns(RuntimeWarning, match="call mlx_rwkvx.ops.prepare"):
        y = mx.compile(lambda *xs: W.wkv7(*xs)[0])(*args)
    assert not used and W.DISPATCH.results == {}
    assert rel_err(np.array(y), np.array(W.wkv7_chunked(*args)[0])) <= FWD_TOL
    W.wkv7(*args)
    assert used and W.DISPATCH.results == {(KERNEL, (16, mx.float32)): True}


@pytest.mark.parametrize("T", [5, 40])
def test_under_compile_equals_eager(T):
    # forward and every gradient of the compiled op equal the eager ones
    args = to_mx(random_wkv7_inputs(np.random.default_rng(T), 2, T, 2, 16))

    def loss(*xs):
        y, s = W.wkv7(*xs)
        return (y * y).sum() + (s * s).sum()

    grad = mx.value_and_grad(loss, argnums=list(range(7)))
    (eager_loss, eager_grads) = grad(*args)
    (comp_loss, comp_grads) = mx.compile(grad)(*args)
    assert abs(comp_loss.item() - eager_loss.item()) <= 1e-6 * abs(eager_loss.item())
    for name, a, b in zip((*WKV7_INPUTS, "state"), comp_grads, eager_grads, strict=True):
        assert rel_err(np.array(a), np.array(b)) <= 1e-6, name


BAD_CALLS = [
    (lambda a: a | {"r": a["r"][0]}, "r must be \\[B, T, H, N\\]"),
    (lambda a: a | {"k": a["k"][:, :3]}, r"k has shape \(1, 3, 2, 16\), expected \(1, 5"),
    (lambda a: a | {"log_w": a["log_w"].astype(mx.bfloat16)}, "log_w has dtype .*float32"),
    (lambda a: a | {"v": a["v"].astype(mx.float16)}, "v has dtype mlx.core.float16, expected"),
    (lambda a: a | {"state": a["state"][:, :1]}, "state has shape \\(1, 1, 16, 16\\)"),
    (lambda a: a | {"state": a["state"].astype(mx.float16)}, "state has dtype"),
    (lambda a: {n: x[..., :12] if n != "state" else x for n, x in a.items()}, "N in"),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", range(len(BAD_CALLS)))
def test_bad_input_names_the_argument(impl, case):
    inputs = random_wkv7_inputs(np.random.default_rng(0), 1, 5, 2, 16)
    args = dict(zip((*WKV7_INPUTS, "state"), to_mx(inputs), strict=True))
    change, message = BAD_CALLS[case]
    bad = change(args)
    with pytest.raises(ValueError, match=message):
        IMPLS[impl](*(bad[n] for n in (*WKV7_INPUTS, "state")))


def test_public_names():
    # the contract of DESIGN.md: mlx_rwkvx.ops.wkv7 and mlx_rwkvx.ops.moba_attention are the ops
    import mlx_rwkvx.ops as ops

    inputs = random_wkv7_inputs(np.random.default_rng(0), 1, 5, 2, 16)
    y, s = ops.wkv7(*to_mx(inputs))
    y_ref, s_ref = wkv7_np(*(inputs[n] for n in WKV7_INPUTS), inputs["state"])
    assert rel_err(as_f64(y), y_ref) <= FWD_TOL and rel_err(as_f64(s), s_ref) <= FWD_TOL
    assert ops.wkv7_step is W.wkv7_step
    rng = np.random.default_rng(5)
    q, k, v = (mx.array(rng.standard_normal((1, 40, 2, 16)).astype(np.float32)) for _ in "qkv")
    a = ops.moba_attention(q, k, v, chunk_size=4, top_k=1)
    b = ops.moba_attention_ref(q, k, v, chunk_size=4, top_k=1)
    assert rel_err(np.array(a), np.array(b)) <= FWD_TOL
