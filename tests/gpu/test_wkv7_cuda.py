"""The CUDA flavour of the WKV7 kernels on a real GPU, through CuPy (no MLX on that machine):
first against the float64 oracle, then timed. Run with tests/gpu/run.sh."""

import time

import numpy as np
import pytest
from common import cuda_launcher, device_ms, error_line
from kernel_harness import sources as standalone
from kernel_harness import wkv7 as harness
from oracle.wkv7 import MIXED, random_wkv7_inputs

pytestmark = pytest.mark.gpu

INSTANCES = [("float32", n) for n in (16, 32, 64, 128)] + [
    ("bfloat16", 64),
    ("bfloat16", 16),
    ("float16", 64),
]


@pytest.fixture(scope="module")
def cuda():
    return cuda_launcher(harness.ENTRIES, INSTANCES)


CASES = [
    (2, 1, 2, 16, MIXED, "float32"),
    (2, 17, 3, 32, MIXED, "float32"),
    (2, 63, 2, 64, (0.5, 0.999), "float32"),
    (2, 100, 2, 16, (0.9999, 0.9999), "float32"),
    (1, 50, 2, 16, (1e-4, 1e-4), "float32"),
    (1, 100, 2, 128, MIXED, "float32"),
    (1, 1000, 2, 64, MIXED, "float32"),
    (1, 1024, 8, 64, MIXED, "float32"),  # the timed shape
    (2, 63, 2, 64, MIXED, "bfloat16"),
    (1, 100, 2, 16, MIXED, "bfloat16"),
    (2, 63, 2, 64, MIXED, "float16"),
]


@pytest.mark.parametrize("B, T, H, N, decays, dtype", CASES)
def test_cuda_flavour_matches_oracle(cuda, B, T, H, N, decays, dtype):
    cp, launch, _ = cuda
    inputs = random_wkv7_inputs(np.random.default_rng(T + N), B, T, H, N, decay_range=decays)
    errors = harness.compare(launch, inputs, dtype, seed=T, xp=cp)
    print(f"\n{dtype} B={B} T={T} H={H} N={N}: " + error_line(errors))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [1024, 4096])
def test_cuda_timing(cuda, T, dtype):
    cp, launch, device = cuda
    B, H, N = 1, 8, 64
    n_seg = -(-T // harness.SEG)
    rng = np.random.default_rng(0)
    inputs = random_wkv7_inputs(rng, B, T, H, N, decay_range=MIXED)
    x = {
        k: cp.asarray(harness.to_storage(v, dtype if k in ("r", "k", "v", "a", "b") else "float32"))
        for k, v in inputs.items()
    }
    seq, mat = (B, T, H, N), (B, H, N, N)
    itype = np.float32 if dtype == "float32" else np.uint16
    dims = cp.asarray(np.array([T, H], dtype=np.int32))
    y, sa = cp.zeros(seq, itype), cp.zeros(seq, np.float32)
    s_out, ckpt = cp.zeros(mat, np.float32), cp.zeros((B, H, n_seg, N, N), np.float32)
    fwd_args = [x[k] for k in ("r", "log_w", "k", "v", "a", "b", "state")] + [
        dims,
        y,
        s_out,
        ckpt,
        sa,
    ]
    dy = cp.asarray(harness.to_storage(rng.standard_normal(seq), dtype))
    dstate = cp.asarray(rng.standard_normal(mat).astype(np.float32))
    grads = [cp.zeros(seq, itype), cp.zeros(seq, np.float32)] + [
        cp.zeros(seq, itype) for _ in range(4)
    ]
    scratch = cp.zeros((B * H, harness.SEG, N, N), np.float32)
    bwd_args = (
        [x[k] for k in ("r", "log_w", "k", "v", "a", "b")]
        + [dy, dstate, ckpt, sa, dims]
        + grads
        + [cp.zeros(mat, np.float32), scratch]
    )
    fwd_name = standalone.instance_name(harness.FWD, dtype, N)
    bwd_name = standalone.instance_name(harness.BWD, dtype, N)
    t0 = time.perf_counter()
    fwd_ms = device_ms(cp, lambda: launch(fwd_name, B * H, N, fwd_args), reps=20)
    bwd_ms = device_ms(cp, lambda: launch(bwd_name, B * H, N, bwd_args), reps=20)
    wall = time.perf_counter() - t0
    # bytes each kernel must move at least: its inputs and outputs (scratch traffic excluded)
    fwd_bytes = sum(a.nbytes for a in fwd_args)
    bwd_bytes = sum(a.nbytes for a in bwd_args) - scratch.nbytes
    print(
        f"\nwkv7 cuda {dtype} on {device}, B={B} T={T} H={H} N={N}: "
        f"forward {fwd_ms:.3f} ms ({B * T / fwd_ms / 1e3:.2f} Mtok/s, "
        f"{fwd_bytes / fwd_ms / 1e6:.1f} GB/s), "
        f"backward {bwd_ms:.3f} ms ({bwd_bytes / bwd_ms / 1e6:.1f} GB/s) [{wall:.1f} s wall]"
    )
    assert bool(cp.isfinite(grads[1]).all()) and bool(cp.isfinite(s_out).all())
