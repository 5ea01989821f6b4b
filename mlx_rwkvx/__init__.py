"""mlx_rwkvx: RWKV-7, RWKV-X and RFA language models in MLX.

Importing the package first makes MLX's CPU backend use the system OpenBLAS on Linux
(see ``mlx_rwkvx._blas``); this must happen before ``mlx.core`` is imported anywhere.
"""

from mlx_rwkvx import _blas

_blas.setup()

__version__ = "0.1.0.dev0"

_LAZY = {
    "load": "mlx_rwkvx.api",
    "load_model": "mlx_rwkvx.api",
    "save": "mlx_rwkvx.api",
    "configure": "mlx_rwkvx._runtime",
    # the functions; ``python -m mlx_rwkvx.generate`` is the command (a module that, once
    # imported, takes this name and calls the function when called)
    "generate": "mlx_rwkvx.generation",
    "stream_generate": "mlx_rwkvx.generation",
    "Chat": "mlx_rwkvx.generation",
}


def __getattr__(name: str):
    # these import mlx: only when asked for, so that importing the package stays light
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'mlx_rwkvx' has no attribute {name!r}")
