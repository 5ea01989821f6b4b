"""The HTTP surface: a FastAPI application with OpenAI's routes, its error JSON for every
refusal (a bad body, a missing key, an unknown model or route, a full queue: 4xx; a bug: a 500
whose body says only that), and server-sent events for ``stream``. What one request may ask
is bounded (``--max-request-tokens``: the tokens of all its answers; ``--max-prompt-tokens``:
of all its prompts; ``--max-inputs``, ``--max-body-bytes``: a body is measured before it is
read), and its work is cancelled as soon as its client goes, whatever
flows meanwhile.

``create_app(engine, settings)``: ``settings`` holds the defaults of what a request may leave
out and the server's limits (``ServerConfig`` of ``mlx_rwkvx.server.main``), its API keys
(``api_key``: a list, resolved by ``main.api_keys``), whose keys share stored states
(``cache_scope``) and, on a loopback ``host``, the other ``Host`` names it answers
(``allowed_hosts``).
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import struct
from collections.abc import AsyncIterator
from importlib import resources

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.generation.chat import encode_chat
from mlx_rwkvx.generation.stream import encode_prompt
from mlx_rwkvx.server import answers
from mlx_rwkvx.server.answers import Params
from mlx_rwkvx.server.engine import Engine, Job, Served
from mlx_rwkvx.server.guards import ApiKeys, BodyLimit, LoopbackHosts, loopback
from mlx_rwkvx.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    Message,
    Sampling,
    bad,
    error_body,
    new_id,
    now,
    token_entry,
    usage,
)

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

log = logging.getLogger("mlx_rwkvx.server")
_PAGE = resources.files("mlx_rwkvx.server").joinpath("static", "chat.html")


def create_app(engine: Engine, settings) -> FastAPI:
    app = FastAPI(title="mlx_rwkvx", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.settings = engine, settings
    _errors(app)
    app.add_middleware(BodyLimit, most=settings.max_body_bytes)

    keys = ApiKeys(settings.api_key or [], shared=settings.cache_scope == "shared")
    local = loopback(settings.host)
    if local:
        app.add_middleware(LoopbackHosts, allowed=settings.allowed_hosts or [])

    async def authorised(request: Request) -> None:
        """The request's key checked; its cache scope in ``request.state.scope``."""
        scope = keys.scope(request.headers)
        if scope is None:
            raise ApiError(
                401,
                "missing or wrong API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                code="invalid_api_key",
            )
        request.state.scope = scope

    guard = [Depends(authorised)]

    @app.get("/", response_class=HTMLResponse)
    async def page():
        """The chat page (``static/chat.html``); it asks for the API key itself."""
        return HTMLResponse(_PAGE.read_text(encoding="utf-8"))

    @app.get("/health")
    async def health(request: Request):
        """ "ok" to anyone (a start-up check); what is served and how busy only to a request
        with a key, or, where none is configured, when the server listens on a loopback
        address (then only this machine reaches it)."""
        if keys.scope(request.headers) is None or not (keys.keys or local):
            return {"status": "ok"}
        return {
            "status": "ok",
            "models": list(engine.served),
            "waiting": engine.waiting,
            "decoding": engine.decoding,
            "embedding": engine.embedding,
        }

    @app.get("/v1/models", dependencies=guard)
    async def models():
        return {"object": "list", "data": [_model_entry(s) for s in engine.served.values()]}

    @app.get("/v1/models/{name:path}", dependencies=guard)
    async def model(name: str):
        return _model_entry(engine.model(name))

    @app.post("/v1/chat/completions", dependencies=guard)
    async def chat(body: ChatRequest, request: Request):
        served = engine.model(body.model)
        asked = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        params = _params(body, settings, served, getattr(body, asked), asked)
        params.logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        tools = _tools(body, served)
        params.grammar = await _tool_grammar(body, served, tools) or await _grammar(
            body.response_format, served
        )
        ids = _chat_ids(served, body.messages, tools)
        _check_prompts([ids], settings, "messages")
        _check_answers(body.n, params.max_tokens, asked, settings)
        return await _answer(
            request, engine, served, body, [ids] * body.n, params, kind="chat", tools=tools
        )

    @app.post("/v1/completions", dependencies=guard)
    async def completions(body: CompletionRequest, request: Request):
        served = engine.model(body.model)
        params = _params(body, settings, served, body.max_tokens, "max_tokens")
        params.logprobs = body.logprobs
        params.grammar = await _grammar(body.response_format, served)
        for name in ("echo", "suffix"):
            if getattr(body, name):
                raise bad(f"{name} is not supported by this server", name)
        if body.best_of not in (None, 1, body.n):
            raise bad("best_of must equal n (no answers are generated and dropped)", "best_of")
        prompts = [
            _prompt_ids(served, p, "prompt")
            for p in _prompts(body.prompt, "prompt", settings, body.n)
        ]
        _check_prompts(prompts, settings, "prompt")
        _check_answers(len(prompts) * body.n, params.max_tokens, "max_tokens", settings)
        batch = [ids for ids in prompts for _ in range(body.n)]
        return await _answer(request, engine, served, body, batch, params, kind="text")

    @app.post("/v1/embeddings", dependencies=guard)
    async def embeddings(body: EmbeddingRequest, request: Request):
        served = engine.model(body.model)
        if body.dimensions is not None and body.dimensions != served.model.config.hidden_size:
            raise bad(
                f"dimensions: this model's embeddings have {served.model.config.hidden_size}",
                "dimensions",
            )
        texts = [_prompt_ids(served, p, "input") for p in _prompts(body.input, "input", settings)]
        _check_prompts(texts, settings, "input")
        job = Job(embedding=answers.Embedding(served, texts, engine.pooling))
        engine.submit(job)
        vectors = dict(event[1:] for event in await _events_until_end(job, request))
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(vectors[i], body.encoding_format),
            }
            for i in range(len(texts))
        ]
        n = sum(len(ids) for ids in texts)
        return {
            "object": "list",
            "data": data,
            "model": served.name,
            "usage": {"prompt_tokens": n, "total_tokens": n},
        }

    return app


