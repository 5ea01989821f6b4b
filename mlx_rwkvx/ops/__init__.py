"""Pure differentiable functions: WKV7 (``mlx_rwkvx.ops.wkv7``) and MoBA attention
(``mlx_rwkvx.ops.moba_attention``), their decode steps, and their kernel builders.

The functions are imported on first use: ``mlx_rwkvx.ops.kernels`` (the kernel sources) must
stay importable without MLX, on the GPU machines where the CUDA flavour is tested through CuPy.
"""

_EXPORTS = {
    "wkv7": "mlx_rwkvx.ops.wkv",
    "wkv7_step": "mlx_rwkvx.ops.wkv",
    "moba_attention": "mlx_rwkvx.ops.moba",
    "moba_decode": "mlx_rwkvx.ops.moba",
    "MobaKVCache": "mlx_rwkvx.ops.moba",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'mlx_rwkvx.ops' has no attribute {name!r}")
