"""What crosses a module line, read from the source with ``ast`` (nothing imported), in every
module of ``mlx_rwkvx/``, ``benchmarks/`` and ``scripts/``:

* No module uses another module's private name. A private name starts with one underscore
  and is not a dunder (``__version__`` is public). It is used across a module line when a
  module of ours is named on the left: ``from mlx_rwkvx.x import _y``, or ``m._y`` where ``m``
  is bound by ``import mlx_rwkvx.x as m`` / ``from mlx_rwkvx import x`` (or spelled out,
  ``mlx_rwkvx.x._y``). A module whose file name starts with an underscore (``_blas``,
  ``_crash``, ``_runtime``, ``_mlx_lm``) is a module, not a name: ``from mlx_rwkvx import
  _blas`` is fine, ``_blas._private`` is not. ``getattr`` with a string and the tests are not
  checked: a test may reach into what it tests.
* Only ``mlx_rwkvx/_mlx_lm.py`` imports ``mlx_lm`` (at the top, inside a function, or by
  ``importlib.import_module("mlx_lm...")``): it lists what we use of mlx-lm and why. The tests
  may import mlx-lm directly where they compare against it (parity); ``test_mlx_lm.py``
  checks that every name ``_mlx_lm`` lists still exists in the installed mlx-lm.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("mlx_rwkvx", "benchmarks", "scripts")
OURS = ("mlx_rwkvx", "benchmarks")  # the importable packages (scripts are run, not imported)
MLX_LM_HOME = "mlx_rwkvx._mlx_lm"


def _dotted(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


FILES = {_dotted(p): p for top in SOURCES for p in sorted((ROOT / top).rglob("*.py"))}


def _ours(module: str) -> bool:
    return module.split(".")[0] in OURS


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _chain(node: ast.expr) -> list[str] | None:
    """``a.b.c`` as ``["a", "b", "c"]``; None for anything but names and attributes."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def private_uses(source: str, module: str = "") -> list[str]:
    """The other modules' private names ``source`` (the text of ``module``) uses."""
    tree = ast.parse(source)
    bound: dict[str, str] = {}  # a local name -> the module of ours it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if _ours(a.name) and a.asname:  # "import a.b.c as m": m is a.b.c
                    bound[a.asname] = a.name
                elif _ours(a.name):  # "import a.b.c": a is a
                    bound[a.name.split(".")[0]] = a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and _ours(node.module or ""):
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full in FILES:
                    bound[a.asname or a.name] = full
                elif _private(a.name):
                    found.append(f"from {node.module} import {a.name}")
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute) or not _private(node.attr):
            continue
        chain = _chain(node)
        if chain is None or chain[0] not in bound:
            continue
        target = ".".join([bound[chain[0]], *chain[1:-1]])
        if target in FILES and target != module and f"{target}.{node.attr}" not in FILES:
            found.append(f"{'.'.join(chain)}")
    return sorted(set(found))


def mlx_lm_imports(source: str) -> list[str]:
    """Where ``source`` imports mlx-lm: import statements and ``import_module("mlx_lm…")``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [f"import {a.name}" for a in node.names if a.name.split(".")[0] == "mlx_lm"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            found.append(f"from {node.module} import ...")
        elif (
            isinstance(node, ast.Call)
            and (_chain(node.func) or [""])[-1] in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], (ast.Constant, ast.JoinedStr))
            and ast.unparse(node.args[0]).strip("'\"f").startswith("mlx_lm")
        ):
            found.append(ast.unparse(node))
    return found


def test_the_modules_are_found():
    assert {"mlx_rwkvx.generation.stream", "benchmarks.wkv7", "scripts.bench"} <= set(FILES)
    assert MLX_LM_HOME in FILES


def test_no_module_uses_another_modules_private_name():
    bad = [
        f"{module}: {use}"
        for module, path in FILES.items()
        for use in private_uses(path.read_text(), module)
    ]
    assert not bad, "private names used across modules (make them public):\n" + "\n".join(bad)


def test_what_counts_as_crossing():
    cases = {
        "from mlx_rwkvx.generation.stream import _encode": [
            "from mlx_rwkvx.generation.stream import _encode"
        ],
        "import mlx_rwkvx.generation.stream as s\ns._encode(1)": ["s._encode"],
        "from mlx_rwkvx.generation import stream\nstream._encode(1)": ["stream._encode"],
        "import mlx_rwkvx.generation.stream\nmlx_rwkvx.generation.stream._encode(1)": [
            "mlx_rwkvx.generation.stream._encode"
        ],
        "from mlx_rwkvx import _blas\n_blas._private()": ["_blas._private"],
        # modules named with an underscore are modules; dunders and our own objects are fine
        "from mlx_rwkvx import _blas, _runtime": [],
        "from mlx_rwkvx._mlx_lm import LoRALinear": [],
        "import mlx_rwkvx\nmlx_rwkvx.__version__": [],
        "from mlx_rwkvx.models import Model\nModel()._cache": [],
        "import numpy as np\nnp._private": [],
    }
    for source, want in cases.items():
        assert private_uses(source) == sorted(want), source


def test_only_one_module_imports_mlx_lm():
    bad = [
        f"{module}: {where}"
        for module, path in FILES.items()
        if module != MLX_LM_HOME
        for where in mlx_lm_imports(path.read_text())
    ]
    assert not bad, f"import mlx-lm's names from {MLX_LM_HOME}, not mlx_lm:\n" + "\n".join(bad)
    assert mlx_lm_imports(FILES[MLX_LM_HOME].read_text())
    for source in (
        "import mlx_lm",
        "from mlx_lm.tuner.lora import LoRALinear",
        "def f():\n    from mlx_lm.generate import generate_step",
        "importlib.import_module(f'mlx_lm.tool_parsers.{kind}')",
    ):
        assert mlx_lm_imports(source), source
