"""Nothing a user has is ever lost: every writer refuses an output that would replace or delete
what is not its own (real commands in subprocesses, a precious file beside every target), one
writer per output (the output lock), and signals, full disks and read-only folders end in one
line with the last good work intact and no temporary files left behind."""

from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import re
import resource
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx_rwkvx
import mlx_rwkvx.generate as generate_cli  # the command (the package's name is the function)
from mlx_rwkvx import merge as merge_cli
from mlx_rwkvx import train as train_cli
from mlx_rwkvx.data.records import read_bin, write_bin
from mlx_rwkvx.errors import TargetError
from mlx_rwkvx.generation import Chat
from mlx_rwkvx.io.targets import (
    LOCK_IN_FOLDER,
    LOCK_PREFIX,
    TMP_PREFIX,
    is_temp,
    output_lock,
    remove_stale,
)
from mlx_rwkvx.models import Model

import mlx.core as mx
import pytest
from helpers import adapter_base, make_adapter, run_module, rwkv7_cfg

PRECIOUS = b"the user's own work, written by hand\n"


def refused(proc: subprocess.CompletedProcess, message: str) -> None:
    """Exit 2 with one line on stderr holding ``message``, and no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and message in lines[0], proc.stderr


def refused_all(cases, **kw) -> None:
    """Each case ``(module, args, message)`` refused as ``refused`` says, two processes at a
    time (a refusal's time is its interpreter's start: two cores start two)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda c: run_module(c[0], *c[1], **kw), cases))
    for (module, args, message), proc in zip(cases, procs, strict=True):
        try:
            refused(proc, message)
        except AssertionError as e:
            raise AssertionError(f"{module} {args}: {e}") from None


# a tqdm bar as a log holds it: ``  50%|#####     | 2/4 [00:01<00:01,  1.5step/s]``, the
# rate in any unit (``step/s``, ``s/step`` when a step is slow, ``?step/s`` at first)
_PROGRESS = re.compile(r"\|\s*\d+/\d+ \[[^\]]*\]\s*\Z")


def is_progress(line: str) -> bool:
    """Whether a line of stderr is a tqdm progress bar's."""
    return _PROGRESS.search(line) is not None


def snapshot(*roots: Path) -> dict[str, bytes | str]:
    out = {}
    for root in roots:
        for path in sorted(Path(root).rglob("*")):
            if path.is_symlink():
                out[str(path)] = f"-> {os.readlink(path)}"
            elif path.is_dir():
                out[str(path)] = "dir"
            else:  # a pipe is not read (it would block): its kind is what matters
                out[str(path)] = path.read_bytes() if path.is_file() else "special"
    return out


def debris(*folders: Path) -> list[str]:
    """Temporary files and lock files left in ``folders`` (and below)."""
    return [
        str(p)
        for f in folders
        for p in Path(f).rglob("*")
        if is_temp(p.name) or p.name.startswith(LOCK_IN_FOLDER)
    ]


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """A model (bytes), two adapters of ``adapter_base()``, a text data file."""
    root = tmp_path_factory.mktemp("kit")
    mlx_rwkvx.save(Model(rwkv7_cfg()), root / "model")
    make_adapter(root / "a.safetensors", noise=1)
    make_adapter(root / "b.safetensors", noise=2)
    mlx_rwkvx.save(adapter_base(), root / "xbase")  # the adapters' base
    lines = [json.dumps({"text": f"{i} + {i} = {2 * i};"}) for i in range(12)]
    (root / "data.jsonl").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture()
def scratch(tmp_path):
    """A folder the commands run in, holding the user's thesis, inside a parent holding more."""
    (tmp_path / "notes.txt").write_bytes(PRECIOUS)
    here = tmp_path / "work"
    here.mkdir()
    (here / "thesis.txt").write_bytes(PRECIOUS)
    return here


# ----- outputs that would delete the user's folders -------------------------------------------


