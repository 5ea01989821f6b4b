"""WKV7 as a plain step loop in MLX ops: the reference every fast path is tested against,
and the single-token decode step."""

from __future__ import annotations

from mlx_rwkvx.ops.wkv7.contract import check_inputs, zero_state

import mlx.core as mx


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
    check_inputs(r, log_w, k, v, a, b, state)
    return step_loop(r, log_w, k, v, a, b, state)


def step_loop(r, log_w, k, v, a, b, state) -> tuple[mx.array, mx.array]:
    """``wkv7_ref`` without the argument checks (the dispatcher ran them)."""
    state = zero_state(r) if state is None else state
    ys = []
    for t in range(r.shape[1]):
        y, state = wkv7_step(r[:, t], log_w[:, t], k[:, t], v[:, t], a[:, t], b[:, t], state)
        ys.append(y)
    return mx.stack(ys, axis=1), state
