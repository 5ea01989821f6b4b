"""The system OpenBLAS is mapped into the process after ``import mlx_rwkvx`` (Linux only).

Each case runs in a fresh interpreter: whether MLX gets OpenBLAS depends on import order.
"""

import os
import subprocess
import sys

from mlx_rwkvx import _blas

import pytest

pytestmark = [
    pytest.mark.skipif(
        not sys.platform.startswith("linux"), reason="OpenBLAS preload is Linux-only"
    ),
    pytest.mark.skipif(
        _blas.find_openblas() is None,
        reason="no system OpenBLAS installed (apt install libopenblas0-pthread)",
    ),
]

MAPPED = (
    "import os\n"
    "maps = open('/proc/self/maps').read().splitlines()\n"
    "libs = {l.split()[-1] for l in maps if '/' in l}\n"
    "print(any(os.path.basename(p).startswith('libopenblas') for p in libs))\n"
)


def run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in ("MLX_RWKVX_BLAS", "LD_PRELOAD")}
    full_env.update(env)
    return subprocess.run(
        [sys.executable, "-c", code], env=full_env, capture_output=True, text=True, check=True
    )


def test_openblas_mapped_after_import():
    out = run("import mlx_rwkvx, mlx.core\n" + MAPPED)
    assert out.stdout.strip() == "True", out.stderr
    assert "BlasWarning" not in out.stderr


def test_switched_off_by_env():
    out = run("import mlx_rwkvx, mlx.core\n" + MAPPED, MLX_RWKVX_BLAS="0")
    assert out.stdout.strip() == "False", out.stderr
    assert "BlasWarning" not in out.stderr


def test_explicit_path_is_loaded():
    path = _blas.find_openblas()
    out = run(
        "import mlx_rwkvx\nfrom mlx_rwkvx import _blas\nprint(_blas.status.loaded)",
        MLX_RWKVX_BLAS=path,
    )
    assert out.stdout.strip() == path


def test_bad_path_warns_once_and_runs():
    out = run("import mlx_rwkvx, mlx.core\n" + MAPPED, MLX_RWKVX_BLAS="/nonexistent/libx.so")
    assert out.stdout.strip() == "False"
    warnings = [ln for ln in out.stderr.splitlines() if "BlasWarning" in ln]
    assert len(warnings) == 1 and "/nonexistent/libx.so" in warnings[0], out.stderr


def test_warning_when_mlx_imported_first():
    out = run("import mlx.core\nimport mlx_rwkvx\n" + MAPPED)
    assert out.stdout.strip() == "False"
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, out.stderr
    assert "slow built-in BLAS" in lines[0] and "LD_PRELOAD=" in lines[0]


def test_describe_names_the_blas_in_use():
    out = run("import mlx_rwkvx, mlx.core\nfrom mlx_rwkvx import _blas\nprint(_blas.describe())")
    assert out.stdout.startswith("OpenBLAS (")
    out = run(
        "import mlx_rwkvx, mlx.core\nfrom mlx_rwkvx import _blas\nprint(_blas.describe())",
        MLX_RWKVX_BLAS="0",
    )
    assert out.stdout.startswith("MLX's bundled reference BLAS")
