"""What a training run is made of, shared by its kinds: ``Task`` (what it trains on and how:
supervised texts, or preference pairs) and ``StepResult`` (what one optimizer step returns to
the loop)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class StepResult:
    loss: float  # the summed loss of the step's micro-batches (over every rank)
    count: int  # what the loss is summed over: trained tokens (preferences: pairs)
    norm: float  # the gradient norm of the mean (with --parallel: the largest adapter's)
    counts: list[int]  # --parallel: each adapter's trained tokens
    stop: bool  # a rank was asked to stop after this step (all stop together)
    fed: int = 0  # tokens fed (padding too): the log's tokens per second
    extra: dict = field(default_factory=dict)  # more of the step's log (preference terms)


@dataclass
class Task:
    """What a run trains on and how: its data (``per_epoch`` steps an epoch, ``stream(position)``
    of micro-batches), its step (``step(run, group)``), and its evaluations (``validate(run,
    max_batches)``, ``evaluate_test(run)``: metrics by name; ``val``, ``test``: the data)."""

    what: str  # "1,000 examples" or "1,000 pairs"
    examples: list
    per_epoch: int
    stream: Callable
    step: Callable
    validate: Callable
    evaluate_test: Callable
    val: list
    test: list
    parts: list = field(default_factory=list)
