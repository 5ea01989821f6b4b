"""A preference run (``--train-mode dpo`` or ``orpo``): the trainer's ``Task`` of preference
pairs (``tuner/preference.py``): its step (``PreferenceStep``) and evaluation, and, built from
a run's settings (``task``), the pairs of the data folder's train and valid splits and their
stream of micro-batches.

DPO's reference is the model as the run builds it, before any step: every adapter starts as
the identity (LoRA's and MiSS's B are zeros, DoRA's magnitude is the weight's norm, PiSSA's
residual plus A0 B0 is the base, a state-tuned state starts at zeros) and full fine-tuning
starts at the base. Its log-probabilities of every pair's answers are computed once, before
the first step (and again on ``--resume``, before the checkpoint is loaded): 8 bytes a pair,
no second copy of the weights, and a step costs the policy's forward and backward alone.
"""

from __future__ import annotations

import math
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from functools import partial

from mlx_rwkvx.data.records import find_split
from mlx_rwkvx.errors import DataError, NonFinite, TrainError
from mlx_rwkvx.ops import tuning
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.distributed import all_sum, rank_share
from mlx_rwkvx.tuner.preference import (
    Pair,
    PreferenceTerms,
    load_pairs,
    pair_logprobs,
    preference_loss,
)
from mlx_rwkvx.tuner.steps import RunData, StepResult, Task
from mlx_rwkvx.tuner.trainer import tune_on_rank0, tuning_on

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_map

SUMS = tuple(f.name for f in fields(PreferenceTerms))  # a batch's sums over its pairs


def _pairs(tokenizer, vocab: int, split: str, path: str | None, max_seq_len: int) -> list[Pair]:
    file = find_split(path, split) if path else None
    if file is None:
        if split == "train":
            raise TrainError(f"--data {path}: no {split}.jsonl of preference pairs")
        return []
    if tokenizer is None:
        raise TrainError(f"{file}: preference pairs need the model's tokenizer")
    try:
        return load_pairs(file, tokenizer, max_seq_len=max_seq_len, vocab_size=vocab)
    except DataError as e:
        raise TrainError(str(e)) from e


def _batches(n: int, size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The epoch's batches of pair indices, in the seed's and the epoch's order."""
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i : i + size] for i in range(0, n - n % size or n, size)]


def reference_logprobs(model, pairs: list[Pair], batch_size: int) -> np.ndarray:
    """``[len(pairs), 2]``: the model's log-probabilities of each pair's chosen and rejected
    answers, dropout off."""
    was = model.training
    model.eval()
    out = np.zeros((len(pairs), 2), dtype=np.float32)
    try:
        for start in range(0, len(pairs), batch_size):
            chosen, rejected, _, _ = pair_logprobs(model, pairs[start : start + batch_size])
            mx.eval(chosen, rejected)
            out[start : start + len(chosen)] = np.stack([chosen, rejected], axis=1)
    finally:
        model.train(was)
    return out


def _no_reference(model, pairs: list[Pair], batch_size: int) -> np.ndarray:
    return np.zeros((len(pairs), 2), dtype=np.float32)  # ORPO has no reference


def _means(sums: dict, n: int, prefix: str = "") -> dict:
    n = max(n, 1)
    return {
        f"{prefix}accuracy": sums["correct"] / n,
        f"{prefix}margin": (sums["chosen_reward"] - sums["rejected_reward"]) / n,
        f"{prefix}chosen_reward": sums["chosen_reward"] / n,
        f"{prefix}rejected_reward": sums["rejected_reward"] / n,
        f"{prefix}chosen_nll": sums["chosen_nll"] / n,
    }


def _values(terms) -> tuple:
    """The ``SUMS`` of a batch's ``PreferenceTerms``, in that order."""
    return tuple(getattr(terms, name) for name in SUMS)


def _add(a: dict | None, b: dict) -> dict:
    return dict(b) if a is None else {k: a[k] + b[k] for k in a}


