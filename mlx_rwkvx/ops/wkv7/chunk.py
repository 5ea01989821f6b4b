"""WKV7 by chunks: batched matmuls for all chunks at once plus a short state scan, with a hand
VJP of the scan (derivation in README.md beside this file).

Per batch row and head, with ``S[i, j]`` (i = value index, j = key index):

    sa = S a_t;   S = S diag(exp(log_w_t)) + v_t k_t^T + sa b_t^T;   y_t = S r_t
"""

from __future__ import annotations

from mlx_rwkvx.ops.common import fast_exp
from mlx_rwkvx.ops.wkv7.contract import check_inputs, zero_state

import mlx.core as mx

# Decays below exp(-16) = 1.1e-7 per step are taken as exp(-16): what the state keeps of itself
# differs by < 1.1e-7, below float32 resolution, and this bound keeps every exponential factor
# taken about a sub-block's reference inside [e^-64, e^64] (``SUB // 2`` steps either side of
# it); the factors across sub-blocks and chunks are <= 1 (README.md: where they may underflow).
LOG_W_MIN = -16.0
# Time steps per chunk of the state scan: the fastest of 16, 32, 64 (benchmarks/BENCHMARKS.md).
CHUNK = 16
SUB = 8  # time steps per sub-block sharing one exponential reference point
REF = SUB // 2 - 1  # the reference: the cumulative log-decay after this step of the sub-block


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """``(I - A)^-1`` for strictly lower-triangular ``A [..., n, n]``, n = SUB * 2^k.

    Diagonal blocks of SUB by ``(I + A)(I + A^2)(I + A^4)`` (exact: A is nilpotent), then pairs
    of blocks merged, ``[[M1, 0], [M2 A21 M1, M2]]``, until one block is left. All matmuls.
    (The product over the whole chunk, ``(I + A)...(I + A^(n/2))``, is as exact on paper but
    forms ``A^8`` and beyond, whose entries grow binomially when the keys point alike and
    cancel in float32: up to 1e-5 off at chunks of 16, overflow at 64.)
    """
    n = A.shape[-1]
    pre = A.shape[:-2]
    nb = n // SUB
    assert n == SUB * nb and nb & (nb - 1) == 0, f"(I - A)^-1 of n={n}: n must be SUB * 2^k"
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


def _scores(Q: mx.array, K: mx.array, back: mx.array, h: mx.array, c_end: mx.array):
    """The L x L blocks of every (query kind, key kind) pair, ``[..., 2, L, 2, L]`` indexed
    ``[r|a, t, k|b, s]``, masked (r rows keep s <= t, a rows s < t).

    ``Q``, ``K`` ``[..., nq, 2 SUB, N]``: each sub-block's queries (r, a rows) and keys (k, b
    rows) scaled to its own reference; ``back`` = ``e^(m_q - c_end(q-1))``, ``h`` =
    ``e^(c_end(q) - m_q)`` and ``c_end``, ``[..., nq, 1, N]``. A diagonal block is
    ``Q_q K_q^T``; an off-diagonal one (q > p) rescales both sides to the sub-block boundaries,
    ``e^(X_t - c_end(q-1))`` and ``e^(c_end(p) - c_s)``, both <= 1, with
    ``e^(c_end(q-1) - c_end(p))`` (<= 1) between them where q - 1 > p.
    """
    *pre, nq, _, N = Q.shape
    ii = mx.arange(SUB)
    keep = mx.stack([ii[:, None] >= ii[None, :], ii[:, None] > ii[None, :]])  # [r|a, t, s]
    keep = mx.broadcast_to(keep[:, :, None, :], (2, SUB, 2, SUB)).reshape(2 * SUB, 2 * SUB)
    # where, not a product: above the diagonal two factors up to e^64 meet and may overflow
    diag = mx.where(keep, Q @ mx.swapaxes(K, -1, -2), 0.0)
    diag = diag.reshape(*pre, nq, 2, SUB, 2, SUB)  # [q, r|a, t, k|b, s]
    if nq > 1:
        Qo = Q[..., 1:, :, :] * back[..., 1:, :, :]  # e^(X_t - c_end(q-1)) <= 1
        Ko = mx.swapaxes(K[..., :-1, :, :] * h[..., :-1, :, :], -1, -2)  # e^(c_end(p) - c_s)
        if nq > 2:  # e^(c_end(q-1) - c_end(p)) for p <= q - 1, zero for p > q - 1
            ce = c_end[..., 0, :]
            low = mx.tril(mx.ones((nq - 1, nq - 1), dtype=mx.bool_))[..., None]
            G = fast_exp(mx.where(low, ce[..., :-1, None, :] - ce[..., None, :-1, :], -mx.inf))
            off = (Qo[..., :, None, :, :] * G[..., None, :]) @ Ko[..., None, :, :, :]
        else:
            off = (Qo @ Ko)[..., None, :, :, :]
        off = off.reshape(*pre, nq - 1, nq - 1, 2, SUB, 2, SUB)  # [q - 1, p, ...]
    zero = mx.zeros_like(diag[..., 0, :, :, :, :])
    rows = []
    for q in range(nq):
        blocks = [off[..., q - 1, p, :, :, :, :] for p in range(q)]
        blocks += [diag[..., q, :, :, :, :]] + [zero] * (nq - 1 - q)
        rows.append(mx.stack(blocks, axis=-2))  # [r|a, t, k|b, p, s]
    return mx.stack(rows, axis=-5).reshape(*pre, 2, nq * SUB, 2, nq * SUB)


