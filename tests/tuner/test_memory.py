"""The memory estimate of a training run (``tuner/memory.py``): within 15% of measured steps it
was not fitted to (another width, another T, MLX's peak counter), a run that would not fit
checkpoints its blocks by itself and says so, one that fits in no way is refused in one line
naming what would fit and writes nothing, after a step MLX holds no float copy of a frozen
quantized weight, and a checkpointed run has glibc give freed buffers back."""

from __future__ import annotations

import ctypes
import gc
import json
import re
import subprocess
import sys

import mlx_rwkvx._runtime as runtime
from mlx_rwkvx.adapters import apply_lora, target_paths
from mlx_rwkvx.data.batches import batches
from mlx_rwkvx.data.examples import Example
from mlx_rwkvx.errors import TrainError
from mlx_rwkvx.io.load import load_model, save
from mlx_rwkvx.models import Model, ModelConfig
from mlx_rwkvx.tuner import memory
from mlx_rwkvx.tuner.build import build, twin
from mlx_rwkvx.tuner.callbacks import Callback
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.trainer import supervised, train

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
import pytest
from helpers import run_module, rwkv7_cfg
from mlx.utils import tree_flatten


def lora_model(blocks: int, width: int) -> Model:
    model = Model(ModelConfig(vocab_size=256, hidden_size=width, block_types=["rwkv7"] * blocks))
    model.set_dtype(mx.bfloat16)
    apply_lora(model, target_paths(model, "rwkv"), rank=8, alpha=16)
    return model


class PeakOfLastStep(Callback):
    """MLX's peak over the last step (its counter reset after every other)."""

    def __init__(self):
        self.peak = 0

    def on_step_end(self, state, record):
        mx.synchronize()
        self.peak = mx.get_peak_memory()
        mx.reset_peak_memory()


@pytest.mark.parametrize("checkpoint", [False, True])
def test_the_estimate_is_within_15_percent_of_a_step_it_was_not_fitted_to(checkpoint):
    # width 384 and T = 768: neither among the measured steps the constants were fitted to
    gc.collect()  # an earlier test's arrays freed during this one would count against it
    mx.synchronize()
    T, held = 768, mx.get_active_memory()
    model = lora_model(3, 384)
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 256, (4, T + 1)).astype(np.int32)
    examples = [Example(row, np.ones(T + 1, bool)) for row in ids]
    data = list(batches(examples, batch_size=1, seed=0, epoch=0))
    peak = PeakOfLastStep()
    task = supervised(grad_checkpoint=checkpoint)
    train(model, task, optim.AdamW(learning_rate=1e-4), data, steps=2, callbacks=[peak])
    estimate = memory.footprint(model, T, 1, checkpoint=checkpoint, process=0)
    measured = peak.peak - held
    assert abs(estimate.total - measured) <= 0.15 * measured, (estimate, measured)
    assert estimate.activations > 0.5 * estimate.total  # the activations are what is checked


def test_the_plan_checkpoints_what_would_not_fit_and_names_what_would(monkeypatch):
    model = lora_model(4, 256)
    monkeypatch.setattr(memory, "process_bytes", lambda: 0)
    plain = memory.footprint(model, 2048, 1, process=0).total
    ckpt = memory.footprint(model, 2048, 1, checkpoint=True, process=0).total
    assert ckpt < 0.5 * plain
    fits, lines = memory.plan(model, 2048, 1, checkpoint=False, memory_budget=plain * 1.01 / 1e9)
    assert not fits and len(lines) == 1 and lines[0].startswith("memory: about")
    budget = (plain + ckpt) / 2 / 1e9
    fits, lines = memory.plan(model, 2048, 1, checkpoint=False, memory_budget=budget)
    assert fits and "block checkpointing on" in lines[1]
    with pytest.raises(TrainError, match="no checkpointing"):
        memory.plan(model, 2048, 1, checkpoint=False, memory_budget=budget, may_checkpoint=False)
    with pytest.raises(TrainError) as refused:
        memory.plan(model, 2048, 1, checkpoint=False, memory_budget=ckpt * 0.6 / 1e9)
    longest = int(re.search(r"--max-seq-len (\d+) would fit", str(refused.value)).group(1))
    assert 64 <= longest < 2048 and longest % 64 == 0
    room = memory.footprint(model, longest, 1, checkpoint=True, process=0).total
    assert room <= ckpt * 0.6 < memory.footprint(model, longest + 64, 1, checkpoint=True).total
    weights = memory.footprint(model, 2, 1, checkpoint=True, process=0).weights
    with pytest.raises(TrainError, match=r"--quantize int8 with --max-seq-len \d+ would fit"):
        memory.plan(model, 2048, 1, checkpoint=False, memory_budget=weights * 0.9 / 1e9)