def unsafe_cases(kit):
    a, b, m = kit / "a.safetensors", kit / "b.safetensors", kit / "model"
    empty = "the path is empty"
    train = ["--model", m, "--data", kit / "data.jsonl", "--lora-rank", 4, "--iters", 1]
    return [
        ("merge", ["--output", "", a, b], empty),
        ("merge", ["--output", "", "--fuse-into", kit / "xbase", a], empty),
        ("convert", [m, ""], empty),
        ("convert", [m, "nonexist/.."], "is the current folder"),
        ("merge", ["--output", "nonexist/../..", a, b], "holds the current folder"),
        ("merge", ["--output", ".", a, b, "--overwrite"], "is the current folder"),
        ("merge", ["--output", "./", a, b, "--overwrite"], "is the current folder"),
        ("convert", [m, "..", "--overwrite"], "holds the current folder"),
        ("convert", [m, "/", "--overwrite"], "is the root folder"),
        ("merge", ["--output", "HOME", a, b, "--overwrite"], "is the home folder"),
        (
            "pretokenize",
            ["--tokenizer", "bytes", "--data", kit / "data.jsonl", "--output", "", "--overwrite"],
            empty,
        ),
        ("demo", ["--out", "."], "is the current folder"),
        ("demo", ["--out", ".."], "holds the current folder"),
        # train only adds files, but nine of them into the home or the parent folder is no
        # place for a run either: the same check as every writer's
        ("train", [*train, "--output", "HOME"], "is the home folder"),
        ("train", [*train, "--output", ".."], "holds the current folder"),
        ("train", [*train, "--output", "."], "is the current folder"),
    ]


def test_outputs_that_hold_the_current_folder_are_refused(kit, scratch):
    home = scratch.parent / "home"
    home.mkdir()
    (home / "diary.txt").write_bytes(PRECIOUS)
    before = snapshot(scratch.parent, kit)
    cases = [
        (module, [str(home) if x == "HOME" else x for x in args], message)
        for module, args, message in unsafe_cases(kit)
    ]
    refused_all(cases, cwd=scratch, env={"HOME": str(home)})
    assert snapshot(scratch.parent, kit) == before


def test_the_api_refuses_them_too(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "thesis.txt").write_bytes(PRECIOUS)
    for path in ("", ".", "nonexist/..", tmp_path):
        with pytest.raises(TargetError):
            mlx_rwkvx.save(Model(rwkv7_cfg()), path, overwrite=True)
    assert sorted(os.listdir(tmp_path)) == ["thesis.txt"]


# ----- outputs that are, hold or lie inside an input ------------------------------------------


def test_an_output_never_replaces_or_enters_an_input(kit, tmp_path):
    run_dir = tmp_path / "A_copy"  # a training run: the adapter, a checkpoint, its metrics
    run_dir.mkdir()
    shutil.copy(kit / "a.safetensors", run_dir / "adapter_final.safetensors")
    shutil.copy(kit / "a.safetensors", run_dir / "checkpoint_2.safetensors")
    (run_dir / "metrics.jsonl").write_bytes(PRECIOUS)
    data = tmp_path / "in.jsonl"
    shutil.copy(kit / "data.jsonl", data)
    model = tmp_path / "model"
    shutil.copytree(kit / "model", model)
    cases = [
        (
            "merge",
            ["--output", run_dir, run_dir, kit / "b.safetensors", "--overwrite"],
            "is the input",
        ),
        (
            "merge",
            ["--output", tmp_path, run_dir, kit / "b.safetensors", "--overwrite"],
            "holds the input",
        ),
        (
            "merge",
            ["--output", run_dir / "merged", run_dir, kit / "b.safetensors"],
            "lies inside the input",
        ),
        (
            "pretokenize",
            ["--tokenizer", "bytes", "--data", data, "--output", data, "--overwrite"],
            "is the input",
        ),
        ("convert", [model, model, "--overwrite"], "is the input"),
        ("convert", [model, model / "int8", "--quantize"], "lies inside the input"),
        ("train", ["--model", model, "--data", data, "--output", model], "is the --model"),
        (
            "train",
            ["--model", model, "--data", data, "--output", tmp_path, "--mode", "full"],
            "would write over the --model",
        ),
    ]
    before = snapshot(tmp_path)
    refused_all(cases)
    assert snapshot(tmp_path) == before


