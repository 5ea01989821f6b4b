"""The WKV7 kernel body (metal/wkv7.h): its CPU flavour against the float64 oracle, the CUDA
flavour through nvcc, the Metal and CUDA sources exactly as the MLX builders assemble them, and
the MLX wrapper (wkv7_kernel and its VJP) driven through the CPU flavour."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

from mlx_rwkvx.ops import kernels
from mlx_rwkvx.ops import wkv7_kernel as WK

import mlx.core as mx
import numpy as np
import pytest
from kernel_harness import cpu
from kernel_harness import wkv7 as harness
from oracle.common import rel_err
from oracle.wkv7 import WKV7_INPUTS, random_wkv7_inputs, wkv7_bwd_np, wkv7_np

MIXED = (1e-4, 0.9999)
NEAR_ONE = (0.9999, 0.9999)
TINY = (1e-4, 1e-4)
DEFAULT = (0.5, 0.999)
HEAD_SIZES = (16, 32, 64, 128)
ENTRIES = (harness.FWD, harness.BWD)


@pytest.fixture(scope="session")
def launch(request, tmp_path_factory):
    if cpu.compiler() is None:
        pytest.skip("no C++ compiler (g++ or clang++): the CPU flavour cannot be built")
    instances = [(d, n) for d in kernels.DTYPES for n in HEAD_SIZES]
    cache = getattr(request.config, "cache", None)  # absent under -p no:cacheprovider
    where = cache.mkdir("kernels_cpu") if cache else tmp_path_factory.mktemp("kernels_cpu")
    lib = cpu.build(ENTRIES, instances, where)
    return cpu.launcher(lib)


# (B, T, H, N, decays, with_state): every T of DESIGN.md, segment edges (16, 32), B and H > 1
FLOAT32_CASES = [
    (2, 1, 2, 16, MIXED, True),
    (2, 17, 3, 32, MIXED, True),
    (2, 16, 2, 16, DEFAULT, True),
    (1, 32, 2, 16, MIXED, False),
    (2, 63, 2, 64, DEFAULT, True),
    (2, 100, 2, 16, NEAR_ONE, True),
    (1, 100, 2, 64, MIXED, True),
    (1, 50, 2, 16, TINY, True),
    (1, 40, 1, 128, MIXED, True),
    (1, 1000, 2, 16, MIXED, True),
    # w = 0.9999 rounded to float32 is off by 1.7e-8, compounded over 1000 steps: a kernel that
    # used that w would measure 2.2e-6 here (as MLX's float32 step loop does); wkv7.h's hi + lo
    # split of the decay keeps it at 3e-7
    (1, 1000, 1, 64, NEAR_ONE, True),
]


@pytest.mark.parametrize("B, T, H, N, decays, with_state", FLOAT32_CASES)
def test_cpu_flavour_float32_matches_oracle(launch, B, T, H, N, decays, with_state):
    rng = np.random.default_rng(T * 131 + N)
    inputs = random_wkv7_inputs(rng, B, T, H, N, decay_range=decays, with_state=with_state)
    harness.compare(launch, inputs, "float32", seed=T)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("B, T, H, N", [(2, 63, 2, 64), (1, 100, 2, 16), (1, 20, 1, 128)])
def test_cpu_flavour_low_precision_matches_oracle(launch, dtype, B, T, H, N):
    inputs = random_wkv7_inputs(np.random.default_rng(T), B, T, H, N, decay_range=MIXED)
    harness.compare(launch, inputs, dtype, seed=T)


@pytest.mark.slow
@pytest.mark.parametrize("N", HEAD_SIZES)
def test_cpu_flavour_long_sequence_every_head_size(launch, N):
    inputs = random_wkv7_inputs(np.random.default_rng(N), 2, 1000, 2, N, decay_range=MIXED)
    harness.compare(launch, inputs, "float32", seed=N)


def test_compare_catches_a_wrong_kernel(launch):
    def wrong(name, groups, threads, arrays):
        launch(name, groups, threads, arrays)
        if name.startswith("wkv7_bwd"):
            da, db = (arrays[len(harness.BWD.inputs) + i] for i in (4, 5))
            da[...], db[...] = db.copy(), da.copy()

    inputs = random_wkv7_inputs(np.random.default_rng(0), 1, 20, 1, 16)
    with pytest.raises(AssertionError, match=r"off the oracle.*'da'"):
        harness.compare(wrong, inputs, "float32")


def test_segment_length_agrees():
    assert harness.SEG == WK.SEG


def test_entries_declare_what_their_bodies_take():
    fwd, bwd = (kernels.entry(name) for name in ("wkv7_fwd.h", "wkv7_bwd.h"))
    assert fwd.input_names == [*WKV7_INPUTS, "state", "dims"]
    assert fwd.output_names == ["y", "state_out", "ckpt", "sa"]
    assert bwd.input_names == [*WKV7_INPUTS, "dy", "dstate", "ckpt", "sa", "dims"]
    assert bwd.output_names[:7] == [f"d{n}" for n in WKV7_INPUTS] + ["dstate0"]
    for e in (fwd, bwd):
        call = re.search(r"wkv7_\w+<InT, N>\((.*?)\);", e.text, re.S).group(1)
        args = [a.strip() for a in call.split(",")]
        expected = [n for n in e.input_names if n != "dims"] + ["dims[0]", "dims[1]"]
        assert args == expected + e.output_names + ["TID_X", "GID_X", "wkv7_smem"]


# MLX's Metal signature writer (mlx/backend/metal/custom_kernel.cpp, write_signature), enough
# of it to rebuild the exact text `mx.fast.metal_kernel` compiles.
METAL_ATTRIBUTES = (
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threads_per_threadgroup", "uint3"),
)
MLX_METAL_TYPES = {"float32": "float", "bfloat16": "bfloat16_t", "float16": "float16_t"}
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
namespace precise { inline float exp(float x) { return std::exp(x); } }
}
struct bfloat16_t {
  float v;
  bfloat16_t() = default;
  explicit bfloat16_t(float f) : v(f) {}
  explicit operator float() const { return v; }
};
using float16_t = _Float16;
"""


