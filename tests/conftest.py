# No test reaches the network: the Hugging Face hub is offline (read when huggingface_hub is
# imported), so a name that is not cached fails at once instead of waiting on DNS; the hub tests
# turn it back on in the processes they point at their stand-in hub on 127.0.0.1.
import os

os.environ["HF_HUB_OFFLINE"] = "1"

# Import the package before anything imports mlx.core, so MLX runs on the system OpenBLAS.
import importlib.util  # noqa: E402

import mlx_rwkvx  # noqa: E402


def pytest_configure(config):
    # MLX's CPU buffer cache as the CLIs set it; a hook, not an import side effect: tests/gpu/
    # imports this file on a machine without MLX
    if importlib.util.find_spec("mlx") is not None:
        mlx_rwkvx.configure()