@pytest.fixture
def long_texts(tmp_path):
    rng = np.random.default_rng(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "slept"]
    with open(tmp_path / "train.jsonl", "w") as f:
        for _ in range(4):
            f.write(json.dumps({"text": " ".join(rng.choice(words, 600))}) + "\n")
    model = Model(rwkv7_cfg(4, 128), seed=0)
    save(model, tmp_path / "model")
    return tmp_path


def run(folder, out: str, *flags, code: int = 0) -> str:
    """The train command in a process of its own (its own resident memory): stdout, or the
    one line of a refusal."""
    done = run_module(
        "train",
        *("--model", folder / "model", "--data", folder / "train.jsonl", "--output"),
        *(folder / out, "--iters", 1, "--max-seq-len", 1024, *flags),
    )
    assert done.returncode == code, done.stderr[-3000:]
    if code:
        lines = [x for x in done.stderr.strip().splitlines() if not x.startswith("note: ")]
        assert len(lines) == 1, done.stderr
        return lines[0]
    return done.stdout


def said_gb(text: str, before: str = "memory: about") -> float:
    """The size a run printed after ``before`` ("1.23 GB" or "456 MB"), in GB."""
    number, unit = re.search(before + r" ([\d.]+) (GB|MB)", text).groups()
    return float(number) * (1 if unit == "GB" else 1e-3)


def test_a_run_that_would_not_fit_checkpoints_its_blocks_and_one_that_fits_nowhere_is_refused(
    long_texts,
):
    plain = said_gb(run(long_texts, "a", "--memory-budget", 1000))
    checkpointed = run(long_texts, "b", "--memory-budget", 1000, "--grad-checkpoint")
    ckpt = said_gb(checkpointed)
    assert ckpt < plain - 0.05
    text = run(long_texts, "c", "--memory-budget", (plain + ckpt) / 2)
    assert "block checkpointing on (--grad-checkpoint)" in text
    assert json.loads((long_texts / "c" / "adapter_config.json").read_text())["steps"] == 1
    # short of the checkpointed peak by half its activations: a shorter text would fit
    activations = said_gb(checkpointed, "activations")
    line = run(long_texts, "d", "--memory-budget", ckpt - activations / 2, code=2)
    assert re.search(r"the run needs about .* --max-seq-len \d+ would fit", line), line
    assert not (long_texts / "d").exists() or not any((long_texts / "d").iterdir())


def test_after_a_step_mlx_holds_no_float_copy_of_a_frozen_quantized_weight(tmp_path):
    save(Model(rwkv7_cfg(2, 512), seed=0), tmp_path / "model")
    model = load_model(tmp_path / "model", quantize="int8")
    apply_lora(model, target_paths(model, "rwkv"), rank=4, alpha=8)
    ids = np.random.default_rng(0).integers(0, 256, 65).astype(np.int32)
    data = list(batches([Example(ids, np.ones(65, bool))], batch_size=1, seed=0, epoch=0))
    optimizer = optim.AdamW(learning_rate=1e-3)
    held = mx.get_active_memory() - sum(x.nbytes for _, x in tree_flatten(model.parameters()))
    train(model, supervised(), optimizer, data, steps=2)
    mx.synchronize()
    params = sum(x.nbytes for _, x in tree_flatten(model.parameters()))
    state = sum(x.nbytes for _, x in tree_flatten(optimizer.state) if isinstance(x, mx.array))
    extra = mx.get_active_memory() - held - params - state
    quantized = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    copies = sum(m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits for m in quantized) * 2
    # what MLX holds beyond the parameters and AdamW's state is a small part of what bf16
    # copies of the quantized weights would be (it grows with the width, not with its square:
    # 0.07 MB at width 128, 0.15 at 256, 0.29 at 512)
    assert len(quantized) >= 8 and extra < 0.05 * copies, (extra, copies)


@pytest.mark.parametrize(
    "settings",
    [
        dict(mode="lora"),
        dict(mode="lora", quantize="int8"),
        dict(mode="miss", dtype="float32"),
        dict(mode="state"),
        dict(mode="full"),
        dict(mode="dora", lora_rank=4),
        dict(mode="lora", parallel=2),
    ],
    ids=lambda s: "-".join(map(str, s.values())),
)
def test_the_model_estimated_before_loading_is_the_model_built(tmp_path, settings):
    model = Model(rwkv7_cfg(2, 64), seed=0)
    model.set_dtype(mx.bfloat16)
    save(model, tmp_path / "model")
    cfg = TrainConfig(model=str(tmp_path / "model"), **settings)
    shape = twin(cfg)
    built = build(cfg).model
    for part in ("weights", "trained"):
        want = getattr(memory.footprint(built, 64, process=0), part)
        assert getattr(memory.footprint(shape, 64, process=0), part) == want, part
    assert memory.backward_blocks(shape) == memory.backward_blocks(built)


