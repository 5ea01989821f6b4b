"""MoBA sparse attention: per query and head, its own chunk plus the top-k earlier chunks.

Per query t (chunk c_t = t // chunk_size) and query head h: keys s <= t of chunk c_t are always
attended; each earlier chunk c < c_t gets the gate <q_t, mean of chunk c's keys>, and the top_k
highest (ties: the lower chunk index) are attended too. ``top_k <= 0`` or ``top_k >=`` the number
of earlier chunks means full causal attention. The selection is held fixed in the backward.

Layouts: q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` with Hq a multiple of Hkv (GQA: query
head h reads kv head h // (Hq // Hkv)). Scores, softmax and accumulation are float32.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

from mlx_rwkvx import _runtime

import mlx.core as mx

_runtime.configure()

FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)


def _check(q, k, v, chunk_size, top_k) -> None:
    """One ValueError naming the first argument that does not fit."""
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"moba_attention: chunk_size must be an int >= 1, got {chunk_size!r}")
    if not isinstance(top_k, int):
        raise ValueError(f"moba_attention: top_k must be an int, got {top_k!r}")
    if q.ndim != 4:
        raise ValueError(f"moba_attention: q must be [B, T, Hq, D], got shape {tuple(q.shape)}")
    B, T, Hq, D = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] != T or x.shape[3] != D:
            raise ValueError(
                f"moba_attention: {name} has shape {tuple(x.shape)}, expected "
                f"[{B}, {T}, Hkv, {D}] (batch, time and head dim of q)"
            )
    if k.shape != v.shape:
        raise ValueError(f"moba_attention: v has shape {tuple(v.shape)}, expected {k.shape}")
    if Hq % k.shape[2]:
        raise ValueError(
            f"moba_attention: q has {Hq} heads, not a multiple of the {k.shape[2]} heads of k, v"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in FLOAT_DTYPES or x.dtype != q.dtype:
            raise ValueError(
                f"moba_attention: {name} has dtype {x.dtype}, expected {q.dtype} "
                f"(one of float32, bfloat16, float16 for all three)"
            )


def _is_full(T: int, chunk_size: int, top_k: int) -> bool:
    """True when every query attends to every earlier chunk: plain causal attention."""
    n_chunks = -(-T // chunk_size)
    return top_k <= 0 or top_k >= n_chunks - 1


def chunk_key_means(k: mx.array, chunk_size: int) -> mx.array:
    """Mean key of each complete chunk, ``[B, T // chunk_size, Hkv, D]`` float32."""
    B, T, Hkv, D = k.shape
    n_full = T // chunk_size
    kc = k[:, : n_full * chunk_size].astype(mx.float32)
    return kc.reshape(B, n_full, chunk_size, Hkv, D).mean(axis=2)


def moba_gates(q: mx.array, means: mx.array) -> mx.array:
    """``<q_t, mean_c>`` for every query, head and chunk: ``[B, T, Hq, n]`` float32 (unscaled)."""
    B, T, Hq, D = q.shape
    Hkv = means.shape[2]
    G = Hq // Hkv
    qg = q.astype(mx.float32).reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4)
    qg = qg.reshape(B, Hkv, T * G, D)
    m = means.transpose(0, 2, 3, 1)  # [B, Hkv, D, n]
    gates = (qg @ m).reshape(B, Hkv, T, G, -1)
    return gates.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, -1)


def select_top_k(gates: mx.array, own_chunk: mx.array, top_k: int) -> tuple[mx.array, mx.array]:
    """The ``top_k`` highest earlier chunks per row of ``gates [..., n]``, ties to the lower index.

    ``own_chunk`` broadcasts against the leading dims: chunks ``c < own_chunk`` are candidates.
    Returns (chunk indices ``[..., top_k]`` int32, valid ``[..., top_k]`` bool): a slot is
    invalid when there are fewer candidates than ``top_k``.
    """
    n = gates.shape[-1]
    chunks = mx.arange(n, dtype=mx.int32)
    open_ = chunks < own_chunk[..., None]
    gates = mx.where(open_, gates, -mx.inf)
    picked, valid = [], []
    for _ in range(top_k):
        best = mx.max(gates, axis=-1, keepdims=True)
        # the lowest index among the maxima: argmax's tie order is not documented
        idx = mx.min(mx.where(open_ & (gates == best), chunks, n), axis=-1)
        ok = idx < n
        idx = mx.where(ok, idx, 0)
        taken = chunks == idx[..., None]
        open_ = open_ & ~taken
        gates = mx.where(taken, -mx.inf, gates)
        picked.append(idx)
        valid.append(ok)
    return mx.stack(picked, axis=-1), mx.stack(valid, axis=-1)


