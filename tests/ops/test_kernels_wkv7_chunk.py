"""The chunked WKV7 kernel body (metal/wkv7_chunk.h): its CPU flavour against the float64 oracle
(outputs and all seven gradients) at every chunk length it is built for, the CUDA flavour
through nvcc, the Metal source as MLX assembles it, and the MLX wrapper (wkv7_chunked_kernel
and its VJP) and the dispatcher's use of it driven through the CPU flavour."""

import importlib
import subprocess

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.metal import shapes
from mlx_rwkvx.ops import tuning
from mlx_rwkvx.ops.wkv7 import kernel as WK

import mlx.core as mx
import numpy as np
import pytest
from helpers.mlx_kernel_emulation import (
    check_cuda_compiles,
    check_imports_without_mlx,
    check_metal_assembly,
    check_wkv7_wrapper,
    kernels_through_cpu,
    wkv7_mx_args,
)
from kernel_harness import cpu
from kernel_harness import sources as standalone
from kernel_harness import wkv7 as sequential
from kernel_harness import wkv7_chunk as harness
from kernel_harness.common import TOL
from oracle.common import rel_err
from oracle.wkv7 import (
    DEFAULT,
    MIXED,
    NEAR_ONE,
    TINY,
    WKV7_INPUTS,
    random_wkv7_inputs,
    wkv7_np,
)

HEAD_SIZES = (16, 32, 64, 128)


@pytest.fixture(scope="session")
def launch(request, tmp_path_factory):
    return cpu.fixture_launch(
        request,
        tmp_path_factory,
        harness.ENTRIES,
        HEAD_SIZES,
        lambda n: [(L,) for L in harness.lengths(n)],
    )


# (B, T, H, N, decays, with_state): T shorter than a chunk, at and across chunk edges, ragged
FLOAT32_CASES = [
    (2, 1, 2, 16, MIXED, True),
    (2, 15, 2, 16, DEFAULT, True),
    (2, 16, 2, 16, DEFAULT, False),
    (2, 17, 3, 32, MIXED, True),
    (1, 40, 2, 64, MIXED, True),
    (2, 63, 2, 64, DEFAULT, True),
    # every decay 1e-4: d log_w is ~1e-4 of the other gradients, each share of it computed with
    # w in its product (the MLX chunked path's reverse cumulative sum loses it: 1e-3 there)
    (1, 50, 2, 16, TINY, True),
    (1, 37, 1, 128, MIXED, True),
    (2, 100, 2, 16, NEAR_ONE, True),
    # the case the sequential kernel's hi + lo split exists for (tests/ops/test_kernels_wkv7.py):
    # w = 0.9999 over 1000 steps; the chunks carry e^{c_L} - 1 once per chunk
    (1, 1000, 1, 64, NEAR_ONE, True),
]


@pytest.mark.parametrize("length", ["short", "long"])
@pytest.mark.parametrize("B, T, H, N, decays, with_state", FLOAT32_CASES)
def test_cpu_flavour_float32_matches_oracle(launch, B, T, H, N, decays, with_state, length):
    # at both chunk lengths built for N (chunk edges move: 16 steps is two chunks of 8)
    rng = np.random.default_rng(T * 131 + N)
    inputs = random_wkv7_inputs(rng, B, T, H, N, decay_range=decays)
    if not with_state:
        inputs["state"] = np.zeros_like(inputs["state"])
    L = harness.lengths(N)[0 if length == "short" else -1]
    harness.compare(launch, inputs, "float32", seed=T, L=L)


def test_any_decay_is_safe(launch):
    # decays down to 1e-35 a step: every factor is an exponential of a difference <= 0, and
    # log_w below WKV7C_LOG_W_MIN (1.1e-7 a step) gets no gradient, as it changes nothing
    rng = np.random.default_rng(11)
    inputs = random_wkv7_inputs(rng, 1, 70, 2, 16)
    inputs["log_w"] = rng.uniform(-80.0, 0.0, inputs["log_w"].shape)
    harness.compare(launch, inputs, "float32", seed=12)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cpu_flavour_low_precision(launch, dtype):
    inputs = random_wkv7_inputs(np.random.default_rng(5), 2, 33, 2, 32)
    harness.compare(launch, inputs, dtype, seed=4)


def test_correlated_keys(launch):
    # keys pointing alike with in-context learning rates near 1: A_ab's entries near -1, which
    # forward and back substitution take in their stride
    rng = np.random.default_rng(16)
    T, N = 37, 16
    inputs = random_wkv7_inputs(rng, 1, T, 2, N, decay_range=(0.99, 0.9999))
    kk = rng.standard_normal((1, 1, 2, N)) + 0.4 * rng.standard_normal((1, T, 2, N))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    inputs["a"], inputs["b"] = -kk, kk * rng.uniform(0.9, 1.0, kk.shape)
    harness.compare(launch, inputs, "float32", seed=17)


