"""The evaluate section: the loss on a data set (``data.loss.dataset_loss``, what
``python -m mlx_rwkvx.evaluate`` and the trainer's validation run) against a bare forward pass
with the fused head and loss on every token of the same batches (the training forward without
its backward), beside the FLOP bound; and its peak memory on 10x the data."""

from __future__ import annotations

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    time_and_peak,
    with_goals,
)
from benchmarks.workloads import chunked_flops, linear_params
from mlx_rwkvx.data.batches import PAD_MULTIPLE, batches
from mlx_rwkvx.data.examples import Example
from mlx_rwkvx.data.loss import dataset_loss, segment_loss
from mlx_rwkvx.models import Model, ModelConfig, preset
from mlx_rwkvx.perf import best_time, matmul_gflops

import mlx.core as mx
import numpy as np

EVALUATE = {
    "full": dict(
        model="rwkv7-0.1b",
        texts=8,
        T=512,
        batch=4,
        repeats=2,
        memory=dict(C=256, layers=4, vocab=65536, texts=16, T=256, batch=4),
        matmul_n=2048,
    ),
    "quick": dict(
        model=None,
        texts=4,
        T=64,
        batch=2,
        repeats=2,
        memory=dict(C=64, layers=2, vocab=512, texts=4, T=64, batch=2),
        matmul_n=256,
    ),
}


def _examples(n: int, T: int, vocab: int, seed: int = 0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tokens = rng.integers(1, vocab, T + 1).astype(np.int32)
        trained = np.ones(T + 1, dtype=bool)
        trained[0] = False
        out.append(Example(tokens, trained))
    return out


def _bound_flops(cfg: ModelConfig, tokens: int) -> float:
    model = Model(cfg, init=None)  # shapes only
    wkv = chunked_flops(tokens, cfg.n_heads, cfg.head_size) * len(cfg.block_types)
    return 2 * linear_params(model) * tokens + wkv


def measure(quick: bool = False) -> dict:
    cfg = sizes(EVALUATE, quick)
    tiny = ModelConfig(vocab_size=1024, hidden_size=128, block_types=["rwkv7"] * 2)
    model_cfg = preset(cfg["model"]) if cfg["model"] else tiny
    model = Model(model_cfg, seed=0)
    model.eval()
    mx.eval(model.parameters())
    examples = _examples(cfg["texts"], cfg["T"], model_cfg.vocab_size)
    stream = list(
        batches(examples, batch_size=cfg["batch"], seed=0, epoch=0, pad_to_multiple=PAD_MULTIPLE)
    )
    arrays = [(mx.array(x), mx.array(y)) for x, y in stream]

    def bare():  # the fused forward on the same batches, nothing else
        total = mx.array(0.0)
        for x, y in arrays:
            loss, _, _ = segment_loss(model, x, y)
            total = total + loss
        mx.eval(total)
        return total

    ours = dataset_loss(model, examples, cfg["batch"])
    reference = float(bare().item())
    err = rel_err(np.array([ours.loss]), np.array([reference]))
    if not err <= 1e-5:
        raise VerificationFailed(f"dataset_loss {ours.loss} vs the bare forward {reference}")
    t_bare = best_time(bare, repeats=cfg["repeats"], warmup=0)
    t_ours = best_time(
        lambda: dataset_loss(model, examples, cfg["batch"]), repeats=cfg["repeats"], warmup=0
    )
    tokens = ours.tokens
    gflops = matmul_gflops(cfg["matmul_n"])
    flops = _bound_flops(model_cfg, tokens)
    # memory: the same evaluation on 1x and 10x the data, a smaller model
    m = cfg["memory"]
    small_cfg = ModelConfig(
        vocab_size=m["vocab"], hidden_size=m["C"], block_types=["rwkv7"] * m["layers"]
    )
    small = Model(small_cfg, seed=0)
    mx.eval(small.parameters())
    peaks = {}
    for scale in (1, 10):
        data = _examples(m["texts"] * scale, m["T"], m["vocab"], seed=scale)
        peaks[scale] = time_and_peak(lambda d=data: dataset_loss(small, d, m["batch"]), 1)
    return {
        "model": cfg["model"] or "tiny",
        "tokens": tokens,
        "batch": cfg["batch"],
        "T": cfg["T"],
        "verify": err,
        "bare": t_bare,
        "ours": t_ours,
        "gflops": gflops,
        "flops": flops,
        "memory": {**m, "peak_1x": peaks[1]["peak"], "peak_10x": peaks[10]["peak"]},
    }


def render(r: dict) -> Rendered:
    rate_bare, rate_ours = r["tokens"] / r["bare"], r["tokens"] / r["ours"]
    bound = r["gflops"] * 1e9 / (r["flops"] / r["tokens"])  # tokens/s at the matmul rate
    m = r["memory"]
    growth = m["peak_10x"] / max(m["peak_1x"], 1)
    lines = [
        f"Verified first: the evaluation's summed loss equals the bare forward's to "
        f"{r['verify']:.1e}.",
        "",
        f"{r['model']}, {r['tokens']} tokens in batches of {r['batch']} x {r['T']}, float32. "
        "bare = the fused head and loss on every token of the same batches (the training "
        "forward without its backward); evaluate = `dataset_loss` (batching, per-batch sums, "
        f"byte counts). Bound: {r['flops'] / r['tokens'] / 1e9:.2f} GFLOP a token at the "
        f"measured matmul rate of {r['gflops']:.0f} GFLOP/s.",
        "",
        "| | tokens/s | of the bound |",
        "|---|---|---|",
        f"| bare forward + fused loss | {rate_bare:.0f} | {rate_bare / bound:.0%} |",
        f"| evaluate | {rate_ours:.0f} | {rate_ours / bound:.0%} |",
        "",
        f"Peak memory of the evaluation (C = {m['C']}, {m['layers']} layers, vocab "
        f"{m['vocab']}, batches of {m['batch']} x {m['T']}): {m['peak_1x'] / 2**20:.0f} MiB "
        f"on {m['texts']} texts, {m['peak_10x'] / 2**20:.0f} MiB on {10 * m['texts']}.",
    ]
    return with_goals(
        lines,
        [
            Goal(
                "evaluate tokens/s, of the bare forward with the fused loss",
                rate_ours / rate_bare,
                0.9,
                True,
            ),
            Goal("evaluation peak memory, 10x the data / 1x", growth, 1.1, False),
        ],
    )


SECTION = Section(measure, render, "the loss on a data set vs the bare fused forward; memory")
