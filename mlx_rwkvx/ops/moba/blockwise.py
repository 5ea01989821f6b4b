"""MoBA over the selected chunks only, the fast MLX path (the selection rule and layouts: the
package's docstring). Every (query, chunk) pair, the own chunk included, is packed into tiles
of one chunk each, so every product is a small matmul; a hand VJP recomputes the probabilities
from the saved log-sum-exp. O(T (top_k + 1) chunk_size) work and memory, no host sync.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mlx_rwkvx.ops.common import pow2_exp
from mlx_rwkvx.ops.moba.contract import check_inputs
from mlx_rwkvx.ops.moba.naive import causal_sdpa
from mlx_rwkvx.ops.moba.selection import select, slots

import mlx.core as mx

TILE = 32  # query rows per tile: each tile is one (TILE x D) @ (D x chunk) matmul


@dataclass(frozen=True)
class _Tiles:
    """The (query row, key chunk) pairs of one call, packed into tiles of one chunk each.

    Pairs are sorted by chunk matrix (b, kv head, chunk) and each matrix's run is padded to
    whole tiles, so every tile is a plain matmul against one chunk. The tile count has a static
    bound (pairs / TILE + matrices): no host sync, unused tiles are empty.
    """

    rows: mx.array  # [S] int32: q row (b, t, h) of each slot, R (a dummy row) for empty slots
    keep: mx.array  # [n_tiles, TILE, cs] bool: the keys each slot's row sees
    mats: mx.array  # [n_tiles] uint32: the chunk matrix of each tile (ascending)
    segments: mx.array  # [M, 2] uint32: each matrix's slots [start, end)


def _tiles(chunk, limit, Hkv: int, n_chunks: int, cs: int) -> _Tiles:
    B, T, Hq, n_slots = chunk.shape
    R = B * T * Hq
    n_mats = B * Hkv * n_chunks
    kv_head = (mx.arange(Hq, dtype=mx.int32) // (Hq // Hkv))[None, None, :, None]
    batch = mx.arange(B, dtype=mx.int32)[:, None, None, None]
    mats = ((batch * Hkv + kv_head) * n_chunks + chunk).reshape(-1)  # [P]
    rows = mx.broadcast_to(mx.arange(R, dtype=mx.int32).reshape(B, T, Hq, 1), chunk.shape)
    order = mx.argsort(mats)
    mats, rows, limit = mats[order], rows.reshape(-1)[order], limit.reshape(-1)[order]
    P = mats.shape[0]
    counts = mx.zeros((n_mats,), dtype=mx.int32).at[mats].add(1)
    first_pair = mx.cumsum(counts) - counts
    n_tiles_of = (counts + TILE - 1) // TILE
    first_tile = mx.cumsum(n_tiles_of) - n_tiles_of
    rank = mx.arange(P, dtype=mx.int32) - first_pair[mats]  # position within its matrix's run
    slot = first_tile[mats] * TILE + rank
    n_tiles = -(-P // TILE) + n_mats
    slot_rows = mx.full((n_tiles * TILE,), R, dtype=mx.int32)
    slot_rows[slot] = rows
    slot_limit = mx.full((n_tiles * TILE,), -1, dtype=mx.int32)
    slot_limit[slot] = limit
    # unused tail tiles get the last matrix, so the tile list stays sorted (gather_mm's hint)
    tile_mats = mx.full((n_tiles,), n_mats - 1, dtype=mx.int32).at[slot // TILE].minimum(mats)
    keep = mx.arange(cs, dtype=mx.int32) <= slot_limit[:, None]
    start = first_tile * TILE
    return _Tiles(
        rows=slot_rows,
        keep=keep.reshape(n_tiles, TILE, cs),
        mats=tile_mats.astype(mx.uint32),
        segments=mx.stack([start, start + n_tiles_of * TILE], axis=-1).astype(mx.uint32),
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
    D = x.shape[-1]
    return x.reshape(B, Hkv, -1, D).transpose(0, 2, 1, 3)[:, :T]


def _per_slot(x_rows: mx.array, tiles: _Tiles) -> mx.array:
    """Rows ``[R, D]`` -> ``[n_tiles, TILE, D]`` by slot (zeros for empty slots)."""
    D = x_rows.shape[-1]
    padded = mx.concatenate([x_rows, mx.zeros((1, D), dtype=x_rows.dtype)], axis=0)
    return padded[tiles.rows].reshape(-1, TILE, D)


def _per_row(x_slots: mx.array, tiles: _Tiles, R: int) -> mx.array:
    """Sum of slots ``[n_tiles, TILE, ...]`` into their rows: ``[R, ...]``."""
    flat = x_slots.reshape(tiles.rows.shape[0], *x_slots.shape[2:])
    return mx.zeros((R + 1, *flat.shape[1:]), dtype=flat.dtype).at[tiles.rows].add(flat)[:R]


def _scores(q_slots, K, tiles: _Tiles, scale: float) -> mx.array:
    """Scaled scores of every slot against its tile's chunk, ``[n_tiles, TILE, cs]``, masked."""
    s = mx.gather_mm(q_slots, mx.swapaxes(K, -1, -2), None, tiles.mats, sorted_indices=True)
    return mx.where(tiles.keep, s * scale, -mx.inf)


