"""A job's events into OpenAI's response to a chat completion or a completion (``answer``):
the answers whole, or as server-sent events for ``stream`` (its first event awaited before the
response starts, so that an error before any token is still a 4xx), with their tool calls,
log-probabilities and usage. A job is cancelled as soon as its client goes, whatever flows
meanwhile (``events_until_end`` waits on one so: the embeddings route's too)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

from mlx_rwkvx.server.answers import Params
from mlx_rwkvx.server.engine import Engine
from mlx_rwkvx.server.jobs import Job
from mlx_rwkvx.server.protocol import new_id, now, token_entry, usage
from mlx_rwkvx.server.served import Served

from fastapi import Request
from fastapi.responses import StreamingResponse


class _Choice:
    """One answer as its events arrive."""

    def __init__(self, served: Served, kind: str, tools):
        self.served, self.kind, self.tools = served, kind, tools
        self.text, self.shown, self.tokens = "", 0, 0
        self.cached, self.finish = 0, None
        self._final: tuple | None = None  # final(): computed once
        self.logprobs: list[tuple] = []  # (token, text piece's bytes, logprob, top)
        self.sent_logprobs = 0
        self.strip = kind == "chat" and served.format.name == "rwkv"  # "Assistant: " + answer

    def add(self, token: int, text: str, logprob, top) -> None:
        if self.strip and not self.text and text:
            text, self.strip = text.removeprefix(" "), False
        self.text += text
        if logprob is not None:
            self.logprobs.append((token, logprob, top))

    def visible(self, final: bool) -> str:
        """The text that can be shown now, less what was shown: with tools, what comes before
        a call (and, at the end, everything when there was none)."""
        end = len(self.text)
        if self.tools and not final:
            end = self.served.tool_calls.held(self.text)
        elif self.tools and self.final()[1]:
            end = self.shown
        piece = self.text[self.shown : end] if end > self.shown else ""
        self.shown = max(self.shown, end)
        return piece

    def final(self) -> tuple[str, list[dict], str]:
        """(text, tool calls, finish reason), once the answer is complete (split once)."""
        if self._final is None:
            content, calls = (
                self.served.tool_calls.split(self.text, self.tools)
                if self.tools
                else (self.text, [])
            )
            self._final = content, calls, "tool_calls" if calls else self.finish
        return self._final

    def entry(self, token: int, logprob: float, top) -> dict:
        out = token_entry(*self._token(token), logprob)
        if self.kind == "chat":
            out["top_logprobs"] = [token_entry(*self._token(t), v) for t, v in top or []]
        return out

    def _token(self, token: int) -> tuple[str, bytes]:
        raw = self.served.token_bytes(token)
        return raw.decode("utf-8", errors="replace"), raw

    def logprob_block(self, start: int = 0) -> dict | None:
        items = self.logprobs[start:]
        if self.kind == "chat":
            return {"content": [self.entry(t, lp, top) for t, lp, top in items]}
        tokens = [self._token(t)[0] for t, _, _ in items]
        return {
            "tokens": tokens,
            "token_logprobs": [lp for _, lp, _ in items],
            "top_logprobs": [{self._token(t)[0]: v for t, v in top or []} for _, _, top in items],
            "text_offset": [],
        }


async def _cancel_when_gone(job: Job, request: Request) -> None:
    """Cancel ``job`` as soon as its client goes (the body is read: the next message is the
    disconnect), whatever events flow meanwhile: the engine stops it at its next step."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    job.cancelled.set()


class _watching:
    """``_cancel_when_gone`` for the block."""

    def __init__(self, job: Job, request: Request):
        self.job, self.request = job, request

    async def __aenter__(self):
        self.task = asyncio.create_task(_cancel_when_gone(self.job, self.request))

    async def __aexit__(self, kind, e, tb):
        self.task.cancel()
        if kind is not None and issubclass(kind, asyncio.CancelledError):
            self.job.cancelled.set()


async def events_until_end(job: Job, request: Request) -> list[tuple]:
    """Every event of a job up to its end; the job is cancelled if the client goes. An error
    event raises (as the 4xx or 500 the engine made of it)."""
    events = []
    async with _watching(job, request):
        while True:
            event = await job.events.get()
            if event[0] == "error":
                job.cancelled.set()
                raise event[1]
            if event[0] == "end":
                return events
            events.append(event)


def _answers(served: Served, batch: list[list[int]], params: Params) -> list:
    """Each answer's (served, ids, params): the n answers of one prompt seeded apart."""
    out = []
    for index, ids in enumerate(batch):
        one = params
        if params.seed is not None and index:
            one = Params(**{**params.__dict__, "seed": params.seed + index})
        out.append((served, ids, one))
    return out


