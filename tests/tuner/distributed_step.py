"""Three LoRA steps of a tiny model on fixed micro-batches, by ``tests/tuner/test_distributed.py``:
under ``mlx.launch`` each of 2 ranks takes its own micro-batches (other lengths and masks:
unequal token counts); with ``--single`` one process takes both ranks' rows as one batch. Rank
0 (or the single process) saves the trained parameters to the .npz named on the command line.
"""

import sys

import mlx_rwkvx  # first: OpenBLAS before mlx.core
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.adapters import apply_lora, target_paths
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.data import IGNORE_INDEX
from mlx_rwkvx.tuner.distributed import data_parallel_group
from mlx_rwkvx.tuner.optimizer import make_optimizer
from mlx_rwkvx.tuner.trainer import Step

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

LENGTHS = (9, 5)  # rank 0's rows are longer; rank 1's are half masked


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


def main(out: str, single: bool) -> None:
    mlx_rwkvx.configure()
    group = None if single else data_parallel_group()
    mx.random.seed(0)
    model = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(model, target_paths(model, "attn"), rank=4, alpha=8.0)
    cfg = TrainConfig(model="m", data="d", output="o", lr=1e-2, warmup=0, iters=3).resolved()
    optimizer, _ = make_optimizer(cfg, 3)
    step = Step(model, optimizer, cfg, group)
    for s in range(3):
        if single:
            batch = [padded([rows(0, s), rows(1, s)])]
        else:
            batch = [rows(group.rank(), s)]
        step(batch)
    if single or group.rank() == 0:
        np.savez(out, **{k: np.array(v) for k, v in tree_flatten(model.trainable_parameters())})


if __name__ == "__main__":
    main(sys.argv[1], "--single" in sys.argv[2:])
