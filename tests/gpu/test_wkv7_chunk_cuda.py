"""The CUDA flavour of the chunked WKV7 kernel on a real GPU, through CuPy (no MLX on that
machine): first against the float64 oracle, then timed beside the sequential kernel at a
Mac-like shape and a large one. Run with tests/gpu/run.sh."""

import numpy as np
import pytest
from common import cuda_launcher, device_ms, error_line
from kernel_harness import sources as standalone
from kernel_harness import wkv7 as sequential
from kernel_harness import wkv7_chunk as harness
from kernel_harness.common import entry_arrays
from oracle.wkv7 import random_wkv7_inputs

pytestmark = pytest.mark.gpu

INSTANCES = [("float32", n) for n in (16, 32, 64, 128)] + [("bfloat16", 64), ("float16", 64)]
MIXED = (1e-4, 0.9999)


@pytest.fixture(scope="module")
def cuda():
    return cuda_launcher(harness.ENTRIES + sequential.ENTRIES, INSTANCES)


CASES = [
    (2, 1, 2, 16, MIXED, "float32"),
    (2, 17, 3, 32, MIXED, "float32"),
    (2, 63, 2, 64, (0.5, 0.999), "float32"),
    (2, 100, 2, 16, (0.9999, 0.9999), "float32"),
    (1, 50, 2, 16, (1e-4, 1e-4), "float32"),
    (1, 100, 2, 128, MIXED, "float32"),
    (1, 1000, 2, 64, (0.9999, 0.9999), "float32"),
    (2, 63, 2, 64, MIXED, "bfloat16"),
    (2, 63, 2, 64, MIXED, "float16"),
]


@pytest.mark.parametrize("B, T, H, N, decays, dtype", CASES)
def test_cuda_flavour_matches_oracle(cuda, B, T, H, N, decays, dtype):
    cp, launch, _ = cuda
    inputs = random_wkv7_inputs(np.random.default_rng(T + N), B, T, H, N, decay_range=decays)
    errors = harness.compare(launch, inputs, dtype, seed=T, xp=cp)
    print(f"\nchunked {dtype} B={B} T={T} H={H} N={N}: " + error_line(errors))


def _outputs(entry, arrays) -> dict:
    return dict(zip(entry.output_names, arrays[len(entry.inputs) :], strict=True))


def _chunked_runs(cp, launch, values: dict, dtype: str):
    """(forward, backward): the chunked kernel's entries on device buffers made once."""
    B, T, H, N = values["r"].shape
    L = harness.chunk_length(N)
    n_chunks = -(-T // L)
    mapped = (B, H, n_chunks, L, N)
    shapes = {name: mapped for name in harness.MAPS_NAMES} | {"cL": (B, H, n_chunks, N)}
    maps = entry_arrays(harness.MAPS, dtype, values, shapes, cp)
    saved = _outputs(harness.MAPS, maps)
    shapes = {"y": values["r"].shape, "state_out": (B, H, N, N), "ckpt": (B, H, n_chunks, N, N)}
    scan = entry_arrays(harness.SCAN, dtype, values, shapes | {"Z": mapped}, cp, ready=saved)
    saved |= _outputs(harness.SCAN, scan)
    shapes = {name: mapped for name in ("dW", "dQm", "dZ", "dKL", "dBL", "dv0")}
    shapes |= {"ddecay": (B, H, n_chunks, N), "dstate0": (B, H, N, N)}
    back_scan = entry_arrays(harness.BWD_SCAN, dtype, values, shapes, cp, ready=saved)
    saved |= _outputs(harness.BWD_SCAN, back_scan)
    shapes = {name: values["r"].shape for name in ("dr", "dlog_w", "dk", "dv", "da", "db")}
    back_maps = entry_arrays(harness.BWD_MAPS, dtype, values, shapes, cp, ready=saved)

    def name(entry):
        return standalone.instance_name(entry, dtype, N)

    def forward():
        launch(name(harness.MAPS), B * H * n_chunks, N, maps)
        launch(name(harness.SCAN), B * H, N, scan)

    def backward():
        launch(name(harness.BWD_SCAN), B * H, N, back_scan)
        launch(name(harness.BWD_MAPS), B * H * n_chunks, N, back_maps)

    return forward, backward


def _sequential_runs(cp, launch, values: dict, dtype: str):
    """(forward, backward): the sequential kernel's entries on device buffers made once."""
    B, T, H, N = values["r"].shape
    seq, mat = (B, T, H, N), (B, H, N, N)
    shapes = {"y": seq, "state_out": mat, "ckpt": (B, H, -(-T // sequential.SEG), N, N)}
    fwd = entry_arrays(sequential.FWD, dtype, values, shapes | {"sa": seq}, cp)
    saved = _outputs(sequential.FWD, fwd)
    shapes = {name: seq for name in ("dr", "dlog_w", "dk", "dv", "da", "db")}
    shapes |= {"dstate0": mat, "scratch": (B * H, sequential.SEG, N, N)}
    bwd = entry_arrays(sequential.BWD, dtype, values, shapes, cp, ready=saved)

    def forward():
        launch(standalone.instance_name(sequential.FWD, dtype, N), B * H, N, fwd)

    def backward():
        launch(standalone.instance_name(sequential.BWD, dtype, N), B * H, N, bwd)

    return forward, backward


# (B, T, H, N): batch 1 of a 0.75B-class model (12 heads) and a large batch; the goals: >= 4x
# the sequential kernel's fwd+bwd at the first, at least its speed at the second
SHAPES = {"mac-like": (1, 4096, 12, 64), "large": (8, 4096, 64, 64)}


@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_timing_against_the_sequential_kernel(cuda, shape):
    cp, launch, device = cuda
    B, T, H, N = SHAPES[shape]
    dtype = "float32"
    rng = np.random.default_rng(0)
    values = random_wkv7_inputs(rng, B, T, H, N, decay_range=(0.5, 0.999))
    values |= {
        "dims": np.array([T, H], dtype=np.int32),
        "dy": rng.standard_normal((B, T, H, N)),
        "dstate": rng.standard_normal((B, H, N, N)),
    }
    times = {}
    for kind, runs in (("sequential", _sequential_runs), ("chunked", _chunked_runs)):
        forward, backward = runs(cp, launch, values, dtype)
        times[kind] = (device_ms(cp, forward, reps=5), device_ms(cp, backward, reps=5))
    # FLOPs of the recurrence itself (the step loop's 8 N^2 a head-step, forward; twice that
    # backward): the same count for both, so their rates compare directly
    flops = 8 * N * N * B * T * H
    line = ", ".join(
        f"{kind} fwd {f:.2f} ms bwd {b:.2f} ms ({3 * flops / (f + b) / 1e9:.0f} GFLOP/s)"
        for kind, (f, b) in times.items()
    )
    ratio = sum(times["sequential"]) / sum(times["chunked"])
    print(f"\nwkv7 {shape} B={B} T={T} H={H} N={N} on {device}: {line}; chunked {ratio:.2f}x")