def moba_selection(q: mx.array, k: mx.array, *, chunk_size: int, top_k: int):
    """The chunks each query attends besides its own: (indices, valid) ``[B, T, Hq, top_k]``.

    None when the rule gives full causal attention (top_k <= 0 or >= the earlier chunks).
    """
    _check(q, k, k, chunk_size, top_k)
    T = q.shape[1]
    if _is_full(T, chunk_size, top_k):
        return None
    gates = moba_gates(q, chunk_key_means(k, chunk_size))
    own = (mx.arange(T, dtype=mx.int32) // chunk_size)[None, :, None]
    idx, valid = select_top_k(gates, own, top_k)
    return mx.stop_gradient(idx), mx.stop_gradient(valid)


def selection_mask(idx, valid, T: int, chunk_size: int) -> mx.array:
    """The selection as a key mask ``[B, Hq, T, T]`` bool (own chunk causal + chosen chunks).

    For tests and the dense reference only: it is O(T^2).
    """
    t = mx.arange(T)
    key_chunk = t // chunk_size
    own = (key_chunk[:, None] == key_chunk[None, :]) & (t[None, :] <= t[:, None])  # [T, T]
    chosen = (key_chunk[None, None, None, :, None] == idx[:, :, :, None, :]) & valid[
        :, :, :, None, :
    ]  # [B, T, Hq, T(keys), top_k]
    mask = chosen.any(axis=-1) | own[None, :, None, :]
    return mask.transpose(0, 2, 1, 3)


def moba_attention_ref(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """Dense causal attention with the MoBA mask built explicitly: the O(T^2) reference."""
    _check(q, k, v, chunk_size, top_k)
    B, T, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    sel = moba_selection(q, k, chunk_size=chunk_size, top_k=top_k)
    qh = q.astype(mx.float32).transpose(0, 2, 1, 3)
    kh = k.astype(mx.float32).transpose(0, 2, 1, 3)
    vh = v.astype(mx.float32).transpose(0, 2, 1, 3)
    if sel is None:
        out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask="causal")
    else:
        mask = selection_mask(*sel, T, chunk_size)
        out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def _slots(q, k, sel, chunk_size: int):
    """Every (query row, chunk) pair to compute: the own chunk first, then the chosen ones.

    Returns chunk ``[B, T, Hq, K + 1]`` int32 and ``limit`` (the last key offset within that
    chunk the query may see: ``t % chunk_size`` in its own chunk, the whole chunk otherwise,
    -1 for an empty slot).
    """
    B, T, Hq, _ = q.shape
    t = mx.arange(T, dtype=mx.int32)[None, :, None, None]
    own = t // chunk_size
    own_limit = t % chunk_size
    if sel is None:
        return mx.broadcast_to(own, (B, T, Hq, 1)), mx.broadcast_to(own_limit, (B, T, Hq, 1))
    idx, valid = sel
    limit = mx.where(valid, chunk_size - 1, -1).astype(mx.int32)
    chunk = mx.concatenate([mx.broadcast_to(own, (B, T, Hq, 1)), idx], axis=-1)
    limit = mx.concatenate([mx.broadcast_to(own_limit, (B, T, Hq, 1)), limit], axis=-1)
    return chunk, limit


@dataclass(frozen=True)
class _Pairs:
    """The (query row, key chunk) pairs of one call, sorted by chunk matrix."""

    rows: mx.array  # [P] uint32: row (b, t, h) of q, flattened
    mats: mx.array  # [P] uint32: chunk matrix (b, kv head, chunk), flattened
    keep: mx.array  # [P, 1, cs] bool: which keys of the chunk the row sees
    segments: mx.array  # [M, 2] uint32: each matrix's run in the sorted pairs


def _pairs(chunk, limit, Hkv: int, n_chunks: int, cs: int) -> _Pairs:
    B, T, Hq, S = chunk.shape
    kv_head = (mx.arange(Hq, dtype=mx.int32) // (Hq // Hkv))[None, None, :, None]
    batch = mx.arange(B, dtype=mx.int32)[:, None, None, None]
    mats = ((batch * Hkv + kv_head) * n_chunks + chunk).reshape(-1)
    rows = mx.broadcast_to(mx.arange(B * T * Hq, dtype=mx.int32).reshape(B, T, Hq, 1), chunk.shape)
    order = mx.argsort(mats)
    mats = mats[order]
    n_mats = B * Hkv * n_chunks
    counts = mx.zeros((n_mats,), dtype=mx.int32).at[mats].add(1)
    ends = mx.cumsum(counts)
    keep = mx.arange(cs, dtype=mx.int32) <= limit.reshape(-1)[order][:, None]
    return _Pairs(
        rows=rows.reshape(-1)[order].astype(mx.uint32),
        mats=mats.astype(mx.uint32),
        keep=keep[:, None, :],
        segments=mx.stack([ends - counts, ends], axis=-1).astype(mx.uint32),
    )


def _chunked_kv(x: mx.array, n_chunks: int, cs: int) -> mx.array:
    """``[B, T, Hkv, D]`` -> float32 ``[B * Hkv * n_chunks, cs, D]``, zero-padded in time."""
    B, T, Hkv, D = x.shape
    x = x.astype(mx.float32)
    pad = n_chunks * cs - T
    if pad:
        x = mx.concatenate([x, mx.zeros((B, pad, Hkv, D), dtype=mx.float32)], axis=1)
    return x.reshape(B, n_chunks, cs, Hkv, D).transpose(0, 3, 1, 2, 4).reshape(-1, cs, D)


def _unchunked(x: mx.array, B: int, T: int, Hkv: int) -> mx.array:
    """Inverse of ``_chunked_kv``: ``[B * Hkv * n_chunks, cs, D]`` -> ``[B, T, Hkv, D]``."""
    _, cs, D = x.shape
    x = x.reshape(B, Hkv, -1, D).transpose(0, 2, 1, 3)
    return x[:, :T]


def _probs(q_rows, K, pairs: _Pairs, scale: float, lse=None):
    """Scores of every pair, ``[P, 1, cs]``, masked; with ``lse`` the normalised probabilities."""
    s = mx.gather_mm(q_rows, mx.swapaxes(K, -1, -2), pairs.rows, pairs.mats, sorted_indices=True)
    s = mx.where(pairs.keep, s * scale, -mx.inf)
    if lse is None:
        return s
    return mx.exp(s - lse[pairs.rows][:, None, None])


def _sparse_forward(q, k, v, chunk, limit, cs: int, scale: float):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    n_chunks = -(-T // cs)
    pairs = _pairs(chunk, limit, Hkv, n_chunks, cs)
    K, V = _chunked_kv(k, n_chunks, cs), _chunked_kv(v, n_chunks, cs)
    q_rows = q.astype(mx.float32).reshape(-1, 1, D)
    R = q_rows.shape[0]
    s = _probs(q_rows, K, pairs, scale)  # [P, 1, cs]
    # softmax over all pairs of a row: a row max by scatter, then sums by scatter-add
    row_max = mx.full((R,), -mx.inf).at[pairs.rows].maximum(mx.max(s, axis=(1, 2)))
    p = mx.exp(s - row_max[pairs.rows][:, None, None])  # masked keys: exp(-inf) = 0
    row_sum = mx.zeros((R,)).at[pairs.rows].add(mx.sum(p, axis=(1, 2)))
    pv = mx.gather_mm(p, V, None, pairs.mats, sorted_indices=True)  # [P, 1, D]
    out = mx.zeros((R, D)).at[pairs.rows].add(pv[:, 0]) / row_sum[:, None]
    lse = row_max + mx.log(row_sum)
    return out.reshape(B, T, Hq, D), lse


@functools.cache
def _sparse_fn(cs: int, scale: float):
    """The sparse attention of one (chunk size, scale) as a custom function with a hand VJP."""

    @mx.custom_function
    def sparse(q, k, v, chunk, limit):
        out, lse = _sparse_forward(q, k, v, chunk, limit, cs, scale)
        return out.astype(q.dtype), lse

    @sparse.vjp
    def sparse_vjp(primals, cotangents, outputs):
        q, k, v, chunk, limit = primals
        B, T, Hq, D = q.shape
        Hkv = k.shape[2]
        n_chunks = -(-T // cs)
        pairs = _pairs(chunk, limit, Hkv, n_chunks, cs)
        K, V = _chunked_kv(k, n_chunks, cs), _chunked_kv(v, n_chunks, cs)
        q_rows = q.astype(mx.float32).reshape(-1, 1, D)
        R = q_rows.shape[0]
        p = _probs(q_rows, K, pairs, scale, lse=outputs[1])  # [P, 1, cs], the forward's softmax
        d_rows = cotangents[0].astype(mx.float32).reshape(R, 1, D)
        dp = mx.gather_mm(
            d_rows, mx.swapaxes(V, -1, -2), pairs.rows, pairs.mats, sorted_indices=True
        )
        # sum_s p dp over a row's keys = <d_out, out>: the softmax's own correction term
        row_dot = mx.zeros((R,)).at[pairs.rows].add(mx.sum(p * dp, axis=(1, 2)))
        ds = p * (dp - row_dot[pairs.rows][:, None, None])  # [P, 1, cs]
        dq_pairs = mx.gather_mm(ds, K, None, pairs.mats, sorted_indices=True)  # [P, 1, D]
        dq = mx.zeros((R, D)).at[pairs.rows].add(dq_pairs[:, 0]) * scale
        # per key chunk: the sum over the pairs that read it (a run of the sorted pairs)
        dK = mx.segmented_mm(ds[:, 0].T, q_rows[pairs.rows][:, 0], pairs.segments) * scale
        dV = mx.segmented_mm(p[:, 0].T, d_rows[pairs.rows][:, 0], pairs.segments)
        return (
            dq.reshape(B, T, Hq, D).astype(q.dtype),
            _unchunked(dK, B, T, Hkv).astype(k.dtype),
            _unchunked(dV, B, T, Hkv).astype(v.dtype),
            mx.zeros_like(chunk),
            mx.zeros_like(limit),
        )

    return sparse


def moba_attention_blockwise(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA over the selected chunks only: O(T (top_k + 1) chunk_size) work and memory.

    Each (query, chunk) pair, the query's own chunk included, is one row-times-chunk product
    (``mx.gather_mm`` over pairs sorted by chunk); the softmax spans all pairs of a query. The
    hand VJP recomputes the probabilities from the saved log-sum-exp and sums each key chunk's
    gradient over the pairs that read it (``mx.segmented_mm``). Full causal attention (the rule
    with top_k <= 0 or >= the earlier chunks) goes to ``mx.fast.scaled_dot_product_attention``.
    """
    _check(q, k, v, chunk_size, top_k)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    sel = moba_selection(q, k, chunk_size=chunk_size, top_k=top_k)
    if sel is None:
        return _causal_sdpa(q, k, v, scale)
    chunk, limit = _slots(q, k, sel, chunk_size)
    out, _ = _sparse_fn(chunk_size, scale)(q, k, v, chunk, limit)
    return out


def _causal_sdpa(q, k, v, scale: float) -> mx.array:
    qh, kh, vh = (x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask="causal")
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


ENV_VAR = "MLX_RWKVX_MOBA"


def moba_attention(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA sparse causal attention (see the module docstring for the selection rule).

    q ``[B, T, Hq, D]``, k and v ``[B, T, Hkv, D]`` (Hq a multiple of Hkv), float32, bfloat16 or
    float16; scale defaults to 1/sqrt(D). Softmax and accumulation in float32; returns
    ``[B, T, Hq, D]`` in q's dtype. Gradients w.r.t. q, k, v are exact for the selection, which
    is held fixed. ``MLX_RWKVX_MOBA=ref|blockwise`` forces an implementation.
    """
    choice = os.environ.get(ENV_VAR, "")
    if choice not in ("", "ref", "blockwise"):
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of blockwise, ref")
    impl = moba_attention_ref if choice == "ref" else moba_attention_blockwise
    return impl(q, k, v, chunk_size=chunk_size, top_k=top_k, scale=scale)
