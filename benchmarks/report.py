"""The report of ``all``: benchmarks.json (its schema, read back and checked; sections carried
over from an earlier one) and BENCHMARKS.md rendered from it."""

from __future__ import annotations

import json
import platform
from collections.abc import Mapping
from pathlib import Path

from benchmarks.common import Section
from mlx_rwkvx.perf import blas_in_use, machine_description, numpy_blas

import mlx.core as mx
import numpy as np

REPORT_NAME, JSON_NAME, PLOT_NAME = "BENCHMARKS.md", "benchmarks.json", "benchmarks.png"
# What ``all`` saves after each measured section: a late failure or Ctrl-C keeps what was
# measured, and ``--skip`` carries it over.
PARTIAL_NAME = "benchmarks.partial.json"
REPORT_FORMAT = 1  # of benchmarks.json
# The fields of benchmarks.json the report is rendered from, checked by read_report: the run's,
# its environment's (``environment``'s keys) and a measured section's.
RUN_FIELDS = {"date": str, "command": str, "quick": bool, "environment": dict, "sections": dict}
ENVIRONMENT_FIELDS = ("machine", "mlx", "blas", "blas_core_note", "numpy", "numpy_blas", "python")
ENTRY_FIELDS = {"date": str, "command": str, "quick": bool, "machine": str, "seconds": (int, float)}
# What a renderer or a plot panel raises on data of a layout it no longer reads.
DATA_ERRORS = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError)
QUICK_WARNING = (
    "**A `--quick` run: small sizes, a smoke test of `scripts/bench.py`. Its numbers mean "
    "nothing about the code's speed.**"
)


class ReportError(ValueError):
    """A benchmarks.json that cannot be read back, or a report that cannot be written."""


def section_command(name: str, quick: bool) -> str:
    """The command that runs one section on its own."""
    return f"python scripts/bench.py {name}" + (" --quick" if quick else "")


def environment() -> dict:
    """What a report's numbers were measured on: the machine, MLX, its BLAS, NumPy, Python."""
    return {
        "machine": machine_description(),
        "mlx": mx.__version__,
        "blas": blas_in_use()["blas"],
        "blas_core_note": blas_in_use()["core_note"],
        "numpy": np.__version__,
        "numpy_blas": numpy_blas(),
        "python": platform.python_version(),
    }


def _entry_problem(entry) -> str | None:
    """What is wrong with one section of a benchmarks.json, or None."""
    if not isinstance(entry, dict):
        return "is not an object"
    if "results" not in entry:
        return None if isinstance(entry.get("not_run"), str) else "has neither results nor not_run"
    bad = [k for k, kind in ENTRY_FIELDS.items() if not isinstance(entry.get(k), kind)]
    if bad:
        return f"has results but no valid {', '.join(bad)} (expected {', '.join(ENTRY_FIELDS)})"
    return None


