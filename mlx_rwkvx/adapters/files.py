"""Adapter files: mlx-lm's tensor names and ``adapter_config.json``, plus what describes the run
(alpha, targets, the base model's fingerprint) in the safetensors metadata, so that a file
copied alone describes itself. Written atomically; only an adapter file is ever replaced."""

from __future__ import annotations

import json
import os

from mlx_rwkvx.adapters.tensors import ADAPTER_LEAVES, adapter_tensors
from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, check_target, save_safetensors
from mlx_rwkvx.io.detect import read_json
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.models.model import Model

import mlx.core as mx

ADAPTER_CONFIG = "adapter_config.json"


FINAL_ADAPTER = "adapter_final.safetensors"  # Foundry's names: adapter_final, checkpoint_<step>


MLX_LM_ADAPTER = "adapters.safetensors"  # what mlx-lm writes and reads


def adapter_config(
    model: Model,
    *,
    fine_tune_type: str,
    paths: list[str],
    rank: int | None = None,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: str = "",
    base_fingerprint: str,
    **facts,
) -> dict:
    """``adapter_config.json``: mlx-lm's fields (``fine_tune_type``, ``num_layers``,
    ``lora_parameters`` with ``rank``, ``scale``, ``dropout`` and the module paths as ``keys``)
    and ours (alpha, targets, the base's fingerprint, and ``facts`` such as the init seed and
    the tokens trained on)."""
    config = {
        "format": "mlx_rwkvx",
        "fine_tune_type": fine_tune_type,
        "num_layers": len(model.layers),
        "targets": targets,
        "base_fingerprint": base_fingerprint,
        **facts,
    }
    if fine_tune_type in ("lora", "dora"):
        config["lora_parameters"] = {
            "rank": rank,
            "scale": alpha / rank,
            "dropout": dropout,
            "keys": list(paths),
        }
        config["alpha"] = alpha
    return config


def save_adapter(path, model: Model, config: dict, *, overwrite: bool = True) -> None:
    """The adapter tensors of ``model`` in one ``.safetensors`` file whose metadata carries
    ``config`` (so a file copied alone describes itself), written atomically."""
    save_adapter_tensors(path, adapter_tensors(model), config, overwrite=overwrite)


def save_adapter_tensors(path, tensors: dict, config: dict, *, overwrite: bool = True) -> None:
    """``save_adapter`` of adapter tensors in hand (a merge's). An existing file is replaced
    only when it is an adapter file (``is_adapter_file``)."""
    path = os.fspath(path)
    check_target(
        path, overwrite=overwrite, folder=False, recognise=is_adapter_file, kind="an adapter file"
    )
    with atomic_target(path, folder=False) as tmp:
        save_safetensors(tmp, tensors, {"adapter_config": json.dumps(config)})


def is_adapter_file(path) -> bool:
    """Whether ``path`` is an adapter file: a safetensors file whose metadata carries an adapter
    config (ours), or whose tensors are all adapter tensors (mlx-lm's ``adapters.safetensors``)."""
    try:
        tensors, metadata = read_safetensors(os.fspath(path))
    except CheckpointError:
        return False
    leaves = (*ADAPTER_LEAVES, "state0")
    return "adapter_config" in metadata or (
        bool(tensors) and all(n.rsplit(".", 1)[-1] in leaves for n in tensors)
    )


def read_adapter(path) -> tuple[dict, dict[str, mx.array]]:
    """(config, tensors) of an adapter: a ``.safetensors`` file (its metadata, else the
    ``adapter_config.json`` beside it) or a folder (``adapter_final.safetensors``, else mlx-lm's
    ``adapters.safetensors``, with the folder's ``adapter_config.json``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in (FINAL_ADAPTER, MLX_LM_ADAPTER):
            if os.path.exists(os.path.join(path, name)):
                file = os.path.join(path, name)
                break
        else:
            raise AdapterError(f"{path}: no {FINAL_ADAPTER} or {MLX_LM_ADAPTER} in the folder")
    elif os.path.isfile(path):
        file = path
    else:
        raise AdapterError(f"{path}: no such adapter file or folder")
    tensors, metadata = read_safetensors(file)
    if "adapter_config" in metadata:
        try:
            config = json.loads(metadata["adapter_config"])
        except json.JSONDecodeError as e:
            raise AdapterError(f"{file}: damaged adapter_config in its metadata ({e})") from e
    else:
        beside = os.path.join(os.path.dirname(file), ADAPTER_CONFIG)
        if not os.path.exists(beside):
            raise AdapterError(f"{file}: no adapter_config in its metadata, and no {beside}")
        config = read_json(beside)
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: the adapter config is not a JSON object")
    return config, tensors
