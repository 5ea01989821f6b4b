"""Running sections and writing what they measured: one section appended to BENCHMARKS.md,
or ``all`` (benchmarks.partial.json as it goes, then benchmarks.json, BENCHMARKS.md and
benchmarks.png). Every file is written whole or not at all (``mlx_rwkvx.io.atomic``)."""

from __future__ import annotations

import contextlib
import json
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from benchmarks.common import RESULTS_DIR, Section, now
from benchmarks.plot import plot_png
from benchmarks.readme_table import write_readme_table
from benchmarks.report import (
    JSON_NAME,
    PARTIAL_NAME,
    PLOT_NAME,
    REPORT_FORMAT,
    REPORT_NAME,
    ReportError,
    carried_over,
    environment,
    previous_reports,
    render_report,
    section_command,
)
from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.atomic import atomic_target, save_text
from mlx_rwkvx.io.targets import reason
from mlx_rwkvx.perf import machine_description

# The first lines of a BENCHMARKS.md that sections run alone started.
APPENDED_HEADER = "# Benchmarks\n\nWritten by `scripts/bench.py`; newest sections last.\n\n"


def _why(e: CheckpointError) -> str:
    """An atomic write's failure in words: the reason of the OSError behind it."""
    cause = e.__cause__
    return reason(cause) if isinstance(cause, OSError) else str(e)


def _write(tmp: str, content: str | bytes) -> None:
    if isinstance(content, bytes):
        Path(tmp).write_bytes(content)
    else:
        save_text(tmp, content)


def _save(path: Path, content: str | bytes) -> None:
    """``content`` at ``path``, replacing it in one step: CheckpointError where it cannot be."""
    with atomic_target(str(path), folder=False) as tmp:
        _write(tmp, content)


def output_folder(path: Path) -> Path:
    """``path`` made where it is missing and checked writable, before anything is measured."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ReportError(f"{path}: cannot hold the report ({e.strerror or e})") from None
    return path


def write_section(title: str, command: str, lines: list[str], path: Path) -> None:
    """Echo one result section, then add it at the end of ``path`` (a BENCHMARKS.md);
    ReportError where it cannot be written."""
    text = "\n".join(
        [
            f"## {title} ({now()})",
            "",
            f"Machine: {machine_description()}",
            f"Command: `{command}`",
            "",
            *lines,
            "",
        ]
    )
    print(text)
    try:
        before = path.read_text() if path.exists() else APPENDED_HEADER
        _save(path, before + text + "\n")
    except OSError as e:
        raise ReportError(f"{path}: cannot be written ({e.strerror or e})") from None
    except CheckpointError as e:
        raise ReportError(f"{path}: cannot be written ({_why(e)})") from None


def run_section(
    name: str, sections: Mapping[str, Section], quick: bool = False, path: Path | None = None
) -> dict:
    """Measure one section, render it, add it to ``path`` (default the repository's
    benchmarks/BENCHMARKS.md); returns the measurements."""
    section = sections[name]
    results = section.measure(quick=quick)
    lines = section.render(results).lines
    write_section(name, section_command(name, quick), lines, path or RESULTS_DIR / REPORT_NAME)
    return results


def run_all(
    sections: Mapping[str, Section], quick: bool, skip: list[str], out_dir: Path, command: str
) -> dict:
    """Every section but ``skip`` verified and measured, skipped ones carried over from
    ``out_dir``'s benchmarks.json (or a newer benchmarks.partial.json); then the report written
    (``write_report``). The report is written only once every section verified and measured;
    until then benchmarks.partial.json holds what was measured, rewritten after each section."""
    previous = previous_reports(out_dir) if skip else []
    env = environment()
    report = {
        "format": REPORT_FORMAT,
        "date": now(),
        "command": command,
        "quick": quick,
        "environment": env,
        "sections": {},
    }
    partial, kept = out_dir / PARTIAL_NAME, []  # the sections measured and saved there
    try:
        for name, section in sections.items():
            if name in skip:
                report["sections"][name] = carried_over(previous, name, quick)
                continue
            print(f"== {name}: {section_command(name, quick)}", flush=True)
            t0 = time.perf_counter()
            # rendered from exactly what is saved
            results = json.loads(json.dumps(section.measure(quick=quick)))
            seconds = time.perf_counter() - t0
            report["sections"][name] = {
                "date": report["date"],
                "command": command,
                "quick": quick,
                "machine": env["machine"],
                "seconds": seconds,
                "results": results,
            }
            try:
                _save(partial, json.dumps(report, indent=1) + "\n")
                kept.append(name)
            except CheckpointError as e:
                print(
                    f"{partial}: cannot be written ({_why(e)}); measuring goes on", file=sys.stderr
                )
            print("\n".join(section.render(results).lines) + f"\n\n({seconds:.0f} s)\n")
        write_report(report, sections, out_dir)
    except BaseException:
        if kept:
            done = ",".join(n for n in sections if n in skip or n in kept)
            print(
                f"{', '.join(kept)} measured and kept in {partial}: "
                f"`all --skip {done}` carries them over",
                file=sys.stderr,
            )
        raise
    return report


def write_report(
    report: dict, sections: Mapping[str, Section], out_dir: Path, with_json: bool = True
) -> list[Path]:
    """benchmarks.png (where matplotlib imports), benchmarks.json and BENCHMARKS.md in
    ``out_dir``: each written to a temporary file first, all renamed over the old ones once all
    are written, so that a failure leaves the old report whole. Then a benchmarks.png the new
    report does not show is removed, and with the JSON the benchmarks.partial.json."""
    png = plot_png(report)
    files: dict[str, str | bytes] = {} if png is None else {PLOT_NAME: png}
    if with_json:
        files[JSON_NAME] = json.dumps(report, indent=1) + "\n"
    files[REPORT_NAME] = render_report(report, sections, PLOT_NAME if png is not None else None)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:  # each renamed into place as the stack unwinds
            for name, content in files.items():
                tmp = stack.enter_context(atomic_target(str(out_dir / name), folder=False))
                _write(tmp, content)
    except OSError as e:
        raise ReportError(f"{out_dir}: the report cannot be written ({reason(e)})") from None
    except CheckpointError as e:
        raise ReportError(f"{out_dir}: the report cannot be written ({_why(e)})") from None
    if out_dir.resolve() == RESULTS_DIR.resolve():
        write_readme_table(report)
    stale = [] if png is not None else [out_dir / PLOT_NAME]
    if with_json:
        stale.append(out_dir / PARTIAL_NAME)
    for path in stale:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    print(f"wrote {', '.join(files)} in {out_dir}")
    return [out_dir / name for name in files]
