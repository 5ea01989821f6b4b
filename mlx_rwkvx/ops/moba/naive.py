"""MoBA as dense causal attention with its mask built explicitly: the O(T^2) reference."""

from __future__ import annotations

import math

from mlx_rwkvx.ops.moba.contract import check_inputs
from mlx_rwkvx.ops.moba.selection import select, selection_mask

import mlx.core as mx


def moba_attention_ref(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """Dense causal attention with the MoBA mask built explicitly: the O(T^2) reference."""
    check_inputs(q, k, v, chunk_size, top_k)
    return dense(q, k, v, chunk_size, top_k, scale)


def dense(q, k, v, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """``moba_attention_ref`` without the argument checks."""
    B, T, Hq, D = q.shape
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    sel = select(q, k, chunk_size, top_k)
    mask = selection_mask(sel, T, k.shape[1], chunk_size)
    qh, kh, vh = (x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)


def causal_sdpa(q, k, v, scale: float) -> mx.array:
    qh, kh, vh = (x.astype(mx.float32).transpose(0, 2, 1, 3) for x in (q, k, v))
    T, S = q.shape[1], k.shape[1]
    mask = "causal" if T == S else selection_mask(None, T, S, 1)
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask=mask)
    return out.transpose(0, 2, 1, 3).astype(q.dtype)
