"""A training run as its settings say (the ``train`` command's): ``train_from_config(cfg)``
settles the settings once, checks the output folder and locks it, builds the model and what it
trains (``build``), the data (``run_data``; preference pairs: ``preference_run``), the
optimizer and the callbacks, resumes from the newest checkpoint where asked, and calls the
library's ``trainer.train``. Under ``mlx.launch`` every rank runs it; rank 0 alone reads and
writes the output folder."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx.adapters.files import adapter_config
from mlx_rwkvx.adapters.tensors import trainable_count
from mlx_rwkvx.adapters.variants import VARIANTS, saved_lora_parameters
from mlx_rwkvx.data.batches import count_batches
from mlx_rwkvx.errors import USER_ERRNOS, CheckpointError, TrainError, os_error_text
from mlx_rwkvx.io.targets import output_lock, remove_stale
from mlx_rwkvx.ops import prepare
from mlx_rwkvx.tuner import (
    callbacks,
    distributed,
    memory,
    outputs,
    parallel,
    preference_run,
    run_data,
    trainer,
)
from mlx_rwkvx.tuner.build import Built, block_kinds_of, build, twin
from mlx_rwkvx.tuner.checkpoints import newest_checkpoint
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.optimizer import optimizer_for
from mlx_rwkvx.tuner.steps import RunData, Task, TrainState

import mlx.core as mx


def train_from_config(cfg: TrainConfig, log: Callable[[dict], None] | None = None) -> Path | None:
    """Run training as ``cfg`` says; returns the output folder (None on the ranks of a
    data-parallel run other than rank 0, which writes). TrainError (or another UserError) for
    what the user can fix (nothing written), NonFinite when the loss or gradients stop being
    finite, ``Interrupted`` after Ctrl-C or SIGTERM (the step finished and saved).
    ``log(record)`` is called with every step's line of metrics.jsonl (its loss, lr, ...)."""
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
            _run(cfg, out, group, lead=False, log=log)
        return None
    inputs = {"model": cfg.model, "data": cfg.data, "val_data": cfg.val_data}
    real = outputs.check_inputs(out, inputs)
    outputs.check_place(out)
    # the lock inside the folder: a run only adds to it (a folder of one's own under a
    # read-only parent can be trained into)
    with output_lock(real, "--output", inside=True):
        outputs.check_output(out, cfg.resume)
        remove_stale(real)  # what runs killed while writing left (their temporary files)
        with distributed.peers_lost(group):
            return _run(cfg, out, group, lead=True, log=log)


SHORTEST = 64  # tokens: a model that does not fit at rows this short fits at none


