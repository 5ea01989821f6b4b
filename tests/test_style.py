"""Formatting is a rule, not a habit: ``ruff format --check`` and ``ruff check`` pass on every
Python file of the repository (the settings in pyproject.toml: line length 100, the import
order of ``[tool.ruff.lint.isort]``), with the ruff the ``test`` extra pins, so that the same
code formats the same on every machine. A statement kept out of the formatter says why, on
its own line: ``# fmt: skip # <reason>`` (or ``# <reason> # fmt: skip``); a bare marker is a
habit, not a rule."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ["mlx_rwkvx", "tests", "benchmarks", "scripts"]
BARE_SKIP = re.compile(r"#\s*fmt:\s*skip\s*$")


def _ruff(*args: str) -> subprocess.CompletedProcess:
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.fail(
            f"no ruff beside {sys.executable}: install the test extra (pip install -e '.[test]')"
        )
    return subprocess.run([str(ruff), *args, *SOURCES], cwd=ROOT, capture_output=True, text=True)


def test_ruff_format_leaves_every_file_as_it_is():
    out = _ruff("format", "--check")
    assert out.returncode == 0, f"run `ruff format {' '.join(SOURCES)}`:\n{out.stdout}{out.stderr}"


def test_ruff_check_finds_nothing():
    out = _ruff("check", "--output-format", "concise")
    assert out.returncode == 0, out.stdout + out.stderr


def bare_markers(text: str) -> list[int]:
    """Lines whose ``# fmt: skip`` carries no reason (a comment of its own before or after)."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        if "fmt: skip" not in line or "#" not in line:
            continue
        comment = line[line.index("#") :]
        parts = [p.strip() for p in comment.split("#") if p.strip()]
        if any(re.fullmatch(r"fmt:\s*skip", p) for p in parts) and len(parts) < 2:
            found.append(n)
    return found


def test_every_format_skip_says_why():
    bare = [
        f"{path.relative_to(ROOT)}:{n}"
        for folder in SOURCES
        for path in sorted((ROOT / folder).rglob("*.py"))
        for n in bare_markers(path.read_text())
    ]
    assert not bare, "a `# fmt: skip` without its reason:\n" + "\n".join(bare)


def test_a_bare_marker_is_told_from_one_with_its_reason():
    assert bare_markers("x = [1,  2]  # fmt: skip\n") == [1]
    assert bare_markers("x = [1,  2]  # fmt: skip # a table\n") == []
    assert bare_markers("x = [1,  2]  # a table # fmt: skip\n") == []
    assert bare_markers("x = 1  # see fmt: skip elsewhere\n") == []
