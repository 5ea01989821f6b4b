"""The loop that runs the models a server holds.

``Engine``: the served models by name (``Served``, of ``served.py``), a queue of ``Job``s (of
``jobs.py``) and the loop that runs them on the main thread (every MLX call of the server
happens there; the HTTP server runs on a thread of its own); a job's events go back to the
event loop that waits on them.

Answers are decoded in batches (continuous batching, through mlx-lm's ``BatchGenerator``): an
answer's prompt is prefilled from the longest stored prefix of its tokens, between two steps of
the batches so that the others keep decoding: a long one a piece (``prefill_step`` tokens) at a
time, the last pieces of several prompts together in one padded forward (``Model.prefill``);
its first token is sampled and sent at once, and the answer then joins its batch; one that
ends or whose client went leaves at once. One batch per set of weights: the base and its
state-tuned states share one (a state-tuned state is only where a row starts), each LoRA or
DoRA adapter has its own, and the batches take turns. The state after the prompt (with its
next-token logits, so that the same prompt again feeds nothing) and the state after the answer
are stored as they are reached. An answer the attention blocks' KV window cannot hold whole
(prompt and ``max_tokens`` over ``--max-cache``) runs alone through the generation layer,
whose window slides (``generate``). An embeddings request takes its turn between the steps of
the batches, a piece of its inputs at a time. Whatever a job's client left stops at its next
step or piece.
"""

from __future__ import annotations

import collections
import logging
import queue
from collections.abc import Callable

from mlx_rwkvx.generation.stream import StopStrings, detokenizer, vocab_mask
from mlx_rwkvx.models.cache import write_caches
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.server.answers import (
    Params,
    generate,
    guarded,
    resume,
    sampling,
    top_logprobs,
)
from mlx_rwkvx.server.batch import Batch, Row, keep_state
from mlx_rwkvx.server.jobs import Job, failures
from mlx_rwkvx.server.protocol import ApiError
from mlx_rwkvx.server.served import Served, share_weights

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger("mlx_rwkvx.server")
PREFILL_ROWS = 8  # prompts prefilled together, at most


def _weights(model: Model) -> tuple:
    """What a batch is shared by: the identities of every weight array but a state-tuned
    initial state's."""
    return tuple(id(a) for k, a in tree_flatten(model.parameters()) if not k.endswith("state0"))


def _without_state0(model: Model) -> Model:
    stripped = share_weights(model)
    for _, module in stripped.named_modules():
        if "state0" in module:
            module.pop("state0")
    return stripped


