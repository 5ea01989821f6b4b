"""The system OpenBLAS is mapped into the process after ``import mlx_rwkvx`` (Linux only), with
the best core type this CPU runs.

Each case runs in a fresh interpreter: whether MLX gets OpenBLAS, and which of its cores, is
decided when it loads, before mlx.core is imported.
"""

import json
import os
import platform
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


# The subprocesses run under the environment as given but for these. OPENBLAS_* stays: some
# machines pin a core on purpose (an older OpenBLAS computes wrong results or crashes on newer
# cores), and mlx_rwkvx keeps a core the user set.
OWN_VARS = ("MLX_RWKVX_BLAS", "MLX_RWKVX_BLAS_CORETYPE", "LD_PRELOAD")
PINNED = os.environ.get(_blas.OPENBLAS_CORETYPE)


def run(code: str, **env) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if k not in OWN_VARS}
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
    # the core the subprocess chose, by its own report (another process may run another)
    out = run(
        "import mlx_rwkvx, mlx.core\nfrom mlx_rwkvx import _blas\n"
        "print(_blas.describe())\nprint(_blas.status.core)"
    )
    described, core = out.stdout.splitlines()
    assert described.startswith("OpenBLAS "), out.stdout
    if core != "None":
        assert f", core {core}" in described
    out = run(
        "import mlx_rwkvx, mlx.core\nfrom mlx_rwkvx import _blas\nprint(_blas.describe())",
        MLX_RWKVX_BLAS="0",
    )
    assert out.stdout.startswith("MLX's bundled reference BLAS")


# Canned /proc/cpuinfo flag sets (the parts that matter).
SSE = {"sse", "sse2", "pni", "ssse3", "sse4_1", "sse4_2"}
SANDY = SSE | {"avx"}
HASWELL = SANDY | {"avx2", "fma", "f16c"}
KNIGHTS_LANDING = HASWELL | {"avx512f", "avx512cd", "avx512er", "avx512pf"}
SKYLAKE_X = HASWELL | {"avx512f", "avx512cd", "avx512bw", "avx512vl", "avx512dq"}
SAPPHIRE_RAPIDS = SKYLAKE_X | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16"}
ZEN4 = SKYLAKE_X | {"avx512_bf16"}


@pytest.mark.parametrize(
    "flags, core",
    [
        (SSE, None),
        (SANDY, "Sandybridge"),
        (HASWELL, "Haswell"),
        (KNIGHTS_LANDING, "Haswell"),
        (SKYLAKE_X, "SkylakeX"),
        (SAPPHIRE_RAPIDS, "SkylakeX"),
        (set(), None),
    ],
)
def test_best_core_from_flags(flags, core):
    assert _blas.best_core(flags) == core


@pytest.mark.parametrize(
    "reported, flags, fix",
    [
        ("Prescott", SAPPHIRE_RAPIDS, "SkylakeX"),
        ("PRESCOTT", SAPPHIRE_RAPIDS, "SkylakeX"),
        ("Nehalem", SKYLAKE_X, "SkylakeX"),
        ("Core2", HASWELL, "Haswell"),
        ("Atom", SANDY, "Sandybridge"),
        ("Sandybridge", SKYLAKE_X, "SkylakeX"),
        ("Haswell", SAPPHIRE_RAPIDS, "SkylakeX"),
        ("SkylakeX", SAPPHIRE_RAPIDS, None),
        ("Cooperlake", SAPPHIRE_RAPIDS, None),
        ("SapphireRapids", SAPPHIRE_RAPIDS, None),
        ("Haswell", KNIGHTS_LANDING, None),
        ("Haswell", HASWELL, None),
        ("SkylakeX", HASWELL, None),
        ("Prescott", SSE, None),
        ("Zen", ZEN4, None),
        ("Excavator", HASWELL, None),
        ("NeoverseN1", SKYLAKE_X, None),
    ],
)
def test_misdetected_core_and_its_fix(reported, flags, fix):
    assert _blas.core_to_fix(reported, flags) == fix


BEST = _blas.best_core(_blas.cpu_flags())
needs_x86_dynamic = pytest.mark.skipif(
    BEST is None
    or platform.machine().lower() not in ("x86_64", "amd64")
    or "DYNAMIC_ARCH" not in (_blas.status.config or ""),
    reason="needs an x86 CPU with AVX and a DYNAMIC_ARCH OpenBLAS",
)
# A core the environment pins is kept: there is no misdetection to fix (and fixing one would
# load a core this machine avoids).
unpinned = pytest.mark.skipif(
    PINNED is not None, reason=f"OPENBLAS_CORETYPE={PINNED} is set: a pinned core is kept"
)

