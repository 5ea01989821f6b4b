"""WKV7, the RWKV-7 recurrence (fla's layout: one package per op).

- ``contract.py``: the argument checks, run once per call;
- ``naive.py``: ``wkv7_ref`` (the step loop, the reference) and ``wkv7_step`` (decode);
- ``chunk.py``: ``wkv7_chunked``, the fast MLX path (derivation in README.md);
- ``kernel.py``: ``wkv7_kernel``, one Metal/CUDA kernel per direction, and
  ``wkv7_chunked_kernel``, the chunked form in four (bodies in ``mlx_rwkvx/metal/``);
- here: ``wkv7``, the dispatcher.
"""

from __future__ import annotations

from mlx_rwkvx.ops import tuning
from mlx_rwkvx.ops.dispatch import KERNEL, Dispatcher
from mlx_rwkvx.ops.wkv7 import chunk, kernel, naive
from mlx_rwkvx.ops.wkv7.chunk import CHUNK, wkv7_chunked
from mlx_rwkvx.ops.wkv7.contract import check_inputs
from mlx_rwkvx.ops.wkv7.kernel import wkv7_chunked_kernel, wkv7_kernel
from mlx_rwkvx.ops.wkv7.naive import wkv7_ref, wkv7_step

import mlx.core as mx

__all__ = [
    "CHUNK",
    "wkv7",
    "wkv7_chunked",
    "wkv7_chunked_kernel",
    "wkv7_kernel",
    "wkv7_ref",
    "wkv7_step",
]

ENV_VAR = "MLX_RWKVX_WKV7"
# Up to this many steps the step loop beats the chunked path (benchmarks/BENCHMARKS.md, wkv7)
REF_MAX_T = 8
# The step loop is measured against the chunked path up to this length bucket; beyond it the
# loop's autograd tape makes it slower everywhere and costly to time
REF_TUNE_MAX_T = 64


def _self_check_inputs(N: int, dtype) -> list:
    keys = mx.random.split(mx.random.key(0), 7)
    shape = (1, 37, 2, N)
    r, k, v = (mx.random.uniform(-0.5, 0.5, shape, key=keys[i]) for i in range(3))
    kk = mx.random.normal(shape, key=keys[3])
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    log_w = mx.log(mx.random.uniform(0.5, 0.999, shape, key=keys[4]))
    b = kk * mx.random.uniform(shape=shape, key=keys[5])
    state = mx.random.uniform(-0.5, 0.5, (1, 2, N, N), key=keys[6])
    args = [x.astype(dtype) for x in (r, log_w, k, v, -kk, b)] + [state]
    args[1] = log_w
    return args


def _outputs_and_grads(fn, args) -> dict:
    def loss(*xs):
        y, s = fn(*xs)
        return y.astype(mx.float32).sum() + s.sum()

    grads = mx.grad(loss, argnums=list(range(7)))(*args)
    names = ["y", "state", *(f"d{n}" for n in ("r", "log_w", "k", "v", "a", "b", "state0"))]
    return dict(zip(names, [*fn(*args), *grads], strict=True))


def _self_check(key, impl) -> dict:
    """``impl``'s outputs and gradients on the problem of ``key = (N, dtype)`` (lazy)."""
    N, dtype = key
    return _outputs_and_grads(impl, _self_check_inputs(N, dtype))


def timing_inputs(B: int, T: int, H: int, N: int, dtype=mx.float32) -> list:
    """Synthetic ``(r, log_w, k, v, a, b, state)`` of a training call's shape: what the tuner
    and ``info --bench`` time the implementations on (log_w stays float32)."""
    keys = mx.random.split(mx.random.key(1), 4)
    r, k, v = (mx.random.uniform(-0.5, 0.5, (B, T, H, N), key=keys[i]) for i in range(3))
    kk = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    log_w = mx.log(mx.random.uniform(0.5, 0.999, (B, T, H, N), key=keys[3]))
    args = [x.astype(dtype) for x in (r, log_w, k, v, -kk, 0.5 * kk)] + [mx.zeros((B, H, N, N))]
    args[1] = log_w
    return args


def _workload(key, shape) -> tuning.Workload:
    """A training step's call (forward and backward) for the tuner, at the call's batch and
    heads and the top of its length bucket."""
    (N, dtype), (B, T, H) = key, shape
    T = tuning.length_bucket(T)

    def make(fn):
        return tuning.forward_backward(fn, timing_inputs(B, T, H, N, dtype))

    names = ("ref", "chunked") if T <= REF_TUNE_MAX_T else ("chunked",)
    return tuning.Workload((f"N={N}", tuning.dtype_name(dtype), f"T<={T}"), names, make)


KERNELS = {KERNEL: kernel.kernel} | {
    name: kernel.chunked_kernel(L) for name, L in kernel.CHUNKED_NAMES.items()
}
DISPATCH = Dispatcher(
    "wkv7",
    {"ref": naive.step_loop, "chunked": chunk.chunked, **KERNELS},
    env_var=ENV_VAR,
    fallback="chunked",
    kernel_names=tuple(KERNELS),
    kernels=kernel.kernels_here,
    self_check=_self_check,
    workload=_workload,
)


def wkv7(r, log_w, k, v, a, b, state=None, *, impl: str | None = None):
    """WKV7 over a sequence. r, log_w, k, v, a, b ``[B, T, H, N]``; state ``[B, H, N, N]``.

    ``log_w <= 0`` is the log of the decay and must be float32 (bf16 would round a decay of
    0.999 to 1). r, k, v, a, b may be float32, bfloat16 or float16; the state and every
    accumulation are float32. Returns (y ``[B, T, H, N]`` in r's dtype, final state float32).
    Differentiable w.r.t. all seven inputs.

    ``impl`` (``"ref"``, ``"chunked"``, ``"kernel"`` -- the sequential kernel --,
    ``"chunked_kernel_L"`` -- the chunked kernel in chunks of L steps, L one of
    ``kernel.chunk_lengths(N)``), else ``MLX_RWKVX_WKV7``, picks the implementation; by default
    the fastest of those available, measured on this device once per head size, dtype and
    length bucket (``ops/tuning.py``); with ``MLX_RWKVX_TUNE=0`` the first kernel the device
    has that passed its self-check (the sequential one, then the chunked ones), else the step
    loop for T <= REF_MAX_T, else the chunked path. A kernel competes only when it passed its
    self-check (one that raises, returns non-finite values or disagrees is not used, with one
    warning); a kernel forced by ``impl`` or the variable is not checked: its failure is
    raised.
    """
    check_inputs(r, log_w, k, v, a, b, state)
    default = "ref" if r.shape[1] <= REF_MAX_T else "chunked"
    name = DISPATCH.pick(impl, (r.shape[-1], r.dtype), r, default, shape=r.shape[:3])
    return DISPATCH.impls[name](r, log_w, k, v, a, b, state)
