"""The models a server holds and the loop that runs them.

``Served``: a model under one name (the base, or the base with one adapter: the adapter's
model shares the base's weight arrays, so each adapter costs only its own tensors), its
tokenizer, chat format, tool-call format and its ``PrefixCache`` of states, keyed by what makes
a state valid (``state_key``). ``Engine``: a queue of ``Job``s and the loop that runs them one
at a time on the main thread (every MLX call of the server happens there; the HTTP server runs
on a thread of its own); a job's events go back to the event loop that waits on them.
``generate`` runs one answer: it resumes from the longest stored prefix of the prompt's tokens,
stores the state after the prompt (with its next-token logits, so that the same prompt again
feeds nothing) as soon as the first token is out, and the state after the answer when it ends
(also when it was cancelled).
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.generation import ChatFormat, Session, stream_generate
from mlx_rwkvx.generation.chat import model_identity
from mlx_rwkvx.generation.prefix_cache import PrefixCache
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.server.protocol import ApiError
from mlx_rwkvx.server.tools import ToolCalls

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.sample_utils import make_logits_processors, make_sampler

log = logging.getLogger("mlx_rwkvx.server")


def share_weights(model: Model) -> Model:
    """A model of the same modules whose arrays are ``model``'s own (no copy): applying an
    adapter to it swaps its layers, never ``model``'s."""

    def copy_of(value):
        if isinstance(value, nn.Module):
            new = copy.copy(value)  # dict items and attributes, shallow
            sets = {k: set(v) for k, v in value.__dict__.items() if isinstance(v, set)}
            new.__dict__.update(sets)  # _no_grad: freezing one must not freeze the other
            for key, item in value.items():
                dict.__setitem__(new, key, copy_of(item))
            return new
        if isinstance(value, list):
            return [copy_of(v) for v in value]
        if isinstance(value, dict):
            return {k: copy_of(v) for k, v in value.items()}
        return value  # an array (shared), or a plain value

    return copy_of(model)


def state_key(model: Model, *, dtype: str | None, quantize: str | None, max_cache: int) -> str:
    """What a stored state is valid for: the weights (fingerprint and adapter tensors), the
    dtype and quantization they run in, and the KV window."""
    return f"{model_identity(model)}|{dtype or 'stored'}|{quantize or 'none'}|{max_cache}"


