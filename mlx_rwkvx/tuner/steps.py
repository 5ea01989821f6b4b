"""What a training run is made of, shared by its kinds and by the loop's duties: ``Task`` (what
it trains on and how: its step and its evaluations), ``StepResult`` (what one optimizer step
returns to the loop), ``TrainState`` (what the loop holds between steps: what a checkpoint
saves, what the callbacks read) and ``RunData`` (a run's data as its settings read it)."""

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
    """What a run trains on and how: ``step(model, optimizer, group)`` builds the step (called
    with a list of micro-batches and ``stop``, it returns a ``StepResult``; ``group``: the
    data-parallel group or None), ``validate(max_batches)`` and ``evaluate_test()`` return
    metrics by name (None: no such data)."""

    step: Callable
    validate: Callable | None = None
    evaluate_test: Callable | None = None
    # None: each step as ``step`` makes it; True / False: every step made recomputes its blocks
    # in the backward or not (the run's memory plan decides, after the Task is made)
    checkpoint: bool | None = None


@dataclass
class TrainState:
    """What the loop holds between steps: what a checkpoint saves and ``--resume`` restores
    (``step``, ``tokens``, ``position``, ``stack_tokens``) and what the callbacks read."""

    step: int = 0  # optimizer steps done
    tokens: int = 0  # tokens trained on (preferences: pairs)
    position: dict = field(default_factory=lambda: {"epoch": 0, "batch": 0})  # the data's, after
    stack_tokens: list[int] = field(default_factory=list)  # --parallel: each adapter's tokens
    rank: int = 0  # of a data-parallel run (rank 0 writes)
    ranks: int = 1
    total: int = 0  # the steps the run makes in all
    fed: int = 0  # tokens fed in this process (padding too): tokens per second
    signal: int | None = None  # this process was asked to stop (Ctrl-C, SIGTERM): the signal
    told: bool = False  # a rank was asked to stop (told in this step's collective)
    saved: int | None = None  # the step of the newest complete checkpoint

    @property
    def stopping(self) -> bool:
        """Stop after this step: a rank was asked to (told in the step's collective), or, alone,
        this process (several ranks decide together, a step later: one that stopped alone would
        leave the others waiting in a collective)."""
        return self.told or (self.ranks == 1 and self.signal is not None)

    def kept(self) -> str:
        """What an interrupted run kept, in the words of its last line."""
        if self.saved != self.step:  # no checkpoints taken (the library without them)
            return f"checkpoint_{self.saved} kept" if self.saved is not None else "nothing saved"
        return f"saved checkpoint_{self.step}" if self.rank == 0 else "rank 0 saved its checkpoint"


@dataclass
class RunData:
    """A run's training data as its settings read it: ``stream(position)``, the micro-batches
    from a data position on (an iterable whose ``position`` follows it); ``per_epoch``: steps
    an epoch; ``what``: said at the start."""

    what: str  # "1,000 examples" or "1,000 pairs"
    examples: list
    per_epoch: int
    stream: Callable
    parts: list = field(default_factory=list)  # --parallel: the examples' N parts
    longest: int = 0  # tokens of the longest row a step feeds (a segment with --carry-state)
