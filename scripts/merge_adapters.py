"""Foundry's adapter merge, with their command as it is:

    python scripts/merge_adapters.py --output merged.safetensors a.safetensors b.safetensors

It is ``python -m mlx_rwkvx.merge`` (fedavg by default; see there for --weights, --method,
--rank and --fuse-into).
"""

from mlx_rwkvx.merge import main

if __name__ == "__main__":
    main()
