"""WKV7 kernels outside MLX: storage conversion, launches through a flavour-agnostic callback,
and the comparison with the float64 oracle. Never imports mlx (tests/gpu/ runs it without MLX).

A *launch* is ``launch(name, groups, threads, arrays)``: run the standalone function ``name``
(``kernels.instance_name``) on ``groups`` threadgroups of ``threads`` threads, with ``arrays`` the
entry's inputs then outputs, in order; outputs are written in place.
"""

from __future__ import annotations

import re

from mlx_rwkvx.ops import kernels

import numpy as np
from oracle.common import rel_err
from oracle.wkv7 import WKV7_INPUTS, wkv7_bwd_np, wkv7_np

FWD = kernels.entry("wkv7_fwd.h")
BWD = kernels.entry("wkv7_bwd.h")
SEG = int(re.search(r"#define WKV7_SEG (\d+)", kernels.kernel_source("wkv7.h")).group(1))
# DESIGN.md, "Numerics and tolerances": norm-wise relative error against the oracle.
TOL = {
    "float32": {"out": 2e-6, "grad": 1e-5},
    # against the oracle run on the rounded inputs: what is left is the kernel's own rounding
    "bfloat16": {"out": 2e-2, "grad": 5e-2},
    "float16": {"out": 2e-2, "grad": 5e-2},
}
GRAD_NAMES = (*WKV7_INPUTS, "state")


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """float -> bfloat16 bit patterns (uint16), rounding to nearest even (finite inputs)."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def to_storage(x: np.ndarray, dtype: str) -> np.ndarray:
    """The kernel's buffer for ``x`` in ``dtype`` (bf16 and fp16 as raw uint16 bits)."""
    if dtype == "float32":
        return np.ascontiguousarray(x, dtype=np.float32)
    if dtype == "float16":
        return np.ascontiguousarray(x, dtype=np.float16).view(np.uint16)
    if dtype == "bfloat16":
        return bf16_bits(x)
    raise ValueError(f"unknown dtype {dtype!r}")


def from_storage(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Inverse of ``to_storage``, as float64."""
    if dtype == "float32":
        return raw.astype(np.float64)
    if dtype == "float16":
        return raw.view(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    raise ValueError(f"unknown dtype {dtype!r}")


def _storage_dtype(param_type: str, dtype: str):
    if param_type == "int":
        return np.int32
    if param_type == "float" or dtype == "float32":
        return np.float32
    return np.uint16


def _arrays(entry, dtype, values: dict, out_shapes: dict, xp, ready=None) -> list:
    """The entry's inputs (from ``ready`` as they are, else converted from ``values``) then
    zeroed outputs, as ``xp`` arrays."""
    arrays = []
    for name, ptype in entry.inputs:
        if ready and name in ready:
            arrays.append(ready[name])
            continue
        x = values[name]
        raw = (
            to_storage(x, dtype)
            if ptype == "InT"
            else np.ascontiguousarray(x, _storage_dtype(ptype, dtype))
        )
        arrays.append(xp.asarray(raw))
    for name, ptype in entry.outputs:
        arrays.append(xp.zeros(out_shapes[name], dtype=_storage_dtype(ptype, dtype)))
    return arrays


def run(launch, inputs: dict, dy: np.ndarray, dstate: np.ndarray, dtype: str, xp=np) -> dict:
    """Forward then backward kernel on oracle-style float64 ``inputs`` (keys of WKV7_INPUTS and
    'state'). Returns float64 numpy arrays: y, state_out, sa, and the gradients ``d<name>``."""
    B, T, H, N = inputs["r"].shape
    n_seg = -(-T // SEG)
    seq, mat = (B, T, H, N), (B, H, N, N)
    dims = np.array([T, H], dtype=np.int32)
    fwd_shapes = {"y": seq, "state_out": mat, "ckpt": (B, H, n_seg, N, N), "sa": seq}
    fwd_arrays = _arrays(FWD, dtype, {**inputs, "dims": dims}, fwd_shapes, xp)
    launch(kernels.instance_name(FWD, dtype, N), B * H, N, fwd_arrays)
    out = dict(zip(FWD.output_names, fwd_arrays[len(FWD.inputs) :], strict=True))

    bwd_shapes = {name: seq for name in ("dr", "dlog_w", "dk", "dv", "da", "db")}
    bwd_shapes |= {"dstate0": mat, "scratch": (B * H, SEG, N, N)}
    values = {**inputs, "dy": dy, "dstate": dstate, "dims": dims}
    # the forward's saved tensors go in as they came out
    saved = {name: out[name] for name in ("ckpt", "sa")}
    bwd_arrays = _arrays(BWD, dtype, values, bwd_shapes, xp, ready=saved)
    launch(kernels.instance_name(BWD, dtype, N), B * H, N, bwd_arrays)
    grads = dict(zip(BWD.output_names, bwd_arrays[len(BWD.inputs) :], strict=True))

    def host(x):
        return x.get() if hasattr(x, "get") else np.asarray(x)

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


def compare(launch, inputs: dict, dtype: str, seed: int = 0, xp=np) -> dict[str, float]:
    """Run the kernels and the oracle (on the rounded inputs and cotangents); return the
    norm-wise relative error per named tensor, and assert each is within DESIGN.md's bounds."""
    rng = np.random.default_rng(seed)
    B, T, H, N = inputs["r"].shape
    dy = from_storage(to_storage(rng.standard_normal((B, T, H, N)), dtype), dtype)
    dstate = from_storage(to_storage(rng.standard_normal((B, H, N, N)), "float32"), "float32")
    x = rounded(inputs, dtype)
    got = run(launch, x, dy, dstate, dtype, xp)
    args = [x[name] for name in WKV7_INPUTS]
    y, state_out = wkv7_np(*args, x["state"])
    grads = wkv7_bwd_np(*args, x["state"], dy, dstate)
    errors = {"y": rel_err(got["y"], y), "state_out": rel_err(got["state_out"], state_out)}
    errors |= {f"d{name}": rel_err(got[f"d{name}"], grads[name]) for name in GRAD_NAMES}
    tol = TOL[dtype]
    bad = {
        name: err
        for name, err in errors.items()
        if not err <= tol["out" if name in ("y", "state_out") else "grad"]
    }
    assert not bad, f"WKV7 kernel ({dtype}, B={B} T={T} H={H} N={N}) off the oracle: {bad}"
    vacuous = [name for name in errors if name.startswith("d") and not np.any(got[name])]
    assert not vacuous, f"vacuous check, kernel gradient all zero: {vacuous}"
    return errors
