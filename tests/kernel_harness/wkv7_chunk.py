"""The chunked WKV7 kernel (metal/wkv7_chunk.h) outside MLX: its forward through a *launch* (see
kernel_harness.common) and the comparison with the float64 oracle. Never imports mlx."""

from __future__ import annotations

import re

from kernel_harness import sources as standalone
from kernel_harness.common import TOL, check_errors, entry_arrays, from_storage, host
from kernel_harness.wkv7 import rounded
from mlx_rwkvx.metal import sources

import numpy as np
from oracle.common import rel_err
from oracle.wkv7 import WKV7_INPUTS, wkv7_np

MAPS = sources.entry("wkv7c_fwd_maps.h")
SCAN = sources.entry("wkv7c_fwd_scan.h")
ENTRIES = (MAPS, SCAN)
_SIZES = re.search(
    r"#define WKV7C_L\(n\) \(\(n\) > (\d+) \? (\d+) : (\d+)\)",
    sources.kernel_source("wkv7_chunk.h"),
)
MAPS_NAMES = ("W", "U0", "Qm", "Y0", "KL", "BL")


def chunk_length(N: int) -> int:
    """WKV7C_L(N) of metal/wkv7_chunk.h."""
    limit, large, small = (int(x) for x in _SIZES.groups())
    return large if N > limit else small


def forward(launch, inputs: dict, dtype: str, xp=np) -> dict:
    """Both entries on oracle-style float64 ``inputs`` (keys of WKV7_INPUTS and 'state').
    Returns float64 NumPy arrays: y, state_out, ckpt."""
    B, T, H, N = inputs["r"].shape
    L = chunk_length(N)
    n_chunks = -(-T // L)
    dims = np.array([T, H], dtype=np.int32)
    maps_shape = (B, H, n_chunks, L, N)
    shapes = {name: maps_shape for name in MAPS_NAMES} | {"dlo": (B, H, n_chunks, N)}
    maps_arrays = entry_arrays(MAPS, dtype, {**inputs, "dims": dims}, shapes, xp)
    launch(standalone.instance_name(MAPS, dtype, N), B * H * n_chunks, N, maps_arrays)
    maps = dict(zip(MAPS.output_names, maps_arrays[len(MAPS.inputs) :], strict=True))

    shapes = {"y": (B, T, H, N), "state_out": (B, H, N, N), "ckpt": (B, H, n_chunks, N, N)}
    scan_arrays = entry_arrays(SCAN, dtype, {**inputs, "dims": dims}, shapes, xp, ready=maps)
    launch(standalone.instance_name(SCAN, dtype, N), B * H, N, scan_arrays)
    out = dict(zip(SCAN.output_names, scan_arrays[len(SCAN.inputs) :], strict=True))
    return {
        "y": from_storage(host(out["y"]), dtype),
        "state_out": host(out["state_out"]).astype(np.float64),
        "ckpt": host(out["ckpt"]).astype(np.float64),
    }


def compare_forward(launch, inputs: dict, dtype: str, xp=np) -> dict[str, float]:
    """The forward against the oracle on the inputs rounded as the kernel sees them: the
    norm-wise relative error of y and of the final state, asserted within DESIGN.md's bounds."""
    x = rounded(inputs, dtype)
    got = forward(launch, x, dtype, xp)
    y, state_out = wkv7_np(*(x[name] for name in WKV7_INPUTS), x["state"])
    errors = {"y": rel_err(got["y"], y), "state_out": rel_err(got["state_out"], state_out)}
    B, T, H, N = inputs["r"].shape
    what = f"chunked WKV7 kernel ({dtype}, B={B} T={T} H={H} N={N})"
    check_errors(what, TOL[dtype], errors, ("y", "state_out"), got, ())
    return errors
