"""The training run: model and adapters, data, the step, checkpoints, resuming, logs.

The step is two functions, so that data parallelism (a later issue) can sit between them:
``loss_and_grad(batch)`` gives the summed loss of one batch, its count of trained tokens and the
gradients of the sum; ``apply_update(grads, count)`` divides by the count, clips the global
norm and takes one AdamW step (``mlx.optimizers``; linear warm-up, then cosine decay).

Checkpoints never lose work: every ``save_every`` steps, at the end and on Ctrl-C,
``checkpoint_<step>.safetensors`` (the trained tensors, what ``load`` and merging read, with
the adapter config in its metadata), ``checkpoint_<step>.state.safetensors`` (optimizer
state, step, data position; each step's randomness comes from the seed and the step) and last
``checkpoint_<step>.json``, the manifest that marks the checkpoint complete, each written
atomically. ``--resume`` continues from the newest
complete one and computes the same losses as the run that was not interrupted.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from dataclasses import asdict, replace
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx import cli
from mlx_rwkvx._crash import crash_point
from mlx_rwkvx.errors import UserError
from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, save_safetensors, save_text
from mlx_rwkvx.io.targets import output_lock, remove_stale
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.io.tokenizers import WORLD_VOCAB, ByteTokenizer, WorldTokenizer, load_tokenizer
from mlx_rwkvx.models import Model, ModelConfig, preset
from mlx_rwkvx.models.config import PRESETS
from mlx_rwkvx.ops import cross_entropy_head, prepare
from mlx_rwkvx.tuner import data as data_mod
from mlx_rwkvx.tuner import parallel as par
from mlx_rwkvx.tuner.adapters import (
    ADAPTER_CONFIG,
    FINAL_ADAPTER,
    AdapterError,
    adapter_config,
    adapter_tensors,
    apply_lora,
    check_rank,
    default_targets,
    enable_state_tuning,
    fingerprint,
    save_adapter,
    save_adapter_tensors,
    target_paths,
    trainable_count,
)
from mlx_rwkvx.tuner.config import FINAL_LR_RATIO, TrainConfig

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import yaml
from mlx.utils import tree_flatten, tree_unflatten
from tqdm import tqdm

METRICS = "metrics.jsonl"
MODEL_DIR = "model"  # full fine-tuning and pretraining write a native model folder here
ADAM_BETAS, ADAM_EPS = (0.9, 0.99), 1e-8  # RWKV's trainers (RWKV-LM, RWKV-PEFT)
# a batch's length is rounded up to a multiple of this (padding the loss skips): fewer distinct
# shapes, so the compiled step is traced a few times rather than once per length
PAD_MULTIPLE = 32


class TrainError(UserError):
    """A run that cannot start or go on because of what it was given (exit 2)."""


class NonFinite(RuntimeError):
    """The loss or a gradient stopped being finite (exit 1; the last checkpoint stays)."""


# ----- model and what it trains -----------------------------------------------------------------


def _model_config(spec: str) -> ModelConfig:
    """A preset name or a JSON/YAML file of ModelConfig fields (--mode pretrain)."""
    if spec in PRESETS:
        return preset(spec)
    if not os.path.isfile(spec):
        raise TrainError(
            f"--model {spec}: for --mode pretrain, a preset ({', '.join(sorted(PRESETS))}) or "
            "a JSON/YAML model config file"
        )
    try:
        with open(spec) as f:
            if spec.endswith((".yaml", ".yml")):
                fields = yaml.safe_load(f)
            else:
                fields = json.load(f)
        return ModelConfig(**fields)
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
        raise TrainError(f"--model {spec}: not a model config ({e})") from e


def build(cfg: TrainConfig):
    """(model with what it trains set up, tokenizer, base fingerprint, trained paths)."""
    if cfg.mode == "pretrain":
        model_cfg = _model_config(cfg.model)
        model = Model(model_cfg, init=cfg.init, seed=cfg.seed)
        tokenizer = (
            WorldTokenizer()
            if model_cfg.vocab_size == 65536
            else ByteTokenizer(model_cfg.vocab_size)
            if model_cfg.vocab_size <= 256
            else None
        )
        if tokenizer is None:
            raise TrainError(
                f"--model {cfg.model}: vocabulary {model_cfg.vocab_size} has no built-in "
                "tokenizer (65536: World, <= 256: bytes)"
            )
    else:
        try:
            model, _ = mlx_rwkvx.load(
                cfg.model, quantize=cfg.quantize, dtype=cfg.dtype, tokenizer=False
            )
        except CheckpointError as e:
            if cfg.model in PRESETS and not os.path.exists(cfg.model):
                how = "only --mode pretrain trains one (from its init); else give a checkpoint"
                raise TrainError(f"--model {cfg.model}: a preset: {how}") from e
            raise TrainError(str(e)) from e
        try:  # pre-tokenized data needs none: a text data set says so if it lacks one
            tokenizer = load_tokenizer(cfg.model, model.config.vocab_size)
        except ValueError as e:
            if _tokenizer_files(cfg.model):  # there is one, and it is broken or foreign
                raise TrainError(str(e)) from e
            tokenizer = None
    base = fingerprint(model)
    try:
        if cfg.mode in ("lora", "dora"):
            targets = cfg.lora_targets or default_targets(model)
            paths = target_paths(model, targets, cfg.num_layers)
            check_rank(model, paths, cfg.lora_rank)
            apply_lora(
                model,
                paths,
                rank=cfg.lora_rank,
                alpha=cfg.lora_alpha,
                dropout=cfg.lora_dropout,
                dora=cfg.mode == "dora",
            )
            if cfg.parallel > 1:
                par.stack_adapters(model, cfg.parallel)
        elif cfg.mode == "state":
            paths = enable_state_tuning(model)
        else:
            if model.quantization is not None:
                raise TrainError(f"--mode {cfg.mode} trains every weight: not a quantized base")
            model.unfreeze()
            paths = [n for n, _ in tree_flatten(model.trainable_parameters())]
    except AdapterError as e:
        raise TrainError(str(e)) from e
    return model, tokenizer, base, paths


def _tokenizer_files(path: str) -> list[str]:
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    return [n for n in ("tokenizer.json", WORLD_VOCAB) if os.path.exists(os.path.join(folder, n))]


def _head(model: Model) -> dict:
    """The head's arrays for ``cross_entropy_head``: the tied embedding or the head layer,
    float or quantized."""
    layer = model.embed if model.config.tie_embeddings else model.lm_head
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return dict(
            weight=layer.weight,
            scales=layer.scales,
            biases=layer.biases,
            group_size=layer.group_size,
            bits=layer.bits,
        )
    return dict(weight=layer.weight)


def batch_loss(model: Model, inputs: mx.array, targets: mx.array, checkpoint: bool = False):
    """(sum of the token losses, number of trained tokens) of one batch."""
    loss, count, _ = segment_loss(model, inputs, targets, None, checkpoint)
    return loss, count


def segment_loss(model: Model, inputs, targets, state=None, checkpoint: bool = False):
    """(sum of the token losses, number of trained tokens, the state after) of one batch that
    continues from ``state`` (None: the start of its texts)."""
    h, state = model.hidden(inputs, state, checkpoint=checkpoint)
    loss, count = cross_entropy_head(
        h, targets=targets, ignore_index=data_mod.IGNORE_INDEX, **_head(model)
    )
    return loss, count, state


def segments(inputs, targets, length: int | None):
    """A batch's columns cut into consecutive segments of ``length`` (None: the batch whole).
    A batch longer than one segment is padded to a whole number of them (padding the loss
    skips), so every segment has the same shape: the compiled step sees one segment length."""
    B, T = inputs.shape
    if length is None or T <= length:
        return [(inputs, targets)]
    pad = -T % length
    if pad:
        inputs = mx.concatenate([inputs, mx.zeros((B, pad), dtype=inputs.dtype)], axis=1)
        ignored = mx.full((B, pad), data_mod.IGNORE_INDEX, dtype=targets.dtype)
        targets = mx.concatenate([targets, ignored], axis=1)
    return [(inputs[:, a : a + length], targets[:, a : a + length]) for a in range(0, T, length)]


# RWKV-7's low-rank projections (LowRank's down and up: BlinkDL's w1/w2, a1/a2, v1/v2, g1/g2)
_LOW_RANK = re.compile(r"\.tmix\.(decay|iclr|value_mix|gate)\.(down|up)\.weight$")


def _no_decay(path: str, param) -> bool:
    # RWKV's trainers (RWKV-LM x070) decay only the matrices named ".weight": the projections,
    # the embedding and the head. Norms, biases, token-shift mixes, decays (w0 is the decay's
    # up.bias), the other per-channel vectors and the low-rank w1/w2-style matrices (their own
    # parameters there, no ".weight") are not decayed
    return param.ndim < 2 or not path.endswith(".weight") or bool(_LOW_RANK.search(path))


def make_optimizer(cfg: TrainConfig, total_steps: int):
    """(optimizer, schedule): AdamW with linear warm-up then cosine decay to the mode's final
    rate; for full fine-tuning and pretraining, no weight decay on norms, biases and other
    vectors and low-rank matrices (RWKV's grouping: see _no_decay)."""
    warmup = min(cfg.warmup, max(total_steps - 1, 0))
    final = cfg.lr * FINAL_LR_RATIO[cfg.mode]
    decay = optim.cosine_decay(cfg.lr, max(total_steps - warmup, 1), final)
    # the warm-up's first step already moves (lr / (warmup + 1)); step `warmup` reaches lr
    warm = optim.linear_schedule(cfg.lr / (warmup + 1), cfg.lr, warmup) if warmup else None
    schedule = optim.join_schedules([warm, decay], [warmup]) if warmup else decay
    adamw = dict(learning_rate=schedule, betas=list(ADAM_BETAS), eps=ADAM_EPS)
    if cfg.mode in ("full", "pretrain"):
        no_decay = optim.AdamW(weight_decay=0.0, **adamw)
        decay = optim.AdamW(weight_decay=cfg.weight_decay, **adamw)
        return optim.MultiOptimizer([no_decay, decay], [_no_decay]), schedule
    return optim.AdamW(weight_decay=cfg.weight_decay, **adamw), schedule


class Step:
    """One training step split in two (see the module docstring), compiled.

    With ``--carry-state`` a batch is trained a segment of ``max_seq_len`` columns at a time:
    each segment starts from the state the previous one ended with (its KV caches cut to
    ``max_cache`` tokens), given as an input, so no gradient crosses the boundary; the
    segments' gradients add up to the step's. The compiled functions see a bounded number of
    shapes (segments and windows of fixed lengths), so they are traced a few times, not per
    step."""

    def __init__(self, model: Model, optimizer, cfg: TrainConfig, group=None):
        self.model, self.optimizer, self.cfg = model, optimizer, cfg
        self.group = group if group is not None and group.size() > 1 else None
        self.shards = cfg.parallel  # --parallel: N adapters side by side, a loss each
        self.stop_requested = False
        self.last_counts = [0] * cfg.parallel  # --parallel: each shard's tokens, last step
        grad_fn = nn.value_and_grad(model, self._loss_sum)
        state = [model.state, optimizer.state, mx.random.state]
        carry = cfg.carry_state

        def first(inputs, targets):  # the start of the texts: the model's own initial state
            (loss, count, after), grads = grad_fn(model, inputs, targets, None)
            return (loss, count, grads, after) if carry else (loss, count, grads)

        def carried(inputs, targets, before):
            (loss, count, after), grads = grad_fn(model, inputs, targets, before)
            return loss, count, grads, after

        def update(grads, count):
            if self.shards > 1:  # each adapter its own mean and its own clipping
                grads, _ = par.per_shard(grads, count, cfg.grad_clip)
                optimizer.update(model, grads)
                return
            grads = _scaled(grads, 1.0 / mx.maximum(count, 1).astype(mx.float32))
            if cfg.grad_clip > 0:
                grads, _ = optim.clip_grad_norm(grads, cfg.grad_clip)
            optimizer.update(model, grads)

        self.first = mx.compile(first, inputs=state, outputs=state)
        self.carried = mx.compile(carried, inputs=state, outputs=state)
        self.apply_update = mx.compile(update, inputs=state, outputs=state)

    def _loss_sum(self, model, inputs, targets, before):
        if self.shards == 1:
            return segment_loss(model, inputs, targets, before, self.cfg.grad_checkpoint)
        # --parallel: rows shard after shard; the summed losses and each shard's token count
        h, _ = model.hidden(inputs, None, checkpoint=self.cfg.grad_checkpoint)
        rows = inputs.shape[0] // self.shards
        total, counts = 0.0, []
        for i in range(self.shards):
            part = slice(i * rows, (i + 1) * rows)
            loss, count = cross_entropy_head(
                h[part], targets=targets[part], ignore_index=data_mod.IGNORE_INDEX, **_head(model)
            )
            total, counts = total + loss, counts + [count]
        return total, mx.stack(counts), None

    def loss_and_grad(self, inputs: mx.array, targets: mx.array):
        """(summed loss, trained tokens, gradients of the sum) of one micro-batch, segment by
        segment with --carry-state (each evaluated before the next: memory holds one)."""
        cfg = self.cfg
        parts = segments(inputs, targets, cfg.max_seq_len if cfg.carry_state else None)
        if len(parts) == 1:
            loss, count, grads = self.first(inputs, targets)[:3]
            mx.eval(loss, count, grads)  # one micro-batch's graph alive at a time
            return loss, count, grads
        loss, count, grads, state = None, None, None, None
        for i, (x, y) in enumerate(parts):
            if state is None:
                part, n, g, state = self.first(x, y)
            else:
                part, n, g, state = self.carried(x, y, state)
            loss, count = (part, n) if loss is None else (loss + part, count + n)
            grads = g if grads is None else _added(grads, g)
            if i + 1 < len(parts):
                state = self.model.trim_state(state, cfg.max_cache)
                mx.eval(loss, count, grads, state)
        mx.eval(loss, count, grads)
        return loss, count, grads

    def __call__(self, micro_batches, stop: bool = False) -> tuple[float, int, float]:
        """(loss sum, trained tokens, gradient norm) of one optimizer step over its
        micro-batches; NonFinite before anything is updated if a value is not finite.
        ``stop``: this process was asked to stop after the step; ``stop_requested`` says
        whether any rank was (decided together, so that all stop at the same step)."""
        total_loss, total_count, grads = 0.0, 0, None
        for inputs, targets in micro_batches:
            loss, count, g = self.loss_and_grad(mx.array(inputs), mx.array(targets))
            grads = g if grads is None else _added(grads, g)
            total_loss += loss
            total_count += count
        self.stop_requested = stop
        if self.group is not None:  # data parallel: sums over every rank's tokens
            flag = mx.array(float(stop))
            grads, total_loss, total_count, flag = all_sum(
                (grads, total_loss, total_count, flag), self.group
            )
            self.stop_requested = flag.item() > 0
        if self.shards > 1:  # the largest of the adapters' gradient norms
            norm = mx.max(par.per_shard(grads, total_count, 0)[1])
        else:
            norm = _global_norm(grads) / mx.maximum(total_count, 1)  # of the mean's gradient
        mx.eval(total_loss, total_count, grads, norm)
        loss_value, norm_value = float(total_loss), norm.item()
        count_value = int(mx.sum(total_count).item())
        if self.shards > 1:
            self.last_counts = [int(c) for c in total_count.tolist()]
        if not math.isfinite(loss_value):
            raise NonFinite(f"the loss is {loss_value}")
        if not math.isfinite(norm_value):
            raise NonFinite(f"the gradient norm is {norm_value}")
        self.apply_update(grads, total_count)
        mx.eval(self.model.parameters(), self.optimizer.state)
        return loss_value, count_value, norm_value


ALL_SUM_BUCKET = 32 << 20  # bytes of gradients summed in one collective (mlx-lm's size)


def all_sum(tree, group):
    """Every array of ``tree`` summed over the ranks of ``group``, in one collective (the
    leaves flattened into one float32 vector and split again)."""
    # in the order of the names: ranks may hold equal trees built in another order (an
    # optimizer state read from a checkpoint, one made fresh)
    leaves = sorted(tree_flatten(tree), key=lambda item: item[0])
    arrays = [mx.array(v) if not isinstance(v, mx.array) else v for _, v in leaves]
    parts, bucket, size = {}, [], 0

    def flush():  # one collective per bucket of at most ALL_SUM_BUCKET bytes (a copy each)
        flat = mx.concatenate([a.astype(mx.float32).reshape(-1) for _, a in bucket])
        summed = mx.distributed.all_sum(flat, group=group)
        start = 0
        for name, a in bucket:
            parts[name] = summed[start : start + a.size].reshape(a.shape).astype(a.dtype)
            start += a.size
        mx.eval([parts[name] for name, _ in bucket])

    for (name, _), a in zip(leaves, arrays, strict=True):
        if bucket and size + 4 * a.size > ALL_SUM_BUCKET:
            flush()
            bucket, size = [], 0
        bucket.append((name, a))
        size += 4 * a.size
    if bucket:
        flush()
    return tree_unflatten([(name, parts[name]) for name, _ in tree_flatten(tree)])


def broadcast(tree, group):
    """``tree`` as rank 0 of ``group`` holds it, on every rank (an all-sum of rank 0's values
    and everybody else's zeros): a resumed run's state reaches the other Macs without files."""
    if group is None or group.size() == 1:
        return tree
    if group.rank() != 0:
        tree = tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(tree)])
    return all_sum(tree, group)


