"""The kernel entries of ``metal/`` as MLX custom kernels, shared by the ops that have one
(``wkv7/kernel.py``, ``moba/kernel.py``): which GPU backend MLX offers here, and the kernel
objects built for it once. ``mlx_rwkvx.metal.sources`` assembles the sources without MLX."""

from __future__ import annotations

import functools

from mlx_rwkvx.metal import sources

import mlx.core as mx


def kernel_backend() -> str | None:
    """``"metal"`` or ``"cuda"`` where MLX can run custom kernels of that kind, else None."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available() and hasattr(mx.fast, "cuda_kernel"):
        return "cuda"
    return None


@functools.cache
def make_kernels(entry_names: tuple[str, ...], backend: str | None) -> tuple | None:
    """One MLX kernel object per entry of ``entry_names`` (e.g. ``("wkv7_fwd.h",
    "wkv7_bwd.h")``), in order, built with ``mx.fast.metal_kernel`` for ``backend="metal"`` or
    ``mx.fast.cuda_kernel`` for ``"cuda"``; None for any other backend (None included). Built
    once per (entries, backend): ``make_kernels.cache_clear()`` forgets them."""
    if backend == "metal":
        make = mx.fast.metal_kernel
    elif backend == "cuda":
        make = mx.fast.cuda_kernel
    else:
        return None
    built = []
    for name in entry_names:
        entry = sources.entry(name)
        header, source = sources.mlx_parts(backend, entry)
        built.append(
            make(
                name=entry.kernel,
                input_names=entry.input_names,
                output_names=entry.output_names,
                source=source,
                header=header,
            )
        )
    return tuple(built)