def test_overwrite_replaces_only_what_the_command_writes(kit, tmp_path):
    a, b = kit / "a.safetensors", kit / "b.safetensors"
    other_run = tmp_path / "other_run"  # another training run's folder (not an input)
    other_run.mkdir()
    shutil.copy(a, other_run / "adapter_final.safetensors")
    (other_run / "metrics.jsonl").write_bytes(PRECIOUS)
    essay = tmp_path / "essay.safetensors"
    essay.write_bytes(PRECIOUS)
    adapter_as_model = tmp_path / "adapter.safetensors"
    shutil.copy(a, adapter_as_model)
    notes = tmp_path / "notes.bin"
    notes.write_bytes(PRECIOUS)
    cases = [
        (
            "merge",
            ["--output", other_run, a, b, "--overwrite"],
            "replacing it would drop ['metrics.jsonl']",
        ),
        ("merge", ["--output", essay, a, b, "--overwrite"], "is not an adapter file"),
        ("convert", [kit / "model", adapter_as_model, "--overwrite"], "is not a checkpoint"),
        ("convert", [kit / "model", other_run, "--overwrite"], "holds files that are not"),
        (
            "pretokenize",
            [
                "--tokenizer",
                "bytes",
                "--data",
                kit / "data.jsonl",
                "--output",
                notes,
                "--overwrite",
            ],
            "is not a pre-tokenized .bin",
        ),
    ]
    before = snapshot(tmp_path)
    refused_all(cases)
    assert snapshot(tmp_path) == before
    # what the command itself wrote is replaced with --overwrite
    out = tmp_path / "p.bin"
    base = ["--tokenizer", "bytes", "--data", kit / "data.jsonl", "--output", out]
    assert run_module("pretokenize", *base).returncode == 0
    assert run_module("pretokenize", *base, "--max-seq-len", 4, "--overwrite").returncode == 0
    assert max(len(x) for x in read_bin(str(out))) == 5


def test_a_link_at_the_output_is_replaced_itself_never_what_it_points_to(kit, tmp_path):
    shutil.copy(kit / "a.safetensors", tmp_path / "victim.safetensors")
    shutil.copytree(kit / "model", tmp_path / "victim_model")
    write_bin(str(tmp_path / "victim.bin"), [[1, 2, 3]])
    for name, target in (
        ("link.safetensors", "victim.safetensors"),
        ("link_model", "victim_model"),
        ("link.bin", "victim.bin"),
    ):
        (tmp_path / name).symlink_to(target)
    victims = snapshot(*(p for p in tmp_path.iterdir() if p.name.startswith("victim")))
    cases = [
        (
            "merge",
            [
                "--output",
                "link.safetensors",
                kit / "a.safetensors",
                kit / "b.safetensors",
                "--overwrite",
            ],
        ),
        ("convert", [kit / "model", "link_model", "--overwrite"]),  # a folder over a link
        (
            "pretokenize",
            [
                "--tokenizer",
                "bytes",
                "--data",
                kit / "data.jsonl",
                "--output",
                "link.bin",
                "--overwrite",
            ],
        ),
    ]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        procs = list(pool.map(lambda c: run_module(c[0], *c[1], cwd=tmp_path), cases))
    for (module, _), proc in zip(cases, procs, strict=True):
        assert proc.returncode == 0, f"{module}: {proc.stderr}"
    assert snapshot(*(p for p in tmp_path.iterdir() if p.name.startswith("victim"))) == victims
    for name in ("link.safetensors", "link_model", "link.bin"):
        assert not (tmp_path / name).is_symlink(), name
    mlx_rwkvx.load(tmp_path / "link_model")
    assert len(read_bin(str(tmp_path / "link.bin"))) == 12
    assert not debris(tmp_path)


