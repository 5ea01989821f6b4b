"""WKV7 as GPU kernels (Metal or CUDA): the sequential pair from ``metal/wkv7.h`` and the chunked
four from ``metal/wkv7_chunk.h``.

Sequential: the forward runs one threadgroup of N threads per (batch, head), thread i holding
row i of the state; besides y and the final state it saves a state checkpoint every ``SEG``
steps and ``sa_t = S_{t-1} a_t``. The backward recomputes each segment's states from its
checkpoint and runs the reverse steps, thread j holding column j. Chunked: every chunk's maps
at once, then the state through the chunks (``wkv7_chunked_kernel``). The CPU flavour of the
same bodies runs in the tests (tests/ops/test_kernels_wkv7.py, test_kernels_wkv7_chunk.py).
"""

from __future__ import annotations

import functools

from mlx_rwkvx.metal.shapes import wkv7_chunk_lengths
from mlx_rwkvx.ops.common import HEAD_SIZES
from mlx_rwkvx.ops.mlx_kernels import kernel_backend, make_kernels
from mlx_rwkvx.ops.wkv7.contract import check_inputs, zero_state

import mlx.core as mx

SEG = 16  # WKV7_SEG in metal/wkv7.h: steps between the forward's state checkpoints
_ENTRIES = ("wkv7_fwd.h", "wkv7_bwd.h")


def _kernels() -> tuple | None:
    """(forward, backward) MLX kernels for this machine's backend, or None without one."""
    return make_kernels(_ENTRIES, kernel_backend())


