"""Imports stay one-way: the package's layers, bottom up (the README's Design section), and no
module importing one of a layer above it, nor two modules importing each other through a
cycle. Imports inside functions count, and so does ``mlx_rwkvx.load`` and the other names the
package root hands out lazily."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_rwkvx"

# Bottom up. A layer is one or more groups side by side: a module may import its own group and
# every layer below, never a group beside it nor anything above. A module belongs to the group
# whose prefix its dotted name starts with (the longest). Inference (generation, evaluation, the
# server and the commands that load models to use them) sits beside the trainer, never on it.
LAYERS = [
    [
        (
            "support",
            [
                "mlx_rwkvx",
                "mlx_rwkvx.errors",
                "mlx_rwkvx._crash",
                "mlx_rwkvx._blas",
                "mlx_rwkvx._runtime",
                "mlx_rwkvx._mlx_lm",
                "mlx_rwkvx.settings",
                "mlx_rwkvx.perf",
                "mlx_rwkvx.cli",
            ],
        )
    ],
    [("kernels", ["mlx_rwkvx.metal"])],
    [("ops", ["mlx_rwkvx.ops"])],
    [("models", ["mlx_rwkvx.models"])],
    [("io", ["mlx_rwkvx.io"])],
    [("adapters", ["mlx_rwkvx.adapters"]), ("data", ["mlx_rwkvx.data"])],
    [("generation", ["mlx_rwkvx.generation"])],
    [("evaluation", ["mlx_rwkvx.evaluation"])],
    [
        (
            "inference commands",
            [
                "mlx_rwkvx.api",
                "mlx_rwkvx.info",
                "mlx_rwkvx.bench_here",
                "mlx_rwkvx.convert",
                "mlx_rwkvx.generate",
                "mlx_rwkvx.evaluate",
                "mlx_rwkvx.server",
            ],
        ),
        ("tuner", ["mlx_rwkvx.tuner"]),
    ],
    [
        (
            "training commands",
            ["mlx_rwkvx.train", "mlx_rwkvx.merge", "mlx_rwkvx.pretokenize", "mlx_rwkvx.demo"],
        )
    ],
]
LAZY = {
    "load": "mlx_rwkvx.api",
    "load_model": "mlx_rwkvx.api",
    "save": "mlx_rwkvx.api",
    "configure": "mlx_rwkvx._runtime",
    "generate": "mlx_rwkvx.generation",
    "stream_generate": "mlx_rwkvx.generation",
    "Chat": "mlx_rwkvx.generation",
}


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def group(module: str) -> tuple[int, str]:
    """(the layer's height, the group's name) of ``module``."""
    best, found = -1, None
    for level, groups in enumerate(LAYERS):
        for name, prefixes in groups:
            for prefix in prefixes:
                if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                    best, found = len(prefix), (level, name)
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


def allowed(module: str, imported: str) -> bool:
    """Whether ``module`` may import ``imported``: its own group, or a layer below."""
    (mine, my_group), (theirs, their_group) = group(module), group(imported)
    return theirs < mine or my_group == their_group


def layer_order() -> str:
    """The order as one line, bottom up (the README's Design section carries it)."""
    return " < ".join(" | ".join(name for name, _ in groups) for groups in LAYERS)


def imports(module: str) -> set[str]:
    """The package modules ``module`` imports."""
    out = set()
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("mlx_rwkvx")}
        elif (
            isinstance(node, ast.ImportFrom)
            and node.level == 0
            and (node.module or "").startswith("mlx_rwkvx")
        ):
            for a in node.names:  # a submodule imported by name, else the module itself
                full = f"{node.module}.{a.name}"
                out.add(full if full in MODULES else node.module)
        elif (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "mlx_rwkvx"
            and node.attr in LAZY
        ):
            out.add(LAZY[node.attr])
    return {m for m in out if m != module}


def upward_imports(modules) -> list[str]:
    return [
        f"{m} ({group(m)[1]}) imports {d} ({group(d)[1]})"
        for m in sorted(modules)
        for d in sorted(imports(m))
        if not allowed(m, d)
    ]


def test_every_import_goes_down_or_stays_in_its_group():
    bad = upward_imports(MODULES)
    assert not bad, "\n".join(bad)


def test_inference_never_imports_the_trainer():
    # the rule the layers exist for, checked on an injected import as well
    for module in (
        "mlx_rwkvx.generation.chat",
        "mlx_rwkvx.evaluation.perplexity",
        "mlx_rwkvx.server.app",
        "mlx_rwkvx.generate",
        "mlx_rwkvx.api",
    ):
        assert not allowed(module, "mlx_rwkvx.tuner.trainer"), module
    assert not allowed("mlx_rwkvx.tuner.trainer", "mlx_rwkvx.server.app")
    assert allowed("mlx_rwkvx.tuner.trainer", "mlx_rwkvx.data.loss")
    assert allowed("mlx_rwkvx.generation.chat", "mlx_rwkvx.adapters.apply")
    assert not allowed("mlx_rwkvx.adapters.apply", "mlx_rwkvx.data.loss")


def test_an_injected_generation_to_tuner_import_is_caught(monkeypatch):
    real = imports

    def injected(module):
        extra = {"mlx_rwkvx.tuner.trainer"} if module == "mlx_rwkvx.generation.chat" else set()
        return real(module) | extra

    monkeypatch.setitem(globals(), "imports", injected)
    assert upward_imports(["mlx_rwkvx.generation.chat"]) == [
        "mlx_rwkvx.generation.chat (generation) imports mlx_rwkvx.tuner.trainer (tuner)"
    ]


def test_the_readme_states_this_order():
    readme = (PACKAGE.parent / "README.md").read_text()
    assert f"<!-- layers -->\n{layer_order()}\n<!-- /layers -->" in readme, (
        f"the README's Design section must carry the layer order:\n{layer_order()}"
    )


def test_no_import_cycle():
    graph = {m: {d for d in imports(m) if d in MODULES} for m in MODULES}
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m) :] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


MOST_LINES = 570  # a module longer than this does more than one job: split it along a seam


def test_no_module_is_longer_than_the_limit():
    long = {
        str(path.relative_to(PACKAGE.parent)): count
        for path in sorted(PACKAGE.rglob("*.py"))
        if (count := len(path.read_text().splitlines())) > MOST_LINES
    }
    assert not long, f"modules of more than {MOST_LINES} lines: " + ", ".join(
        f"{name} ({count})" for name, count in long.items()
    )


def test_the_layers_know_every_module():
    for module in MODULES:
        group(module)
    assert {"mlx_rwkvx.tuner.trainer", "mlx_rwkvx.io.targets"} <= set(MODULES)


if __name__ == "__main__":  # python tests/test_package_layers.py: write the order into the README
    import re

    readme = PACKAGE.parent / "README.md"
    text = readme.read_text()
    new = re.sub(
        r"<!-- layers -->\n.*?\n<!-- /layers -->",
        f"<!-- layers -->\n{layer_order()}\n<!-- /layers -->",
        text,
        flags=re.S,
    )
    readme.write_text(new)
    print(layer_order())
