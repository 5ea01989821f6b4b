"""``python -m benchmarks ...``: the same command line as ``python scripts/bench.py ...``."""

from benchmarks.cli import main

if __name__ == "__main__":
    main(prog="python -m benchmarks")