class Engine:
    """The served models by name, and the loop that runs jobs in order of arrival on the
    thread that calls ``run`` (the main one: MLX's thread-local streams are not safe to leave
    behind on a thread that ends). ``submit`` (from any thread) refuses a job (429) when
    ``max_queue`` jobs already wait, and (503) once the engine is closing."""

    def __init__(
        self,
        served: dict[str, Served],
        *,
        max_queue: int,
        max_cache: int,
        prefill_step: int,
        pooling: str = "mean",
        decode_concurrency: int = 32,
    ):
        self.served, self.max_cache = served, max_cache
        self.prefill_step, self.pooling = prefill_step, pooling
        self.decode_concurrency = decode_concurrency
        self._queue: queue.Queue = queue.Queue(maxsize=max_queue)
        self.closing = False
        self._current: Job | None = None
        self._batches: dict[tuple, Batch] = {}
        self._pending: collections.deque[Row] = collections.deque()  # prompts being prefilled
        self._embeddings: collections.deque[Job] = collections.deque()  # they take turns
        self._weights = {name: _weights(s.model) for name, s in served.items()}

    def model(self, name: str) -> Served:
        served = self.served.get(name)
        if served is None:
            raise ApiError(
                404,
                f"The model {name!r} does not exist (GET /v1/models lists "
                f"them: {', '.join(self.served)})",
                param="model",
                code="model_not_found",
            )
        return served

    def submit(self, job: Job) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error")
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise ApiError(
                429,
                f"too many requests waiting ({self._queue.maxsize}, --max-queue): try again later",
                type="rate_limit_error",
                code="queue_full",
            ) from None

    @property
    def waiting(self) -> int:
        return self._queue.qsize()

    @property
    def decoding(self) -> int:
        """Answers being prefilled or decoded now."""
        return len(self._pending) + sum(len(b.rows) for b in self._batches.values())

    @property
    def embedding(self) -> int:
        """Embeddings requests being run now."""
        return len(self._embeddings)

    def run(self, until: Callable[[], bool]) -> None:
        """Run jobs as they come until ``until()`` is true and none waits or runs: in turn, a
        piece of an embeddings request, a piece of prefill, a step of every batch."""
        while True:
            rows = self.decoding + self.embedding
            busy, full = rows > 0, rows >= self.decode_concurrency  # full: the rest wait
            try:
                job = (
                    None
                    if full
                    else (self._queue.get_nowait() if busy else self._queue.get(timeout=0.05))
                )
            except queue.Empty:
                job = None
            if job is not None:
                self._start(job)
            elif busy:
                if self._embeddings:
                    self._embed()
                if self._pending:
                    self._prefill()
                self._step()
                if not self.decoding:
                    mx.clear_cache()  # idle: freed buffers go back, not into MLX's pool
            elif until():
                return

    def _start(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.fail(ApiError(503, "the request was cancelled", type="server_error"))
            return
        if job.embedding is not None:
            self._embeddings.append(job)
            return
        job.open = len(job.answers)
        if not job.answers:  # nothing to answer (the handlers refuse such requests)
            job.answered()
        for index, (served, ids, params) in enumerate(job.answers):
            if job.ended:
                return
            with failures(job):
                if _fits(served.model, len(ids) + params.max_tokens, self.max_cache):
                    self._join(job, served, ids, params, index)
                else:  # the KV window slides: alone, through the generation layer
                    self._current = job
                    generate(self, served, job, ids, params, index)
                    self._current = None
                    job.answered()

    def _embed(self) -> None:
        """A piece (``prefill_step`` tokens) of the first embeddings request, which then goes
        last: a request of many long inputs holds neither the batches nor the others up."""
        job = self._embeddings[0]
        if job.cancelled.is_set() or job.ended:
            job.fail(
                ApiError(
                    503,
                    "the request was stopped: its client went, or the server is shutting down",
                    type="server_error",
                )
            )
        else:
            with failures(job):
                for index, vector in job.embedding.step(self.prefill_step):
                    job.emit("embedding", index, vector)
            if job.embedding.done and not job.ended:
                job.ended = True
                job.emit("end", None)
        self._embeddings.popleft()
        if not job.ended:
            self._embeddings.append(job)
        else:
            mx.clear_cache()

    def _batch(self, served: Served) -> Batch:
        key = self._weights[served.name]
        batch = self._batches.get(key)
        if batch is None:
            model = served.model
            if len(key) != len(tree_flatten(model.parameters())):  # a state-tuned state
                model = _without_state0(model)
            eos = sorted(getattr(served.tokenizer, "eos_token_ids", ()) or ())
            batch = Batch(model, eos, self.decode_concurrency)
            self._batches[key] = batch
        return batch

    def _join(self, job: Job, served: Served, ids: list[int], params: Params, index: int):
        """The answer waits for its prefill, from the longest stored prefix of the prompt."""
        vocab = served.model.config.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0 .. {vocab - 1})")
        cached, entry = resume(served, ids, params.scope)
        state = entry["state"] if entry is not None else served.model.init_state(1)
        logits = entry.get("logits") if entry is not None and cached == len(ids) else None
        sample, procs = sampling(params, served)
        known = getattr(served.tokenizer, "vocab_size", None)
        if known is not None and known < vocab:  # never sample an id the tokenizer lacks
            procs.insert(0, vocab_mask(known, vocab))
        failed = ApiError(500, "internal error (see the server's log)", type="server_error")
        sample = guarded(sample, lambda: job.fail(failed))  # its answer alone fails
        self._pending.append(
            Row(
                job,
                served,
                ids,
                params,
                index,
                cached,
                detokenizer(served.tokenizer),
                StopStrings(params.stop),
                state,
                logits,
                ids[cached:],
                sample,
                procs,
            )
        )

    def _prefill(self) -> None:
        """Prompts a piece further, between two steps of the batches: the prompts with at
        most ``prefill_step`` tokens to go, together (a padded batch per set of weights, up
        to ``PREFILL_ROWS``), each answer's first token sampled and sent, and the answers
        joining their batches; else a piece of the first longer prompt."""
        for row in list(self._pending):
            if row.job.cancelled.is_set() or row.job.ended:
                self._pending.remove(row)
                self._finish(None, row, None, "cancelled")
        groups: dict[int, list[Row]] = {}
        for row in self._pending:
            if len(row.todo) <= self.prefill_step:
                group = groups.setdefault(id(self._batch(row.served)), [])
                if len(group) < PREFILL_ROWS:
                    group.append(row)
        for rows in groups.values():
            for row in rows:
                self._pending.remove(row)
            self._last_piece(self._batch(rows[0].served), rows)
        if not groups and self._pending:
            row = self._pending[0]
            model = self._batch(row.served).model
            piece, row.todo = row.todo[: self.prefill_step], row.todo[self.prefill_step :]
            with failures(row.job):
                _, row.state = model.hidden(
                    mx.array([piece], dtype=mx.int32), row.state, check=False
                )
                mx.eval(row.state)
        mx.clear_cache()  # prefill's buffers go back (the batches reuse theirs)

    def _last_piece(self, batch: Batch, rows: list[Row]) -> None:
        """The rows' last prompt tokens in one padded forward, then each answer's first token;
        the state after each prompt is stored (with its logits) and the answers that go on
        join ``batch``."""
        model, layers = batch.model, batch.model.layers
        try:
            caches = []
            for row in rows:
                cache = model.make_cache()
                write_caches(layers, cache, row.state)
                caches.append(cache)
            logits = [row.logits for row in rows]
            need = [i for i, row in enumerate(rows) if row.todo]
            if need:
                merged = [
                    type(c).merge([caches[i][k] for i in need])
                    for k, c in enumerate(caches[need[0]])
                ]
                lengths = [len(rows[i].todo) for i in need]
                T = max(lengths)
                tokens = mx.array(
                    [rows[i].todo + [0] * (T - len(rows[i].todo)) for i in need], dtype=mx.int32
                )
                out = model.prefill(tokens, merged, lengths).astype(mx.float32)
                for j, i in enumerate(need):
                    caches[i] = [c.extract(j) for c in merged]
                    logits[i] = out[j : j + 1]
            firsts = []
            for row, row_logits in zip(rows, logits, strict=True):
                history = mx.array(row.ids, dtype=mx.int32)
                for p in row.procs:
                    row_logits = p(history, row_logits)
                logprobs = row_logits - mx.logsumexp(row_logits, axis=-1, keepdims=True)
                firsts.append((row.sample(logprobs), logprobs[0]))
            mx.eval(firsts, logits, [c.state for cache in caches for c in cache])
        except Exception:  # a bug: these answers fail (their traceback in the log)
            log.exception("a prefill failed")
            for row in rows:
                row.job.fail(
                    ApiError(500, "internal error (see the server's log)", type="server_error")
                )
            return
        joining = []
        for row, cache, row_logits, (token, logprobs) in zip(
            rows, caches, logits, firsts, strict=True
        ):
            row.job.emit("prefilled", row.index, row.cached)
            finish = self._emit(row, int(token.item()), logprobs, None)
            if row.todo or row.cached < len(row.ids):  # the state after the prompt: stored
                keep_state(row, layers, cache, row.ids, row_logits)
            row.state = row.logits = None
            row.todo = []
            if finish is not None:
                self._finish(None, row, None, finish)
            else:
                joining.append((row, cache))
        if not joining:
            return
        uids = batch.gen.insert(
            [[row.last] for row, _ in joining],
            max_tokens=[row.params.max_tokens - 1 for row, _ in joining],
            caches=[cache for _, cache in joining],
            all_tokens=[row.ids for row, _ in joining],
            samplers=[row.sample for row, _ in joining],
            logits_processors=[row.procs for row, _ in joining],
        )
        for uid, (row, _) in zip(uids, joining, strict=True):
            batch.rows[uid] = row

    def _step(self) -> None:
        """One step of every batch with rows: prompts a piece further, answers a token
        further."""
        for batch in list(self._batches.values()):
            for uid, row in list(batch.rows.items()):
                if row.job.cancelled.is_set():
                    self._finish(batch, row, uid, "cancelled")
            if not batch.rows:
                continue
            try:
                for r in batch.gen.next_generated():
                    self._token(batch, r)
            except Exception:  # a bug: every row of the batch fails, the batch starts over
                log.exception("a batch failed")
                for row in batch.rows.values():
                    row.job.fail(
                        ApiError(500, "internal error (see the server's log)", type="server_error")
                    )
                self._batches = {k: b for k, b in self._batches.items() if b is not batch}

    def _store(self, batch: Batch, uid: int) -> None:
        """A row's state now (its tokens so far), into its model's cache of states."""
        row = batch.rows.get(uid)
        if row is None:
            return
        ((cache, tokens),) = batch.gen.extract_cache([uid]).values()
        if len(tokens) <= row.cached:  # the prompt's state, stored already
            return
        keep_state(row, batch.model.layers, cache, tokens)

    def _token(self, batch: Batch, r) -> None:
        """A token of a row of ``batch`` (mlx-lm's response)."""
        row = batch.rows.get(r.uid)
        if row is None:
            return
        finish = self._emit(row, r.token, r.logprobs, r.finish_reason)
        if finish is None and row.n == row.params.max_tokens - 1:
            # the state before the last token too: a text cut at max_tokens is sent back in
            # the next turn's prompt, where its last token may merge with what follows
            self._store(batch, r.uid)
        if finish is not None:
            done = (r.prompt_cache, r.all_tokens) if r.finish_reason is not None else None
            self._finish(batch, row, r.uid, finish, done)

    def _emit(self, row: Row, token: int, logprobs: mx.array, finish: str | None) -> str | None:
        """Send a row's token (its text past the stop strings, its log-probabilities); the
        answer's finish reason, or None while it goes on."""
        params = row.params
        row.n += 1
        row.last = token
        if token in (getattr(row.served.tokenizer, "eos_token_ids", ()) or ()):
            row.detok.finalize()
            text, finish = row.stops.flush() + row.detok.last_segment, "stop"
        else:
            row.detok.add_token(token)
            text, stopped = row.stops.add(row.detok.last_segment)
            if stopped:
                finish = "stop"
            else:
                if finish is None and row.n >= params.max_tokens:
                    finish = "length"
                if finish is not None:
                    row.detok.finalize()
                    text += row.stops.add(row.detok.last_segment)[0] + row.stops.flush()
        logprob = top = None
        if params.logprobs is not None:
            logprob = logprobs[token].item()
            top = top_logprobs(logprobs, params.logprobs)
        row.job.emit("token", row.index, token, text, logprob, top)
        if finish is None and row.job.cancelled.is_set():
            finish = "cancelled"
        return finish

    def _finish(
        self, batch: Batch | None, row: Row, uid: int | None, finish: str, done=None
    ) -> None:
        """A row ends (it leaves its batch): the state after its answer is stored, its job
        told."""
        if batch is not None:
            batch.rows.pop(uid, None)
            if done is None:  # still in the batch: taken out now
                done = batch.gen.remove([uid], return_prompt_caches=True).get(uid)
            if done is not None and len(done[1]) > len(row.ids):
                keep_state(row, batch.model.layers, *done)
            mx.clear_cache()  # the batch's arrays change shape: the old buffers go back
        if row.job.ended:
            return
        if finish == "cancelled":  # its client went (nobody reads this), or the server stops
            row.job.fail(
                ApiError(
                    503, "the answer was stopped: the server is shutting down", type="server_error"
                )
            )
            return
        row.job.emit("done", row.index, finish, row.n)
        row.job.answered()

    def cancel_all(self) -> None:
        """Cancel the running jobs and every waiting one (their handlers answer them)."""
        self.closing = True
        current = self._current
        if current is not None:
            current.cancelled.set()
        for job in (*self._embeddings, *(row.job for row in self._pending)):
            job.cancelled.set()
        for batch in self._batches.values():
            for row in batch.rows.values():
                row.job.cancelled.set()
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                break
            job.fail(ApiError(503, "the server is shutting down", type="server_error"))


def _fits(model: Model, tokens: int, max_cache: int) -> bool:
    """Whether an answer of ``tokens`` in all fits the attention blocks' KV window (an RWKV-7
    model has none)."""
    return all(layer.kind == "rwkv7" for layer in model.layers) or tokens <= max_cache
