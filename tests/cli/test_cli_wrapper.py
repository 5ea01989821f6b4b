"""One command wrapper (``mlx_rwkvx.cli.run``): only the project's own errors become one line
and exit 2; anything else, an MLX shape error raised by a bug inside a command among them,
keeps its traceback."""

from __future__ import annotations

import mlx_rwkvx
from mlx_rwkvx import cli
from mlx_rwkvx import convert as convert_cli
from mlx_rwkvx import merge as merge_cli
from mlx_rwkvx import pretokenize as pretokenize_cli
from mlx_rwkvx import train as train_cli
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.io import convert as conversion
from mlx_rwkvx.models import Model
from mlx_rwkvx.tuner import from_config
from mlx_rwkvx.tuner import merge as merging
from mlx_rwkvx.tuner import pretokenize as pretokenizing

import mlx.core as mx
import pytest
from helpers import rwkv7_cfg


def shape_bug(*args, **kwargs):
    """What a bug looks like from MLX: a ValueError about shapes."""
    return mx.zeros((2, 3)) @ mx.zeros((4, 5))


@pytest.fixture()
def model(tmp_path):
    path = tmp_path / "m"
    mlx_rwkvx.save(Model(rwkv7_cfg()), path)
    (tmp_path / "d.jsonl").write_text('{"text": "hello"}\n')
    return path


@pytest.mark.parametrize("command", ["train", "convert", "merge", "pretokenize"])
def test_a_bug_keeps_its_traceback(command, model, tmp_path, monkeypatch):
    data, out = tmp_path / "d.jsonl", tmp_path / "out"
    main, argv = {
        "train": (train_cli.main, ["--model", model, "--data", data, "--output", out]),
        "convert": (convert_cli.main, [model, out]),
        "merge": (merge_cli.main, ["--output", out, model, model]),
        "pretokenize": (
            pretokenize_cli.main,
            ["--tokenizer", "bytes", "--data", data, "--output", tmp_path / "o.bin"],
        ),
    }[command]
    where = {
        "train": (from_config, "build"),
        "convert": (conversion, "read_model"),
        "merge": (merging, "read"),
        "pretokenize": (pretokenizing, "load_examples"),
    }
    monkeypatch.setattr(*where[command], shape_bug)
    with pytest.raises(ValueError, match="matmul|shape") as info:
        main([str(a) for a in argv])
    assert not isinstance(info.value, SystemExit)


def test_a_user_error_is_one_line_and_exit_2(capsys):
    def body():
        raise UsageError("--flag: what is wrong,\n  said on two lines")

    with pytest.raises(SystemExit) as exit_:
        cli.run("mlx_rwkvx.x", body)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert err == "mlx_rwkvx.x: error: --flag: what is wrong, said on two lines\n"
