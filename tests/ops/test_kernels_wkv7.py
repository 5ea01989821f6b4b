"""The WKV7 kernel body (metal/wkv7.h): its CPU flavour against the float64 oracle, the CUDA
flavour through nvcc, the Metal and CUDA sources exactly as the MLX builders assemble them, and
the MLX wrapper (wkv7_kernel and its VJP) driven through the CPU flavour."""

import re

from mlx_rwkvx.metal import sources
from mlx_rwkvx.ops.wkv7 import kernel as WK

import mlx.core as mx
import numpy as np
import pytest
from helpers.mlx_kernel_emulation import (
    MX_DTYPES,
    check_cuda_compiles,
    check_imports_without_mlx,
    check_metal_assembly,
    kernels_through_cpu,
)
from kernel_harness import cpu
from kernel_harness import wkv7 as harness
from oracle.common import rel_err
from oracle.wkv7 import WKV7_INPUTS, random_wkv7_inputs, wkv7_bwd_np, wkv7_np

MIXED = (1e-4, 0.9999)
NEAR_ONE = (0.9999, 0.9999)
TINY = (1e-4, 1e-4)
DEFAULT = (0.5, 0.999)
HEAD_SIZES = (16, 32, 64, 128)
ENTRIES = harness.ENTRIES


@pytest.fixture(scope="session")
def launch(request, tmp_path_factory):
    return cpu.fixture_launch(request, tmp_path_factory, ENTRIES, HEAD_SIZES)


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
    fwd, bwd = (sources.entry(name) for name in ("wkv7_fwd.h", "wkv7_bwd.h"))
    assert fwd.input_names == [*WKV7_INPUTS, "state", "dims"]
    assert fwd.output_names == ["y", "state_out", "ckpt", "sa"]
    assert bwd.input_names == [*WKV7_INPUTS, "dy", "dstate", "ckpt", "sa", "dims"]
    assert bwd.output_names[:7] == [f"d{n}" for n in WKV7_INPUTS] + ["dstate0"]
    for e in (fwd, bwd):
        call = re.search(r"wkv7_\w+<InT, N>\((.*?)\);", e.text, re.S).group(1)
        args = [a.strip() for a in call.split(",")]
        expected = [n for n in e.input_names if n != "dims"] + ["dims[0]", "dims[1]"]
        assert args == expected + e.output_names + ["TID_X", "GID_X", "wkv7_smem"]


def test_metal_assembly_names_its_thread_ids_and_compiles_as_cpp(tmp_path):
    instances = [("float32", 64), ("bfloat16", 16)]
    check_metal_assembly(tmp_path, "wkv7", ENTRIES, instances, small=("dims",))


def test_cuda_flavour_compiles_with_nvcc(tmp_path):
    instances = [("float32", 16), ("float32", 64), ("float32", 128)]
    instances += [("bfloat16", 64), ("float16", 32)]
    check_cuda_compiles(tmp_path, "wkv7", ENTRIES, instances, as_mlx=[("bfloat16", 64)])


def test_builders_return_none_without_a_backend():
    if WK.kernel_backend() is not None:
        pytest.skip("this MLX has a GPU backend")
    assert WK._kernels() is None
    args = _mx_args(random_wkv7_inputs(np.random.default_rng(0), 1, 3, 1, 16), "float32")
    with pytest.raises(RuntimeError, match="wkv7_kernel needs MLX with a Metal or CUDA"):
        WK.wkv7_kernel(*args)
    with pytest.raises(ValueError, match="k has shape"):
        WK.wkv7_kernel(args[0], args[1], args[2][:, :2], *args[3:])


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


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_wrapper_and_vjp_through_cpu_flavour(launch, monkeypatch, backend, dtype):
    with kernels_through_cpu(monkeypatch, backend, WK, ENTRIES, launch) as calls:
        B, T, H, N = 2, 37, 2, 32
        inputs = random_wkv7_inputs(np.random.default_rng(5), B, T, H, N, decay_range=MIXED)
        args = _mx_args(inputs, dtype)
        rng = np.random.default_rng(6)
        dy = mx.array(rng.standard_normal((B, T, H, N)), dtype=mx.float32).astype(args[0].dtype)
        dstate = mx.array(rng.standard_normal((B, H, N, N)), dtype=mx.float32)
        (y, state_out), grads = mx.vjp(lambda *xs: WK.wkv7_kernel(*xs), args, [dy, dstate])
        mx.eval(y, state_out, grads)
    assert [name for name, _ in calls] == ["wkv7_fwd", "wkv7_bwd"]
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
    check_imports_without_mlx("test_wkv7_cuda")
