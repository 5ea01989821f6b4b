"""Make MLX's CPU backend use the system OpenBLAS on Linux.

The ``mlx[cpu]`` wheel links a bundled reference BLAS that runs a large fp32 matmul ~50x slower
than OpenBLAS. Loading OpenBLAS with ``RTLD_GLOBAL`` *before* ``mlx.core`` is first imported
puts its ``cblas_*`` symbols ahead of the bundled ones, so MLX calls OpenBLAS. After the import
it is too late (MLX's symbols are already bound), which is why this module never imports mlx.

``MLX_RWKVX_BLAS``: unset, empty or ``1`` = find OpenBLAS; ``0`` = leave MLX alone;
a path = load that library.

A DYNAMIC_ARCH OpenBLAS picks its kernels ("core type") from the CPU model at load time. One
that predates the CPU falls back to old kernels (Debian's 0.3.21 runs Prescott's SSE3 kernels on
newer Xeons, 2-4x slower), so after loading we compare its choice with the CPU's flags and, on
a misdetection, unload it and load it again with ``OPENBLAS_CORETYPE`` set.
``MLX_RWKVX_BLAS_CORETYPE``: unset, empty or ``1`` = fix a misdetection unless the user set
``OPENBLAS_CORETYPE``; ``0`` = keep OpenBLAS's choice; a core name = load with that core.
"""

from __future__ import annotations

import _ctypes
import ctypes
import ctypes.util
import os
import platform
import sys
import warnings
from dataclasses import dataclass

ENV_VAR = "MLX_RWKVX_BLAS"
CORETYPE_VAR = "MLX_RWKVX_BLAS_CORETYPE"
OPENBLAS_CORETYPE = "OPENBLAS_CORETYPE"

