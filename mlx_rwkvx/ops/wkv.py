"""WKV7, the RWKV-7 recurrence: step-loop reference, chunked fast path, kernels, dispatcher.

Per batch row and head, with ``S[i, j]`` (i = value index, j = key index):

    sa = S a_t;   S = S diag(exp(log_w_t)) + v_t k_t^T + sa b_t^T;   y_t = S r_t

The chunked formulation and its backward are derived in ``ops/README.md``.
"""

from __future__ import annotations

import os

from mlx_rwkvx import _runtime
from mlx_rwkvx.ops.common import FLOAT_DTYPES, HEAD_SIZES, SELF_CHECK_TOL, fast_exp, require_arrays
from mlx_rwkvx.ops.dispatch import SelfCheck, agree

import mlx.core as mx

_runtime.configure()

# Decays below exp(-16) = 1.1e-7 per step are taken as exp(-16): what the state keeps of itself
# differs by < 1.1e-7, below float32 resolution, and this bound keeps every exponential factor
# of the chunked path inside [e^-64, e^64] (``SUB // 2`` steps either side of a reference).
LOG_W_MIN = -16.0
CHUNK = 16  # time steps per chunk of the state scan (measured fastest here: 16 vs 32 vs 64)
SUB = 8  # time steps per sub-block sharing one exponential reference point
REF = SUB // 2 - 1  # the reference: the cumulative log-decay after this step of the sub-block
_NAMES = ("r", "log_w", "k", "v", "a", "b")


def _check(r, log_w, k, v, a, b, state) -> None:
    """One ValueError naming the first argument whose shape or dtype does not fit (TypeError
    for one that is not an mx.array)."""
    require_arrays("wkv7", dict(zip(_NAMES, (r, log_w, k, v, a, b), strict=True)), state=state)
    if r.ndim != 4:
        raise ValueError(f"wkv7: r must be [B, T, H, N], got shape {tuple(r.shape)}")
    B, T, H, N = r.shape
    if T < 1 or N not in HEAD_SIZES:
        raise ValueError(
            f"wkv7: r must be [B, T>=1, H, N] with N in {HEAD_SIZES}, got shape {tuple(r.shape)}"
        )
    for name, x in zip(_NAMES, (r, log_w, k, v, a, b), strict=True):
        if tuple(x.shape) != (B, T, H, N):
            raise ValueError(
                f"wkv7: {name} has shape {tuple(x.shape)}, expected {(B, T, H, N)} (that of r)"
            )
        if name == "log_w":
            if x.dtype != mx.float32:
                raise ValueError(
                    f"wkv7: log_w has dtype {x.dtype}, expected float32 (the log-decay is "
                    "always float32)"
                )
        elif x.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"wkv7: {name} has dtype {x.dtype}, expected one of float32, bfloat16, float16"
            )
        elif x.dtype != r.dtype:
            raise ValueError(f"wkv7: {name} has dtype {x.dtype}, expected {r.dtype} (that of r)")
    if state is not None:
        if tuple(state.shape) != (B, H, N, N):
            raise ValueError(f"wkv7: state has shape {tuple(state.shape)}, expected {(B, H, N, N)}")
        if state.dtype != mx.float32:
            raise ValueError(f"wkv7: state has dtype {state.dtype}, expected float32")


def _zero_state(r: mx.array) -> mx.array:
    B, _, H, N = r.shape
    return mx.zeros((B, H, N, N), dtype=mx.float32)


def wkv7_step(r, log_w, k, v, a, b, state) -> tuple[mx.array, mx.array]:
    """One decode step. r, log_w, k, v, a, b ``[B, H, N]``, state ``[B, H, N, N]`` float32.

    Returns (y ``[B, H, N]`` in r's dtype, new state float32).
    """
    f32 = [x.astype(mx.float32) for x in (r, k, v, a, b)]
    r32, k32, v32, a32, b32 = f32
    w = mx.exp(log_w.astype(mx.float32))
    sa = (state @ a32[..., None])[..., 0]  # [B, H, N]
    state = (
        state * w[..., None, :]
        + v32[..., :, None] * k32[..., None, :]
        + sa[..., :, None] * b32[..., None, :]
    )
    y = (state @ r32[..., None])[..., 0]
    return y.astype(r.dtype), state