class PreferenceStep:
    """One optimizer step over micro-batches of pairs (each an array of indices into ``pairs``):
    the gradient of the mean pair loss (``terms(policy, reference)``: a ``PreferenceTerms``)
    over the step's pairs (with ``group``, a data-parallel run's: the summed gradients, pair
    counts and logged sums all-summed over its ranks, each rank's pairs its own share), clipped
    by its global norm ``grad_clip`` (0: none), one update; NonFinite before anything is
    updated when the loss or the norm is not finite. ``reference``: ``[len(pairs), 2]``, the
    reference model's log-probabilities (``reference_logprobs``; ORPO: unused).

    Before a micro-batch of a new length bucket is stepped on, its loss-and-grad graph is built
    once and dropped (``tune``), where the ops choose their implementations; a data-parallel
    run's ranks then take rank 0's choices, as ``trainer.Step`` does."""

    def __init__(
        self,
        model,
        optimizer,
        pairs: list[Pair],
        reference: np.ndarray,
        *,
        terms: Callable,
        grad_clip: float = 1.0,
        grad_checkpoint: bool = False,
        group=None,
    ):
        self.model, self.optimizer, self.pairs, self.reference = model, optimizer, pairs, reference
        self.grad_clip, self.grad_checkpoint = grad_clip, grad_checkpoint
        self.group = group if group is not None and group.size() > 1 else None

        def loss(model, batch, ref_c, ref_r):
            policy = pair_logprobs(model, batch, checkpoint=self.grad_checkpoint)
            return _values(terms(policy, (ref_c, ref_r)))

        self.loss_and_grad = nn.value_and_grad(model, loss)
        self._tuned: set[tuple] = set()  # data parallel: the length classes chosen for so far
        # data parallel: decided once, by every rank alike (each step's tuning is collective)
        self._tune = tuning_on(self.group) if self.group is not None else False

    def _batch(self, indices):
        ref = self.reference[indices]
        return [self.pairs[i] for i in indices], mx.array(ref[:, 0]), mx.array(ref[:, 1])

    def share_choices(self, micro_batches) -> None:
        """A data-parallel step: the length classes of these micro-batches met for the first
        time by any rank (prompt and answer length buckets, equal prompts or not) are chosen
        for by rank 0 (their gradient graphs built and dropped unevaluated; another rank's on
        blank pairs of its lengths), and every rank takes rank 0's choices (``trainer.
        tune_on_rank0``). The step is not compiled, so a single process needs no such pass:
        its own calls choose as they go."""
        mine = {}
        for indices in micro_batches:
            key = _length_class([self.pairs[i] for i in indices])
            if key not in self._tuned:
                mine.setdefault(key, indices)

        def tune(key, lengths):
            if key in mine:
                self.loss_and_grad(self.model, *self._batch(mine[key]))
                return
            blank = [_blank_pair(*n) for n in lengths]
            zeros = mx.zeros(len(blank))
            self.loss_and_grad(self.model, blank, zeros, zeros)

        lengths = {
            key: [[len(p.prompt), len(p.chosen), len(p.rejected)] for p in self._batch(ix)[0]]
            for key, ix in mine.items()
        }
        self._tuned.update(tune_on_rank0(self.group, lengths, tune))

    def __call__(self, micro_batches, stop: bool = False):
        grads, sums, n, fed = None, None, 0, 0
        if self._tune:  # data parallel only: a single process chooses as it goes
            self.share_choices(micro_batches)
        for indices in micro_batches:
            batch, ref_c, ref_r = self._batch(indices)
            values, g = self.loss_and_grad(self.model, batch, ref_c, ref_r)
            values = mx.stack(values)
            sums = values if sums is None else sums + values
            grads = g if grads is None else tree_map(mx.add, grads, g)
            mx.eval(sums, grads)  # one micro-batch's graph alive at a time
            n += len(batch)
            fed += sum(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in batch)
        count, flag = mx.array(float(n)), mx.array(float(stop))
        if self.group is not None:  # data parallel: sums over every rank's pairs
            grads, sums, count, flag = all_sum((grads, sums, count, flag), self.group)
        n = int(count.item())
        grads = tree_map(lambda x: x / n, grads)
        grads, norm = optim.clip_grad_norm(grads, self.grad_clip or math.inf)
        mx.eval(grads, norm)
        norm = norm.item()
        sums = dict(zip(SUMS, sums.tolist(), strict=True))
        if not math.isfinite(sums["loss"]):
            raise NonFinite(f"the loss is {sums['loss']}")
        if not math.isfinite(norm):
            raise NonFinite(f"the gradient norm is {norm}")
        self.optimizer.update(self.model, grads)
        mx.eval(self.model.parameters(), self.optimizer.state)
        return StepResult(sums["loss"], n, norm, [], flag.item() > 0, fed, _means(sums, n))


def _length_class(pairs: list[Pair]) -> tuple[int, int, int, int]:
    """What a preference batch's ops are chosen by: the length buckets of its prompts, of its
    answers (each padded to the longest) and of both (the answers' attention reaches back
    over the prompt), and whether the prompts need padding at all."""
    prompt = max(len(p.prompt) for p in pairs)
    answer = max(max(len(p.chosen), len(p.rejected)) for p in pairs)
    ragged = len({len(p.prompt) for p in pairs}) > 1
    bucket = tuning.length_bucket
    return bucket(prompt), bucket(answer), bucket(prompt + answer), int(ragged)


