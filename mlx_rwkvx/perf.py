"""Small timing helpers shared by ``mlx_rwkvx.info`` and ``scripts/bench.py``.

Every speed we report is set beside the machine's physical limits measured in the same run:
the fp32 matmul rate (FLOP/s) and the memory read bandwidth (bytes/s).
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import mlx_rwkvx  # noqa: F401  (importing the package loads OpenBLAS before mlx.core)
from mlx_rwkvx import _blas

import mlx.core as mx
import numpy as np


def blas_in_use() -> dict:
    """The BLAS MLX's CPU backend uses: ``blas`` (a line naming it), ``core`` (OpenBLAS's core
    type, or None), ``core_note`` (how that core was chosen), ``x86_flags`` (whether the CPU's
    feature flags were read: a misdetected core can be told)."""
    return {
        "blas": _blas.describe(),
        "core": _blas.running_core(),
        "core_note": _blas.status.core_note,
        "x86_flags": bool(_blas.cpu_flags()),
    }


def numpy_blas() -> str:
    """NumPy's own BLAS: its version, core type and threads when it is an OpenBLAS copy of its
    own (not the one MLX uses)."""
    mlx_one = _blas.mapped_openblas()
    own = [
        p
        for p in _blas.mapped_blas_libraries()
        if "openblas" in os.path.basename(p).lower() and p != mlx_one
    ]
    return _blas.openblas_summary(own[0]) if own else "not an OpenBLAS"


def best_time(fn: Callable[[], object], repeats: int = 3, warmup: int = 1) -> float:
    """Best wall time in seconds of ``fn()`` over ``repeats`` runs after ``warmup`` runs.

    ``fn`` must finish its work before returning (call ``mx.eval`` inside it).
    """
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def matmul_gflops(n: int = 2048, dtype=mx.float32, repeats: int = 3) -> float:
    """GFLOP/s of one ``n x n @ n x n`` MLX matmul on the default device."""
    a = mx.random.normal((n, n)).astype(dtype)
    b = mx.random.normal((n, n)).astype(dtype)
    mx.eval(a, b)
    t = best_time(lambda: mx.eval(a @ b), repeats=repeats)
    return 2 * n**3 / t / 1e9


def read_bandwidth_gbs(
    nbytes: int = 1 << 30, threads: int | None = None, repeats: int = 3
) -> float:
    """Memory read bandwidth in GB/s: the faster of two ways of streaming ``nbytes`` of fp32
    from RAM once, a vectorised sum (one slice per thread; NumPy's reduction releases the GIL)
    and NumPy's own fp32 matrix-vector product. The array is far larger than any cache, so this
    is the DRAM read rate, the bound of weight-streaming decode."""

    threads = threads or os.cpu_count() or 1
    x = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(x, threads)
    width = 4096

    def read(p):
        whole = p[: p.size // width * width]
        return np.add.reduce(whole.reshape(-1, width), axis=0)

    with ThreadPoolExecutor(threads) as pool:
        t_sum = best_time(lambda: list(pool.map(read, parts)), repeats=repeats)
    matrix = x[: x.size // width * width].reshape(-1, width)
    vector = np.ones(width, dtype=np.float32)
    t_gemv = best_time(lambda: matrix @ vector, repeats=repeats) if threads > 1 else t_sum
    return x.nbytes / min(t_sum, t_gemv) / 1e9


def machine_description() -> str:
    """One line naming the CPU, core count, memory and OS of this machine."""

    cpu = platform.processor() or platform.machine()
    mem = ""
    try:
        with open("/proc/cpuinfo") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        cpu = names[0] if names else cpu
        with open("/proc/meminfo") as f:
            kb = int(next(ln for ln in f if ln.startswith("MemTotal")).split()[1])
        mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, StopIteration, ValueError):
        pass
    device = mx.default_device()
    system = f"{platform.system()} {platform.machine()}"
    return f"{cpu}, {os.cpu_count()} cores{mem}, {system}, MLX {device}"
