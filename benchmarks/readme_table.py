"""README.md's "which Mac" table: written from the memory-fit section's last full run (in
benchmarks.json) between its markers whenever the repository's report is written, so that the
README never carries those numbers typed by hand."""

from __future__ import annotations

from benchmarks import memory_fit
from benchmarks.common import PACKAGE_ROOT
from mlx_rwkvx.io.atomic import atomic_target, save_text

README_BEGIN = "<!-- which-mac: written by scripts/bench.py from benchmarks/benchmarks.json -->"
README_END = "<!-- /which-mac -->"


def readme_lines(record: dict) -> list[str]:
    """README.md's "which Mac" table from the section's record in benchmarks.json (its results,
    date, command and machine), between its markers."""
    return [
        README_BEGIN,
        f"Measured {record['date'][:10]} by `{record['command']}` on {record['machine']} "
        "([BENCHMARKS.md](benchmarks/BENCHMARKS.md#memory-fit) says how): the peak resident "
        "memory of a whole training process, batch 1, the default LoRA rank and targets, "
        "extrapolated per block from the preset cut to "
        f"{' and '.join(map(str, memory_fit.BLOCKS))} blocks; on Linux, not on a Mac. "
        "The smallest Mac is the one whose working set (taken as "
        f"{memory_fit.WORKING_SET:.0%} of its memory) holds the checkpointed peak.",
        "",
        *memory_fit.table_lines(record["results"]),
        README_END,
    ]


def with_readme_table(text: str, record: dict) -> str:
    """``text`` (README.md's) with the table between its markers replaced; ValueError where
    they are missing."""
    start, end = text.index(README_BEGIN), text.index(README_END) + len(README_END)
    return text[:start] + "\n".join(readme_lines(record)) + text[end:]


def write_readme_table(report: dict) -> None:
    """README.md's "which Mac" table rewritten from the report's memory-fit section (a full
    run's): the README never carries numbers typed by hand there."""
    record = report["sections"].get("memory-fit")
    if record is None or record["quick"]:
        return
    path = PACKAGE_ROOT / "README.md"
    text = path.read_text(encoding="utf-8")
    new = with_readme_table(text, record)
    if new != text:
        with atomic_target(str(path), folder=False) as tmp:
            save_text(tmp, new)
        print(f"rewrote the which-Mac table in {path}")
