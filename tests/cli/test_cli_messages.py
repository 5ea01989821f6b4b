"""What the commands say when nothing is wrong: ``--help`` without reStructuredText
markup, the demo's errors named as every command's, training's notes (examples cut to
--max-seq-len, the --parallel remainder, a --config setting the --mode ignores), the validation
loss shown once, --resume past a checkpoint cut short, an answer stopped by a full KV cache, the
byte tokenizer written for Hugging Face, and metrics.jsonl as strict JSON.

Every command runs its ``main`` in this process on tiny models made here."""

from __future__ import annotations

import json

import mlx_rwkvx
import mlx_rwkvx.generate as gen_cli  # the command; ``from mlx_rwkvx import`` gives the function
from mlx_rwkvx import convert as convert_cli
from mlx_rwkvx import demo as demo_cli
from mlx_rwkvx import merge as merge_cli
from mlx_rwkvx import pretokenize as pretok_cli
from mlx_rwkvx import train as train_cli
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.outputs import metrics_line

import pytest
from helpers import rwkv7_cfg

COMMANDS = {
    "train": train_cli,
    "generate": gen_cli,
    "merge": merge_cli,
    "convert": convert_cli,
    "pretokenize": pretok_cli,
    "demo": demo_cli,
}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny RWKV-7 (the byte tokenizer) in the native format."""
    path = tmp_path_factory.mktemp("cli") / "base"
    mlx_rwkvx.save(Model(rwkv7_cfg()), path)
    return path


def data_folder(path, texts, valid=None):
    """An mlx-lm data folder of text records (and a valid split of ``valid``)."""
    path.mkdir()
    for split, rows in (("train", texts), ("valid", valid)):
        if rows is not None:
            lines = "".join(json.dumps({"text": t}) + "\n" for t in rows)
            (path / f"{split}.jsonl").write_text(lines)
    return path


def train(base, data, out, *flags):
    """A short LoRA run (stops the test with its stderr if the command exits)."""
    argv = [
        "--model",
        base,
        "--data",
        data,
        "--output",
        out,
        "--lora-rank",
        4,
        "--batch-size",
        1,
        "--lr",
        1e-3,
        "--log-every",
        1,
        *flags,
    ]
    train_cli.main([str(a) for a in argv])


def lines_with(text: str, part: str) -> list[str]:
    return [line for line in text.splitlines() if part in line]


# ----- help and errors ----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_help_shows_no_rst_markup(name, capsys):
    with pytest.raises(SystemExit) as e:
        COMMANDS[name].main(["--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage:" in out, out
    assert "``" not in out, [line for line in out.splitlines() if "``" in line]


@pytest.mark.parametrize("kind", ["a file", "a folder the demo did not write"])
def test_demo_errors_start_with_its_name(tmp_path, capsys, kind):
    out = tmp_path / "out"
    if kind == "a file":
        out.write_text("mine")
    else:
        out.mkdir()
        (out / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit) as e:
        demo_cli.main(["--out", str(out), "--quick"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("mlx_rwkvx.demo: error: --out"), lines


# ----- training ------------------------------------------------------------------------------


def test_validation_at_the_last_step_is_shown_once(base, tmp_path, capsys):
    data = data_folder(tmp_path / "data", ["hello world", "a small text"], valid=["hello"])
    train(base, data, tmp_path / "run", "--iters", 2, "--val-every", 2)
    out = capsys.readouterr().out
    assert len(lines_with(out, "validation loss")) == 1, out


def test_examples_cut_to_max_seq_len_are_one_note(base, tmp_path, capsys):
    long = "a text much longer than eight bytes"  # 35 bytes and the end-of-text token
    data = data_folder(tmp_path / "data", ["hi", long, "yo"])
    train(base, data, tmp_path / "run", "--iters", 2, "--max-seq-len", 8)
    captured = capsys.readouterr()
    notes = lines_with(captured.err, "longer than --max-seq-len")
    assert len(notes) == 1, captured.err
    assert notes[0].startswith(
        "note: 1 of 3 examples are longer than --max-seq-len 8 and were cut to 9 tokens (the "
        "longest had 36)"
    ), notes
    assert "done: " in captured.out


def test_the_parallel_remainder_is_a_note(base, tmp_path, capsys):
    data = data_folder(tmp_path / "data", [f"text number {i}" for i in range(5)])
    train(base, data, tmp_path / "run", "--iters", 1, "--parallel", 2)
    captured = capsys.readouterr()
    notes = lines_with(captured.err, "--parallel 2:")
    assert len(notes) == 1 and notes[0].startswith(
        "note: --parallel 2: 1 of 5 examples left out"
    ), captured.err
    assert "done: " in captured.out


@pytest.mark.parametrize("rank", ["lora_parameters: {rank: 8}", "lora_rank: 8"])
def test_a_config_setting_the_mode_ignores_is_a_note(tmp_path, capsys, rank):
    config = tmp_path / "run.yaml"
    config.write_text(f"mode: state\n{rank}\n")
    cfg = train_cli.read_settings(["--config", str(config)])
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["note: --config: lora_rank does not apply to --mode state: ignored"], err
    assert cfg.mode == "state" and cfg.lora_rank == 32  # the default: the file's was dropped
    cfg.resolved()  # and the run goes ahead


def test_resume_skips_a_checkpoint_without_its_manifest(base, tmp_path, capsys):
    data = data_folder(tmp_path / "data", ["hello world", "a small text"])
    out = tmp_path / "run"
    train(base, data, out, "--iters", 4, "--save-every", 2)
    (out / "checkpoint_4.json").unlink()  # as if the run stopped while saving checkpoint_4
    capsys.readouterr()
    train(base, data, out, "--iters", 4, "--save-every", 2, "--resume")
    captured = capsys.readouterr()
    skipped = lines_with(captured.err, "--resume:")
    assert skipped == [
        "--resume: skipped checkpoint_4 (no manifest: the run stopped while saving it); "
        "resuming from checkpoint_2"
    ], captured.err
    assert "done: " in captured.out and (out / "checkpoint_4.json").is_file()


def test_metrics_lines_are_strict_json():
    line = metrics_line({"step": 1, "val_loss": float("nan")})

    def refuse(constant):
        raise ValueError(f"not strict JSON: {constant}")

    assert json.loads(line, parse_constant=refuse) == {"step": 1, "val_loss": None}
    assert line.endswith("\n") and line.count("\n") == 1


# ----- generation and conversion ---------------------------------------------------------------


def test_an_answer_stopped_by_a_full_kv_cache_says_so(tmp_path, capsys):
    # --max-cache 16 on an RWKV-X model (MoBA chunks of 8): the 5-token prompt fits, the
    # answer fills the cache, and --no-window stops it there
    model = tmp_path / "rwkv-x"
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny")), model)
    gen_cli.main(
        [
            "--model",
            str(model),
            "--prompt",
            "hello",
            "--no-window",
            "--max-cache",
            "16",
            "--max-tokens",
            "100",
            "--ignore-chat-template",
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1:] == [
        "[stopped: the attention blocks' KV cache is full (--max-cache 16) and --no-window "
        "keeps no sliding window]"
    ], err


@pytest.fixture(scope="module")
def hf_folder(base, tmp_path_factory):
    """The tiny byte-tokenizer model converted --to hf."""
    out = tmp_path_factory.mktemp("hf") / "hf"
    convert_cli.main([str(base), str(out), "--to", "hf"])
    return out


def test_convert_to_hf_writes_the_byte_tokenizer(hf_folder):
    assert (hf_folder / "tokenizer.json").is_file()
    assert (hf_folder / "tokenizer_config.json").is_file()
    _, tok = mlx_rwkvx.load(hf_folder)
    text = "héllo\x00 wörld"
    assert tok.encode(text) == list(text.encode())
    assert tok.eos_token_ids == {0}


def test_transformers_reads_the_byte_tokenizer(hf_folder):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(hf_folder))
    assert tok.encode("héllo") == list("héllo".encode())
    assert tok.decode(list("héllo".encode())) == "héllo"
