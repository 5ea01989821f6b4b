"""Which format a checkpoint path holds (see ``formats.py``), and reading its JSON."""

from __future__ import annotations

import json
import os

from mlx_rwkvx.io.atomic import CheckpointError
from mlx_rwkvx.io.pth import PthError, pth_names
from mlx_rwkvx.io.tensors import read_safetensors

FORMAT_TAG = "mlx_rwkvx"
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


def read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e


def checkpoint_path(path) -> str:
    """``path`` as a str: a str or an ``os.PathLike`` (``pathlib.Path``), else a TypeError."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or a pathlib.Path, got {path!r}")
    return os.fspath(path)


def detect(path: str) -> str:
    """The format of ``path`` (see the module docstring). Raises CheckpointError if unknown."""
    path = checkpoint_path(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        cfg_path = os.path.join(path, CONFIG_FILE)
        if not os.path.exists(cfg_path):
            raise CheckpointError(f"{path}: a checkpoint folder needs {CONFIG_FILE}")
        cfg = read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object")
        if cfg.get("format") == FORMAT_TAG:
            return "native"
        kind = cfg.get("model_type")
        if kind in ("rwkv7", "qwen2"):
            return f"hf_{kind}"
        raise CheckpointError(
            f"{cfg_path}: unknown checkpoint (model_type {kind!r}; expected an mlx_rwkvx "
            "config, or model_type rwkv7 or qwen2)"
        )
    if path.endswith(".pth"):
        try:
            names = pth_names(path)  # the pickle only, no tensor's bytes
        except PthError:
            return "blinkdl"  # its reader says what is wrong with it
        return "rwkvx" if "rwkv.emb.weight" in names else "blinkdl"
    if path.endswith(".safetensors"):
        tensors, metadata = read_safetensors(path)  # the header only: tensors load lazily
        if metadata.get("format") == FORMAT_TAG:
            return "native_file"
        if "emb.weight" in tensors and any(n.startswith("blocks.0.att.") for n in tensors):
            return "blinkdl"
        if "rwkv.emb.weight" in tensors:
            return "rwkvx"
        raise CheckpointError(
            f"{path}: unknown safetensors checkpoint (no mlx_rwkvx config in its metadata, and "
            "neither BlinkDL's RWKV-7 naming nor the RWKV-X authors')"
        )
    raise CheckpointError(
        f"{path}: unknown checkpoint format (expected a folder, .safetensors or .pth)"
    )


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a checkpoint we read (what ``overwrite`` may replace)."""
    try:
        detect(path)
    except CheckpointError:
        return False
    return True