def _launch(kernel, inputs, r, output_shapes, output_dtypes):
    B, T, H, N = r.shape
    dims = mx.array([T, H], dtype=mx.int32)
    return kernel(
        inputs=[*inputs, dims],
        template=[("InT", r.dtype), ("N", N)],
        grid=(B * H * N, 1, 1),  # threads, as MLX counts them: B * H threadgroups of N
        threadgroup=(N, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
    )


@mx.custom_function
def _wkv7_kernel_core(r, log_w, k, v, a, b, state):
    forward, _ = _kernels()
    B, T, H, N = r.shape
    seq = (B, T, H, N)
    n_seg = -(-T // SEG)
    f32 = mx.float32
    y, state_out, ckpt, sa = _launch(
        forward,
        [r, log_w, k, v, a, b, state],
        r,
        [seq, (B, H, N, N), (B, H, n_seg, N, N), seq],
        [r.dtype, f32, f32, f32],
    )
    # ckpt and sa ride along as outputs: the backward kernel starts from them
    return y, state_out, ckpt, sa


@_wkv7_kernel_core.vjp
def _wkv7_kernel_vjp(primals, cotangents, outputs):
    r, log_w, k, v, a, b, _ = primals
    dy, d_state_out = cotangents[:2]
    _, _, ckpt, sa = outputs
    _, backward = _kernels()
    B, T, H, N = r.shape
    seq = (B, T, H, N)
    f32, dt = mx.float32, r.dtype
    dy = mx.zeros(seq, dtype=dt) if dy is None else dy.astype(dt)
    if d_state_out is None:
        d_state_out = mx.zeros((B, H, N, N), dtype=f32)
    grads = _launch(
        backward,
        [r, log_w, k, v, a, b, dy, d_state_out.astype(f32), ckpt, sa],
        r,
        [seq] * 6 + [(B, H, N, N), (B * H, SEG, N, N)],
        [dt, f32, dt, dt, dt, dt, f32, f32],
    )
    return tuple(grads[:7])  # the last output is the kernel's scratch memory


def wkv7_kernel(r, log_w, k, v, a, b, state=None) -> tuple[mx.array, mx.array]:
    """WKV7 by one GPU kernel per direction (Metal or CUDA); same contract as ``wkv7_ref``.

    r, k, v, a, b ``[B, T, H, N]`` (float32, bfloat16 or float16, all alike), log_w float32,
    state ``[B, H, N, N]`` float32 or None (zeros); N in 16, 32, 64, 128. The state and every
    accumulation are float32; returns (y in r's dtype, final state float32). Differentiable
    w.r.t. all seven inputs (the VJP is the backward kernel). Raises RuntimeError where MLX has
    no Metal or CUDA backend.
    """
    check_inputs(r, log_w, k, v, a, b, state)
    return kernel(r, log_w, k, v, a, b, state)


CHUNKED_ENTRIES = ("wkv7c_fwd_maps.h", "wkv7c_fwd_scan.h", "wkv7c_bwd_scan.h", "wkv7c_bwd_maps.h")


def chunk_lengths(N: int) -> tuple[int, ...]:
    """The chunk lengths the chunked kernel is built for at head size N, shortest first: the
    two largest powers of two whose threadgroup memory fits (metal/shapes.py)."""
    return wkv7_chunk_lengths(N)


def _chunked_kernels() -> tuple | None:
    return make_kernels(CHUNKED_ENTRIES, kernel_backend())


def _run(kernel, inputs, T: int, dtype, N: int, L: int, groups: int, output_shapes, output_dtypes):
    H = inputs[0].shape[2]
    return kernel(
        inputs=[*inputs, mx.array([T, H], dtype=mx.int32)],
        template=[("InT", dtype), ("N", N), ("L", L)],
        grid=(groups * N, 1, 1),  # threads, as MLX counts them: threadgroups of N
        threadgroup=(N, 1, 1),
        output_shapes=output_shapes,
        output_dtypes=output_dtypes,
    )


@functools.cache
def _chunked_core(L: int):
    """The chunked kernels' forward and VJP in chunks of ``L`` steps: one custom function per
    length."""

    @mx.custom_function
    def core(r, log_w, k, v, a, b, state):
        return _chunked_forward(L, r, log_w, k, v, a, b, state)

    @core.vjp
    def core_vjp(primals, cotangents, outputs):
        return _chunked_backward(L, primals, cotangents, outputs)

    return core


def _chunked_forward(L: int, r, log_w, k, v, a, b, state):
    maps, scan, _, _ = _chunked_kernels()
    B, T, H, N = r.shape
    n_chunks = -(-T // L)
    chunked = (B, H, n_chunks, L, N)
    f32 = mx.float32
    W, U0, Qm, Y0, KL, BL, c_L = _run(
        maps,
        [r, log_w, k, v, a, b],
        T,
        r.dtype,
        N,
        L,
        B * H * n_chunks,
        [chunked] * 6 + [(B, H, n_chunks, N)],
        [f32] * 7,
    )
    y, state_out, ckpt, Z = _run(
        scan,
        [v, state, W, U0, Qm, Y0, KL, BL, c_L],
        T,
        r.dtype,
        N,
        L,
        B * H,
        [(B, T, H, N), (B, H, N, N), (B, H, n_chunks, N, N), chunked],
        [r.dtype, f32, f32, f32],
    )
    # what the backward starts from rides along as outputs
    return y, state_out, ckpt, Z, W, U0, Qm, KL, BL, c_L


def _chunked_backward(L: int, primals, cotangents, outputs):
    r, log_w, k, v, a, b, _ = primals
    dy, d_state_out = cotangents[:2]
    _, _, ckpt, Z, W, U0, Qm, KL, BL, c_L = outputs
    _, _, back_scan, back_maps = _chunked_kernels()
    B, T, H, N = r.shape
    n_chunks = ckpt.shape[2]
    chunked = W.shape
    f32, dt = mx.float32, r.dtype
    dy = mx.zeros(r.shape, dtype=dt) if dy is None else dy.astype(dt)
    if d_state_out is None:
        d_state_out = mx.zeros((B, H, N, N), dtype=f32)
    dW, dQm, dZ, dKL, dBL, d_decay, dv0, d_state = _run(
        back_scan,
        [dy, v, d_state_out.astype(f32), ckpt, Z, W, Qm, KL, BL, c_L],
        T,
        dt,
        N,
        L,
        B * H,
        [chunked] * 5 + [(B, H, n_chunks, N), chunked, (B, H, N, N)],
        [f32] * 8,
    )
    grads = _run(
        back_maps,
        [r, log_w, k, v, a, b, dy, W, U0, dW, dQm, dZ, dKL, dBL, d_decay, dv0],
        T,
        dt,
        N,
        L,
        B * H * n_chunks,
        [r.shape] * 6,
        [dt, f32, dt, dt, dt, dt],
    )
    return (*grads, d_state)


def wkv7_chunked_kernel(
    r, log_w, k, v, a, b, state=None, *, chunk: int | None = None
) -> tuple[mx.array, mx.array]:
    """WKV7 by the chunked GPU kernels (Metal or CUDA); the contract of ``wkv7_ref``, with
    decays below exp(-16) a step taken as exp(-16) (their log_w gets no gradient), as
    ``wkv7_chunked`` does.

    Every chunk's maps in parallel, then the state through the chunks, one threadgroup per
    (batch, head); the VJP is the reverse scan and the maps' backward, as kernels too
    (``metal/wkv7_chunk.h``). ``chunk``: steps per chunk, one of ``chunk_lengths(N)`` (default
    the longest; ``wkv7`` picks by measurement). Raises RuntimeError where MLX has no Metal or
    CUDA backend.
    """
    check_inputs(r, log_w, k, v, a, b, state)
    N = r.shape[-1]
    if chunk is None:
        chunk = chunk_lengths(N)[-1]
    elif chunk not in chunk_lengths(N):
        raise ValueError(
            f"wkv7_chunked_kernel: chunk={chunk} at head size {N}; built for {chunk_lengths(N)}"
        )
    return chunked_kernel(chunk)(r, log_w, k, v, a, b, state)


def chunked_kernel(L: int):
    """``wkv7_chunked_kernel`` in chunks of ``L`` steps, without the argument checks (the
    dispatcher ran them): one of the dispatcher's implementations."""

    def run(r, log_w, k, v, a, b, state) -> tuple[mx.array, mx.array]:
        if _chunked_kernels() is None:
            raise RuntimeError(
                "wkv7_chunked_kernel needs MLX with a Metal or CUDA device; use wkv7_chunked or "
                "wkv7 here"
            )
        state = zero_state(r) if state is None else state
        y, state_out, *_ = _chunked_core(L)(r, log_w, k, v, a, b, state)
        return y, state_out

    return run


def chunked_name(L: int) -> str:
    """The dispatcher's name of the chunked kernel in chunks of ``L`` steps."""
    return f"chunked_kernel_{L}"


# every length some head size builds
CHUNKED_NAMES = {
    chunked_name(L): L for L in sorted({L for N in HEAD_SIZES for L in chunk_lengths(N)})
}


def available(key=None) -> bool:
    """Whether this device has the WKV7 kernels (Metal or CUDA; for any ``(N, dtype)`` the
    contract takes)."""
    return _kernels() is not None


def kernels_here(key=None) -> tuple[str, ...]:
    """The WKV7 kernels this device has for ``key = (N, dtype)`` (for any, when None): the
    sequential one (``kernel``), then the chunked one at each length it is built for there."""
    sequential = ("kernel",) if available(key) else ()
    if _chunked_kernels() is None:
        return sequential
    if key is None:
        return (*sequential, *CHUNKED_NAMES)
    return (*sequential, *(chunked_name(L) for L in chunk_lengths(key[0])))


def kernel(r, log_w, k, v, a, b, state) -> tuple[mx.array, mx.array]:
    """``wkv7_kernel`` without the argument checks (the dispatcher ran them)."""
    if not available(None):
        raise RuntimeError(
            "wkv7_kernel needs MLX with a Metal or CUDA device; use wkv7_chunked or wkv7 here"
        )
    state = zero_state(r) if state is None else state
    y, state_out, _, _ = _wkv7_kernel_core(r, log_w, k, v, a, b, state)
    return y, state_out