def _scaled(tree, factor):
    return tree_unflatten([(k, v * factor) for k, v in tree_flatten(tree)])


def _added(a, b):
    return tree_unflatten(
        [(k, x + y) for (k, x), (_, y) in zip(tree_flatten(a), tree_flatten(b), strict=True)]
    )


def _global_norm(tree) -> mx.array:
    return mx.sqrt(sum(mx.sum(mx.square(v.astype(mx.float32))) for _, v in tree_flatten(tree)))


# ----- checkpoints ------------------------------------------------------------------------------


def _checkpoint_names(step: int) -> dict[str, str]:
    base = f"checkpoint_{step}"
    return {
        "weights": f"{base}.safetensors",
        "state": f"{base}.state.safetensors",
        "manifest": f"{base}.json",
    }


def newest_checkpoint(out: Path) -> int | None:
    """The step of the newest complete checkpoint in ``out`` (its manifest written last, every
    file it names present), or None."""
    return scan_checkpoints(out)[0]


_CHECKPOINT_FILE = re.compile(r"checkpoint_(\d+)\.(json|safetensors|state\.safetensors)\Z")


def scan_checkpoints(out: Path) -> tuple[int | None, dict[int, str]]:
    """(the newest complete checkpoint's step or None, {step: why it is not complete} for the
    newer ones whose files are there: a run stopped while saving, a damaged manifest)."""
    steps = set()
    for path in out.glob("checkpoint_*"):
        found = _CHECKPOINT_FILE.match(path.name)
        if found:
            steps.add(int(found.group(1)))
    broken = {}
    for step in sorted(steps, reverse=True):
        manifest_path = out / _checkpoint_names(step)["manifest"]
        if not manifest_path.exists():
            broken[step] = "no manifest: the run stopped while saving it"
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"] if manifest.get("complete") else None
        except (ValueError, OSError, AttributeError, KeyError, TypeError):
            broken[step] = "its manifest cannot be read"
            continue
        if not isinstance(files, list):
            broken[step] = "its manifest lists no files"
            continue
        missing = [str(f) for f in files if not (out / str(f)).exists()]
        if missing:
            broken[step] = f"{missing[0]} is missing"
            continue
        return step, broken
    return None, broken


