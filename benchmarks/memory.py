"""The memory section: where one training step's memory goes, for the INT8 LoRA run on the 1.5B
RFA preset (T = 256, batch 1, the default LoRA rank and targets), with and without
--grad-checkpoint: each run a process of its own, two steps through ``train_from_config`` as
a user's run makes them (on a CPU, MLX's buffer cache off while training), instrumented. The
weights by kind, the gradients and the optimizer state are counted from the arrays; the
forward and backward's peak (activations kept for the backward, their transients) and the head
and loss alone by MLX's peak counter; the process before any model and MLX's buffer cache by the
resident memory and MLX's counters; each import's cost in a fresh interpreter. The runs are
without torch (no dependency; transformers imports it where installed: the import row's cost).

    python -m benchmarks.memory --worker checkpoint FOLDER [--quick]
    python -m benchmarks.memory --worker breakdown FOLDER [--grad-checkpoint] [--quick]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from functools import partial

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    resident_memory,
    sizes,
    start_worker,
    with_goals,
    worker_main,
    worker_result,
)
from benchmarks.workloads import rfa_model_config
from mlx_rwkvx.data.loss import token_loss
from mlx_rwkvx.data.records import write_bin
from mlx_rwkvx.io.load import save
from mlx_rwkvx.models import Model
from mlx_rwkvx.tuner import trainer
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.memory import footprint, nbytes

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten

T_TRAIN = {"full": 256, "quick": 32}
COUNT_TOL = 0.02  # the arrays counted against MLX's own count of what it holds
STEPS = 2
# What a training process may import that it does not need, or needs only for some inputs
HEAVY = ("torch", "transformers", "mlx_lm", "tokenizers", "fastapi", "uvicorn", "lm_eval")
IMPORTS = ("mlx.core", "mlx_rwkvx", "mlx_lm", "transformers", "torch", "mlx_rwkvx.train")


def weight_kinds(model: nn.Module) -> dict[str, int]:
    """Bytes of the model's parameters by kind: quantized integers, their scales and biases,
    float parameters that are frozen, trained parameters."""
    trained = {k for k, _ in tree_flatten(model.trainable_parameters())}
    quant = (nn.QuantizedLinear, nn.QuantizedEmbedding)
    quantized = {path for path, m in model.named_modules() if isinstance(m, quant)}
    kinds = dict.fromkeys(("quantized", "scales_biases", "frozen_float", "trained"), 0)
    for name, x in tree_flatten(model.parameters()):
        module, _, leaf = name.rpartition(".")
        if name in trained:
            kind = "trained"
        elif module in quantized:
            kind = "quantized" if leaf == "weight" else "scales_biases"
        else:
            kind = "frozen_float"
        kinds[kind] += x.nbytes
    return kinds


def checkpoint_worker(folder: str, quick: bool = False) -> dict:
    """The RFA config's random weights saved in bf16 (built lazily: no float32 copy of the
    whole model) and a .bin data set of two texts of T + 1 tokens."""
    cfg = rfa_model_config(quick)
    model = Model(cfg, init=None)
    model.set_dtype(mx.bfloat16)
    save(model, folder + "/bf16")
    T = sizes(T_TRAIN, quick)
    rng = np.random.default_rng(0)
    texts = [rng.integers(0, cfg.vocab_size, T + 1) for _ in range(2 * STEPS)]
    write_bin(folder + "/data.bin", texts)
    return {"T": T}


def instrument(steps: list[dict], seen: dict) -> None:
    """``trainer.Step``'s step and micro-batch wrapped from outside: MLX's counters and the
    resident memory around each appended to ``steps``; the model and optimizer put in
    ``seen``."""
    step_fn, micro_fn = trainer.Step.__call__, trainer.Step.loss_and_grad

    def step(self, micro_batches, stop=False):
        seen.update(model=self.model, optimizer=self.optimizer)
        seen.setdefault("peak_before_steps", resident_memory()[1])  # loading's, the first time
        before, t0 = mx.get_active_memory(), time.perf_counter()
        out = step_fn(self, micro_batches, stop)
        steps[-1].update(
            active_before=before,
            cache_after=mx.get_cache_memory(),
            optimizer_state=nbytes(self.optimizer.state),
            peak_resident=resident_memory()[1],
            seconds=time.perf_counter() - t0,
        )
        return out

    def micro(self, inputs, targets):
        mx.synchronize()
        start = mx.get_active_memory()
        mx.reset_peak_memory()
        loss, count, grads = micro_fn(self, inputs, targets)
        steps.append(dict(micro_start=start, micro_peak=mx.get_peak_memory()))
        steps[-1]["gradients"] = nbytes(grads)
        return loss, count, grads

    trainer.Step.__call__, trainer.Step.loss_and_grad = step, micro


def head_and_loss(model, T: int) -> int:
    """Peak bytes above its inputs of the head and loss's value and gradient (w.r.t. the hidden
    states) at T tokens: ``token_loss``, what training calls."""
    h = mx.random.normal((1, T, model.config.hidden_size)).astype(mx.bfloat16)
    targets = mx.random.randint(0, model.config.vocab_size, (1, T))

    def loss(h):
        return token_loss(model, h, targets)[0]

    mx.eval(h, targets)
    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(mx.value_and_grad(loss)(h))
    return mx.get_peak_memory() - start


def breakdown_worker(folder: str, quick: bool = False, grad_checkpoint: bool = False) -> dict:
    """Two INT8 LoRA steps through ``train_from_config``, instrumented (the module's docstring)."""
    resident0, _ = resident_memory()
    loaded = [m for m in HEAVY if sys.modules.get(m) is not None]  # None: hidden
    steps, seen = [], {}
    instrument(steps, seen)
    T = sizes(T_TRAIN, quick)
    settings = dict(quantize="int8", iters=STEPS, max_seq_len=T, grad_checkpoint=grad_checkpoint)
    out = folder + ("/out_checkpoint" if grad_checkpoint else "/out")
    t0 = time.perf_counter()
    data, model = folder + "/data.bin", folder + "/bf16"
    train_from_config(TrainConfig(model=model, data=data, output=out, save_every=99, **settings))
    seconds = time.perf_counter() - t0
    _, peak_resident = resident_memory()
    model = seen["model"]
    return {
        "T": T,
        "grad_checkpoint": grad_checkpoint,
        "baseline_resident": resident0,
        "imported": loaded,
        "weights": weight_kinds(model),
        "steps": steps,
        "mlx_peak": mx.get_peak_memory(),
        "peak_resident": peak_resident,
        "head_and_loss": head_and_loss(model, T),
        "seconds": seconds,
        # what train estimated before its first step (tuner/memory.py), the process measured
        "estimate": footprint(model, T, 1, checkpoint=grad_checkpoint, process=resident0).total,
    }


def import_cost(module: str) -> int:
    """Resident bytes of a fresh interpreter after ``import module`` (``sys``: a bare one)."""
    code = (
        f"import {module}\n"
        "fields = dict(l.split(':', 1) for l in open('/proc/self/status'))\n"
        "print(int(fields['VmRSS'].split()[0]) * 1024)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return int(done.stdout.strip().splitlines()[-1])


def measure(quick: bool = False) -> dict:
    """The imports' cost, then both training runs side by side, in processes of their own."""
    imports = {m: import_cost(m) for m in ("sys", *(IMPORTS[:1] if quick else IMPORTS))}
    with tempfile.TemporaryDirectory() as tmp:
        worker_result(start_worker("memory", "checkpoint", tmp, quick=quick))
        start = partial(start_worker, "memory", "breakdown", tmp, quick=quick, without=("torch",))
        plain, checkpointed = start(), start("--grad-checkpoint")
        runs = {"default": worker_result(plain), "grad_checkpoint": worker_result(checkpointed)}
    for name, r in runs.items():
        # the method, checked: the arrays counted are what MLX holds when the step begins
        held = r["steps"][-1]["active_before"]
        counted = sum(r["weights"].values()) + r["steps"][-1]["optimizer_state"]
        r["counted_vs_held"] = rel_err(np.array([counted]), np.array([held]))
        if not r["counted_vs_held"] <= COUNT_TOL:
            raise VerificationFailed(
                f"{name}: weights and optimizer state counted {counted} B, MLX holds {held} B "
                f"when the second step begins (relative {r['counted_vs_held']:.3f})"
            )
    return {"imports": imports, "runs": runs, "preset": "rfa-1.5b" if not quick else "tiny"}


def _gb(x: float) -> str:
    return f"{x / 1e9:.2f}"


def breakdown_rows(r: dict) -> list[tuple[str, float]]:
    """One run's memory by part, in bytes, at its second step (the first also compiles and
    measures the ops): the rows not indented add up to the resident peak; the indented ones are
    parts of the row above them, or (the cache after the step) of what freed buffers became."""
    last = r["steps"][-1]
    w = r["weights"]
    activations = last["micro_peak"] - last["micro_start"] - last["gradients"]
    beyond = r["peak_resident"] - r["baseline_resident"] - last["micro_peak"]
    return [
        ("Python, MLX and the imports, before any model", r["baseline_resident"]),
        ("weights: INT8 integers", w["quantized"]),
        ("weights: their scales and biases", w["scales_biases"]),
        ("weights: float parameters, frozen", w["frozen_float"]),
        ("LoRA parameters (trained)", w["trained"]),
        ("their gradients", last["gradients"]),
        ("optimizer state (AdamW: two moments)", last["optimizer_state"]),
        ("forward + backward: MLX's peak above all of the above", activations),
        ("  of it, the head and loss alone", r["head_and_loss"]),
        ("beyond MLX's peak: freed buffers it keeps, the allocator's pages", beyond),
        ("  MLX's buffer cache after the step (freed activations)", last["cache_after"]),
    ]


def render(q: dict) -> Rendered:
    imports = q["imports"]
    bare = imports["sys"]
    runs = q["runs"]
    checked = ", ".join(f"{r['counted_vs_held']:.1e} ({n})" for n, r in runs.items())
    lines = [
        "Verified first: the weights and optimizer state counted from the arrays are what MLX "
        f"holds when the second step begins, relative difference {checked}.",
        "",
        f"INT8 LoRA (default rank and targets) on the {q['preset']} RFA config (random weights "
        "saved in bf16, loaded with --quantize int8), batch 1, two steps through `train()` as "
        "a run makes them (on a CPU, MLX's buffer cache off while it steps), each run in a "
        "process of its own (the two side by side); the parts at "
        "the second step, counted from the arrays where they are arrays, from MLX's peak "
        "counter around the micro-batch for the forward and backward, and the process's own "
        "resident peak (Linux's VmHWM). The rows not indented add up to the peak.",
        "",
        "| part | default, GB | --grad-checkpoint, GB |",
        "|---|---|---|",
    ]
    table = {name: breakdown_rows(r) for name, r in runs.items()}
    for i, (part, _) in enumerate(table["default"]):
        cells = " | ".join(_gb(table[name][i][1]) for name in runs)
        lines.append(f"| {part} | {cells} |")
    cells = " | ".join(_gb(r["peak_resident"]) for r in runs.values())
    lines.append(f"| **peak resident, whole process** | {cells} |")
    if all("estimate" in r for r in runs.values()):
        cells = " | ".join(_gb(r["estimate"]) for r in runs.values())
        lines.append(f"| the run's own estimate before its first step | {cells} |")
    cells = " | ".join(f"{r['seconds']:.0f} s" for r in runs.values())
    lines.append(f"| run time (load, quantize, compile, two steps, save) | {cells} |")
    lines += [
        "",
        "What importing costs, each in a fresh interpreter (resident MB above a bare Python's "
        f"{bare / 1e6:.0f} MB): "
        + ", ".join(f"`{m}` {(imports[m] - bare) / 1e6:.0f}" for m in IMPORTS if m in imports)
        + f". The training process had imported: {', '.join(runs['default']['imported'])} "
        "(torch hidden, as a default install has none; where installed, transformers imports it).",
    ]
    name = "INT8 RFA LoRA T={} ({}) peak resident memory, GB"
    goals = [
        Goal(name.format(r["T"], n), r["peak_resident"] / 1e9, 3.0, False) for n, r in runs.items()
    ]
    return with_goals(lines, goals)


SECTION = Section(measure, render, "where an INT8 LoRA step's memory goes (1.5B: 40 minutes)")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("checkpoint", "breakdown"))
    parser.add_argument("folder")
    parser.add_argument("--grad-checkpoint", action="store_true", help="with breakdown")

    def work(args) -> dict:
        if args.part == "checkpoint":
            return checkpoint_worker(args.folder, args.quick)
        return breakdown_worker(args.folder, args.quick, args.grad_checkpoint)

    worker_main(parser, work, argv)


if __name__ == "__main__":
    main()
