"""The train section: a LoRA step against mlx-lm's trainer and the FLOP bound, each shape
verified first (the first step's loss, ours against mlx-lm's on the same weights and batch)."""

from __future__ import annotations

import functools
import os
import tempfile

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    time_steps,
    with_goals,
)
from benchmarks.workloads import lora_step_flops, mlx_lm_twin
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.models import Model, ModelConfig
from mlx_rwkvx.perf import matmul_gflops
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.optimizer import optimizer_for
from mlx_rwkvx.tuner.trainer import Step

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

TRAIN = {
    "full": dict(
        shapes={
            "0.1B": dict(layers=12, C=768, vocab=65536, T=512, batch=4, ours=3, theirs=2),
            "recurrent": dict(layers=4, C=256, vocab=4096, T=2048, batch=1, ours=3, theirs=1),
        },
        rank=32,
        matmul_n=2048,
    ),
    "quick": dict(
        shapes={
            "0.1B": dict(layers=2, C=128, vocab=1024, T=64, batch=2, ours=2, theirs=2),
            "recurrent": dict(layers=2, C=64, vocab=512, T=128, batch=1, ours=2, theirs=1),
        },
        rank=4,
        matmul_n=256,
    ),
}
# mlx-lm's rwkv7 names of our "rwkv" LoRA targets: the same projections on both sides
MLX_LM_RWKV_TARGETS = [
    "attn.r_proj",
    "attn.k_proj",
    "attn.v_proj",
    "attn.o_proj",
    "ffn.key",
    "ffn.value",
]
# MLX autograd through mlx-lm's WKV7 step loop keeps a full [B, T, H, N] cotangent per step, per
# layer: ~8 B T^2 H N bytes a layer (the wkv7 section measures it). A shape whose estimate
# passes this share of RAM is run at a shorter T (halved until it fits).
MLX_LM_RAM_SHARE = 0.3


