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
# of the chunked path inside [e^-64, e^64] (``SUB // 2`` steps either side of a reference).
LOG_W_MIN = -16.0
# Time steps per chunk of the state scan: the fastest of 16, 32, 64 (benchmarks/BENCHMARKS.md).
CHUNK = 16
SUB = 8  # time steps per sub-block sharing one exponential reference point
REF = SUB // 2 - 1  # the reference: the cumulative log-decay after this step of the sub-block


def _unit_lower_inverse(A: mx.array) -> mx.array:
    """``(I - A)^-1`` for strictly lower-triangular ``A [..., n, n]``, n a power of two.

    A is nilpotent (``A^n = 0``), so ``(I - A)^-1 = (I + A)(I + A^2)(I + A^4)...(I + A^(n/2))``
    exactly: log2(n) squarings and as many products, all batched matmuls.
    """
    M = A + mx.eye(A.shape[-1], dtype=A.dtype)
    power = A
    for _ in range(A.shape[-1].bit_length() - 2):
        power = power @ power
        M = M + M @ power
    return M


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
    Qm, Y0 ``[..., L, N]``. See README.md for the derivation and the exponent bounds.
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


@mx.custom_function
def _scan(P: mx.array, U: mx.array, state: mx.array) -> mx.array:
    """States entering each chunk, ``[B, H, n_chunks, N, N]``, and the final one appended:
    ``S_{c+1} = S_c P_c + U_c``, one ``addmm`` per chunk."""
    states = [state]
    for c in range(P.shape[2]):
        states.append(mx.addmm(U[:, :, c], states[-1], P[:, :, c]))
    return mx.stack(states, axis=2)


@_scan.vjp
def _scan_vjp(primals, cotangent, output):
    """The reverse scan: with ``G_c`` the cotangent of state c from its other uses, the whole
    cotangent of S_c is ``D_c = G_c + D_{c+1} P_c^T``; then ``dP_c = S_c^T D_{c+1}``,
    ``dU_c = D_{c+1}``."""
    P = primals[0]
    n_chunks = P.shape[2]
    P_t = mx.swapaxes(P, -1, -2)
    d = [cotangent[:, :, n_chunks]]
    for c in reversed(range(n_chunks)):
        d.append(mx.addmm(cotangent[:, :, c], d[-1], P_t[:, :, c]))
    d_state = d.pop()
    d_after = mx.stack(d[::-1], axis=2)  # the whole cotangent of S_{c+1}, chunk c
    return mx.swapaxes(output[:, :, :-1], -1, -2) @ d_after, d_after, d_state


def wkv7_chunked(r, log_w, k, v, a, b, state=None) -> tuple[mx.array, mx.array]:
    """WKV7 by chunks of CHUNK steps: batched matmuls for all chunks plus a short state scan.

    Same contract as ``wkv7_ref`` (float32 state and accumulation, y in r's dtype); the VJP is
    the reverse state scan plus one batched ``mx.vjp`` of the chunk maps. Memory kept for the
    backward: the inputs and one N x N state per chunk.
    """
    check_inputs(r, log_w, k, v, a, b, state)
    return chunked(r, log_w, k, v, a, b, state)


def chunked(r, log_w, k, v, a, b, state) -> tuple[mx.array, mx.array]:
    """``wkv7_chunked`` without the argument checks (the dispatcher ran them)."""
    state = zero_state(r) if state is None else state
    T = r.shape[1]
    n_chunks = -(-T // CHUNK)
    P, U, Qm, Y0 = _chunk_maps(*(_to_chunks(x, n_chunks) for x in (r, log_w, k, v, a, b)))
    states = _scan(P, U, state.astype(mx.float32))  # [B, H, n_chunks + 1, N, N]
    Y = Y0 + Qm @ mx.swapaxes(states[:, :, :-1], -1, -2)
    return _from_chunks(Y, T).astype(r.dtype), states[:, :, -1]
