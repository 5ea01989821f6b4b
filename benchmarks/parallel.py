"""The parallel section: ``--parallel 4`` (stacked adapters, one batched step) against one
shard; 2-rank data parallel on localhost with the all-reduce's share.

``python -m benchmarks.parallel --worker [--quick]`` is one rank of the data-parallel run,
started by mlx.launch."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    time_steps,
    with_goals,
    worker_command,
    worker_env,
    worker_main,
)
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.models import Model, ModelConfig
from mlx_rwkvx.perf import best_time
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.distributed import all_sum, data_parallel_group
from mlx_rwkvx.tuner.optimizer import optimizer_for
from mlx_rwkvx.tuner.parallel import stack_adapters
from mlx_rwkvx.tuner.trainer import Step

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

PARALLEL = {
    "full": dict(layers=4, C=256, vocab=4096, T=512, batch=4, shards=4, rank=32, steps=3),
    "quick": dict(layers=2, C=64, vocab=256, T=32, batch=2, shards=4, rank=4, steps=2),
}


def _lora_model(p: dict, shards: int = 1) -> Model:
    cfg = ModelConfig(
        vocab_size=p["vocab"], hidden_size=p["C"], block_types=["rwkv7"] * p["layers"]
    )
    mx.random.seed(0)
    model = Model(cfg, seed=0)
    apply_lora(model, target_paths(model, "rwkv"), rank=p["rank"], alpha=2.0 * p["rank"])
    if shards > 1:
        stack_adapters(model, shards)
    return model


def _lora_step(model: Model, shards: int = 1, group=None, eps: float | None = None) -> Step:
    cfg = TrainConfig(mode="lora", lr=1e-3, warmup=0, parallel=shards).resolved()
    optimizer = optimizer_for(cfg, 100)
    if eps is not None:  # AdamW's eps in place of RWKV's (measure's check)
        optimizer.eps = eps
    return Step(model, optimizer, stacked=shards, group=group)


def _shard_rows(p: dict, shard: int):
    rng = np.random.default_rng(shard)
    tokens = rng.integers(0, p["vocab"], (p["batch"], p["T"] + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def _data_parallel(quick: bool) -> list[dict]:
    """Both ranks' results of ``python -m benchmarks.parallel --worker`` under mlx.launch."""
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    worker = worker_command("parallel", quick=quick)
    cmd = [
        launcher,
        "--backend",
        "ring",
        "-n",
        "2",
        "--hosts",
        "127.0.0.1",
        "--starting-port",
        str(40000 + os.getpid() % 20000),
        "--python",
        worker[0],
        "--",
        *worker[1:],
    ]
    out = subprocess.run(cmd, env=worker_env(), check=True, capture_output=True, text=True)
    ranks = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return sorted(ranks, key=lambda r: r["rank"])


def measure(quick: bool = False) -> dict:
    """--parallel N (one batched step of N stacked adapters) against one shard's step, verified
    first; and 2-rank data parallel on localhost (mlx.launch), its all-reduce's share."""
    p = sizes(PARALLEL, quick)
    n = p["shards"]
    rows = [_shard_rows(p, i) for i in range(n)]
    # verify: after one step, the stacked adapter of shard 0 is a single run's on shard 0 (B
    # starts at zero, so B is the step's update; A's gradient is zero while B is zero). AdamW's
    # eps = 1, far above sqrt(v) = 0.1 |g| (the gradient clipped to norm 1), makes the update
    # lr 0.1 g / (0.1 |g| + eps) proportional to the gradient; with eps = 1e-8 it is about
    # +-lr whatever the gradient's size, and a near-zero gradient's sign that another
    # summation order flips would make a 2 lr difference.
    single, stacked = _lora_model(p), _lora_model(p, n)
    _lora_step(single, eps=1.0)([rows[0]])
    together = (np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]))
    _lora_step(stacked, n, eps=1.0)([together])
    a = dict(tree_flatten(single.trainable_parameters()))
    b = dict(tree_flatten(stacked.trainable_parameters()))
    err = max(rel_err(b[k][0], a[k]) for k in a if k.endswith("lora_b"))
    # Error model: the same float32 sums in other orders (other batch shapes, another BLAS
    # blocking), so the update errs by at most about K u relative, K the longest sum (the
    # vocabulary, the FFN width, a shard's tokens), u = 2^-24: the worst case of one sum, which
    # also covers the step's chain of a few dozen sums (random errors: sqrt(D K) u); +1: the
    # update's own rounding.
    longest = max(p["vocab"], single.config.intermediate_size, p["batch"] * p["T"])
    bound = (longest + 1) * 2.0**-24
    if not err <= bound:
        raise VerificationFailed(
            f"--parallel shard 0 vs one run after a step: {err:.1e} (bound {bound:.1e})"
        )
    del single, stacked
    one_step = _lora_step(_lora_model(p))
    t_one = time_steps(lambda: one_step([rows[0]]), p["steps"])
    par_step = _lora_step(_lora_model(p, n), n)
    t_par = time_steps(lambda: par_step([together]), p["steps"])
    trainable = sum(v.size for _, v in tree_flatten(_lora_model(p).trainable_parameters()))
    # 2 ranks on localhost, each its own batch of the single shard's size
    return {
        "p": p,
        "verify_error": err,
        "verify_bound": bound,
        "one_shard_s": t_one,
        "parallel_s": t_par,
        "trainable": trainable,
        "ranks": _data_parallel(quick),
    }


