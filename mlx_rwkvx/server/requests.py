"""A request's body into the engine's work, checked: each answer's settings (``answer_params``),
the tools and the grammar that holds an answer (a forced call's, or a ``response_format``'s),
the prompts as token ids (a chat's messages through the model's template, texts, ids), and what
one request may ask bounded (``--max-request-tokens``: the tokens of all its answers;
``--max-prompt-tokens``: of all its prompts; ``--max-inputs``: its prompts times ``n``). A
mistake is an ``ApiError`` (400) naming the field. ``settings`` is the server's
``ServerConfig`` (``mlx_rwkvx.server.main``)."""

from __future__ import annotations

import asyncio
import json

from mlx_rwkvx.errors import UserError
from mlx_rwkvx.generation.chat import encode_chat
from mlx_rwkvx.generation.stream import encode_prompt
from mlx_rwkvx.server.answers import Params
from mlx_rwkvx.server.protocol import ApiError, ChatRequest, Message, Sampling, bad
from mlx_rwkvx.server.served import Served

from starlette.concurrency import run_in_threadpool


def answer_params(
    body: Sampling, settings, served: Served, max_tokens: int | None, asked: str
) -> Params:
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


def chat_tools(body: ChatRequest, served: Served) -> list | None:
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


async def forced_call_grammar(body: ChatRequest, served: Served, tools) -> str | None:
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


async def format_grammar(response_format, served: Served) -> str | None:
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


def chat_ids(served: Served, messages: list[Message], tools) -> list[int]:
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


def prompt_list(prompt, param: str, settings, n: int = 1) -> list:
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


def prompt_ids(served: Served, prompt, param: str) -> list[int]:
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


def check_prompts(prompts: list[list[int]], settings, param: str) -> None:
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


def check_answers(answers: int, max_tokens: int, asked: str, settings) -> None:
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
