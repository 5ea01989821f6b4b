"""MoBA's selected-chunk attention as GPU kernels (Metal or CUDA), from ``metal/moba.h``.

Same contract as ``blockwise.sparse_fn``: each query row (b, t, h) reads the key chunks of its slots
``chunk, limit [B, T, Hq, S]`` int32 (the keys may be a longer prefix: the queries are their last
T). The forward runs one threadgroup per query row (online softmax over tiles of D keys) and saves
the log-sum-exp; the backward is two kernels: dq per query row (it also saves
``delta = <dout, out> - dlse``), then dk, dv per tile of keys, summed over the rows that selected
the chunk through an inverse index (the slots sorted by chunk), so each gradient row has one
writer: no atomics, deterministic. The CPU flavour of the same body runs in the tests
(tests/ops/test_kernels_moba.py); see ``mlx_rwkvx/metal/moba.h`` for the layouts.
"""

from __future__ import annotations

import functools

from mlx_rwkvx.ops.common import HEAD_SIZES
from mlx_rwkvx.ops.mlx_kernels import kernel_backend, make_kernels
from mlx_rwkvx.ops.moba.blockwise import sparse_attention
from mlx_rwkvx.ops.moba.contract import check_inputs

import mlx.core as mx

_ENTRIES = ("moba_fwd.h", "moba_bwd_dq.h", "moba_bwd_dkv.h")
# mx.fast.metal_kernel puts an input of fewer elements in the `constant` address space, which the
# body's `device` pointers cannot take (mlx/fast.cpp, max_constant_array_size): pad such inputs.
_MIN_DEVICE_SIZE = 8


def _kernels() -> tuple | None:
    """(forward, dq, dk/dv) MLX kernels for this machine's backend, or None without one."""
    return make_kernels(_ENTRIES, kernel_backend())


def _device_sized(x: mx.array) -> mx.array:
    """``x`` flattened, zero-padded to at least _MIN_DEVICE_SIZE elements."""
    x = x.reshape(-1)
    short = _MIN_DEVICE_SIZE - x.size
    return mx.concatenate([x, mx.zeros((short,), dtype=x.dtype)]) if short > 0 else x


