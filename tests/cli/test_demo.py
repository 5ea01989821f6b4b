"""``python -m mlx_rwkvx.demo --quick``: every stage runs through the real command-line tools,
the losses fall, the files a user is promised exist, and the printed chat command works."""

import json
import shlex
import subprocess
import sys

import pytest


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    folder = tmp_path_factory.mktemp("demo")
    out = folder / "run"
    proc = subprocess.run(  # a relative --out, as a user gives it
        [sys.executable, "-m", "mlx_rwkvx.demo", "--quick", "--out", "run"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=folder,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return out, proc.stdout, {r["stage"]: r for r in records}


def test_every_stage_ran(demo):
    _, stdout, stages = demo
    assert list(stages) == ["corpus", "pretrain", "split", "mac-1", "mac-2", "merge", "total"]
    for command in (
        "mlx_rwkvx.train --mode pretrain",
        "mlx_rwkvx.pretokenize",
        "--split-weights 3,1",
        "--parallel 2",
        "mlx_rwkvx.merge",
    ):
        assert command in stdout
    assert "| merged exactly |" in stdout and "| merged by FedAvg |" in stdout
    assert "time per stage:" in stdout
    assert stdout.count("(expected ") == 4 * 6  # four prompts after each of the six scorings


def test_losses_fall(demo):
    _, _, stages = demo
    for stage in ("pretrain", "mac-1", "mac-2"):
        assert stages[stage]["last_loss"] < stages[stage]["first_loss"], stage
    assert stages["pretrain"]["last_loss"] < 0.6 * stages["pretrain"]["first_loss"]


def test_files_exist(demo):
    out, _, _ = demo
    for path in (
        "pretrain/model/config.json",
        "pretrain/metrics.jsonl",
        "data/reverse_0.bin",
        "data/reverse_1.bin",
        "data/held_out.jsonl",
        "mac-1/thread_0.safetensors",
        "mac-1/thread_1.safetensors",
        "mac-1/adapter_final.safetensors",
        "mac-2/adapter_final.safetensors",
        "merged/adapter_final.safetensors",
        "merged-fedavg/adapter_final.safetensors",
    ):
        assert (out / path).is_file(), path
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (out / "loss.png").is_file()


def test_printed_chat_command_runs(demo):
    out, stdout, _ = demo
    line = stdout.strip().splitlines()[-1].strip()
    args = shlex.split(line)
    assert args[:3] == ["python", "-m", "mlx_rwkvx.generate"], line
    assert str(out.resolve()) in line  # absolute: it runs from any folder
    proc = subprocess.run(
        [sys.executable, *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=out.parent.parent,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip(), "the model answered nothing"


def test_a_rerun_removes_only_what_the_demo_wrote(demo):
    out, _, _ = demo
    (out / "mynotes.txt").write_text("mine")
    (out / "mylora").mkdir()
    (out / "mylora" / "adapter.safetensors").write_text("my adapter")
    (out / "data" / "stale.jsonl").write_text("{}")  # in the demo's own folder: the demo's
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_rwkvx.demo", "--quick", "--out", "run"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=out.parent,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "mynotes.txt").read_text() == "mine"
    assert (out / "mylora" / "adapter.safetensors").read_text() == "my adapter"
    assert not (out / "data" / "stale.jsonl").exists()
    said = [line for line in proc.stdout.splitlines() if line.startswith("kept ")]
    assert said == [f"kept 2 things of yours in {out.resolve()}: mylora, mynotes.txt"]
    assert (out / "merged" / "adapter_final.safetensors").is_file()
    records = (out / "metrics.jsonl").read_text().splitlines()
    assert len(records) == 7  # this run's stages only: the earlier metrics went with it


def test_a_manifest_names_only_entries_of_its_own_folder(tmp_path):
    from mlx_rwkvx.demo.folder import MARKER, prepare

    (tmp_path / "precious.txt").write_text("mine")
    out = tmp_path / "run"
    out.mkdir()
    (out / "data").mkdir()
    entries = ["../precious.txt", "/etc", "..", ".", "data"]
    (out / MARKER).write_text(json.dumps({"entries": entries}))
    prepare(out)
    assert (tmp_path / "precious.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [MARKER]


def test_refuses_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_rwkvx.demo", "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "the demo did not write" in proc.stderr and len(proc.stderr.splitlines()) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_refuses_a_training_run(tmp_path):
    # a train --output folder also holds metrics.jsonl: the demo must not take it for its own
    run = tmp_path / "my-lora"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (run / "adapter_final.safetensors").write_bytes(b"weights")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_rwkvx.demo", "--quick", "--out", str(run)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert sorted(p.name for p in run.iterdir()) == ["adapter_final.safetensors", "metrics.jsonl"]


def test_refuses_a_file_as_out(tmp_path):
    (tmp_path / "file").write_text("mine")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_rwkvx.demo", "--quick", "--out", str(tmp_path / "file")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "not a folder" in proc.stderr
    assert len(proc.stderr.splitlines()) == 1
    assert (tmp_path / "file").read_text() == "mine"
