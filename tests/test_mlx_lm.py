"""Every mlx-lm name ``mlx_rwkvx/_mlx_lm.py`` relies on exists in the installed mlx-lm: the
test to run first when mlx-lm changes (``pyproject.toml`` pins ``<0.33``). The names are read
from the module's source, so the list is the code itself: each ``from mlx_lm.x import name``
(at the top or inside a function) must import, and each attribute read off such a name
(``Rwkv7TimeMixing._wkv7``) must exist; every tool parser must carry what
``server/tools.py`` reads of it. What we use inside mlx-lm's classes and functions (methods,
fields, keyword parameters) is declared in ``_mlx_lm.RELIED``: each entry must hold, the table
must name every mlx-lm class we subclass, and every method a subclass of ours overrides or
reaches through ``super()``."""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import pkgutil
import textwrap
import types
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_rwkvx"
SOURCE = PACKAGE / "_mlx_lm.py"
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


def resolve(dotted: str) -> tuple[object, str | None]:
    """``(the object at dotted, None)`` (``mlx_lm.module.Name[.attribute]``), or ``(None, the
    first part that is not there)``. Modules by import: ``mlx_lm.generate`` the module, not
    the function ``mlx_lm/__init__.py`` exports under that name."""
    parts = dotted.split(".")
    for cut in range(len(parts) - 1, 0, -1):  # the longest importable module prefix
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for i, attr in enumerate(parts[cut:], start=cut):
            if not hasattr(obj, attr):
                return None, ".".join(parts[: i + 1])
            obj = getattr(obj, attr)
        return obj, None
    return None, dotted


def missing(dotted: str) -> str | None:
    """None where ``dotted`` (``mlx_lm.module.Name[.attribute]``) exists, else what is not."""
    return resolve(dotted)[1]


# A small instance of each class whose fields in RELIED its __init__ sets
INSTANCES = {
    "mlx_lm.models.cache.ArraysCache": lambda cls: cls(2),
    "mlx_lm.tuner.lora.LoRALinear": lambda cls: cls(4, 4, r=2),
    "mlx_lm.tuner.dora.DoRALinear": lambda cls: cls(4, 4, r=2),
}


def _takes(fn, name: str) -> bool:
    """Whether ``fn`` (a class: its constructor) has a parameter ``name`` a keyword can set."""
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    param = inspect.signature(fn).parameters.get(name)
    return param is not None and param.kind in kinds


def _has(obj, name: str, instance) -> bool:
    """Whether ``obj`` has the attribute ``name``: on itself, as a dataclass field, declared
    in a class's annotations, or on ``instance`` (one of the class, or None)."""
    if hasattr(obj, name):
        return True
    if dataclasses.is_dataclass(obj) and name in {f.name for f in dataclasses.fields(obj)}:
        return True
    if inspect.isclass(obj) and any(
        name in vars(k).get("__annotations__", {}) for k in obj.__mro__
    ):
        return True
    return instance is not None and hasattr(instance, name)


def unmet(relied: dict[str, tuple[str, ...]]) -> list[str]:
    """What ``relied`` (``_mlx_lm.RELIED``'s form) lists that the installed mlx-lm lacks: a
    name gone as its path, an attribute as ``path.name``, a keyword parameter as
    ``path(name=)``."""
    gone = []
    for path, uses in relied.items():
        obj, lost = resolve(path)
        if lost is not None:
            gone.append(lost)
            continue
        instance = INSTANCES[path](obj) if path in INSTANCES else None
        for use in uses:
            if use.endswith("="):
                if not _takes(obj, use[:-1]):
                    gone.append(f"{path}({use})")
            elif not _has(obj, use, instance):
                gone.append(f"{path}.{use}")
    return gone


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


def _relied() -> dict[str, tuple[str, ...]]:
    """``_mlx_lm.RELIED``, read from the source (collecting the tests imports no mlx-lm)."""
    for node in ast.parse(SOURCE.read_text()).body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "RELIED":
            return ast.literal_eval(node.value)
    raise AssertionError("mlx_rwkvx/_mlx_lm.py has no RELIED")


def test_the_table_read_is_the_modules():
    from mlx_rwkvx._mlx_lm import RELIED

    assert _relied() == RELIED


@pytest.mark.parametrize("path", list(_relied()))
def test_what_we_use_inside_each_name_exists(path):
    gone = unmet({path: _relied()[path]})
    assert gone == [], f"mlx-lm no longer has {gone}: see RELIED in mlx_rwkvx/_mlx_lm.py"


