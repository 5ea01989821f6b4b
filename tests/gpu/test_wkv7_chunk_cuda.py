"""The CUDA flavour of the chunked WKV7 kernel on a real GPU, through CuPy (no MLX on that
machine): first against the float64 oracle at each chunk length built, then timed beside the
sequential kernel and flash-linear-attention's ``chunk_rwkv7`` (Triton, carried as a wheel:
tests/gpu/run.sh installs it) at a Mac-like shape and a large one, with the GPU's matmul and
copy rates measured in the same run as the bounds. Run with tests/gpu/run.sh."""

import numpy as np
import pytest
from common import cuda_launcher, device_ms, error_line
from kernel_harness import sources as standalone
from kernel_harness import wkv7 as sequential
from kernel_harness import wkv7_chunk as harness
from kernel_harness.common import entry_arrays
from oracle.wkv7 import MIXED, random_wkv7_inputs

pytestmark = pytest.mark.gpu

BASE = [("float32", n) for n in (16, 32, 64, 128)] + [("bfloat16", 64), ("float16", 64)]
INSTANCES = [(d, n, L) for d, n in BASE for L in harness.lengths(n)]


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


@pytest.mark.parametrize("length", ["short", "long"])
@pytest.mark.parametrize("B, T, H, N, decays, dtype", CASES)
def test_cuda_flavour_matches_oracle(cuda, B, T, H, N, decays, dtype, length):
    cp, launch, _ = cuda
    L = harness.lengths(N)[0 if length == "short" else -1]
    inputs = random_wkv7_inputs(np.random.default_rng(T + N), B, T, H, N, decay_range=decays)
    errors = harness.compare(launch, inputs, dtype, seed=T, xp=cp, L=L)
    print(f"\nchunked L={L} {dtype} B={B} T={T} H={H} N={N}: " + error_line(errors))


def _outputs(entry, arrays) -> dict:
    return dict(zip(entry.output_names, arrays[len(entry.inputs) :], strict=True))


def _chunked_runs(cp, launch, values: dict, dtype: str, L: int):
    """(forward, backward): the chunked kernel's entries in chunks of ``L`` steps on device
    buffers made once."""
    B, T, H, N = values["r"].shape
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
        return standalone.instance_name(entry, dtype, N, L)

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


def _fla_runs(values: dict, dtype: str):
    """(forward, backward) of flash-linear-attention's chunk_rwkv7 on the same inputs (torch
    tensors made once), or None without torch, CUDA or fla (tests/gpu/run.sh installs the
    wheel where one was carried)."""
    try:
        import torch
        from fla.ops.rwkv7 import chunk_rwkv7
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    kind = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]

    def tensor(name, as_dtype=kind):
        return torch.tensor(values[name], device="cuda").to(as_dtype).requires_grad_(True)

    r, k, v, a, b = (tensor(n) for n in ("r", "k", "v", "a", "b"))
    log_w = tensor("log_w", kind)  # fla takes the log-decay in the inputs' dtype
    state = torch.tensor(values["state"], device="cuda", dtype=torch.float32)
    state = state.transpose(-1, -2).contiguous().requires_grad_(True)  # fla's [B, H, K, V]
    dy = torch.tensor(values["dy"], device="cuda").to(kind)
    dstate = torch.tensor(values["dstate"], device="cuda", dtype=torch.float32)
    out = {}

    def forward():
        out["y"], out["s"] = chunk_rwkv7(
            r=r,
            w=log_w,
            k=k,
            v=v,
            a=a,
            b=b,
            scale=1.0,
            initial_state=state,
            output_final_state=True,
        )

    def backward():  # the gradients returned, not accumulated into .grad
        torch.autograd.grad(
            (out["y"], out["s"]), (r, log_w, k, v, a, b, state), (dy, dstate), retain_graph=True
        )

    forward()
    return forward, backward


