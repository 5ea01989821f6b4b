"""Reading tensors: safetensors files (whole and lazily, or a block of rows of one tensor straight
from disk), sharded folders, and BlinkDL's ``.pth`` (without torch)."""

from __future__ import annotations

import json
import os
import struct

from mlx_rwkvx.io.atomic import CheckpointError
from mlx_rwkvx.io.pth import PthError, read_pth, read_pth_lazily
from mlx_rwkvx.io.stream import header_of

import mlx.core as mx
import numpy as np

ADAPTERS_FILE = "adapters.safetensors"  # beside a model's weights, never part of them
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map


def read_safetensors(path: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Tensors and metadata of one ``.safetensors`` file (lazy: read when evaluated); tensors
    sharing bytes of the file are refused."""
    _refuse_shared_bytes(path)
    try:
        tensors, metadata = mx.load(path, return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError for damaged files
        raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e
    return tensors, metadata or {}


_MAX_HEADER = 100 << 20  # the safetensors format's own limit on its JSON header


def safetensors_header(f, limit: int = _MAX_HEADER) -> tuple[dict, int]:
    """(the JSON header, the offset its data starts at) of the ``.safetensors`` file open in
    ``f``, read from its start. ValueError when the file is shorter than its header says, the
    header is longer than ``limit`` bytes, or it is not JSON."""
    head = f.read(8)
    if len(head) < 8:
        raise ValueError("shorter than a safetensors header")
    (length,) = struct.unpack("<Q", head)
    if length > min(os.fstat(f.fileno()).st_size - 8, limit):
        raise ValueError("cut short, or not a safetensors file")
    return json.loads(f.read(length)), 8 + length


def _refuse_shared_bytes(path: str) -> None:
    """mx.load checks each tensor's byte range against its shape and the file's size, not
    against the others': many tensors naming one range would each read it (a small file
    filling a model many times its size). Refused as the safetensors library refuses it;
    a header it cannot parse here is left to mx.load to name."""
    try:
        with open(path, "rb") as f:
            header, _ = safetensors_header(f)
        ranges = sorted(
            (int(t["data_offsets"][0]), int(t["data_offsets"][1]), name)
            for name, t in header.items()
            if name != "__metadata__"
        )
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return
    end, last = 0, None  # the furthest byte read so far, and by which tensor
    for start, stop, name in ranges:
        if start < end and start < stop:
            raise CheckpointError(
                f"{path}: tensors {last} and {name} share bytes of the file "
                "(no safetensors writer makes such a file)"
            )
        if stop > end:
            end, last = stop, name


_ST_DTYPES = {
    "F32": ("<f4", None),
    "F16": ("<f2", None),
    "BF16": ("<u2", mx.bfloat16),
    "I32": ("<i4", None),
    "U32": ("<u4", None),
    "I8": ("i1", None),
    "U8": ("u1", None),
}


def read_rows(path: str, name: str, start: int, stop: int) -> mx.array:
    """Rows ``start:stop`` of tensor ``name`` of a ``.safetensors`` file, read from disk alone
    (a big embedding can be quantized a slice at a time, never whole in floating point)."""
    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        info = header[name]
        np_dtype, view = _ST_DTYPES[info["dtype"]]
        shape = info["shape"]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize
        f.seek(8 + header_len + info["data_offsets"][0] + start * row_bytes)
        raw = f.read((stop - start) * row_bytes)
    x = mx.array(np.frombuffer(raw, dtype=np_dtype).reshape(stop - start, *shape[1:]))
    return x.view(view) if view is not None else x


def read_folder_safetensors(folder: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors of a (possibly sharded) Hugging Face folder, and the file of each tensor.

    With ``model.safetensors.index.json`` exactly the files it lists are read, and every
    tensor must sit in the file the index names (as transformers reads it); without one, every
    ``*.safetensors`` but adapters and hidden files (interrupted saves among them)."""
    index_path = os.path.join(folder, INDEX_FILE)
    weight_map = None
    if os.path.exists(index_path):
        weight_map = _read_index(index_path)
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' of tensor names to files")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise CheckpointError(f"{index_path}: lists shards that are missing: {missing}")
    else:
        names = sorted(
            n
            for n in os.listdir(folder)
            if n.endswith(".safetensors") and n != ADAPTERS_FILE and not n.startswith(".")
        )
    if not names:
        raise CheckpointError(f"{folder}: no .safetensors weights in the folder")
    tensors: dict[str, mx.array] = {}
    files: dict[str, str] = {}
    for name in names:
        part, _ = read_safetensors(os.path.join(folder, name))
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise CheckpointError(f"{folder}: tensors {twice[:4]} are in more than one shard")
        tensors.update(part)
        files.update(dict.fromkeys(part, os.path.join(folder, name)))
    if weight_map is not None:
        misplaced = sorted(n for n in tensors if weight_map.get(n) != os.path.basename(files[n]))
        unlisted = sorted(set(weight_map) - set(tensors))
        if misplaced or unlisted:
            raise CheckpointError(
                f"{index_path}: does not match its shards (tensors not where it says: "
                f"{misplaced[:4]}; listed but absent: {unlisted[:4]})"
            )
    return tensors, files


