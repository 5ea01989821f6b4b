"""A fresh model, optionally quantized as it is drawn: with Foundry's init a big matrix is drawn
and quantized a block of rows at a time, so a quantized random model never holds its float
weights (the 1.5B RFA preset fits in ~2 GB)."""

from __future__ import annotations

from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.init import foundry_scale, init_scheme, uniform_row_blocks
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.quantize import GROUP_SIZE, quantize_bits, quantize_model

import mlx.core as mx


def build(cfg: ModelConfig, *, quantize=None, init: str | None = "foundry", seed: int = 0) -> Model:
    """A model of ``cfg`` with a fresh init (``foundry``, ``pretrain`` or None), evaluated;
    ``quantize``: None, ``"int8"`` or ``"int4"``."""
    model = Model(cfg, init=init, seed=seed)  # lazy: nothing is computed yet
    bits = quantize_bits(quantize)
    if bits:

        def drawn(path, module):
            if init is None or init_scheme(init) != "foundry":
                return None
            scale, offset = foundry_scale(module, "weight")
            return uniform_row_blocks(seed, f"{path}.weight", module.weight.shape, scale, offset)

        quantize_model(model, bits, GROUP_SIZE, drawn)
    mx.eval(model.parameters())
    return model