def _mlx_metal_text(e: kernels.Entry, dtype: str, n: int) -> str:
    header, source = kernels.mlx_parts("metal", e)
    sizes = {"dims": 2}  # inputs under 8 elements go in the constant address space
    name = f"custom_kernel_{e.kernel}_{MLX_METAL_TYPES[dtype]}_{n}"
    params = []
    for i, (pname, ptype) in enumerate(e.inputs):
        space = "constant" if sizes.get(pname, 1 << 20) < 8 else "device"
        ctype = MLX_METAL_TYPES[e.dtype_of(ptype, dtype)] if ptype != "int" else "int32_t"
        params.append(f"  const {space} {ctype}* {pname} [[buffer({i})]]")
    for i, (pname, ptype) in enumerate(e.outputs, start=len(e.inputs)):
        params.append(
            f"  device {MLX_METAL_TYPES[e.dtype_of(ptype, dtype)]}* {pname} [[buffer({i})]]"
        )
    params += [f"  {t} {a} [[{a}]]" for a, t in METAL_ATTRIBUTES if a in source]
    inst = f"{name}<{MLX_METAL_TYPES[dtype]}, {n}>"
    return (
        f"{header}template <typename InT, int N>\n[[kernel]] void {name}(\n"
        + ",\n".join(params)
        + f") {{\n{source}\n}}\n"
        + f'template [[host_name("{name}")]] [[kernel]] decltype({inst}) {inst};\n'
    )