_SEARCH_DIRS = (
    "/usr/lib/{arch}-linux-gnu/openblas-pthread",
    "/usr/lib/{arch}-linux-gnu/openblas-openmp",
    "/usr/lib/{arch}-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
_SEARCH_NAMES = ("libopenblas.so.0", "libopenblasp.so.0", "libopenblas.so")

# OpenBLAS's core types of Intel's line, ranked by the widest vector ISA their kernels use.
# MLX calls only cblas_{s,d,c}gemm and LAPACK, whose kernels SkylakeX, Cooperlake and
# SapphireRapids share (the later two add bf16 kernels), so the three rank the same.
# Vendor-tuned cores (Zen, Excavator, ...) are absent: a CPU that OpenBLAS recognised keeps them.
_CORE_RANK = {
    **dict.fromkeys(("katmai", "coppermine", "northwood", "banias", "prescott"), 0),
    **dict.fromkeys(("core2", "penryn", "dunnington", "atom", "nehalem"), 1),
    "sandybridge": 2,
    "haswell": 3,
    **dict.fromkeys(("skylakex", "cooperlake", "sapphirerapids"), 4),
}
# (flags the kernels need, the core to load): names every DYNAMIC_ARCH build since 0.3.0 knows.
# AVX-512 needs BW/VL/DQ too: Knights Landing has only F/CD/ER/PF and runs Haswell kernels.
_CORE_FOR_FLAGS = (
    (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma"}), "SkylakeX"),
    (frozenset({"avx2", "fma"}), "Haswell"),
    (frozenset({"avx"}), "Sandybridge"),
)


@dataclass
class BlasStatus:
    """What ``setup`` did: ``loaded`` is the path we loaded, ``reason`` says why not.

    ``core`` is the OpenBLAS core type running, ``detected_core`` the one it ran after the first
    load (they differ when we reloaded it), ``core_note`` says how ``core`` was chosen.
    """

    loaded: str | None = None
    reason: str = ""
    config: str | None = None
    core: str | None = None
    detected_core: str | None = None
    core_note: str = ""


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
    # NumPy's own copy (libscipy_openblas64_*, before NumPy 2 libopenblas64_*) renames its
    # symbols, so it serves NumPy alone.
    name = os.path.basename(path).lower()
    return name.startswith("libopenblas") and not name.startswith("libopenblas64")


def cpu_flags() -> frozenset[str]:
    """This CPU's x86 feature flags from ``/proc/cpuinfo``; empty on other CPUs and systems."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def best_core(flags: frozenset[str] | set[str]) -> str | None:
    """The best OpenBLAS core type an x86 CPU with these flags runs, or None below AVX."""
    for needed, core in _CORE_FOR_FLAGS:
        if needed <= flags:
            return core
    return None


def core_to_fix(reported: str, flags: frozenset[str] | set[str]) -> str | None:
    """The core type to load instead of ``reported``, or None when ``reported`` stands.

    Only a core of Intel's line ranked below what the flags support counts as misdetected;
    vendor-tuned cores (Zen, ...) and names not known here are left alone.
    """
    best = best_core(flags)
    rank = _CORE_RANK.get(reported.lower())
    if best is None or rank is None or rank >= _CORE_RANK[best.lower()]:
        return None
    return best


def _query(lib: ctypes.CDLL, name: str, restype=ctypes.c_char_p) -> str | int | None:
    # openblas_get_{corename,config,num_threads} under the names of plain OpenBLAS and of
    # NumPy's renamed copies; None when the library has none of them (it is not OpenBLAS).
    for full in (f"openblas_{name}", f"scipy_openblas_{name}64_", f"openblas_{name}64_"):
        fn = getattr(lib, full, None)
        if fn is not None:
            fn.restype, fn.argtypes = restype, []
            out = fn()
            return out.decode(errors="replace").strip() if isinstance(out, bytes) else out
    return None


def mapped_openblas() -> str | None:
    """Path of the OpenBLAS that MLX can bind mapped into this process (not NumPy's), or None."""
    return next((p for p in mapped_blas_libraries() if _is_openblas(p)), None)


def _mapped_lib(path: str) -> ctypes.CDLL | None:
    # A handle on a library already mapped into the process; never loads one.
    try:
        return ctypes.CDLL(path, mode=os.RTLD_NOLOAD)
    except OSError:
        return None


def running_core() -> str | None:
    """The core type of the OpenBLAS mapped into this process (None if none is mapped)."""
    path = mapped_openblas()
    lib = _mapped_lib(path) if path else None
    return _query(lib, "get_corename") if lib else None


def openblas_summary(path: str) -> str:
    """``OpenBLAS 0.3.21 (path), core SkylakeX, 2 threads`` for an OpenBLAS mapped into this
    process (MLX's or NumPy's own copy); what is unknown is left out."""
    lib = _mapped_lib(path)
    if lib is None:
        return f"OpenBLAS ({path})"
    config = _query(lib, "get_config") or ""
    version = config.split()[1] if config.startswith("OpenBLAS ") else ""
    core = _query(lib, "get_corename")
    threads = _query(lib, "get_num_threads", ctypes.c_int)
    return (
        f"OpenBLAS{' ' + version if version else ''} ({path})"
        + (f", core {core}" if core else "")
        + (f", {threads} threads" if threads else "")
    )


def describe() -> str:
    """One phrase naming the BLAS that MLX's CPU matmuls use in this process."""
    if sys.platform == "darwin":
        return "Accelerate (MLX's BLAS on macOS)"
    libs = mapped_blas_libraries()
    openblas = [p for p in libs if _is_openblas(p)]
    if openblas:
        return openblas_summary(openblas[0])
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
            status.core = status.detected_core = running_core()
            if mapped_openblas() is None:
                _warn(
                    "mlx.core was imported before mlx_rwkvx, so MLX runs on its slow built-in "
                    "BLAS; import mlx_rwkvx before mlx or mlx_lm, or start Python with "
                    f"LD_PRELOAD={path}"
                )
            elif status.core and os.environ.get(CORETYPE_VAR, "").strip() in ("", "1"):
                target = core_to_fix(status.core, cpu_flags())
                if target is not None and OPENBLAS_CORETYPE not in os.environ:
                    status.core_note = f"OpenBLAS chose {status.core}, but this CPU runs {target}"
                    _warn(f"{status.core_note}; start Python with {OPENBLAS_CORETYPE}={target}")
        else:
            _load(path)
    return status


def _load_global(path: str, coretype: str | None) -> ctypes.CDLL:
    # OpenBLAS reads OPENBLAS_CORETYPE once, while loading; the environment is put back after.
    before = os.environ.get(OPENBLAS_CORETYPE)
    if coretype is not None:
        os.environ[OPENBLAS_CORETYPE] = coretype
    try:
        return ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    finally:
        if before is None:
            os.environ.pop(OPENBLAS_CORETYPE, None)
        else:
            os.environ[OPENBLAS_CORETYPE] = before


def _load(path: str) -> None:
    wanted = os.environ.get(CORETYPE_VAR, "").strip()
    forced = wanted if wanted not in ("", "1", "0") else None
    users = os.environ.get(OPENBLAS_CORETYPE)
    # Another copy already mapped (LD_PRELOAD, a library linked to it) would survive dlclose.
    preloaded = mapped_openblas() is not None
    try:
        lib = _load_global(path, forced)
    except OSError as e:
        status.reason = f"could not load {path}: {e}"
        _warn(status.reason)
        return
    status.loaded = path
    status.config = _query(lib, "get_config")
    status.core = status.detected_core = _query(lib, "get_corename")
    if status.core is None:  # not OpenBLAS: no core type to check
        return
    if forced is not None:
        status.core_note = f"{CORETYPE_VAR}={forced}"
        if status.core.lower() != forced.lower():
            _warn(f"{CORETYPE_VAR}={forced}, but OpenBLAS at {path} runs {status.core}")
        return
    target = core_to_fix(status.core, cpu_flags())
    if users is not None:
        status.core_note = f"{OPENBLAS_CORETYPE}={users} (set by the user)"
        if target is not None:
            status.core_note += f"; this CPU runs {target}"
        return
    if target is None:
        status.core_note = "chosen by OpenBLAS"
        return
    slow = f"OpenBLAS chose {status.core}, but this CPU runs {target}"
    if wanted == "0":
        status.core_note = f"{slow}; kept ({CORETYPE_VAR}=0)"
        return
    if "DYNAMIC_ARCH" not in (status.config or ""):
        status.core_note = f"{slow}; it is built for {status.core} only"
        _warn(f"{status.core_note}: point {ENV_VAR} at an OpenBLAS built with DYNAMIC_ARCH")
        return
    if preloaded:
        status.core_note = f"{slow}; not reloaded: it was loaded already"
        _warn(f"{slow}; start Python with {OPENBLAS_CORETYPE}={target}")
        return
    _ctypes.dlclose(lib._handle)
    try:
        lib = _load_global(path, target)
    except OSError as e:
        status.loaded, status.core = None, None
        status.reason = f"could not reload {path}: {e}"
        _warn(status.reason)
        return
    status.config = _query(lib, "get_config")
    status.core = _query(lib, "get_corename")
    status.core_note = f"{slow}; reloaded with {OPENBLAS_CORETYPE}={target}"
    if (status.core or "").lower() != target.lower():
        _warn(f"{slow}; reloaded with {OPENBLAS_CORETYPE}={target}, it runs {status.core}")