def test_a_use_gone_is_caught(monkeypatch):
    import mlx_lm.models.cache
    import mlx_lm.tuner.lora

    generate = importlib.import_module("mlx_lm.generate")  # the module, not the function
    arrays_cache = mlx_lm.models.cache.ArraysCache
    monkeypatch.delattr(arrays_cache, "filter")  # a method
    lora_init = mlx_lm.tuner.lora.LoRALinear.__init__

    @functools.wraps(lora_init)  # the same parameters
    def without_scale(self, *args, **kwargs):  # a field its __init__ sets
        lora_init(self, *args, **kwargs)
        del self.scale

    monkeypatch.setattr(mlx_lm.tuner.lora.LoRALinear, "__init__", without_scale)

    def generate_step(prompt, model, *, max_tokens=256, sampler=None, logits_processors=None):
        pass  # prompt_cache renamed away

    monkeypatch.setattr(generate, "generate_step", generate_step)
    monkeypatch.delattr(generate, "GenerationBatch")  # a whole name
    assert unmet(_relied()) == [
        "mlx_lm.models.cache.ArraysCache.filter",
        "mlx_lm.generate.generate_step(prompt_cache=)",
        "mlx_lm.generate.GenerationBatch",
        "mlx_lm.tuner.lora.LoRALinear.scale",
    ]
    assert unmet({"mlx_lm.generate.TextStateMachine": ("split", "nope=")}) == [
        "mlx_lm.generate.TextStateMachine(nope=)"
    ]


# Our subclasses of mlx-lm's classes, and their bases
SUBCLASSES = {
    "RowsCache": "mlx_lm.models.cache.ArraysCache",
    "_ByteDetokenizer": "mlx_lm.tokenizer_utils.StreamingDetokenizer",
    "PissaLinear": "mlx_lm.tuner.lora.LoRALinear",
    "MissLinear": "mlx_lm.tuner.lora.LoRALinear",
}


def test_every_mlx_lm_class_we_subclass_is_in_the_table():
    """Each ``class X(Base)`` in mlx_rwkvx/ whose base comes from ``_mlx_lm`` (read with
    ``ast``) is in SUBCLASSES, its base in RELIED."""
    relied = {path.rsplit(".", 1)[-1]: path for path in _relied()}
    found = {}
    for file in PACKAGE.rglob("*.py"):
        tree = ast.parse(file.read_text())
        imported = {
            a.asname or a.name
            for node in ast.walk(tree)
            if isinstance(node, ast.ImportFrom) and node.module == "mlx_rwkvx._mlx_lm"
            for a in node.names
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                for base in node.bases:
                    if isinstance(base, ast.Name) and base.id in imported:
                        found[node.name] = relied.get(base.id, f"{base.id}, not in RELIED")
    assert found == SUBCLASSES


def _subclass(name: str) -> type:
    from mlx_rwkvx.adapters import variants
    from mlx_rwkvx.generation import stream
    from mlx_rwkvx.models.cache import _classes

    if name == "RowsCache":
        return _classes()[1]
    return getattr(variants, name, None) or getattr(stream, name)


def _super_calls(cls) -> set[str]:
    """The names ``cls``' source reaches through ``super().name``."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    return {
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Call)
        and isinstance(node.value.func, ast.Name)
        and node.value.func.id == "super"
    }


@pytest.mark.parametrize("name", SUBCLASSES)
def test_the_table_lists_what_our_subclasses_override(name):
    """Every method of ours that overrides one of the mlx-lm base's (today's), and every
    ``super()`` call but the constructor's, is in RELIED: so the test above fails when the
    base's method goes or is renamed, and ours would silently no longer be called."""
    cls, base = _subclass(name), SUBCLASSES[name]
    listed = set(_relied()[base])
    parent = resolve(base)[0]
    assert issubclass(cls, parent)
    methods = (types.FunctionType, classmethod, staticmethod, property)
    overrides = {
        n
        for n, v in vars(cls).items()
        if isinstance(v, methods) and not n.startswith("__") and hasattr(parent, n)
    }
    supers = _super_calls(cls) - {"__init__"}
    assert sorted((overrides | supers) - listed) == [], f"add them to RELIED[{base!r}]"
    if name == "RowsCache":  # the batch methods BatchGenerator calls
        assert overrides >= {"filter", "extend", "extract", "prepare", "finalize", "make_mask"}
        assert supers >= {"extend", "finalize", "make_mask"}
