"""LAMBADA as RWKV-LM checks every model (``RWKV-v7/rwkv_v7_demo.py``): each line of a JSONL
file is ``{"text": ...}``; its last word (after the last space) is the target, predicted after
the rest. Accuracy: the share of texts whose target greedy decoding reproduces token for token;
perplexity: exp of minus the mean over texts of the target's summed log-probability.

Before the context goes the token that starts a document in training: 0 for RWKV World and the
byte tokenizer (the end of text that separates documents, as rwkv_v7_demo.py prefixes it), the
tokenizer's BOS for a Hugging Face tokenizer that has one, else nothing. lm-evaluation-harness's
``lambada_openai`` prefixes nothing and scores the same target (its ppl and acc differ by that
token's context)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from mlx_rwkvx.errors import DataError
from mlx_rwkvx.evaluation.likelihood import continuation_scores
from mlx_rwkvx.models import Model

TASK = "rwkv_lambada"


def read_lambada(path: str) -> list[tuple[str, str]]:
    """(context, " " + last word) of every line; DataError naming the line when it is not a
    JSON object with a text that has a last word after some context."""
    docs = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise DataError(f"{path}: cannot read it ({e})") from e
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)["text"]
        except (ValueError, KeyError, TypeError) as e:
            raise DataError(f"{path}:{n}: expected a JSON object with a 'text' ({e})") from e
        if not isinstance(text, str):
            raise DataError(f"{path}:{n}: 'text' must be a string, got {type(text).__name__}")
        context, _, word = text.rpartition(" ")
        if not context.strip() or not word:
            raise DataError(
                f"{path}:{n}: no last word after some context (a text needs a "
                "space before its last word)"
            )
        docs.append((context, " " + word))
    if not docs:
        raise DataError(f"{path}: no texts")
    return docs


def document_start(tokenizer) -> list[int]:
    """What goes before a context (see the module docstring)."""
    if getattr(tokenizer, "name", None) in ("world", "bytes"):
        return [0]
    bos = getattr(tokenizer, "bos_token_id", None)
    return [bos] if isinstance(bos, int) else []


@dataclass
class LambadaResult:
    accuracy: float
    perplexity: float
    texts: int

    def record(self) -> dict:
        return {
            "task": TASK,
            "accuracy": self.accuracy,
            "perplexity": self.perplexity,
            "texts": self.texts,
        }


def lambada(model: Model, tokenizer, docs, *, batch_size: int = 8, on_done=None):
    """``LambadaResult`` of ``model`` on ``docs`` (``read_lambada``)."""
    start = document_start(tokenizer)
    requests = []
    for context, target in docs:
        ids = start + tokenizer.encode(context)
        if not ids:
            raise DataError(
                f"a context encodes to no token and the tokenizer has no BOS: {context!r}"
            )
        requests.append((ids, tokenizer.encode(target)))
    scores = continuation_scores(model, requests, batch_size=batch_size, on_done=on_done)
    total = sum(s.logprob for s in scores)
    mean = -total / len(scores)
    return LambadaResult(
        accuracy=sum(s.greedy for s in scores) / len(scores),
        perplexity=math.exp(mean) if mean < 700 else math.inf,
        texts=len(scores),
    )
