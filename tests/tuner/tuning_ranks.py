"""Two SFT steps of a tiny model with tuning on, by ``tests/tuner/test_train_tuning.py`` under
``mlx.launch`` on 2 ranks, each rank's measurement faked to prefer another wkv7 path (rank 0 the
chunked one, rank 1 the step loop). Each rank writes its tuner's choices, its pinned ones and
the wkv7 implementations its steps called and how many workloads it measured to
``<out>.<rank>.json``."""

import importlib
import json
import os
import sys
import tempfile

import mlx_rwkvx  # first: OpenBLAS before mlx.core
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.ops import tuning
from mlx_rwkvx.tuner.distributed import data_parallel_group
from mlx_rwkvx.tuner.trainer import Step

import mlx.optimizers as optim
import numpy as np

W = importlib.import_module("mlx_rwkvx.ops.wkv7")


def main(out: str) -> None:
    mlx_rwkvx.configure()
    group = data_parallel_group()
    rank = group.rank()
    os.environ[tuning.ENV_TUNE] = "1"
    os.environ[tuning.ENV_CACHE] = tempfile.mkdtemp(prefix=f"tuning-rank{rank}-")
    fastest = ("chunked", "ref")[rank]

    def measure(thunks):
        return {name: 1e-3 if name in (fastest, "blockwise") else 2e-3 for name in thunks}

    tuning.TUNER.measure = measure
    called = []
    for name, fn in dict(W.DISPATCH.impls).items():
        W.DISPATCH.impls[name] = lambda *a, _n=name, _f=fn: (called.append(_n), _f(*a))[1]
    model = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(model, target_paths(model, "attn"), rank=4, alpha=8.0)
    step = Step(model, optim.AdamW(learning_rate=1e-2), group=group)
    rng = np.random.default_rng(rank)
    # both ranks meet T=6 first; rank 1 alone then meets T=40 (a length bucket rank 0 never
    # steps on: rank 0 chooses for it all the same)
    for T in (6, 40 if rank else 6):
        step([(rng.integers(1, 256, (2, T)), rng.integers(1, 256, (2, T)))])
    record = {
        "choices": tuning.choices(),
        "pinned": tuning.TUNER.pinned,
        "called": called,
        "measured": tuning.TUNER.measured,
    }
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(record, f)


if __name__ == "__main__":
    main(sys.argv[1])
