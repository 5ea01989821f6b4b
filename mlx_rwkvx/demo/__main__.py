"""``python -m mlx_rwkvx.demo``."""

from mlx_rwkvx.demo import main

if __name__ == "__main__":
    main()