def _chunk_maps(r, log_w, k, v, a, b):
    """Each chunk's affine map of its initial state, for all chunks at once.

    Inputs ``[..., L, N]`` float32 (L = CHUNK). With S_c the state entering a chunk, the chunk
    gives ``S_next = S_c P + U`` and ``Y = Y0 + Qm S_c^T``. Returns P, U ``[..., N, N]`` and
    Qm, Y0 ``[..., L, N]``. See README.md for the derivation and the exponent bounds.
    """
    *pre, L, N = r.shape
    nq = L // SUB
    lw = mx.maximum(log_w, LOG_W_MIN)
    c = mx.cumsum(lw, axis=-2)  # [..., L, N] inclusive cumulative log-decay from chunk start
    cq = c.reshape(*pre, nq, SUB, N)
    m = cq[..., REF : REF + 1, :]  # [..., nq, 1, N] each sub-block's reference
    c_end = cq[..., -1:, :]  # [..., nq, 1, N]
    E, E_inv = _exp_both(cq - m)  # e^(c_t - m_q), in [e^-64, e^48], and 1/it
    zero = mx.zeros_like(c_end[..., :1, :, :])
    c_before = mx.concatenate([zero, c_end[..., :-1, :, :]], axis=-3)  # c_end(q - 1)
    first, back = _exp_both(c_before - m)  # e^(c_end(q-1) - m_q) in [1, e^64], and 1/it
    E_prev = mx.concatenate([first, E[..., :-1, :]], axis=-2)  # e^(c_{t-1} - m_q)
    h = E[..., -1:, :]  # e^(c_end(q) - m_q) <= 1

    def sub_blocks(x):
        return x.reshape(*pre, nq, SUB, N)

    Q = mx.concatenate([sub_blocks(r) * E, sub_blocks(a) * E_prev], axis=-2)  # [nq, 2 SUB, N]
    K = mx.concatenate([sub_blocks(k) * E_inv, sub_blocks(b) * E_inv], axis=-2)
    A = _scores(Q, K, back, h, c_end)  # [..., r|a, t, k|b, s]
    A_rk, A_rb, A_ak, A_ab = (
        A[..., 0, :, 0, :],
        A[..., 0, :, 1, :],
        A[..., 1, :, 0, :],
        A[..., 1, :, 1, :],
    )

    to_start = fast_exp(m)  # e^(m_q): from the reference back to the chunk start
    R0 = (Q[..., :SUB, :] * to_start).reshape(*pre, L, N)  # r_t e^(c_t)
    A0 = (Q[..., SUB:, :] * to_start).reshape(*pre, L, N)  # a_t e^(c_{t-1})
    c_last = c[..., -1:, :]  # [..., 1, N]
    KB_L = K * fast_exp(c_last[..., None, :, :] - m)  # times e^(c_L - m_q) <= 1
    K_L = KB_L[..., :SUB, :].reshape(*pre, L, N)  # k_s e^(c_L - c_s)
    B_L = KB_L[..., SUB:, :].reshape(*pre, L, N)  # b_s e^(c_L - c_s)
    # z_t = S_{t-1} a_t solves (I - A_ab) Z = A0 S^T + A_ak v: split by linearity in S
    M = _unit_lower_inverse(A_ab)
    Z_S, Z0 = M @ A0, M @ (A_ak @ v)
    Qm = mx.addmm(R0, A_rb, Z_S)
    Y0 = mx.addmm(A_rk @ v, A_rb, Z0)
    decay = fast_exp(c_last)  # [..., 1, N] e^(c_L)
    P = mx.swapaxes(Z_S, -1, -2) @ B_L + decay * mx.eye(N, dtype=mx.float32)
    U = mx.addmm(mx.swapaxes(v, -1, -2) @ K_L, mx.swapaxes(Z0, -1, -2), B_L)
    return P, U, Qm, Y0


