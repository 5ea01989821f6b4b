"""MoBA's chunk selection: per query and head, the own chunk plus the ``top_k`` earlier chunks
whose mean key scores highest (ties: the lower chunk index); and the (query, chunk) slots the
attention paths compute. The selection carries no gradient (it is held fixed)."""

from __future__ import annotations

from mlx_rwkvx.ops.moba.contract import check_inputs

import mlx.core as mx


def is_full(S: int, chunk_size: int, top_k: int) -> bool:
    """True when every query attends to every earlier chunk (S keys): plain causal attention."""
    return top_k <= 0 or top_k >= (S - 1) // chunk_size


def positions(q: mx.array, k: mx.array) -> mx.array:
    """Positions of the queries: the last ``T`` of the ``S`` keys, ``[T]`` int32."""
    T, S = q.shape[1], k.shape[1]
    return mx.arange(S - T, S, dtype=mx.int32)


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
    check_inputs(q, k, k, chunk_size, top_k)
    return select(q, k, chunk_size, top_k)


def select(q: mx.array, k: mx.array, chunk_size: int, top_k: int):
    """``moba_selection`` without the argument checks."""
    if is_full(k.shape[1], chunk_size, top_k):
        return None
    gates = moba_gates(q, chunk_key_means(k, chunk_size))
    own = (positions(q, k) // chunk_size)[None, :, None]
    idx, valid = select_top_k(gates, own, top_k)
    return mx.stop_gradient(idx), mx.stop_gradient(valid)


def selection_mask(sel, T: int, S: int, chunk_size: int) -> mx.array:
    """A selection as a key mask ``[B, Hq, T, S]`` bool (``[1, 1, T, S]`` for None = causal).

    Queries are the last T of the S positions. For tests and the dense reference only: O(T S).
    """
    t = mx.arange(S - T, S)[:, None]
    s = mx.arange(S)[None, :]
    causal = s <= t
    if sel is None:
        return causal[None, None]
    idx, valid = sel
    own = causal & (s // chunk_size == t // chunk_size)  # [T, S]
    key_chunk = (mx.arange(S) // chunk_size)[None, None, None, :, None]
    chosen = (key_chunk == idx[:, :, :, None, :]) & valid[:, :, :, None, :]  # [B, T, Hq, S, K]
    mask = chosen.any(axis=-1) | own[None, :, None, :]
    return mask.transpose(0, 2, 1, 3)


def slots(q, k, sel, chunk_size: int):
    """Every (query row, chunk) pair to compute: the own chunk first, then the chosen ones.

    Returns chunk ``[B, T, Hq, K + 1]`` int32 and ``limit`` (the last key offset within that
    chunk the query may see: ``t % chunk_size`` in its own chunk, the whole chunk otherwise,
    -1 for an empty slot).
    """
    B, T, Hq, _ = q.shape
    t = positions(q, k)[None, :, None, None]
    own = t // chunk_size
    own_limit = t % chunk_size
    if sel is None:
        return mx.broadcast_to(own, (B, T, Hq, 1)), mx.broadcast_to(own_limit, (B, T, Hq, 1))
    idx, valid = sel
    limit = mx.where(valid, chunk_size - 1, -1).astype(mx.int32)
    chunk = mx.concatenate([mx.broadcast_to(own, (B, T, Hq, 1)), idx], axis=-1)
    limit = mx.concatenate([mx.broadcast_to(own_limit, (B, T, Hq, 1)), limit], axis=-1)
    return chunk, limit
