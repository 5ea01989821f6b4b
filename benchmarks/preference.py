"""The preference section: a DPO step against a LoRA SFT step over the same 2N sequences (each
pair's prompt with its chosen and with its rejected answer), time and peak memory. DPO feeds
each prompt once (the two answers continue from its state) and its reference is computed
before training (forward passes only), so it should cost no more than SFT on those
sequences."""

from __future__ import annotations

import math
import time
from functools import partial

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    with_goals,
)
from benchmarks.workloads import lora_step_flops
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.data.loss import batch_loss
from mlx_rwkvx.models import Model, ModelConfig
from mlx_rwkvx.perf import matmul_gflops
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.optimizer import optimizer_for
from mlx_rwkvx.tuner.preference import Pair, pair_logprobs, preference_loss
from mlx_rwkvx.tuner.preference_run import PreferenceStep
from mlx_rwkvx.tuner.trainer import Step

import mlx.core as mx
import numpy as np

PREFERENCE = {
    "full": dict(
        layers=12,
        C=768,
        vocab=65536,
        pairs=4,
        prompt=192,
        answer=64,
        rank=32,
        steps=2,
        matmul_n=2048,
    ),
    "quick": dict(
        layers=2, C=64, vocab=512, pairs=2, prompt=16, answer=8, rank=4, steps=1, matmul_n=256
    ),
}
IGNORE = -100


