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
from mlx_rwkvx.ops.common import FLOAT_DTYPES, HEAD_SIZES, SELF_CHECK_TOL, pow2_exp, require_arrays
from mlx_rwkvx.ops.dispatch import SelfCheck, agree

import mlx.core as mx

_runtime.configure()


def _check(q, k, v, chunk_size, top_k) -> None:
    """One ValueError naming the first argument that does not fit (TypeError for one that is
    not an mx.array)."""
    require_arrays("moba_attention", {"q": q, "k": k, "v": v})
    if type(chunk_size) is not int or chunk_size < 1:
        raise ValueError(f"moba_attention: chunk_size must be an int >= 1, got {chunk_size!r}")
    if type(top_k) is not int:
        raise ValueError(f"moba_attention: top_k must be an int, got {top_k!r}")
    if q.ndim != 4 or 0 in q.shape:
        raise ValueError(
            f"moba_attention: q must be [B, T, Hq, D], none of them 0, got shape {tuple(q.shape)}"
        )
    B, T, Hq, D = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] < T or x.shape[3] != D or not x.shape[2]:
            raise ValueError(
                f"moba_attention: {name} has shape {tuple(x.shape)}, expected "
                f"[{B}, S >= {T}, Hkv >= 1, {D}] (batch and head dim of q, at least its length)"
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


def _is_full(S: int, chunk_size: int, top_k: int) -> bool:
    """True when every query attends to every earlier chunk (S keys): plain causal attention."""
    return top_k <= 0 or top_k >= (S - 1) // chunk_size


def _positions(q: mx.array, k: mx.array) -> mx.array:
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
    _check(q, k, k, chunk_size, top_k)
    if _is_full(k.shape[1], chunk_size, top_k):
        return None
    gates = moba_gates(q, chunk_key_means(k, chunk_size))
    own = (_positions(q, k) // chunk_size)[None, :, None]
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


def moba_attention_ref(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """Dense causal attention with the MoBA mask built explicitly: the O(T^2) reference."""
    _check(q, k, v, chunk_size, top_k)
    B, T, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    sel = moba_selection(q, k, chunk_size=chunk_size, top_k=top_k)
    mask = selection_mask(sel, T, k.shape[1], chunk_size)
    qh, kh, vh = (x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def _slots(q, k, sel, chunk_size: int):
    """Every (query row, chunk) pair to compute: the own chunk first, then the chosen ones.

    Returns chunk ``[B, T, Hq, K + 1]`` int32 and ``limit`` (the last key offset within that
    chunk the query may see: ``t % chunk_size`` in its own chunk, the whole chunk otherwise,
    -1 for an empty slot).
    """
    B, T, Hq, _ = q.shape
    t = _positions(q, k)[None, :, None, None]
    own = t // chunk_size
    own_limit = t % chunk_size
    if sel is None:
        return mx.broadcast_to(own, (B, T, Hq, 1)), mx.broadcast_to(own_limit, (B, T, Hq, 1))
    idx, valid = sel
    limit = mx.where(valid, chunk_size - 1, -1).astype(mx.int32)
    chunk = mx.concatenate([mx.broadcast_to(own, (B, T, Hq, 1)), idx], axis=-1)
    limit = mx.concatenate([mx.broadcast_to(own_limit, (B, T, Hq, 1)), limit], axis=-1)
    return chunk, limit


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


def moba_attention_blockwise(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA over the selected chunks only: O(T (top_k + 1) chunk_size) work and memory.

    Each (query, chunk) pair, the query's own chunk included, is one row-times-chunk product
    (``mx.gather_mm`` over pairs sorted by chunk); the softmax spans all pairs of a query. The
    hand VJP recomputes the probabilities from the saved log-sum-exp and sums each key chunk's
    gradient over the pairs that read it (``mx.segmented_mm``). Full causal attention (the rule
    with top_k <= 0 or >= the earlier chunks) goes to ``mx.fast.scaled_dot_product_attention``.
    """
    return _moba(q, k, v, chunk_size, top_k, scale, _sparse_fn)


def moba_kernel(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA with the selected-chunk attention in one Metal/CUDA kernel per direction
    (``ops/moba_kernel.py``); same contract. RuntimeError where the device has no kernel."""
    fn = _kernel_fn(q.shape[-1])
    if fn is None:
        raise RuntimeError(
            f"moba_kernel needs MLX with a Metal or CUDA device and a head dim in {HEAD_SIZES} "
            f"(got {q.shape[-1]})"
        )
    return _moba(q, k, v, chunk_size, top_k, scale, fn)


def _moba(q, k, v, chunk_size, top_k, scale, sparse_fn) -> mx.array:
    _check(q, k, v, chunk_size, top_k)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    sel = moba_selection(q, k, chunk_size=chunk_size, top_k=top_k)
    if sel is None:
        return _causal_sdpa(q, k, v, scale)
    chunk, limit = _slots(q, k, sel, chunk_size)
    out, _ = sparse_fn(chunk_size, scale)(q, k, v, chunk, limit)
    return out


def _kernel_fn(head_dim: int | None = None):
    """The kernel's sparse function where the device has a kernel (for ``head_dim``)."""
    from mlx_rwkvx.ops.mlx_kernels import kernel_backend
    from mlx_rwkvx.ops.moba_kernel import moba_kernel_fn

    if kernel_backend() is None or (head_dim is not None and head_dim not in HEAD_SIZES):
        return None
    return moba_kernel_fn


_self_check = SelfCheck("MoBA", "blockwise")


def _kernel_passes_self_check(D: int, dtype) -> bool:
    """Once per (D, dtype): the kernel against the blockwise path, outputs and gradients."""

    def check() -> bool:
        keys = mx.random.split(mx.random.key(0), 3)
        q = mx.random.normal((1, 50, 4, D), key=keys[0]).astype(dtype)
        k, v = (mx.random.normal((1, 50, 2, D), key=key).astype(dtype) for key in keys[1:])

        def run(impl):
            f = functools.partial(impl, chunk_size=8, top_k=2)
            grads = mx.grad(lambda *a: f(*a).astype(mx.float32).sum(), argnums=(0, 1, 2))
            return [f(q, k, v), *grads(q, k, v)]

        tol = SELF_CHECK_TOL[dtype]
        return agree(run(moba_kernel), run(moba_attention_blockwise), tol)

    return _self_check.passes((D, dtype), check)


def _causal_sdpa(q, k, v, scale: float) -> mx.array:
    qh, kh, vh = (x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    T, S = q.shape[1], k.shape[1]
    mask = "causal" if T == S else selection_mask(None, T, S, 1)
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


ENV_VAR = "MLX_RWKVX_MOBA"


def moba_attention(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA sparse causal attention (see the module docstring for the selection rule).

    q ``[B, T, Hq, D]``, k and v ``[B, S, Hkv, D]`` (S >= T: the queries are the last T of S
    positions; Hq a multiple of Hkv), float32, bfloat16 or float16; scale defaults to
    1/sqrt(D). Softmax and accumulation in float32; returns ``[B, T, Hq, D]`` in q's dtype.
    Gradients w.r.t. q, k, v are exact for the selection, which is held fixed. Uses the kernel
    where the device has one and it passed its self-check, else the blockwise path;
    ``MLX_RWKVX_MOBA=ref|blockwise|kernel`` forces one.
    """
    require_arrays("moba_attention", {"q": q, "k": k, "v": v})
    choice = os.environ.get(ENV_VAR, "")
    impls = {"ref": moba_attention_ref, "blockwise": moba_attention_blockwise,
             "kernel": moba_kernel}  # fmt: skip
    if choice and choice not in impls:
        raise ValueError(f"{ENV_VAR}={choice!r}: expected one of blockwise, kernel, ref")
    if not choice:
        use_kernel = _kernel_fn(q.shape[-1]) is not None
        if use_kernel:
            _check(q, k, v, chunk_size, top_k)
            use_kernel = _kernel_passes_self_check(q.shape[-1], q.dtype)
        choice = "kernel" if use_kernel else "blockwise"
    return impls[choice](q, k, v, chunk_size=chunk_size, top_k=top_k, scale=scale)


class MobaKVCache:
    """Keys and values of one MoBA block, head-major ``[B, Hkv, capacity, D]``, growing by whole
    chunks, with the key sum of every chunk so that decode ranks chunks without re-reading keys.
    """

    def __init__(self, chunk_size: int):
        if not isinstance(chunk_size, int) or chunk_size < 1:
            raise ValueError(f"MobaKVCache: chunk_size must be an int >= 1, got {chunk_size!r}")
        self.chunk_size = chunk_size
        self.keys = None
        self.values = None
        self.key_sums = None  # [B, Hkv, capacity // chunk_size, D] float32
        self.offset = 0

    def update(self, k: mx.array, v: mx.array) -> None:
        """Append ``k, v [B, T_new, Hkv, D]`` (the new tokens' keys and values)."""
        B, n_new, Hkv, D = k.shape
        cs = self.chunk_size
        start, stop = self.offset, self.offset + n_new
        need = -(-stop // cs) * cs
        if self.keys is None or need > self.keys.shape[2]:
            capacity = max(need, 2 * (0 if self.keys is None else self.keys.shape[2]))
            keys = mx.zeros((B, Hkv, capacity, D), dtype=k.dtype)
            values = mx.zeros((B, Hkv, capacity, D), dtype=v.dtype)
            sums = mx.zeros((B, Hkv, capacity // cs, D), dtype=mx.float32)
            if self.keys is not None:
                keys[:, :, :start] = self.keys[:, :, :start]
                values[:, :, :start] = self.values[:, :, :start]
                sums[:, :, : self.key_sums.shape[2]] = self.key_sums
            self.keys, self.values, self.key_sums = keys, values, sums
        self.keys[:, :, start:stop] = k.transpose(0, 2, 1, 3)
        self.values[:, :, start:stop] = v.transpose(0, 2, 1, 3)
        first, last = start // cs, (stop - 1) // cs + 1  # the chunks these tokens fall in
        span = self.keys[:, :, first * cs : last * cs].astype(mx.float32)
        self.key_sums[:, :, first:last] = span.reshape(B, Hkv, last - first, cs, D).sum(axis=3)
        self.offset = stop

    def kv(self) -> tuple[mx.array, mx.array]:
        """All cached keys and values, time-major ``[B, offset, Hkv, D]`` (for a prefill)."""
        k = self.keys[:, :, : self.offset].transpose(0, 2, 1, 3)
        return k, self.values[:, :, : self.offset].transpose(0, 2, 1, 3)


def moba_decode(q: mx.array, cache: MobaKVCache, *, top_k: int, scale=None) -> mx.array:
    """MoBA attention of one new token, ``q [B, 1, Hq, D]``, against ``cache``, which must
    already hold that token's key and value. Reads the key sums of the earlier chunks, then only
    the chosen chunks and the own chunk: O(n_chunks + (top_k + 1) chunk_size) per head.
    Equals the last row of ``moba_attention`` over the whole sequence.
    """
    B, n, Hq, D = q.shape
    if n != 1 or cache.keys is None or cache.keys.shape[0] != B or cache.keys.shape[3] != D:
        raise ValueError(
            f"moba_decode: q must be [B, 1, Hq, D] matching a non-empty cache, got {q.shape}"
        )
    cs, t = cache.chunk_size, cache.offset - 1
    Hkv = cache.keys.shape[1]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    own = t // cs
    qg = q[:, 0].astype(mx.float32).reshape(B, Hkv, G, D)
    full = _is_full(t + 1, cs, top_k)
    first = 0 if full else own * cs  # keys read by every query head of a kv head
    shared_k = cache.keys[:, :, first : t + 1].astype(mx.float32)  # [B, Hkv, n, D]
    shared_v = cache.values[:, :, first : t + 1].astype(mx.float32)
    logits = qg @ mx.swapaxes(shared_k, -1, -2)  # [B, Hkv, G, n]
    if not full:
        means = cache.key_sums[:, :, :own] / cs  # [B, Hkv, own, D]
        gates = (qg @ mx.swapaxes(means, -1, -2)).reshape(B, Hq, own)
        idx, valid = select_top_k(gates, mx.array(own), top_k)  # [B, Hq, top_k]
        kv_head = mx.arange(Hq) // G
        flat = ((mx.arange(B)[:, None] * Hkv + kv_head[None, :]) * own)[..., None] + idx
        chunks_k = cache.keys[:, :, : own * cs].reshape(B * Hkv * own, cs, D)
        chunks_v = cache.values[:, :, : own * cs].reshape(B * Hkv * own, cs, D)
        sel_k = chunks_k[flat].reshape(B, Hkv, G, -1, D).astype(mx.float32)  # top_k * cs keys
        sel_v = chunks_v[flat].reshape(B, Hkv, G, -1, D).astype(mx.float32)
        sel = (qg[..., None, :] @ mx.swapaxes(sel_k, -1, -2))[..., 0, :]  # [B, Hkv, G, top_k cs]
        sel = mx.where(mx.repeat(valid, cs, axis=-1).reshape(sel.shape), sel, -mx.inf)
        logits = mx.concatenate([logits, sel], axis=-1)
    probs = mx.softmax(logits * scale, axis=-1, precise=True)
    n = shared_k.shape[2]
    out = probs[..., :n] @ shared_v
    if not full:
        out = out + (probs[..., None, n:] @ sel_v)[..., 0, :]
    return out.reshape(B, 1, Hq, D).astype(q.dtype)