def _run(cfg: TrainConfig, out: Path, group, lead: bool, log=None) -> Path:
    mlx_rwkvx.configure()
    shape = twin(cfg)  # before the seed: its lazy adapters draw from MLX's random state
    if shape is not None:  # a model that cannot fit at any length is refused before loading
        _plan_memory(cfg, shape, min(cfg.max_seq_len, SHORTEST))
    del shape
    mx.random.seed(cfg.seed)
    built = build(cfg)
    model = built.model
    chunks = [layer.attn.chunk_size for layer in model.layers if layer.kind == "moba"]
    if cfg.carry_state and chunks and cfg.max_cache < max(chunks):
        raise TrainError(
            f"--max-cache {cfg.max_cache}: MoBA keeps whole chunks of "
            f"{max(chunks)} tokens; give at least one chunk"
        )
    if group is not None and cfg.parallel > 1:
        raise TrainError("--parallel trains N adapters in one process: not under mlx.launch")
    prepare(dtypes=(mx.float32, mx.bfloat16))  # kernels checked before anything compiles
    if cfg.train_mode == "sft":
        task, data = _supervised(cfg, built, group, lead)
    else:  # the reference: the model as built (every adapter starts as the identity)
        task, data = preference_run.task(cfg, built, group, lead)
    if cfg.val_every and task.validate is None and lead:
        print(
            f"--val-every {cfg.val_every}: no validation data (--val-data, or valid.jsonl or "
            "valid.bin in the --data folder): no validation loss",
            file=sys.stderr,
        )
    # the plan at the data's own longest row: the run checkpoints its blocks where it must
    cfg, memory_lines = _plan_memory(cfg, model, data.longest)
    task.checkpoint = cfg.grad_checkpoint
    per_epoch = data.per_epoch
    if group is not None:  # every rank runs the same steps (one with fewer would hang the rest)
        per_epoch = int(mx.distributed.all_min(mx.array(per_epoch), group=group).item())
    total = cfg.iters or cfg.epochs * per_epoch
    optimizer = optimizer_for(cfg, total)
    state = TrainState(stack_tokens=[0] * cfg.parallel, total=total)
    if group is not None:
        state.rank, state.ranks = group.rank(), group.size()
    full = cfg.mode in ("full", "pretrain")
    describe = _describe(cfg, built)
    checkpoints = callbacks.Checkpoints(
        out,
        model,
        optimizer,
        every=cfg.save_every,
        describe=describe,
        settings=asdict(cfg),
        base=built.base,
        full=full,
        write=lead,
    )
    if cfg.resume:
        optimizer.init(model.trainable_parameters())
        if lead:
            checkpoints.resume(state)
    if group is not None:  # every rank starts from rank 0's parameters (and checkpoint)
        distributed.broadcast_state(model, optimizer, state, group)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        _say_what(cfg, model, built, data, state, group, total)
        print("\n".join(memory_lines))

    def write_final(state: TrainState) -> None:
        outputs.write_final(
            out,
            model,
            full=full,
            tokenizer=built.tokenizer,
            config=describe(state),
            settings=asdict(cfg),
            stack_tokens=state.stack_tokens,
        )
        if cfg.plot:
            outputs.plot(out)

    duties = [callbacks.StopRequests(), callbacks.Progress(cfg.log_every, show=lead)]
    if lead and task.validate is not None:
        duties.append(callbacks.Validation(task.validate, cfg.val_every, cfg.val_batches))
    if lead and task.evaluate_test is not None:
        duties.append(callbacks.TestLoss(task.evaluate_test))
    if lead:
        duties.append(callbacks.MetricsFile(out))
    if log is not None:
        duties.append(callbacks.Records(log))
    duties.append(checkpoints)
    if lead:
        duties.append(callbacks.FinalFiles(write_final))
    try:
        trainer.train(
            model,
            task,
            optimizer,
            data.stream(state.position),
            steps=total,
            callbacks=duties,
            grad_accum=cfg.grad_accum,
            seed=cfg.seed,
            state=state,
            group=group,
        )
    except (OSError, CheckpointError) as e:
        if isinstance(e, OSError) and e.errno not in USER_ERRNOS:
            raise
        text = os_error_text(e) if isinstance(e, OSError) else str(e)
        last = newest_checkpoint(out) if lead else None
        kept = (
            f"checkpoint_{last} is the last complete one, kept"
            if last is not None
            else ("no checkpoint was complete yet")
        )
        raise TrainError(f"{text}; {kept}") from e
    return out


def _plan_memory(cfg: TrainConfig, model, T: int) -> tuple[TrainConfig, list[str]]:
    """The run's settings with block checkpointing as its memory needs at rows of ``T`` tokens
    (``memory.plan``: on where it would not fit otherwise; TrainError where it fits in no way),
    and the lines that say its memory."""
    rows = cfg.batch_size * cfg.parallel * (1 if cfg.train_mode == "sft" else 2)
    checkpoint, lines = memory.plan(
        model,
        T,
        rows,
        checkpoint=cfg.grad_checkpoint,
        grad_accum=cfg.grad_accum,
        memory_budget=cfg.memory_budget,
        may_checkpoint=not cfg.lora_dropout,  # dropout's draws would differ in the recompute
    )
    return dataclasses.replace(cfg, grad_checkpoint=checkpoint), lines


