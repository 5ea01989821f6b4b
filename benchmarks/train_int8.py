"""The train-int8 section: the INT8 RFA LoRA step's peak memory, with and without
``--grad-checkpoint`` (the 1.5B preset: tens of minutes on a CPU).

Each part runs in a process of its own, so that its peak memory is its own:

    python -m benchmarks.train_int8 --worker checkpoint FOLDER [--quick]
    python -m benchmarks.train_int8 --worker train FOLDER [--grad-checkpoint] [--quick]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    start_worker,
    with_goals,
    worker_main,
    worker_result,
)
from benchmarks.workloads import rfa_model_config
from mlx_rwkvx.data.records import write_bin
from mlx_rwkvx.io.load import load, save
from mlx_rwkvx.models import Model
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config

import mlx.core as mx
import mlx.nn as nn
import numpy as np

INT8_T = {"full": 256, "quick": 32}  # the training sequence length
INT8_MARGIN = 4.0  # INT8 (bf16 activations) vs its exact twin, over bf16 vs float32


def checkpoint_worker(folder: str, quick: bool = False) -> dict:
    """Write the RFA config's random weights as a bf16 checkpoint and a small .bin data set,
    and the logits the caller verifies INT8 with (a process of its own: the training process's
    peak memory must not include this): the checkpoint loaded with --quantize; its exact
    float32 twin (the same checkpoint in float32 with every quantized weight replaced by the
    INT8 model's own dequantized integers); the INT8 model with its float parameters cast to
    float32 (which must equal the twin: the quantized arithmetic is exact); and the checkpoint
    unquantized in bf16 and in float32 (the noise floor of bf16 activations in this deep random
    network, the yardstick for INT8 with its bf16 activations against the twin)."""
    cfg = rfa_model_config(quick)
    model = Model(cfg, init=None)  # lazy: cast to bf16 before anything is computed
    model.set_dtype(mx.bfloat16)
    save(model, folder + "/bf16")
    T = sizes(INT8_T, quick)
    rng = np.random.default_rng(0)
    write_bin(folder + "/data.bin", [rng.integers(0, cfg.vocab_size, T + 1) for _ in range(2)])
    del model
    tokens = mx.array(rng.integers(0, cfg.vocab_size, (1, 4)))

    def logits(m):
        return np.array(m(tokens).astype(mx.float32))

    out = {"bf16": logits(load(folder + "/bf16", tokenizer=False)[0])}
    int8 = load(folder + "/bf16", quantize="int8", tokenizer=False)[0]
    out["int8"] = logits(int8)
    f32 = load(folder + "/bf16", dtype="float32", tokenizer=False)[0]
    out["f32"] = logits(f32)
    quantized = dict(int8.named_modules())
    for path, m in f32.named_modules():
        q = quantized[path]
        if isinstance(q, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            scales, biases = (a.astype(mx.float32) for a in (q.scales, q.biases))  # exact
            m.weight = mx.dequantize(q.weight, scales, biases, q.group_size, q.bits)
            mx.eval(m.weight)
    out["twin"] = logits(f32)
    del f32
    int8.set_dtype(mx.float32)  # every float parameter cast exactly, the integers unchanged
    out["int8_f32"] = logits(int8)
    for name, value in out.items():  # verified by the caller, before any timing
        np.save(f"{folder}/logits_{name}.npy", value)
    return {"T": T}


def train_worker(folder: str, quick: bool = False, grad_checkpoint: bool = False) -> dict:
    """One INT8 LoRA training step through ``train_from_config`` on the checkpoint above: the
    process's peak resident memory and the run's time."""
    T = sizes(INT8_T, quick)
    # configure() keeps up to a quarter of RAM of freed buffers for reuse on the CPU: with no
    # cache, the resident memory is what the step needs (Metal manages its own)
    mx.set_cache_limit(0)
    t0 = time.perf_counter()
    settings = dict(
        quantize="int8",
        iters=1,
        batch_size=1,
        max_seq_len=T,
        save_every=10,
        grad_checkpoint=grad_checkpoint,
    )
    out = folder + ("/out_checkpoint" if grad_checkpoint else "/out")
    cfg = TrainConfig(model=folder + "/bf16", data=folder + "/data.bin", output=out, **settings)
    train_from_config(cfg)
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "mlx_peak": mx.get_peak_memory(),
        "seconds": time.perf_counter() - t0,
        "T": T,
    }


def _verify(folder: str) -> dict:
    """The checkpoint worker's logits: INT8 against its exact float32 twin."""
    logits = {
        k: np.load(f"{folder}/logits_{k}.npy").astype(np.float64)
        for k in ("int8", "int8_f32", "twin", "bf16", "f32")
    }
    exact = rel_err(logits["int8_f32"], logits["twin"])
    err = rel_err(logits["int8"], logits["twin"])
    floor = rel_err(logits["bf16"], logits["f32"])
    if not exact <= 1e-5:
        raise VerificationFailed(f"INT8 in float32 vs its exact twin: relative error {exact:.3g}")
    # with bf16 activations, INT8 may be as far from the twin as the bf16 model is from the
    # float32 one (one draw of a chaotic network's noise: a margin, which still catches a
    # wrong bf16 CPU quantized matmul)
    if not err <= INT8_MARGIN * floor:
        raise VerificationFailed(
            f"INT8 (bf16 activations) vs its exact float32 twin: relative error {err:.3g}, "
            f"over {INT8_MARGIN} x the bf16 model's own {floor:.3g}"
        )
    return {
        "int8_f32_vs_twin": exact,
        "int8_vs_twin": err,
        "bf16_vs_f32": floor,
        "int8_vs_bf16": rel_err(logits["int8"], logits["bf16"]),
    }


def measure(quick: bool = False) -> dict:
    """Peak memory of one INT8 LoRA step of the RFA config, in processes of their own."""
    with tempfile.TemporaryDirectory() as tmp:
        worker_result(start_worker("train_int8", "checkpoint", tmp, quick=quick))
        verified = _verify(tmp)
        # with and without --grad-checkpoint, side by side (each a process of its own, each
        # mostly one core: MLX's CPU quantized matmul is single-threaded)
        plain = start_worker("train_int8", "train", tmp, quick=quick)
        checkpointed = start_worker("train_int8", "train", tmp, "--grad-checkpoint", quick=quick)
        runs = {"plain": worker_result(plain), "grad_checkpoint": worker_result(checkpointed)}
    return {"runs": runs, **verified, "preset": "rfa-1.5b" if not quick else "tiny"}


def render(q: dict) -> Rendered:
    """The verification, each run's peak memory and time, the goals."""
    lines = [
        f"Verified first, logits of 4 tokens of the {q['preset']} RFA checkpoint loaded with "
        f"--quantize int8, against its exact float32 twin (the same integers dequantized): "
        f"{q['int8_f32_vs_twin']:.1e} relative error with the INT8 model's float parameters "
        f"cast to float32 (exact arithmetic), {q['int8_vs_twin']:.3f} with its bf16 activations "
        f"(within {INT8_MARGIN:g} x the bf16 model's own error against float32, "
        f"{q['bf16_vs_f32']:.3f}: bf16 rounding in a deep random network); INT8 vs bf16 "
        f"{q['int8_vs_bf16']:.3f}.",
        "",
        f"INT8 LoRA (the default targets, rank 32) on the {q['preset']} RFA config (random "
        "weights saved in bf16, loaded with --quantize), batch 1, one step through `train()`, "
        "with and without --grad-checkpoint, each in a process of its own (the two side by "
        "side) with MLX's buffer cache off; the time is the whole run's (loading, quantizing, "
        "compiling, the step, saving).",
        "",
        "| run | T | peak resident | MLX's own peak | run time |",
        "|---|---|---|---|---|",
    ]
    goals = []
    for name, r in q["runs"].items():
        flag = "--grad-checkpoint" if name == "grad_checkpoint" else "default"
        lines.append(
            f"| {flag} | {r['T']} | {r['peak_rss'] / 1e9:.2f} GB | {r['mlx_peak'] / 1e9:.2f} GB "
            f"| {r['seconds']:.0f} s |"
        )
        goals.append(
            Goal(
                f"INT8 RFA LoRA ({flag}) peak resident memory, GB", r["peak_rss"] / 1e9, 3.0, False
            )
        )
    return with_goals(lines, goals)


SECTION = Section(
    measure, render, "INT8 RFA LoRA step's peak memory (1.5B: tens of minutes on a CPU)"
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("checkpoint", "train"))
    parser.add_argument("folder")
    parser.add_argument("--grad-checkpoint", action="store_true", help="with train")

    def work(args) -> dict:
        if args.part == "checkpoint":
            return checkpoint_worker(args.folder, args.quick)
        return train_worker(args.folder, args.quick, args.grad_checkpoint)

    worker_main(parser, work, argv)


if __name__ == "__main__":
    main()
