"""How the generate section times generation: the first token (ours and mlx-lm's
generate_step), decode, MLX's own one-row matmuls, and a chat's second turn."""

from __future__ import annotations

import time

from benchmarks.common import VerificationFailed, rel_err
from mlx_rwkvx.generation import Chat, ChatFormat, Session, stream_generate
from mlx_rwkvx.perf import best_time

import mlx.core as mx
import mlx.nn as nn
import numpy as np


class AnyIdTokenizer:
    """Every id of a model is one character (``chr(id)``), so that any generated text encodes
    back to its ids; no end of text: generation runs the number of steps asked for."""

    eos_token_ids: set = set()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def verify_generation(ours, theirs, ids) -> float:
    """Our generated steps against the full forward, and our first token's log-probabilities
    against mlx-lm's generate_step: the larger relative error."""
    from mlx_rwkvx._mlx_lm import generate_step

    tokenizer = AnyIdTokenizer(ours.config.vocab_size)
    seq, worst = list(ids), 0.0
    for r in stream_generate(ours, tokenizer, ids, max_tokens=4):
        full = ours(mx.array([seq]))[0, -1].astype(mx.float32)
        worst = max(worst, rel_err(r.logprobs, full - mx.logsumexp(full)))
        seq.append(r.token)
    _, theirs_lp = next(generate_step(mx.array(ids), theirs, max_tokens=1))
    first = next(stream_generate(ours, tokenizer, ids, max_tokens=1))
    worst = max(worst, rel_err(first.logprobs, theirs_lp))
    if not worst <= 1e-4:
        raise VerificationFailed(f"generation logits vs the full forward / mlx-lm {worst:.1e}")
    return worst


def first_token_time(session_factory, ids, repeats: int) -> float:
    """Best time from nothing to the first sampled token of ``ids`` in a fresh session."""

    def run():
        session = session_factory()
        mx.eval(mx.argmax(session.feed(ids), axis=-1))

    return best_time(run, repeats=repeats)


def generate_step_ttft(model, ids, repeats: int) -> float:
    """Best time from nothing to the first token of mlx-lm's ``generate_step`` with ``model``
    (ours, through its mlx-lm caches, or mlx-lm's own): its prefill runs the prompt but its last
    token in pieces (only the caches evaluated: no head), then the last token as a step of its
    own. It starts the next step before it yields: each run waits for that step, untimed, before
    the next one begins."""
    from mlx_rwkvx._mlx_lm import generate_step

    prompt = mx.array(ids)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        t0 = time.perf_counter()
        next(generate_step(prompt, model, max_tokens=1))
        times.append(time.perf_counter() - t0)
        mx.synchronize()
    return min(times[1:])


def decode_tps(model, steps: int, factory=None) -> float:
    """Tokens per second of our generation loop (greedy) after a short prompt, with sessions
    from ``factory`` (default a plain ``Session``)."""
    factory = factory or (lambda: Session(model))
    tokenizer = AnyIdTokenizer(model.config.vocab_size)

    def run():
        for _ in stream_generate(
            model, tokenizer, [1, 2, 3, 4], max_tokens=steps, session=factory()
        ):
            pass

    def prompt_only():
        factory().feed([1, 2, 3, 4])

    return (steps - 1) / (best_time(run, repeats=2) - best_time(prompt_only, repeats=2))


def matvec_tps(model, steps: int) -> dict:
    """One-row matmuls of every Linear weight of ``model`` (what a decode step reads), as
    tokens per second: MLX's ``x @ W.T`` as the layers run it, the same with the weights
    transposed once ([in, out], row-major), and the whole set under ``mx.compile``."""
    weights = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    transposed = [mx.array(np.ascontiguousarray(np.array(w).T)) for w in weights]
    mx.eval(transposed)
    xs = [mx.random.normal((1, w.shape[1])) for w in weights]

    def rows(ws, t):
        return [x @ (w.T if not t else w) for x, w in zip(xs, ws, strict=True)]

    compiled = mx.compile(lambda *ws: rows(ws, False))
    out = {}
    for name, fn in (
        ("x @ W.T", lambda: rows(weights, False)),
        ("x @ W, W transposed once", lambda: rows(transposed, True)),
        ("x @ W.T, compiled", lambda: compiled(*weights)),
    ):

        def run(fn=fn):
            for _ in range(steps):
                mx.eval(fn())

        out[name] = steps / best_time(run, repeats=3)
    return out


def second_turn(model, tokenizer, first_turn: int, new_turn: int, repeats: int) -> dict:
    """Time to the first token of a chat's second turn (first turn ``first_turn`` tokens, an
    answer of 8, then ``new_turn`` tokens), against prefilling the new turn's tokens alone."""

    def render(messages, add_generation_prompt):  # answers rendered as generated
        text = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return text + "assistant:" if add_generation_prompt else text

    rng = np.random.default_rng(5)
    words = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    first, second = words(first_turn), words(new_turn)
    times, fed, reused = [], None, None
    for _ in range(repeats + 1):
        chat = Chat(model, tokenizer, max_tokens=8)
        chat.format = ChatFormat("bench", render, [])
        for _ in chat.ask(first):
            pass
        t0 = time.perf_counter()
        next(chat.ask(second))
        times.append(time.perf_counter() - t0)
        fed, reused = chat.prefilled, chat.reused
    ids = chat.session.tokens[reused : reused + fed]

    def alone_turn():  # the same tokens through the same generation loop, in a fresh session
        next(stream_generate(model, tokenizer, ids, max_tokens=8))

    alone = best_time(alone_turn, repeats=repeats)
    return {
        "second_turn_s": min(times[1:]),
        "alone_s": alone,
        "new_tokens": fed,
        "held_tokens": reused,
    }