# Runs after mlx_rwkvx chose the core: the core, the note, and an fp32 matmul's error.
REPORT = (
    "import json, os\n"
    "import mlx.core as mx, numpy as np\n"
    "from mlx_rwkvx import _blas\n"
    "rng = np.random.default_rng(0)\n"
    "a = rng.standard_normal((300, 257)).astype(np.float32)\n"
    "b = rng.standard_normal((257, 129)).astype(np.float32)\n"
    "ref = a.astype(np.float64) @ b.astype(np.float64)\n"
    "err = np.linalg.norm(np.array(mx.array(a) @ mx.array(b)) - ref) / np.linalg.norm(ref)\n"
    "print(json.dumps({'core': _blas.running_core(), 'detected': _blas.status.detected_core,\n"
    "    'note': _blas.status.core_note, 'err': float(err),\n"
    "    'env': os.environ.get('OPENBLAS_CORETYPE')}))\n"
)
# OpenBLAS reads OPENBLAS_CORETYPE with getenv(); set there only (not in os.environ), it makes
# OpenBLAS choose Prescott while mlx_rwkvx sees no user setting: a misdetection, as on a CPU
# newer than the OpenBLAS.
MISDETECT = (
    "import ctypes\n"
    "ctypes.CDLL(None).setenv(b'OPENBLAS_CORETYPE', b'Prescott', 1)\n"
    "import mlx_rwkvx\n"
)


def report(code: str, **env) -> dict:
    out = run(code + REPORT, **env)
    assert "BlasWarning" not in out.stderr, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["err"] < 1e-5, result
    return result


@needs_x86_dynamic
@unpinned
def test_misdetected_core_is_reloaded_with_the_best_one():
    result = report(MISDETECT)
    assert result["detected"] == "Prescott"
    assert result["core"] == BEST, result
    assert f"reloaded with OPENBLAS_CORETYPE={BEST}" in result["note"]
    assert result["env"] is None  # the environment is put back


# The user's OPENBLAS_CORETYPE: the one the environment pins, else Prescott (SSE3, which every
# x86-64 CPU runs) set for the test.
USERS_CORE = PINNED or "Prescott"
USERS_ENV = {} if PINNED else {"OPENBLAS_CORETYPE": USERS_CORE}


@needs_x86_dynamic
@pytest.mark.skipif(
    (PINNED or "").lower() == "prescott",
    reason="the environment pins Prescott: no older core to force over it",
)
def test_forced_core_wins_over_openblas_coretype():
    # over a pinned core the test forces Prescott, not a newer core the machine avoids
    forced = BEST if PINNED is None else "Prescott"
    result = report("import mlx_rwkvx\n", MLX_RWKVX_BLAS_CORETYPE=forced, **USERS_ENV)
    assert result["core"] == forced, result
    assert result["env"] == USERS_CORE


@needs_x86_dynamic
def test_users_openblas_coretype_is_respected():
    result = report("import mlx_rwkvx\n", **USERS_ENV)
    assert result["core"].lower() == USERS_CORE.lower(), result
    fix = _blas.core_to_fix(result["core"], _blas.cpu_flags())
    tail = f"(set by the user); this CPU runs {fix}" if fix else "(set by the user)"
    assert result["note"].endswith(tail), result


@needs_x86_dynamic
@unpinned
def test_coretype_0_keeps_openblas_choice():
    result = report(MISDETECT, MLX_RWKVX_BLAS_CORETYPE="0")
    assert result["core"] == "Prescott", result
    assert "MLX_RWKVX_BLAS_CORETYPE=0" in result["note"]


@needs_x86_dynamic
@unpinned
def test_info_names_the_core_and_the_fix():
    out = run(MISDETECT + "from mlx_rwkvx.info import main\nmain(['--no-timing'])\n")
    blas = [ln for ln in out.stdout.splitlines() if ln.startswith("blas")]
    assert blas and f", core {BEST}" in blas[0], out.stdout
    assert f"OpenBLAS chose Prescott, but this CPU runs {BEST}; reloaded" in out.stdout


@needs_x86_dynamic
@unpinned
def test_preloaded_misdetected_core_warns_with_the_fix():
    path = _blas.find_openblas()
    code = (
        "import ctypes\n"
        "libc = ctypes.CDLL(None)\n"
        "libc.setenv(b'OPENBLAS_CORETYPE', b'Prescott', 1)\n"
        f"ctypes.CDLL({path!r}, mode=ctypes.RTLD_GLOBAL)\n"
        "libc.unsetenv(b'OPENBLAS_CORETYPE')\n"
        "import mlx_rwkvx\n"
        "from mlx_rwkvx import _blas\n"
        "print(_blas.running_core())\n"
    )
    out = run(code)
    assert out.stdout.strip() == "Prescott"
    warnings = [ln for ln in out.stderr.splitlines() if "BlasWarning" in ln]
    assert len(warnings) == 1 and f"OPENBLAS_CORETYPE={BEST}" in warnings[0], out.stderr
