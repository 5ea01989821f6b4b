"""Packaging: the wheel carries the kernel bodies and the console scripts; the CLIs run."""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

from mlx_rwkvx import info
from mlx_rwkvx.metal import sources

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI_SCRIPTS = (
    "mlx_rwkvx-demo",
    "mlx_rwkvx-info",
    "mlx_rwkvx-convert",
    "mlx_rwkvx-train",
    "mlx_rwkvx-pretokenize",
)


def test_kernel_sources_readable():
    for flavour in sources.FLAVOURS:
        text = sources.prelude(flavour)
        assert "#define BARRIER()" in text
    with pytest.raises(FileNotFoundError, match="no kernel file 'nope.h'"):
        sources.kernel_source("nope.h")
    with pytest.raises(ValueError, match="flavour must be one of"):
        sources.prelude("opencl")


def test_wheel_ships_kernels_and_scripts(tmp_path):
    if (
        shutil.which("pip") is None
        and subprocess.run(
            [sys.executable, "-m", "pip", "--version"], capture_output=True
        ).returncode
    ):
        pytest.skip("pip is not available")
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
        capture_output=True,
    )
    (wheel,) = wheels.glob("mlx_rwkvx-*.whl")
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    py = env_dir / "bin" / "python"
    # No dependencies: reading a kernel body needs nothing but the package itself.
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    code = (
        "import mlx_rwkvx.metal.sources as k, mlx_rwkvx, pathlib\n"
        "assert 'site-packages' in mlx_rwkvx.__file__, mlx_rwkvx.__file__\n"
        "print(k.prelude('metal'))"
    )
    out = subprocess.run(
        [str(py), "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    assert "threadgroup_barrier" in out.stdout
    for script in CLI_SCRIPTS:
        assert (env_dir / "bin" / script).exists(), script


def test_info_report_names_device_and_blas(capsys):
    info.main(["--no-timing"])
    out = capsys.readouterr().out
    for field in ("mlx_rwkvx", "mlx ", "mlx-lm", "device", "blas"):
        assert field in out


def test_bad_cache_limit_is_one_clear_error():
    code = "import mlx_rwkvx; mlx_rwkvx.configure()"
    env = dict(os.environ) | {"MLX_RWKVX_CACHE_LIMIT": "lots"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode != 0
    assert "MLX_RWKVX_CACHE_LIMIT='lots': expected a number of bytes" in out.stderr


def test_info_selfcheck_reports_the_kernels(capsys, monkeypatch):
    # on this CPU: no kernels, said so, and for each op and shape class
    info.main(["--no-timing", "--selfcheck"])
    out = capsys.readouterr().out
    assert "kernels    none on Device(cpu, 0): the ops run their MLX paths" in out
    assert "kernels    wkv7 size 64 bfloat16: not available on this device" in out
    assert out.count(": not available on this device") == 16
    # as on a GPU whose sequential WKV7 kernel is right and whose chunked one (at one length)
    # and MoBA kernel are wrong (stand-ins for them)
    import importlib

    from mlx_rwkvx.ops import mlx_kernels
    from mlx_rwkvx.ops.dispatch import KERNEL

    W = importlib.import_module("mlx_rwkvx.ops.wkv7")
    M = importlib.import_module("mlx_rwkvx.ops.moba")

    def wrong_moba(q, k, v, chunk_size, top_k, scale=None):
        return M.blockwise.attention(q, k, v, chunk_size, top_k, scale) * 1.2  # off in bf16 too

    def wrong_wkv7(*args):
        y, state = W.chunk.chunked(*args)
        return y, state * 0.5

    monkeypatch.setattr(mlx_kernels, "kernel_backend", lambda: "metal")
    wkv7_kernels = {KERNEL: W.chunk.chunked, "chunked_kernel_8": wrong_wkv7}
    for dispatcher, kernels in ((W.DISPATCH, wkv7_kernels), (M.DISPATCH, {KERNEL: wrong_moba})):
        monkeypatch.setattr(dispatcher, "kernels", lambda key=None, k=tuple(kernels): k)
        monkeypatch.setattr(dispatcher, "impls", {**dispatcher.impls, **kernels})
        monkeypatch.setattr(dispatcher, "results", {})
        monkeypatch.setattr(dispatcher, "reasons", {})
    with pytest.warns(RuntimeWarning, match="moba kernel") as caught:
        info.main(["--no-timing", "--selfcheck"])
    assert any("wkv7 kernel chunked_kernel_8 for size 16 float32" in str(w.message) for w in caught)
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("kernels")]
    assert lines[0] == "kernels    metal on Device(cpu, 0)"
    assert len(lines) == 1 + 24  # wkv7's two kernels, moba's one; four head sizes, two dtypes
    assert all(x.endswith(": passed") for x in lines if " wkv7 kernel " in x), lines
    wrong = [x for x in lines if " wkv7 chunked_kernel_8 " in x]
    assert len(wrong) == 8 and all(": FAILED, not used: disagrees" in x for x in wrong), wrong
    failed = ": FAILED, the blockwise path is used: disagrees with the blockwise path"
    assert all(failed in x for x in lines if " moba " in x), lines


def test_info_bench_prints_a_table_to_paste(capsys, monkeypatch):
    import re

    from mlx_rwkvx import bench_here

    # tiny shapes (a step-loop-only length and a longer one) and the tiny model, via the CLI
    tiny = bench_here.Shapes(
        wkv7=((1, 8, 2, 16), (1, 80, 2, 16)),
        moba=((1, 32, 2, 1, 16, 8, 2),),
        lora_batch=1,
        lora_length=16,
        lora_steps=1,
        repeats=1,
        model="rwkv-x-tiny",
        fit=("rwkv-x-tiny", "int8", 16),
        fit_cuts=(2, 4),
    )
    monkeypatch.setattr(bench_here, "shapes_here", lambda: tiny)
    info.main(["--no-timing", "--bench"])
    out = capsys.readouterr().out
    assert "kernels    none on Device(cpu, 0)" in out  # the self-checks and the tuning table
    assert "tuning     off" in out
    lines = [x for x in out.splitlines() if x.startswith("bench      ")]
    assert re.fullmatch(
        r"bench      device Device\(cpu, 0\) \(.*device_name .*\), MLX [\d.]+\S*, "
        r"mlx_rwkvx \S+",
        lines[0],
    ), lines[0]
    ms = r"fwd +\d+\.\d\d ms   fwd\+bwd +\d+\.\d\d ms"
    ops = [x.split()[1:4] for x in lines if re.search(ms + "$", x)]
    assert ops == [
        ["wkv7", "B=1", "T=8"],
        ["wkv7", "B=1", "T=8"],
        ["wkv7", "B=1", "T=80"],
        ["moba", "B=1", "T=32"],
        ["moba", "B=1", "T=32"],
    ]
    impls = [x.split()[-7] for x in lines if re.search(ms + "$", x)]
    assert impls == ["ref", "chunked", "chunked", "ref", "blockwise"]  # no kernel on a CPU
    # one column each: the implementations and the times start at the same place
    timed = [x for x in lines if re.search(ms + "$", x)]
    assert len({x.index(" fwd ") for x in timed}) == 1
    assert len({len(x) for x in timed}) == 1
    assert "rwkv-x-tiny" in lines[-3] and "batch 1 x T=16" in lines[-3]
    assert re.fullmatch(
        r"bench      lora +\d+ tokens/s +\d+\.\d ms/step   peak MLX memory +\d+ MiB   "
        r"max RSS +\d+ MiB",
        lines[-2],
    ), lines[-2]
    # the "which Mac" row: the training command's own peak, cut to 2 and 4 blocks
    one, two, whole = map(float, re.findall(r"([\d.]+) GB", lines[-1]))
    assert lines[-1].startswith("bench      memory rwkv-x-tiny int8 LoRA T=16 --grad-checkpoint")
    assert 0 < one <= two <= whole and lines[-1].endswith(
        "extrapolated to its 6 (README's which-Mac table)"
    )


def test_info_selfcheck_prints_the_tuning_table(capsys, monkeypatch, tmp_path):
    from mlx_rwkvx.ops import tuning, wkv7

    import mlx.core as mx

    info.main(["--no-timing", "--selfcheck"])  # the suite runs with tuning off
    assert (
        "tuning     off (MLX_RWKVX_TUNE=0): each op takes its fixed rule" in capsys.readouterr().out
    )
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    monkeypatch.setenv(tuning.ENV_CACHE, str(tmp_path))
    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())
    info.main(["--no-timing", "--selfcheck"])
    out = capsys.readouterr().out
    assert f"tuning     file {tmp_path / 'tuning.json'} (not written yet)" in out
    assert "tuning     nothing measured yet on this device" in out
    # one wkv7 call measures (a fake measurement: chunked 1 ms, the step loop 2.5 ms); another
    # process's tuner reads the choice and the timings from the file
    tuning.TUNER.measure = lambda thunks: {"chunked": 1e-3, "ref": 2.5e-3}
    wkv7(*(mx.zeros((1, 8, 1, 16)) for _ in range(6)))
    monkeypatch.setattr(tuning, "TUNER", tuning.Tuner())
    info.main(["--no-timing", "--selfcheck"])
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("tuning")]
    assert lines == [
        f"tuning     file {tmp_path / 'tuning.json'}",
        "tuning     wkv7 N=16 float32 T<=8: chunked (chunked 1 ms, ref 2.5 ms)",
    ]
