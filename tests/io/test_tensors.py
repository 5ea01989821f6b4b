"""Hostile ``.safetensors`` files: no byte of the file is read for two tensors."""

import json
import struct

import mlx_rwkvx
from mlx_rwkvx.io.formats import CheckpointError, write_hf
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.models import Model

import mlx.core as mx
import pytest
from helpers import rwkv7_cfg
from helpers.model_params import flat_params


def _rewrite_header(path, edit) -> None:
    """``path``'s safetensors header replaced by ``edit(header)`` (in place), its data kept."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    edit(header)
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length :])


def test_tensors_sharing_the_files_bytes_are_refused(tmp_path):
    # mx.load checks each range against its shape and the file alone: 1,000 names for one
    # range would each read it (a small file filling a model many times its size)
    path = tmp_path / "shared.safetensors"
    mx.save_safetensors(str(path), {"a": mx.arange(4.0), "b": mx.arange(4.0) + 4})
    assert sorted(read_safetensors(str(path))[0]) == ["a", "b"]
    _rewrite_header(path, lambda h: h["b"].update(data_offsets=h["a"]["data_offsets"]))
    with pytest.raises(CheckpointError, match=r"shared.safetensors: tensors a and b share bytes"):
        read_safetensors(str(path))


def test_a_model_whose_tensors_share_bytes_is_refused(tmp_path):
    model = Model(rwkv7_cfg(2, hidden_size=64), seed=1)
    write_hf(str(tmp_path), model.config, flat_params(model))
    (weights,) = tmp_path.glob("*.safetensors")
    mlx_rwkvx.load(str(tmp_path))  # as written: each tensor its own bytes

    def alias(header):  # every tensor reads the bytes of the first one of its shape
        first = {}
        for name, t in header.items():
            if name != "__metadata__":
                key = (t["dtype"], tuple(t["shape"]))
                t["data_offsets"] = first.setdefault(key, t["data_offsets"])

    _rewrite_header(weights, alias)
    with pytest.raises(CheckpointError, match="share bytes of the file"):
        mlx_rwkvx.load(str(tmp_path))