def trained_tensors(model: Model, mode: str) -> dict[str, mx.array]:
    """What a run trains, under the model's paths: the adapter's tensors, or for full
    fine-tuning and pretraining every trainable weight."""
    if mode in ("full", "pretrain"):
        return dict(tree_flatten(model.trainable_parameters()))
    return adapter_tensors(model)


# settings that decide what the trained tensors are and which batches come next: a run
# resumes only with the ones it was started with
RESUME_FIXED = ("mode", "lora_rank", "lora_alpha", "lora_targets", "num_layers", "quantize",
                "dtype", "init", "sql", "skip_bad", "mask_prompt", "max_seq_len", "batch_size",
                "grad_accum", "seed", "carry_state", "max_cache", "parallel")  # fmt: skip


def save_checkpoint(out: Path, run) -> None:
    """The three files of one checkpoint, the manifest last; each atomically. A checkpoint is
    whole or absent: if a write fails (a full disk) or is interrupted, the files of this one
    already written are removed again, and the older checkpoints stay as they were."""
    names = _checkpoint_names(run.step)
    try:
        _save_checkpoint(out, run, names)
    except BaseException:
        for key in ("manifest", "state", "weights"):  # the manifest first: never complete
            (out / names[key]).unlink(missing_ok=True)
        raise


