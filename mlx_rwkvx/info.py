"""``python -m mlx_rwkvx.info``: versions, the MLX device, the BLAS in use, and matmul speed;
``--selfcheck`` runs each kernel against the MLX ops path on this device and lists it per shape
class as passed, failed (why) or not available, then the tuning table: the implementation
chosen per op, shape class and length bucket and each candidate's measured time, and the file
that holds them; ``--bench`` adds those and ``bench_here.py``'s timings of the ops and a LoRA
step on this device."""

from __future__ import annotations

import platform
import sys
from dataclasses import dataclass
from importlib import metadata

import mlx_rwkvx
from mlx_rwkvx import _blas, cli, settings
from mlx_rwkvx.settings import Settings, opt

PROG = "mlx_rwkvx.info"


@dataclass
class InfoConfig(Settings):
    no_timing: bool = opt("skip the matmul timing", default=False)
    selfcheck: bool = opt("check each kernel against the ops on this device", default=False)
    bench: bool = opt(
        "also time WKV7, MoBA and a LoRA step here (about a minute): a table to paste in an issue",
        default=False,
    )


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
    """Run every kernel's on-device self-check (against the exact MLX path) and report each
    kernel per shape class as passed, failed (why) or not available on this device:
    ``ops.configure_and_prepare()``, which every command that runs a model runs first."""
    from mlx_rwkvx.ops import configure_and_prepare
    from mlx_rwkvx.ops.common import HEAD_SIZES
    from mlx_rwkvx.ops.dispatch import DISPATCHERS, PREPARED_DTYPES, shape_class
    from mlx_rwkvx.ops.mlx_kernels import kernel_backend

    import mlx.core as mx

    backend = kernel_backend()
    if backend is None:
        lines = [f"kernels    none on {mx.default_device()}: the ops run their MLX paths"]
    else:
        lines = [f"kernels    {backend} on {mx.default_device()}"]
    configure_and_prepare()
    for op, dispatcher in sorted(DISPATCHERS.items()):
        for key in ((size, dtype) for size in HEAD_SIZES for dtype in PREPARED_DTYPES):
            here = dispatcher.kernels(key)
            if not here:
                lines.append(f"kernels    {op} {shape_class(key)}: not available on this device")
            for kernel in here:
                name = "" if len(dispatcher.kernel_names) == 1 else f" {kernel}"
                line = f"kernels    {op}{name} {shape_class(key)}: "
                if dispatcher.results.get((kernel, key)):
                    lines.append(line + "passed")
                    continue
                reason = dispatcher.reasons.get((kernel, key), "unchecked")
                reason = reason.replace("\n", "\n" + " " * 11)
                if len(here) == 1:
                    lines.append(line + f"FAILED, the {dispatcher.fallback} path is used: {reason}")
                else:
                    lines.append(line + f"FAILED, not used: {reason}")
    return lines + tuning_table()


def tuning_table() -> list[str]:
    """The implementations chosen by measurement on this device (``ops/tuning.py``), each with
    every candidate's time per call (forward and backward), and where the file is."""
    from mlx_rwkvx.ops import tuning

    if not tuning.enabled():
        return [f"tuning     off ({tuning.ENV_TUNE}=0): each op takes its fixed rule"]
    tuner = tuning.TUNER
    entries = tuner.entries()
    lines = [
        f"tuning     file {tuner.path}" + ("" if tuner.path.exists() else " (not written yet)")
    ]
    if not entries:
        lines.append(
            "tuning     nothing measured yet on this device (each op measures on first use)"
        )
    for name, chosen, timings in entries:
        times = ", ".join(f"{c} {t * 1e3:.3g} ms" for c, t in sorted(timings.items()))
        lines.append(f"tuning     {name}: {chosen}" + (f" ({times})" if times else ""))
    return lines


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = settings.load(InfoConfig, argv, PROG, description=__doc__, yaml=False)
        mlx_rwkvx.configure()
        lines = report(timing=not cfg.no_timing)
        if cfg.bench:
            from mlx_rwkvx.bench_here import bench

            return lines + selfcheck() + bench()
        return lines + (selfcheck() if cfg.selfcheck else [])

    print("\n".join(cli.run(PROG, body)))


if __name__ == "__main__":
    main()
