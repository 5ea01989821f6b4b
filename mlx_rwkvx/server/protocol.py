"""OpenAI's request bodies as pydantic models (what FastAPI checks before a handler runs), its
error JSON, and the pieces of its responses that do not depend on the model: ids, usage,
log-probabilities.

Every field OpenAI defines for chat and text completions is named here, with its bounds
(``temperature`` 0..2, ``top_p`` 0..1, ``top_logprobs`` 0..20, penalties -2..2,
``logit_bias`` -100..100); mlx-lm's server extensions (``top_k``, ``min_p``,
``repetition_penalty``) likewise, and with OpenAI's types taken strictly (``"10"`` or
``true`` is no ``max_tokens``). What depends on the model or the server's limits (``top_k``
within the vocabulary, ``max_tokens`` within ``--max-request-tokens``) the handlers check. A
field this server cannot honour is refused by the handler with a 400 naming it, never
ignored; unknown fields are ignored, as OpenAI's own server does.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

# OpenAI's schema types these strictly: "10" or true is no integer, 1 no boolean
Probability = Annotated[float, Field(strict=True, ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(strict=True, ge=-2.0, le=2.0)]
TokenIds = list[StrictInt]


class ApiError(Exception):
    """A request this server answers with ``status`` and OpenAI's error JSON."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        super().__init__(message)
        self.status, self.message = status, message
        self.type, self.param, self.code = type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None):
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad(message: str, param: str | None = None) -> ApiError:
    """A 400: the request is wrong (OpenAI's ``invalid_request_error``)."""
    return ApiError(400, message, param=param)


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: StrictBool = False


class Sampling(_Request):
    """What chat and text completions share."""

    model: str
    max_tokens: StrictInt | None = None
    temperature: Annotated[float, Field(strict=True, ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    n: Annotated[StrictInt, Field(ge=1, le=128)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = None
    user: str | None = None
    # mlx-lm's server's extensions
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    min_p: Probability | None = None
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0)] | None = None


class ToolFunction(_Request):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: ToolFunction


class ContentPart(_Request):
    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; a mapping is taken too


class ToolCall(_Request):
    """A call an assistant turn made (as OpenAI's ``message.tool_calls`` hold them)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class JsonSchema(_Request):
    name: str = "schema"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatRequest(Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: ResponseFormat | None = None


class CompletionRequest(Sampling):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=5)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    best_of: StrictInt | None = None
    response_format: ResponseFormat | None = None


class EmbeddingRequest(_Request):
    model: str
    input: str | list[str] | TokenIds | list[TokenIds]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: StrictInt | None = None
    user: str | None = None


# ----- responses ------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def token_entry(text: str, raw: bytes, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(raw)}