def _model(c: dict) -> Model:
    cfg = ModelConfig(
        vocab_size=c["vocab"],
        hidden_size=c["C"],
        head_size=min(64, c["C"] // 2),
        block_types=["rwkv7"] * c["layers"],
    )
    model = Model(cfg, seed=0)
    apply_lora(model, target_paths(model, "rwkv"), rank=c["rank"], alpha=2.0 * c["rank"])
    return model


def _pairs(c: dict) -> list[Pair]:
    rng = np.random.default_rng(0)
    out = []
    for _ in range(c["pairs"]):
        prompt, chosen, rejected = (
            rng.integers(1, c["vocab"], size=n).astype(np.int32)
            for n in (c["prompt"], c["answer"], c["answer"])
        )
        trained = np.ones(c["answer"], dtype=bool)
        out.append(Pair(prompt, chosen, trained, rejected, trained.copy()))
    return out


def _sequences(pairs: list[Pair]) -> tuple[mx.array, mx.array]:
    """SFT's batch of the same texts: every prompt + answer, the loss on the answers."""
    rows = [(p.prompt, a) for p in pairs for a in (p.chosen, p.rejected)]
    tokens = np.stack([np.concatenate([q, a]) for q, a in rows])
    targets = tokens.copy()
    targets[:, : len(rows[0][0])] = IGNORE
    return mx.array(tokens[:, :-1]), mx.array(targets[:, 1:])


def _config(c: dict) -> TrainConfig:
    cfg = TrainConfig(
        model="m",
        data="d",
        output="o",
        lr=1e-5,
        lora_rank=c["rank"],
        lora_alpha=2.0 * c["rank"],
        train_mode="dpo",
        iters=100,
    )
    return cfg.resolved({"rwkv7"})


def _step_time_and_peak(step, steps: int) -> dict:
    step()  # the first: what compiles, the buffers MLX keeps
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    times = []
    for _ in range(steps):
        tic = time.perf_counter()
        step()
        mx.synchronize()
        times.append(time.perf_counter() - tic)
    return {"time": min(times), "peak": mx.get_peak_memory() - base}


def measure(quick: bool = False) -> dict:
    """Verify (DPO's first loss is ln 2; a pair's log-probability equals its text's through the
    SFT loss), then time a DPO step and an SFT step on the same sequences, each on a fresh
    LoRA model."""
    c = sizes(PREFERENCE, quick)
    pairs, cfg = _pairs(c), _config(c)
    model = _model(c)
    policy = pair_logprobs(model, pairs)
    reference = np.stack([np.array(policy[0]), np.array(policy[1])], axis=1)
    first = preference_loss("dpo", policy, policy[:2]).loss.item() / len(pairs)
    inputs, targets = _sequences(pairs[:1])
    alone = -batch_loss(model, inputs[:1], targets[:1])[0].item()
    verify = {"ln2": rel_err(first, math.log(2)), "logprob": rel_err(policy[0][0].item(), alone)}
    if not max(verify.values()) <= 1e-5:
        raise VerificationFailed(f"preference: {verify}")
    optimizer = optimizer_for(cfg, 100)
    terms = partial(preference_loss, "dpo", beta=cfg.beta, kind=cfg.dpo_loss)
    dpo_step = PreferenceStep(model, optimizer, pairs, reference, terms=terms)
    indices = np.arange(len(pairs))
    dpo = _step_time_and_peak(lambda: dpo_step([indices]), c["steps"])
    sft_model = _model(c)
    sft_optimizer = optimizer_for(cfg, 100)
    step = Step(sft_model, sft_optimizer)
    batch = _sequences(pairs)
    sft = _step_time_and_peak(lambda: step([batch]), c["steps"])
    fed_dpo = len(pairs) * (c["prompt"] + 2 * c["answer"])
    fed_sft = 2 * len(pairs) * (c["prompt"] + c["answer"])
    return {
        **c,
        "verify": verify,
        "dpo": dpo,
        "sft": sft,
        "fed_dpo": fed_dpo,
        "fed_sft": fed_sft,
        "gflops": matmul_gflops(c["matmul_n"]),
        "bound_flops": {
            "dpo": lora_step_flops(model.config, fed_dpo),
            "sft": lora_step_flops(model.config, fed_sft),
        },
    }


def render(r: dict) -> Rendered:
    dpo, sft = r["dpo"], r["sft"]
    n = r["pairs"]
    bound = {k: f / (r["gflops"] * 1e9) for k, f in r["bound_flops"].items()}  # seconds
    lines = [
        f"Verified first: DPO's first loss is ln 2 to {r['verify']['ln2']:.1e}; a pair's "
        f"log-probability equals its text's through the SFT loss to "
        f"{r['verify']['logprob']:.1e} (relative).",
        "",
        f"RWKV-7 of {r['layers']} blocks, C = {r['C']}, vocabulary {r['vocab']}, LoRA rank "
        f"{r['rank']} on the rwkv targets, float32. {n} pairs of a {r['prompt']}-token prompt "
        f"and two {r['answer']}-token answers; SFT trains the same {2 * n} texts (prompt + "
        "answer, the loss on the answers). DPO's reference log-probabilities are computed "
        "before training, as the trainer does. Matmul: "
        f"{r['gflops']:.0f} GFLOP/s (fp32, n = {r['matmul_n']}).",
        "",
        "| step | tokens fed | time | tokens/s | bound time | of bound | peak memory |",
        "|---|---|---|---|---|---|---|",
        *[
            f"| {name} | {r[f'fed_{k}']} | {m['time']:.2f} s | {r[f'fed_{k}'] / m['time']:.0f} | "
            f"{bound[k]:.2f} s | {bound[k] / m['time']:.0%} | {m['peak'] / 2**20:.0f} MiB |"
            for name, k, m in (("LoRA SFT", "sft", sft), ("DPO", "dpo", dpo))
        ],
        "",
        "Bound: forward + input-gradient FLOPs of every projection and the head over the tokens "
        "fed, plus WKV7's forward and backward, at the measured matmul rate (the train "
        "section's bound).",
        "",
        f"DPO feeds {r['fed_dpo'] / r['fed_sft']:.2f}x SFT's tokens (each prompt once).",
    ]
    goals = [
        Goal(
            "DPO step time / LoRA SFT step on the same sequences",
            dpo["time"] / sft["time"],
            1.2,
            False,
        ),
        Goal(
            "DPO step peak memory / LoRA SFT step's", dpo["peak"] / max(sft["peak"], 1), 1.2, False
        ),
    ]
    return with_goals(lines, goals)


SECTION = Section(measure, render, "a DPO step vs a LoRA SFT step on the same sequences")
