"""Every mlx-lm name ``mlx_rwkvx/_mlx_lm.py`` relies on exists in the installed mlx-lm: the
test to run first when mlx-lm changes (``pyproject.toml`` pins ``<0.33``). The names are read
from the module's source, so the list is the code itself: each ``from mlx_lm.x import name``
(at the top or inside a function) must import, and each attribute read off such a name
(``Rwkv7TimeMixing._wkv7``) must exist; every tool parser must carry what
``server/tools.py`` reads of it."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parent.parent / "mlx_rwkvx" / "_mlx_lm.py"
TOOL_PARSER = ("tool_call_start", "tool_call_end", "parse_tool_call")


def relied_on(source: str) -> list[str]:
    """The dotted mlx-lm names ``source`` imports or reads attributes of."""
    tree = ast.parse(source)
    imported: dict[str, str] = {}  # local name -> "mlx_lm.module.name"
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "mlx_lm":
            for a in node.names:
                imported[a.asname or a.name] = f"{node.module}.{a.name}"
    names = set(imported.values())
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id in imported:
                names.add(f"{imported[node.value.id]}.{node.attr}")
    return sorted(names)


def missing(dotted: str) -> str | None:
    """None where ``dotted`` (``mlx_lm.module.Name[.attribute]``) exists, else what is not."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                return ".".join(parts[: i + 1])
            obj = getattr(obj, attr)
        return None
    return dotted


def test_the_list_is_read_from_the_module():
    names = relied_on(SOURCE.read_text())
    assert "mlx_lm.tuner.lora.LoRALinear" in names
    assert "mlx_lm.tokenizer_utils._infer_tool_parser" in names  # inside a function
    assert "mlx_lm.models.rwkv7.Rwkv7TimeMixing._wkv7" in names  # an attribute of a name
    assert len(names) > 15


@pytest.mark.parametrize("name", relied_on(SOURCE.read_text()))
def test_every_name_we_rely_on_exists(name):
    assert missing(name) is None, f"mlx-lm no longer has {missing(name)}: see mlx_rwkvx/_mlx_lm.py"


def test_a_name_gone_is_caught():
    source = "from mlx_lm.generate import Gone\nfrom mlx_lm.tuner.lora import LoRALinear\n"
    source += "LoRALinear._gone\n"
    gone = [n for n in relied_on(source) if missing(n)]
    assert gone == ["mlx_lm.generate.Gone", "mlx_lm.tuner.lora.LoRALinear._gone"]
    assert missing("mlx_lm.no_such_module.Name") == "mlx_lm.no_such_module"


def test_every_tool_parser_has_what_we_read():
    import mlx_lm.tool_parsers

    kinds = [m.name for m in pkgutil.iter_modules(mlx_lm.tool_parsers.__path__)]
    assert kinds
    from mlx_rwkvx._mlx_lm import tool_parser

    for kind in kinds:
        module = tool_parser(kind)
        assert all(hasattr(module, a) for a in TOOL_PARSER), (kind, TOOL_PARSER)


def test_the_module_imports_and_lists_its_names():
    import mlx_rwkvx._mlx_lm as lm

    assert all(hasattr(lm, name) for name in lm.__all__)
