"""One answer's work, apart from the batch: its settings (``Params``), its logits processors
and sampler, the log-probabilities it reports, where it resumes from in its model's cache of
states (``resume``); an answer run alone through the generation layer (``generate``: one the
batches cannot hold whole), and a request's embeddings (``Embedding``, a piece at a time).
``served``, ``job`` and ``engine`` arguments are a ``served.Served``, a ``jobs.Job`` and the
``engine.Engine`` (not imported here: jobs.py and the engine import this module)."""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_rwkvx._mlx_lm import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)
from mlx_rwkvx.generation import Session, stream_generate
from mlx_rwkvx.server.protocol import ApiError

import mlx.core as mx

log = logging.getLogger("mlx_rwkvx.server")


@dataclass
class Params:
    """One answer's settings, checked (the handlers turn a request into these)."""

    max_tokens: int
    temp: float = 0.0
    top_p: float = 0.0
    min_p: float = 0.0
    top_k: int = 0
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: int | None = None  # None: none; k: the chosen token's and the top k
    grammar: str | None = None  # llguidance's grammar the answer keeps to (response_format)
    scope: str = ""  # whose stored states it resumes from and adds to (its API key's)


def resume(served, ids: list[int], scope: str) -> tuple[int, dict | None]:
    """The longest prefix of ``ids`` stored in ``scope`` and its entry: the whole prompt only
    where its logits were stored too (else the last token is fed again, for them)."""
    cached, entry = served.cache.get(ids, scope=scope)
    if entry is not None and cached == len(ids) and "logits" not in entry:
        cached, entry = served.cache.get(ids[:-1], scope=scope)
    return cached, entry


def processors(params: Params, served) -> list:
    """mlx-lm's logits processors of the request, and its grammar's mask last."""
    out = make_logits_processors(
        logit_bias=params.logit_bias or None,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty or None,
        frequency_penalty=params.frequency_penalty or None,
    )
    if params.grammar is not None:
        from mlx_rwkvx.server.schema import GrammarProcessor

        vocab = served.model.config.vocab_size
        out.append(GrammarProcessor(served.token_table(), params.grammar, vocab))
    return out


def sampler(params: Params):
    """The answer's sampler: greedy, or drawing from a key of its own (its seed's, else a
    random one), so that the answer is the same whatever shares its batch, and no draw
    depends on ``mx.random.state``. mlx-lm's filters take that state as a compiled input and
    leave it unusable when they raise (then every later draw fails): a failure here resets
    it."""
    if params.temp == 0:
        return make_sampler(temp=0.0)
    seed = secrets.randbits(63) if params.seed is None else params.seed
    position = _Position()

    def sample(logprobs: mx.array) -> mx.array:
        try:
            draw = mx.random.key((seed + position.n * _GOLDEN) % 2**63)
            if 0 < params.top_p < 1:
                logprobs = apply_top_p(logprobs, params.top_p)
            if params.min_p:
                logprobs = apply_min_p(logprobs, params.min_p, 1)
            if params.top_k > 0:
                logprobs = apply_top_k(logprobs, params.top_k)
            # the Gumbel-max draw (exact for the softmax): only two tokens whose perturbed
            # scores tie within rounding can trade places when a batch's logits differ from
            # one row's in the last bits; an inverse-CDF draw over the summed probabilities
            # (mx.random.categorical) lands on a neighbouring id far more often there
            noise = mx.random.gumbel(shape=logprobs.shape, key=draw)
            return mx.argmax(logprobs * (1 / params.temp) + noise, axis=-1)
        except Exception:
            mx.random.seed(secrets.randbits(63))
            raise

    sample.position = position
    return sample


_GOLDEN = 0x9E3779B97F4A7C15  # spreads the positions' keys apart


class _Position:
    """A logits processor that changes nothing: it notes how many tokens precede the token
    about to be drawn, and a sampled answer draws that token from a key of its seed and this
    position, not of how often its sampler was called (a batch may call it a step ahead)."""

    n = 0

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        self.n = tokens.size
        return logits


def sampling(params: Params, served) -> tuple[Callable, list]:
    """The answer's sampler and its logits processors, a sampled answer's ending with the
    note of the position its sampler keys its draws by."""
    sample, procs = sampler(params), processors(params, served)
    if getattr(sample, "position", None) is not None:
        procs.append(sample.position)
    return sample, procs