def test_checkpoints_are_the_states_entering_each_chunk(launch):
    # what the backward will start from: checkpoint c equals the state after c chunks
    rng = np.random.default_rng(3)
    inputs = random_wkv7_inputs(rng, 1, 40, 1, 16)
    L = harness.lengths(16)[0]
    got = harness.forward(launch, inputs, "float32", L=L)
    for c in range(got["ckpt"].shape[2]):
        if c == 0:
            want = inputs["state"][:, :, :, :]
        else:
            part = {name: x[:, : c * L] for name, x in inputs.items() if name != "state"}
            _, want = wkv7_np(*(part[n] for n in WKV7_INPUTS), inputs["state"])
        assert np.abs(got["ckpt"][:, :, c] - want).max() <= 1e-5 * np.abs(want).max()


def test_metal_assembly_names_its_thread_ids_and_compiles_as_cpp(tmp_path):
    instances = [("float32", 64, 16), ("bfloat16", 16, 8), ("float16", 128, 4)]
    check_metal_assembly(tmp_path, "wkv7_chunk", harness.ENTRIES, instances, small=("dims",))


def test_cuda_flavour_compiles_with_nvcc(tmp_path):
    instances = [("float32", 16, 16), ("float32", 64, 8), ("float32", 128, 8), ("bfloat16", 64, 16)]
    check_cuda_compiles(
        tmp_path, "wkv7_chunk", harness.ENTRIES, instances, as_mlx=[("float16", 32, 16)]
    )


