"""Process-wide MLX settings that the CPU backend needs to run the ops at speed:
``mlx_rwkvx.configure()``, which the CLIs, the benchmarks and the tests call (importing an op
changes nothing)."""

from __future__ import annotations

import contextlib
import ctypes
import os

from mlx_rwkvx.errors import UserError

import mlx.core as mx

# MLX's CPU allocator keeps only 32 MB of freed buffers by default. Larger arrays are then
# fresh mmaps whose pages fault in on first touch (benchmarks/BENCHMARKS.md, wkv7 section,
# measures what that costs the chunked WKV7 path).
_DEFAULT_CPU_CACHE = 32 << 20
_done = False


def configure() -> None:
    """Raise MLX's buffer-cache limit on the CPU device to a quarter of RAM (once).

    Left alone when a limit other than MLX's default was already set, or when
    ``MLX_RWKVX_CACHE_LIMIT`` says otherwise (bytes; ``0`` = do not touch).
    """
    global _done
    if _done:
        return
    if mx.default_device() != mx.cpu:
        _done = True
        return
    wanted = os.environ.get("MLX_RWKVX_CACHE_LIMIT")
    if wanted is not None:
        try:
            limit = int(wanted)
            if not 0 <= limit < 2**64:  # MLX takes a size_t
                raise ValueError
        except ValueError:
            raise UserError(
                f"MLX_RWKVX_CACHE_LIMIT={wanted!r}: expected a number of bytes from 0 (MLX's "
                "default) to 2^64 - 1"
            ) from None
        if limit > 0:
            mx.set_cache_limit(limit)
        _done = True
        return
    _done = True
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        ram = 8 << 30
    previous = mx.set_cache_limit(ram // 4)
    if previous != _DEFAULT_CPU_CACHE:  # someone chose a limit already: keep theirs
        mx.set_cache_limit(previous)


# glibc's mallopt: a fixed threshold from which allocations are mmaps of their own
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 128 << 10  # glibc's own starting value, kept from then on


def unmapped_when_freed() -> bool:
    """Where the C library is glibc, buffers from ``MMAP_THRESHOLD`` up are mapped on their
    own and given back to the system when freed, for the rest of the process; True if so.

    glibc raises its threshold after each larger buffer freed (up to 32 MB), so buffers of a
    few MB that MLX allocates and frees in a step then come from its heap, whose free parts
    stay resident. Measured on 4 blocks of the 1.5B RWKV-7 (int4 LoRA, T = 512,
    checkpointed): the resident peak 1.29 -> 1.14 GB (MLX's own peak 0.85), the step ~20%
    slower (fresh pages fault in on first touch): what a checkpointed run trades."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (macOS: Metal's buffers are not malloc's)
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


@contextlib.contextmanager
def buffers_given_back(checkpointed: bool = False):
    """While training on the CPU, MLX's buffer cache is off (its limit 0; the limit before is
    restored on leaving): a step frees buffers in sizes the next ones rarely ask for again,
    and the cache kept them beside the step's own peak. Measured on 4 blocks of the 1.5B RFA
    (INT8 LoRA, T = 256): the resident peak of a step 1.11 -> 0.95 GB, its time unchanged
    within the noise; on the whole model, what the process holds beyond MLX's own peak went
    0.56 -> 0.11 GB (BENCHMARKS.md, memory section). ``checkpointed`` (a run that trades time
    for memory): the C library gives freed buffers back too (``unmapped_when_freed``). Left
    alone where ``MLX_RWKVX_CACHE_LIMIT`` chooses the limit, and on a GPU, whose allocator
    gives its cache back by itself when memory runs short."""
    if mx.default_device() != mx.cpu or os.environ.get("MLX_RWKVX_CACHE_LIMIT") is not None:
        yield
        return
    if checkpointed:
        unmapped_when_freed()
    previous = mx.set_cache_limit(0)
    try:
        yield
    finally:
        mx.set_cache_limit(previous)
