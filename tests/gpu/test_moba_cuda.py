"""The CUDA flavour of the MoBA kernels on a real GPU, through CuPy (no MLX on that machine):
first against the float64 oracle, then timed (after a sampled check at the timed shape). Run
with tests/gpu/run.sh."""

import time

import numpy as np
import pytest
from common import cuda_launcher, device_ms, error_line
from kernel_harness import moba as harness
from oracle.common import rel_err

pytestmark = pytest.mark.gpu

INSTANCES = [("float32", n) for n in (16, 32, 64, 128)] + [
    ("bfloat16", 64),
    ("bfloat16", 32),
    ("float16", 64),
]


@pytest.fixture(scope="module")
def cuda():
    return cuda_launcher(harness.ENTRIES, INSTANCES)


# (B, T, Hq, Hkv, D, chunk_size, top_k, key prefix, dtype)
CASES = [
    (1, 1, 1, 1, 16, 4, 2, 0, "float32"),
    (2, 37, 2, 1, 16, 8, 2, 0, "float32"),
    (1, 40, 2, 2, 32, 8, 0, 0, "float32"),
    (2, 50, 4, 2, 32, 8, 2, 0, "float32"),
    (1, 100, 2, 1, 16, 40, 1, 0, "float32"),
    (1, 45, 2, 2, 128, 8, 2, 0, "float32"),
    (2, 20, 4, 2, 32, 8, 2, 27, "float32"),
    (1, 1000, 4, 2, 64, 64, 3, 0, "float32"),
    (1, 1024, 8, 8, 64, 64, 3, 0, "float32"),
    (1, 2048, 8, 8, 64, 256, 3, 0, "float32"),  # the timed chunk and top_k, 8 chunks
    (2, 63, 4, 2, 64, 16, 2, 0, "bfloat16"),
    (1, 100, 2, 1, 32, 8, 2, 0, "bfloat16"),
    (2, 63, 4, 2, 64, 16, 2, 0, "float16"),
]


@pytest.mark.parametrize("B, T, Hq, Hkv, D, cs, top_k, prefix, dtype", CASES)
def test_cuda_flavour_matches_oracle(cuda, B, T, Hq, Hkv, D, cs, top_k, prefix, dtype):
    cp, launch, _ = cuda
    rng = np.random.default_rng(T + D)
    x = harness.random_inputs(rng, B, T, Hq, Hkv, D, cs, top_k, prefix=prefix, shuffle=True)
    errors = harness.compare(launch, x, cs, dtype, xp=cp)
    print(
        f"\n{dtype} B={B} T={T} Hq={Hq} Hkv={Hkv} D={D} cs={cs} top_k={top_k} prefix={prefix}: "
        + error_line(errors)
    )


def _rows_reference(x: dict, rows, cs: int, scale: float) -> dict:
    """float64 out, lse and dq of the query rows ``rows`` only, from their own slots."""
    B, T, Hq, D = x["q"].shape
    group = Hq // x["k"].shape[2]
    ref = {"out": [], "lse": [], "dq": []}
    for r in rows:
        b, t, h = r // (T * Hq), (r // Hq) % T, r % Hq
        keys = [
            c * cs + j
            for c, lim in zip(x["chunk"][b, t, h], x["limit"][b, t, h], strict=True)
            for j in range(lim + 1)
        ]
        K, V = x["k"][b, keys, h // group], x["v"][b, keys, h // group]
        s = scale * (K @ x["q"][b, t, h])
        lse = s.max() + np.log(np.exp(s - s.max()).sum())
        p = np.exp(s - lse)
        out = p @ V
        d_out = x["dout"][b, t, h]
        ds = p * (V @ d_out - (d_out @ out - x["dlse"][r]))
        ref["out"].append(out)
        ref["lse"].append(lse)
        ref["dq"].append(scale * ds @ K)
    return {name: np.array(v) for name, v in ref.items()}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("T", [4096, 8192])
def test_cuda_timing(cuda, T, dtype):
    cp, launch, device = cuda
    B, H, D, cs, top_k = 1, 8, 64, 256, 3
    t_setup = time.perf_counter()
    x = harness.rounded(
        harness.random_inputs(np.random.default_rng(T), B, T, H, H, D, cs, top_k), dtype
    )
    scale = float(np.float32(1.0 / np.sqrt(D)))
    launches, made = harness.plan(x, cs, scale, dtype, xp=cp)
    t_setup = time.perf_counter() - t_setup

    # verify, then time: sampled rows against float64, every gradient finite and non-zero
    for name, groups, threads, arrays in launches:
        launch(name, groups, threads, arrays)
    rows = np.random.default_rng(0).choice(B * T * H, size=48, replace=False)
    ref = _rows_reference(x, rows, cs, scale)
    got = {
        "out": harness.from_storage(made["out"].get(), dtype).reshape(-1, D)[rows],
        "lse": made["lse"].get().astype(np.float64)[rows],
        "dq": harness.from_storage(made["dq"].get(), dtype).reshape(-1, D)[rows],
    }
    tol = harness.TOL[dtype]
    for name in ("out", "lse", "dq"):
        err = rel_err(got[name], ref[name])
        assert err <= tol["grad" if name == "dq" else "out"], (name, err)
    for name in ("dk", "dv"):
        assert bool(cp.isfinite(made[name]).all()) and bool(cp.any(made[name] != 0)), name

    ms = [device_ms(cp, lambda a=a: launch(*a), reps=10) for a in launches]
    # attended keys over all rows: the work of every kernel is proportional to it
    keys = np.where(x["limit"] >= 0, np.minimum(x["limit"] + 1, T - x["chunk"] * cs), 0).sum()
    flops = [4 * D * keys, 6 * D * keys, 8 * D * keys]  # forward, dq, dk/dv multiply-adds x 2
    rates = " ".join(
        f"{name} {t:.3f} ms ({f / t / 1e6:.0f} GFLOP/s)"
        for name, t, f in zip(("forward", "dq", "dk/dv"), ms, flops, strict=True)
    )
    print(
        f"\nmoba cuda {dtype} on {device}, B={B} T={T} H={H} D={D} chunk={cs} top_k={top_k} "
        f"({keys / (B * T * H):.0f} keys per query): {rates}; backward {ms[1] + ms[2]:.3f} ms "
        f"[setup {t_setup:.1f} s]"
    )
