# Import the package before anything imports mlx.core, so MLX runs on the system OpenBLAS.
import mlx_rwkvx  # noqa: F401
