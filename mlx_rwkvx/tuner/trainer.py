"""The training run, top to bottom: ``train(cfg)`` resolves the settings once, builds the model
(``build``), reads the data (``run_data``), then loops over steps (``Step``: the loss and
gradients of a step's micro-batches, summed over the ranks of a data-parallel run, then one
AdamW update), logs, validates and checkpoints, and writes its results (``outputs``). Ctrl-C and
SIGTERM finish the step, save a checkpoint and stop (a --carry-state step of many windows is
dropped between two of them instead: nothing of it was applied yet); ``--resume`` continues from
the newest complete checkpoint with the losses of the run that was not interrupted."""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx._crash import crash_point
from mlx_rwkvx.adapters.files import adapter_config
from mlx_rwkvx.adapters.tensors import trainable_count
from mlx_rwkvx.adapters.variants import VARIANTS, saved_lora_parameters
from mlx_rwkvx.data.batches import count_batches
from mlx_rwkvx.data.loss import batch_loss, dataset_loss, segment_loss, segments
from mlx_rwkvx.errors import (
    EXIT_CODES,
    USER_ERRNOS,
    CheckpointError,
    Interrupted,
    NonFinite,
    TrainError,
    os_error_text,
)
from mlx_rwkvx.io.targets import output_lock, remove_stale
from mlx_rwkvx.models import Model
from mlx_rwkvx.ops import prepare
from mlx_rwkvx.tuner import distributed, outputs, parallel, preference_run, run_data
from mlx_rwkvx.tuner.build import block_kinds_of, build
from mlx_rwkvx.tuner.checkpoints import (
    load_checkpoint,
    newest_checkpoint,
    save_checkpoint,
    scan_checkpoints,
)
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.optimizer import make_optimizer
from mlx_rwkvx.tuner.steps import StepResult, Task

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
from mlx.utils import tree_map
from tqdm import tqdm

__all__ = ["NonFinite", "Step", "TrainError", "batch_loss", "evaluate", "train"]


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


class Step:
    """One training step, compiled: ``loss_and_grad`` of each micro-batch (with --carry-state,
    segment by segment of ``max_seq_len`` columns, each starting from the state the previous
    one ended with, its KV caches cut to ``max_cache``; no gradient crosses a boundary), the
    gradients summed over micro-batches and ranks, then one update. NonFinite before anything
    is updated when the loss or the gradient norm is not finite. The compiled functions see a
    bounded number of shapes (segments and windows of fixed lengths)."""

    def __init__(self, model: Model, optimizer, cfg: TrainConfig, group=None):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.group = group if group is not None and group.size() > 1 else None
        # between_windows(n), after the step's n-th window: True drops the step (WindowStop)
        self.between_windows: Callable[[int], bool] = lambda n: False
        self._windows = 0
        self.way = parallel.Stacked(cfg.parallel) if cfg.parallel > 1 else Single()
        grad_fn = nn.value_and_grad(model, self._loss_sum)
        state = [model.state, optimizer.state, mx.random.state]

        def first(inputs, targets):  # the start of the texts: the model's own initial state
            (loss, count, after), grads = grad_fn(model, inputs, targets, None)
            return (loss, count, grads, after) if cfg.carry_state else (loss, count, grads)

        def carried(inputs, targets, before):
            (loss, count, after), grads = grad_fn(model, inputs, targets, before)
            return loss, count, grads, after

        def mean_grads(grads, count):
            return self.way.mean_grads(grads, count, cfg.grad_clip)

        def update(grads):
            optimizer.update(model, grads)

        self.first = mx.compile(first, inputs=state, outputs=state)
        self.carried = mx.compile(carried, inputs=state, outputs=state)
        self.mean_grads = mx.compile(mean_grads)
        self.update = mx.compile(update, inputs=state, outputs=state)

    def _loss_sum(self, model, inputs, targets, before):
        return self.way.loss_sum(model, inputs, targets, before, self.cfg.grad_checkpoint)

    def loss_and_grad(self, inputs: mx.array, targets: mx.array):
        """(summed loss, trained tokens, gradients of the sum) of one micro-batch, segment by
        segment with --carry-state (each evaluated before the next: memory holds one)."""
        cfg = self.cfg
        parts = segments(inputs, targets, cfg.max_seq_len if cfg.carry_state else None)
        loss, count, grads, state = None, None, None, None
        for i, (x, y) in enumerate(parts):
            if state is None:
                part, n, g, *after = self.first(x, y)
            else:
                part, n, g, *after = self.carried(x, y, state)
            loss, count = (part, n) if loss is None else (loss + part, count + n)
            grads = g if grads is None else tree_map(mx.add, grads, g)
            if i + 1 < len(parts):
                state = self.model.trim_state(after[0], cfg.max_cache)
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
        return StepResult(loss, int(mx.sum(total_count).item()), norm, counts, flag.item() > 0,
                          fed)  # fmt: skip


