"""What MLX does with a custom kernel, emulated for machines without its GPU backends: the
exact text ``mx.fast.metal_kernel`` and ``mx.fast.cuda_kernel`` compile (so g++ and nvcc can check
it), and a stand-in kernel object that runs the CPU flavour of the same entry on the same buffers
(so the MLX wrappers and their VJPs run end to end here). Also the checks built on them that
tests/ops/test_kernels_*.py share."""

from __future__ import annotations

import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from helpers import ROOT
from mlx_rwkvx.metal import sources
from mlx_rwkvx.ops import mlx_kernels

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import cpu
from kernel_harness import sources as kernel_sources
from kernel_harness.common import TOL
from oracle.common import rel_err
from oracle.wkv7 import MIXED, WKV7_INPUTS, random_wkv7_inputs, wkv7_bwd_np, wkv7_np

# MLX's Metal signature writer (mlx/fast.cpp, write_signature): an input of fewer elements than
# this goes in the `constant` address space, and the thread-position attributes it declares
# when the source names them, in its order.
MAX_CONSTANT_ARRAY_SIZE = 8
METAL_ATTRIBUTES = (
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threads_per_threadgroup", "uint3"),
)
MLX_METAL_TYPES = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "float16_t"}
MLX_CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}
# Stand-ins for the Metal names the sources use, so that g++ can check the rest of the text.
METAL_STUB = """
#include <cmath>
#include <cstddef>
#include <cstdint>
#define device
#define constant
#define threadgroup
#define kernel
using uint = unsigned;
struct uint3 { uint x, y, z; };
namespace mem_flags { enum flags { mem_none, mem_threadgroup }; }
inline void threadgroup_barrier(mem_flags::flags) {}
namespace metal {
inline float fma(float a, float b, float c) { return std::fma(a, b, c); }
namespace precise {
inline float exp(float x) { return std::exp(x); }
inline float log(float x) { return std::log(x); }
}
}
struct bfloat16_t {
  float v;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) : v(f) {}
  explicit operator float() const { return v; }
};
using float16_t = _Float16;
"""