async def answer(
    request: Request, engine: Engine, served: Served, body, batch, params, *, kind: str, tools=None
):
    params.scope = request.state.scope  # its key's: it sees no other key's stored states
    job = Job(answers=_answers(served, batch, params))
    engine.submit(job)  # a full queue: 429 before anything is sent
    choices = [_Choice(served, kind, tools) for _ in batch]
    head = {
        "id": new_id("chatcmpl" if kind == "chat" else "cmpl"),
        "created": now(),
        "model": served.name,
    }
    n = body.n  # the batch: each prompt n times
    prompt_tokens = sum(len(ids) for ids in batch[::n])
    if body.stream:
        include = bool(body.stream_options and body.stream_options.include_usage)
        stream = _stream(job, choices, head, kind, prompt_tokens, include, n)
        body = await _streamed(job, stream, request)  # an error before the first event: a 4xx
        return StreamingResponse(
            body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
        )
    for event in await events_until_end(job, request):
        _apply(choices, event)
    out = []
    for i, c in enumerate(choices):
        content, calls, finish = c.final()
        logprobs = c.logprob_block() if params.logprobs is not None else None
        entry = {"index": i, "finish_reason": finish, "logprobs": logprobs}
        if kind == "chat":
            entry["message"] = {
                "role": "assistant",
                "content": content if (content or not calls) else None,
            }
            if calls:
                entry["message"]["tool_calls"] = calls
        else:
            entry["text"] = content
        out.append(entry)
    return {
        **head,
        "object": "chat.completion" if kind == "chat" else "text_completion",
        "choices": out,
        "usage": _usage(choices, prompt_tokens, n),
    }


def _usage(choices: list[_Choice], prompt_tokens: int, n: int) -> dict:
    """OpenAI's usage: each prompt counted once (its first answer's cached tokens), every
    answer's tokens."""
    cached = sum(c.cached for c in choices[::n])
    return usage(prompt_tokens, sum(c.tokens for c in choices), cached)


def _apply(choices: list[_Choice], event: tuple) -> _Choice:
    kind, index, *rest = event
    c = choices[index]
    if kind == "prefilled":
        c.cached = rest[0]
    elif kind == "token":
        c.add(*rest)
    elif kind == "done":
        c.finish, c.tokens = rest
    return c


async def _streamed(job: Job, stream: AsyncIterator[str], request: Request) -> AsyncIterator[str]:
    """``stream`` once its first piece is known: an error before any token is raised here
    (so that the response is a 4xx, not a stream that starts with 200). The job is cancelled
    as soon as its client goes, for the stream's whole life: Starlette notices a disconnect
    by itself only under ASGI before 2.4, and else only when a send fails, which never comes
    while nothing is sent (a tool call's text is held)."""
    watcher = asyncio.create_task(_cancel_when_gone(job, request))
    try:
        first = await stream.__anext__()
    except StopAsyncIteration:
        first = None
    except BaseException:
        watcher.cancel()
        job.cancelled.set()
        raise

    async def rest():
        try:
            if first is not None:
                yield first
            async for piece in stream:
                yield piece
        finally:
            watcher.cancel()
            job.cancelled.set()  # a client that went: its slot is freed at the next token

    return rest()


def _sse(data) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


async def _stream(job: Job, choices, head, kind, prompt_tokens, include_usage, n):
    obj = "chat.completion.chunk" if kind == "chat" else "text_completion"
    started = False
    while True:
        event = await job.events.get()
        if event[0] == "error":
            if not started:
                raise event[1]
            yield _sse(event[1].body())
            break
        if event[0] == "end":
            break
        c = _apply(choices, event)
        index = event[1]
        if event[0] == "prefilled":
            started = True
            if kind == "chat":
                yield _sse(
                    {
                        **head,
                        "object": obj,
                        "choices": [
                            {
                                "index": index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    }
                )
            continue
        final = event[0] == "done"
        if event[0] not in ("token", "done"):
            continue
        piece = c.visible(final)
        logprobs = None
        if c.logprobs and len(c.logprobs) > c.sent_logprobs:
            logprobs = c.logprob_block(c.sent_logprobs)
            c.sent_logprobs = len(c.logprobs)
        choice: dict = {"index": index, "logprobs": logprobs, "finish_reason": None}
        if final:
            content, calls, finish = c.final()
            choice["finish_reason"] = finish
            if kind == "chat" and calls:
                for n, call in enumerate(calls):
                    yield _sse(
                        {
                            **head,
                            "object": obj,
                            "choices": [
                                {
                                    "index": index,
                                    "delta": {"tool_calls": [{"index": n, **call}]},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ],
                        }
                    )
        if not piece and not final and logprobs is None:
            continue
        if kind == "chat":
            choice["delta"] = {"content": piece} if piece else {}
        else:
            choice["text"] = piece
        yield _sse({**head, "object": obj, "choices": [choice]})
    if include_usage:
        yield _sse(
            {**head, "object": obj, "choices": [], "usage": _usage(choices, prompt_tokens, n)}
        )
    yield "data: [DONE]\n\n"
