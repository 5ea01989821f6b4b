"""``train --parallel N``: N adapters from one init, each on its equal shard of the data, in one
batched forward, equal to N separate runs on the shards; thread_<i> and their FedAvg written;
what it does not go with is one line."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx.adapters.files import read_adapter
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner import optimizer
from mlx_rwkvx.tuner.build import build
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.trainer import TrainError

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_module
from mlx.utils import tree_flatten

FACTS = [f"{a}+{b}={a + b}" for a in range(1, 6) for b in range(1, 4)]  # 15: shards of 7

# AdamW with eps = 1, far above sqrt(v) (<= 0.1 * sqrt(6) * clip = 0.012 after 6 clipped
# steps), updates by lr * m / eps: in proportion to the gradient. With RWKV's eps = 1e-8 every
# element moves by about +-lr whatever its gradient's size, so a gradient of 1e-9 whose sign
# another summation order flips makes a 2 lr difference, not a rounding error.
LINEAR_EPS, LINEAR_LR = 1.0, 10.0
# Error model of stacked against separate: the same float32 sums in other orders (other batch
# shapes, another BLAS blocking). A step's update then errs by at most about K u relative,
# K = 256 the longest sum (the vocabulary, the FFN width), u = 2^-24: the worst case of one
# sum, which also covers a step's chain of a few dozen sums (random errors: sqrt(D K) u); adding
# the update to a parameter theta rounds once more (u |theta|). Over 6 steps the errors add up:
# |stacked - separate| <= 6 u (K |delta| + |theta|), delta = theta - theta_0 the training's change.
ITERS, LONGEST_SUM, U = 6, 256, 2.0**-24


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel")
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")
    # lengths differ within and across shards: batches of other T are padded side by side
    lines = [
        json.dumps({"prompt": f[:4], "completion": f[4:] + "!" * (i % 4)})
        for i, f in enumerate(FACTS)
    ]
    (root / "all.jsonl").write_text("\n".join(lines) + "\n")
    for i in range(2):
        (root / f"shard{i}.jsonl").write_text("\n".join(lines[i * 7 : (i + 1) * 7]) + "\n")
    return root


def cfg(ws: Path, data: str, out: Path, **kw) -> TrainConfig:
    fields = dict(
        model=str(ws / "base"),
        data=str(ws / data),
        output=str(out),
        lora_rank=4,
        lora_alpha=8,
        batch_size=3,
        lr=2e-2,
        warmup=1,
        iters=ITERS,
        save_every=100,
        grad_clip=0.05,
    )  # a small clip: each shard's own clipping matters
    fields.update(kw)
    return TrainConfig(**fields)


def tensors(path) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in read_adapter(path)[1].items()}


def test_parallel_equals_separate_runs(workspace, tmp_path, monkeypatch):
    monkeypatch.setattr(optimizer, "ADAM_EPS", LINEAR_EPS)
    # no weight decay: at this lr it would shrink A by 10% a step, the same in both runs
    linear = dict(lr=LINEAR_LR, weight_decay=0.0)
    out = train_from_config(cfg(workspace, "all.jsonl", tmp_path / "par", parallel=2, **linear))
    threads = [tensors(out / f"thread_{i}.safetensors") for i in range(2)]
    init_cfg = cfg(workspace, "all.jsonl", tmp_path / "x").resolved()
    mx.random.seed(init_cfg.seed)  # theta_0: the adapters' init, as train builds it
    start = build(init_cfg).model
    init = {k: np.array(v) for k, v in tree_flatten(start.trainable_parameters())}
    for i in range(2):
        one = cfg(workspace, f"shard{i}.jsonl", tmp_path / f"alone{i}", **linear)
        alone = train_from_config(one)
        ref = tensors(alone / "adapter_final.safetensors")
        assert sorted(ref) == sorted(threads[i]) == sorted(init)
        for name, x in ref.items():
            delta = np.linalg.norm(x - init[name])
            bound = ITERS * U * (LONGEST_SUM * delta + np.linalg.norm(x))
            # measured: <= 3e-6 of delta; one shard clipped by both shards' norm: 0.3
            err = np.linalg.norm(threads[i][name] - x)
            assert err <= bound, (i, name, err / delta, bound / delta)
    final = tensors(out / "adapter_final.safetensors")
    for name in final:
        assert np.allclose(final[name], (threads[0][name] + threads[1][name]) / 2, atol=1e-7)
    assert not np.allclose(threads[0][next(iter(final))], threads[1][next(iter(final))])
    config, _ = read_adapter(out / "thread_1.safetensors")
    assert (config["parallel"], config["thread"], config["lora_parameters"]["rank"]) == (2, 1, 4)
    alone_config, _ = read_adapter(tmp_path / "alone1" / "adapter_final.safetensors")
    assert config["tokens_trained"] == alone_config["tokens_trained"] > 0  # its own shard's
    # the average loads as any adapter
    model, _ = mlx_rwkvx.load(workspace / "base", adapter=out / "adapter_final.safetensors")
    assert model is not None


def test_parallel_resumes_after_a_kill(workspace, tmp_path):
    settings = cfg(workspace, "all.jsonl", tmp_path / "whole", parallel=2, save_every=3)
    whole = train_from_config(settings)
    cut = cfg(workspace, "all.jsonl", tmp_path / "cut", parallel=2, save_every=3)
    defaults = vars(TrainConfig())  # the settings given: those that differ from the defaults
    flags = [
        f"--{k.replace('_', '-')}={v}"
        for k, v in vars(cut).items()
        if v is not None and not isinstance(v, bool) and v != defaults[k]
    ]
    killed = run_module("train", *flags, env={"MLX_RWKVX_CRASH_AT": "step:5"})
    assert killed.returncode == -9, killed.stderr
    assert (tmp_path / "cut" / "checkpoint_3.json").exists()
    resumed = train_from_config(dataclasses.replace(cut, resume=True))
    for i in range(2):
        a = tensors(whole / f"thread_{i}.safetensors")
        b = tensors(resumed / f"thread_{i}.safetensors")
        for name in a:
            assert np.allclose(a[name], b[name], rtol=1e-6, atol=1e-8), name


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(mode="dora"), "--parallel trains LoRA adapters"),
        (dict(carry_state=True), "--parallel and --carry-state"),
        (dict(parallel=20), "cannot make 20 parts"),
        (dict(parallel=0), "parallel must be"),
    ],
)
def test_parallel_refusals(workspace, tmp_path, kw, message):
    with pytest.raises(TrainError, match=message):
        train_from_config(cfg(workspace, "all.jsonl", tmp_path / "x", **{"parallel": 2, **kw}))
    assert not (tmp_path / "x").exists()


def test_foundrys_cross_machine_recipe(workspace, tmp_path):
    # pretokenize --split-weights 6,2; each part trained with --parallel and --quantize (two
    # Macs); the two adapters merged; the result chats
    def run(module, *args):
        out = run_module(module, *args, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    text = "\n".join(json.dumps({"text": f}) for f in FACTS * 4) + "\n"
    (tmp_path / "chats.jsonl").write_text(text)
    run(
        "pretokenize",
        "--tokenizer",
        "bytes",
        "--data",
        tmp_path / "chats.jsonl",
        "--output",
        tmp_path / "chats.bin",
        "--max-seq-len",
        64,
        "--split-weights",
        "6,2",
    )
    parts = [tmp_path / "chats_0.bin", tmp_path / "chats_1.bin"]
    for mac, part in zip(("m4", "m3"), parts, strict=True):
        run(
            "train",
            "--model",
            workspace / "base",
            "--data",
            part,
            "--output",
            tmp_path / mac,
            "--parallel",
            2,
            "--quantize",
            "--lora-rank",
            4,
            "--epochs",
            1,
            "--batch-size",
            2,
        )
    said = run(
        "merge",
        "--output",
        tmp_path / "merged.safetensors",
        tmp_path / "m4",
        tmp_path / "m3",
        "--weights",
        "auto",
    )
    weights = re.search(r"by fedavg, weights ([\d.]+), ([\d.]+)", said)
    assert 0.7 <= float(weights.group(1)) <= 0.8, said  # by tokens: the 6:2 split
    answer = run(
        "generate",
        "--model",
        workspace / "base",
        "--adapter",
        tmp_path / "merged.safetensors",
        "--prompt",
        "1+2=",
        "--max-tokens",
        4,
    )
    assert len(answer) > 1
