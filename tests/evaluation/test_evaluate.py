"""``python -m mlx_rwkvx.evaluate``: the loss, perplexity and bits per byte of a data set, equal
to their definitions computed in NumPy float64 from the model's own logits, equal to the
trainer's validation loss for the same settings, the same over windows with the state carried
as in one pass (RWKV-7), and side by side for models and adapters."""

from __future__ import annotations

import json
import math
import signal

import mlx_rwkvx
import mlx_rwkvx.evaluate as evaluate_cli
from mlx_rwkvx.evaluation import eval_examples, evaluate_loss
from mlx_rwkvx.io.tokenizers import ByteTokenizer
from mlx_rwkvx.models import Model

import mlx.core as mx
import numpy as np
import pytest
from helpers import CliError, cli, run_module, rwkv7_cfg, tiny_model

TEXTS = [
    "The cat sat on the mat. " * 6,
    "héllo wörld, ✓ done",
    "a",  # one token, its end of text the only target
    "Numbers: 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25",
]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def reference(model, tokenizer, texts):
    """(summed loss in nats, tokens, UTF-8 bytes of the targets) by the definition, in float64:
    each text whole with its end of text, every token after the first a target, the log-
    probabilities from the model's full-sequence logits."""
    loss = tokens = nbytes = 0
    for text in texts:
        ids = tokenizer.encode(text) + [0]  # the byte tokenizer's end of text
        logits = np.array(model(mx.array([ids[:-1]]))[0], dtype=np.float64)
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        targets = ids[1:]
        loss -= logp[np.arange(len(targets)), targets].sum()
        tokens += len(targets)
        nbytes += len(tokenizer.decode_bytes([t for t in targets if t != 0]))
    return loss, tokens, nbytes


@pytest.mark.parametrize("family", ["rwkv7", "rwkv-x", "rfa"])
def test_loss_perplexity_and_bits_per_byte_are_their_definitions(tmp_path, family):
    model, tokenizer = tiny_model(family, seed=3), ByteTokenizer()
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    examples, _ = eval_examples(str(data), tokenizer, 256, max_seq_len=512, carry_state=True)
    result, _ = evaluate_loss(model, tokenizer, examples, batch_size=2, max_seq_len=512)
    loss, tokens, nbytes = reference(model, tokenizer, TEXTS)
    assert (result.tokens, result.bytes) == (tokens, nbytes)
    assert result.mean == pytest.approx(loss / tokens, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(loss / tokens), rel=1e-5)
    assert result.bits_per_byte == pytest.approx(loss / math.log(2) / nbytes, rel=1e-5)


def test_windows_with_the_state_carried_are_one_pass(tmp_path):
    """RWKV-7: a long text in windows of 16 tokens, the state carried, has the loss of one pass
    over it (and of the NumPy definition); cut without the state, it differs."""
    model, tokenizer = tiny_model("rwkv7", seed=1), ByteTokenizer()
    text = "".join(f"line {i}: the quick brown fox. " for i in range(12))  # ~380 bytes
    (tmp_path / "t.txt").write_text(text)
    path = str(tmp_path / "t.txt")

    def loss(window, carry=True):
        examples, _ = eval_examples(path, tokenizer, 256, max_seq_len=window, carry_state=carry)
        return evaluate_loss(
            model, tokenizer, examples, batch_size=1, max_seq_len=window, carry_state=carry
        )[0]

    whole, windows = loss(1024), loss(16)
    ids = tokenizer.encode(text)
    logits = np.array(model(mx.array([ids[:-1]]))[0], dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    expected = -logp[np.arange(len(ids) - 1), ids[1:]].mean()
    assert whole.tokens == windows.tokens == len(ids) - 1  # a text file has no end of text
    assert windows.mean == pytest.approx(whole.mean, rel=1e-5)
    assert whole.mean == pytest.approx(expected, rel=1e-5)
    cut = loss(16, carry=False)
    assert cut.tokens == 16 and cut.mean != pytest.approx(whole.mean, rel=1e-3)


def test_the_trainers_validation_loss_is_evaluates(tmp_path):
    """One definition: the validation loss a run logs at its end equals evaluate's on the
    adapter it wrote, for the same data and settings (also with --carry-state)."""
    mlx_rwkvx.save(Model(rwkv7_cfg(hidden_size=64), seed=2), tmp_path / "base")
    data = tmp_path / "data"
    data.mkdir()
    write_jsonl(data / "train.jsonl", [{"text": t} for t in TEXTS * 2])
    write_jsonl(data / "valid.jsonl", [{"text": t * 3} for t in TEXTS])
    for flags in ([], ["--carry-state", "--max-cache", "64"]):
        out = tmp_path / f"run{len(flags)}"
        train = run_module(
            "train",
            "--model",
            tmp_path / "base",
            "--data",
            data,
            "--output",
            out,
            "--iters",
            3,
            "--batch-size",
            2,
            "--max-seq-len",
            32,
            "--learning-rate",
            1e-2,
            *flags,
        )
        assert train.returncode == 0, train.stderr
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        logged = [r["val_loss"] for r in rows if "val_loss" in r][-1]
        carry = [] if flags else ["--no-carry-state"]
        ev = run_module(
            "evaluate",
            "--model",
            tmp_path / "base",
            "--adapter",
            out,
            "--data",
            data,
            "--split",
            "valid",
            "--batch-size",
            2,
            "--max-seq-len",
            32,
            *carry,
            *flags[1:],
            "--json",
        )
        assert ev.returncode == 0, ev.stderr
        results = json.loads(ev.stdout)["results"]
        assert results[1]["adapter"] == str(out)
        assert results[1]["loss"] == pytest.approx(logged, rel=1e-6), flags
        assert results[0]["loss"] != pytest.approx(logged, rel=1e-4)  # the base is another model


def test_models_and_adapters_side_by_side(tmp_path):
    """Two models, an adapter of the second: the adapter is evaluated on its own base (found by
    its fingerprint), the table has a row each; an adapter of neither is refused."""
    for name, seed in (("a", 1), ("b", 2)):
        mlx_rwkvx.save(Model(rwkv7_cfg(hidden_size=64), seed=seed), tmp_path / name)
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS])
    out = tmp_path / "lora"
    train = run_module(
        "train",
        "--model",
        tmp_path / "b",
        "--data",
        data,
        "--output",
        out,
        "--iters",
        2,
        "--learning-rate",
        1e-2,
    )
    assert train.returncode == 0, train.stderr
    ev = run_module(
        "evaluate",
        "--model",
        tmp_path / "a",
        "--model",
        tmp_path / "b",
        "--adapter",
        out,
        "--data",
        data,
    )
    assert ev.returncode == 0, ev.stderr
    lines = ev.stdout.splitlines()
    assert lines[0] == f"{data}:" and lines[1].split() == [
        "model",
        "loss",
        "ppl",
        "bits/byte",
        "tokens",
        "tok/s",
    ]
    assert [line.split()[0] for line in lines[2:]] == [str(tmp_path / n) for n in "abb"]
    assert f"{tmp_path / 'b'} + {out}" in lines[4]
    refused = run_module("evaluate", "--model", tmp_path / "a", "--adapter", out, "--data", data)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.strip().splitlines() == [
        f"mlx_rwkvx.evaluate: error: {out}: the adapter was trained on another base model than "
        f"the model given (its base's fingerprint {json.loads((out / 'adapter_config.json').read_text())['base_fingerprint']})"  # noqa: E501
    ]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda t: write_jsonl(t / "e.jsonl", []), "e.jsonl: no examples"),
        (lambda t: (t / "s.txt").write_text("x") and t / "s.txt", "shorter than two tokens"),
        (lambda t: (t / "folder").mkdir() or t / "folder", "no test.jsonl, valid.jsonl"),
        (lambda t: t / "missing.jsonl", "missing.jsonl"),
    ],
    ids=["empty", "one token", "folder without a split", "missing"],
)
def test_bad_data_is_one_line(tmp_path, make, message):
    mlx_rwkvx.save(Model(rwkv7_cfg(hidden_size=64), seed=1), tmp_path / "m")
    with pytest.raises(CliError) as e:  # in this process: one line, exit 2, nothing printed
        cli(evaluate_cli.main, "--model", tmp_path / "m", "--data", make(tmp_path))
    assert str(e.value).startswith("mlx_rwkvx.evaluate: error: ") and message in str(e.value)


