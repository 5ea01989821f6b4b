"""The trainer as a library, as the README shows it: a model built in Python, LoRA on it, a few
examples, an AdamW, and ``train`` with no settings object and no files."""

from __future__ import annotations

from mlx_rwkvx.adapters import apply_lora, target_paths
from mlx_rwkvx.data.batches import batches
from mlx_rwkvx.data.examples import Example
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.callbacks import Records
from mlx_rwkvx.tuner.trainer import supervised, train

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
import pytest
from mlx.utils import tree_flatten


def test_a_model_built_in_python_trains_in_a_few_lines():
    student = Model(preset("rwkv-x-tiny"), seed=0)  # 256 tokens: bytes
    apply_lora(student, target_paths(student, "attn"), rank=4, alpha=8)
    texts = [b"1+2=3", b"3+4=7", b"5+6=11", b"2+2=4"]
    examples = [
        Example(np.frombuffer(t, np.uint8).astype(np.int32), np.arange(len(t)) > 0) for t in texts
    ]
    data = list(batches(examples, batch_size=2, seed=0, epoch=0))  # a list repeats
    base = {k: np.array(v) for k, v in tree_flatten(student.parameters()) if "lora" not in k}
    losses = []
    state = train(
        student,
        supervised(),
        optim.AdamW(learning_rate=1e-2),
        data,
        steps=20,
        callbacks=[Records(lambda record: losses.append(record["loss"]))],
    )
    assert state.step == 20 and len(losses) == 20
    assert np.mean(losses[-4:]) < 0.8 * np.mean(losses[:4]), losses
    after = dict(tree_flatten(student.parameters()))
    assert all(np.array_equal(np.array(after[k]), v) for k, v in base.items())  # frozen


def test_an_iterator_that_runs_out_is_said():
    student = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(student, target_paths(student, "attn"), rank=4, alpha=8)
    ids = np.frombuffer(b"1+2=3", np.uint8).astype(np.int32)
    one_epoch = batches([Example(ids, np.arange(len(ids)) > 0)], batch_size=1, seed=0, epoch=0)
    with pytest.raises(ValueError, match="ran out before the last step"):
        train(student, supervised(), optim.AdamW(learning_rate=1e-3), one_epoch, steps=3)


def test_on_the_cpu_freed_buffers_go_back_during_training_and_the_limit_after(monkeypatch):
    monkeypatch.delenv("MLX_RWKVX_CACHE_LIMIT", raising=False)
    student = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(student, target_paths(student, "attn"), rank=4, alpha=8)
    ids = np.frombuffer(b"1+2=3, 3+4=7", np.uint8).astype(np.int32)
    data = list(batches([Example(ids, np.arange(len(ids)) > 0)], batch_size=1, seed=0, epoch=0))
    cached = []
    before = mx.set_cache_limit(1 << 30)
    try:
        train(
            student,
            supervised(),
            optim.AdamW(learning_rate=1e-3),
            data,
            steps=3,
            callbacks=[Records(lambda record: cached.append(mx.get_cache_memory()))],
        )
        assert cached == [0, 0, 0]  # MLX kept no freed buffer after a step
        assert mx.set_cache_limit(1 << 30) == 1 << 30  # the limit before, restored
    finally:
        mx.set_cache_limit(before)
