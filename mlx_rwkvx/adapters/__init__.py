"""Adapters: what a fine-tune trains beside a frozen base, and its files. One module per job:
``targets`` (which layers), ``lora`` and ``variants`` (LoRA, DoRA, PiSSA, MiSS layers),
``state`` (state tuning), ``tensors`` (the trained tensors), ``fingerprint`` (the base's),
``files`` (the adapter file format), ``apply`` (an adapter file onto a model), ``fuse``.

Inference imports this package, never the trainer's (``tuner/``)."""

from mlx_rwkvx.adapters.apply import apply_adapter, apply_adapter_tensors
from mlx_rwkvx.adapters.files import adapter_config, is_adapter_file, read_adapter, save_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.fuse import fuse_adapters
from mlx_rwkvx.adapters.lora import apply_lora, has_adapters
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import PRESETS, target_paths
from mlx_rwkvx.adapters.tensors import adapter_tensors

__all__ = [
    "PRESETS",
    "adapter_config",
    "adapter_tensors",
    "apply_adapter",
    "apply_adapter_tensors",
    "apply_lora",
    "enable_state_tuning",
    "fingerprint",
    "fuse_adapters",
    "has_adapters",
    "is_adapter_file",
    "read_adapter",
    "save_adapter",
    "target_paths",
]
