"""The training loop as a library, as mlx-lm's: the caller builds the objects.
``train(model, task, optimizer, data, steps=...)`` makes ``steps`` optimizer steps of ``task``
on the micro-batches of ``data`` (``supervised()``'s ``Step``: the loss and gradients of a
step's micro-batches, summed over the ranks of a data-parallel run, then one update; the
preference Task's step is ``tuner/preference_run.py``'s). What a run does beside stepping
(the log, ``metrics.jsonl``, validation, checkpoints and resuming, the answer to Ctrl-C and
SIGTERM) is done by its ``callbacks`` (``tuner/callbacks.py``), each a duty of its own;
``tuner/from_config.py: train_from_config`` builds all of it from a ``TrainConfig`` for the
``train`` command."""

from __future__ import annotations

import math
import signal
from collections.abc import Callable, Iterable, Iterator, Sequence

from mlx_rwkvx._crash import crash_point
from mlx_rwkvx._runtime import buffers_given_back
from mlx_rwkvx.data.loss import batch_loss, dataset_loss, segment_loss, segments
from mlx_rwkvx.errors import Interrupted, NonFinite, TrainError
from mlx_rwkvx.models import Model
from mlx_rwkvx.ops import tuning
from mlx_rwkvx.tuner import distributed, parallel
from mlx_rwkvx.tuner.callbacks import Callback
from mlx_rwkvx.tuner.steps import StepResult, Task, TrainState

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

__all__ = [
    "NonFinite",
    "Step",
    "TrainError",
    "TrainState",
    "batch_loss",
    "evaluate",
    "supervised",
    "train",
]


class Single:
    """How a step trains one adapter (or a whole model): the summed token loss, and the mean
    gradient clipped by its global norm (``parallel.Stacked`` trains N at once)."""

    def loss_sum(self, model, inputs, targets, before, checkpoint: bool):
        return segment_loss(model, inputs, targets, before, checkpoint)

    def mean_grads(self, grads, count: mx.array, clip: float):
        """(the token mean's gradient, clipped; its norm before clipping)."""
        grads = tree_map(lambda g: g / mx.maximum(count, 1).astype(mx.float32), grads)
        return optim.clip_grad_norm(grads, clip if clip > 0 else math.inf)


class WindowStop(Exception):
    """A stop request between two windows of a --carry-state step: the step is dropped (nothing
    was updated yet) and redone on --resume."""


def use_rank0_choices(group) -> None:
    """Every data-parallel rank takes rank 0's tuning choices, so all step with the same
    implementations (each rank's own measurement may differ)."""
    tuning.use_choices(distributed.broadcast_json(tuning.choices(), group))


def tuning_on(group) -> bool:
    """Whether the ops' implementations are chosen by measurement (``MLX_RWKVX_TUNE``): for a
    data-parallel run every rank's setting, which must agree (a rank that tunes joins
    collectives the others skip): a TrainError on every rank when they do not."""
    if group is None:
        return tuning.enabled()
    settings = distributed.all_gather_json(tuning.enabled(), group)
    if len(set(settings)) > 1:
        ranks = ", ".join(f"rank {i}: {'on' if on else 'off'}" for i, on in enumerate(settings))
        raise TrainError(
            f"{tuning.ENV_TUNE} differs between the ranks ({ranks}): give every rank the same "
            f"(mlx.launch --env {tuning.ENV_TUNE}=0)"
        )
    return settings[0]


def tune_on_rank0(group, new: dict, tune: Callable[[tuple, object], None]) -> list[tuple]:
    """A data-parallel step's length classes met for the first time by any rank, chosen for by
    rank 0 alone: ``new`` maps this rank's new classes (tuples) to what rebuilds a step of
    that class (anything ``json`` writes, e.g. a shape); rank 0 calls ``tune(key, spec)`` for
    every rank's, then every rank takes rank 0's choices before stepping on any of them.
    Returns every rank's new classes. One scalar all-sum a step; more when a class is new."""
    if not distributed.all_sum_int(len(new), group):
        return []
    classes: dict[tuple, object] = {}
    for theirs in distributed.all_gather_json([[list(k), v] for k, v in new.items()], group):
        for key, spec in theirs:
            classes.setdefault(tuple(key), spec)
    if not classes:
        return []
    if group.rank() == 0:
        for key, spec in classes.items():
            tune(key, spec)
    use_rank0_choices(group)
    return list(classes)