class Run:
    """What a training run holds between steps (what a checkpoint saves)."""

    def __init__(self, cfg, built, optimizer, schedule):
        self.cfg, self.model, self.tokenizer = cfg, built.model, built.tokenizer
        self.base, self.paths = built.base, built.paths
        self.optimizer, self.schedule = optimizer, schedule
        self.step, self.tokens = 0, 0
        self.position = {"epoch": 0, "batch": 0}
        self.lead = True  # rank 0 of a data-parallel run (or the only one): it writes
        self.rank, self.ranks = 0, 1
        self.stack_tokens = [0] * cfg.parallel  # --parallel: the tokens each adapter trained on
        self.validated = None  # (step, its metrics) of the latest --val-every validation

    def adapter_config(self) -> dict:
        cfg = self.cfg
        kind = cfg.mode if cfg.mode in ("lora", "dora", "state") else "full"
        facts = {}
        if cfg.mode in VARIANTS:  # saved as the LoRA update it is against the original base
            kind, facts = "lora", {"method": cfg.mode, "method_rank": cfg.lora_rank}
        rank, alpha = saved_lora_parameters(cfg.mode, cfg.lora_rank, cfg.lora_alpha)
        return adapter_config(
            self.model, fine_tune_type=kind, paths=self.paths if kind != "full" else [],
            rank=rank, alpha=alpha, dropout=cfg.lora_dropout,
            targets=cfg.lora_targets or "", base_fingerprint=self.base, seed=cfg.seed,
            tokens_trained=self.tokens, steps=self.step, **facts,
        )  # fmt: skip


def evaluate(model: Model, examples, batch_size: int, max_batches: int | None = None,
             segment: int | None = None, max_cache: int | None = None) -> float:  # fmt: skip
    """The mean token loss over ``examples`` (``losses.dataset_loss``, the one definition the
    ``evaluate`` command shares)."""
    result = dataset_loss(model, examples, batch_size, max_batches, segment, max_cache)
    if result.stopped is not None:
        raise result.stopped  # the trainer's own Ctrl-C / SIGTERM handling takes it from here
    return result.mean


def train(cfg: TrainConfig, log: Callable[[dict], None] | None = None) -> Path | None:
    """Run training as ``cfg`` says; returns the output folder (None on the ranks of a
    data-parallel run other than rank 0, which writes). TrainError (or another UserError) for
    what the user can fix (nothing written), NonFinite when the loss or gradients stop being
    finite, ``Interrupted`` after Ctrl-C or SIGTERM (the step finished and saved).
    ``log(record)`` is called with every line metrics.jsonl gets (a step's loss, lr, ...)."""
    try:
        cfg.check()
    except ValueError as e:
        raise TrainError(str(e)) from e
    for name in ("model", "data", "output"):
        if not getattr(cfg, name):
            raise TrainError(f"--{name} is required")
    cfg = cfg.resolved(block_kinds_of(cfg))  # settled here, never changed afterwards
    out = Path(cfg.output)
    group = distributed.data_parallel_group()
    if group is not None and group.rank() != 0:  # rank 0 alone reads and writes files
        with distributed.peers_lost(group):
            _train(cfg, out, group, lead=False, log=log)
        return None
    real = outputs.check_inputs(out, cfg)
    outputs.check_place(out)
    # the lock inside the folder: a run only adds to it (a folder of one's own under a
    # read-only parent can be trained into)
    with output_lock(real, "--output", inside=True):
        outputs.check_output(out, cfg.resume)
        remove_stale(real)  # what runs killed while writing left (their temporary files)
        with distributed.peers_lost(group):
            return _train(cfg, out, group, lead=True, log=log)