@dataclass
class Served:
    name: str
    model: Model
    tokenizer: object
    format: ChatFormat
    cache: PrefixCache
    adapter: str | None = None
    tool_calls: ToolCalls | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def token_table(self):
        """llguidance's view of the tokenizer (``schema.token_table``), made on first use."""
        if getattr(self, "_table", None) is None:
            from mlx_rwkvx.server.schema import token_table

            self._table = token_table(self.tokenizer, self.model.config.vocab_size)
        return self._table

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (none for a padded row of the head: no text)."""
        tok = self.tokenizer
        try:
            if hasattr(tok, "decode_bytes"):
                return tok.decode_bytes([token])
            return tok.decode([token]).encode("utf-8")
        except ValueError:
            return b""


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


class Job:
    """Work for the engine's loop: ``run(job)`` calls ``job.emit(event)`` as it goes and
    checks ``job.cancelled``; the events arrive in ``job.events`` on the event loop, the last
    one ``("end", None)``."""

    def __init__(self, run: Callable[[Job], None]):
        self.run = run
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody waits any more
            self.cancelled.set()


class Engine:
    """The served models by name, and the loop that runs jobs one at a time in order of
    arrival, on the thread that calls ``run`` (the main one: MLX's thread-local streams are
    not safe to leave behind on a thread that ends). ``submit`` (from any thread) refuses a
    job (429) when ``max_queue`` jobs already wait, and (503) once the engine is closing."""

    def __init__(self, served: dict[str, Served], *, max_queue: int, max_cache: int,
                 prefill_step: int, pooling: str = "mean"):  # fmt: skip
        self.served, self.max_cache = served, max_cache
        self.prefill_step, self.pooling = prefill_step, pooling
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.closing = False
        self._current: Job | None = None

    def model(self, name: str) -> Served:
        served = self.served.get(name)
        if served is None:
            raise ApiError(404, f"The model {name!r} does not exist (GET /v1/models lists "
                           f"them: {', '.join(self.served)})", param="model",
                           code="model_not_found")  # fmt: skip
        return served

    def submit(self, job: Job) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ApiError(429, f"too many requests waiting ({self._queue.maxsize}, "
                           "--max-queue): try again later", type="rate_limit_error",
                           code="queue_full") from None  # fmt: skip

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    def run(self, until: Callable[[], bool]) -> None:
        """Run jobs as they come until ``until()`` is true and none waits."""
        while True:
            try:
                job = self._queue.get(timeout=0.05)
            except queue.Empty:
                if until():
                    return
                continue
            self._run(job)

    def _run(self, job: Job) -> None:
        self._current = job
        try:
            if not job.cancelled.is_set():
                job.run(job)
        except ApiError as e:
            job.emit("error", e)
        except UserError as e:  # a request the model cannot take (an id, a template)
            job.emit("error", ApiError(400, str(e)))
        except Exception:  # a bug: its traceback in the log, never in a response
            log.exception("a request failed")
            job.emit("error", ApiError(500, "internal error (see the server's log)",
                                       type="server_error"))  # fmt: skip
        finally:
            self._current = None
            # a request's freed buffers go back, not into MLX's pool: the process holds the
            # model, the states under --cache-bytes and what the running request needs
            mx.clear_cache()
            job.emit("end", None)

    def cancel_all(self) -> None:
        """Cancel the running job and every waiting one (their handlers answer them)."""
        self.closing = True
        current = self._current
        if current is not None:
            current.cancelled.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.cancelled.set()
            job.emit("error", ApiError(503, "the server is shutting down", type="server_error"))
            job.emit("end", None)


# ----- the work --------------------------------------------------------------------------------


def processors(params: Params, served: Served) -> list:
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


def _top(logprobs: mx.array, k: int) -> list[tuple[int, float]]:
    if k <= 0:
        return []
    idx = mx.argpartition(-logprobs, k - 1)[:k]
    values = logprobs[idx]
    order = mx.argsort(-values)
    return list(zip(idx[order].tolist(), values[order].tolist(), strict=True))


def generate(engine: Engine, served: Served, job: Job, ids: list[int], params: Params,
             index: int = 0) -> None:  # fmt: skip
    """One answer to ``ids``, as events: ``("prefilled", index, cached)``, then ``("token",
    index, token, text, logprob, top)`` per token (logprob None unless asked), then
    ``("done", index, finish_reason, tokens)``."""
    session = Session(served.model, max_cache=engine.max_cache, prefill_step=engine.prefill_step)
    cached, entry = served.cache.get(ids)
    if entry is not None and cached == len(ids) and "logits" not in entry:
        cached, entry = served.cache.get(ids[:-1])  # the last token fed again, for its logits
    if entry is not None:
        session.restore((ids[:cached], entry["state"]), entry.get("logits"))
    if params.seed is not None:
        mx.random.seed(params.seed)
    responses = stream_generate(
        served.model,
        served.tokenizer,
        ids[cached:],
        max_tokens=params.max_tokens,
        sampler=make_sampler(
            temp=params.temp, top_p=params.top_p, min_p=params.min_p, top_k=params.top_k
        ),  # fmt: skip
        logits_processors=processors(params, served),
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
                top = _top(r.logprobs, params.logprobs)
            n = r.generation_tokens
            job.emit("token", index, r.token, r.text, logprob, top)
            if not prompt_stored:  # the state after the prompt: after the first token is out
                if cached < len(ids):
                    served.cache.put(ids, {"state": session.state, "logits": session.logits})
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
            served.cache.put(session.tokens, entry)
    if finish == "cancelled":  # its client went (nobody reads this), or the server stops
        raise ApiError(503, "the answer was stopped: the server is shutting down",
                       type="server_error")  # fmt: skip
    job.emit("done", index, "length" if finish == "cache" else finish, n)


def embed(engine: Engine, served: Served, ids: list[int]) -> list[float]:
    """The text's final normalised hidden states pooled (their mean, or the last token's:
    ``engine.pooling``) and scaled to unit length."""
    model, state = served.model, None
    total = None
    for start in range(0, len(ids), engine.prefill_step):
        piece = mx.array([ids[start : start + engine.prefill_step]], dtype=mx.int32)
        h, state = model.hidden(piece, state, check=False)
        h = h[0].astype(mx.float32)
        total = (h[-1] if engine.pooling == "last" else
                 h.sum(axis=0) + (0 if total is None else total))  # fmt: skip
        mx.eval(total, state)
    pooled = total if engine.pooling == "last" else total / len(ids)
    pooled = pooled / mx.maximum(mx.linalg.norm(pooled), 1e-12)
    return pooled.tolist()
