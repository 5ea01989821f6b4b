"""nn.Modules of RWKV-7, RWKV-X and RFA, built from one ModelConfig."""

from mlx_rwkvx.models.config import ModelConfig, preset, rfa_config, rwkv_x_block_types
from mlx_rwkvx.models.model import Model

__all__ = [
    "Model",
    "ModelConfig",
    "preset",
    "rfa_config",
    "rwkv_x_block_types",
]