@pytest.mark.parametrize("sig", ["INT", "TERM"])
def test_ctrl_c_prints_the_result_so_far(tmp_path, sig):
    """Ctrl-C or SIGTERM mid-evaluation: the result so far, then the signal's exit code."""
    mlx_rwkvx.save(Model(rwkv7_cfg(hidden_size=64), seed=1), tmp_path / "m")
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in TEXTS * 5])
    out = run_module(
        "evaluate",
        "--model",
        tmp_path / "m",
        "--data",
        data,
        "--json",
        env={"MLX_RWKVX_CRASH_AT": f"eval:3:{sig}"},
    )
    assert out.returncode == 128 + getattr(signal, f"SIG{sig}"), out.stderr
    record = json.loads(out.stdout)["results"][0]
    assert record["complete"] is False and record["tokens"] > 0
    assert out.stderr.strip().endswith("interrupted (the result so far is above)")


def test_chat_jsonl_and_sqlite_give_the_same_loss_on_the_assistant_turns(tmp_path):
    """The same conversations as chat JSONL and as a SQLite database (--sql, as train takes
    it): one loss, over the assistant turns only, its bytes those turns' text."""
    import sqlite3

    mlx_rwkvx.save(Model(rwkv7_cfg(hidden_size=64), seed=3), tmp_path / "m")
    talks = {
        "a": [("user", "Hi there"), ("assistant", "Hello, héllo")],
        "b": [
            ("user", "2+2?"),
            ("assistant", "4"),
            ("user", "and 3+3?"),
            ("assistant", "6, of course"),
        ],
    }
    records = [
        {"messages": [{"role": r, "content": c} for r, c in turns]} for turns in talks.values()
    ]
    write_jsonl(tmp_path / "chats.jsonl", records)
    con = sqlite3.connect(tmp_path / "chats.db")
    con.execute("CREATE TABLE m (id INTEGER, conv TEXT, role TEXT, content TEXT)")
    rows = [
        (i, conv, r, c)
        for i, (conv, r, c) in enumerate(
            (conv, r, c) for conv, turns in talks.items() for r, c in turns
        )
    ]
    con.executemany("INSERT INTO m VALUES (?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    results = []
    for flags in (
        ["--data", tmp_path / "chats.jsonl"],
        ["--data", tmp_path / "chats.db", "--sql", "SELECT conv, role, content FROM m ORDER BY id"],
    ):
        out = run_module("evaluate", "--model", tmp_path / "m", *flags, "--json")
        assert out.returncode == 0, out.stderr
        results.append(json.loads(out.stdout)["results"][0])
    a, b = results
    assert (a["tokens"], a["bytes"]) == (b["tokens"], b["bytes"])
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-6)
    # the targets: each assistant turn's text after "Assistant:" and its "\n\n" (RWKV's format)
    answers = [c for turns in talks.values() for r, c in turns if r == "assistant"]
    assert a["bytes"] == sum(len((" " + c + "\n\n").encode()) for c in answers)
