"""Benchmarks: each section verifies its fast path against a reference, then times it.

    python scripts/bench.py blas
    python scripts/bench.py wkv7 moba models    # several sections, one after another
    python scripts/bench.py all                 # every section: benchmarks/BENCHMARKS.md anew
    python scripts/bench.py all --skip train-int8   # that one carried over from the last run
    python scripts/bench.py render              # benchmarks/BENCHMARKS.md anew from benchmarks.json
    python scripts/bench.py all --quick --output /tmp/bench   # the smoke run

The benchmarks are the ``benchmarks`` package beside this folder (``python -m benchmarks`` is
the same command); this script is its entry point from a checkout.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package, from anywhere

from benchmarks.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
