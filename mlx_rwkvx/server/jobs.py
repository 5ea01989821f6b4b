"""A request's work for the engine and its way back: ``Job`` (answers to decode, or an
embeddings request) carries its events from the engine's thread to the event loop that waits
on them, and its cancellation the other way; ``failures`` turns whatever its work raised into
its response (a user's mistake a 4xx, a bug a 500 whose traceback stays in the log)."""

from __future__ import annotations

import asyncio
import logging
import threading

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.server.answers import Embedding, Params
from mlx_rwkvx.server.protocol import ApiError
from mlx_rwkvx.server.served import Served

log = logging.getLogger("mlx_rwkvx.server")


class Job:
    """Work for the engine's loop, either ``answers``, ``(served, ids, params)`` for each
    answer to decode in the batch, or an ``embedding`` (its inputs a piece at a time, between
    steps of the batches; an ``("embedding", index, vector)`` event for each). The events
    arrive in ``job.events`` on the event loop, the last one ``("end", None)``; the work
    stops at the next step once ``cancelled`` is set (its client went)."""

    def __init__(
        self,
        answers: list[tuple[Served, list[int], Params]] | None = None,
        embedding: Embedding | None = None,
    ):
        self.answers, self.embedding = answers or [], embedding
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.open = 0  # answers not yet done
        self.ended = False

    def emit(self, *event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the loop is closed: nobody waits any more
            self.cancelled.set()

    def fail(self, error: ApiError) -> None:
        """End the job with ``error`` (once; its other answers are dropped by the engine)."""
        if not self.ended:
            self.ended = True
            self.cancelled.set()
            self.emit("error", error)
            self.emit("end", None)

    def answered(self) -> None:
        """One answer done; the job ends with its last."""
        self.open -= 1
        if self.open <= 0 and not self.ended:
            self.ended = True
            self.emit("end", None)


class failures:
    """A job's errors as its response: an ``ApiError`` as it is, a ``UserError`` as a 400, a
    bug as a 500 (its traceback in the log, never in a response)."""

    def __init__(self, job: Job):
        self.job = job

    def __enter__(self):
        return self

    def __exit__(self, kind, e, tb) -> bool:
        if e is None:
            return False
        if isinstance(e, ApiError):
            self.job.fail(e)
        elif isinstance(e, UserError):  # a request the model cannot take (an id, a template)
            self.job.fail(ApiError(400, str(e)))
        elif isinstance(e, Exception):
            log.exception("a request failed")
            self.job.fail(
                ApiError(500, "internal error (see the server's log)", type="server_error")
            )
        else:
            return False
        return True
