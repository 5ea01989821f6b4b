"""What ``.ci/run`` runs: the README's test command exactly as written (a user's fresh machine has
only the ``test`` extra, so that is what the default suite may need), then the heavy extras and
the tests they unlock, which carry the ``extra`` marker: a test that imports a heavy extra but
lacks the marker would skip in the first run and be left out of the second."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# the extras whose tests skip in the README's command (the test extra brings the others)
HEAVY = {"parity", "eval"}


def readme_test_command() -> str:
    lines = (ROOT / "README.md").read_text().splitlines()
    (command,) = [line for line in lines[:12] if line.endswith("-m pytest")]
    return command


def test_ci_runs_the_readme_command_as_written_before_any_extra():
    script = (ROOT / ".ci" / "run").read_text().splitlines()
    command = readme_test_command()
    assert command in script, f".ci/run does not run the README's command {command!r}"
    before = script[: script.index(command)]
    assert not [line for line in before if "pip install" in line], "an install before it"
    assert "unset MLX_RWKVX_CI" in before, "the README's command runs with the CI flag unset"
    after = "\n".join(script[script.index(command) :])
    assert re.search(r'pip install -e "\.\[(parity,eval|eval,parity)\]"', after)
    assert 'MLX_RWKVX_CI=1 .venv/bin/python -m pytest -m "extra and not slow and not gpu"' in after


def test_the_test_extra_brings_the_server_and_no_heavy_extra():
    (test,) = re.findall(r"^test = \[(.*)\]$", (ROOT / "pyproject.toml").read_text(), re.M)
    assert '"mlx_rwkvx[server]"' in test
    assert not [name for name in HEAVY if f"mlx_rwkvx[{name}]" in test], test


def test_every_test_of_a_heavy_extra_is_marked():
    unmarked = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        text = path.read_text()
        for call in re.findall(r"import_parity_extra\((.*?)\)\n", text, flags=re.S):
            extra = re.search(r'extra="(\w+)"', call)
            name = extra.group(1) if extra else "parity"
            if name in HEAVY and f'mark.extra("{name}")' not in text:
                unmarked.append(f"{path.relative_to(ROOT)}: {name}")
    assert not unmarked, f"imports a heavy extra without pytest.mark.extra: {unmarked}"
