"""The WKV7 kernel body (metal/wkv7.h): its CPU flavour against the float64 oracle, the CUDA
flavour through nvcc, the Metal and CUDA sources exactly as the MLX builders assemble them, and
the MLX wrapper (wkv7_kernel and its VJP) driven through the CPU flavour."""

import re

from mlx_rwkvx.metal import sources
from mlx_rwkvx.ops.wkv7 import kernel as WK

import numpy as np
import pytest
from helpers.mlx_kernel_emulation import (
    check_cuda_compiles,
    check_imports_without_mlx,
    check_metal_assembly,
    check_wkv7_wrapper,
    wkv7_mx_args,
)
from kernel_harness import cpu
from kernel_harness import wkv7 as harness
from oracle.wkv7 import (
    DEFAULT,
    MIXED,
    NEAR_ONE,
    TINY,
    WKV7_INPUTS,
    random_wkv7_inputs,
)

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
    args = wkv7_mx_args(random_wkv7_inputs(np.random.default_rng(0), 1, 3, 1, 16), "float32")
    with pytest.raises(RuntimeError, match="wkv7_kernel needs MLX with a Metal or CUDA"):
        WK.wkv7_kernel(*args)
    with pytest.raises(ValueError, match="k has shape"):
        WK.wkv7_kernel(args[0], args[1], args[2][:, :2], *args[3:])


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_wrapper_and_vjp_through_cpu_flavour(launch, monkeypatch, backend, dtype):
    called = check_wkv7_wrapper(monkeypatch, backend, WK, ENTRIES, launch, WK.wkv7_kernel, dtype)
    assert called == ["wkv7_fwd", "wkv7_bwd"]


def test_gpu_harness_imports_without_mlx():
    check_imports_without_mlx("test_wkv7_cuda")