def test_chat_save_replaces_only_a_conversation(kit, tmp_path):
    model, tokenizer = mlx_rwkvx.load(kit / "model")
    chat = Chat(model, tokenizer, max_tokens=2)  # a short answer: the state is what matters
    list(chat.ask("hi"))
    m2 = tmp_path / "m2"
    mlx_rwkvx.save(Model(rwkv7_cfg()), m2 / "model.safetensors")
    essay = tmp_path / "essay.safetensors"
    essay.write_bytes(PRECIOUS)
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    device = tmp_path / "null.safetensors"
    device.symlink_to("/dev/null")
    before = snapshot(tmp_path)
    for path, message in [
        (m2 / "model.safetensors", "is not a saved state"),
        (essay, "is not a saved state"),
        (fifo, "not a regular file"),
        (device, "not a regular file"),
    ]:
        with pytest.raises(ValueError, match=message):
            chat.save(path)
        assert snapshot(tmp_path) == before
    # the chat's /save says so in one line, and the chat goes on
    said = []

    class Screen:
        def say(self, text="", end="\n"):
            said.append(text)

    assert generate_cli._command(chat, f"/save {m2 / 'model'}", Screen())
    assert said and said[-1].startswith("error: ") and "not a saved state" in said[-1]
    assert snapshot(tmp_path) == before
    # a conversation is replaced by the next save
    mine = tmp_path / "mine.safetensors"
    chat.save(mine)
    list(chat.ask("again"))
    chat.save(mine)
    Chat(model, tokenizer).load(mine)
    assert mlx_rwkvx.load(m2 / "model.safetensors")[0] is not None


# ----- one writer per output ------------------------------------------------------------------


def test_a_second_writer_is_refused_while_the_first_holds_the_output(kit, tmp_path):
    a, b = kit / "a.safetensors", kit / "b.safetensors"
    cases = [
        ("merge", tmp_path / "merged", ["--output", tmp_path / "merged", a, b]),
        ("convert", tmp_path / "conv", [kit / "model", tmp_path / "conv"]),
        (
            "pretokenize",
            tmp_path / "d.bin",
            ["--tokenizer", "bytes", "--data", kit / "data.jsonl", "--output", tmp_path / "d.bin"],
        ),
        (
            "train",
            tmp_path / "run",
            ["--model", kit / "model", "--data", kit / "data.jsonl", "--output", tmp_path / "run"],
        ),
        ("demo", tmp_path / "demo", ["--quick", "--out", tmp_path / "demo"]),
    ]
    for module, target, args in cases:
        inside = module == "train"  # a run's folder holds its own lock
        with output_lock(os.path.realpath(target), inside=inside):
            refused(run_module(module, *args), f"process {os.getpid()} is writing it")
            assert target.exists() == inside
        assert not target.exists()
    assert not debris(tmp_path)


def _stopped(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "T"
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_two_train_runs_on_one_output(kit, tmp_path):
    out = tmp_path / "run"
    args = [
        "--model",
        kit / "model",
        "--data",
        kit / "data.jsonl",
        "--output",
        out,
        "--iters",
        4,
        "--save-every",
        2,
        "--lora-rank",
        4,
    ]
    first = subprocess.Popen(
        [sys.executable, "-m", "mlx_rwkvx.train", *map(str, args)],
        env={**os.environ, "MLX_RWKVX_CRASH_AT": "step:2:STOP"},  # it pauses itself there
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while not _stopped(first.pid) and time.time() < deadline and first.poll() is None:
            time.sleep(0.1)
        assert _stopped(first.pid), first.poll()
        second = run_module("train", *args)
        refused(second, f"process {first.pid} is writing it")
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert (out / "adapter_final.safetensors").exists() and not debris(tmp_path)


# ----- signals ---------------------------------------------------------------------------------


def _train_args(kit, out, iters=6):
    return [
        "--model",
        kit / "model",
        "--data",
        kit / "data.jsonl",
        "--output",
        out,
        "--iters",
        iters,
        "--save-every",
        2,
        "--lora-rank",
        4,
        "--batch-size",
        2,
    ]


def _complete(out: Path) -> list[int]:
    return sorted(int(p.stem.split("_")[1]) for p in out.glob("checkpoint_*.json"))


@pytest.mark.parametrize(("crash", "saved"), [("step:3:TERM", 3), ("save:2:TERM", 2)])
def test_sigterm_in_train_saves_like_ctrl_c(kit, tmp_path, crash, saved):
    out = tmp_path / "run"
    proc = run_module("train", *_train_args(kit, out), env={"MLX_RWKVX_CRASH_AT": crash})
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"mlx_rwkvx.train: interrupted (saved checkpoint_{saved})"
    )
    assert _complete(out)[-1] == saved and not debris(tmp_path)
    again = run_module("train", *_train_args(kit, out), "--resume")
    assert again.returncode == 0, again.stderr
    assert (out / "adapter_final.safetensors").exists()


def test_sigterm_within_a_long_carry_state_text_stops_between_windows(kit, tmp_path):
    # one text of ~800 tokens in windows of 16: a step is 50 windows (of a 50 MB line, minutes)
    text = " ".join(f"{i} + {i} = {2 * i};" for i in range(60))
    (tmp_path / "long.jsonl").write_text(json.dumps({"text": text}) + "\n")
    out = tmp_path / "run"
    args = [
        "--model",
        kit / "model",
        "--data",
        tmp_path / "long.jsonl",
        "--output",
        out,
        "--lora-rank",
        4,
        "--carry-state",
        "--max-seq-len",
        16,
        "--batch-size",
        1,
        "--iters",
        3,
        "--save-every",
        100,
    ]
    proc = run_module("train", *args, env={"MLX_RWKVX_CRASH_AT": "window:2.3:TERM"})
    assert proc.returncode == 143, proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "mlx_rwkvx.train: interrupted (saved checkpoint_1; step 2 was cut short between its "
        "windows (--resume redoes it))"
    )
    assert _complete(out) == [1] and not debris(tmp_path)  # step 2's later windows never ran
    again = run_module("train", *args, "--resume")
    assert again.returncode == 0, again.stderr
    assert _complete(out)[-1] == 3 and (out / "adapter_final.safetensors").is_file()


