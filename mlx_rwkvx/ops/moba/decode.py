"""MoBA with a KV cache held as plain arrays: appending keys and values, and attending one new
token by reading only the chunks it selects.

The cache of one block is three arrays, all of their exact length (no capacity, no counter: the
length is the shape): keys and values head-major ``[B, Hkv, S, D]``, and the key sum of every
chunk so far ``[B, Hkv, ceil(S / chunk_size), D]`` float32 (the last one partial), so decode
ranks chunks without re-reading their keys.
"""

from __future__ import annotations

import math

from mlx_rwkvx.ops.common import require_arrays
from mlx_rwkvx.ops.moba.selection import is_full, select_top_k

import mlx.core as mx


def empty_kv(batch: int, n_kv_heads: int, head_dim: int, dtype) -> tuple[mx.array, ...]:
    """(keys, values, key sums) of an empty cache."""
    kv = mx.zeros((batch, n_kv_heads, 0, head_dim), dtype=dtype)
    return kv, kv, mx.zeros((batch, n_kv_heads, 0, head_dim), dtype=mx.float32)


def append_kv(keys, values, key_sums, k, v, chunk_size: int) -> tuple[mx.array, ...]:
    """The cache ``(keys, values, key_sums)`` with ``k, v [B, T_new, Hkv, D]`` (time-major, as
    the attention takes them) appended. The key sums of the chunks the new keys fall in are
    recomputed; earlier ones are kept."""
    S = keys.shape[2]
    keys = mx.concatenate([keys, k.transpose(0, 2, 1, 3).astype(keys.dtype)], axis=2)
    values = mx.concatenate([values, v.transpose(0, 2, 1, 3).astype(values.dtype)], axis=2)
    B, H, total, D = keys.shape
    first = S // chunk_size  # the first chunk the new keys touch
    n_chunks = -(-total // chunk_size)
    span = keys[:, :, first * chunk_size :].astype(mx.float32)
    pad = (n_chunks - first) * chunk_size - span.shape[2]
    if pad:
        span = mx.concatenate([span, mx.zeros((B, H, pad, D), dtype=mx.float32)], axis=2)
    sums = span.reshape(B, H, n_chunks - first, chunk_size, D).sum(axis=3)
    key_sums = mx.concatenate([key_sums[:, :, :first], sums], axis=2)
    return keys, values, key_sums


def time_major(x: mx.array) -> mx.array:
    """Cached keys or values ``[B, Hkv, S, D]`` as the attention takes them: ``[B, S, Hkv, D]``."""
    return x.transpose(0, 2, 1, 3)


def _check_decode(q, keys, values, key_sums, chunk_size, top_k) -> None:
    """One ValueError naming the first argument of ``moba_decode`` that does not fit."""
    require_arrays("moba_decode", {"q": q, "keys": keys, "values": values, "key_sums": key_sums})
    if type(chunk_size) is not int or chunk_size < 1:
        raise ValueError(f"moba_decode: chunk_size must be an int >= 1, got {chunk_size!r}")
    if type(top_k) is not int:
        raise ValueError(f"moba_decode: top_k must be an int, got {top_k!r}")
    if q.ndim != 4 or keys.ndim != 4 or q.shape[1] != 1 or keys.shape[2] == 0:
        raise ValueError(
            f"moba_decode: q must be [B, 1, Hq, D] matching a non-empty cache, got q "
            f"{tuple(q.shape)} and keys {tuple(keys.shape)}"
        )
    B, _, Hq, D = q.shape
    _, Hkv, S, _ = keys.shape
    n_chunks = -(-S // chunk_size)
    for name, x, want in (
        ("keys", keys, (B, Hkv, S, D)),
        ("values", values, (B, Hkv, S, D)),
        ("key_sums", key_sums, (B, Hkv, n_chunks, D)),
    ):
        if tuple(x.shape) != want:
            raise ValueError(f"moba_decode: {name} has shape {tuple(x.shape)}, expected {want}")
    if Hq % Hkv:
        raise ValueError(f"moba_decode: q has {Hq} heads, not a multiple of the {Hkv} of keys")
    if q.dtype != keys.dtype or values.dtype != keys.dtype or key_sums.dtype != mx.float32:
        raise ValueError(
            f"moba_decode: q, keys, values must share a dtype and key_sums be float32, got "
            f"{q.dtype}, {keys.dtype}, {values.dtype}, {key_sums.dtype}"
        )


def moba_decode(q, keys, values, key_sums, *, chunk_size: int, top_k: int, scale=None):
    """MoBA attention of one new token, ``q [B, 1, Hq, D]``, against a cache that already holds
    its key and value (see ``append_kv``). Reads the key sums of the earlier chunks, then only
    the chosen chunks and the own chunk: O(n_chunks + (top_k + 1) chunk_size) per head. Equals
    the last row of ``moba_attention`` over the whole sequence; returns ``[B, 1, Hq, D]`` in q's
    dtype, computed in float32."""
    _check_decode(q, keys, values, key_sums, chunk_size, top_k)
    B, _, Hq, D = q.shape
    cs, t = chunk_size, keys.shape[2] - 1
    Hkv = keys.shape[1]
    G = Hq // Hkv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    own = t // cs
    qg = q[:, 0].astype(mx.float32).reshape(B, Hkv, G, D)
    full = is_full(t + 1, cs, top_k)
    first = 0 if full else own * cs  # keys read by every query head of a kv head
    shared_k = keys[:, :, first : t + 1].astype(mx.float32)  # [B, Hkv, n, D]
    shared_v = values[:, :, first : t + 1].astype(mx.float32)
    logits = qg @ mx.swapaxes(shared_k, -1, -2)  # [B, Hkv, G, n]
    if not full:
        means = key_sums[:, :, :own] / cs  # [B, Hkv, own, D]
        gates = (qg @ mx.swapaxes(means, -1, -2)).reshape(B, Hq, own)
        idx, valid = select_top_k(gates, mx.array(own), top_k)  # [B, Hq, top_k]
        kv_head = mx.arange(Hq) // G
        flat = ((mx.arange(B)[:, None] * Hkv + kv_head[None, :]) * own)[..., None] + idx
        chunks_k = keys[:, :, : own * cs].reshape(B * Hkv * own, cs, D)
        chunks_v = values[:, :, : own * cs].reshape(B * Hkv * own, cs, D)
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