def pth_placeholders(path: str) -> dict[str, mx.array]:
    """The tensors of a ``.pth`` as zeros of their shapes and dtypes, lazy and never computed:
    what a memory estimate reads, without reading the file's tensors."""
    out = {}
    for name, t in _pth_lazily(path).items():
        dtype = mx.bfloat16 if t.bfloat16 else getattr(mx, t.dtype.name.replace("bool", "bool_"))
        out[name] = mx.zeros(t.shape, dtype)
    return out


def _pth_lazily(path: str) -> dict:
    """``read_pth_lazily``'s tensors; its errors as CheckpointError."""
    try:
        return read_pth_lazily(path)
    except PthError as e:
        raise CheckpointError(str(e)) from e


def read_pth_tensors(path: str) -> dict[str, mx.array]:
    """The tensors of a ``.pth`` (bfloat16 ones as bfloat16), read without torch."""
    try:
        state = read_pth(path)
    except PthError as e:
        raise CheckpointError(str(e)) from e
    out = {}
    for name, t in state.items():
        x = mx.array(t.array)
        out[name] = x.view(mx.bfloat16) if t.bfloat16 else x
    return out


# numpy dtypes of a .pth's storages as the safetensors format names them (bfloat16: "BF16")
_ST_NAMES = {
    np.dtype(d): n
    for d, n in (
        ("float32", "F32"),
        ("float16", "F16"),
        ("float64", "F64"),
        ("int64", "I64"),
        ("int32", "I32"),
        ("int16", "I16"),
        ("int8", "I8"),
        ("uint8", "U8"),
        ("bool", "BOOL"),
    )
}


def stage_pth(path: str, staged: str) -> None:
    """Copy the tensors of the ``.pth`` at ``path`` into the ``.safetensors`` file ``staged``
    (the same names, shapes and dtypes) one at a time: what ``mx.load`` then reads lazily, a
    tensor when it is used, so that a model read from it is never whole in memory (MLX reads
    no tensor lazily from a zip). Raises CheckpointError naming ``path``."""
    tensors = _pth_lazily(path)
    entries = {}
    for name, t in tensors.items():
        if not t.bfloat16 and t.dtype not in _ST_NAMES:
            raise CheckpointError(f"{path}: {name} has dtype {t.dtype}, not a model's")
        dtype = "BF16" if t.bfloat16 else _ST_NAMES[t.dtype]
        entries[name] = (dtype, t.shape, t.size * t.dtype.itemsize)
    with open(staged, "wb") as f:
        f.write(header_of(entries))
        for name in sorted(tensors):
            try:
                data = np.ascontiguousarray(tensors.pop(name).take())
            except PthError as e:
                raise CheckpointError(str(e)) from e
            f.write(memoryview(data).cast("B"))
            del data


def _read_index(path: str):
    try:
        with open(path) as f:
            index = json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e
    return index.get("weight_map") if isinstance(index, dict) else None
