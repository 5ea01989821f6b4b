"""Make MLX's CPU backend use the system OpenBLAS on Linux.

The ``mlx[cpu]`` wheel links a bundled reference BLAS that runs a large fp32 matmul ~50x slower
than OpenBLAS. Loading OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is first imported
puts its ``cblas_*`` symbols ahead of the bundled ones, so MLX calls OpenBLAS. After the import
it is too late (MLX's symbols are already bound), which is why this module never imports mlx.

``MLX_RWKVX_BLAS``: unset, empty or ``1`` = find OpenBLAS; ``0`` = leave MLX alone;
a path = load that library.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from dataclasses import dataclass

ENV_VAR = "MLX_RWKVX_BLAS"

_SEARCH_DIRS = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp",
    "/usr/lib/{arch}-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
_SEARCH_NAMES = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so")


@dataclass
class BlasStatus:
    """What ``setup`` did: ``loaded`` is the path we loaded, ``reason`` says why not."""

    loaded: str | None = None
    reason: str = ""


status = BlasStatus()


def find_openblas() -> str | None:
    """Path of the system OpenBLAS, or None."""
    arch = platform.machine()
    for d in _SEARCH_DIRS:
        for name in _SEARCH_NAMES:
            path = os.path.join(d.format(arch=arch), name)
            if os.path.exists(path):
                return path
    return ctypes.util.find_library("openblas")


def mapped_blas_libraries() -> list[str]:
    """Paths of the shared libraries with 'blas' in their name mapped into this process."""
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    paths = {line.split()[-1] for line in lines if "/" in line}
    return sorted(p for p in paths if "blas" in os.path.basename(p).lower())


def _is_openblas(path: str) -> bool:
    # NumPy's own copy (libscipy_openblas64_*) renames its symbols, so it serves NumPy alone.
    return os.path.basename(path).lower().startswith("libopenblas")


def describe() -> str:
    """One phrase naming the BLAS that MLX's CPU matmuls use in this process."""
    if sys.platform == "darwin":
        return "Accelerate (MLX's BLAS on macOS)"
    libs = mapped_blas_libraries()
    openblas = [p for p in libs if _is_openblas(p)]
    if openblas:
        return f"OpenBLAS ({openblas[0]})"
    bundled = [p for p in libs if os.path.basename(p).lower().startswith("libblas")]
    if bundled:
        return f"MLX's bundled reference BLAS ({bundled[0]}): slow, see {ENV_VAR} in the README"
    return "unknown (no BLAS library mapped yet)"


class BlasWarning(RuntimeWarning):
    """MLX will run its matmuls on a slow BLAS."""


def _warn(message: str) -> None:
    # An explicit location keeps the warning on one line (no source line is printed).
    warnings.warn_explicit(message, BlasWarning, "mlx_rwkvx", 0)


def setup() -> BlasStatus:
    """Load OpenBLAS globally before mlx.core is imported (Linux only). Idempotent."""
    if status.loaded or status.reason:
        return status
    choice = os.environ.get(ENV_VAR, "").strip()
    if not sys.platform.startswith("linux"):
        status.reason = "not Linux"
    elif choice == "0":
        status.reason = f"{ENV_VAR}=0"
    else:
        path = choice if choice not in ("", "1") else find_openblas()
        if path is None:
            status.reason = "no OpenBLAS found (apt install libopenblas0-pthread)"
        elif "mlx.core" in sys.modules:
            status.reason = "mlx.core was imported first"
            if not any(_is_openblas(p) for p in mapped_blas_libraries()):
                _warn(
                    "mlx.core was imported before mlx_rwkvx, so MLX runs on its slow built-in "
                    "BLAS; import mlx_rwkvx before mlx or mlx_lm, or start Python with "
                    f"LD_PRELOAD={path}"
                )
        else:
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                status.loaded = path
            except OSError as e:
                status.reason = f"could not load {path}: {e}"
                _warn(status.reason)
    return status
