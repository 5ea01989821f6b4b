"""Quantized matmuls that the CPU runs at BLAS speed.

MLX's CPU kernel for ``mx.quantized_matmul`` multiplies one row of the input at a time: a
512 x 2048 x 8192 product runs at 2.3 GFLOP/s on a 2-core x86 machine, where OpenBLAS's
float32 GEMM runs at ~70 (mlx 0.32; int4 and int8 alike). From ``TILED_ROWS`` rows of input on
the CPU, ``quantized_matmul`` below dequantizes the weight in float32 a tile of its rows at a
time and multiplies each tile by BLAS: 56, 69, 73, 69 and 59 GFLOP/s there with tiles of 1, 2,
4, 8 and 16 MB (at 512 x 4096 x 4096 2 MB: 55, 16 MB: 76), and closer to the exact product
(scales and biases applied in float32: 3e-7 of the largest output off a float64 reference,
MLX's kernel 1.3e-6). The tiles are dequantized by a compiled unpacking of the integers
(``dequantized``; 2, 4 and 8 bits), MLX's values exactly and twice as fast as its CPU kernel
(an 8192 x 2048 int4 weight to float32: 83-91 ms against 165-229, beside another job), which
matters where a checkpointed model multiplies spans of 128 tokens (``models/model.py``).
Below ``TILED_ROWS`` rows (decoding) MLX's kernel is faster: 15 ms against 95 ms at one row;
the two cross between 8 and 16 rows.

Memory: the backward keeps what ``mx.quantized_matmul``'s keeps (the input and the quantized
weight; the input's gradient is the tiled product the other way round); one tile is dequantized
at a time (MLX's dequantize needs twice its output while it runs). Small tiles cost resident
memory that MLX's counters do not see: training blocks of the 1.5B RWKV-7 (int4 LoRA, T = 512,
checkpointed), the process's resident memory after a step grew 76 MB per block with 2 MB tiles,
49 with 16 MB, 47 with 64 MB, where MLX's peak grew 44-47 (the block's weights 36); MLX's peak
itself 27 MB higher with 16 MB tiles than with 2, 300 higher with 64. Metal's kernel is left
alone: the GPU path is MLX's.
"""

from __future__ import annotations

import functools

import mlx.core as mx

TILED_ROWS = 16  # rows of input from which the CPU goes through float32 tiles
TILE_BYTES = 16 << 20  # a float32 tile of the dequantized weight, at most


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array | None,
    transpose: bool = True,
    group_size: int = 64,
    bits: int = 4,
    mode: str = "affine",
) -> mx.array:
    """``mx.quantized_matmul`` with the same arguments and result, through float32 tiles of
    the weight on the CPU from ``TILED_ROWS`` rows of ``x`` (see the module's note)."""
    rows = x.size // x.shape[-1] if x.ndim else 0
    if (
        biases is None
        or mode != "affine"
        or rows < TILED_ROWS
        or mx.default_device().type != mx.cpu
    ):
        return mx.quantized_matmul(
            x, w, scales, biases, transpose, group_size=group_size, bits=bits, mode=mode
        )
    return _tiled(transpose, group_size, bits)(x, w, scales, biases)


def _product(x, w, scales, biases, transpose: bool, group_size: int, bits: int) -> mx.array:
    """``x @ W.T`` (transpose) or ``x @ W``, W the dequantized ``w``: a tile of W's rows at a
    time, in float32."""
    width = w.shape[-1] * 32 // bits  # W's columns
    step = max(1, TILE_BYTES // (4 * width))
    scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
    x32 = x.astype(mx.float32)
    parts, out = [], None
    for a in range(0, w.shape[0], step):
        b = min(w.shape[0], a + step)
        # a tile is read once the input and the last tile's product are there: MLX would be
        # free to dequantize every tile of every layer first, and did
        rows = mx.depends(w[a:b], [x32] if a == 0 else parts[-1:] if transpose else [out])
        tile = dequantized(rows, scales[a:b], biases[a:b], group_size, bits)
        if transpose:  # a tile of W's rows is a slice of the output's columns
            parts.append(x32 @ tile.T)
        else:  # ... or a slice of the sum over x's columns
            piece = x32[..., a:b] @ tile
            out = piece if out is None else out + piece
    return mx.concatenate(parts, axis=-1) if transpose else out


def dequantized(w, scales, biases, group_size: int, bits: int) -> mx.array:
    """``mx.dequantize(w, scales, biases, group_size, bits)`` (affine) in the dtype of
    ``scales``; where ``bits`` divides 32 (2, 4, 8 bits) as a compiled unpacking of the
    integers, elementwise: twice as fast as MLX's CPU kernel, and the same values."""
    if 32 % bits:
        return mx.dequantize(w, scales, biases, group_size, bits)
    return _unpacked(group_size, bits)(w, scales, biases)


@functools.cache
def _unpacked(group_size: int, bits: int):
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    mask = (1 << bits) - 1

    @mx.compile
    def unpack(w, scales, biases):
        values = (w[..., None] >> shifts) & mask  # [..., packed, 32 // bits], lowest bits first
        groups = values.reshape(*w.shape[:-1], -1, group_size).astype(scales.dtype)
        out = groups * scales[..., None] + biases[..., None]
        return out.reshape(*w.shape[:-1], -1)

    return unpack


@functools.cache
def _tiled(transpose: bool, group_size: int, bits: int):
    """The tiled product as a custom function of ``(x, w, scales, biases)``, its gradient for
    ``x`` the tiled product the other way round (the quantized weight is frozen: zeros)."""

    @mx.custom_function
    def product(x, w, scales, biases):
        y = _product(x, w, scales, biases, transpose, group_size, bits)
        return y.astype(mx.result_type(x, scales))

    @product.vjp
    def product_vjp(primals, cotangent, output):
        x, w, scales, biases = primals
        dx = _product(cotangent, w, scales, biases, not transpose, group_size, bits)
        zeros = (mx.zeros_like(a) for a in (w, scales, biases))
        return (dx.astype(x.dtype), *zeros)

    return product
