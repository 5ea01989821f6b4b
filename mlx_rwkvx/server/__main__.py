"""``python -m mlx_rwkvx.server``."""

from mlx_rwkvx.server.main import main

if __name__ == "__main__":
    main()
