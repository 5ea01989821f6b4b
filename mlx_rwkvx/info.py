"""``python -m mlx_rwkvx.info``: versions, the MLX device, the BLAS in use, and matmul speed."""

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
    if timing:
        n = 1024
        lines.append(f"matmul     {matmul_gflops(n):.1f} GFLOP/s (fp32, {n}x{n}x{n}, best of 3)")
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_rwkvx.info", description=__doc__)
    parser.add_argument("--no-timing", action="store_true", help="skip the matmul timing")
    args = parser.parse_args(argv)
    print("\n".join(report(timing=not args.no_timing)))


if __name__ == "__main__":
    main()
