"""The rows of the engine's batches: each answer decoding (``Row``: its job, model, prompt,
settings and text so far), a batch (``Batch``: mlx-lm's ``BatchGenerator`` over one set of
weights, and its rows by uid), and a row's state stored as it is reached (``keep_state``).
``job`` and ``served`` are a ``jobs.Job`` and a ``served.Served`` (typed ``object``: a row
only carries them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mlx_rwkvx._mlx_lm import BatchGenerator
from mlx_rwkvx.generation.stream import StopStrings
from mlx_rwkvx.models.cache import read_caches
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.server.answers import Params

import mlx.core as mx


@dataclass
class Row:
    """One answer in a batch: its job, model, prompt, settings and text so far."""

    job: object  # a jobs.Job
    served: object  # a served.Served
    ids: list[int]
    params: Params
    index: int
    cached: int
    detok: object
    stops: StopStrings
    state: list | None  # the state after the prompt's tokens fed so far (None once batched)
    logits: mx.array | None  # the logits after them, where the prefix cache held them
    todo: list[int]  # prompt tokens not fed yet
    sample: Callable
    procs: list
    n: int = 0
    last: int = 0  # the last token sent


class Batch:
    """mlx-lm's ``BatchGenerator`` over one set of weights, and its rows by uid."""

    def __init__(self, model: Model, eos: list[int], decode: int):
        self.model = model
        # its prompts are one token (the answer's first, sampled after the prompt's prefill)
        self.gen = BatchGenerator(
            model, max_tokens=1, stop_tokens=[[e] for e in eos], completion_batch_size=decode
        )
        self.rows: dict[int, Row] = {}


def keep_state(row: Row, layers, cache, tokens, logits: mx.array | None = None) -> None:
    """The state in a row's ``cache`` (one row, after ``tokens``; with the logits after them
    when known) into its model's prefix cache."""
    state, _ = read_caches(layers, cache, 1)
    entry = {"state": state} if logits is None else {"state": state, "logits": logits}
    row.served.cache.put(list(tokens), entry, scope=row.params.scope)
