"""WKV7's contract: the argument checks every entry point runs once, and the zero state."""

from __future__ import annotations

from mlx_rwkvx.ops.common import FLOAT_DTYPES, HEAD_SIZES, require_arrays

import mlx.core as mx

NAMES = ("r", "log_w", "k", "v", "a", "b")


def check_inputs(r, log_w, k, v, a, b, state) -> None:
    """One ValueError naming the first argument whose shape or dtype does not fit (TypeError
    for one that is not an mx.array)."""
    require_arrays("wkv7", dict(zip(NAMES, (r, log_w, k, v, a, b), strict=True)), state=state)
    if r.ndim != 4:
        raise ValueError(f"wkv7: r must be [B, T, H, N], got shape {tuple(r.shape)}")
    B, T, H, N = r.shape
    if T < 1 or N not in HEAD_SIZES:
        raise ValueError(
            f"wkv7: r must be [B, T>=1, H, N] with N in {HEAD_SIZES}, got shape {tuple(r.shape)}"
        )
    for name, x in zip(NAMES, (r, log_w, k, v, a, b), strict=True):
        if tuple(x.shape) != (B, T, H, N):
            raise ValueError(
                f"wkv7: {name} has shape {tuple(x.shape)}, expected {(B, T, H, N)} (that of r)"
            )
        if name == "log_w":
            if x.dtype != mx.float32:
                raise ValueError(
                    f"wkv7: log_w has dtype {x.dtype}, expected float32 (the log-decay is "
                    "always float32)"
                )
        elif x.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"wkv7: {name} has dtype {x.dtype}, expected one of float32, bfloat16, float16"
            )
        elif x.dtype != r.dtype:
            raise ValueError(f"wkv7: {name} has dtype {x.dtype}, expected {r.dtype} (that of r)")
    if state is not None:
        if tuple(state.shape) != (B, H, N, N):
            raise ValueError(f"wkv7: state has shape {tuple(state.shape)}, expected {(B, H, N, N)}")
        if state.dtype != mx.float32:
            raise ValueError(f"wkv7: state has dtype {state.dtype}, expected float32")


def zero_state(r: mx.array) -> mx.array:
    B, _, H, N = r.shape
    return mx.zeros((B, H, N, N), dtype=mx.float32)
