"""The trained tensors of an adapted model, under their module paths: what an adapter file
and a checkpoint hold."""

from __future__ import annotations

from mlx_rwkvx.adapters.variants import (
    load_saved_tensors,
    saved_tensors,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # what LoRALinear / DoRALinear train


def trainable_count(model: nn.Module) -> int:
    return sum(x.size for _, x in tree_flatten(model.trainable_parameters()))


def adapter_tensors(model: nn.Module) -> dict[str, mx.array]:
    """The trained tensors of a LoRA/DoRA/PiSSA/MiSS/state-tuned model, under their module
    paths; PiSSA's and MiSS's as the LoRA update they are against the original base."""
    tensors = {
        name: x
        for name, x in tree_flatten(model.trainable_parameters())
        if name.rsplit(".", 1)[-1] in (*ADAPTER_LEAVES, "state0")
    }
    tensors.update(saved_tensors(model))
    return tensors


def load_adapter_tensors(model: nn.Module, tensors: dict) -> None:
    """Put ``adapter_tensors``' tensors back into the model they came from (a resumed run)."""
    model.load_weights(list(load_saved_tensors(model, tensors).items()), strict=False)
