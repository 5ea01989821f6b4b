"""What the ops share: the dtypes and head sizes they take, a faster exponential, and the
tolerances of the kernels' self-checks."""

from __future__ import annotations

import mlx.core as mx

FLOAT_DTYPES = (mx.float32, mx.bfloat16, mx.float16)
HEAD_SIZES = (16, 32, 64, 128)  # WKV7 head sizes, and MoBA head dims the kernels take
# kernel vs MLX path on a tiny problem: both are ~1e-7 from the oracle in float32; bf16/fp16
# inputs round at ~1e-2 (DESIGN.md's bounds for them)
SELF_CHECK_TOL = {mx.float32: 1e-4, mx.bfloat16: 5e-2, mx.float16: 5e-2}
_LOG2E = 1.4426950408889634


def require_arrays(op: str, arrays: dict, **optional) -> None:
    """A TypeError naming the first argument that is not an ``mx.array`` (lists and NumPy
    arrays included: convert them with ``mx.array`` first); ``optional`` ones may be None."""
    for name, x in {**arrays, **{n: x for n, x in optional.items() if x is not None}}.items():
        if not isinstance(x, mx.array):
            raise TypeError(f"{op}: {name} must be an mx.array, got {type(x).__name__}")


def pow2_exp(x: mx.array) -> mx.array:
    """``e^x`` as ``2^(x log2 e)``: MLX's CPU exp runs ~3x slower at the same ~3e-7 relative
    accuracy over the exponents the ops use (|x| <= 64)."""
    return mx.power(2.0, x * _LOG2E)


@mx.custom_function
def fast_exp(x: mx.array) -> mx.array:
    """``pow2_exp`` for code that autograd differentiates: its VJP reuses the output. (A custom
    function keeps its input alive longer: code with a hand VJP uses ``pow2_exp``.)"""
    return pow2_exp(x)


@fast_exp.vjp
def _fast_exp_vjp(primals, cotangent, output):
    return cotangent * output
