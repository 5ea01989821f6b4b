"""Benchmarks: each section verifies its fast path against a reference, then times it.

    python scripts/bench.py blas                # or: python -m benchmarks blas
    python scripts/bench.py wkv7 moba models    # several sections, one after another
    python scripts/bench.py all                 # every section: benchmarks/BENCHMARKS.md anew
    python scripts/bench.py all --skip train-int8   # that one carried over from the last run
    python scripts/bench.py render              # benchmarks/BENCHMARKS.md anew from benchmarks.json
    python scripts/bench.py all --quick --output /tmp/bench   # the smoke run

A section run on its own is appended to BENCHMARKS.md with the machine, the command, the times
and every ratio, each set beside the physical limits measured in the same run. ``all`` runs
every section and only then rewrites BENCHMARKS.md (a failed verification leaves the old one
whole): a header naming the machine, MLX, its BLAS and NumPy; a summary of every section's
goals; one section each. Beside it go the raw measurements (benchmarks.json: ``--skip``
carries a section over from it, ``render`` re-renders from it without measuring) and
benchmarks.png where matplotlib is installed (the ``plot`` extra). The recorded results live
in the repository's benchmarks/ folder, beside this code; ``--output DIR`` writes elsewhere.
``--quick`` runs at small sizes: a smoke test of the benchmarks, whose numbers say nothing about
the code's speed; it writes into a new temporary folder unless given ``--output``, and never
into the repository. While ``all`` runs, benchmarks.partial.json holds the sections measured
so far: after a failure or Ctrl-C, ``--skip`` carries them over from it.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import mlx_rwkvx
from benchmarks.common import PACKAGE_ROOT, RESULTS_DIR, Section, VerificationFailed
from benchmarks.report import JSON_NAME, REPORT_NAME, ReportError, read_report
from benchmarks.run import output_folder, run_all, run_section, write_report

# The repository (a --quick run never writes into it) and the default output folder.
ROOT, DEFAULT_OUTPUT = PACKAGE_ROOT, RESULTS_DIR
COMMANDS = {
    "all": "every section; rewrites BENCHMARKS.md, benchmarks.json and benchmarks.png",
    "render": "BENCHMARKS.md and benchmarks.png again from benchmarks.json, measuring nothing",
}


def _in_repository(path: Path) -> bool:
    path = path.resolve()
    return path == ROOT or ROOT in path.parents


def _parser(sections: Mapping[str, Section], prog: str | None) -> argparse.ArgumentParser:
    def section_list(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in sections]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"no section {', '.join(unknown)} (sections: {', '.join(sections)})"
            )
        return names

    parser = argparse.ArgumentParser(
        prog=prog, description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument(
        "sections",
        nargs="+",
        choices=[*sections, *COMMANDS],
        metavar="SECTION",
        help="\n".join(f"{name}: {s.help}" for name, s in sections.items())
        + "\n"
        + "\n".join(f"{name}: {help_text}" for name, help_text in COMMANDS.items()),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: a smoke test of the sections; its numbers mean nothing",
    )
    parser.add_argument(
        "--skip",
        type=section_list,
        action="extend",
        default=[],
        metavar="SECTION[,SECTION]",
        help="with all: leave these sections out, carried over from the folder's benchmarks.json "
        "(or a newer benchmarks.partial.json) when it has them",
    )
    parser.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="the folder of BENCHMARKS.md (and, for all and render, benchmarks.json and "
        "benchmarks.png); default the repository's benchmarks/ folder, with --quick a new "
        "temporary folder (a --quick run never writes into the repository)",
    )
    return parser


def main(
    argv: list[str] | None = None,
    *,
    sections: Mapping[str, Section] | None = None,
    prog: str | None = None,
) -> None:
    """Run the benchmarks the command line asks for; ``sections`` (default every section, in
    order) are the ones it knows."""
    if sections is None:
        from benchmarks.sections import SECTIONS as sections
    if argv is None:
        argv = sys.argv[1:]
    mlx_rwkvx.configure()  # MLX's CPU buffer cache, as the CLIs set it
    parser = _parser(sections, prog)
    args = parser.parse_args(argv)
    command = next((c for c in COMMANDS if c in args.sections), None)
    if command and len(args.sections) > 1:
        parser.error(f"{command} takes no other section")
    if args.skip and command != "all":
        parser.error("--skip goes with all")
    if command == "render" and args.quick:
        parser.error("render takes no --quick: benchmarks.json says whether its run was quick")
    if args.quick and args.output is not None and _in_repository(args.output):
        parser.error(
            f"--quick does not write into the repository ({args.output}): give --output a "
            "folder outside it"
        )
    out_dir = args.output or DEFAULT_OUTPUT
    temporary = args.quick and args.output is None
    if temporary:
        out_dir = Path(tempfile.mkdtemp(prefix="mlx_rwkvx-bench-quick-"))
        print(f"--quick: writing into a new temporary folder, {out_dir}", flush=True)
    try:
        if command != "render":
            output_folder(out_dir)  # before anything is measured
        if command == "all":
            run_all(
                sections,
                args.quick,
                args.skip,
                out_dir,
                "python scripts/bench.py " + shlex.join(argv),
            )
        elif command == "render":
            write_report(read_report(out_dir / JSON_NAME), sections, out_dir, with_json=False)
        else:
            for name in args.sections:
                run_section(name, sections, quick=args.quick, path=out_dir / REPORT_NAME)
    except VerificationFailed as e:
        raise SystemExit(f"verify failed: {e}") from None
    except ReportError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted\n")
    finally:
        if temporary:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only where nothing was written into it
