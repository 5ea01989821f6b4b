"""Data parallel over ``mx.distributed`` (ring backend, 2 ranks on localhost through
``mlx.launch``): the same parameters after 3 steps as one process on the combined batch, with
unequal token counts per rank, for SFT and for DPO (each rank its own pairs' reference); the
training CLI under mlx.launch writes once (rank 0) and resumes from rank 0's checkpoint (SFT
killed, DPO stopped by a signal to one rank: every rank stops after the next step)."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import mlx_rwkvx
from mlx_rwkvx.errors import TrainError
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.distributed import peers_lost

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
    cmd = [
        launcher(),
        "--backend",
        "ring",
        "-n",
        "2",
        "--hosts",
        "127.0.0.1",
        "--starting-port",
        str(port),
        "--python",
        sys.executable,
        *map(str, args),
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
    )


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    """distributed_step.py's SFT and DPO runs: 2 ranks, and rank 0 alone on both ranks' data."""
    path = tmp_path_factory.mktemp("steps") / "steps.npz"
    out = launch(HERE / "distributed_step.py", path)
    assert out.returncode == 0, out.stdout + out.stderr
    return np.load(path)


def _parameters(got, kind: str) -> list[str]:
    names = [
        n.removeprefix(f"{kind}/single/") for n in got.files if n.startswith(f"{kind}/single/")
    ]
    assert len(names) == 24
    # lora_b starts at zero: it moved on every rank
    assert all(np.abs(got[f"{kind}/ranks/{n}"]).max() > 0 for n in names if n.endswith("lora_b"))
    return names


def test_two_ranks_equal_one_process_on_the_combined_batch(steps):
    for name in _parameters(steps, "sft"):
        a, b = steps[f"sft/ranks/{name}"], steps[f"sft/single/{name}"]
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b), name


def test_dpo_two_ranks_equal_one_process_on_the_combined_batch(steps):
    """Each rank its pairs and its pairs' reference; gradients, pair counts and the logged
    terms summed over the ranks: the one-process step on all the pairs."""
    # DPO's gradient is the difference of two answers' gradients: where they nearly cancel,
    # float32 rounding (another padding, another sum order) is a larger part of it, and Adam's
    # second and third updates divide by its running size (measured: 5.1e-5 of a tensor at
    # worst; SFT's test holds 1e-5). A missing all-sum is O(1); a count of one rank's pairs
    # instead of all is caught by the logged gradient norm below (Adam hides a scale)
    for name in _parameters(steps, "dpo"):
        a, b = steps[f"dpo/ranks/{name}"], steps[f"dpo/single/{name}"]
        assert np.linalg.norm(a - b) <= 2e-4 * np.linalg.norm(b), name
    # each step's loss, pairs, gradient norm, accuracy, margin, rewards, chosen NLL; the first
    # step's accuracy, margin and rewards left out: policy = reference, so they are rounding's
    ranks, single = steps["dpo/log_ranks"], steps["dpo/log_single"]
    ranks[0, 3:7] = single[0, 3:7]
    np.testing.assert_allclose(ranks, single, rtol=1e-5, atol=1e-6)
    assert (single[:, 1] == 4).all() and single[1:, 3].min() > 0  # both ranks' 2 pairs


def test_a_lost_peer_is_one_line_and_other_errors_are_not():
    """A rank whose peer exited (rank 0's user error, a kill) says so in one line, not MLX's
    traceback; any other RuntimeError (a bug) keeps its traceback."""
    group = SimpleNamespace(rank=lambda: 1)
    with pytest.raises(TrainError, match="rank 1: another rank stopped, and this one with it"):
        with peers_lost(group):
            raise RuntimeError("[ring] connection to a peer was lost")
    with pytest.raises(RuntimeError, match="something else"):
        with peers_lost(group):
            raise RuntimeError("something else")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist")
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")
    facts = [f"{a}+{b}={a + b}" for a in range(1, 6) for b in range(1, 4)]
    (root / "data").mkdir()
    lines = [
        json.dumps({"prompt": f[:4], "completion": f[4:] + " " * (i % 3)})
        for i, f in enumerate(facts)
    ]
    (root / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "prefs").mkdir()
    lines = [
        json.dumps({"prompt": f[:4], "chosen": f[4:], "rejected": f[4:][::-1] + "0"}) for f in facts
    ]
    (root / "prefs" / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def train_args(ws, out, *extra):
    return [
        "-m",
        "mlx_rwkvx.train",
        "--model",
        ws / "base",
        "--data",
        ws / "data",
        "--output",
        out,
        "--iters",
        "4",
        "--batch-size",
        "2",
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--warmup",
        "0",
        "--log-every",
        "1",
        "--save-every",
        "2",
        *extra,
    ]


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x]


def _same_adapter(a, b) -> None:
    a = mlx_rwkvx.io.tensors.read_safetensors(str(a / "adapter_final.safetensors"))[0]
    b = mlx_rwkvx.io.tensors.read_safetensors(str(b / "adapter_final.safetensors"))[0]
    for name, x in a.items():
        ref = np.array(x)
        assert np.linalg.norm(np.array(b[name]) - ref) <= 1e-6 * np.linalg.norm(ref), name


def test_dpo_under_mlx_launch_writes_once_stops_together_and_resumes(workspace, tmp_path):
    def args(out, *extra):
        got = train_args(workspace, out, "--train-mode", "dpo", "--beta", "0.5", *extra)
        got[got.index("--data") + 1] = workspace / "prefs"
        return got

    whole = launch(*args(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "dpo with lora" in whole.stdout and "7 preference pairs a rank, 2 ranks" in whole.stdout
    assert "1 of 15 examples left out" in whole.stderr  # 15 pairs: 7 a rank
    rows = _rows(tmp_path / "whole")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]  # one writer
    assert abs(rows[0]["loss"] - np.log(2)) <= 1e-5 and "accuracy" in rows[0]
    assert (whole.stdout + whole.stderr).count("done: ") == 1
    # SIGTERM reaches rank 1 alone, after step 1's collective: it says so in step 2's, and
    # every rank stops after step 2 (rank 0 saving checkpoint_2); none waits for the others
    signal = {"MLX_RWKVX_CRASH_AT": "step:1:TERM", "MLX_RWKVX_CRASH_RANK": "1"}
    cut = launch(*args(tmp_path / "cut"), timeout=120, env=signal)
    said = cut.stdout + cut.stderr
    assert "saved checkpoint_2" in said and "rank 0 saved its checkpoint" in said, said
    assert [r["step"] for r in _rows(tmp_path / "cut")] == [1, 2]
    resumed = launch(*args(tmp_path / "cut", "--resume"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at step 2" in resumed.stdout
    _same_adapter(tmp_path / "whole", tmp_path / "cut")


def test_training_cli_under_mlx_launch_writes_once_and_resumes(workspace, tmp_path):
    whole = launch(*train_args(workspace, tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout + whole.stderr
    assert "2 ranks (data parallel)" in whole.stdout
    assert [r["step"] for r in _rows(tmp_path / "whole")] == [1, 2, 3, 4]  # one writer
    assert (whole.stdout + whole.stderr).count("done: ") == 1  # and one report
    # killed after step 3 (checkpoint_2 is the newest), resumed: every rank from rank 0's
    cut = launch(*train_args(workspace, tmp_path / "cut"), env={"MLX_RWKVX_CRASH_AT": "step:3"})
    assert "exited with code -9" in cut.stdout + cut.stderr  # mlx.launch itself exits 0
    assert not (tmp_path / "cut" / "adapter_final.safetensors").exists()
    resumed = launch(*train_args(workspace, tmp_path / "cut", "--resume"))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert "resuming at step 2" in resumed.stdout
    _same_adapter(tmp_path / "whole", tmp_path / "cut")