def _train(cfg: TrainConfig, out: Path, group, lead: bool, log=None) -> Path:
    mlx_rwkvx.configure()
    mx.random.seed(cfg.seed)
    built = build(cfg)
    model = built.model
    chunks = [layer.attn.chunk_size for layer in model.layers if layer.kind == "moba"]
    if cfg.carry_state and chunks and cfg.max_cache < max(chunks):
        raise TrainError(f"--max-cache {cfg.max_cache}: MoBA keeps whole chunks of "
                         f"{max(chunks)} tokens; give at least one chunk")  # fmt: skip
    if group is not None and cfg.parallel > 1:
        raise TrainError("--parallel trains N adapters in one process: not under mlx.launch")
    prepare(dtypes=(mx.float32, mx.bfloat16))  # kernels checked before anything compiles
    if cfg.train_mode == "sft":
        task = _supervised(cfg, built, group, lead)
    else:  # the reference: the model as built (every adapter starts as the identity)
        task = preference_run.task(cfg, built, group, lead)
    if cfg.val_every and not task.val and lead:
        print(f"--val-every {cfg.val_every}: no validation data (--val-data, or valid.jsonl or "
              "valid.bin in the --data folder): no validation loss", file=sys.stderr)  # fmt: skip
    per_epoch = task.per_epoch
    if group is not None:  # every rank runs the same steps (one with fewer would hang the rest)
        per_epoch = int(mx.distributed.all_min(mx.array(per_epoch), group=group).item())
    total = cfg.iters or cfg.epochs * per_epoch
    run = Run(cfg, built, *make_optimizer(cfg, total))
    run.lead = lead
    if group is not None:
        run.rank, run.ranks = group.rank(), group.size()
    if cfg.resume:
        run.optimizer.init(model.trainable_parameters())
        if lead:
            _resume(run, out)
    if group is not None:  # every rank starts from rank 0's parameters (and checkpoint)
        distributed.broadcast_run(run, group)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        outputs.keep_metrics(out / outputs.METRICS, run.step)
        _say_what(run, task, group, total)
    step = task.step(run, group)
    try:
        stop = _Interrupt()
        try:
            _loop(run, step, task, total, out, stop, log)
        finally:
            stop.restore()  # the end (evaluation, final files): Ctrl-C stops it at once
        if lead:
            _finish(run, task, out)
    except (OSError, CheckpointError) as e:
        if isinstance(e, OSError) and e.errno not in USER_ERRNOS:
            raise
        text = os_error_text(e) if isinstance(e, OSError) else str(e)
        last = newest_checkpoint(out) if lead else None
        kept = f"checkpoint_{last} is the last complete one, kept" if last is not None else (
            "no checkpoint was complete yet")  # fmt: skip
        raise TrainError(f"{text}; {kept}") from e
    return out


def _resume(run: Run, out: Path) -> None:
    step, broken = scan_checkpoints(out)
    if step is None:
        raise TrainError(f"--output {out}: no complete checkpoint to resume from")
    for newer, why in broken.items():
        print(f"--resume: skipped checkpoint_{newer} ({why}); resuming from "
              f"checkpoint_{step}", file=sys.stderr)  # fmt: skip
    load_checkpoint(out, step, run)