def _to_chunks(x: mx.array, n_chunks: int) -> mx.array:
    """``[B, T, H, N]`` -> float32 ``[n_chunks, B, H, CHUNK, N]``, zero-padded at the end.
    Chunk-major: the scan's slice of one chunk is contiguous."""
    B, T, H, N = x.shape
    x = x.astype(mx.float32)
    pad = n_chunks * CHUNK - T
    if pad:
        x = mx.concatenate([x, mx.zeros((B, pad, H, N), dtype=mx.float32)], axis=1)
    return mx.transpose(x.reshape(B, n_chunks, CHUNK, H, N), (1, 0, 3, 2, 4))


def _from_chunks(x: mx.array, T: int) -> mx.array:
    """Inverse of ``_to_chunks`` (drops the padding)."""
    n_chunks, B, H, L, N = x.shape
    return mx.transpose(x, (1, 0, 3, 2, 4)).reshape(B, n_chunks * L, H, N)[:, :T]


def _per_chunk(x: mx.array) -> list[mx.array]:
    """``[n_chunks, B, ...]`` as a list of ``[B, ...]``: one split, not a slice per chunk."""
    return mx.split(x.reshape(-1, *x.shape[2:]), x.shape[0])


@mx.custom_function
def scan_states(P: mx.array, U: mx.array, state: mx.array) -> mx.array:
    """States entering each chunk, ``[n_chunks, B, H, N, N]``, and the final one appended:
    ``S_{c+1} = S_c P_c + U_c``, one ``addmm`` per chunk."""
    states = [state]
    for P_c, U_c in zip(_per_chunk(P), _per_chunk(U), strict=True):
        states.append(mx.addmm(U_c, states[-1], P_c))
    return mx.stack(states)


@scan_states.vjp
def _scan_vjp(primals, cotangent, output):
    """The reverse scan: with ``G_c`` the cotangent of state c from its other uses, the whole
    cotangent of S_c is ``D_c = G_c + D_{c+1} P_c^T``; then ``dP_c = S_c^T D_{c+1}``,
    ``dU_c = D_{c+1}``."""
    G = _per_chunk(cotangent)
    d = [G.pop()]
    for P_c, G_c in zip(reversed(_per_chunk(primals[0])), reversed(G), strict=True):
        d.append(mx.addmm(G_c, d[-1], mx.swapaxes(P_c, -1, -2)))
    d_state = d.pop()
    d_after = mx.stack(d[::-1])  # the whole cotangent of S_{c+1}, chunk c
    return mx.swapaxes(output[:-1], -1, -2) @ d_after, d_after, d_state


def wkv7_chunked(r, log_w, k, v, a, b, state=None) -> tuple[mx.array, mx.array]:
    """WKV7 by chunks of CHUNK steps: batched matmuls for all chunks plus a short state scan.

    Same contract as ``wkv7_ref`` (float32 state and accumulation, y in r's dtype); the VJP is
    the reverse state scan by hand and autograd through the chunk maps. Memory kept for the
    backward: one N x N state per chunk (T / CHUNK of them per head) and the maps'
    intermediates, a few dozen ``[T, H, N]``-sized arrays.
    """
    check_inputs(r, log_w, k, v, a, b, state)
    return chunked(r, log_w, k, v, a, b, state)


def chunked(r, log_w, k, v, a, b, state) -> tuple[mx.array, mx.array]:
    """``wkv7_chunked`` without the argument checks (the dispatcher ran them)."""
    state = zero_state(r) if state is None else state
    T = r.shape[1]
    n_chunks = -(-T // CHUNK)
    P, U, Qm, Y0 = _chunk_maps(*(_to_chunks(x, n_chunks) for x in (r, log_w, k, v, a, b)))
    states = scan_states(P, U, state.astype(mx.float32))  # [n_chunks + 1, B, H, N, N]
    Y = Y0 + Qm @ mx.swapaxes(states[:-1], -1, -2)
    return _from_chunks(Y, T).astype(r.dtype), states[-1]
