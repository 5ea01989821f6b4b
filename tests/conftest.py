# Import the package before anything imports mlx.core, so MLX runs on the system OpenBLAS.
import importlib.util

import mlx_rwkvx


def pytest_configure(config):
    # MLX's CPU buffer cache as the CLIs set it; a hook, not an import side effect: tests/gpu/
    # imports this file on a machine without MLX
    if importlib.util.find_spec("mlx") is not None:
        mlx_rwkvx.configure()
