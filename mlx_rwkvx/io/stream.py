"""Writing tensors one at a time, so that a model whose tensors are lazy (read from a file,
renamed, cast, quantized: nothing computed yet) is never whole in memory while it is written.

``write_safetensors`` makes the header from the tensors' shapes and dtypes alone, then
evaluates, writes and drops each tensor in turn: the peak is about the largest tensor and what
it is computed from. The file reads back as ``mx.save_safetensors``'s does (the same header
entries and bytes; the data in the order of the names, the header padded to 8 bytes as the
safetensors format allows, so that the data is aligned)."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import mlx.core as mx

# MLX's dtypes as the safetensors format names them (what mx.save_safetensors writes)
SAFETENSORS_DTYPES = {
    mx.bool_: "BOOL",
    mx.uint8: "U8",
    mx.uint16: "U16",
    mx.uint32: "U32",
    mx.uint64: "U64",
    mx.int8: "I8",
    mx.int16: "I16",
    mx.int32: "I32",
    mx.int64: "I64",
    mx.float16: "F16",
    mx.bfloat16: "BF16",
    mx.float32: "F32",
    mx.float64: "F64",
    mx.complex64: "C64",
}


def safetensors_header(tensors: dict[str, mx.array], metadata: dict | None = None) -> bytes:
    """The length-prefixed JSON header of a ``.safetensors`` file holding ``tensors`` in the
    order of their names, made from their shapes and dtypes (nothing is evaluated)."""
    entries = {}
    for name, x in tensors.items():
        if x.dtype not in SAFETENSORS_DTYPES:
            raise ValueError(f"{name}: the safetensors format has no dtype {x.dtype}")
        entries[name] = (SAFETENSORS_DTYPES[x.dtype], tuple(x.shape), x.nbytes)
    return header_of(entries, metadata)


def header_of(entries: dict[str, tuple[str, tuple, int]], metadata: dict | None = None) -> bytes:
    """The length-prefixed JSON header of a ``.safetensors`` file of ``entries`` (name ->
    the format's dtype name, shape, bytes), their data in the order of their names."""
    header: dict = {"__metadata__": {str(k): str(v) for k, v in (metadata or {}).items()} or None}
    offset = 0
    for name in sorted(entries):
        dtype, shape, nbytes = entries[name]
        header[name] = {
            "data_offsets": [offset, offset + nbytes],
            "dtype": dtype,
            "shape": list(shape),
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text


def write_safetensors(
    path: str,
    tensors: dict[str, mx.array],
    metadata: dict | None = None,
    *,
    check: Callable[[str, mx.array], None] | None = None,
) -> None:
    """Write ``tensors`` (lazy or not) to the ``.safetensors`` file ``path``, one at a time:
    each is taken out of ``tensors`` (the dict is left empty), evaluated, handed to
    ``check(name, array)`` (which may raise), written and dropped, and MLX's freed buffers are
    given back, so that a tensor nothing else holds is freed once written. ``metadata``: the
    file's string metadata."""
    head = safetensors_header(tensors, metadata or {})
    with open(path, "wb") as f:
        f.write(head)
        for name in sorted(tensors):
            x = tensors.pop(name)
            mx.eval(x)
            if check is not None:
                check(name, x)
            if x.size:
                f.write(raw_bytes(x))
            del x
            mx.clear_cache()  # kept in MLX's pool, the freed tensors would add up to the model


def raw_bytes(x: mx.array) -> memoryview:
    """The bytes of ``x`` in row-major order (a strided array is copied first)."""
    flat = x.reshape(-1)
    if x.dtype == mx.bool_:
        flat = flat.astype(mx.uint8)  # one byte each, as the format stores it
    flat = flat.view(mx.uint8)
    mx.eval(flat)
    return memoryview(flat)