def _sparse_forward(q, k, v, chunk, limit, cs: int, scale: float):
    B, T, Hq, D = q.shape
    Hkv = k.shape[2]
    n_chunks = -(-k.shape[1] // cs)
    R = B * T * Hq
    tiles = _tiles(chunk, limit, Hkv, n_chunks, cs)
    K, V = _chunked_kv(k, n_chunks, cs), _chunked_kv(v, n_chunks, cs)
    s = _scores(_per_slot(q.astype(mx.float32).reshape(R, D), tiles), K, tiles, scale)
    # softmax over all slots of a row: the row max by scatter-max, then sums by scatter-add
    slot_max = mx.max(s, axis=-1).reshape(-1)
    row_max = mx.full((R + 1,), -mx.inf).at[tiles.rows].maximum(slot_max)
    row_max = mx.where(row_max == -mx.inf, 0.0, row_max)  # the dummy row of empty slots
    p = pow2_exp(s - row_max[tiles.rows].reshape(-1, TILE, 1))  # masked keys: 0
    row_sum = _per_row(mx.sum(p, axis=-1, keepdims=True), tiles, R)[:, 0]
    pv = mx.gather_mm(p, V, None, tiles.mats, sorted_indices=True)  # [n_tiles, TILE, D]
    out = _per_row(pv, tiles, R) / row_sum[:, None]
    lse = row_max[:R] + mx.log(row_sum)
    return out.reshape(B, T, Hq, D), lse


@functools.cache
def sparse_fn(cs: int, scale: float):
    """The sparse attention of one (chunk size, scale) as a custom function with a hand VJP."""

    @mx.custom_function
    def sparse(q, k, v, chunk, limit):
        out, lse = _sparse_forward(q, k, v, chunk, limit, cs, scale)
        return out.astype(q.dtype), lse

    @sparse.vjp
    def sparse_vjp(primals, cotangents, outputs):
        q, k, v, chunk, limit = primals
        B, T, Hq, D = q.shape
        S, Hkv = k.shape[1], k.shape[2]
        n_chunks = -(-S // cs)
        R = B * T * Hq
        tiles = _tiles(chunk, limit, Hkv, n_chunks, cs)
        K, V = _chunked_kv(k, n_chunks, cs), _chunked_kv(v, n_chunks, cs)
        q_slots = _per_slot(q.astype(mx.float32).reshape(R, D), tiles)
        lse = mx.concatenate([outputs[1], mx.zeros((1,))])  # the dummy row: empty slots
        s = _scores(q_slots, K, tiles, scale)
        p = pow2_exp(s - lse[tiles.rows].reshape(-1, TILE, 1))  # the forward's probabilities
        d_slots = _per_slot(cotangents[0].astype(mx.float32).reshape(R, D), tiles)
        dp = mx.gather_mm(d_slots, mx.swapaxes(V, -1, -2), None, tiles.mats, sorted_indices=True)
        # sum_s p dp over a row's keys = <d_out, out>: the softmax's own correction term
        row_dot = _per_row(mx.sum(p * dp, axis=-1, keepdims=True), tiles, R)
        row_dot = mx.concatenate([row_dot, mx.zeros((1, 1))])
        ds = p * (dp - row_dot[tiles.rows].reshape(-1, TILE, 1))  # [n_tiles, TILE, cs]
        dq = _per_row(mx.gather_mm(ds, K, None, tiles.mats, sorted_indices=True), tiles, R)
        # each key chunk's gradient: a sum over its own run of slots
        flat_ds, flat_p = ds.reshape(-1, cs), p.reshape(-1, cs)
        dK = mx.segmented_mm(flat_ds.T, q_slots.reshape(-1, D), tiles.segments)
        dV = mx.segmented_mm(flat_p.T, d_slots.reshape(-1, D), tiles.segments)
        return (
            (dq * scale).reshape(B, T, Hq, D).astype(q.dtype),
            _unchunked(dK * scale, B, S, Hkv).astype(k.dtype),
            _unchunked(dV, B, S, Hkv).astype(v.dtype),
            mx.zeros_like(chunk),
            mx.zeros_like(limit),
        )

    return sparse


def attention(q, k, v, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """``moba_attention_blockwise`` without the argument checks (the dispatcher ran them)."""
    return sparse_attention(q, k, v, chunk_size, top_k, scale, sparse_fn)


def moba_attention_blockwise(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA over the selected chunks only: O(T (top_k + 1) chunk_size) work and memory.

    Each (query, chunk) pair, the query's own chunk included, is one row-times-chunk product
    (``mx.gather_mm`` over pairs sorted by chunk); the softmax spans all pairs of a query. The
    hand VJP recomputes the probabilities from the saved log-sum-exp and sums each key chunk's
    gradient over the pairs that read it (``mx.segmented_mm``). Full causal attention (the rule
    with top_k <= 0 or >= the earlier chunks) goes to ``mx.fast.scaled_dot_product_attention``.
    """
    check_inputs(q, k, v, chunk_size, top_k)
    return sparse_attention(q, k, v, chunk_size, top_k, scale, sparse_fn)


def sparse_attention(q, k, v, chunk_size, top_k, scale, sparse_fn) -> mx.array:
    """MoBA without the argument checks, the selected chunks computed by ``sparse_fn(chunk_size,
    scale)`` (this module's, or the kernel's); full causal attention by SDPA."""
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    sel = select(q, k, chunk_size, top_k)
    if sel is None:
        return causal_sdpa(q, k, v, scale)
    chunk, limit = slots(q, k, sel, chunk_size)
    out, _ = sparse_fn(chunk_size, scale)(q, k, v, chunk, limit)
    return out
