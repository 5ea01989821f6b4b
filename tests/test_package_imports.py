"""Every module of the package imports, in any order, in one process, and then the package's
functions still are the functions: ``mlx_rwkvx.generate`` (a name the command module
``mlx_rwkvx.generate`` takes once imported), ``mlx_rwkvx.stream_generate``, ``mlx_rwkvx.Chat``.
No import warns (a RuntimeWarning is an error here)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "mlx_rwkvx"

CALLS = """
import mlx_rwkvx
from mlx_rwkvx import generate, stream_generate
from mlx_rwkvx.io.tokenizers import ByteTokenizer
from mlx_rwkvx.models import Model, ModelConfig

model = Model(ModelConfig(vocab_size=256, hidden_size=32, head_size=16, block_types=["rwkv7"]))
tok = ByteTokenizer()
text = mlx_rwkvx.generate(model, tok, "hi", max_tokens=3)
assert isinstance(text, str) and generate(model, tok, "hi", max_tokens=3) == text
assert "".join(r.text for r in stream_generate(model, tok, "hi", max_tokens=3)) == text
assert "".join(r.text for r in mlx_rwkvx.Chat(model, tok, max_tokens=3).ask("hi"))
print("ok")
"""


def modules() -> list[str]:
    """Every module and package of mlx_rwkvx, found from its files (nothing imported)."""
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__main__" or "__pycache__" in parts:
            continue
        names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def orders() -> list[list[str]]:
    """Two shuffled orders and each reversed: ``generate`` before ``generation`` and after."""
    found = []
    for seed in (0, 1):
        names = modules()
        random.Random(seed).shuffle(names)
        found += [names, names[::-1]]
    return found


def test_modules_are_found():
    names = modules()
    assert {"mlx_rwkvx", "mlx_rwkvx.generate", "mlx_rwkvx.generation"} <= set(names)
    assert "mlx_rwkvx.models.cache" in names and len(names) > 40


@pytest.mark.parametrize(
    "order", orders(), ids=["seed 0", "seed 0 reversed", "seed 1", "seed 1 reversed"]
)
def test_every_module_imports_in_any_order(order):
    program = "import importlib\n"
    program += "".join(f"importlib.import_module({name!r})\n" for name in order) + CALLS
    out = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c", program],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
