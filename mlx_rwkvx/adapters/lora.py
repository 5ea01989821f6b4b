"""LoRA and DoRA on a model's projections: mlx-lm's ``LoRALinear`` / ``DoRALinear`` (and
PiSSA's and MiSS's layers of ``variants.py``) wrapped around the frozen base."""

from __future__ import annotations

from mlx_rwkvx._mlx_lm import DoRALinear, LoRALinear
from mlx_rwkvx.adapters.variants import (
    MissLinear,
    PissaLinear,
)
from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.models.model import Model

import mlx.nn as nn
from mlx.utils import tree_unflatten


def apply_lora(
    model: Model,
    paths: list[str],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    dora: bool = False,
    variant: str | None = None,
) -> None:
    """Wrap the projections at ``paths`` in mlx-lm's ``LoRALinear`` (``DoRALinear`` with
    ``dora``; ``variant`` ``"pissa"`` or ``"miss"``: ``variants.py``' layers), scale =
    alpha / rank, in place. The base is frozen, the adapters trainable."""
    if type(rank) is not int or rank < 1:
        raise AdapterError(f"the LoRA rank must be an int >= 1, got {rank!r}")
    if not 0.0 <= dropout < 1.0:
        raise AdapterError(f"the LoRA dropout must be in [0, 1), got {dropout!r}")
    modules = dict(model.named_modules())
    if dora and any(isinstance(modules[p], nn.QuantizedLinear) for p in paths):
        raise AdapterError(
            "DoRA on a quantized base: mlx-lm's DoRALinear dequantizes the whole base weight "
            "on every forward (the float copy a quantized base exists to avoid); use LoRA"
        )
    if variant == "pissa" and any(isinstance(modules[p], nn.QuantizedLinear) for p in paths):
        raise AdapterError("PiSSA needs a float base (its residual would be quantized anew)")
    model.freeze()
    layer = {"pissa": PissaLinear, "miss": MissLinear}.get(variant) or (
        DoRALinear if dora else LoRALinear
    )
    wrapped = [
        (p, layer.from_base(modules[p], r=rank, dropout=dropout, scale=alpha / rank)) for p in paths
    ]
    model.update_modules(tree_unflatten(wrapped))


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds adapter layers (to be fused, or saved as an adapter)."""
    return any(isinstance(m, (LoRALinear, DoRALinear)) for _, m in model.named_modules())
