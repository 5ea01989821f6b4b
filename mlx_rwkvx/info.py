"""``python -m mlx_rwkvx.info``: versions, the MLX device, the BLAS in use, and matmul speed;
``--selfcheck`` runs each kernel against the MLX ops path on this device."""

from __future__ import annotations

import argparse
import platform
import sys
from importlib import metadata

import mlx_rwkvx
from mlx_rwkvx import _blas


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def report(timing: bool = True) -> list[str]:
    """The lines ``info`` prints."""
    from mlx_rwkvx.perf import matmul_gflops

    import mlx.core as mx

    lines = [
        f"mlx_rwkvx  {mlx_rwkvx.__version__}",
        f"python     {platform.python_version()} ({sys.platform}, {platform.machine()})",
        f"mlx        {_version('mlx')}",
        f"mlx-lm     {_version('mlx-lm')}",
        f"numpy      {_version('numpy')}",
        f"device     {mx.default_device()}",
        f"blas       {_blas.describe()}",
    ]
    if _blas.status.reason:
        lines.append(f"           (OpenBLAS not loaded by mlx_rwkvx: {_blas.status.reason})")
    if _blas.status.core_note:
        lines.append(f"           (core type: {_blas.status.core_note})")
    if timing:
        n = 1024
        lines.append(f"matmul     {matmul_gflops(n):.1f} GFLOP/s (fp32, {n}x{n}x{n}, best of 3)")
    return lines


def selfcheck() -> list[str]:
    """Run every kernel's on-device self-check (against the MLX ops path) and report it:
    ``mlx_rwkvx.ops.prepare()``, which code that compiles runs first."""
    from mlx_rwkvx.ops import prepare
    from mlx_rwkvx.ops.dispatch import DISPATCHERS
    from mlx_rwkvx.ops.mlx_kernels import kernel_backend

    import mlx.core as mx

    backend = kernel_backend()
    if backend is None:
        return [f"kernels    none on {mx.default_device()}: the ops run their MLX paths"]
    return [
        f"kernels    {backend} {op} size {size} {dtype}: "
        + ("ok" if ok else f"FAILED (the {DISPATCHERS[op].fallback} path is used)")
        for op, size, dtype, ok in prepare(dtypes=(mx.float32, mx.bfloat16))
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mlx_rwkvx.info", description=__doc__)
    parser.add_argument("--no-timing", action="store_true", help="skip the matmul timing")
    parser.add_argument(
        "--selfcheck", action="store_true", help="check each kernel against the ops on this device"
    )
    args = parser.parse_args(argv)
    mlx_rwkvx.configure()
    lines = report(timing=not args.no_timing)
    if args.selfcheck:
        lines += selfcheck()
    print("\n".join(lines))


if __name__ == "__main__":
    main()