def test_a_kill_while_saving_is_cleaned_up_by_the_next_run(kit, tmp_path):
    out = tmp_path / "run"
    crash = "commit:checkpoint_4.state.safetensors"  # killed between a file's write and rename
    proc = run_module("train", *_train_args(kit, out), env={"MLX_RWKVX_CRASH_AT": crash})
    assert proc.returncode == -signal.SIGKILL
    left = [p.name for p in out.iterdir() if is_temp(p.name)]
    assert left == [
        f"{TMP_PREFIX}{left[0].split('-tmp-')[1].split('.')[0]}.new.checkpoint_4.state.safetensors"
    ], left
    assert _complete(out) == [2] and (out / "checkpoint_4.safetensors").exists()
    again = run_module("train", *_train_args(kit, out), "--resume")
    assert again.returncode == 0, again.stderr
    assert "--resume: skipped checkpoint_4 (no manifest" in again.stderr
    assert not debris(tmp_path) and _complete(out)[-1] == 6


@pytest.mark.parametrize("module", ["convert", "merge"])
def test_signals_in_convert_and_merge(kit, tmp_path, module):
    out = tmp_path / "out"
    if module == "convert":
        args = [kit / "model", out]
    else:
        args = ["--output", out, "--fuse-into", kit / "xbase", kit / "a.safetensors"]
    for sig, code in (("TERM", 143), ("INT", 130)):
        proc = run_module(module, *args, env={"MLX_RWKVX_CRASH_AT": f"commit:out:{sig}"})
        assert proc.returncode == code, proc.stderr
        assert proc.stderr.strip().splitlines() == [
            f"mlx_rwkvx.{module}: interrupted (nothing written)"
        ]
        assert not out.exists() and not debris(tmp_path)
    killed = run_module(module, *args, env={"MLX_RWKVX_CRASH_AT": "commit:out"})
    assert killed.returncode == -signal.SIGKILL
    assert [p.name for p in tmp_path.iterdir() if is_temp(p.name)]  # the half-written folder
    again = run_module(module, *args)
    assert again.returncode == 0, again.stderr
    assert out.is_dir() and not debris(tmp_path)
    mlx_rwkvx.load(out)


def test_sigterm_in_the_demo_stops_it_in_one_line(tmp_path):
    out = tmp_path / "demo"
    proc = run_module("demo", "--quick", "--out", out, env={"MLX_RWKVX_CRASH_AT": "step:2:TERM"})
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mlx_rwkvx.demo: interrupted")
    assert not debris(tmp_path)


# ----- full disks and read-only folders -------------------------------------------------------