def _mlx_lm_fit(cfg, B: int, T: int) -> tuple[int, int]:
    """(batch, T) at which mlx-lm's LoRA step fits in memory here."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = lambda b, t: 8 * b * t * t * cfg.n_heads * cfg.head_size * len(cfg.block_types)  # noqa: E731
    if need(B, T) > MLX_LM_RAM_SHARE * ram:
        B = 1
    while need(B, T) > MLX_LM_RAM_SHARE * ram and T > 16:
        T //= 2
    return B, T


def _lora_step(model: Model, rank: int, tcfg: TrainConfig) -> Step:
    """LoRA on ``model``'s rwkv targets, and the trainer's own step for it."""
    apply_lora(model, target_paths(model, "rwkv"), rank=rank, alpha=2.0 * rank)
    return Step(model, optimizer_for(tcfg, 100), grad_clip=tcfg.grad_clip)


def _train_shape(shape: dict, rank: int, tmp: str) -> dict:
    """LoRA steps of ours and of mlx-lm's trainer machinery on the same weights and batch."""
    from mlx_rwkvx._mlx_lm import default_loss, linear_to_lora_layers

    cfg = ModelConfig(
        vocab_size=shape["vocab"], hidden_size=shape["C"], block_types=["rwkv7"] * shape["layers"]
    )
    model = Model(cfg, seed=0)
    mx.eval(model.parameters())
    theirs = mlx_lm_twin(model, tmp)
    B, T = shape["batch"], shape["T"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # ours: the trainer's own step
    tcfg = TrainConfig(mode="lora", lr=1e-4, warmup=0).resolved()
    step = _lora_step(model, rank, tcfg)
    ours_loss = step([(inputs, targets)]).loss / (B * T)
    # mlx-lm: its LoRA layers, loss and a compiled step as its trainer builds them
    theirs.freeze()
    linear_to_lora_layers(
        theirs,
        len(theirs.layers),
        {"rank": rank, "scale": 2.0, "dropout": 0.0, "keys": MLX_LM_RWKV_TARGETS},
    )
    opt = optim.AdamW(learning_rate=1e-4)
    loss_grad = nn.value_and_grad(theirs, default_loss)
    state = [theirs.state, opt.state]
    their_B, their_T = _mlx_lm_fit(cfg, B, T)
    batch = mx.array(tokens[:their_B, : their_T + 1])
    lengths = mx.array([[1, their_T]] * their_B)

    @functools.partial(mx.compile, inputs=state, outputs=state)
    def their_step(batch, lengths):
        (loss, _), grads = loss_grad(theirs, batch, lengths)
        opt.update(theirs, grads)
        return loss

    their_loss = their_step(batch, lengths).item()
    # the same batch for ours, to verify before timing
    check_step = _lora_step(Model(cfg, seed=0), rank, tcfg)
    check = check_step([(inputs[:their_B, :their_T], targets[:their_B, :their_T])])
    check_loss = check.loss / (their_B * their_T)
    if not rel_err(np.array([check_loss]), np.array([their_loss])) <= 1e-3:
        raise VerificationFailed(f"first LoRA loss: ours {check_loss}, mlx-lm {their_loss}")
    del check_step
    ours_t = time_steps(lambda: step([(inputs, targets)]), shape["ours"])
    theirs_t = time_steps(lambda: mx.eval(their_step(batch, lengths)), shape["theirs"])
    return {
        "shape": shape,
        "loss": check_loss,
        "mlx_lm_loss": their_loss,
        "ours_s": ours_t,
        "mlx_lm_s": theirs_t,
        "mlx_lm_batch": their_B,
        "mlx_lm_T": their_T,
        "bound_flops": lora_step_flops(cfg, B * T),
        "first_loss": ours_loss,
    }


def measure(quick: bool = False) -> dict:
    """LoRA training speed against the bound and mlx-lm's trainer (verified first)."""
    cfg = sizes(TRAIN, quick)
    shapes = {}
    for name, shape in cfg["shapes"].items():  # each verified, then timed
        with tempfile.TemporaryDirectory() as tmp:
            shapes[name] = _train_shape(shape, cfg["rank"], tmp)
        print(name, shapes[name])
    rate = matmul_gflops(cfg["matmul_n"])
    return {
        "matmul_gflops": rate,
        "matmul_n": cfg["matmul_n"],
        "rank": cfg["rank"],
        "shapes": shapes,
    }


def tokens_per_s(s: dict) -> tuple[float, float]:
    """Tokens per second of one shape's LoRA step: ours, mlx-lm's (at the batch and T it fit)."""
    sh = s["shape"]
    ours = sh["batch"] * sh["T"] / s["ours_s"]
    return ours, s["mlx_lm_batch"] * s["mlx_lm_T"] / s["mlx_lm_s"]


def render(r: dict) -> Rendered:
    """Tokens per second of ours, mlx-lm's and the bound per shape, the goals."""
    lines = [
        "Verified first: the first LoRA step's loss, ours vs mlx-lm's on the same weights "
        "and batch: "
        + ", ".join(
            f"{n} {s['loss']:.5f} vs {s['mlx_lm_loss']:.5f}" for n, s in r["shapes"].items()
        )
        + ".",
        "",
        f"LoRA rank {r['rank']} on every RWKV block's receptance, key, value, output and "
        "channel-mix key and value (mlx-lm: the same projections), AdamW, float32, one step = "
        "forward, backward and update of one batch (best of the timed steps after a compiling "
        f"one). Bound: forward + input-gradient FLOPs of every projection and the head, plus "
        f"WKV7's forward and backward, at the {r['matmul_gflops']:.0f} GFLOP/s of a "
        f"{r['matmul_n']}^3 fp32 matmul measured in this run.",
        "",
        "mlx-lm's step loop does not fit in memory at every shape (its autograd keeps ~8 B "
        "T^2 H N bytes a layer): it then runs at batch 1 and the longest T that fits, and the "
        "speed-up compares tokens per second (which understates ours: its cost grows as T^2).",
        "",
        "| shape | ours tokens/s | mlx-lm tokens/s (at batch, T) | speed-up | bound tokens/s | "
        "of bound |",
        "|---|---|---|---|---|---|",
    ]
    goals = []
    for name, s in r["shapes"].items():
        sh = s["shape"]
        ours, theirs = tokens_per_s(s)
        bound = sh["batch"] * sh["T"] / (s["bound_flops"] / (r["matmul_gflops"] * 1e9))
        lines.append(
            f"| {name}: {sh['layers']} x C={sh['C']}, vocab {sh['vocab']}, T={sh['T']}, batch "
            f"{sh['batch']} | {ours:.0f} | {theirs:.0f} ({s['mlx_lm_batch']}, {s['mlx_lm_T']}) "
            f"| {ours / theirs:.1f}x | {bound:.0f} | {ours / bound:.0%} |"
        )
        if name == "0.1B":
            goals.append(Goal(f"{name} LoRA tokens/s / bound", ours / bound, 0.7, True))
        else:
            goals.append(Goal(f"{name} LoRA tokens/s vs mlx-lm", ours / theirs, 20, True))
    return with_goals(lines, goals)


SECTION = Section(measure, render, "LoRA steps vs the bound and mlx-lm")