def _save_checkpoint(out: Path, run, names: dict[str, str]) -> None:
    if run.cfg.mode in ("full", "pretrain"):
        with atomic_target(str(out / names["weights"]), folder=False) as tmp:
            config = json.dumps(run.adapter_config())
            save_safetensors(tmp, trained_tensors(run.model, "full"), {"adapter_config": config})
    else:
        save_adapter(out / names["weights"], run.model, run.adapter_config())
    state = dict(tree_flatten(run.optimizer.state))
    meta = {"step": str(run.step), "position": json.dumps(run.position), "tokens": str(run.tokens),
            "train": json.dumps(asdict(run.cfg)), "base": run.base, "ranks": str(run.ranks),
            "shard_tokens": json.dumps(run.shard_tokens)}  # fmt: skip
    with atomic_target(str(out / names["state"]), folder=False) as tmp:
        save_safetensors(tmp, state, meta)
    crash_point("save", run.step)  # weights and state written, the manifest not yet
    manifest = {"complete": True, "step": run.step, "files": [names["weights"], names["state"]]}
    with atomic_target(str(out / names["manifest"]), folder=False) as tmp:
        save_text(tmp, json.dumps(manifest))


def _read_checkpoint_file(path: Path, step: int):
    """(tensors, metadata) of one file of checkpoint ``step``; TrainError when it cannot be
    read (cut short after its manifest was written: a partial copy, a failing disk)."""
    try:
        return read_safetensors(str(path))
    except CheckpointError as e:
        hint = f"remove checkpoint_{step}.* to resume from an older one"
        raise TrainError(f"--resume: {e}; {hint}") from None


def load_checkpoint(out: Path, step: int, run) -> None:
    """Restore ``run`` from checkpoint ``step``: TrainError when it was made by a run with
    other settings (see RESUME_FIXED) or on another base, its tensors do not fit, or a file
    of it cannot be read."""
    names = _checkpoint_names(step)
    state, meta = _read_checkpoint_file(out / names["state"], step)
    then = json.loads(meta.get("train", "{}"))
    changed = [k for k in RESUME_FIXED if k in then and then[k] != getattr(run.cfg, k)]
    if changed:
        was = ", ".join(f"{k.replace('_', '-')} {then[k]!r} (now {getattr(run.cfg, k)!r})"
                        for k in changed)  # fmt: skip
        raise TrainError(f"--resume: checkpoint_{step} was trained with {was}; resume with the "
                         "run's settings or start a new --output")  # fmt: skip
    if meta.get("base", run.base) != run.base:
        raise TrainError(f"--resume: checkpoint_{step} was trained on another base model")
    if int(meta.get("ranks", 1)) != run.ranks:  # the shards and data positions depend on it
        raise TrainError(f"--resume: checkpoint_{step} was trained on {meta.get('ranks', 1)} "
                         f"ranks, this run has {run.ranks}; resume with as many")  # fmt: skip
    others = [k for k in ("lr", "warmup", "weight_decay", "grad_clip", "iters", "epochs", "data")
              if k in then and then[k] != getattr(run.cfg, k)]  # fmt: skip
    if others:
        print(f"note: resuming with other {', '.join(others)} than checkpoint_{step}'s run",
              file=sys.stderr)  # fmt: skip
    weights, _ = _read_checkpoint_file(out / names["weights"], step)
    expected = {n: tuple(x.shape) for n, x in trained_tensors(run.model, run.cfg.mode).items()}
    wrong = sorted(set(weights) ^ set(expected)) + sorted(
        n for n in weights if n in expected and tuple(weights[n].shape) != expected[n]
    )
    if wrong:
        raise TrainError(f"--resume: checkpoint_{step}'s tensors do not fit this run: {wrong[:4]}")
    run.model.load_weights(list(weights.items()), strict=False)
    run.optimizer.state = tree_unflatten(list(state.items()))
    run.step, run.tokens = int(meta["step"]), int(meta["tokens"])
    run.shard_tokens = json.loads(meta.get("shard_tokens", "[]")) or run.shard_tokens
    run.position = json.loads(meta["position"])
    mx.eval(run.model.parameters(), run.optimizer.state)


