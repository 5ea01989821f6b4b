"""The CPU flavour of the kernels: one C++ file assembled by ``standalone.standalone_source``,
compiled with the system C++ compiler into a shared library and called through ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

from kernel_harness import sources as standalone
from mlx_rwkvx.metal import sources

import numpy as np
import pytest

CXX_FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-Wall", "-Wextra", "-Werror")


def compiler() -> str | None:
    """The C++ compiler to use (``$CXX``, else g++, else clang++), or None."""
    for name in (os.environ.get("CXX"), "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def build(entries, instances, cache_dir: Path) -> ctypes.CDLL:
    """Compile the CPU flavour of ``entries`` for ``(dtype, N)`` in ``instances`` (cached by the
    hash of the source and flags) and load it."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler (g++ or clang++) found")
    source = standalone.standalone_source("cpu", entries, instances)
    key = hashlib.sha256("\0".join([cxx, *CXX_FLAGS, source]).encode()).hexdigest()[:16]
    lib_path = cache_dir / f"kernels_cpu_{key}.so"
    if not lib_path.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        src = cache_dir / f"kernels_cpu_{key}.cpp"
        src.write_text(source)
        tmp = lib_path.with_suffix(f".{os.getpid()}.tmp")
        done = subprocess.run(
            [cxx, *CXX_FLAGS, "-o", str(tmp), str(src)], capture_output=True, text=True
        )
        if done.returncode:
            raise RuntimeError(f"{cxx} failed on {src}:\n{done.stderr[-4000:]}")
        tmp.replace(lib_path)
    return ctypes.CDLL(str(lib_path))


def launcher(lib: ctypes.CDLL):
    """A launch (see kernel_harness.common) that runs the library's functions on NumPy arrays."""

    def launch(name: str, groups: int, threads: int, arrays: list) -> None:
        del threads  # the CPU function knows N
        fn = getattr(lib, name)
        fn.restype = None
        fn.argtypes = [ctypes.c_uint] + [ctypes.c_void_p] * len(arrays)
        for x in arrays:
            assert isinstance(x, np.ndarray) and x.flags.c_contiguous, name
        fn(groups, *(x.ctypes.data for x in arrays))

    return launch


def fixture_launch(request, tmp_path_factory, entries, sizes, ints=lambda n: [()]):
    """For a pytest fixture: the launch of the CPU flavour of ``entries`` at every dtype, every
    N in ``sizes`` and each tuple of ``ints(N)`` (the entries' other int template arguments),
    built in pytest's cache (a temporary folder without it). Skips without a C++ compiler."""
    if compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the CPU flavour cannot be built")
    instances = [(d, n, *i) for d in sources.DTYPES for n in sizes for i in ints(n)]
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    where = cache.mkdir("kernels_cpu") if cache else tmp_path_factory.mktemp("kernels_cpu")
    return launcher(build(entries, instances, where))
