"""State tuning: a trainable initial WKV state for every RWKV block, all else frozen."""

from __future__ import annotations

from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.models.model import Model


def enable_state_tuning(model: Model) -> list[str]:
    """Give every RWKV block a trainable initial WKV state (zeros: no change at first) and
    freeze everything else. Returns the trained parameters' paths."""
    blocks = [(i, b) for i, b in enumerate(model.layers) if b.kind == "rwkv7"]
    if not blocks:
        raise AdapterError("state tuning needs RWKV blocks; this model has none")
    model.freeze()
    for _, block in blocks:
        if "state0" not in block.tmix:
            block.tmix.enable_state_tuning()
        block.tmix.unfreeze(keys=["state0"], recurse=False)
    return [f"layers.{i}.tmix.state0" for i, _ in blocks]