# ----- the run ----------------------------------------------------------------------------------


class Run:
    """What a training run holds between steps (what a checkpoint saves)."""

    def __init__(self, cfg, model, tokenizer, base, paths, optimizer, schedule):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.base, self.paths = base, paths
        self.optimizer, self.schedule = optimizer, schedule
        self.step, self.tokens = 0, 0
        self.position = {"epoch": 0, "batch": 0}
        self.lead = True  # rank 0 of a data-parallel run (or the only one): it writes
        self.rank, self.ranks = 0, 1
        self.shard_tokens = [0] * cfg.parallel  # --parallel: the tokens each adapter trained on
        self.validated = None  # (step, validation loss) of the latest --val-every validation

    def adapter_config(self) -> dict:
        cfg = self.cfg
        kind = cfg.mode if cfg.mode in ("lora", "dora", "state") else "full"
        return adapter_config(
            self.model,
            fine_tune_type=kind,
            paths=self.paths if kind != "full" else [],
            rank=cfg.lora_rank,
            alpha=cfg.lora_alpha,
            dropout=cfg.lora_dropout,
            targets=cfg.lora_targets or "",
            base_fingerprint=self.base,
            seed=cfg.seed,
            tokens_trained=self.tokens,
            steps=self.step,
        )


PLOT = "loss.png"
_WRITTEN = re.compile(
    r"(checkpoint_\d+\.(json|safetensors|state\.safetensors)|thread_\d+\.safetensors)\Z"
)


def _check_place(out: Path) -> None:
    """--output must be, or become, a folder."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"--output {out}: is a file")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():  # the folder could never be made
        raise TrainError(f"--output {out}: {above} is a file")


def _check_output(out: Path, resume: bool) -> None:
    """A new run needs a folder holding none of the files a run writes (a metrics.jsonl of a
    run that stopped before its first checkpoint is replaced); --resume needs a complete
    checkpoint. Neither writes through a symbolic link among those names."""
    if not out.is_dir():
        return
    named = (METRICS, ADAPTER_CONFIG, FINAL_ADAPTER, MODEL_DIR, PLOT)
    ours = [p for p in out.iterdir() if p.name in named or _WRITTEN.match(p.name)]
    links = [p.name for p in ours if p.is_symlink()]
    if links:
        raise TrainError(f"--output {out}: {links[0]} is a symbolic link; a run writes its own "
                         "files there, never through a link: choose another folder")  # fmt: skip
    if resume:
        if newest_checkpoint(out) is None:
            raise TrainError(f"--output {out}: --resume, but there is no complete checkpoint "
                             "there")  # fmt: skip
        return
    others = [p.name for p in ours if p.name != METRICS or not _is_metrics(p)]
    if newest_checkpoint(out) is not None or any(n in (FINAL_ADAPTER, MODEL_DIR) for n in others):
        raise TrainError(f"--output {out}: holds another run; pass --resume or choose a folder")
    if others:
        raise TrainError(f"--output {out}: holds {sorted(others)[:4]}, which a run writes; "
                         "choose an empty or new folder")  # fmt: skip


def _is_metrics(path: Path) -> bool:
    """Whether ``path`` is a run's metrics.jsonl: every line a JSON object with a step (the
    last one may be cut short: the run died while writing it)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, ValueError):
        return False
    records = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: cut short
                continue
            return False
        if not isinstance(record, dict) or "step" not in record:
            return False
        records += 1
    return records > 0


def _examples(cfg, tokenizer, vocab, split="train", path=None):
    reasons = []
    try:
        examples, skipped = data_mod.load_examples(
            path or cfg.data,
            tokenizer,
            split=split,
            sql=cfg.sql,
            max_seq_len=None if cfg.carry_state else cfg.max_seq_len,  # else: whole, in segments
            skip_bad=cfg.skip_bad,
            vocab_size=vocab,
            on_skip=reasons.append,
        )
    except data_mod.DataError as e:
        raise TrainError(str(e)) from e
    if not cfg.mask_prompt:  # every token after the first is a target
        examples = [replace(e, trained=np.arange(len(e.tokens)) > 0) for e in examples]
    if skipped:
        print(f"skipped {skipped} bad examples of {path or cfg.data} ({split}):", file=sys.stderr)
        for reason in reasons[:10]:
            print(f"  {reason}", file=sys.stderr)
    note = data_mod.cut_note(examples, cfg.max_seq_len, "--max-seq-len")
    if note:
        print(f"{note} ({split}; --carry-state trains long texts whole)", file=sys.stderr)
    return examples


def evaluate(
    model: Model,
    examples,
    batch_size: int,
    max_batches: int | None = None,
    segment: int | None = None,
    max_cache: int | None = None,
) -> float:
    """The mean token loss over ``examples`` (the first ``max_batches`` batches, in a fixed
    order) with dropout off; ``segment``: long texts a segment of that many tokens at a time,
    the state carried (its KV caches cut to ``max_cache`` tokens), as --carry-state trains."""
    total, count = 0.0, 0
    was_training = model.training
    model.eval()
    try:
        stream = data_mod.batches(
            examples, batch_size=batch_size, seed=0, epoch=0, pad_to_multiple=PAD_MULTIPLE
        )
        for i, (inputs, targets) in enumerate(stream):
            if max_batches is not None and i >= max_batches:
                break
            state = None
            for x, y in segments(mx.array(inputs), mx.array(targets), segment):
                if state is not None and max_cache is not None:
                    state = model.trim_state(state, max_cache)
                loss, n, state = segment_loss(model, x, y, state)
                mx.eval(loss, n, state)
                total, count = total + loss.item(), count + n.item()
    finally:
        model.train(was_training)
    return total / max(count, 1)


