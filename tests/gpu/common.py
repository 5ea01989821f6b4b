"""What the CuPy GPU tests share: the CUDA flavour of some entries compiled and loaded as a
*launch* (see kernel_harness.common), device timing, and the error line they print. Never
imports mlx: the lent GPU machine has CuPy but no MLX."""

from __future__ import annotations

import pytest
from kernel_harness import sources as standalone


def cuda_launcher(entries, instances):
    """``(cupy, launch, device name)`` for the CUDA flavour of ``entries`` at the
    ``(dtype, N, *ints)`` of ``instances`` (kernel_harness.sources.standalone_source); skips the
    calling test without CuPy or a usable CUDA device."""
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("no CUDA device")
    except cp.cuda.runtime.CUDARuntimeError as err:
        pytest.skip(f"no usable CUDA device: {err}")
    code = standalone.standalone_source("cuda", entries, instances)
    names = {
        standalone.instance_name(e, d, n, *i[: len(e.ints)])
        for e in entries
        for d, n, *i in instances
    }
    try:
        module = cp.RawModule(code=code, options=("-std=c++17",))
        functions = {name: module.get_function(name) for name in names}
    except cp.cuda.compiler.CompileException:
        # NVRTC may not find cuda_bf16.h on its include path; nvcc always does
        module = cp.RawModule(code=code, options=("-std=c++17",), backend="nvcc")
        functions = {name: module.get_function(name) for name in names}

    def launch(name, groups, threads, arrays):
        functions[name]((groups,), (threads,), tuple(arrays))

    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    return cp, launch, props["name"].decode()


def device_ms(cp, fn, reps: int) -> float:
    """Mean device time of ``fn()`` in milliseconds over ``reps`` runs, after one warm-up."""
    fn()  # warm-up
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / reps


def error_line(errors: dict[str, float]) -> str:
    """``name=error`` for each tensor of a harness's ``compare``."""
    return " ".join(f"{k}={v:.1e}" for k, v in errors.items())