def _encoded(vector: list[float], encoding: str):
    """A vector as OpenAI sends it: a list, or ``base64`` of its little-endian float32s."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


def _errors(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def api_error(request, e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, e: RequestValidationError):
        problems = e.errors()
        first = problems[0] if problems else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            message, where = f"the body is not valid JSON ({first.get('ctx', {})})", None
        text = f"{where}: {message}" if where else message
        return JSONResponse(error_body(text, "invalid_request_error", where or None), 400)

    @app.exception_handler(HTTPException)
    async def http_error(request, e: HTTPException):
        return JSONResponse(error_body(str(e.detail), "invalid_request_error"), e.status_code)

    @app.exception_handler(Exception)
    async def bug(request, e: Exception):
        log.exception("a request failed")
        return JSONResponse(
            error_body("internal error (see the server's log)", "server_error"), 500
        )


def _model_entry(served: Served) -> dict:
    return {
        "id": served.name,
        "object": "model",
        "created": served.created,
        "owned_by": "mlx_rwkvx",
    }


# ----- requests into work ----------------------------------------------------------------------


def _params(body: Sampling, settings, served: Served, max_tokens: int | None, asked: str) -> Params:
    """The request's settings, checked (``asked``: the field that gave ``max_tokens``)."""
    if body.n > settings.max_n:
        raise bad(f"n must be at most {settings.max_n}", "n")
    max_tokens = settings.max_tokens if max_tokens is None else max_tokens
    if max_tokens < 1:
        raise bad(f"{asked} must be at least 1, got {max_tokens}", asked)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if len(stop) > 16 or any(not s for s in stop):
        raise bad("stop: at most 16 strings, none of them empty", "stop")
    vocab = served.model.config.vocab_size
    bias = {}
    for key, value in (body.logit_bias or {}).items():
        if not key.isdigit() or int(key) >= vocab:
            raise bad(
                f"logit_bias: {key!r} is not a token id of this model (0 .. {vocab - 1})",
                "logit_bias",
            )
        bias[int(key)] = value
    if body.seed is not None and not 0 <= body.seed < 2**63:
        raise bad("seed must be in 0 .. 2^63 - 1", "seed")
    if body.top_k is not None and body.top_k > vocab:
        raise bad(
            f"top_k must be at most the vocabulary's {vocab} tokens, got {body.top_k}", "top_k"
        )
    top_k = settings.top_k if body.top_k is None else body.top_k
    top_p = settings.top_p if body.top_p is None else body.top_p
    return Params(
        max_tokens=max_tokens,
        temp=settings.temp if body.temperature is None else body.temperature,
        top_p=0.0 if top_p >= 1 else top_p,  # 1 keeps every token: off
        min_p=settings.min_p if body.min_p is None else body.min_p,
        top_k=0 if top_k >= vocab else top_k,  # the whole vocabulary: off
        repetition_penalty=body.repetition_penalty,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        logit_bias=bias or None,
        seed=body.seed,
        stop=list(served.format.stops) + stop,
    )


def _tools(body: ChatRequest, served: Served) -> list | None:
    choice = body.tool_choice
    if not body.tools or choice == "none":
        if choice not in (None, "none", "auto"):
            raise bad("tool_choice: a call is asked for but no tools are given", "tool_choice")
        return None
    if not served.format.tools or served.tool_calls is None:
        raise bad(f"tools: the chat template of {served.name} takes no tools", "tools")
    return [t.model_dump(exclude_none=True) for t in body.tools]


