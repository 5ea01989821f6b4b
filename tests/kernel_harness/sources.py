"""Standalone CUDA and C++ files of the kernel entries, as the tests compile them: the CPU
flavour runs in every CI run (kernel_harness.cpu), the CUDA one through nvcc and CuPy. Never
imports mlx."""

from __future__ import annotations

from mlx_rwkvx.metal.sources import Entry, kernel_source, prelude

# C names of each dtype: what MLX writes in the signatures it generates, and the CPU storage types.
C_TYPES = {
    "metal": {"float32": "float", "bfloat16": "bfloat16_t", "float16": "float16_t", "int32": "int"},
    "cuda": {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int32": "int"},
    "cpu": {"float32": "float", "bfloat16": "kcpu::bf16", "float16": "kcpu::f16", "int32": "int"},
}


def instance_name(e: Entry, dtype: str, n: int, *ints: int) -> str:
    """Name of the standalone function for ``InT = dtype``, ``N = n`` and the entry's other int
    template arguments ``ints``: ``wkv7_fwd_float32_64``, ``wkv7c_fwd_maps_float32_64_L16``."""
    if len(ints) != len(e.ints):
        raise ValueError(f"{e.kernel} takes the template ints N {' '.join(e.ints)}")
    return f"{e.kernel}_{dtype}_{n}" + "".join(
        f"_{k}{v}" for k, v in zip(e.ints, ints, strict=True)
    )


def constants(e: Entry, c_dtype: str, n: int, ints) -> str:
    """The template arguments as the lines MLX writes at the top of a CUDA kernel."""
    lines = [f"using InT = {c_dtype};", f"constexpr int N = {n};"]
    lines += [f"constexpr int {k} = {v};" for k, v in zip(e.ints, ints, strict=True)]
    return "".join(f"    {line}\n" for line in lines)


def standalone_source(flavour: str, entries, instances) -> str:
    """One compilable CUDA or C++ file: prelude, bodies, and one ``extern "C"`` function per entry
    and ``(dtype, N, *ints)`` in ``instances`` (the entry's own int template arguments; an
    entry without them takes ``(dtype, N)`` of each), whose signature is the one MLX would
    write.

    CUDA: a ``__global__`` kernel, launched with grid and block as MLX launches it. CPU: a
    function ``name(unsigned groups, params...)`` that runs ``groups`` threadgroups of N threads.
    """
    if flavour not in ("cuda", "cpu"):
        raise ValueError(f"standalone sources are 'cuda' or 'cpu', got {flavour!r}")
    entries = list(entries)
    types = C_TYPES[flavour]
    parts = [prelude(flavour)]
    for body in dict.fromkeys(e.body for e in entries):
        parts.append(kernel_source(body))
    for e in entries:
        for dtype, n, *ints in dict.fromkeys((d, n, *i[: len(e.ints)]) for d, n, *i in instances):
            params = [f"const {types[e.dtype_of(t, dtype)]}* {name}" for name, t in e.inputs] + [
                f"{types[e.dtype_of(t, dtype)]}* {name}" for name, t in e.outputs
            ]
            consts = constants(e, types[dtype], n, ints)
            name = instance_name(e, dtype, n, *ints)
            if flavour == "cuda":
                parts.append(
                    f'extern "C" __global__ void {name}(\n    '
                    + ",\n    ".join(params)
                    + ") {\n"
                    + consts
                    + e.text
                    + "}\n"
                )
            else:
                parts.append(
                    f'extern "C" void {name}(\n    unsigned groups,\n    '
                    + ",\n    ".join(params)
                    + ") {\n"
                    + consts
                    + "    kcpu::launch(groups, N, [&] {\n"
                    + e.text
                    + "    });\n}\n"
                )
    return "\n".join(parts)