def test_metal_assembly_names_its_thread_ids_and_compiles_as_cpp(tmp_path):
    for e in ENTRIES:
        header, source = kernels.mlx_parts("metal", e)
        assert kernels.prelude("metal") in header and kernels.kernel_source(e.body) in header
        # the attributes MLX must declare, found in `source` itself
        for attr in ("thread_position_in_threadgroup", "threadgroup_position_in_grid"):
            assert attr in source, attr
        # no input makes MLX add _shape/_strides/_ndim parameters the entry does not expect
        for pname in e.input_names:
            for suffix in ("_shape", "_strides", "_ndim"):
                assert pname + suffix not in source
    if cpu.compiler() is None:
        pytest.skip("no C++ compiler for the syntax check")
    text = METAL_STUB + "".join(
        _mlx_metal_text(e, d, n) for e in ENTRIES for d, n in [("float32", 64), ("bfloat16", 16)]
    )
    path = tmp_path / "wkv7_metal_as_cpp.cpp"
    path.write_text(text)
    cmd = [cpu.compiler(), "-std=c++20", "-fsyntax-only", "-w", str(path)]
    done = subprocess.run(cmd, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


MLX_CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half"}


def _mlx_cuda_text(e: kernels.Entry, dtype: str, n: int) -> str:
    """What mx.fast.cuda_kernel compiles (mlx/backend/cuda/custom_kernel.cpp, build_kernel), with
    its default header's MLX include left out."""
    header, source = kernels.mlx_parts("cuda", e)
    types = MLX_CUDA_TYPES | {"int32": "int32_t"}
    params = [f"    const {types[e.dtype_of(t, dtype)]}* {p}" for p, t in e.inputs]
    params += [f"    {types[e.dtype_of(t, dtype)]}* {p}" for p, t in e.outputs]
    return (
        "#include <cooperative_groups.h>\n"
        + header
        + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
        + f"__global__ void custom_kernel_{e.kernel}_{dtype}_{n}(\n"
        + ",\n".join(params)
        + f") {{\n  using InT = {types[dtype]};\n  constexpr int N = {n};\n\n{source}\n}}\n\n}}\n"
    )


def test_cuda_flavour_compiles_with_nvcc(tmp_path):
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc is not installed: the CUDA flavour is not compiled here")
    instances = [
        ("float32", 16),
        ("float32", 64),
        ("float32", 128),
        ("bfloat16", 64),
        ("float16", 32),
    ]
    standalone = tmp_path / "wkv7_standalone.cu"
    standalone.write_text(kernels.standalone_source("cuda", ENTRIES, instances))
    as_mlx = tmp_path / "wkv7_as_mlx.cu"
    as_mlx.write_text("".join(_mlx_cuda_text(e, "bfloat16", 64) for e in ENTRIES))
    jobs = [
        subprocess.Popen(
            [nvcc, "-std=c++17", "-arch=sm_80", "-c", str(src), "-o", str(src.with_suffix(".o"))],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for src in (standalone, as_mlx)
    ]
    for job in jobs:
        out, _ = job.communicate()
        assert job.returncode == 0, out[-3000:]


def test_builders_return_none_without_a_backend():
    if WK.kernel_backend() is not None:
        pytest.skip("this MLX has a GPU backend")
    assert WK._make_wkv7_kernels() is None
    args = _mx_args(random_wkv7_inputs(np.random.default_rng(0), 1, 3, 1, 16), "float32")
    with pytest.raises(RuntimeError, match="wkv7_kernel needs MLX with a Metal or CUDA"):
        WK.wkv7_kernel(*args)
    with pytest.raises(ValueError, match="k has shape"):
        WK.wkv7_kernel(args[0], args[1], args[2][:, :2], *args[3:])


MX_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
NP_OF_MX = {
    mx.float32: np.float32,
    mx.int32: np.int32,
    mx.bfloat16: np.uint16,
    mx.float16: np.uint16,
}


def _mx_args(inputs: dict, dtype: str) -> list:
    out = []
    for name in (*WKV7_INPUTS, "state"):
        as_in = name not in ("log_w", "state")
        out.append(
            mx.array(inputs[name], dtype=mx.float32).astype(
                MX_DTYPES[dtype] if as_in else mx.float32
            )
        )
    return out


class _FakeKernel:
    """Stands in for an MLX custom kernel: checks the call against the entry and runs the CPU
    flavour of the same function on the same buffers."""

    def __init__(self, launch, calls, *, name, input_names, output_names, source, header):
        self.entry = next(e for e in ENTRIES if e.kernel == name)
        assert input_names == self.entry.input_names and output_names == self.entry.output_names
        assert (header, source) == kernels.mlx_parts(self.backend, self.entry)
        self.launch, self.calls = launch, calls

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
        self.calls.append(self.entry.kernel)
        targs = dict(template)
        dtype = next(k for k, v in MX_DTYPES.items() if v == targs["InT"])
        n = targs["N"]
        assert threadgroup == (n, 1, 1) and grid[0] % n == 0 and grid[1:] == (1, 1)
        want = [self.entry.dtype_of(t, dtype) for _, t in self.entry.inputs]
        got = [
            next(k for k, v in {**MX_DTYPES, "int32": mx.int32}.items() if v == x.dtype)
            for x in inputs
        ]
        assert got == want, (self.entry.kernel, got, want)
        arrays = []
        for x in inputs:
            x = x.view(mx.uint16) if x.dtype in (mx.bfloat16, mx.float16) else x
            arrays.append(np.ascontiguousarray(np.array(x)))
        outs = [
            np.zeros(s, dtype=NP_OF_MX[d])
            for s, d in zip(output_shapes, output_dtypes, strict=True)
        ]
        self.launch(kernels.instance_name(self.entry, dtype, n), grid[0] // n, n, arrays + outs)
        result = []
        for o, d in zip(outs, output_dtypes, strict=True):
            result.append(mx.array(o).view(d) if d in (mx.bfloat16, mx.float16) else mx.array(o))
        return result


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_wrapper_and_vjp_through_cpu_flavour(launch, monkeypatch, backend, dtype):
    calls = []

    class Fake(_FakeKernel):
        pass

    Fake.backend = backend
    maker = "metal_kernel" if backend == "metal" else "cuda_kernel"
    monkeypatch.setattr(mx.fast, maker, lambda **kw: Fake(launch, calls, **kw), raising=False)
    monkeypatch.setattr(WK, "kernel_backend", lambda: backend)
    WK._kernels.cache_clear()
    try:
        B, T, H, N = 2, 37, 2, 32
        inputs = random_wkv7_inputs(np.random.default_rng(5), B, T, H, N, decay_range=MIXED)
        args = _mx_args(inputs, dtype)
        rng = np.random.default_rng(6)
        dy = mx.array(rng.standard_normal((B, T, H, N)), dtype=mx.float32).astype(args[0].dtype)
        dstate = mx.array(rng.standard_normal((B, H, N, N)), dtype=mx.float32)
        (y, state_out), grads = mx.vjp(lambda *xs: WK.wkv7_kernel(*xs), args, [dy, dstate])
        mx.eval(y, state_out, grads)
    finally:
        WK._kernels.cache_clear()
    assert calls == ["wkv7_fwd", "wkv7_bwd"]
    assert y.dtype == args[0].dtype and state_out.dtype == mx.float32
    assert [g.dtype for g in grads] == [x.dtype for x in args]

    x = [np.array(a.astype(mx.float32), dtype=np.float64) for a in args]
    dy64 = np.array(dy.astype(mx.float32), dtype=np.float64)
    y_ref, s_ref = wkv7_np(*x[:6], x[6])
    g_ref = wkv7_bwd_np(*x[:6], x[6], dy64, np.array(dstate, dtype=np.float64))
    tol = harness.TOL[dtype]
    assert rel_err(np.array(y.astype(mx.float32)), y_ref) <= tol["out"]
    assert rel_err(np.array(state_out), s_ref) <= tol["out"]
    for name, g in zip((*WKV7_INPUTS, "state"), grads, strict=True):
        assert rel_err(np.array(g.astype(mx.float32)), g_ref[name]) <= tol["grad"], name


def test_gpu_harness_imports_without_mlx():
    # the lent GPU machine has CuPy but no MLX: nothing tests/gpu/ imports may pull mlx in
    code = (
        "import sys; sys.path[:0] = ['tests', 'tests/gpu']\n"
        "import conftest, test_wkv7_cuda\n"
        "bad = [m for m in sys.modules if m == 'mlx' or m.startswith('mlx.')]\n"
        "assert not bad, bad\n"
    )
    root = Path(__file__).resolve().parent.parent
    done = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
