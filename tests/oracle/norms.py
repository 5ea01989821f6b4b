"""LayerNorm, RMSNorm and per-head GroupNorm: float64 forward and hand backward.

Every norm works over the last axis of ``x [..., C]``; weight and bias are ``[C]`` and their
gradients are summed over all leading axes. Variances are biased (divide by the group size),
as in torch's LayerNorm / GroupNorm and Qwen2's RMSNorm.
"""

from __future__ import annotations

import numpy as np


def _sum_leading(x: np.ndarray) -> np.ndarray:
    """Sum over every axis but the last: ``[..., C] -> [C]``."""
    return x.reshape(-1, x.shape[-1]).sum(axis=0)


def _standardize(x: np.ndarray, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(x - mean) / sqrt(var + eps)`` over the last axis; returns (xhat, rstd [..., 1])."""
    xc = x - x.mean(axis=-1, keepdims=True)
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=-1, keepdims=True) + eps)
    return xc * rstd, rstd


def _standardize_bwd(xhat: np.ndarray, rstd: np.ndarray, dxhat: np.ndarray) -> np.ndarray:
    mean_d = dxhat.mean(axis=-1, keepdims=True)
    mean_dx = (dxhat * xhat).mean(axis=-1, keepdims=True)
    return rstd * (dxhat - mean_d - xhat * mean_dx)


def layer_norm_fwd_np(x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = 1e-5):
    """LayerNorm over the last axis. x ``[..., C]``, w, b ``[C]`` -> (y ``[..., C]``, cache)."""
    xhat, rstd = _standardize(x, eps)
    return xhat * w + b, (xhat, rstd, w)


def layer_norm_bwd_np(cache, dy: np.ndarray):
    """Returns (dx ``[..., C]``, dw ``[C]``, db ``[C]``)."""
    xhat, rstd, w = cache
    dx = _standardize_bwd(xhat, rstd, dy * w)
    return dx, _sum_leading(dy * xhat), _sum_leading(dy)


def rms_norm_fwd_np(x: np.ndarray, w: np.ndarray, eps: float = 1e-6):
    """Qwen2 RMSNorm: ``x / sqrt(mean(x^2) + eps) * w`` over the last axis -> (y, cache)."""
    rstd = 1.0 / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps)
    xhat = x * rstd
    return xhat * w, (xhat, rstd, w)


def rms_norm_bwd_np(cache, dy: np.ndarray):
    """Returns (dx ``[..., C]``, dw ``[C]``)."""
    xhat, rstd, w = cache
    dxhat = dy * w
    dx = rstd * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))
    return dx, _sum_leading(dy * xhat)


def group_norm_fwd_np(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, n_groups: int, eps: float = 64e-5
):
    """GroupNorm of the last axis split into ``n_groups`` contiguous groups, affine w, b ``[C]``.

    RWKV-7's ``ln_x``: one group per head, eps = 1e-5 * head_size_divisor^2 = 64e-5.
    """
    C = x.shape[-1]
    xg = x.reshape(*x.shape[:-1], n_groups, C // n_groups)  # [..., G, C/G]
    xhat, rstd = _standardize(xg, eps)
    xhat = xhat.reshape(x.shape)  # [..., C]
    return xhat * w + b, (xhat, rstd, w, n_groups)


def group_norm_bwd_np(cache, dy: np.ndarray):
    """Returns (dx ``[..., C]``, dw ``[C]``, db ``[C]``)."""
    xhat, rstd, w, n_groups = cache
    C = xhat.shape[-1]
    group_shape = (*xhat.shape[:-1], n_groups, C // n_groups)
    dxhat = (dy * w).reshape(group_shape)
    dx = _standardize_bwd(xhat.reshape(group_shape), rstd, dxhat).reshape(xhat.shape)
    return dx, _sum_leading(dy * xhat), _sum_leading(dy)
