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


def _design_entries() -> list[str]:
    """The Design section's tree, one entry per top-level item (with its continuation lines)."""
    section = README.read_text().split("\n## Design\n", 1)[1]
    tree = re.search(r"```\nmlx_rwkvx/\n(.*?)```", section, flags=re.S).group(1)
    return re.split(r"\n(?=  \S)", tree)


def test_readme_design_draws_every_module():
    # "the layers as they now are": every public module and subpackage of the package is named
    # in the Design section's tree, a subpackage's modules in its own entry
    package = README.parent / "mlx_rwkvx"
    entries = _design_entries()
    missing = []

    def named(name: str, text: str) -> bool:
        return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None

    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
        entry = next((e for e in entries if e.startswith(f"  {sub.name}/")), None)
        if entry is None:
            missing.append(f"{sub.name}/")
            continue
        for child in sorted(sub.iterdir()):
            if child.name.startswith("_"):
                continue
            if child.suffix == ".py" and not named(child.name, entry):
                missing.append(f"{sub.name}/{child.name}")
            if (child / "__init__.py").exists() and not named(f"{child.name}/", entry):
                missing.append(f"{sub.name}/{child.name}/")
    top = "\n".join(e for e in entries if not re.match(r"  \w+/", e))
    for module in sorted(package.glob("*.py")):
        if not module.name.startswith("_") and not named(module.name, top):
            missing.append(module.name)
    assert not missing, f"README's Design section does not draw {missing}"