class Step:
    """One training step, compiled (the gradient of a checkpointed one on the CPU aside):
    ``loss_and_grad`` of each micro-batch (with --carry-state, segment by segment of
    ``segment`` columns, each starting from the state the previous one ended with, its KV
    caches cut to ``max_cache``; no gradient crosses a boundary), the gradients summed over
    micro-batches and ranks, then one update. NonFinite before anything is updated when the
    loss or the gradient norm is not finite. The compiled functions see a bounded number of
    shapes (segments and windows of fixed lengths).

    Before a micro-batch of a new length bucket is stepped on (the compiled functions traced
    for it), the ops' implementations are chosen at its shapes (``tune``): nothing is measured
    inside ``mx.compile``, where a call with nothing remembered takes the op's fixed rule."""

    def __init__(
        self,
        model: Model,
        optimizer: optim.Optimizer,
        *,
        grad_clip: float = 1.0,
        grad_checkpoint: bool = False,
        segment: int | None = None,
        max_cache: int | None = None,
        stacked: int = 1,
        group=None,
    ):
        """``grad_clip``: the global norm the mean gradient is clipped to (0: none);
        ``segment``: --carry-state's segment length (None: a text in one piece);
        ``max_cache``: the attention KV window carried between segments (None: all of it);
        ``stacked``: --parallel's N stacked adapters; ``group``: data parallel's ranks."""
        self.model, self.optimizer = model, optimizer
        self.grad_checkpoint, self.segment, self.max_cache = grad_checkpoint, segment, max_cache
        self.group = group if group is not None and group.size() > 1 else None
        # between_windows(n), after the step's n-th window: True drops the step (WindowStop)
        self.between_windows: Callable[[int], bool] = lambda n: False
        self._windows = 0
        self._tuned: set[tuple[int, int]] = set()  # the length classes tune() has seen
        # data parallel: decided once, by every rank alike (each step's tuning is collective)
        self._tune = tuning_on(self.group) if self.group is not None else None
        self.way = parallel.Stacked(stacked) if stacked > 1 else Single()
        grad_fn = nn.value_and_grad(model, self._loss_sum)
        state = [model.state, optimizer.state, mx.random.state]
        carry = segment is not None

        def first(inputs, targets):  # the start of the texts: the model's own initial state
            (loss, count, after), grads = grad_fn(model, inputs, targets, None)
            return (loss, count, grads, after) if carry else (loss, count, grads)

        def carried(inputs, targets, before):
            (loss, count, after), grads = grad_fn(model, inputs, targets, before)
            return loss, count, grads, after

        def mean_grads(grads, count):
            return self.way.mean_grads(grads, count, grad_clip)

        def update(grads):
            optimizer.update(model, grads)

        self._grad_fn = grad_fn  # uncompiled: what tune() runs
        # checkpointed on the CPU, the gradient is not compiled: MLX's peak over a compiled one
        # was higher (1.5B RWKV-7, 4 blocks, int4 LoRA, T = 512: 635 MB against 564, the
        # process's resident peak 759 against 668), its time the same within the noise
        compiled = not (grad_checkpoint and mx.default_device() == mx.cpu)
        self.first = mx.compile(first, inputs=state, outputs=state) if compiled else first
        self.carried = mx.compile(carried, inputs=state, outputs=state) if compiled else carried
        self.mean_grads = mx.compile(mean_grads)
        self.update = mx.compile(update, inputs=state, outputs=state)

    def _loss_sum(self, model, inputs, targets, before):
        return self.way.loss_sum(model, inputs, targets, before, self.grad_checkpoint)

    def tune(self, inputs: mx.array, targets: mx.array) -> None:
        """Let every op choose its implementation at this micro-batch's shapes (measured once
        per device, shape class and length bucket, ``ops/tuning.py``): the gradient graph of
        each of its segments is built uncompiled, where the ops may measure, and dropped
        unevaluated (only the ops' first call at a shape evaluates anything)."""
        parts, before = segments(inputs, targets, self.segment), None
        for i, (x, y) in enumerate(parts):
            (_, _, before), _ = self._grad_fn(self.model, x, y, before)
            if i + 1 < len(parts) and self.max_cache is not None:
                before = self.model.trim_state(before, self.max_cache)

    def _tune_new(self, micro_batches) -> None:
        """``tune`` on each micro-batch of a length class not seen yet (its segments' length
        bucket and number: a carried state's attention cache grows with the segments). In a
        data-parallel run rank 0 tunes every rank's new classes (another rank's on zeros of its
        shape) and every rank takes rank 0's choices (``tune_on_rank0``)."""
        mine = {}
        for inputs, targets in micro_batches:
            T = inputs.shape[1]
            length = T if self.segment is None else min(T, self.segment)
            key = (tuning.length_bucket(length), -(-T // length))
            if key not in self._tuned:
                mine.setdefault(key, (inputs, targets))
        if self.group is None:
            for inputs, targets in mine.values():
                self.tune(mx.array(inputs), mx.array(targets))
            self._tuned.update(mine)
            return

        def tune(key, shape):
            zeros = np.zeros(shape, np.int32)
            inputs, targets = mine.get(key, (zeros, zeros))
            self.tune(mx.array(inputs), mx.array(targets))

        shapes = {key: list(inputs.shape) for key, (inputs, _) in mine.items()}
        self._tuned.update(tune_on_rank0(self.group, shapes, tune))

    def loss_and_grad(self, inputs: mx.array, targets: mx.array):
        """(summed loss, trained tokens, gradients of the sum) of one micro-batch, segment by
        segment with --carry-state (each evaluated before the next: memory holds one)."""
        parts = segments(inputs, targets, self.segment)
        loss, count, grads, state = None, None, None, None
        for i, (x, y) in enumerate(parts):
            if state is None:
                part, n, g, *after = self.first(x, y)
            else:
                part, n, g, *after = self.carried(x, y, state)
            loss, count = (part, n) if loss is None else (loss + part, count + n)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            if i + 1 < len(parts):
                state = after[0]
                if self.max_cache is not None:
                    state = self.model.trim_state(state, self.max_cache)
                mx.eval(loss, count, grads, state)
                self._windows += 1
                if self.between_windows(self._windows):  # a text of many windows: minutes
                    raise WindowStop
        mx.eval(loss, count, grads)  # one micro-batch's graph alive at a time
        return loss, count, grads

    def __call__(self, micro_batches, stop: bool = False) -> StepResult:
        """One optimizer step over ``micro_batches``; ``stop``: this process was asked to stop
        after it (decided with the other ranks in the step's collective)."""
        total_loss, total_count, grads = 0.0, 0, None
        self._windows = 0
        if tuning.enabled() if self.group is None else self._tune:
            self._tune_new(micro_batches)
        for inputs, targets in micro_batches:
            loss, count, g = self.loss_and_grad(mx.array(inputs), mx.array(targets))
            grads = g if grads is None else tree_map(mx.add, grads, g)
            total_loss, total_count = total_loss + loss, total_count + count
        flag = mx.array(float(stop))
        if self.group is not None:  # data parallel: sums over every rank's tokens
            summed = (grads, total_loss, total_count, flag)
            grads, total_loss, total_count, flag = distributed.all_sum(summed, self.group)
        grads, norm = self.mean_grads(grads, total_count)
        mx.eval(total_loss, total_count, grads, norm)
        loss, norm = float(total_loss), norm.item()
        if not math.isfinite(loss):
            raise NonFinite(f"the loss is {loss}")
        if not math.isfinite(norm):
            raise NonFinite(f"the gradient norm is {norm}")
        self.update(grads)
        mx.eval(self.model.parameters(), self.optimizer.state)
        counts = total_count.tolist() if total_count.ndim else []
        fed = sum(int(inputs.size) for inputs, _ in micro_batches)
        return StepResult(loss, int(mx.sum(total_count).item()), norm, counts, flag.item() > 0, fed)


def supervised(
    *,
    grad_clip: float = 1.0,
    grad_checkpoint: bool = False,
    segment: int | None = None,
    max_cache: int | None = None,
    stacked: int = 1,
) -> Task:
    """The Task of the token loss of texts (SFT, pretraining): micro-batches of ``(inputs,
    targets)`` int32 ``[B, T]`` (``data.batches``), one ``Step`` (see it for the options)."""

    def step(model, optimizer, group):
        return Step(
            model,
            optimizer,
            grad_clip=grad_clip,
            grad_checkpoint=grad_checkpoint,
            segment=segment,
            max_cache=max_cache,
            stacked=stacked,
            group=group,
        )

    return Task(step=step)


def evaluate(
    model: Model,
    examples,
    batch_size: int,
    max_batches: int | None = None,
    segment: int | None = None,
    max_cache: int | None = None,
) -> float:
    """The mean token loss over ``examples`` (``data.loss.dataset_loss``, the one definition
    the ``evaluate`` command shares)."""
    result = dataset_loss(model, examples, batch_size, max_batches, segment, max_cache)
    if result.stopped is not None:
        raise result.stopped  # the trainer's own Ctrl-C / SIGTERM handling takes it from here
    return result.mean


def train(
    model: Model,
    task: Task,
    optimizer: optim.Optimizer,
    data: Iterable,
    *,
    steps: int,
    callbacks: Sequence[Callback] = (),
    grad_accum: int = 1,
    seed: int = 0,
    state: TrainState | None = None,
    group=None,
) -> TrainState:
    """Train ``model`` until step ``steps`` (a resumed ``state`` has made some already): each
    step ``task``'s step over ``grad_accum`` micro-batches of ``data`` (an iterable: a list is
    gone through again when it ends; a stream with a ``position`` is followed, for resuming),
    its randomness (dropout) drawn from ``seed`` and the step alone. ``callbacks`` are told of
    the start, each step (its record: loss, grad_norm, lr, tokens, ...), a stop and the end.
    ``group``: the ranks of a data-parallel run (every rank calls ``train``).

    Returns the state. NonFinite when the loss or the gradient norm is not finite (nothing of
    that step applied); ``Interrupted`` when a stop was asked for (``TrainState.signal``, set
    by ``callbacks.StopRequests``): after the step, or between two windows of a --carry-state
    step (that step dropped)."""
    if steps < 0 or grad_accum < 1:
        raise ValueError(f"train: steps {steps} and grad_accum {grad_accum}: need >= 0 and >= 1")
    group = group if group is not None and group.size() > 1 else None
    state = TrainState() if state is None else state
    state.total = steps
    if group is not None:
        state.rank, state.ranks = group.rank(), group.size()
    step_fn = task.step(model, optimizer, group)
    if task.checkpoint is not None:
        step_fn.grad_checkpoint = task.checkpoint
    batches = _micro_batches(data)

    def between_windows(n: int) -> bool:  # one process alone: ranks stop after a step together
        crash_point("window", f"{state.step + 1}.{n}")
        return state.ranks == 1 and state.signal is not None

    if hasattr(step_fn, "between_windows"):
        step_fn.between_windows = between_windows
    with buffers_given_back(getattr(step_fn, "grad_checkpoint", False)):
        try:
            for callback in callbacks:
                callback.on_train_begin(state)
            while state.step < steps:
                _step(
                    step_fn,
                    optimizer,
                    [next(batches) for _ in range(grad_accum)],
                    data,
                    state,
                    callbacks,
                    seed,
                )
            final = {}  # the end's metrics (the last validation, the test loss)
            for callback in callbacks:
                callback.on_train_end(state, final)
        finally:
            for callback in callbacks:
                callback.close()
    return state


def _step(step_fn, optimizer, batch: list, data, state: TrainState, callbacks, seed: int):
    # each step's randomness (dropout) from the seed and the step alone: a resumed run draws
    # what the uninterrupted one drew, with no random state to save (another rank another
    # draw: its rows are other rows)
    mx.random.seed((seed * 1_000_003 + state.step + 7_919 * state.rank) % 2**64)
    try:
        result: StepResult = step_fn(batch, stop=state.signal is not None)
    except WindowStop:
        raise _interrupted(callbacks, state, within=True) from None
    except NonFinite as e:
        kept = f"checkpoint_{state.saved}" if state.saved is not None else "no checkpoint yet"
        raise NonFinite(f"step {state.step + 1}: {e}; stopped (kept: {kept})") from None
    state.step, state.tokens = state.step + 1, state.tokens + result.count
    state.position = getattr(data, "position", state.position)  # after the step's last batch
    if result.counts:  # --parallel: each adapter's tokens
        before = state.stack_tokens or [0] * len(result.counts)
        state.stack_tokens = [a + b for a, b in zip(before, result.counts, strict=True)]
    state.fed += result.fed
    state.told = result.stop
    crash_point("step", state.step)
    record = {
        "step": state.step,
        "loss": result.loss / max(result.count, 1),
        **result.extra,
        "grad_norm": result.norm,
        "lr": _learning_rate(optimizer),
        "tokens": state.tokens,
    }
    for callback in callbacks:
        callback.on_step_end(state, record)
    if state.stopping:  # asked before the step, or during its callbacks (a save, a validation)
        raise _interrupted(callbacks, state)


def _interrupted(callbacks, state: TrainState, within: bool = False) -> Interrupted:
    """The Interrupted of a stop request, the callbacks told first (a checkpoint saved)."""
    for callback in callbacks:
        callback.on_stop(state)
    kept = state.kept()
    if within:
        kept = kept if state.step else "no step had finished: nothing saved"
        kept += f"; step {state.step + 1} was cut short between its windows (--resume redoes it)"
    return Interrupted(state.signal or signal.SIGINT, kept)


def _learning_rate(optimizer: optim.Optimizer) -> float:
    """The rate the last update used (a MultiOptimizer's: its first group's)."""
    inner = getattr(optimizer, "optimizers", [optimizer])[0]
    return float(inner.learning_rate)


def _micro_batches(data: Iterable) -> Iterator:
    """``data``'s items, from its start again when it ends (an iterator that ends: ValueError)."""
    while True:
        items, empty = iter(data), True
        for item in items:
            empty = False
            yield item
        if empty or items is data:
            raise ValueError("train: the data ran out before the last step")