def train(cfg: TrainConfig) -> Path | None:
    """Run training as ``cfg`` says; returns the output folder (None on the ranks of a
    data-parallel run other than rank 0, which writes). TrainError (or another UserError) for
    what the user can fix (nothing written), NonFinite when the loss or gradients stop being
    finite, ``cli.Interrupted`` after Ctrl-C or SIGTERM (the step finished and saved)."""
    try:
        cfg = cfg.resolved()
    except ValueError as e:
        raise TrainError(str(e)) from e
    for name in ("model", "data", "output"):
        if not getattr(cfg, name):
            raise TrainError(f"--{name} is required")
    out = Path(cfg.output)
    group = _group()
    if group is not None and group.rank() != 0:  # rank 0 alone reads and writes files
        _train(cfg, out, group, lead=False)
        return None
    real = _check_inputs(out, cfg)
    _check_place(out)
    # the lock inside the folder: a run only adds to it (a folder of one's own under a
    # read-only parent can be trained into)
    with output_lock(real, "--output", inside=True):
        _check_output(out, cfg.resume)
        remove_stale(real)  # what runs killed while writing left (their temporary files)
        return _train(cfg, out, group, lead=True)


def _check_inputs(out: Path, cfg: TrainConfig) -> str:
    """The real path of --output: TrainError when it, or a file the run writes into it, is
    one of the run's inputs (training only adds files, and never over what it reads)."""
    real = os.path.realpath(out)
    written = [os.path.join(real, name) for name in (MODEL_DIR, FINAL_ADAPTER, ADAPTER_CONFIG,
                                                      METRICS)]  # fmt: skip
    for name in ("model", "data", "val_data"):
        given = getattr(cfg, name)
        if not given or not os.path.lexists(given):
            continue
        source = os.path.realpath(given)
        if source == real or source in written or source.startswith(written[0] + os.sep):
            what = "is" if source == real else "would write over"
            raise TrainError(f"--output {out}: {what} the --{name.replace('_', '-')} {given}; "
                             "choose another output folder")  # fmt: skip
    return real