def read_report(path: Path) -> dict:
    """A benchmarks.json written by ``all``, checked for every field its report is rendered
    from: the run's, its environment's and each section's."""
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise ReportError(f"{path}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None
    ok = isinstance(report, dict) and report.get("format") == REPORT_FORMAT
    if not (ok and all(isinstance(report.get(k), kind) for k, kind in RUN_FIELDS.items())):
        raise ReportError(
            f"{path}: not a benchmarks.json of `scripts/bench.py all` (format {REPORT_FORMAT} "
            f"with {', '.join(RUN_FIELDS)})"
        )
    missing = [k for k in ENVIRONMENT_FIELDS if k not in report["environment"]]
    if missing:
        raise ReportError(f"{path}: its environment has no {', '.join(missing)}")
    for name, entry in report["sections"].items():
        problem = _entry_problem(entry)
        if problem:
            raise ReportError(f"{path}: section {name} {problem}")
    return report


def previous_reports(out_dir: Path) -> list[dict]:
    """The reports ``--skip`` carries sections over from, newest first: ``out_dir``'s
    benchmarks.json and the benchmarks.partial.json an unfinished ``all`` left there."""
    paths = [p for p in (out_dir / PARTIAL_NAME, out_dir / JSON_NAME) if p.exists()]
    paths.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [read_report(p) for p in paths]


def carried_over(previous: list[dict], name: str, quick: bool) -> dict:
    """A skipped section's entry: the newest of the earlier reports' measurements of the same
    kind (--quick or full), or why there is none."""
    entries = [r["sections"][name] for r in previous if name in r["sections"]]
    if not entries:
        where = "not in benchmarks.json" if previous else "no earlier benchmarks.json"
        return {"not_run": f"skipped; {where}"}
    measured = [e for e in entries if "results" in e]
    if not measured:
        return {"not_run": "skipped; not run in the earlier run either"}
    same = [e for e in measured if e["quick"] == quick]
    if not same:
        kind = "a --quick" if measured[0]["quick"] else "a full"
        return {"not_run": f"skipped; the earlier measurement was {kind} run's"}
    return {**same[0], "carried_over": True}


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _section_status(entry: dict, machine: str) -> str:
    if "results" not in entry:
        return f"not run ({entry['not_run']})"
    done = f"{entry['seconds']:.0f} s"
    if not entry.get("carried_over"):
        return f"measured in this run ({done})"
    elsewhere = f", on {entry['machine']}" if entry["machine"] != machine else ""
    return f"carried over from the run of {entry['date']} (`{entry['command']}`{elsewhere}; {done})"


def _count_line(met: int, goals: int, not_run: int) -> str:
    """``M of N goals met.``, with ``; K sections not run`` where some did not run."""
    sections = f"; {not_run} section{'s' if not_run != 1 else ''} not run" if not_run else ""
    return f"{met} of {goals} goals met{sections}."


def _header(report: dict) -> list[str]:
    env = report["environment"]
    core_note = f" (core: {env['blas_core_note']})" if env["blas_core_note"] else ""
    lines = ["# Benchmarks", ""] + ([QUICK_WARNING, ""] if report["quick"] else [])
    return lines + [
        "Written by `scripts/bench.py all`: every section verifies its fast path against a "
        "reference, then times it, beside baselines and physical limits measured in the same "
        f"run. The raw measurements are in `{JSON_NAME}` beside this file; "
        "`python scripts/bench.py render` writes this file again from them.",
        "",
        f"- Date: {report['date']}",
        f"- Machine: {env['machine']}",
        f"- MLX: {env['mlx']}",
        f"- MLX's BLAS: {env['blas']}{core_note}",
        f"- NumPy: {env['numpy']}, its own BLAS: {env['numpy_blas']}",
        f"- Python: {env['python']}",
        f"- Command: `{report['command']}`",
        "",
    ]


def render_report(report: dict, sections: Mapping[str, Section], plot: str | None = None) -> str:
    """BENCHMARKS.md of a report: header, summary of every goal, contents, one section each,
    each rendered by ``sections``' renderers, the summary from the goals they return. A
    carried-over section whose data the renderer no longer reads is reported as not run; one
    measured in the report's own run raises ReportError."""
    machine, quick = report["environment"]["machine"], report["quick"]
    rendered, summary, met, judged, not_run = {}, [], 0, 0, 0
    for name, section in sections.items():
        entry = report["sections"].get(name, {"not_run": "not in benchmarks.json"})
        body, goals = None, []
        if "results" in entry:
            try:
                body, goals = section.render(entry["results"])
            except DATA_ERRORS as e:
                if not entry.get("carried_over"):
                    raise ReportError(
                        f"section {name} does not render ({e!r}): measured by another version "
                        "of scripts/bench.py?"
                    ) from None
                # measured by an older version whose data this renderer no longer reads
                entry = {"not_run": f"carried over, but its data no longer renders ({e!r})"}
        rendered[name] = (entry, body)
        label = f"[{name}](#{name})" + (" (carried over)" if entry.get("carried_over") else "")
        if body is None:
            not_run += 1
            summary.append(f"| {label} | not run ({_cell(entry['not_run'])}) | | | |")
        for g in goals:
            summary.append(
                f"| {label} | {_cell(g.name)} | {g.value:.2f} | {g.bound_text} | {g.verdict} |"
            )
            met += g.met
        judged += len(goals)
    lines = _header(report)
    lines += ["## Summary", "", _count_line(met, judged, not_run), ""]
    lines += ["| section | goal | value | bound | |", "|---|---|---|---|---|", *summary, ""]
    lines += ["## Contents", ""]
    for name, (entry, _) in rendered.items():
        lines.append(
            f"- [{name}](#{name}): {sections[name].help}; {_section_status(entry, machine)}"
        )
    lines.append("")
    if plot:
        lines += [f"![WKV7 and MoBA time against T, LoRA training tokens/s]({plot})", ""]
    for name, (entry, body) in rendered.items():
        status = _section_status(entry, machine)
        lines += [f"## {name}", "", f"Command: `{section_command(name, quick)}`", ""]
        lines += [status[0].upper() + status[1:] + ".", ""]
        if body is not None:
            lines += body + [""]
    return "\n".join(lines) + "\n"  # a blank line last: sections run alone are appended
