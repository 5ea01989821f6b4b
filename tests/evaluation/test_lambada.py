"""LAMBADA as RWKV-LM's rwkv_v7_demo.py checks it, on a small stand-in in its format: accuracy
and perplexity equal the demo's loop run in NumPy float64 over the model's full logits (token 0
before the context for World and byte tokenizers, BOS or nothing for others), batched or not;
continuation scores equal the same definition; bad files are one line."""

from __future__ import annotations

import json
import math
import re

import mlx_rwkvx.evaluate as evaluate_cli
from mlx_rwkvx.errors import DataError
from mlx_rwkvx.evaluation.lambada import document_start, lambada, read_lambada
from mlx_rwkvx.evaluation.likelihood import continuation_scores
from mlx_rwkvx.io.tokenizers import ByteTokenizer, HFTokenizer

import mlx.core as mx
import numpy as np
import pytest
from helpers import CliError, chatml_tokenizer, cli, constant, run_module, tiny_model

TEXTS = [
    "the cat sat on the mat and then the cat",
    "one two three four five six seven eight nine ten",
    "hello there general kenobi",
    "a b",
    "it was a dark and stormy night; the rain fell in torrents, except at occasional intervals",
]


def lambada_file(path, texts=TEXTS):
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return path


def demo_loop(model, tokenizer, texts):
    """rwkv_v7_demo.py's LAMBADA loop, in float64 over the full-sequence logits."""
    xsum = xacc = 0.0
    for text in texts:
        context, word = text.rsplit(" ", 1)
        src = document_start(tokenizer) + tokenizer.encode(context)
        dst = tokenizer.encode(" " + word)
        logits = np.array(model(mx.array([src + dst]))[0], dtype=np.float64)
        total, correct = 0.0, True
        for i, token in enumerate(dst):
            row = logits[len(src) - 1 + i]
            logp = row - row.max() - np.log(np.exp(row - row.max()).sum())
            total += logp[token]
            correct &= int(row.argmax()) == token
        xsum += total
        xacc += correct
    return xacc / len(texts), math.exp(-xsum / len(texts))


@pytest.mark.parametrize("family", ["rwkv7", "rwkv-x", "rfa"])
@pytest.mark.parametrize("batch_size", [1, 3])
def test_accuracy_and_perplexity_are_the_demos(tmp_path, family, batch_size):
    model, tokenizer = tiny_model(family, seed=5), ByteTokenizer()
    docs = read_lambada(str(lambada_file(tmp_path / "l.jsonl")))
    result = lambada(model, tokenizer, docs, batch_size=batch_size)
    accuracy, perplexity = demo_loop(model, tokenizer, TEXTS)
    assert result.texts == len(TEXTS) and result.accuracy == accuracy
    assert result.perplexity == pytest.approx(perplexity, rel=1e-5)


def test_greedy_means_every_token_is_the_most_likely():
    """A model that predicts 'b' after anything: continuations of b's are greedy; LAMBADA's
    target ' b' starts with a space it never predicts, so no text is right."""
    model = constant(tiny_model("rwkv7", seed=1), ord("b"))
    tokenizer = ByteTokenizer()
    scores = continuation_scores(model, [([0, ord("a")], [ord("b")]), ([0], [ord("b"), 98])])
    assert [s.greedy for s in scores] == [True, True]
    result = lambada(model, tokenizer, [("a", " b"), ("x", " b")], batch_size=2)
    assert result.accuracy == 0.0  # " b" is two bytes: the space is never the constant's


def test_what_goes_before_the_context(tmp_path):
    assert document_start(ByteTokenizer()) == [0]
    qwen_like = chatml_tokenizer(tmp_path / "q")  # no bos_token: nothing
    assert document_start(qwen_like) == []
    config = json.loads((tmp_path / "q" / "tokenizer_config.json").read_text())
    config["bos_token"] = "<|im_start|>"
    (tmp_path / "q" / "tokenizer_config.json").write_text(json.dumps(config))
    with_bos = HFTokenizer(str(tmp_path / "q"))
    assert document_start(with_bos) == [with_bos._tok.token_to_id("<|im_start|>")]


@pytest.mark.parametrize(
    ("lines", "message"),
    [
        (['{"text": "oneword"}'], "l.jsonl:1: no last word after some context"),
        (['{"text": "two words"}', '{"text": " lead"}'], "l.jsonl:2: no last word"),
        (['{"text": "trailing space "}'], "l.jsonl:1: no last word"),
        (['{"txt": "a b"}'], "l.jsonl:1: expected a JSON object with a 'text'"),
        (["not json"], "l.jsonl:1: expected a JSON object"),
        (['{"text": 3}'], "'text' must be a string"),
        ([], "l.jsonl: no texts"),
    ],
)
def test_bad_lambada_files(tmp_path, lines, message):
    (tmp_path / "l.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=message):
        read_lambada(str(tmp_path / "l.jsonl"))


def test_the_command_runs_the_task(tmp_path):
    import mlx_rwkvx

    mlx_rwkvx.save(tiny_model("rwkv7", seed=2), tmp_path / "m")
    data = lambada_file(tmp_path / "l.jsonl")
    out = run_module(
        "evaluate", "--model", tmp_path / "m", "--tasks", "rwkv_lambada", "--data", data, "--json"
    )
    assert out.returncode == 0, out.stderr
    (record,) = json.loads(out.stdout)["results"]
    model, _ = mlx_rwkvx.load(tmp_path / "m")
    accuracy, perplexity = demo_loop(model, ByteTokenizer(), TEXTS)
    assert record["task"] == "rwkv_lambada" and record["texts"] == len(TEXTS)
    assert record["accuracy"] == accuracy
    assert record["perplexity"] == pytest.approx(perplexity, rel=1e-5)
    table = run_module(
        "evaluate", "--model", tmp_path / "m", "--tasks", "rwkv_lambada", "--data", data
    )
    lines = table.stdout.splitlines()
    assert lines[0] == f"rwkv_lambada ({data}):"
    assert lines[1].split() == ["model", "accuracy", "ppl", "texts"]
    assert lines[2].split()[:2] == [str(tmp_path / "m"), f"{100 * accuracy:.2f}%"]
    for flags, message in (  # in this process: one line each, exit 2
        (["--tasks", "rwkv_lambada"], "--tasks rwkv_lambada reads --data"),
        (["--tasks", "rwkv_lambada", "--data", tmp_path / "missing.jsonl"], "missing.jsonl"),
    ):
        with pytest.raises(CliError, match=re.escape(message)):
            cli(evaluate_cli.main, "--model", tmp_path / "m", *flags)
