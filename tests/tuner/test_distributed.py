"""Data parallel over ``mx.distributed`` (ring backend, 2 ranks on localhost through
``mlx.launch``): the same parameters after 3 steps as one process on the combined batch, with
unequal token counts per rank; the training CLI under mlx.launch writes once (rank 0) and
resumes from rank 0's checkpoint."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx.models import Model, preset

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent


def launcher() -> str:
    beside = Path(sys.executable).parent / "mlx.launch"
    found = str(beside) if beside.exists() else shutil.which("mlx.launch")
    if found is None:
        pytest.skip("mlx.launch is not installed")
    return found


def launch(*args, env=None, timeout=300):
    port = random.randint(20000, 60000)
    cmd = [launcher(), "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1",
           "--starting-port", str(port), "--python", sys.executable, *map(str, args)]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})  # fmt: skip


def test_two_ranks_equal_one_process_on_the_combined_batch(tmp_path):
    out = launch(HERE / "distributed_step.py", tmp_path / "ranks.npz")
    assert out.returncode == 0, out.stdout + out.stderr
    single = subprocess.run([sys.executable, str(HERE / "distributed_step.py"),
                             str(tmp_path / "single.npz"), "--single"],
                            capture_output=True, text=True, timeout=300)  # fmt: skip
    assert single.returncode == 0, single.stderr
    a, b = np.load(tmp_path / "ranks.npz"), np.load(tmp_path / "single.npz")
    assert sorted(a.files) == sorted(b.files) and len(a.files) == 24
    for name in a.files:
        err = np.linalg.norm(a[name] - b[name]) / np.linalg.norm(b[name])
        assert err <= 1e-5, (name, err)
    moved = [n for n in a.files if n.endswith("lora_b")]  # lora_b starts at zero
    assert moved and all(np.abs(a[n]).max() > 0 for n in moved)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")
    facts = [f"{a}+{b}={a + b}" for a in range(1, 6) for b in range(1, 4)]
    (root / "data").mkdir()
    lines = [json.dumps({"prompt": f[:4], "completion": f[4:] + " " * (i % 3)})
             for i, f in enumerate(facts)]  # fmt: skip
    (root / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def train_args(ws, out, *extra):
    return ["-m", "mlx_rwkvx.train", "--model", ws / "base", "--data", ws / "data", "--output",
            out, "--iters", "4", "--batch-size", "2", "--lora-rank", "4", "--lr", "1e-2",
            "--warmup", "0", "--log-every", "1", "--save-every", "2", *extra]  # fmt: skip


def test_training_cli_under_mlx_launch_writes_once_and_resumes(workspace, tmp_path):
    whole = launch(*train_args(workspace, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "2 ranks (data parallel)" in whole.stdout
    rows = [json.loads(x) for x in (tmp_path / "whole" / "metrics.jsonl").read_text().split("\n")
            if x]  # fmt: skip
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer
    assert (whole.stdout + whole.stderr).count("done: ") == 1  # and one report
    # killed after step 3 (checkpoint_2 is the newest), resumed: every rank from rank 0's
    cut = launch(*train_args(workspace, tmp_path / "cut"), env={"MLX_RWKVX_CRASH_AT": "step:3"})
    assert "exited with code -9" in cut.stdout + cut.stderr  # mlx.launch itself exits 0
    assert not (tmp_path / "cut" / "adapter_final.safetensors").exists()
    resumed = launch(*train_args(workspace, tmp_path / "cut", "--resume"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at step 2" in resumed.stdout
    a = mlx_rwkvx.io.tensors.read_safetensors(str(tmp_path / "whole" / "adapter_final.safetensors"))
    b = mlx_rwkvx.io.tensors.read_safetensors(str(tmp_path / "cut" / "adapter_final.safetensors"))
    for name, x in a[0].items():
        ref = np.array(x)
        assert np.linalg.norm(np.array(b[0][name]) - ref) <= 1e-6 * np.linalg.norm(ref), name