def _describe(cfg: TrainConfig, built: Built) -> Callable[[TrainState], dict]:
    """The adapter config of the run's trained tensors at a state (its tokens and steps)."""
    kind = cfg.mode if cfg.mode in ("lora", "dora", "state") else "full"
    facts = {}
    if cfg.mode in VARIANTS:  # saved as the LoRA update it is against the original base
        kind, facts = "lora", {"method": cfg.mode, "method_rank": cfg.lora_rank}
    rank, alpha = saved_lora_parameters(cfg.mode, cfg.lora_rank, cfg.lora_alpha)

    def describe(state: TrainState) -> dict:
        return adapter_config(
            built.model,
            fine_tune_type=kind,
            paths=built.paths if kind != "full" else [],
            rank=rank,
            alpha=alpha,
            dropout=cfg.lora_dropout,
            targets=cfg.lora_targets or "",
            base_fingerprint=built.base,
            seed=cfg.seed,
            tokens_trained=state.tokens,
            steps=state.step,
            **facts,
        )

    return describe


def _supervised(cfg: TrainConfig, built: Built, group, lead: bool) -> tuple[Task, RunData]:
    """The token loss of texts (SFT, pretraining): examples, --parallel parts, the Task."""
    vocab = built.model.config.vocab_size
    examples = run_data.train_examples(cfg, built.tokenizer, vocab)
    examples = distributed.rank_share(examples, group)
    parts = parallel.parts(examples, cfg.parallel)
    val = run_data.validation_examples(cfg, built.tokenizer, vocab) if lead else []
    test = run_data.test_examples(cfg, built.tokenizer, vocab) if lead else []  # read now
    segment = cfg.max_seq_len if cfg.carry_state else None

    def loss_on(examples, max_batches):
        with parallel.merged(built.model):  # --parallel: the adapters' average, adapter_final
            return trainer.evaluate(
                built.model, examples, cfg.batch_size, max_batches, segment, cfg.max_cache
            )

    task = trainer.supervised(
        grad_clip=cfg.grad_clip,
        grad_checkpoint=cfg.grad_checkpoint,
        segment=segment,
        max_cache=cfg.max_cache,
        stacked=cfg.parallel,
    )
    if val:
        task.validate = lambda max_batches: {"val_loss": loss_on(val, max_batches)}
    if test:
        task.evaluate_test = lambda: {"test_loss": loss_on(test, cfg.test_batches)}
    per_epoch = max(1, count_batches(parts[0], cfg.batch_size) // cfg.grad_accum)

    def stream(position):
        return run_data.Stream(parts, cfg.batch_size, cfg.seed, position)

    longest = min(max(len(e.tokens) for e in examples) - 1, cfg.max_seq_len)
    return task, RunData(f"{len(examples)} examples", examples, per_epoch, stream, parts, longest)


def _say_what(
    cfg: TrainConfig, model, built: Built, data: RunData, state: TrainState, group, total: int
) -> None:
    who = f" a rank, {group.size()} ranks (data parallel)" if group is not None else ""
    if cfg.parallel > 1:
        who = f", {cfg.parallel} parts of {len(data.parts[0])} trained at once (--parallel)"
    how = cfg.mode if cfg.train_mode == "sft" else f"{cfg.train_mode} with {cfg.mode}"
    print(
        f"{how}: {trainable_count(model):,} trainable parameters ({len(built.paths)} "
        f"tensors or layers), {data.what}{who}, {total} steps"
        + (f", resuming at step {state.step}" if cfg.resume else "")
    )
    if cfg.carry_state:
        longest = max(len(e) for e in data.examples) - 1
        print(
            f"carry-state: texts of up to {longest:,} tokens, in segments of {cfg.max_seq_len} "
            f"(at most {-(-longest // cfg.max_seq_len)} a text); attention KV window "
            f"{cfg.max_cache} tokens"
        )