def test_threadgroup_memory_rule_is_the_bodys(tmp_path):
    # metal/shapes.py's rule and the header's compile-time check agree: the lengths built fit
    # (the fixture compiled them), the next power of two does not compile
    if cpu.compiler() is None:
        pytest.skip("no C++ compiler")
    assert {N: WK.chunk_lengths(N) for N in HEAD_SIZES} == {
        16: (8, 16),
        32: (8, 16),
        64: (8, 16),
        128: (4, 8),
    }
    for N in HEAD_SIZES:
        L = 2 * WK.chunk_lengths(N)[-1]
        assert not shapes.wkv7_chunk_fits(N, L)
        path = tmp_path / f"too_long_{N}.cpp"
        instances = [("float32", N, L)]
        path.write_text(standalone.standalone_source("cpu", harness.ENTRIES, instances))
        cmd = [cpu.compiler(), "-std=c++20", "-fsyntax-only", str(path)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        assert done.returncode != 0 and "chunk too long" in done.stderr, (N, L)


def test_without_a_backend_the_wrapper_says_so():
    if WK.kernel_backend() is not None:
        pytest.skip("this MLX has a GPU backend")
    args = wkv7_mx_args(random_wkv7_inputs(np.random.default_rng(0), 1, 3, 1, 16), "float32")
    with pytest.raises(RuntimeError, match="wkv7_chunked_kernel needs MLX with a Metal or CUDA"):
        WK.wkv7_chunked_kernel(*args)


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_wrapper_and_vjp_through_cpu_flavour(launch, monkeypatch, backend, dtype):
    fn = WK.wkv7_chunked_kernel
    called = check_wkv7_wrapper(monkeypatch, backend, WK, harness.ENTRIES, launch, fn, dtype)
    assert called == ["wkv7c_fwd_maps", "wkv7c_fwd_scan", "wkv7c_bwd_scan", "wkv7c_bwd_maps"]


def test_gpu_harness_imports_without_mlx():
    check_imports_without_mlx("test_wkv7_chunk_cuda")


def test_a_small_chunk_decay_keeps_the_state_to_relative_precision(launch):
    # w = e^-0.6 every step: each chunk keeps e^-9.6 of its state. Kept as S + S (g - 1), the
    # state would lose g's relative precision (1e-3 off here); as S hi + S lo it keeps it
    rng = np.random.default_rng(64)
    inputs = random_wkv7_inputs(rng, 1, 64, 2, 16)
    inputs["log_w"] = np.full_like(inputs["log_w"], -0.6)
    inputs["v"][:, 8:] = 0.0
    inputs["a"] *= 1e-3  # the state then mostly decays: its relative precision is what is seen
    inputs["b"] *= 1e-3
    errors = harness.compare(launch, inputs, "float32", seed=65)
    assert errors["state_out"] <= 1e-6, errors


def test_nan_in_log_w_reaches_the_outputs(launch):
    # the clamp at WKV7C_LOG_W_MIN must not turn NaN into a decay (the MLX paths propagate it)
    inputs = random_wkv7_inputs(np.random.default_rng(8), 1, 20, 1, 16)
    inputs["log_w"][0, 5, 0, 3] = np.nan
    got = harness.forward(launch, inputs, "float32")
    assert np.isnan(got["state_out"]).any() and np.isnan(got["y"][0, 5:]).any()
    assert np.isfinite(got["y"][0, :5]).all()


@pytest.mark.parametrize("drop", ["each chunk's first step", "ten steps, then near 1"])
def test_a_large_drop_inside_a_chunk_leaves_the_later_steps_exact(launch, drop):
    # every exponent is summed over its own range of steps: a difference of prefix sums would
    # carry the rounding of the drop (~1e-5 relative here: y, state and every gradient)
    inputs = random_wkv7_inputs(np.random.default_rng(3), 1, 64, 2, 16)
    log_w = np.full(inputs["log_w"].shape, np.log(0.999))
    if drop == "each chunk's first step":
        log_w[:, :: harness.lengths(16)[-1]] = -9.0
    else:
        log_w[:, :10], log_w[:, 10:] = -15.99, -1e-3
    inputs["log_w"] = log_w
    harness.compare(launch, inputs, "float32", seed=4)


def test_chunk_must_be_a_length_built():
    args = wkv7_mx_args(random_wkv7_inputs(np.random.default_rng(0), 1, 3, 1, 128), "float32")
    with pytest.raises(ValueError, match=r"chunk=16 at head size 128; built for \(4, 8\)"):
        WK.wkv7_chunked_kernel(*args, chunk=16)


def test_dispatcher_checks_times_and_forces_each_chunk_length(launch, monkeypatch, tmp_path):
    # as on a GPU with only the chunked kernels: each length is self-checked on its own, the
    # tuner times both beside the MLX path, and impl= runs the one it names
    W = importlib.import_module("mlx_rwkvx.ops.wkv7")
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    monkeypatch.setattr(W.DISPATCH, "tuner", tuning.Tuner(tmp_path / "tuning.json"))
    monkeypatch.setattr(W.DISPATCH, "results", {})
    monkeypatch.setattr(W.DISPATCH, "reasons", {})
    entries = (*harness.ENTRIES, *sequential.ENTRIES)  # built, never launched
    with kernels_through_cpu(monkeypatch, "metal", WK, entries, launch) as calls:
        here = W.DISPATCH.kernels((32, mx.float32))
        assert here == ("kernel", "chunked_kernel_8", "chunked_kernel_16")
        real = W.DISPATCH.kernels
        monkeypatch.setattr(W.DISPATCH, "kernels", lambda key=None: real(key)[1:])
        inputs = random_wkv7_inputs(np.random.default_rng(9), 1, 40, 2, 32, decay_range=MIXED)
        args = wkv7_mx_args(inputs, "float32")
        y, state = W.wkv7(*args)
        mx.eval(y, state)
        assert W.DISPATCH.results == {
            ("chunked_kernel_8", (32, mx.float32)): True,
            ("chunked_kernel_16", (32, mx.float32)): True,
        }
        [(name, chosen, timings)] = W.DISPATCH.tuner.entries()
        assert name == "wkv7 N=32 float32 T<=64"
        assert set(timings) == {"ref", "chunked", "chunked_kernel_8", "chunked_kernel_16"}
        assert chosen == min(timings, key=timings.__getitem__)
        del calls[:]
        y8, state8 = W.wkv7(*args, impl="chunked_kernel_8")
        mx.eval(y8, state8)
        assert [name for name, _ in calls] == ["wkv7c_fwd_maps", "wkv7c_fwd_scan"]
        assert calls[0][1]["r"] == 40 * 2 * 32 and calls[0][1]["L"] == calls[1][1]["L"] == 8
        with pytest.raises(UserError, match="'chunked_kernel_16' has no form for size 128 float32"):
            W.wkv7(
                *wkv7_mx_args(
                    random_wkv7_inputs(np.random.default_rng(0), 1, 3, 1, 128), "float32"
                ),
                impl="chunked_kernel_16",
            )
    y_ref, s_ref = wkv7_np(*(inputs[n] for n in WKV7_INPUTS), inputs["state"])
    for got_y, got_s in ((y, state), (y8, state8)):
        assert rel_err(np.array(got_y), y_ref) <= TOL["float32"]["out"]
        assert rel_err(np.array(got_s), s_ref) <= TOL["float32"]["out"]


def test_info_bench_times_each_chunk_length(launch, monkeypatch):
    # info --bench (bench_here) on a device whose chunked kernels passed: a row per length
    from mlx_rwkvx import bench_here

    W = importlib.import_module("mlx_rwkvx.ops.wkv7")
    shapes = bench_here.Shapes(
        wkv7=((1, 40, 2, 32),), moba=(), lora_batch=1, lora_length=16, lora_steps=1, repeats=1
    )
    monkeypatch.setattr(W.DISPATCH, "results", {})
    monkeypatch.setattr(W.DISPATCH, "reasons", {})
    entries = (*harness.ENTRIES, *sequential.ENTRIES)  # built, never launched
    with kernels_through_cpu(monkeypatch, "cuda", WK, entries, launch):
        real = W.DISPATCH.kernels
        monkeypatch.setattr(W.DISPATCH, "kernels", lambda key=None: real(key)[1:])
        lines = bench_here.wkv7_lines(shapes)
    assert [line.split()[7] for line in lines] == [
        "ref",
        "chunked",
        "chunked_kernel_8",
        "chunked_kernel_16",
    ]