@pytest.mark.parametrize("quantize", [None, "int4"])
def test_a_pth_is_estimated_from_its_pickle_alone(tmp_path, monkeypatch, quantize):
    """A BlinkDL ``.pth`` (read whole when loaded): its twin from the names, shapes and dtypes
    in its pickle, no tensor read, the same footprint as the model built from it."""
    from mlx_rwkvx.io import tensors
    from mlx_rwkvx.io.convert import convert

    model = Model(rwkv7_cfg(2, 64), seed=0)
    model.set_dtype(mx.bfloat16)
    save(model, tmp_path / "model")
    convert(tmp_path / "model", tmp_path / "m.pth", to="blinkdl")
    cfg = TrainConfig(model=str(tmp_path / "m.pth"), quantize=quantize)

    def unread(path):
        raise AssertionError("a tensor of the .pth was read")

    with monkeypatch.context() as patch:
        patch.setattr(tensors, "read_pth", unread)
        shape = twin(cfg)
    built = build(cfg).model
    for part in ("weights", "trained", "activations"):
        want = getattr(memory.footprint(built, 64, process=0), part)
        assert getattr(memory.footprint(shape, 64, process=0), part) == want, part


def test_a_run_too_big_for_its_budget_is_refused_before_its_weights_are_read(tmp_path):
    save(Model(rwkv7_cfg(2, 64), seed=0), tmp_path / "model")
    weights = tmp_path / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-64] + b"\xff" * 64)  # loading: NaNs, refused
    cfg = TrainConfig(
        model=str(tmp_path / "model"), data="x", output=str(tmp_path / "o"), memory_budget=0.001
    )
    with pytest.raises(TrainError, match="the run needs about"):
        train_from_config(cfg)


def test_the_plan_is_made_at_the_longest_row_of_the_data(long_texts):
    # rows of 65,536 tokens would need ~4 GB even checkpointed; the data's are 60 bytes
    with open(long_texts / "train.jsonl", "w") as f:
        for i in range(4):
            f.write(json.dumps({"text": f"{i} the cat sat on a mat and then slept. " * 1}) + "\n")
    done = run_module(
        "train",
        *("--model", long_texts / "model", "--data", long_texts / "train.jsonl", "--output"),
        *(long_texts / "short", "--iters", 1, "--max-seq-len", 65536, "--memory-budget", 2),
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert said_gb(done.stdout) < 1 and "checkpointing on" not in done.stdout


GIVEN_BACK = """
import ctypes, sys
from mlx_rwkvx._runtime import unmapped_when_freed
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
def resident():
    return next(int(s.split()[1]) << 10 for s in open("/proc/self/status") if "VmRSS" in s)
def touched(n):
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    return p
if sys.argv[1] == "on":
    assert unmapped_when_freed()
libc.free(touched(8 << 20))  # glibc's own threshold rises to 8 MB when this is freed
before, freed = resident(), []
for _ in range(32):  # 1 MB buffers with 100 KB ones kept between them
    freed.append(touched(1 << 20))
    touched(100 << 10)
for p in freed:
    libc.free(p)
print((resident() - before) >> 20)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "mallopt"), reason="glibc's malloc only")
def test_a_checkpointed_run_gives_freed_buffers_back_to_the_system():
    # 32 MB of 1 MB buffers freed between 3 MB kept: glibc's heap keeps them resident, unless
    # buffers from 128 KB are mapped on their own (what a checkpointed run asks for)
    def resident_after(setting):
        out = subprocess.run(
            [sys.executable, "-c", GIVEN_BACK, setting], capture_output=True, text=True, check=True
        )
        return int(out.stdout)

    assert resident_after("off") >= 32
    assert resident_after("on") <= 8


@pytest.mark.parametrize("checkpoint", [False, True])
def test_only_a_checkpointed_run_asks_for_it(monkeypatch, checkpoint):
    calls = []
    monkeypatch.setattr(runtime, "unmapped_when_freed", lambda: calls.append(1))
    model = lora_model(1, 64)
    ids = np.random.default_rng(0).integers(0, 256, (2, 17)).astype(np.int32)
    data = list(
        batches([Example(r, np.ones(17, bool)) for r in ids], batch_size=1, seed=0, epoch=0)
    )
    task = supervised(grad_checkpoint=checkpoint)
    train(model, task, optim.AdamW(learning_rate=1e-4), data, steps=1)
    assert calls == ([1] if checkpoint and mx.default_device() == mx.cpu else [])