def _forced_call(body: ChatRequest) -> tuple[bool, str | None]:
    """Whether ``tool_choice`` asks for a call (``required`` or a named function), and the
    function's name (None: any)."""
    choice = body.tool_choice
    if choice in (None, "auto", "none"):
        return False, None
    if choice == "required":
        return True, None
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if (
        not isinstance(choice, dict)
        or choice.get("type") != "function"
        or not isinstance(name, str)
    ):
        raise bad(
            'tool_choice: none, auto, required or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    return True, name


async def _tool_grammar(body: ChatRequest, served: Served, tools) -> str | None:
    """The grammar that holds the answer to one call, where ``tool_choice`` asks for one."""
    forced, name = _forced_call(body)
    if not forced:
        return None
    if body.response_format is not None and body.response_format.type != "text":
        raise bad(
            "tool_choice: a forced call and a response_format cannot both hold the answer",
            "tool_choice",
        )
    from mlx_rwkvx.server.schema import tool_grammar

    return await asyncio.to_thread(
        lambda: tool_grammar(served.tool_calls.kind, tools, name, served.token_table())
    )


async def _grammar(response_format, served: Served) -> str | None:
    """The grammar of a ``response_format`` (made off the event loop: a schema may take a
    while to compile, and the token table once per model a second)."""
    if response_format is None or response_format.type == "text":
        return None
    from mlx_rwkvx.server.schema import grammar_of

    return await run_in_threadpool(lambda: grammar_of(response_format, served.token_table()))


def _text(message: Message) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if any(p.type != "text" or p.text is None for p in content):
        raise bad("messages: only text content parts are supported", "messages")
    return "".join(p.text for p in content)


def _chat_ids(served: Served, messages: list[Message], tools) -> list[int]:
    rendered = []
    for m in messages:
        entry = {"role": "system" if m.role == "developer" else m.role, "content": _text(m)}
        if m.name:
            entry["name"] = m.name
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        if m.tool_calls:  # templates take the arguments as a mapping, OpenAI sends JSON text
            calls = []
            for call in m.tool_calls:
                function = call.function.model_dump()
                if isinstance(function["arguments"], str):
                    try:
                        function["arguments"] = json.loads(function["arguments"])
                    except ValueError:
                        raise bad(
                            "messages: a tool call's arguments are not JSON", "messages"
                        ) from None
                calls.append({**call.model_dump(exclude_none=True), "function": function})
            entry["tool_calls"] = calls
        rendered.append(entry)
    try:
        return encode_chat(served.tokenizer, served.format, rendered, tools=tools)
    except UserError as e:
        raise bad(str(e), "messages") from None


def _prompts(prompt, param: str, settings, n: int = 1) -> list:
    """One prompt or several (a text, token ids, a list of either): at least one, and, times
    the answers to each (``n``), at most ``--max-inputs``."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise bad(f"{param}: an empty list", param)
    if len(prompt) * n > settings.max_inputs:
        times = f" times n = {n}" if n > 1 else ""
        raise bad(
            f"{param}: {len(prompt)}{times}, more than this server takes in one request "
            f"({settings.max_inputs}, --max-inputs)",
            param,
        )
    return list(prompt)


def _prompt_ids(served: Served, prompt, param: str) -> list[int]:
    if isinstance(prompt, str):
        try:
            ids = encode_prompt(served.tokenizer, prompt)
        except UserError as e:
            raise bad(str(e), param) from None
    else:
        ids = list(prompt)
        vocab = served.model.config.vocab_size
        if any(not 0 <= i < vocab for i in ids):
            raise bad(f"{param}: token ids must be in 0 .. {vocab - 1}", param)
    if not ids:
        raise bad(f"{param}: empty (no tokens)", param)
    return ids


def _check_prompts(prompts: list[list[int]], settings, param: str) -> None:
    """A request's prompts (or inputs) hold at most ``--max-prompt-tokens`` in all: what one
    request costs to prefill is bounded, however many prompts it gives."""
    total = sum(len(ids) for ids in prompts)
    if total > settings.max_prompt_tokens:
        what = (
            f"the prompt has {total} tokens"
            if len(prompts) == 1
            else f"the {len(prompts)} prompts have {total} tokens in all"
        )
        raise ApiError(
            400,
            f"{what}, more than this server takes in one request "
            f"({settings.max_prompt_tokens}, --max-prompt-tokens)",
            param=param,
            code="context_length_exceeded",
        )


def _check_answers(answers: int, max_tokens: int, asked: str, settings) -> None:
    """A request's answers (prompts times ``n``) ask for at most ``--max-request-tokens`` in
    all: what one request costs to decode is bounded, however it is split."""
    total = answers * max_tokens
    if total > settings.max_request_tokens:
        times = f" times {answers} answers = {total}" if answers > 1 else ""
        raise bad(
            f"{asked} {max_tokens}{times}: more tokens than this server generates for "
            f"one request ({settings.max_request_tokens}, --max-request-tokens)",
            asked,
        )


# ----- answers ---------------------------------------------------------------------------------


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


async def _events_until_end(job: Job, request: Request) -> list[tuple]:
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


async def _answer(
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
    for event in await _events_until_end(job, request):
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