def metal_text(
    e: sources.Entry, dtype: str, n: int, *ints: int, small: tuple[str, ...] = ()
) -> str:
    """What ``mx.fast.metal_kernel`` compiles for ``e`` at ``InT = dtype``, ``N = n`` and the
    entry's other int template arguments ``ints``, with the inputs named in ``small`` under
    MAX_CONSTANT_ARRAY_SIZE elements (so in ``constant``)."""
    header, source = sources.mlx_parts("metal", e)
    suffix = "".join(f"_{v}" for v in ints)
    name = f"custom_kernel_{e.kernel}_{MLX_METAL_TYPES[dtype]}_{n}{suffix}"
    params = []
    for i, (pname, ptype) in enumerate(e.inputs):
        space = "constant" if pname in small else "device"
        ctype = MLX_METAL_TYPES[e.dtype_of(ptype, dtype)] if ptype != "int" else "int32_t"
        params.append(f"  const {space} {ctype}* {pname} [[buffer({i})]]")
    for i, (pname, ptype) in enumerate(e.outputs, start=len(e.inputs)):
        params.append(
            f"  device {MLX_METAL_TYPES[e.dtype_of(ptype, dtype)]}* {pname} [[buffer({i})]]"
        )
    params += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]
    inst = f"{name}<{', '.join([MLX_METAL_TYPES[dtype], str(n), *map(str, ints)])}>"
    template = ", ".join(["typename InT", "int N", *(f"int {k}" for k in e.ints)])
    return (
        f"{header}template <{template}>\n[[kernel]] void {name}(\n"
        + ",\n".join(params)
        + f") {{\n{source}\n}}\n"
        + f'template [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    )


def cuda_text(e: sources.Entry, dtype: str, n: int, *ints: int) -> str:
    """What ``mx.fast.cuda_kernel`` compiles (mlx/backend/cuda/custom_kernel.cpp, build_kernel)
    at ``InT = dtype``, ``N = n`` and the entry's ``ints``, with its default header's MLX
    include left out."""
    header, source = sources.mlx_parts("cuda", e)
    types = MLX_CUDA_TYPES | {"int32": "int32_t"}
    params = [f"    const {types[e.dtype_of(t, dtype)]}* {p}" for p, t in e.inputs]
    params += [f"    {types[e.dtype_of(t, dtype)]}* {p}" for p, t in e.outputs]
    return (
        "#include <cooperative_groups.h>\n"
        + header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void custom_kernel_{e.kernel}_{dtype}_{n}{''.join(f'_{v}' for v in ints)}(\n"
        + ",\n".join(params)
        + ") {\n"
        + kernel_sources.constants(e, types[dtype], n, ints)
        + f"\n{source}\n}}\n\n}}\n"
    )


MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


def fake_kernel_maker(backend: str, entries, launch, calls: list):
    """A replacement for ``mx.fast.metal_kernel`` (or ``cuda_kernel``) whose kernels check each
    call against their entry and run the CPU flavour (``launch``, see kernel_harness.cpu) of the
    same function on the same buffers. Each call appends ``(kernel, {input: size})`` to
    ``calls``, the entry's int template arguments beyond N among them (``{"L": 16}``)."""

    def make(*, name, input_names, output_names, source, header):
        entry = next(e for e in entries if e.kernel == name)
        assert input_names == entry.input_names and output_names == entry.output_names
        assert (header, source) == sources.mlx_parts(backend, entry)
        return _FakeKernel(entry, launch, calls)

    return make


@contextmanager
def kernels_through_cpu(monkeypatch, backend: str, module, entries, launch):
    """MLX's kernel builder for ``backend`` (``metal`` or ``cuda``) replaced by
    ``fake_kernel_maker`` over the CPU flavour, and ``module.kernel_backend`` (an op's kernel
    wrapper) reporting that backend; the kernels built meanwhile are forgotten on the way in
    and out. Yields the list the fake kernels record their calls in."""
    calls = []
    maker = "metal_kernel" if backend == "metal" else "cuda_kernel"
    fake = fake_kernel_maker(backend, entries, launch, calls)
    monkeypatch.setattr(mx.fast, maker, fake, raising=False)
    monkeypatch.setattr(module, "kernel_backend", lambda: backend)
    mlx_kernels.make_kernels.cache_clear()
    try:
        yield calls
    finally:
        mlx_kernels.make_kernels.cache_clear()


def _garbage(shape, dtype) -> np.ndarray:
    """MLX does not initialise outputs: NaN (or a wild int) shows any element a kernel skips."""
    if dtype == mx.int32:
        return np.full(shape, np.iinfo(np.int32).min, dtype=np.int32)
    if dtype == mx.float32:
        return np.full(shape, np.nan, dtype=np.float32)
    return np.full(shape, 0xFFFF, dtype=np.uint16)  # NaN in bfloat16 and in float16


class _FakeKernel:
    def __init__(self, entry, launch, calls):
        self.entry, self.launch, self.calls = entry, launch, calls

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        e = self.entry
        targs = dict(template)
        sizes = {n: x.size for n, x in zip(e.input_names, inputs, strict=True)}
        self.calls.append((e.kernel, sizes | {k: targs.get(k) for k in e.ints}))
        dtype = next(k for k, v in MX_DTYPES.items() if v == targs["InT"])
        n = targs["N"]
        assert list(targs) == ["InT", "N", *e.ints], (e.kernel, list(targs))
        ints = [targs[k] for k in e.ints]
        assert threadgroup == (n, 1, 1) and grid[0] % n == 0 and grid[1:] == (1, 1)
        want = [e.dtype_of(t, dtype) for _, t in e.inputs]
        got = [
            next(k for k, v in {**MX_DTYPES, "int32": mx.int32}.items() if v == x.dtype)
            for x in inputs
        ]
        assert got == want, (e.kernel, got, want)
        arrays = []
        for x in inputs:
            x = x.view(mx.uint16) if x.dtype in (mx.bfloat16, mx.float16) else x
            arrays.append(np.ascontiguousarray(np.array(x)))
        outs = [_garbage(s, d) for s, d in zip(output_shapes, output_dtypes, strict=True)]
        name = kernel_sources.instance_name(e, dtype, n, *ints)
        self.launch(name, grid[0] // n, n, arrays + outs)
        return [
            mx.array(o).view(d) if d in (mx.bfloat16, mx.float16) else mx.array(o)
            for o, d in zip(outs, output_dtypes, strict=True)
        ]


def check_metal_assembly(tmp_path: Path, stem: str, entries, instances, small, extra="") -> None:
    """What MLX needs of each entry's Metal assembly (the prelude and body in the header; the
    thread ids it must declare named in the source itself; no input that makes MLX add
    ``_shape``/``_strides``/``_ndim`` parameters the entry does not take), then the text
    ``metal_text`` rebuilds for ``entries`` at each ``(dtype, N, *ints)`` of ``instances``
    (``small`` as there), followed by ``extra``, syntax-checked as C++ over METAL_STUB. Skips
    the syntax check without a C++ compiler."""
    for e in entries:
        header, source = sources.mlx_parts("metal", e)
        assert sources.prelude("metal") in header and sources.kernel_source(e.body) in header
        for attr in ("thread_position_in_threadgroup", "threadgroup_position_in_grid"):
            assert attr in source, attr
        for pname in e.input_names:
            for suffix in ("_shape", "_strides", "_ndim"):
                assert pname + suffix not in source
    if cpu.compiler() is None:
        pytest.skip("no C++ compiler for the syntax check")
    text = METAL_STUB + "".join(
        metal_text(e, d, n, *i[: len(e.ints)], small=small)
        for e in entries
        for d, n, *i in instances
    )
    path = tmp_path / f"{stem}_metal_as_cpp.cpp"
    path.write_text(text + extra)
    cmd = [cpu.compiler(), "-std=c++20", "-fsyntax-only", "-w", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


def check_cuda_compiles(tmp_path: Path, stem: str, entries, instances, as_mlx) -> None:
    """nvcc (sm_80) compiles the standalone CUDA flavour of ``entries`` at each
    ``(dtype, N, *ints)`` of ``instances``, and the text ``cuda_text`` rebuilds for them at each
    of ``as_mlx``; the two compile side by side. Skips without nvcc."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA flavour is not compiled here")
    standalone = tmp_path / f"{stem}_standalone.cu"
    standalone.write_text(kernel_sources.standalone_source("cuda", entries, instances))
    mlx_text = tmp_path / f"{stem}_as_mlx.cu"
    mlx_text.write_text(
        "".join(cuda_text(e, d, n, *i[: len(e.ints)]) for e in entries for d, n, *i in as_mlx)
    )
    jobs = [
        subprocess.Popen(
            [nvcc, "-std=c++17", "-arch=sm_80", "-c", str(src), "-o", str(src.with_suffix(".o"))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for src in (standalone, mlx_text)
    ]
    for job in jobs:
        out, _ = job.communicate()
        assert job.returncode == 0, out[-3000:]


def check_imports_without_mlx(module: str) -> None:
    """Importing ``module`` of tests/gpu/ (after tests/conftest.py, as pytest does) in a fresh
    interpreter pulls in no mlx: the lent GPU machine has CuPy but no MLX."""
    code = (
        "import sys; sys.path[:0] = ['tests', 'tests/gpu']\n"
        f"import conftest, {module}\n"
        "bad = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]\n"
        "assert not bad, bad\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def wkv7_mx_args(inputs: dict, dtype: str) -> list:
    """Oracle-style float64 WKV7 ``inputs`` as MLX arrays: r, k, v, a, b in ``dtype``, log_w
    and the state float32."""
    out = []
    for name in (*WKV7_INPUTS, "state"):
        kind = MX_DTYPES[dtype] if name not in ("log_w", "state") else mx.float32
        out.append(mx.array(inputs[name], dtype=mx.float32).astype(kind))
    return out


def check_wkv7_wrapper(monkeypatch, backend: str, module, entries, launch, fn, dtype: str):
    """A WKV7 kernel's MLX wrapper ``fn`` (``module``'s, built from ``entries``) and its VJP
    through the CPU flavour (``kernels_through_cpu``; every output buffer starts as NaN, so an
    element no kernel writes shows) on a ragged problem: the dtypes it returns, then outputs
    and all seven gradients against the float64 oracle. Returns the kernels called, in order."""
    with kernels_through_cpu(monkeypatch, backend, module, entries, launch) as calls:
        B, T, H, N = 2, 37, 2, 32
        inputs = random_wkv7_inputs(np.random.default_rng(5), B, T, H, N, decay_range=MIXED)
        args = wkv7_mx_args(inputs, dtype)
        rng = np.random.default_rng(6)
        dy = mx.array(rng.standard_normal((B, T, H, N)), dtype=mx.float32).astype(args[0].dtype)
        dstate = mx.array(rng.standard_normal((B, H, N, N)), dtype=mx.float32)
        (y, state_out), grads = mx.vjp(lambda *xs: fn(*xs), args, [dy, dstate])
        mx.eval(y, state_out, grads)
    assert y.dtype == args[0].dtype and state_out.dtype == mx.float32
    assert [g.dtype for g in grads] == [x.dtype for x in args]

    x = [np.array(a.astype(mx.float32), dtype=np.float64) for a in args]
    dy64 = np.array(dy.astype(mx.float32), dtype=np.float64)
    y_ref, s_ref = wkv7_np(*x[:6], x[6])
    g_ref = wkv7_bwd_np(*x[:6], x[6], dy64, np.array(dstate, dtype=np.float64))
    tol = TOL[dtype]
    assert rel_err(np.array(y.astype(mx.float32)), y_ref) <= tol["out"]
    assert rel_err(np.array(state_out), s_ref) <= tol["out"]
    for name, g in zip((*WKV7_INPUTS, "state"), grads, strict=True):
        assert rel_err(np.array(g.astype(mx.float32)), g_ref[name]) <= tol["grad"], name
    return [name for name, _ in calls]