def guarded(sample: Callable, fail: Callable[[], None]) -> Callable:
    """``sample`` for a row of a batch: where it raises, its answer alone fails (``fail``,
    the traceback in the log) and the most likely token stands in, so that the batch's other
    rows go on; the failed row leaves the batch with that token."""

    def draw(logprobs: mx.array) -> mx.array:
        try:
            return sample(logprobs)
        except Exception:
            log.exception("a sampler failed")
            fail()
            return mx.argmax(logprobs, axis=-1)

    return draw


def top_logprobs(logprobs: mx.array, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    idx = mx.argpartition(-logprobs, k - 1)[:k]
    values = logprobs[idx]
    order = mx.argsort(-values)
    return list(zip(idx[order].tolist(), values[order].tolist(), strict=True))


def generate(engine, served, job, ids: list[int], params: Params, index: int = 0) -> None:
    """One answer to ``ids``, as events: ``("prefilled", index, cached)``, then ``("token",
    index, token, text, logprob, top)`` per token (logprob None unless asked), then
    ``("done", index, finish_reason, tokens)``."""
    session = Session(served.model, max_cache=engine.max_cache, prefill_step=engine.prefill_step)
    cached, entry = resume(served, ids, params.scope)
    if entry is not None:
        session.restore((ids[:cached], entry["state"]), entry.get("logits"))
    sample, procs = sampling(params, served)
    responses = stream_generate(
        served.model,
        served.tokenizer,
        ids[cached:],
        max_tokens=params.max_tokens,
        sampler=sample,
        logits_processors=procs,
        stop=params.stop,
        session=session,
    )
    n, finish, prompt_stored = 0, "cancelled", False
    try:
        for r in responses:
            if not prompt_stored:
                job.emit("prefilled", index, cached)
            logprob = top = None
            if params.logprobs is not None:
                logprob = r.logprobs[r.token].item()
                top = top_logprobs(r.logprobs, params.logprobs)
            n = r.generation_tokens
            job.emit("token", index, r.token, r.text, logprob, top)
            if not prompt_stored:  # the state after the prompt: after the first token is out
                if cached < len(ids):
                    served.cache.put(
                        ids, {"state": session.state, "logits": session.logits}, scope=params.scope
                    )
                prompt_stored = True
            if r.finish_reason is not None:
                finish = r.finish_reason
                break
            if job.cancelled.is_set():
                break
    finally:
        responses.close()
        if len(session.tokens) > len(ids):  # the state after the answer (as far as it came)
            entry = {"state": session.state}
            if session.logits is not None:
                entry["logits"] = session.logits
            served.cache.put(session.tokens, entry, scope=params.scope)
    if finish == "cancelled":  # its client went (nobody reads this), or the server stops
        raise ApiError(
            503, "the answer was stopped: the server is shutting down", type="server_error"
        )
    job.emit("done", index, "length" if finish == "cache" else finish, n)


class Embedding:
    """The embeddings of one request's inputs, made a piece at a time (``step``) so that the
    engine can run them between steps of its batches and stop them between pieces. Each
    text's final normalised hidden states pooled (their mean, or the last token's:
    ``pooling``) and scaled to unit length."""

    def __init__(self, served, texts: list[list[int]], pooling: str):
        self.served, self.texts, self.pooling = served, texts, pooling
        self.index, self.start = 0, 0  # the text being fed and its tokens fed so far
        self.state, self.total = None, None

    @property
    def done(self) -> bool:
        return self.index == len(self.texts)

    def step(self, budget: int) -> list[tuple[int, list[float]]]:
        """Feed up to ``budget`` tokens (the rest of a text, then the next texts'); the
        (index, vector) of each text finished."""
        out = []
        while budget > 0 and not self.done:
            ids = self.texts[self.index]
            piece = ids[self.start : self.start + budget]
            h, self.state = self.served.model.hidden(
                mx.array([piece], dtype=mx.int32), self.state, check=False
            )
            h = h[0].astype(mx.float32)
            self.total = (
                h[-1]
                if self.pooling == "last"
                else h.sum(axis=0) + (0 if self.total is None else self.total)
            )
            mx.eval(self.total, self.state)
            self.start += len(piece)
            budget -= len(piece)
            if self.start == len(ids):
                pooled = self.total if self.pooling == "last" else self.total / len(ids)
                pooled = pooled / mx.maximum(mx.linalg.norm(pooled), 1e-12)
                out.append((self.index, pooled.tolist()))
                self.index, self.start, self.state, self.total = self.index + 1, 0, None, None
        return out
