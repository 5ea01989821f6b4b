"""The README's Python snippets run as written, in order, in a fresh process (each may use
what an earlier one defined, as a reader would), in an empty working folder."""

import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(snippets()) >= 3


def test_readme_snippets_run(tmp_path):
    program = "\n\n".join(snippets())
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"


def test_readme_promises_only_commands_that_exist():
    import importlib.util

    for name in set(re.findall(r"python -m (mlx_rwkvx\.\w+)", README.read_text())):
        assert importlib.util.find_spec(name) is not None, f"README promises {name}"
    for link in re.findall(r"\]\(([^)#]+)\)", README.read_text()):
        if not link.startswith("http"):
            assert (README.parent / link).exists(), f"README links to missing {link}"
