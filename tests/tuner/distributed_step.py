"""Three training steps of a tiny model with a LoRA adapter, by ``tests/tuner/test_distributed.py``,
under ``mlx.launch`` on 2 ranks, then by rank 0 alone on both ranks' data as one batch from a
fresh model (the one-process run):

- SFT (``Step``): each rank its own micro-batches (other lengths and masks: unequal token
  counts);
- DPO (``PreferenceStep``): each rank its own pairs (prompts and answers of other lengths, a
  masked user turn in rank 1's answers) and its own pairs' reference.

Rank 0 saves both runs' trained parameters (and DPO's logged terms) to the .npz named on the
command line.
"""

import sys
from functools import partial

import mlx_rwkvx  # first: OpenBLAS before mlx.core
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.data.examples import IGNORE_INDEX
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.distributed import data_parallel_group
from mlx_rwkvx.tuner.optimizer import optimizer_for
from mlx_rwkvx.tuner.preference import Pair, preference_loss
from mlx_rwkvx.tuner.preference_run import PreferenceStep, reference_logprobs
from mlx_rwkvx.tuner.trainer import Step

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

LENGTHS = (9, 5)  # SFT: rank 0's rows are longer; rank 1's are half masked
SHAPES = ((7, 6, 4), (3, 9, 5))  # DPO: each rank's (prompt, chosen, rejected) lengths


def rows(rank: int, step: int):
    rng = np.random.default_rng([step, rank])
    T = LENGTHS[rank]
    inputs = rng.integers(1, 256, (2, T))
    targets = rng.integers(1, 256, (2, T))
    if rank == 1:
        targets[:, : T // 2] = IGNORE_INDEX  # a prompt, masked out of the loss
    return inputs, targets


def padded(parts):
    T = max(x.shape[1] for x, _ in parts)
    xs = [np.pad(x, ((0, 0), (0, T - x.shape[1]))) for x, _ in parts]
    ys = [np.pad(y, ((0, 0), (0, T - y.shape[1])), constant_values=IGNORE_INDEX) for _, y in parts]
    return np.concatenate(xs), np.concatenate(ys)


def pairs(rank: int, step: int) -> list[Pair]:
    rng = np.random.default_rng([step, rank, 1])
    p, c, r = SHAPES[rank]
    out = []
    for i in range(2):
        chosen, rejected = rng.integers(1, 256, c + i), rng.integers(1, 256, r)
        chosen_trained = np.ones(len(chosen), dtype=bool)
        if rank == 1:
            chosen_trained[2:5] = False  # a user turn between two assistant turns
        out.append(
            Pair(
                rng.integers(1, 256, p + i).astype(np.int32),
                chosen.astype(np.int32),
                chosen_trained,
                rejected.astype(np.int32),
                np.ones(len(rejected), dtype=bool),
            )
        )
    return out


def start(train_mode: str):
    mx.random.seed(0)
    model = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(model, target_paths(model, "attn"), rank=4, alpha=8.0)
    cfg = TrainConfig(
        model="m", data="d", output="o", lr=1e-2, warmup=0, iters=3, train_mode=train_mode
    ).resolved()
    optimizer = optimizer_for(cfg, 3)
    return model, cfg, optimizer


def sft(group, batches):
    """Three SFT steps, one micro-batch each: the trained parameters."""
    model, cfg, optimizer = start("sft")
    step = Step(model, optimizer, grad_clip=cfg.grad_clip, group=group)
    for batch in batches:
        step([batch])
    return dict(tree_flatten(model.trainable_parameters())), None


def dpo(group, batches):
    """Three DPO steps on ``batches`` (a list of pairs each): (the trained parameters, each
    step's log)."""
    model, cfg, optimizer = start("dpo")
    every = [p for batch in batches for p in batch]
    reference = reference_logprobs(model, every, 2)  # the starting model's, as the trainer's
    terms = partial(preference_loss, "dpo", beta=cfg.beta, kind=cfg.dpo_loss)
    step = PreferenceStep(
        model, optimizer, every, reference, terms=terms, grad_clip=cfg.grad_clip, group=group
    )
    logs, first = [], 0
    for batch in batches:
        result = step([np.arange(first, first + len(batch))])
        first += len(batch)
        logs.append([result.loss, result.count, result.norm, *result.extra.values()])
    return dict(tree_flatten(model.trainable_parameters())), np.array(logs)


def main(out: str) -> None:
    mlx_rwkvx.configure()
    group = data_parallel_group()
    rank, arrays = group.rank(), {}
    runs = {
        "sft": (
            sft,
            [rows(rank, s) for s in range(3)],
            [padded([rows(0, s), rows(1, s)]) for s in range(3)],
        ),
        "dpo": (
            dpo,
            [pairs(rank, s) for s in range(3)],
            [pairs(0, s) + pairs(1, s) for s in range(3)],
        ),
    }
    for kind, (fn, mine, both) in runs.items():
        ranks, log_ranks = fn(group, mine)
        if rank != 0:
            continue
        single, log_single = fn(None, both)
        arrays.update({f"{kind}/ranks/{k}": np.array(v) for k, v in ranks.items()})
        arrays.update({f"{kind}/single/{k}": np.array(v) for k, v in single.items()})
        if log_ranks is not None:
            arrays.update({f"{kind}/log_ranks": log_ranks, f"{kind}/log_single": log_single})
    if rank == 0:
        np.savez(out, **arrays)


if __name__ == "__main__":
    main(sys.argv[1])
