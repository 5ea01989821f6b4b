"""The embeddings route's work (``embeddings_response``): a request's inputs checked and
embedded by the engine (a piece at a time, between the steps of its batches), and the vectors
as OpenAI sends them, lists of floats or ``base64`` of their little-endian float32s."""

from __future__ import annotations

import base64
import struct

from mlx_rwkvx.server import answers
from mlx_rwkvx.server.engine import Engine
from mlx_rwkvx.server.jobs import Job
from mlx_rwkvx.server.protocol import EmbeddingRequest, bad
from mlx_rwkvx.server.replies import events_until_end
from mlx_rwkvx.server.requests import check_prompts, prompt_ids, prompt_list

from fastapi import Request


async def embeddings_response(
    engine: Engine, settings, body: EmbeddingRequest, request: Request
) -> dict:
    """The response to ``body`` (``settings``: the server's ``ServerConfig``)."""
    served = engine.model(body.model)
    if body.dimensions is not None and body.dimensions != served.model.config.hidden_size:
        raise bad(
            f"dimensions: this model's embeddings have {served.model.config.hidden_size}",
            "dimensions",
        )
    texts = [prompt_ids(served, p, "input") for p in prompt_list(body.input, "input", settings)]
    check_prompts(texts, settings, "input")
    job = Job(embedding=answers.Embedding(served, texts, engine.pooling))
    engine.submit(job)
    vectors = dict(event[1:] for event in await events_until_end(job, request))
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


def _encoded(vector: list[float], encoding: str):
    """A vector as OpenAI sends it: a list, or ``base64`` of its little-endian float32s."""
    if encoding == "float":
        return vector
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
