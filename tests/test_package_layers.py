"""Imports stay one-way: the package's layers, bottom up (the README's Design section), and no
module importing one of a layer above it, nor two modules importing each other through a
cycle. Imports inside functions count, and so does ``mlx_rwkvx.load`` and the other names the
package root hands out lazily."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_rwkvx"

# bottom up; a module belongs to the first entry its dotted name starts with (longest first)
LAYERS = [
    ("support", ["mlx_rwkvx", "mlx_rwkvx.errors", "mlx_rwkvx._crash", "mlx_rwkvx._blas",
                 "mlx_rwkvx._runtime", "mlx_rwkvx.settings", "mlx_rwkvx.perf"]),
    ("kernels", ["mlx_rwkvx.metal"]),
    ("ops", ["mlx_rwkvx.ops"]),
    ("models", ["mlx_rwkvx.models"]),
    ("io", ["mlx_rwkvx.io"]),
    ("tuner, generation", ["mlx_rwkvx.tuner", "mlx_rwkvx.generation"]),
    ("evaluation", ["mlx_rwkvx.evaluation"]),
    ("commands", ["mlx_rwkvx.api", "mlx_rwkvx.cli", "mlx_rwkvx.info", "mlx_rwkvx.convert",
                  "mlx_rwkvx.train", "mlx_rwkvx.generate", "mlx_rwkvx.merge",
                  "mlx_rwkvx.pretokenize", "mlx_rwkvx.demo", "mlx_rwkvx.evaluate",
                  "mlx_rwkvx.server"]),
]  # fmt: skip
LAZY = {"load": "mlx_rwkvx.api", "load_model": "mlx_rwkvx.api", "save": "mlx_rwkvx.api",
        "configure": "mlx_rwkvx._runtime", "generate": "mlx_rwkvx.generation",
        "stream_generate": "mlx_rwkvx.generation", "Chat": "mlx_rwkvx.generation"}  # fmt: skip


def _name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in PACKAGE.rglob("*.py")}


def layer(module: str) -> int:
    best, found = -1, None
    for level, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), level
    assert found is not None, f"{module} is in no layer: add it to LAYERS"
    return found


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
        elif (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
              and node.value.id == "mlx_rwkvx" and node.attr in LAZY):  # fmt: skip
            out.add(LAZY[node.attr])
    return {m for m in out if m != module}


def test_every_import_goes_down_or_stays_in_its_layer():
    upward = [
        f"{m} ({LAYERS[layer(m)][0]}) imports {d} ({LAYERS[layer(d)][0]})"
        for m in sorted(MODULES)
        for d in sorted(imports(m))
        if layer(d) > layer(m)
    ]
    assert not upward, "\n".join(upward)


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


def test_the_layers_know_every_module():
    for module in MODULES:
        layer(module)
    assert {"mlx_rwkvx.tuner.trainer", "mlx_rwkvx.io.targets"} <= set(MODULES)
