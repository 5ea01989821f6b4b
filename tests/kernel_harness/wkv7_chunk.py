"""The chunked WKV7 kernel (metal/wkv7_chunk.h) outside MLX: its forward and backward through a
*launch* (see kernel_harness.common) and the comparison with the float64 oracle. Never imports
mlx."""

from __future__ import annotations

from functools import partial

from kernel_harness import sources as standalone
from kernel_harness import wkv7 as sequential
from kernel_harness.common import (
    entry_arrays,
    from_storage,
    host,
)
from mlx_rwkvx.metal import sources
from mlx_rwkvx.metal.shapes import wkv7_chunk_lengths

import numpy as np

MAPS = sources.entry("wkv7c_fwd_maps.h")
SCAN = sources.entry("wkv7c_fwd_scan.h")
BWD_SCAN = sources.entry("wkv7c_bwd_scan.h")
BWD_MAPS = sources.entry("wkv7c_bwd_maps.h")
ENTRIES = (MAPS, SCAN, BWD_SCAN, BWD_MAPS)
MAPS_NAMES = ("W", "U0", "Qm", "Y0", "KL", "BL")


def _arrays(entry, dtype: str, values: dict, out_shapes: dict, xp, ready=None) -> list:
    """``entry_arrays`` with every output buffer filled with NaN (all ones bits in bf16/fp16,
    NaN there too), as MLX leaves outputs uninitialised: an element no kernel writes shows."""
    arrays = entry_arrays(entry, dtype, values, out_shapes, xp, ready=ready)
    for out in arrays[len(entry.inputs) :]:
        out.fill(np.nan if out.dtype == np.float32 else 0xFFFF)
    return arrays


def lengths(N: int) -> tuple[int, ...]:
    """The chunk lengths built at head size N (metal/shapes.py)."""
    return wkv7_chunk_lengths(N)


def forward(launch, inputs: dict, dtype: str, xp=np, L: int | None = None) -> dict:
    """Both entries on oracle-style float64 ``inputs`` (keys of WKV7_INPUTS and 'state'), in
    chunks of ``L`` steps (default: the longest built). Returns float64 NumPy arrays: y,
    state_out, ckpt."""
    B, T, H, N = inputs["r"].shape
    L = L or lengths(N)[-1]
    n_chunks = -(-T // L)
    dims = np.array([T, H], dtype=np.int32)
    maps_shape = (B, H, n_chunks, L, N)
    shapes = {name: maps_shape for name in MAPS_NAMES} | {"cL": (B, H, n_chunks, N)}
    maps_arrays = _arrays(MAPS, dtype, {**inputs, "dims": dims}, shapes, xp)
    launch(standalone.instance_name(MAPS, dtype, N, L), B * H * n_chunks, N, maps_arrays)
    maps = dict(zip(MAPS.output_names, maps_arrays[len(MAPS.inputs) :], strict=True))

    shapes = {"y": (B, T, H, N), "state_out": (B, H, N, N), "ckpt": (B, H, n_chunks, N, N)}
    shapes["Z"] = maps_shape
    scan_arrays = _arrays(SCAN, dtype, {**inputs, "dims": dims}, shapes, xp, ready=maps)
    launch(standalone.instance_name(SCAN, dtype, N, L), B * H, N, scan_arrays)
    out = dict(zip(SCAN.output_names, scan_arrays[len(SCAN.inputs) :], strict=True))
    return {
        "y": from_storage(host(out["y"]), dtype),
        "state_out": host(out["state_out"]).astype(np.float64),
        "ckpt": host(out["ckpt"]).astype(np.float64),
        "saved": {**maps, "ckpt": out["ckpt"], "Z": out["Z"]},  # as they came out
    }


def backward(launch, inputs: dict, dy, dstate, dtype: str, xp=np, L: int | None = None) -> dict:
    """The forward, then both backward entries. Returns the forward's outputs and float64
    gradients ``d<name>`` of every input (``dstate``: the initial state's)."""
    B, T, H, N = inputs["r"].shape
    L = L or lengths(N)[-1]
    n_chunks = -(-T // L)
    got = forward(launch, inputs, dtype, xp, L)
    saved = got.pop("saved")
    dims = np.array([T, H], dtype=np.int32)
    maps_shape = (B, H, n_chunks, L, N)
    names = ("dW", "dQm", "dZ", "dKL", "dBL", "dv0")
    shapes = {name: maps_shape for name in names}
    shapes |= {"ddecay": (B, H, n_chunks, N), "dstate0": (B, H, N, N)}
    values = {**inputs, "dy": dy, "dstate": dstate, "dims": dims}
    arrays = _arrays(BWD_SCAN, dtype, values, shapes, xp, ready=saved)
    launch(standalone.instance_name(BWD_SCAN, dtype, N, L), B * H, N, arrays)
    scan = dict(zip(BWD_SCAN.output_names, arrays[len(BWD_SCAN.inputs) :], strict=True))

    shapes = {name: (B, T, H, N) for name in ("dr", "dlog_w", "dk", "dv", "da", "db")}
    arrays = _arrays(BWD_MAPS, dtype, values, shapes, xp, ready={**saved, **scan})
    launch(standalone.instance_name(BWD_MAPS, dtype, N, L), B * H * n_chunks, N, arrays)
    grads = dict(zip(BWD_MAPS.output_names, arrays[len(BWD_MAPS.inputs) :], strict=True))
    for name, ptype in BWD_MAPS.outputs:
        raw = host(grads[name])
        got[name] = from_storage(raw, dtype) if ptype == "InT" else raw.astype(np.float64)
    got["dstate"] = host(scan["dstate0"]).astype(np.float64)
    return got


def compare(
    launch, inputs: dict, dtype: str, seed: int = 0, xp=np, L: int | None = None
) -> dict[str, float]:
    """Forward and backward in chunks of ``L`` steps against the oracle, as
    kernel_harness.wkv7.compare does for the sequential kernel: the norm-wise relative error
    per named tensor, asserted."""
    run = partial(backward, L=L)
    return sequential.compare(launch, inputs, dtype, seed, xp, run, f"chunked WKV7 kernel (L={L})")
