"""What the kernel harnesses (kernel_harness.wkv7, kernel_harness.moba) share: the tolerances,
the storage of each dtype, and an entry's buffers. Never imports mlx (tests/gpu/ runs it without
MLX).

A *launch* is ``launch(name, groups, threads, arrays)``: run the standalone function ``name``
(``sources.instance_name``) on ``groups`` threadgroups of ``threads`` threads, with ``arrays``
the entry's inputs then outputs, in order; outputs are written in place.
"""

from __future__ import annotations

import numpy as np

# DESIGN.md, "Numerics and tolerances": norm-wise relative error against the oracle.
TOL = {
    "float32": {"out": 2e-6, "grad": 1e-5},
    # against the oracle run on the rounded inputs: what is left is the kernel's own rounding
    "bfloat16": {"out": 2e-2, "grad": 5e-2},
    "float16": {"out": 2e-2, "grad": 5e-2},
}


def check_errors(what: str, tol: dict, errors: dict, outputs, got: dict, grads) -> None:
    """Assert every error in ``errors`` within ``tol`` (a TOL entry: ``tol["out"]`` for the names
    in ``outputs``, ``tol["grad"]`` for the rest), then that no kernel gradient (``got[name]``
    for the names in ``grads``) is all zero. ``what`` names the kernel and shape."""
    bad = {
        name: err
        for name, err in errors.items()
        if not err <= tol["out" if name in outputs else "grad"]
    }
    assert not bad, f"{what} off the oracle: {bad}"
    vacuous = [name for name in grads if not np.any(got[name])]
    assert not vacuous, f"vacuous check, kernel gradient all zero: {vacuous}"


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


def entry_arrays(entry, dtype, values: dict, out_shapes: dict, xp, ready=None) -> list:
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


def host(x) -> np.ndarray:
    """A launch's buffer as a NumPy array (CuPy arrays are copied off the device)."""
    return x.get() if hasattr(x, "get") else np.asarray(x)