def _train(cfg: TrainConfig, out: Path, group, lead: bool) -> Path:
    mlx_rwkvx.configure()
    mx.random.seed(cfg.seed)
    model, tokenizer, base, paths = build(cfg)
    chunks = [layer.attn.chunk_size for layer in model.layers if layer.kind == "moba"]
    if cfg.carry_state and chunks and cfg.max_cache < max(chunks):
        raise TrainError(f"--max-cache {cfg.max_cache}: MoBA keeps whole chunks of "
                         f"{max(chunks)} tokens; give at least one chunk")  # fmt: skip
    prepare(dtypes=(mx.float32, mx.bfloat16))  # kernels checked before anything compiles
    family = set(model.config.block_types)
    if cfg.max_seq_len is None:
        cfg.max_seq_len = 256 if "qwen2" in family else 512  # rfa_train / rx_train
    vocab = model.config.vocab_size
    if group is not None and cfg.parallel > 1:
        raise TrainError("--parallel trains N adapters in one process: not under mlx.launch")
    train_examples = _shard(_examples(cfg, tokenizer, vocab), group)
    if cfg.parallel > 1:
        try:
            shards = par.equal_shards(train_examples, cfg.parallel)
        except ValueError as e:
            raise TrainError(str(e)) from e
        left = len(train_examples) - cfg.parallel * len(shards[0])
        if left:
            print(f"note: --parallel {cfg.parallel}: {left} of {len(train_examples)} examples "
                  "left out (the shards are equal: the remainder of the division)",
                  file=sys.stderr)  # fmt: skip
    val_examples = _validation(cfg, tokenizer, vocab) if lead else []
    if cfg.val_every and not val_examples and lead:
        print(f"--val-every {cfg.val_every}: no validation data (--val-data, or valid.jsonl or "
              "valid.bin in the --data folder): no validation loss", file=sys.stderr)  # fmt: skip
    # read now: bad data stops the start
    test_examples = _test_split(cfg, tokenizer, vocab) if lead else []
    per_shard = shards[0] if cfg.parallel > 1 else train_examples
    per_epoch = max(1, data_mod.count_batches(per_shard, cfg.batch_size) // cfg.grad_accum)
    if group is not None:  # every rank runs the same steps (one with fewer would hang the rest)
        per_epoch = int(mx.distributed.all_min(mx.array(per_epoch), group=group).item())
    total = cfg.iters or cfg.epochs * per_epoch
    optimizer, schedule = make_optimizer(cfg, total)
    run = Run(cfg, model, tokenizer, base, paths, optimizer, schedule)
    run.lead = lead
    if group is not None:
        run.rank, run.ranks = group.rank(), group.size()
    if cfg.resume:
        optimizer.init(model.trainable_parameters())
        if lead:
            step, broken = scan_checkpoints(out)
            if step is None:
                raise TrainError(f"--output {out}: no complete checkpoint to resume from")
            for newer, why in broken.items():
                print(f"--resume: skipped checkpoint_{newer} ({why}); resuming from "
                      f"checkpoint_{step}", file=sys.stderr)  # fmt: skip
            load_checkpoint(out, step, run)
    if group is not None:  # every rank starts from rank 0's parameters (and checkpoint)
        _broadcast_run(run, group)
    say = print if lead else (lambda *a, **k: None)
    if lead:
        out.mkdir(parents=True, exist_ok=True)
        _keep_metrics(out / METRICS, run.step)
    ranks = f", {group.size()} ranks (data parallel)" if group is not None else ""
    if cfg.parallel > 1:
        ranks = f", {cfg.parallel} shards of {len(per_shard)} trained at once"
    say(
        f"{cfg.mode}: {trainable_count(model):,} trainable parameters "
        f"({len(paths)} tensors or layers), {len(train_examples)} examples{ranks}, {total} steps"
        + (f", resuming at step {run.step}" if cfg.resume else "")
    )
    if cfg.carry_state and lead:
        longest = max(len(e) for e in train_examples) - 1
        print(
            f"carry-state: texts of up to {longest:,} tokens, in segments of {cfg.max_seq_len} "
            f"(at most {-(-longest // cfg.max_seq_len)} a text); attention KV window "
            f"{cfg.max_cache} tokens"
        )
    step_fn = Step(model, optimizer, cfg, group)
    try:
        stop = _Interrupt()
        try:
            data = shards if cfg.parallel > 1 else train_examples
            _loop(run, step_fn, data, val_examples, total, out, stop)
        finally:
            stop.restore()  # the end (evaluation, final files): Ctrl-C stops it at once
        if lead:
            _finish(run, val_examples, test_examples, out)
    except (OSError, CheckpointError) as e:
        if isinstance(e, OSError) and e.errno not in cli.USER_ERRNOS:
            raise
        text = cli.os_error_text(e) if isinstance(e, OSError) else str(e)
        last = newest_checkpoint(out) if lead else None
        kept = f"checkpoint_{last} is the last complete one, kept" if last is not None else (
            "no checkpoint was complete yet")  # fmt: skip
        raise TrainError(f"{text}; {kept}") from e
    return out


def _group():
    """The data-parallel group when launched by ``mlx.launch`` on several ranks, else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def _shard(examples, group):
    """Rank r's share of the examples: every size-th from r, the remainder of the division
    left out, so that every rank has as many (and so as many batches and steps)."""
    if group is None:
        return examples
    size = group.size()
    keep = len(examples) // size * size
    if keep == 0:
        raise TrainError(f"{len(examples)} training examples for {size} ranks: too few to shard")
    if keep < len(examples) and group.rank() == 0:
        print(f"note: {len(examples) - keep} of {len(examples)} examples left out: every one of "
              f"the {size} ranks trains as many", file=sys.stderr)  # fmt: skip
    return examples[group.rank() : keep : size]


def _broadcast_run(run, group) -> None:
    """Rank 0's trainable parameters, optimizer state, step, tokens and data position on
    every rank."""
    run.model.update(broadcast(run.model.trainable_parameters(), group))
    if run.optimizer.state:
        run.optimizer.state = broadcast(run.optimizer.state, group)
    pos = run.position
    counters = [run.step, run.tokens, pos["epoch"], pos["batch"], *run.shard_tokens]
    # integers summed as integers (a float32 sum would round a count above 2^24); tokens as
    # two 31-bit halves, so that no count overflows int32
    ints = [part for c in counters for part in (c >> 31, c & (2**31 - 1))]
    mine = mx.array(ints if group.rank() == 0 else [0] * len(ints), dtype=mx.int32)
    summed = mx.distributed.all_sum(mine, group=group).tolist()
    step, tokens, epoch, batch, *shards = [
        (hi << 31) + lo for hi, lo in zip(summed[::2], summed[1::2], strict=True)
    ]
    run.step, run.tokens, run.position = step, tokens, {"epoch": epoch, "batch": batch}
    run.shard_tokens = shards
    mx.eval(run.model.parameters(), run.optimizer.state)


def _test_split(cfg, tokenizer, vocab):
    """--test: the data folder's test split (none there: said, and nothing to evaluate)."""
    if not cfg.test:
        return []
    try:
        found = data_mod.find_split(cfg.data, "test") if os.path.isdir(cfg.data) else None
    except data_mod.DataError as e:
        raise TrainError(str(e)) from e
    if found is None:
        print(f"--test: {cfg.data} has no test split (test.jsonl or test.bin)", file=sys.stderr)
        return []
    return _examples(cfg, tokenizer, vocab, "test", found)


def _keep_metrics(path: Path, step: int) -> None:
    """The metrics of the steps up to ``step`` (a new run: none; a resumed one: those of the
    checkpoint it continues from, not those of the steps the interruption lost)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (ValueError, AttributeError):  # a line the interruption cut short
            continue
    with atomic_target(str(path), folder=False) as tmp:
        save_text(tmp, "".join(line + "\n" for line in kept))


def _validation(cfg, tokenizer, vocab):
    """--val-data, else the data folder's valid split (valid.jsonl or valid.bin), if any."""
    if cfg.val_data:
        return _examples(cfg, tokenizer, vocab, "valid", cfg.val_data)
    try:
        found = data_mod.find_split(cfg.data, "valid") if os.path.isdir(cfg.data) else None
    except data_mod.DataError as e:
        raise TrainError(str(e)) from e
    return _examples(cfg, tokenizer, vocab, "valid", found) if found else []


class _Interrupt:
    """Ctrl-C or SIGTERM during training: finish the step, save, stop (a second one stops at
    once: Ctrl-C's KeyboardInterrupt, or whatever SIGTERM did before)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.signum = None
        self._old = {}
        if threading.current_thread() is threading.main_thread():
            self._old = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}

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


def _micro_batches(run, examples):
    """Micro-batches from the run's data position on, epoch after epoch; with --parallel
    (``examples`` a list of shards) each is the shards' batches, one after the other."""
    cfg = run.cfg
    shards = examples if cfg.parallel > 1 else [examples]
    while True:
        epoch, start = run.position["epoch"], run.position["batch"]
        streams = [
            data_mod.batches(
                shard,
                batch_size=cfg.batch_size,
                seed=cfg.seed,
                epoch=epoch,
                start=start,
                pad_to_multiple=PAD_MULTIPLE,
            )
            for shard in shards
        ]
        # equal shards: equally many batches (strict=False: zip stops with the shortest)
        for i, parts in enumerate(zip(*streams, strict=False)):
            run.position = {"epoch": epoch, "batch": start + i + 1}
            yield parts[0] if len(parts) == 1 else _side_by_side(parts, cfg.batch_size)
        run.position = {"epoch": epoch + 1, "batch": 0}


def _side_by_side(parts, rows: int):
    """The shards' batches as one: each padded to ``rows`` rows and the longest length (rows
    and columns that the loss skips; a recurrent row's padding after it changes nothing)."""
    T = max(x.shape[1] for x, _ in parts)
    inputs = np.zeros((len(parts) * rows, T), dtype=np.int32)
    targets = np.full((len(parts) * rows, T), data_mod.IGNORE_INDEX, dtype=np.int32)
    for i, (x, y) in enumerate(parts):
        inputs[i * rows : i * rows + x.shape[0], : x.shape[1]] = x
        targets[i * rows : i * rows + y.shape[0], : y.shape[1]] = y
    return inputs, targets


def _loop(run, step_fn, examples, val_examples, total, out, stop):
    cfg, lead = run.cfg, run.lead
    # only rank 0 (the lead) writes: the other ranks' metrics go nowhere
    metrics = open(out / METRICS if lead else os.devnull, "a")  # noqa: SIM115 (closed below)
    stream = _micro_batches(run, examples)
    started, seen = time.perf_counter(), 0
    bar = tqdm(total=total, initial=run.step, unit="step", dynamic_ncols=True, leave=False,
               disable=not lead)  # fmt: skip
    try:
        while run.step < total:
            batch = [next(stream) for _ in range(cfg.grad_accum)]
            lr = float(run.schedule(run.step))
            # each step's randomness (dropout) from the seed and the step alone: a resumed run
            # draws what the uninterrupted one drew, with no random state to save
            # (another rank another draw: its rows are other rows)
            mx.random.seed((cfg.seed * 1_000_003 + run.step + 7_919 * run.rank) % 2**64)
            try:
                loss, count, norm = step_fn(batch, stop=stop.requested)
            except NonFinite as e:
                last = newest_checkpoint(out)
                kept = f"checkpoint_{last}" if last is not None else "no checkpoint yet"
                raise NonFinite(f"step {run.step + 1}: {e}; stopped (kept: {kept})") from None
            run.step += 1
            run.tokens += count
            if cfg.parallel > 1:
                run.shard_tokens = [a + b for a, b in zip(run.shard_tokens, step_fn.last_counts,
                                                          strict=True)]  # fmt: skip
            seen += sum(int(inputs.size) for inputs, _ in batch)
            bar.update(1)
            crash_point("step", run.step)
            record = {"step": run.step, "loss": loss / max(count, 1), "grad_norm": norm,
                      "lr": lr, "tokens": run.tokens}  # fmt: skip
            if lead and (run.step % cfg.log_every == 0 or run.step == total):
                record["tokens_per_s"] = seen / max(time.perf_counter() - started, 1e-9)
                record["peak_memory_gb"] = mx.get_peak_memory() / 1e9
                bar.write(
                    f"step {run.step}/{total}: loss {record['loss']:.4f}, lr {lr:.2e}, "
                    f"{record['tokens_per_s']:.0f} tok/s, peak {record['peak_memory_gb']:.2f} GB"
                )
            if lead and val_examples and cfg.val_every and run.step % cfg.val_every == 0:
                record["val_loss"] = _evaluate(run, val_examples, cfg.val_batches)
                run.validated = (run.step, record["val_loss"])
                bar.write(f"step {run.step}: validation loss {record['val_loss']:.4f}")
            metrics.write(metrics_line(record))
            metrics.flush()
            stopping = stop.requested or step_fn.stop_requested  # on any rank: on all
            if lead and (run.step % cfg.save_every == 0 or stopping):
                save_checkpoint(out, run)
                # a signal during the save: that checkpoint is the step's (several ranks
                # decide together, in the next step's collective)
                stopping = stopping or (step_fn.group is None and stop.requested)
            if stopping:
                saved = f"saved checkpoint_{run.step}" if lead else "rank 0 saved its checkpoint"
                raise cli.Interrupted(stop.signum or signal.SIGINT, saved)
    finally:
        bar.close()
        metrics.close()


def metrics_line(record: dict) -> str:
    """One line of metrics.jsonl: strict JSON, a value that is not finite written as null."""
    clean = {k: None if isinstance(v, float) and not math.isfinite(v) else v
             for k, v in record.items()}  # fmt: skip
    return json.dumps(clean, allow_nan=False) + "\n"


def _evaluate(run, examples, max_batches) -> float:
    cfg = run.cfg
    if cfg.parallel > 1:  # the adapters' average: what adapter_final will be
        par.set_merged(run.model, True)
        try:
            return evaluate(run.model, examples, cfg.batch_size, max_batches)
        finally:
            par.set_merged(run.model, False)
    if not cfg.carry_state:
        return evaluate(run.model, examples, cfg.batch_size, max_batches)
    return evaluate(run.model, examples, cfg.batch_size, max_batches, cfg.max_seq_len,
                    cfg.max_cache)  # fmt: skip


def _finish(run, val_examples, test_examples, out: Path) -> None:
    cfg = run.cfg
    if newest_checkpoint(out) != run.step:
        save_checkpoint(out, run)
    final = {}
    if val_examples:
        if run.validated is not None and run.validated[0] == run.step:
            final["val_loss"] = run.validated[1]  # taken (and shown) at the last step
        else:
            final["val_loss"] = _evaluate(run, val_examples, cfg.val_batches)
            print(f"validation loss {final['val_loss']:.4f}")
    if test_examples:
        final["test_loss"] = _evaluate(run, test_examples, cfg.test_batches)
        print(f"test loss {final['test_loss']:.4f}")
    if final:
        with open(out / METRICS, "a") as f:
            f.write(metrics_line({"step": run.step, **final}))
    if cfg.parallel > 1:  # rfa_train's outputs: thread_<i> and their FedAvg
        config = run.adapter_config()
        stacked = adapter_tensors(run.model)
        for i in range(cfg.parallel):
            thread = {**config, "parallel": cfg.parallel, "thread": i,
                      "tokens_trained": run.shard_tokens[i]}  # fmt: skip
            save_adapter_tensors(out / f"thread_{i}.safetensors", par.shard_tensors(stacked, i),
                                 thread)  # fmt: skip
        save_adapter_tensors(out / FINAL_ADAPTER, par.averaged(stacked), config)
        with atomic_target(str(out / ADAPTER_CONFIG), folder=False) as tmp:
            save_text(tmp, json.dumps({**config, "train": asdict(cfg)}, indent=2))
        print(f"wrote {out / FINAL_ADAPTER} (the FedAvg of thread_0..{cfg.parallel - 1})")
    elif cfg.mode in ("lora", "dora", "state"):
        config = run.adapter_config()
        save_adapter(out / FINAL_ADAPTER, run.model, config)
        with atomic_target(str(out / ADAPTER_CONFIG), folder=False) as tmp:
            save_text(tmp, json.dumps({**config, "train": asdict(cfg)}, indent=2))
        print(f"wrote {out / FINAL_ADAPTER}")
    else:
        mlx_rwkvx.save(run.model, out / MODEL_DIR, tokenizer=run.tokenizer, overwrite=True)
        print(f"wrote {out / MODEL_DIR}")
    if cfg.plot:
        _plot(out)


def _plot(out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install 'mlx_rwkvx[plot]')")
        return
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train, strict=True), label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.savefig(out / PLOT, dpi=100)
    print(f"wrote {out / PLOT}")
