"""The base model's fingerprint, which an adapter file carries so that it is never applied to
another base."""

from __future__ import annotations

import hashlib
import json

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