def _pair_index(chunk: mx.array, limit: mx.array, n_kv_heads: int, n_keys: int, cs: int):
    """The inverse index of the dk/dv kernel: (pairs ``[R * S]``, offsets ``[M + 1]``) int32.

    pairs: the slots ``r * S + s`` sorted by chunk matrix ``m = (b * Hkv + kv head) * n_chunks +
    chunk``, empty slots last; matrix m's slots are ``pairs[offsets[m]:offsets[m + 1]]``.
    """
    B, T, Hq, _ = chunk.shape
    n_chunks = -(-n_keys // cs)
    n_mats = B * n_kv_heads * n_chunks
    kv_head = (mx.arange(Hq, dtype=mx.int32) // (Hq // n_kv_heads))[None, None, :, None]
    batch = mx.arange(B, dtype=mx.int32)[:, None, None, None]
    mats = (batch * n_kv_heads + kv_head) * n_chunks + chunk
    mats = mx.where(limit >= 0, mats, n_mats).reshape(-1)
    pairs = mx.argsort(mats).astype(mx.int32)  # order within a matrix only reorders a sum
    counts = mx.zeros((n_mats + 1,), dtype=mx.int32).at[mats].add(1)
    offsets = mx.concatenate([mx.zeros((1,), dtype=mx.int32), mx.cumsum(counts[:n_mats])])
    return pairs, offsets


def check_slots(q, k, v, chunk, limit) -> None:
    """One ValueError naming the first argument that does not fit the kernels."""
    if q.ndim != 4 or q.shape[-1] not in HEAD_SIZES:
        raise ValueError(
            f"moba_kernel: q must be [B, T, Hq, D] with D in {HEAD_SIZES}, got {tuple(q.shape)}"
        )
    B, T, Hq, D = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] < T or x.shape[3] != D or Hq % x.shape[2]:
            raise ValueError(
                f"moba_kernel: {name} has shape {tuple(x.shape)}, expected "
                f"[{B}, Tk >= {T}, Hkv, {D}] with Hkv dividing {Hq}"
            )
    if k.shape != v.shape:
        raise ValueError(f"moba_kernel: v has shape {tuple(v.shape)}, expected {tuple(k.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype or q.dtype not in (mx.float32, mx.bfloat16, mx.float16):
            raise ValueError(
                f"moba_kernel: {name} has dtype {x.dtype}, q {q.dtype}: expected one of "
                "float32, bfloat16, float16 for all three"
            )
    for name, x in (("chunk", chunk), ("limit", limit)):
        if x.ndim != 4 or x.shape[:3] != (B, T, Hq) or x.dtype != mx.int32:
            raise ValueError(
                f"moba_kernel: {name} has shape {tuple(x.shape)} and dtype {x.dtype}, "
                f"expected [{B}, {T}, {Hq}, S] int32"
            )
    if chunk.shape != limit.shape:
        raise ValueError(
            f"moba_kernel: limit has shape {tuple(limit.shape)}, expected {tuple(chunk.shape)}"
        )


def _consts(q, k, chunk, cs: int, scale: float):
    B, T, Hq, D = q.shape
    _, Tk, Hkv, _ = k.shape
    dims = mx.array([T, Tk, Hq, Hkv, chunk.shape[-1], cs], dtype=mx.int32)
    return mx.array([scale], dtype=mx.float32), dims


@functools.cache
def _moba_kernel_fn(cs: int, scale: float):
    @mx.custom_function
    def moba_slots_kernel(q, k, v, chunk, limit):
        check_slots(q, k, v, chunk, limit)
        forward, _, _ = _kernels()
        B, T, Hq, D = q.shape
        R = B * T * Hq
        scale_arr, dims = _consts(q, k, chunk, cs, scale)
        out, lse = forward(
            inputs=[q, k, v, _device_sized(chunk), _device_sized(limit), scale_arr, dims],
            template=[("InT", q.dtype), ("N", D)],
            grid=(R * D, 1, 1),  # threads, as MLX counts them: one threadgroup of D per row
            threadgroup=(D, 1, 1),
            output_shapes=[q.shape, (R,)],
            output_dtypes=[q.dtype, mx.float32],
        )
        return out, lse

    @moba_slots_kernel.vjp
    def moba_slots_kernel_vjp(primals, cotangents, outputs):
        q, k, v, chunk, limit = primals
        d_out, d_lse = cotangents
        out, lse = outputs
        _, dq_kernel, dkv_kernel = _kernels()
        B, T, Hq, D = q.shape
        _, Tk, Hkv, _ = k.shape
        R = B * T * Hq
        f32 = mx.float32
        d_out = mx.zeros_like(q) if d_out is None else d_out.astype(q.dtype)
        d_lse = mx.zeros((R,), dtype=f32) if d_lse is None else d_lse.astype(f32)
        scale_arr, dims = _consts(q, k, chunk, cs, scale)
        lse, chunk_in, limit_in = (_device_sized(x) for x in (lse, chunk, limit))
        template = [("InT", q.dtype), ("N", D)]
        dq, delta = dq_kernel(
            inputs=[q, k, v, out, d_out, lse, _device_sized(d_lse), chunk_in, limit_in]
            + [scale_arr, dims],
            template=template,
            grid=(R * D, 1, 1),
            threadgroup=(D, 1, 1),
            output_shapes=[q.shape, (max(R, 8),)],  # delta is an input of the next kernel
            output_dtypes=[q.dtype, f32],
        )
        pairs, offsets = _pair_index(chunk, limit, Hkv, Tk, cs)
        groups = B * Hkv * -(-Tk // cs) * -(-cs // D)  # (b, kv head, chunk, tile of D keys)
        dk, dv = dkv_kernel(
            inputs=[q, k, v, d_out, lse, delta, limit_in, _device_sized(pairs)]
            + [_device_sized(offsets), scale_arr, dims],
            template=template,
            grid=(groups * D, 1, 1),
            threadgroup=(D, 1, 1),
            output_shapes=[k.shape, k.shape],
            output_dtypes=[f32, f32],
        )
        return (
            dq,
            dk.astype(k.dtype),
            dv.astype(v.dtype),
            mx.zeros_like(chunk),
            mx.zeros_like(limit),
        )

    return moba_slots_kernel


def moba_kernel_fn(chunk_size: int, scale: float):
    """MoBA attention over given chunk slots by GPU kernels: the drop-in for
    ``blockwise.sparse_fn(chunk_size, scale)``.

    Returns an ``mx.custom_function`` ``(q, k, v, chunk, limit) -> (out, lse)``: q
    ``[B, T, Hq, D]``, k, v ``[B, Tk, Hkv, D]`` with Tk >= T (float32, bfloat16 or float16, all
    alike; Hkv dividing Hq; D in 16, 32, 64, 128), chunk and limit ``[B, T, Hq, S]`` int32 (slot
    s of row (b, t, h) reads keys ``chunk * chunk_size + j`` for ``0 <= j <= limit``; limit < 0:
    empty; the slots carry causality, see ``selection.slots``).
    out has q's dtype, lse ``[B * T * Hq]`` is the float32 log-sum-exp of the row's scaled
    scores; softmax and every sum are float32. Its VJP (two kernels) gives exact dq, dk, dv for
    the slots, lse's cotangent included. Raises RuntimeError where MLX has no Metal or CUDA
    backend.
    """
    if _kernels() is None:
        raise RuntimeError(
            "moba_kernel_fn needs MLX with a Metal or CUDA device; use moba_attention_blockwise "
            "or moba_attention here"
        )
    return _moba_kernel_fn(int(chunk_size), float(scale))


def available(key=None) -> bool:
    """Whether this device has the MoBA kernels (for ``key = (head_dim, dtype)``, when given:
    head dims 16, 32, 64, 128)."""
    return _kernels() is not None and (key is None or key[0] in HEAD_SIZES)


def moba_kernel(q, k, v, *, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """MoBA with the selected-chunk attention in one Metal/CUDA kernel per direction; the
    contract of ``moba_attention``. RuntimeError where the device has no kernel."""
    check_inputs(q, k, v, chunk_size, top_k)
    return attention(q, k, v, chunk_size, top_k, scale)


def attention(q, k, v, chunk_size: int, top_k: int, scale=None) -> mx.array:
    """``moba_kernel`` without the argument checks (the dispatcher ran them)."""
    if not available((q.shape[-1], q.dtype)):
        raise RuntimeError(
            f"moba_kernel needs MLX with a Metal or CUDA device and a head dim in {HEAD_SIZES} "
            f"(got {q.shape[-1]})"
        )
    return sparse_attention(q, k, v, chunk_size, top_k, scale, moba_kernel_fn)
