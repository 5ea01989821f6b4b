"""Fusing adapters into their base layers (a quantized base stays quantized)."""

from __future__ import annotations

from mlx_rwkvx._mlx_lm import DoRALinear, LoRALinear
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.quantize import use_our_classes

from mlx.utils import tree_unflatten


def fuse_adapters(model: Model) -> Model:
    """Fold every LoRA/DoRA adapter into its base layer (mlx-lm's ``fuse``; a quantized base
    stays quantized), in place."""
    fused = [
        (p, m.fuse()) for p, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))
    ]
    if fused:
        model.update_modules(tree_unflatten(fused))
        use_our_classes(model)  # mlx-lm re-quantizes a fused layer as MLX's class
    return model
