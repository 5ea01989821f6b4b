"""The benchmarks of mlx_rwkvx: ``python scripts/bench.py`` or ``python -m benchmarks`` (the
command line and what it writes: ``cli``).

One module per section (``blas``, ``wkv7``, ``moba``, ``models``, ``loss``, ``train``,
``train_int8``, ``generate``, ``parallel``), each with ``measure(quick)``, which verifies, then
times and returns plain data (JSON-serialisable), and ``render(results)``, which turns that data
into a ``Rendered``: the markdown lines and the section's goals, judged, as values
(``common.with_goals``), without measuring anything. ``sections`` lists them in order; ``report``
is benchmarks.json and BENCHMARKS.md, ``plot`` benchmarks.png, ``run`` runs sections and writes
the files, ``cli`` the command line. Work that must run in a fresh process is an entry point of
its section's module (``python -m benchmarks.parallel --worker`` under mlx.launch, for one).
"""

import mlx_rwkvx  # noqa: F401  (first: it loads OpenBLAS before mlx.core is imported)