def _torch_ms(fn, reps: int) -> float:
    import torch

    fn()
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    stop.record()
    stop.synchronize()
    return start.elapsed_time(stop) / reps


def _bounds(cp) -> tuple[float, float]:
    """This GPU's float32 matmul FLOP/s (8192^3, cuBLAS) and copy bandwidth (bytes read and
    written per second, 1 GiB), measured now."""
    n = 8192
    x = cp.random.standard_normal((n, n), dtype=cp.float32)
    flops = 2 * n**3 / (device_ms(cp, lambda: x @ x, reps=5) / 1e3)
    src = cp.zeros(1 << 28, dtype=cp.float32)
    dst = cp.empty_like(src)
    copy_ms = device_ms(cp, lambda: cp.copyto(dst, src), reps=10)
    return flops, 2 * src.nbytes / (copy_ms / 1e3)


# (B, T, H, N): batch 1 of a 0.75B-class model (12 heads) and a large batch; the goals: >= 4x
# the sequential kernel's fwd+bwd at the first, at least its speed and ahead of fla at the second
SHAPES = {"mac-like": (1, 4096, 12, 64), "large": (8, 4096, 64, 64)}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_cuda_timing_against_the_sequential_kernel_and_fla(cuda, shape, dtype):
    cp, launch, device = cuda
    B, T, H, N = SHAPES[shape]
    rng = np.random.default_rng(0)
    values = random_wkv7_inputs(rng, B, T, H, N, decay_range=(0.5, 0.999))
    values |= {
        "dims": np.array([T, H], dtype=np.int32),
        "dy": rng.standard_normal((B, T, H, N)),
        "dstate": rng.standard_normal((B, H, N, N)),
    }
    # one implementation's buffers at a time (at the large shape each holds 13-24 GB)
    makers = {"sequential": lambda: _sequential_runs(cp, launch, values, dtype)}
    for L in harness.lengths(N):
        makers[f"chunked L={L}"] = lambda L=L: _chunked_runs(cp, launch, values, dtype, L)
    times = {}
    for kind, make in makers.items():
        forward, backward = make()
        times[kind] = (device_ms(cp, forward, reps=5), device_ms(cp, backward, reps=5))
        del forward, backward
        cp.get_default_memory_pool().free_all_blocks()
    fla = _fla_runs(values, dtype)
    if fla is not None:
        cp.cuda.Device().synchronize()
        times["fla chunk_rwkv7"] = (_torch_ms(fla[0], reps=5), _torch_ms(fla[1], reps=5))
        fla = None
        import torch

        torch.cuda.empty_cache()
    # the recurrence's FLOPs (the step loop's 8 N^2 a head-step forward, twice that backward)
    # and its least traffic (fwd: six inputs read, y written; bwd: six inputs and dy read, six
    # gradients written), float32 or 2-byte elements; log_w float32 throughout
    peak_flops, bandwidth = _bounds(cp)
    flops = 24 * N * N * B * T * H
    size = 4 if dtype == "float32" else 2
    moved = B * T * H * N * (4 * 3 + size * 17)  # log_w read twice and its gradient, float32
    bound_ms = max(flops / peak_flops, moved / bandwidth) * 1e3
    print(
        f"\nwkv7 {shape} B={B} T={T} H={H} N={N} {dtype} on {device}: bounds "
        f"{peak_flops / 1e12:.1f} TFLOP/s fp32, {bandwidth / 1e12:.2f} TB/s -> {bound_ms:.3f} ms"
    )
    base = sum(times["sequential"])
    for kind, (f, b) in times.items():
        print(
            f"  {kind:<16} fwd {f:8.3f} ms  bwd {b:8.3f} ms  {base / (f + b):5.2f}x sequential"
            f"  {bound_ms / (f + b):6.1%} of the bound"
        )
    if "fla chunk_rwkv7" not in times:
        print("  fla chunk_rwkv7: not importable here (torch, CUDA and the fla-core wheel)")