def rank_worker(quick: bool = False) -> dict:
    """One rank of 2 under mlx.launch: LoRA steps on its batch, and the gradient all-sum alone
    (the same bytes) to time its share of a step."""
    p = sizes(PARALLEL, quick)
    group = data_parallel_group()
    model = _lora_model(p)
    step = _lora_step(model, group=group)
    batch = [_shard_rows(p, group.rank())]
    t_step = time_steps(lambda: step(batch), p["steps"])
    grads = model.trainable_parameters()
    nbytes = sum(v.size * 4 for _, v in tree_flatten(grads))

    def reduce():
        mx.eval(all_sum(grads, group))

    t_reduce = best_time(reduce, repeats=5)
    return {
        "rank": group.rank(),
        "step_s": t_step,
        "all_sum_s": t_reduce,
        "bytes": nbytes,
        "tokens": p["batch"] * p["T"],
    }


def render(r: dict) -> Rendered:
    """One shard against --parallel N, each data-parallel rank, the goal."""
    p, n = r["p"], r["p"]["shards"]
    tokens = p["batch"] * p["T"]
    one, par = tokens / r["one_shard_s"], n * tokens / r["parallel_s"]
    lines = [
        f"LoRA (rank {p['rank']}, the rwkv targets: {r['trainable']:,} trainable parameters a "
        f"shard) on a {p['layers']}-block C={p['C']} RWKV-7, vocab {p['vocab']}, T={p['T']}, "
        f"batch {p['batch']} per shard.",
        "",
        f"Verified first: after one step, shard 0's adapter of `--parallel {n}` against a run of "
        f"its own on the same rows, relative error {r['verify_error']:.1e}"
        + (f" (bound {r['verify_bound']:.1e})." if "verify_bound" in r else "."),
        "",
        "| run | step | tokens/s | vs one shard |",
        "|---|---|---|---|",
        f"| one shard | {r['one_shard_s']:.2f} s | {one:.0f} | 1.00 |",
        f"| --parallel {n} (one batched step) | {r['parallel_s']:.2f} s | {par:.0f} "
        f"| {par / one:.2f} |",
        "",
        "Data parallel, 2 ranks on localhost (mlx.launch, ring backend; both share this "
        "machine's cores), each a batch of one shard's size:",
        "",
        "| rank | step | tokens/s | gradient all-sum | its share of the step | bytes a step |",
        "|---|---|---|---|---|---|",
    ]
    for k in r["ranks"]:
        lines.append(
            f"| {k['rank']} | {k['step_s']:.2f} s | {k['tokens'] / k['step_s']:.0f} | "
            f"{k['all_sum_s'] * 1e3:.1f} ms | {k['all_sum_s'] / k['step_s']:.1%} | "
            f"{k['bytes'] / 1e6:.1f} MB |"
        )
    total = sum(k["tokens"] / k["step_s"] for k in r["ranks"])
    lines += [
        "",
        f"Both ranks together: {total:.0f} tokens/s ({total / one:.2f} x one process "
        "alone on this machine).",
        "",
    ]
    return with_goals(lines, [Goal(f"--parallel {n} tokens/s vs one shard", par / one, 2.5, True)])


SECTION = Section(
    measure, render, "--parallel N against one shard; 2-rank data parallel on localhost"
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=rank_worker.__doc__)
    worker_main(parser, lambda args: rank_worker(args.quick), argv)


if __name__ == "__main__":
    main()
