"""How likely a model finds a continuation after a context: the summed log-probability of its
tokens and whether greedy decoding would produce it, the one computation behind LAMBADA and
lm-evaluation-harness's ``loglikelihood``. Texts are batched by length, padded on the right
(every model here is causal: padding after a text changes nothing before it), and the head
runs only where a continuation token is predicted: no ``[tokens, vocab]`` logits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_rwkvx.models import Model

import mlx.core as mx
import numpy as np


@dataclass
class Score:
    """A continuation's summed log-probability (nats), whether each of its tokens is the
    model's most likely one (greedy), and the log-probability of each token."""

    logprob: float
    greedy: bool
    token_logprobs: list[float]


def continuation_scores(
    model: Model,
    requests: Sequence[tuple[Sequence[int], Sequence[int]]],
    *,
    batch_size: int = 8,
    on_done: Callable[[int], None] | None = None,
) -> list[Score]:
    """``Score`` of each ``(context ids, continuation ids)``, in the order given. A context
    must hold at least one token (the first continuation token is predicted from it), a
    continuation at least one. ``on_done(n)`` after each batch of n requests."""
    for i, (context, continuation) in enumerate(requests):
        if not len(context) or not len(continuation):
            raise ValueError(f"request {i}: needs a context and a continuation of >= 1 token")
    order = sorted(range(len(requests)), key=lambda i: -sum(map(len, requests[i])))
    scores: list[Score | None] = [None] * len(requests)
    was_training = model.training
    model.eval()
    try:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            for i, score in zip(chunk, _batch(model, [requests[i] for i in chunk]), strict=True):
                scores[i] = score
            if on_done is not None:
                on_done(len(chunk))
    finally:
        model.train(was_training)
    return scores


def _batch(model: Model, requests) -> list[Score]:
    texts = [list(c) + list(x) for c, x in requests]
    T = max(len(t) for t in texts) - 1  # the last token is predicted, never read
    inputs = np.zeros((len(texts), T), dtype=np.int32)
    rows, cols, targets = [], [], []
    for b, ((context, continuation), text) in enumerate(zip(requests, texts, strict=True)):
        inputs[b, : len(text) - 1] = text[:-1]
        for j, token in enumerate(continuation):
            rows.append(b)
            cols.append(len(context) - 1 + j)  # the position whose output predicts it
            targets.append(token)
    h, _ = model.hidden(mx.array(inputs))
    picked = h[mx.array(rows), mx.array(cols)]  # [targets, C]
    logits = model.head(picked).astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    target = mx.array(targets)
    chosen = mx.take_along_axis(logp, target[:, None], axis=-1)[:, 0]
    best = mx.argmax(logits, axis=-1) == target
    mx.eval(chosen, best)
    chosen, best = np.array(chosen), np.array(best)
    out, at = [], 0
    for _, continuation in requests:
        n = len(continuation)
        part = chosen[at : at + n].astype(np.float64)
        out.append(Score(float(part.sum()), bool(best[at : at + n].all()), part.tolist()))
        at += n
    return out
