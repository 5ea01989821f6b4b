"""The package's front door: ``mlx_rwkvx.load`` (a checkpoint, optionally with an adapter) and
``mlx_rwkvx.save``."""

from __future__ import annotations

from mlx_rwkvx.io.load import load as load_checkpoint
from mlx_rwkvx.io.load import load_model, save

__all__ = ["load", "load_model", "save"]


def load(path, *, quantize=None, dtype=None, adapter=None, tokenizer: bool = True):
    """``(model, tokenizer)`` of a checkpoint in any supported format (see
    ``mlx_rwkvx.io.load.load`` for ``quantize``, ``dtype`` and ``tokenizer``). ``adapter``: an
    adapter file or folder (ours, or mlx-lm's ``adapters.safetensors`` with its
    ``adapter_config.json``) applied on top; one trained on another base is refused."""
    model, found = load_checkpoint(path, quantize=quantize, dtype=dtype, tokenizer=tokenizer)
    if adapter is not None:
        # here, not at the top: the adapters import mlx-lm's tuner (transformers, and torch
        # where installed: seconds), which a load without one does not need
        from mlx_rwkvx.adapters.apply import apply_adapter

        apply_adapter(model, adapter)
    return model, found
