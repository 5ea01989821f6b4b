"""The HTTP surface: a FastAPI application with OpenAI's routes, the guards in front of them
(API keys, the ``Host`` check on a loopback address, ``--max-body-bytes``: a body is measured
before it is read) and its error JSON for every refusal (a bad body, a missing key, an unknown
model or route, a full queue: 4xx; a bug: a 500 whose body says only that). A route's work is
elsewhere: a request checked and made into work in ``requests.py``, a job's events made into
the response (whole, or server-sent events for ``stream``) in ``replies.py``, the embeddings
route's in ``embeddings.py``.

``create_app(engine, settings)``: ``settings`` holds the defaults of what a request may leave
out and the server's limits (``ServerConfig`` of ``mlx_rwkvx.server.main``), its API keys
(``api_key``: a list, resolved by ``main.api_keys``), whose keys share stored states
(``cache_scope``) and, on a loopback ``host``, the other ``Host`` names it answers
(``allowed_hosts``).
"""

from __future__ import annotations

import logging
from importlib import resources

from mlx_rwkvx.server.embeddings import embeddings_response
from mlx_rwkvx.server.engine import Engine
from mlx_rwkvx.server.guards import ApiKeys, BodyLimit, LoopbackHosts, loopback
from mlx_rwkvx.server.protocol import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    bad,
    error_body,
)
from mlx_rwkvx.server.replies import answer
from mlx_rwkvx.server.requests import (
    answer_params,
    chat_ids,
    chat_tools,
    check_answers,
    check_prompts,
    forced_call_grammar,
    format_grammar,
    prompt_ids,
    prompt_list,
)
from mlx_rwkvx.server.served import Served

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse
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
        params = answer_params(body, settings, served, getattr(body, asked), asked)
        params.logprobs = (body.top_logprobs or 0) if body.logprobs else None
        if body.top_logprobs and not body.logprobs:
            raise bad("top_logprobs needs logprobs: true", "top_logprobs")
        tools = chat_tools(body, served)
        params.grammar = await forced_call_grammar(body, served, tools) or await format_grammar(
            body.response_format, served
        )
        ids = chat_ids(served, body.messages, tools)
        check_prompts([ids], settings, "messages")
        check_answers(body.n, params.max_tokens, asked, settings)
        return await answer(
            request, engine, served, body, [ids] * body.n, params, kind="chat", tools=tools
        )

    @app.post("/v1/completions", dependencies=guard)
    async def completions(body: CompletionRequest, request: Request):
        served = engine.model(body.model)
        params = answer_params(body, settings, served, body.max_tokens, "max_tokens")
        params.logprobs = body.logprobs
        params.grammar = await format_grammar(body.response_format, served)
        for name in ("echo", "suffix"):
            if getattr(body, name):
                raise bad(f"{name} is not supported by this server", name)
        if body.best_of not in (None, 1, body.n):
            raise bad("best_of must equal n (no answers are generated and dropped)", "best_of")
        prompts = [
            prompt_ids(served, p, "prompt")
            for p in prompt_list(body.prompt, "prompt", settings, body.n)
        ]
        check_prompts(prompts, settings, "prompt")
        check_answers(len(prompts) * body.n, params.max_tokens, "max_tokens", settings)
        batch = [ids for ids in prompts for _ in range(body.n)]
        return await answer(request, engine, served, body, batch, params, kind="text")

    @app.post("/v1/embeddings", dependencies=guard)
    async def embeddings(body: EmbeddingRequest, request: Request):
        return await embeddings_response(engine, settings, body, request)

    return app


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