def test_a_file_size_limit_in_train_is_one_line(kit, tmp_path):
    out = tmp_path / "run"

    def limit():  # ulimit -f: every file the process writes stops at 64 KB (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))

    args = [
        "--model",
        kit / "model",
        "--data",
        kit / "data.jsonl",
        "--output",
        out,
        "--mode",
        "full",
        "--iters",
        4,
        "--save-every",
        2,
    ]
    command = [sys.executable, "-m", "mlx_rwkvx.train", *map(str, args)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, preexec_fn=limit)
    lines = [x for x in proc.stderr.strip().splitlines() if x.strip() and not is_progress(x)]
    assert proc.returncode == 2, proc.stderr  # (the progress bar's lines aside) one line:
    assert len(lines) == 1 and lines[0].startswith("mlx_rwkvx.train: error: "), proc.stderr
    assert "checkpoint_2.safetensors: cannot write" in lines[0]
    assert "file-size limit" in lines[0] and "no checkpoint was complete yet" in lines[0]
    assert not list(out.glob("checkpoint_*")) and not debris(tmp_path)


def test_a_full_disk_in_train_keeps_the_last_checkpoint(kit, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    real, calls = mx.save_safetensors, []

    def full_disk(file, tensors, metadata=None):
        calls.append(file)
        if "checkpoint_4" in str(file):
            Path(file).write_bytes(b"partial")
            raise RuntimeError("[write] Unable to write 4096 bytes to file.")
        return real(file, tensors, metadata=metadata)

    monkeypatch.setattr(mx, "save_safetensors", full_disk)
    with pytest.raises(SystemExit) as exit_:
        train_cli.main(list(map(str, _train_args(kit, out))))
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2
    assert err[-1].startswith("mlx_rwkvx.train: error: ") and "is the disk full" in err[-1]
    assert "checkpoint_2 is the last complete one, kept" in err[-1]
    assert _complete(out) == [2] and not list(out.glob("checkpoint_4*"))
    assert not debris(tmp_path)
    mlx_rwkvx.load(kit / "model", adapter=out / "checkpoint_2.safetensors")


@pytest.mark.parametrize("code", [errno.EACCES, errno.EROFS])
def test_an_unwritable_output_is_one_line(kit, tmp_path, monkeypatch, capsys, code):
    import mlx_rwkvx.io.targets as targets

    real_open = os.open

    def refuse(path, flags, *a, **k):
        if LOCK_IN_FOLDER in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, flags, *a, **k)

    monkeypatch.setattr(targets.os, "open", refuse)
    for main, args in [
        (train_cli.main, _train_args(kit, tmp_path / "run")),
        (
            merge_cli.main,
            ["--output", tmp_path / "m", kit / "a.safetensors", kit / "b.safetensors"],
        ),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(list(map(str, args)))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1, err
        assert f"cannot write there ({os.strerror(code)})" in err[0]
    assert sorted(os.listdir(tmp_path)) == []


def test_a_full_disk_at_the_lock_leaves_no_lock_file(kit, tmp_path, monkeypatch, capsys):
    import mlx_rwkvx.io.targets as targets
    from mlx_rwkvx import pretokenize as pretokenize_cli

    def full(fd, data):  # the lock file was created; the disk has no block for its pid
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(targets.os, "write", full)
    for main, args in [
        (
            merge_cli.main,
            ["--output", tmp_path / "m.safetensors", kit / "a.safetensors", kit / "b.safetensors"],
        ),
        (
            pretokenize_cli.main,
            ["--tokenizer", "bytes", "--data", kit / "data.jsonl", "--output", tmp_path / "x.bin"],
        ),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main(list(map(str, args)))
        err = capsys.readouterr().err.strip().splitlines()
        assert exit_.value.code == 2 and len(err) == 1, err
        assert "No space left on device" in err[0]
    assert sorted(os.listdir(tmp_path)) == []


def test_write_bin_replaces_only_a_bin(tmp_path):
    path = tmp_path / "x.bin"
    path.write_bytes(PRECIOUS)
    with pytest.raises(ValueError, match="is not a pre-tokenized .bin"):
        write_bin(str(path), [[1, 2, 3]])
    assert path.read_bytes() == PRECIOUS
    path.unlink()
    write_bin(str(path), [[1, 2, 3]])
    write_bin(str(path), [[4, 5]])
    assert [list(x) for x in read_bin(str(path))] == [[4, 5]]


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_stale_temporaries_go_and_a_displaced_folder_comes_back(tmp_path):
    dead = _dead_pid()
    new = tmp_path / f"{TMP_PREFIX}{dead}.new.model"  # a half-written replacement
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"half")
    old = tmp_path / f"{TMP_PREFIX}{dead}.old.model"  # the user's model, renamed away
    old.mkdir()
    (old / "config.json").write_bytes(PRECIOUS)
    live = tmp_path / f"{TMP_PREFIX}{os.getppid()}.new.model"  # a live writer's: kept
    live.write_bytes(b"in progress")
    other = tmp_path / f"{TMP_PREFIX}{dead}.new.other"  # another target's: not this call's
    other.write_bytes(b"half")
    removed = remove_stale(str(tmp_path), "model")
    assert sorted(os.listdir(tmp_path)) == sorted(["model", live.name, other.name]), removed
    assert (tmp_path / "model" / "config.json").read_bytes() == PRECIOUS
    # being deleted is never put back; this process's own pid counts as an earlier run's (a
    # container's pid 1)
    live.unlink()
    (tmp_path / f"{TMP_PREFIX}{dead}.del.other").mkdir()
    (tmp_path / f"{TMP_PREFIX}{os.getpid()}.new.other").write_bytes(b"half")
    remove_stale(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_a_lock_dies_with_its_process(tmp_path):
    target = tmp_path / "out"
    code = (
        "import os, signal, sys\n"
        "from mlx_rwkvx.io.targets import output_lock\n"
        f"with output_lock({str(target)!r}):\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    killed = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert killed.returncode == -signal.SIGKILL
    assert (tmp_path / f"{LOCK_PREFIX}out").exists()  # the file stays; its lock does not
    with output_lock(str(target)):
        again = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
        )
        assert again.returncode == 1 and f"process {os.getpid()} is writing it" in again.stderr
    assert os.listdir(tmp_path) == []  # let go: the lock file removed


def test_a_target_that_appears_while_written_is_left_alone(tmp_path):
    from mlx_rwkvx.io.atomic import CheckpointError, atomic_target

    target = tmp_path / "out"
    with pytest.raises(CheckpointError, match="appeared while it was written"):
        with atomic_target(str(target), folder=True) as tmp:
            (Path(tmp) / "model.safetensors").write_bytes(b"new")
            target.mkdir()  # another program, meanwhile
            (target / "notes.txt").write_bytes(PRECIOUS)
    assert os.listdir(tmp_path) == ["out"]
    assert (target / "notes.txt").read_bytes() == PRECIOUS


def test_convert_overwrite_keeps_what_the_checkpoint_does_not_bring(kit, tmp_path):
    out = tmp_path / "out"
    assert run_module("convert", kit / "model", out).returncode == 0
    backup = out / "my_finetune_backup.safetensors"
    shutil.copy(out / "model.safetensors", backup)
    before = snapshot(tmp_path)
    refused(
        run_module("convert", kit / "model", out, "--overwrite"),
        "replacing it would drop ['my_finetune_backup.safetensors']",
    )
    assert snapshot(tmp_path) == before


def test_train_adds_to_a_folder_but_never_over_files_it_did_not_write(kit, tmp_path):
    here = tmp_path / "project"
    here.mkdir()
    (here / "metrics.jsonl").write_bytes(PRECIOUS)  # the user's own, not a run's
    (tmp_path / "precious.json").write_bytes(PRECIOUS)
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").symlink_to(tmp_path / "precious.json")
    before = snapshot(tmp_path)
    args = ["--model", kit / "model", "--data", kit / "data.jsonl", "--lora-rank", 4]
    refused(
        run_module("train", *args, "--output", here.name, cwd=tmp_path), "holds ['metrics.jsonl']"
    )
    refused(
        run_module("train", *args, "--output", linked), "adapter_config.json is a symbolic link"
    )
    assert snapshot(tmp_path) == before