def _supervised(cfg: TrainConfig, built, group, lead: bool) -> Task:
    """The token loss of texts (SFT, pretraining): examples, --parallel parts, Step."""
    vocab = built.model.config.vocab_size
    examples = run_data.train_examples(cfg, built.tokenizer, vocab)
    examples = distributed.rank_share(examples, group)
    parts = parallel.parts(examples, cfg.parallel)
    val = run_data.validation_examples(cfg, built.tokenizer, vocab) if lead else []
    test = run_data.test_examples(cfg, built.tokenizer, vocab) if lead else []  # read now

    def validate(run, max_batches):
        return {"val_loss": _evaluate(run, val, max_batches)}

    def evaluate_test(run):
        return {"test_loss": _evaluate(run, test, cfg.test_batches)}

    return Task(
        what=f"{len(examples)} examples",
        examples=examples,
        per_epoch=max(1, count_batches(parts[0], cfg.batch_size) // cfg.grad_accum),
        stream=lambda position: run_data.stream(cfg, parts, position),
        step=lambda run, group: Step(run.model, run.optimizer, cfg, group),
        validate=validate,
        evaluate_test=evaluate_test,
        val=val,
        test=test,
        parts=parts,
    )


def _say_what(run: Run, task: Task, group, total: int) -> None:
    cfg = run.cfg
    who = f" a rank, {group.size()} ranks (data parallel)" if group is not None else ""
    if cfg.parallel > 1:
        who = f", {cfg.parallel} parts of {len(task.parts[0])} trained at once (--parallel)"
    how = cfg.mode if cfg.train_mode == "sft" else f"{cfg.train_mode} with {cfg.mode}"
    print(f"{how}: {trainable_count(run.model):,} trainable parameters ({len(run.paths)} "
          f"tensors or layers), {task.what}{who}, {total} steps"
          + (f", resuming at step {run.step}" if cfg.resume else ""))  # fmt: skip
    if cfg.carry_state:
        examples = task.examples
        longest = max(len(e) for e in examples) - 1
        print(f"carry-state: texts of up to {longest:,} tokens, in segments of {cfg.max_seq_len} "
              f"(at most {-(-longest // cfg.max_seq_len)} a text); attention KV window "
              f"{cfg.max_cache} tokens")  # fmt: skip


class _Interrupt:
    """Ctrl-C or SIGTERM during training: finish the step, save, stop (a second one stops at
    once: Ctrl-C's KeyboardInterrupt, or whatever SIGTERM did before)."""

    def __init__(self):
        self.signum, self._old = None, {}
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in EXIT_CODES}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame):
        self.signum = signum
        self.restore()

    def restore(self):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


