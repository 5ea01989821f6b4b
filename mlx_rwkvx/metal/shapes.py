"""Launch rules of the kernels that the MLX wrappers and the MLX-free test harness both need;
importing this never imports MLX.

The chunked WKV7 kernel (``wkv7_chunk.h``) takes its chunk length L as a template argument.
Its threadgroup memory, in floats, mirrors the header's macros: the maps' backward holds
5 L N + 8 L^2, each scan (4 L + 2) N; the header asserts at compile time that both fit
Metal's 32 KiB (CUDA's default is 48 KiB). The lengths built are the two largest powers of two
that fit, so the tuner always has two to measure: 8 and 16 for N <= 64, 4 and 8 for N = 128.
"""

from __future__ import annotations

SMEM_BYTES = 32768  # WKV7C_SMEM_BYTES
_LENGTHS = (4, 8, 16, 32, 64)


def wkv7_chunk_fits(N: int, L: int) -> bool:
    """Whether chunks of L steps at head size N fit the threadgroup memory (WKV7C_FITS)."""
    maps_backward = 5 * L * N + 8 * L * L
    scan = (4 * L + 2) * N
    return 4 * max(maps_backward, scan) <= SMEM_BYTES


def wkv7_chunk_lengths(N: int) -> tuple[int, ...]:
    """The chunk lengths the chunked WKV7 kernel is built for at head size N, shortest first:
    the two largest powers of two that fit."""
    return tuple(L for L in _LENGTHS if wkv7_chunk_fits(N, L))[-2:]
