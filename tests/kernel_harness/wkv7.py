"""WKV7 kernels outside MLX: launches through a flavour-agnostic callback (a *launch*, see
kernel_harness.common) and the comparison with the float64 oracle. Never imports mlx (tests/gpu/
runs it without MLX)."""

from __future__ import annotations

import re

from kernel_harness import sources as standalone
from kernel_harness.common import TOL, check_errors, entry_arrays, from_storage, host, to_storage
from mlx_rwkvx.metal import sources

import numpy as np
from oracle.common import rel_err
from oracle.wkv7 import WKV7_INPUTS, wkv7_bwd_np, wkv7_np

FWD = sources.entry("wkv7_fwd.h")
BWD = sources.entry("wkv7_bwd.h")
ENTRIES = (FWD, BWD)
SEG = int(re.search(r"#define WKV7_SEG (\d+)", sources.kernel_source("wkv7.h")).group(1))
GRAD_NAMES = (*WKV7_INPUTS, "state")


def run(launch, inputs: dict, dy: np.ndarray, dstate: np.ndarray, dtype: str, xp=np) -> dict:
    """Forward then backward kernel on oracle-style float64 ``inputs`` (keys of WKV7_INPUTS and
    'state'). Returns float64 numpy arrays: y, state_out, sa, and the gradients ``d<name>``."""
    B, T, H, N = inputs["r"].shape
    n_seg = -(-T // SEG)
    seq, mat = (B, T, H, N), (B, H, N, N)
    dims = np.array([T, H], dtype=np.int32)
    fwd_shapes = {"y": seq, "state_out": mat, "ckpt": (B, H, n_seg, N, N), "sa": seq}
    fwd_arrays = entry_arrays(FWD, dtype, {**inputs, "dims": dims}, fwd_shapes, xp)
    launch(standalone.instance_name(FWD, dtype, N), B * H, N, fwd_arrays)
    out = dict(zip(FWD.output_names, fwd_arrays[len(FWD.inputs) :], strict=True))

    bwd_shapes = {name: seq for name in ("dr", "dlog_w", "dk", "dv", "da", "db")}
    bwd_shapes |= {"dstate0": mat, "scratch": (B * H, SEG, N, N)}
    values = {**inputs, "dy": dy, "dstate": dstate, "dims": dims}
    # the forward's saved tensors go in as they came out
    saved = {name: out[name] for name in ("ckpt", "sa")}
    bwd_arrays = entry_arrays(BWD, dtype, values, bwd_shapes, xp, ready=saved)
    launch(standalone.instance_name(BWD, dtype, N), B * H, N, bwd_arrays)
    grads = dict(zip(BWD.output_names, bwd_arrays[len(BWD.inputs) :], strict=True))

    result = {"y": from_storage(host(out["y"]), dtype)}
    result |= {name: host(out[name]).astype(np.float64) for name in ("state_out", "ckpt", "sa")}
    for name, ptype in BWD.outputs:
        if name != "scratch":
            raw = host(grads[name])
            key = "dstate" if name == "dstate0" else name  # the initial state's gradient
            result[key] = from_storage(raw, dtype) if ptype == "InT" else raw.astype(np.float64)
    return result


def rounded(inputs: dict, dtype: str) -> dict:
    """The inputs as the kernel sees them: r, k, v, a, b rounded to ``dtype`` (log_w and the
    state stay float32), back in float64 for the oracle."""
    out = {}
    for name, x in inputs.items():
        in_t = name in ("r", "k", "v", "a", "b")
        out[name] = from_storage(
            to_storage(x, dtype if in_t else "float32"), dtype if in_t else "float32"
        )
    return out


def compare(
    launch, inputs: dict, dtype: str, seed: int = 0, xp=np, kernels=run, name="WKV7 kernel"
) -> dict[str, float]:
    """Run the kernels (``kernels``: ``run``, or another harness's function of the same
    arguments and results) and the oracle (on the rounded inputs and cotangents); return the
    norm-wise relative error per named tensor, and assert each is within DESIGN.md's bounds."""
    rng = np.random.default_rng(seed)
    B, T, H, N = inputs["r"].shape
    dy = from_storage(to_storage(rng.standard_normal((B, T, H, N)), dtype), dtype)
    dstate = from_storage(to_storage(rng.standard_normal((B, H, N, N)), "float32"), "float32")
    x = rounded(inputs, dtype)
    got = kernels(launch, x, dy, dstate, dtype, xp)
    args = [x[name] for name in WKV7_INPUTS]
    y, state_out = wkv7_np(*args, x["state"])
    grads = wkv7_bwd_np(*args, x["state"], dy, dstate)
    errors = {"y": rel_err(got["y"], y), "state_out": rel_err(got["state_out"], state_out)}
    errors |= {f"d{name}": rel_err(got[f"d{name}"], grads[name]) for name in GRAD_NAMES}
    what = f"{name} ({dtype}, B={B} T={T} H={H} N={N})"
    d_names = [f"d{name}" for name in GRAD_NAMES]
    check_errors(what, TOL[dtype], errors, ("y", "state_out"), got, d_names)
    return errors
