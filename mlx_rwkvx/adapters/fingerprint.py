"""The base model's fingerprint, which an adapter file carries so that it is never applied to
another base, and a model's identity (the base's fingerprint and its adapters), which a saved
state carries so that it is never resumed on another model."""

from __future__ import annotations

import hashlib
import json

from mlx_rwkvx.adapters.tensors import adapter_tensors
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.rwkv7 import HeadNorm

import mlx.core as mx
import mlx.nn as nn


def fingerprint(model: Model) -> str:
    """A short hash of a base model, the same in any of our formats and in float32, bfloat16 or
    INT8 (its architecture, and its norm weights rounded to bfloat16: norms are never
    quantized), and different between bases whose norms differ."""
    architecture = model.config.to_dict()
    architecture.pop("max_cache")  # a default of generation's, not what the weights compute
    h = hashlib.sha256(json.dumps(architecture, sort_keys=True).encode())
    for path, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
            h.update(path.encode())
            h.update(memoryview(module.weight.astype(mx.bfloat16).view(mx.uint16)))
    return h.hexdigest()[:16]


def model_identity(model: Model) -> str:
    """What a model's states are valid for: the base's fingerprint and a hash of any adapter
    tensors (LoRA, DoRA, a state-tuned initial state)."""
    h = hashlib.sha256()
    for name, x in sorted(adapter_tensors(model).items()):
        h.update(name.encode())
        h.update(memoryview(x.astype(mx.float32)))
    return f"{fingerprint(model)}-{h.hexdigest()[:16]}"
