"""Writing a tensor at a time: the same file content as MLX's writer, and a model passes
through building, converting and quantizing without ever being whole in memory."""

from __future__ import annotations

import json
import struct

from mlx_rwkvx.io.stream import safetensors_header, write_safetensors

import mlx.core as mx


def _tensors() -> dict[str, mx.array]:
    mx.random.seed(3)
    return {
        "b.weight": mx.random.normal((6, 5)).astype(mx.bfloat16),
        "a.transposed": mx.random.normal((4, 7)).T,  # strided: written row-major
        "c.half": mx.random.normal((3,)).astype(mx.float16),
        "d.packed": mx.arange(10, dtype=mx.uint32) * 2654435761,
        "e.empty": mx.zeros((0, 4)),
        "f.flags": mx.array([True, False, True]),
        "g.scalar": mx.array(2.5),
        "h.int8": mx.arange(-4, 4, dtype=mx.int8),
        "i.int32": mx.arange(5, dtype=mx.int32),
        "j.float32": mx.random.normal((2, 3, 4)),
    }


def test_the_same_content_as_mlx_writes(tmp_path):
    ours, theirs = tmp_path / "ours.safetensors", tmp_path / "theirs.safetensors"
    mx.save_safetensors(str(theirs), _tensors(), metadata={"format": "pt", "x": "ü"})
    given = _tensors()
    write_safetensors(str(ours), given, {"format": "pt", "x": "ü"})
    assert given == {}  # taken out as written
    a, meta_a = mx.load(str(ours), return_metadata=True)
    b, meta_b = mx.load(str(theirs), return_metadata=True)
    assert meta_a == meta_b and sorted(a) == sorted(b)
    for name in b:
        assert a[name].dtype == b[name].dtype and a[name].shape == b[name].shape, name
        assert mx.array_equal(a[name], b[name]).item(), name
    with open(ours, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    assert (8 + length) % 8 == 0  # the data aligned
    assert list(header)[0] == "__metadata__" and list(header)[1:] == sorted(b)


def test_the_header_from_shapes_alone():
    lazy = {"w": mx.random.normal((1 << 14, 1 << 14))}  # 1 GiB if it were computed
    head = safetensors_header(lazy)
    header = json.loads(head[8:])
    assert header["w"] == {"data_offsets": [0, 1 << 30], "dtype": "F32", "shape": [1 << 14] * 2}
    assert header["__metadata__"] is None  # as MLX writes no metadata
