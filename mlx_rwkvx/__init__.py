"""mlx_rwkvx: RWKV-7, RWKV-X and RFA language models in MLX.

Importing the package first makes MLX's CPU backend use the system OpenBLAS on Linux
(see ``mlx_rwkvx._blas``); this must happen before ``mlx.core`` is imported anywhere.
"""

from mlx_rwkvx import _blas

_blas.setup()

__version__ = "0.1.0.dev0"
