# No test reaches the network: the Hugging Face hub is offline (read when huggingface_hub is
# imported), so a name that is not cached fails at once instead of waiting on DNS; the hub tests
# turn it back on in the processes they point at their stand-in hub on 127.0.0.1.
import os

os.environ["HF_HUB_OFFLINE"] = "1"

# The ops take today's fixed rule, not a measurement (which would make a run depend on the
# machine's load), and the tuning file, should a test turn tuning on, goes to a folder of the
# run's own, never the user's cache (subprocesses inherit both)
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

os.environ["MLX_RWKVX_TUNE"] = "0"
os.environ["MLX_RWKVX_CACHE"] = tempfile.mkdtemp(prefix="mlx_rwkvx-test-cache-")
atexit.register(shutil.rmtree, os.environ["MLX_RWKVX_CACHE"], ignore_errors=True)

# Import the package before anything imports mlx.core, so MLX runs on the system OpenBLAS.
import importlib.util  # noqa: E402

import mlx_rwkvx  # noqa: E402


def pytest_configure(config):
    # MLX's CPU buffer cache as the CLIs set it; a hook, not an import side effect: tests/gpu/
    # imports this file on a machine without MLX
    if importlib.util.find_spec("mlx") is not None:
        mlx_rwkvx.configure()