def _blank_pair(prompt: int, chosen: int, rejected: int) -> Pair:
    """A pair of zero tokens with these lengths: another rank's batch shape, for tuning."""
    return Pair(
        np.zeros(prompt, np.int32),
        np.zeros(chosen, np.int32),
        np.ones(chosen, bool),
        np.zeros(rejected, np.int32),
        np.ones(rejected, bool),
    )


def _evaluate(
    model,
    pairs: list[Pair],
    reference: np.ndarray,
    terms: Callable,
    batch_size: int,
    max_batches,
    prefix: str,
) -> dict:
    """The mean pair loss and terms over ``pairs`` (the first ``max_batches`` batches)."""
    was = model.training
    model.eval()
    sums, n = None, 0
    try:
        for i, start in enumerate(range(0, len(pairs), batch_size)):
            if max_batches is not None and i >= max_batches:
                break
            batch = pairs[start : start + batch_size]
            ref = reference[start : start + len(batch)]
            policy = pair_logprobs(model, batch)
            values = _values(terms(policy, (mx.array(ref[:, 0]), mx.array(ref[:, 1]))))
            sums = _add(sums, {k: v.item() for k, v in zip(SUMS, values, strict=True)})
            n += len(batch)
    finally:
        model.train(was)
    return {f"{prefix}loss": sums["loss"] / max(n, 1), **_means(sums, n, prefix)}


def task(cfg: TrainConfig, built, group, lead: bool) -> tuple[Task, RunData]:
    """The trainer's ``Task`` of a preference run and its data, from the run's settings (the
    reference computed now): under ``mlx.launch`` (``group``), this rank's share of the pairs
    and its share's reference; validation on rank 0 (``lead``)."""
    model, vocab, size = built.model, built.model.config.vocab_size, cfg.batch_size
    pairs = rank_share(_pairs(built.tokenizer, vocab, "train", cfg.data, cfg.max_seq_len), group)
    val_path = cfg.val_data or (cfg.data if os.path.isdir(cfg.data) else None)
    val = _pairs(built.tokenizer, vocab, "valid", val_path, cfg.max_seq_len) if lead else []
    if cfg.test:
        print("--test: a preference run evaluates on valid.jsonl (no test split)", file=sys.stderr)
    if len(pairs) < size:
        share = f" (a rank's share, of {group.size()} ranks)" if group is not None else ""
        raise TrainError(f"{len(pairs)} preference pairs{share}: fewer than --batch-size {size}")
    dpo = cfg.train_mode == "dpo"
    logprobs = reference_logprobs if dpo else _no_reference
    reference, val_reference = logprobs(model, pairs, size), logprobs(model, val, size)
    terms = partial(preference_loss, cfg.train_mode, beta=cfg.beta, kind=cfg.dpo_loss, lam=cfg.beta)

    def stream(position):
        return PairStream(len(pairs), size, cfg.seed, position)

    def step(model, optimizer, group):
        return PreferenceStep(
            model,
            optimizer,
            pairs,
            reference,
            terms=terms,
            grad_clip=cfg.grad_clip,
            grad_checkpoint=cfg.grad_checkpoint,
            group=group,
        )

    def validate(max_batches):
        return _evaluate(model, val, val_reference, terms, size, max_batches, "val_")

    per_epoch = max(1, (len(pairs) // size) // cfg.grad_accum)
    task = Task(step=step, validate=validate if val else None)
    longest = max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in pairs)
    return task, RunData(
        f"{len(pairs)} preference pairs", pairs, per_epoch, stream, longest=longest
    )


class PairStream:
    """Micro-batches of pair indices from ``position`` (``{"epoch", "batch"}``) on, epoch after
    epoch in the seed's order; ``position`` follows it (the data position after the last)."""

    def __init__(self, n: int, batch_size: int, seed: int, position: dict):
        self.position = dict(position)
        self._batches = self._from(n, batch_size, seed, self.position)

    def __iter__(self):
        return self

    def __next__(self):
        batch, self.position = next(self._batches)
        return batch

    @staticmethod
    def _from(n: int, size: int, seed: int, position: dict):
        epoch, start = position["epoch"], position["batch"]
        while True:
            batches = _batches(n, size, seed, epoch)
            for i in range(start, len(batches)):
                yield batches[i], {"epoch": epoch, "batch": i + 1}
            epoch, start = epoch + 1, 0