def wkv7_ref(r, log_w, k, v, a, b, state=None) -> tuple[mx.array, mx.array]:
    """The step loop in MLX ops: the reference every fast path is tested against.

    Inputs ``[B, T, H, N]`` (log_w float32), state ``[B, H, N, N]`` float32 or None (zeros).
    Returns (y ``[B, T, H, N]`` in r's dtype, final state float32). Differentiable by autograd.
    """
    _check(r, log_w, k, v, a, b, state)
    state = _zero_state(r) if state is None else state
    ys = []
    for t in range(r.shape[1]):
        y, state = wkv7_step(r[:, t], log_w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """``(I - A)^-1`` for strictly lower-triangular ``A [..., n, n]``, n = SUB * 2^k.

    Diagonal blocks of SUB by ``(I + A)(I + A^2)(I + A^4)`` (exact: A is nilpotent), then pairs
    of blocks merged, ``[[M1, 0], [M2 A21 M1, M2]]``, until one block is left. All matmuls.
    """
    n = A.shape[-1]
    pre = A.shape[:-2]
    nb = n // SUB
    blocks = A.reshape(*pre, nb, SUB, nb, SUB)
    X = mx.moveaxis(mx.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb, SUB, SUB]
    M = X + mx.eye(SUB, dtype=A.dtype)
    power = X
    for _ in range(SUB.bit_length() - 2):  # SUB = 8: X^2 then X^4
        power = power @ power
        M = M + M @ power
    size = SUB
    while nb > 1:
        grid = A.reshape(*pre, nb // 2, 2, size, nb // 2, 2, size)
        # block (2j+1, 2j) of A at this size: rows of the odd block, columns of the even one
        A21 = mx.moveaxis(mx.diagonal(grid[..., 1, :, :, 0, :], axis1=-4, axis2=-2), -1, -3)
        M1, M2 = M[..., 0::2, :, :], M[..., 1::2, :, :]
        M21 = M2 @ A21 @ M1
        top = mx.concatenate([M1, mx.zeros_like(M1)], axis=-1)
        bottom = mx.concatenate([M21, M2], axis=-1)
        M = mx.concatenate([top, bottom], axis=-2)
        nb //= 2
        size *= 2
    return M[..., 0, :, :]


@mx.custom_function
def _exp_both(x: mx.array) -> tuple[mx.array, mx.array]:
    """``(e^x, e^-x)`` with one exponential; the VJP never squares a factor (e^-64 would vanish)."""
    e = fast_exp(x)
    return e, mx.reciprocal(e)


@_exp_both.vjp
def _exp_both_vjp(primals, cotangents, outputs):
    d_e, d_inv = cotangents
    e, inv = outputs
    return d_e * e - d_inv * inv


def _chunk_maps(r, log_w, k, v, a, b):
    """Each chunk's affine map of its initial state, for all chunks at once.

    Inputs ``[..., L, N]`` float32 (L = CHUNK). With S_c the state entering a chunk, the chunk
    gives ``S_next = S_c P + U`` and ``Y = Y0 + Qm S_c^T``. Returns P, U ``[..., N, N]`` and
    Qm, Y0 ``[..., L, N]``. See ops/README.md for the derivation and the exponent bounds.
    """
    *pre, L, N = r.shape
    nq = L // SUB
    lw = mx.maximum(log_w, LOG_W_MIN)
    c = mx.cumsum(lw, axis=-2)  # [..., L, N] inclusive cumulative log-decay from chunk start
    cq = c.reshape(*pre, nq, SUB, N)
    m = cq[..., REF, :]  # [..., nq, N] each sub-block's reference
    c_end = cq[..., -1, :]  # [..., nq, N]
    c_before = mx.concatenate([mx.zeros_like(c_end[..., :1, :]), c_end[..., :-1, :]], axis=-2)
    E, E_inv = _exp_both(cq - m[..., None, :])  # e^(c_t - m_q), in [e^-64, e^48], and 1/it
    E_prev = mx.concatenate(
        [fast_exp(c_before - m)[..., None, :], E[..., :-1, :]], axis=-2
    )  # e^(c_{t-1} - m_q), in [e^-64, e^64]
    h = E[..., -1, None, None, :]  # e^(c_end(q) - m_q) <= 1, [..., nq, 1, 1, N]
    c_last = c[..., -1, :]  # [..., N]
    to_start = fast_exp(m)[..., None, :]  # e^(m_q): from the reference back to the chunk start
    to_end = fast_exp(c_last[..., None, :] - m)[..., None, None, :]  # e^(c_L - m_q) <= 1
    # e^(m_q - c_end(p)) <= 1 between sub-blocks p < q; zero elsewhere
    later = mx.tril(mx.ones((nq, nq), dtype=mx.bool_), k=-1)[..., None]
    pair = fast_exp(mx.where(later, m[..., :, None, :] - c_end[..., None, :, :], -mx.inf))
    same = mx.eye(nq, dtype=mx.bool_)[:, :, None, None, None]

    rq, aq = r.reshape(*pre, nq, SUB, N), a.reshape(*pre, nq, SUB, N)
    queries = mx.concatenate([rq * E, aq * E_prev], axis=-2)  # [..., nq, 2 SUB, N]
    # keys k and b of each sub-block p, [..., p, kind, SUB, N], as seen from sub-block q
    kb = mx.stack([k.reshape(*pre, nq, SUB, N), b.reshape(*pre, nq, SUB, N)], axis=-3)
    near = kb * E_inv[..., :, None, :, :]  # e^(m_q - c_s): s in the query's own sub-block
    far = near * h  # e^(c_end(p) - c_s) <= 1, seen from q > p times pair[q, p]
    far_seen = far[..., None, :, :, :, :] * pair[..., None, None, :]
    seen = mx.where(same, near[..., None, :, :, :, :], far_seen)  # [..., q, p, kind, SUB, N]
    scores = queries @ mx.swapaxes(seen.reshape(*pre, nq, 2 * L, N), -1, -2)
    scores = scores.reshape(*pre, nq, 2, SUB, nq, 2, SUB)  # [q, r|a, t, p, k|b, s]

    def block(query_kind, key_kind, mask):
        # where, not a product: above the diagonal two factors up to e^64 meet and may overflow
        x = scores[..., query_kind, :, :, key_kind, :].reshape(*pre, L, L)
        return mx.where(mask, x, 0.0)

    incl = mx.tril(mx.ones((L, L), dtype=mx.bool_))
    strict = mx.tril(mx.ones((L, L), dtype=mx.bool_), k=-1)
    A_rk, A_rb = block(0, 0, incl), block(0, 1, incl)
    A_ak, A_ab = block(1, 0, strict), block(1, 1, strict)

    R0 = (rq * E * to_start).reshape(*pre, L, N)  # r_t e^(c_t)
    A0 = (aq * E_prev * to_start).reshape(*pre, L, N)  # a_t e^(c_{t-1})
    KB_L = (near * to_end).reshape(*pre, nq, 2, SUB, N)  # k_s, b_s times e^(c_L - c_s)
    K_L = KB_L[..., 0, :, :].reshape(*pre, L, N)
    B_L = KB_L[..., 1, :, :].reshape(*pre, L, N)
    # z_t = S_{t-1} a_t solves (I - A_ab) Z = A0 S^T + A_ak v: split by linearity in S
    Z = _unit_lower_inverse(A_ab) @ mx.concatenate([A0, A_ak @ v], axis=-1)
    Z_S, Z0 = Z[..., :N], Z[..., N:]
    Qm = R0 + A_rb @ Z_S
    VZ = mx.concatenate([v, Z0], axis=-2)  # [..., 2L, N]
    Y0 = mx.concatenate([A_rk, A_rb], axis=-1) @ VZ
    decay = fast_exp(c_last)  # [..., N] e^(c_L)
    P = mx.swapaxes(Z_S, -1, -2) @ B_L + decay[..., None, :] * mx.eye(N, dtype=mx.float32)
    U = mx.swapaxes(VZ, -1, -2) @ mx.concatenate([K_L, B_L], axis=-2)
    return P, U, Qm, Y0


def _to_chunks(x: mx.array, n_chunks: int) -> mx.array:
    """``[B, T, H, N]`` -> float32 ``[B, H, n_chunks, CHUNK, N]``, zero-padded at the end."""
    B, T, H, N = x.shape
    x = x.astype(mx.float32)
    pad = n_chunks * CHUNK - T
    if pad:
        x = mx.concatenate([x, mx.zeros((B, pad, H, N), dtype=mx.float32)], axis=1)
    return mx.moveaxis(x, 1, 2).reshape(B, H, n_chunks, CHUNK, N)


def _from_chunks(x: mx.array, T: int) -> mx.array:
    """Inverse of ``_to_chunks`` (drops the padding)."""
    B, H, n_chunks, L, N = x.shape
    return mx.moveaxis(x.reshape(B, H, n_chunks * L, N), 2, 1)[:, :T]


def _scan(P: mx.array, U: mx.array, state: mx.array) -> mx.array:
    """States entering each chunk, ``[B, H, n_chunks, N, N]``, and the final one appended."""
    states = [state]
    for c in range(P.shape[2]):
        states.append(mx.addmm(U[:, :, c], states[-1], P[:, :, c]))
    return mx.stack(states, axis=2)


@mx.custom_function
def _wkv7_chunked_core(r, log_w, k, v, a, b, state):
    T = r.shape[1]
    n_chunks = -(-T // CHUNK)
    P, U, Qm, Y0 = _chunk_maps(*(_to_chunks(x, n_chunks) for x in (r, log_w, k, v, a, b)))
    states = _scan(P, U, state)  # [B, H, n_chunks + 1, N, N]
    Y = Y0 + Qm @ mx.swapaxes(states[:, :, :-1], -1, -2)
    # states, P and Qm ride along as outputs: the VJP's reverse scan needs them first
    return _from_chunks(Y, T).astype(r.dtype), states[:, :, -1], states, P, Qm


@_wkv7_chunked_core.vjp
def _wkv7_chunked_vjp(primals, cotangents, outputs):
    dy, d_state_out = cotangents[:2]
    _, _, states, P, Qm = outputs
    T = primals[0].shape[1]
    n_chunks = P.shape[2]
    dY = _to_chunks(dy, n_chunks)  # [B, H, nc, L, N]
    entry = states[:, :, :-1]  # S_c entering chunk c
    # Y = Y0 + Qm S_c^T: the state's share of each chunk's output gradient
    d_from_y = mx.swapaxes(dY, -1, -2) @ Qm  # [B, H, nc, N, N]
    d_next = [d_state_out.astype(mx.float32)]  # dL/dS_{c+1}, from the last chunk back
    P_t = mx.swapaxes(P, -1, -2)
    for c in reversed(range(n_chunks)):
        d_next.append(mx.addmm(d_from_y[:, :, c], d_next[-1], P_t[:, :, c]))
    d_state = d_next.pop()
    d_after = mx.stack(d_next[::-1], axis=2)  # dL/dS_{c+1} for each chunk c
    cotangents_of_maps = [mx.swapaxes(entry, -1, -2) @ d_after, d_after, dY @ entry, dY]
    chunks = [_to_chunks(x, n_chunks) for x in primals[:6]]
    _, grads = mx.vjp(_chunk_maps, chunks, cotangents_of_maps)
    out = [_from_chunks(g, T).astype(x.dtype) for g, x in zip(grads, primals[:6], strict=True)]
    return (*out, d_state)


def wkv7_chunked(r, log_w, k, v, a, b, state=None) -> tuple[mx.array, mx.array]:
    """WKV7 by chunks of CHUNK steps: batched matmuls for all chunks plus a short state scan.

    Same contract as ``wkv7_ref`` (float32 state and accumulation, y in r's dtype); the VJP is
    the reverse state scan plus one batched ``mx.vjp`` of the chunk maps. Memory kept for the
    backward: the inputs and one N x N state per chunk.
    """
    _check(r, log_w, k, v, a, b, state)
    state = _zero_state(r) if state is None else state
    y, state_out, *_ = _wkv7_chunked_core(r, log_w, k, v, a, b, state)
    return y, state_out


ENV_VAR = "MLX_RWKVX_WKV7"
# Below this many steps the step loop beats the chunked path (measured here, H=8, N=64:
# forward 1.6 vs 2.5 ms at T=8, 3.2 vs 1.8 ms at T=16; fwd+bwd likewise).
REF_MAX_T = 8
_self_check = SelfCheck("WKV7", "chunked")


def _kernel_fn():
    from mlx_rwkvx.ops.mlx_kernels import kernel_backend
    from mlx_rwkvx.ops.wkv7_kernel import wkv7_kernel

    return wkv7_kernel if kernel_backend() is not None else None


def _self_check_inputs(N: int, dtype) -> list:
    keys = mx.random.split(mx.random.key(0), 7)
    shape = (1, 37, 2, N)
    r, k, v = (mx.random.uniform(-0.5, 0.5, shape, key=keys[i]) for i in range(3))
    kk = mx.random.normal(shape, key=keys[3])
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    log_w = mx.log(mx.random.uniform(0.5, 0.999, shape, key=keys[4]))
    b = kk * mx.random.uniform(shape=shape, key=keys[5])
    state = mx.random.uniform(-0.5, 0.5, (1, 2, N, N), key=keys[6])
    args = [x.astype(dtype) for x in (r, log_w, k, v, -kk, b)] + [state]
    args[1] = log_w
    return args


def _outputs_and_grads(fn, args) -> list:
    def loss(*xs):
        y, s = fn(*xs)
        return y.astype(mx.float32).sum() + s.sum()

    return [*fn(*args), *mx.grad(loss, argnums=list(range(7)))(*args)]


def _kernel_passes_self_check(N: int, dtype) -> bool:
    """Once per (N, dtype): the kernel against the chunked path, outputs and gradients."""

    def check() -> bool:
        args = _self_check_inputs(N, dtype)
        tol = SELF_CHECK_TOL[dtype]
        mine = _outputs_and_grads(_kernel_fn(), args)
        return agree(mine, _outputs_and_grads(wkv7_chunked, args), tol)

    return _self_check.passes((N, dtype), check)


def wkv7(r, log_w, k, v, a, b, state=None) -> tuple[mx.array, mx.array]:
    """WKV7 over a sequence. r, log_w, k, v, a, b ``[B, T, H, N]``; state ``[B, H, N, N]``.

    ``log_w <= 0`` is the log of the decay and must be float32 (bf16 would round a decay of
    0.999 to 1). r, k, v, a, b may be float32, bfloat16 or float16; the state and every
    accumulation are float32. Returns (y ``[B, T, H, N]`` in r's dtype, final state float32).

    Picks the kernel where the device has one and it passed its self-check, else the step loop
    for T <= REF_MAX_T, else the chunked path; ``MLX_RWKVX_WKV7=ref|chunked|kernel`` forces one.
    """
    choice = os.environ.get(ENV_VAR, "")
    if choice == "kernel":
        kernel = _kernel_fn()
        if kernel is None:
            raise RuntimeError(f"{ENV_VAR}=kernel, but this device has no WKV7 kernel (Metal/CUDA)")
        return kernel(r, log_w, k, v, a, b, state)
    if choice:
        if choice not in ("ref", "chunked"):
            raise ValueError(f"{ENV_VAR}={choice!r}: expected one of chunked, kernel, ref")
        impl = wkv7_ref if choice == "ref" else wkv7_chunked
        return impl(r, log_w, k, v, a, b, state)
    _check(r, log_w, k, v, a, b, state)
    if _kernel_fn() is not None and _kernel_passes_self_check(r.shape[-1], r.dtype):
        return _kernel_fn()(r, log_w, k, v, a, b, state)
    if r.shape[1] <= REF_MAX_T:
        return wkv7_ref(r, log_w, k, v, a, b, state)
    return wkv7_chunked(r, log_w, k, v, a, b, state)