def _loop(run: Run, step_fn, task: Task, total: int, out: Path, stop: _Interrupt, log):
    cfg, lead = run.cfg, run.lead
    metrics = outputs.Metrics(out, write=lead)  # only rank 0 writes
    stream = task.stream(run.position)
    started, seen = time.perf_counter(), 0
    bar = tqdm(total=total, initial=run.step, unit="step", dynamic_ncols=True, leave=False,
               disable=not lead)  # fmt: skip

    def between_windows(n: int) -> bool:  # one process alone: ranks stop after a step together
        crash_point("window", f"{run.step + 1}.{n}")
        return step_fn.group is None and stop.requested

    if isinstance(step_fn, Step):
        step_fn.between_windows = between_windows
    try:
        while run.step < total:
            batch, position = zip(*[next(stream) for _ in range(cfg.grad_accum)], strict=True)
            lr = float(run.schedule(run.step))
            # each step's randomness (dropout) from the seed and the step alone: a resumed run
            # draws what the uninterrupted one drew, with no random state to save
            # (another rank another draw: its rows are other rows)
            mx.random.seed((cfg.seed * 1_000_003 + run.step + 7_919 * run.rank) % 2**64)
            try:
                result = step_fn(batch, stop=stop.requested)
            except WindowStop:
                raise _stopped_within(run, out, stop) from None
            except NonFinite as e:
                last = newest_checkpoint(out)
                kept = f"checkpoint_{last}" if last is not None else "no checkpoint yet"
                raise NonFinite(f"step {run.step + 1}: {e}; stopped (kept: {kept})") from None
            run.step, run.tokens = run.step + 1, run.tokens + result.count
            run.position = position[-1]  # the loop's: the data after the step's last batch
            if result.counts:  # --parallel: each adapter's tokens
                tokens = zip(run.stack_tokens, result.counts, strict=True)
                run.stack_tokens = [a + b for a, b in tokens]
            seen += result.fed
            bar.update(1)
            crash_point("step", run.step)
            record = {"step": run.step, "loss": result.loss / max(result.count, 1),
                      **result.extra, "grad_norm": result.norm, "lr": lr,
                      "tokens": run.tokens}  # fmt: skip
            if lead and (run.step % cfg.log_every == 0 or run.step == total):
                record["tokens_per_s"] = seen / max(time.perf_counter() - started, 1e-9)
                record["peak_memory_gb"] = mx.get_peak_memory() / 1e9
                bar.write(f"step {run.step}/{total}: loss {record['loss']:.4f}, lr {lr:.2e}, "
                          f"{record['tokens_per_s']:.0f} tok/s, peak "
                          f"{record['peak_memory_gb']:.2f} GB")  # fmt: skip
            if lead and task.val and cfg.val_every and run.step % cfg.val_every == 0:
                validated = task.validate(run, cfg.val_batches)
                record.update(validated)
                run.validated = (run.step, validated)
                bar.write(f"step {run.step}: validation loss {record['val_loss']:.4f}")
            metrics.add(record)
            if log is not None:
                log(record)
            # asked on any rank before its step's collective: every rank stops now; a signal
            # that came after it is told to the others in the next step's (a rank that
            # stopped alone would leave them waiting in a collective)
            stopping = result.stop or (step_fn.group is None and stop.requested)
            if lead and (run.step % cfg.save_every == 0 or stopping):
                save_checkpoint(out, run)
                # a signal during the save: that checkpoint is the step's (several ranks
                # decide together, in the next step's collective)
                stopping = stopping or (step_fn.group is None and stop.requested)
            if stopping:
                saved = f"saved checkpoint_{run.step}" if lead else "rank 0 saved its checkpoint"
                raise Interrupted(stop.signum or signal.SIGINT, saved)
    finally:
        bar.close()
        metrics.close()


def _stopped_within(run: Run, out: Path, stop: _Interrupt) -> Interrupted:
    """The Interrupted of a step dropped between its windows, the steps before it saved."""
    if run.step and newest_checkpoint(out) != run.step:
        save_checkpoint(out, run)
    saved = f"saved checkpoint_{run.step}" if run.step else "no step had finished: nothing saved"
    return Interrupted(stop.signum or signal.SIGINT, f"{saved}; step {run.step + 1} was cut "
                       "short between its windows (--resume redoes it)")  # fmt: skip


def _evaluate(run: Run, examples, max_batches) -> float:
    cfg = run.cfg
    segment = cfg.max_seq_len if cfg.carry_state else None
    with parallel.merged(run.model):  # --parallel: the adapters' average, adapter_final
        return evaluate(run.model, examples, cfg.batch_size, max_batches, segment, cfg.max_cache)


def _finish(run: Run, task: Task, out: Path) -> None:
    cfg = run.cfg
    if newest_checkpoint(out) != run.step:
        save_checkpoint(out, run)
    final = {}
    if task.val:
        if run.validated is not None and run.validated[0] == run.step:
            final.update(run.validated[1])  # taken (and shown) at the last step
        else:
            final.update(task.validate(run, cfg.val_batches))
            print(f"validation loss {final['val_loss']:.4f}")
    if task.test:
        final.update(task.evaluate_test(run))
        print(f"test loss {final['test_loss']:.4f}")
    if final:
        metrics = outputs.Metrics(out, write=True)
        metrics.add({"step": run.step, **final})
        metrics.close()
    outputs.write_final(run, out)
    if cfg.plot:
        outputs.plot(out)
