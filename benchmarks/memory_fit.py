"""The memory-fit section: which model each Mac can fine-tune. For each row of goals (a released
RWKV-7 shape, its base, the mode, T), the peak resident memory of a whole training process
(batch 1, two steps through ``train_from_config``, the default LoRA rank and targets), with
block checkpointing (what a run turns on by itself where it would not fit) and with the
defaults, beside the run's own estimate and the weights' size. A whole 7.2B step is hours on a
CPU: each row runs its preset cut to a few blocks (``BLOCKS``), the whole model's numbers
extrapolated per block (every part of a step is the same for every block, or one block's at a
time); the extrapolation is checked first on a model also run whole.

    python -m benchmarks.memory_fit --worker build FOLDER ROW 0 [--quick]
    python -m benchmarks.memory_fit --worker train FOLDER ROW BLOCKS [--grad-checkpoint] [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
from functools import partial
from typing import NamedTuple

from benchmarks.common import (
    RESULTS_DIR,
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    now,
    rel_err,
    resident_memory,
    sizes,
    start_worker,
    with_goals,
    worker_main,
    worker_result,
)
from benchmarks.memory import instrument
from mlx_rwkvx.data.records import write_bin
from mlx_rwkvx.io.atomic import atomic_target, save_text
from mlx_rwkvx.io.load import save
from mlx_rwkvx.models import Model, ModelConfig
from mlx_rwkvx.models.config import preset
from mlx_rwkvx.tuner import memory
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config

import mlx.core as mx
import numpy as np

STEPS = 2
BLOCKS = (4, 8)  # the cuts run: fewer over-estimate the whole (0.4B: 1 and 2 +36%, 2 and 4 +10%)
MACS = (8, 16, 24, 36, 64)  # GB of the Macs sold
WORKING_SET = 0.7  # of a Mac's memory, what Metal lets a process use (about 70-75%)
EXTRAPOLATION_TOL = 0.05  # extrapolated against measured, on the model run whole
ESTIMATE_TOL = 0.15  # the run's own estimate against its measured peak
KEPT = RESULTS_DIR / "memory-fit.rows.json"  # a full run's rows so far


class Row(NamedTuple):
    model: str  # a preset's name, or "tiny" (the quick run's)
    base: str  # "bf16", "int8", "int4"
    mode: str  # "lora", "state"
    T: int
    goal: float | None  # GB, the checkpointed peak's (None: a row for the method's check only)
    whole: bool = False  # also run whole, checkpointed: the extrapolation's check


ROWS = {
    "full": [
        Row("rwkv7-2.9b", "int4", "lora", 512, 3.0, whole=True),
        Row("rwkv7-1.5b", "int4", "lora", 512, 1.8),
        Row("rwkv7-1.5b", "bf16", "state", 1024, 4.0),
        Row("rwkv7-7.2b", "int4", "lora", 512, 6.5),
        Row("rwkv7-7.2b", "int8", "lora", 512, 10.0),
    ],
    "quick": [Row("tiny", "int8", "lora", 32, 3.0, whole=True)],
}


def model_config(row: Row, blocks: int) -> ModelConfig:
    """The row's config cut to its first ``blocks`` blocks (0: whole)."""
    if row.model == "tiny":
        cfg = ModelConfig(vocab_size=512, hidden_size=128, block_types=["rwkv7"] * 10)
    else:
        cfg = preset(row.model)
    if blocks:
        cfg = dataclasses.replace(cfg, block_types=cfg.block_types[:blocks])
    return cfg


def cuts(row: Row) -> tuple[int, ...]:
    """The block counts a row runs (0: whole)."""
    return (*BLOCKS, 0) if row.whole else BLOCKS


def build_worker(folder: str, row: Row) -> dict:
    """Each cut's random weights saved in bf16 (built lazily, one at a time), and the row's
    data: texts of T + 1 tokens."""
    for n in cuts(row):
        cfg = model_config(row, n)
        model = Model(cfg, init=None)
        model.set_dtype(mx.bfloat16)
        save(model, f"{folder}/m{n}")
        del model
    rng = np.random.default_rng(0)
    texts = [rng.integers(0, cfg.vocab_size, row.T + 1) for _ in range(2 * STEPS)]
    write_bin(f"{folder}/data.bin", texts)
    return {"blocks": len(model_config(row, 0).block_types)}


def train_worker(folder: str, row: Row, blocks: int, grad_checkpoint: bool) -> dict:
    """Two steps of the row's training on the cut model: the process's peak resident memory,
    and what the run estimated (``tuner/memory.py``), its weights' part alone too."""
    steps, seen, estimates = [], {}, []
    instrument(steps, seen)
    estimate_of = memory.footprint  # the run's own estimates, the last one what it printed
    memory.footprint = lambda *a, **k: estimates.append(estimate_of(*a, **k)) or estimates[-1]
    settings = dict(iters=STEPS, max_seq_len=row.T, mode=row.mode, grad_checkpoint=grad_checkpoint)
    if row.base != "bf16":
        settings["quantize"] = row.base
    out = f"{folder}/out{blocks}{'c' if grad_checkpoint else ''}"
    data, model = f"{folder}/data.bin", f"{folder}/m{blocks}"
    train_from_config(TrainConfig(model=model, data=data, output=out, save_every=99, **settings))
    _, peak = resident_memory()
    estimate = estimates[-1]
    return {
        "peak": peak,
        "peak_before_steps": seen["peak_before_steps"],
        "estimate": estimate.total,
        "weights": estimate.weights,
    }


def _extrapolated(runs: dict, blocks: int) -> dict:
    """Every measure of the runs of the two cuts (``BLOCKS``), at ``blocks`` blocks: linear."""
    (m, few), (n, more) = ((b, runs[str(b)]) for b in BLOCKS)
    return {k: few[k] + (blocks - m) * (more[k] - few[k]) / (n - m) for k in few}


def _kept_rows() -> dict:
    """The rows a full run measured so far (``KEPT``), by their settings."""
    try:
        return json.loads(KEPT.read_text())
    except (OSError, ValueError):
        return {}


def measure(quick: bool = False) -> dict:
    """Each row in a folder of its own: the cut models built, then the checkpointed and the
    default runs side by side, each a process of its own; the first row also whole. A full run
    takes hours on a CPU: each row measured is kept in ``KEPT`` until the section is done, and
    a run stopped part way goes on from there (a row's date says when it was measured)."""
    rows, kept = [], {} if quick else _kept_rows()
    for i, row in enumerate(sizes(ROWS, quick)):
        key = json.dumps({**row._asdict(), "cuts": BLOCKS}, sort_keys=True)
        if key not in kept:
            kept[key] = _measure_row(i, row, quick)
            if not quick:  # kept first: a failed check below leaves its measurements to read
                with atomic_target(str(KEPT), folder=False) as tmp_file:
                    save_text(tmp_file, json.dumps(kept, indent=1) + "\n")
        result = kept[key]
        rows.append(result)
        if "extrapolation_error" in result:
            whole = result["runs"]["checkpoint"]["0"]["peak"]
            extrapolated = np.array([result["whole"]["checkpoint"]["peak"]])
            off = rel_err(extrapolated, np.array([whole]))
            if not off <= 5 * EXTRAPOLATION_TOL:  # the method itself broken, not a goal missed
                raise VerificationFailed(
                    f"{row.model}: {result['blocks']} blocks measured {whole} B, extrapolated "
                    f"from {' and '.join(map(str, BLOCKS))} blocks {extrapolated[0]:.0f} B "
                    f"(the runs: {KEPT})"
                )
    if not quick:
        KEPT.unlink(missing_ok=True)  # the report holds them now
    return {"rows": rows}


def _measure_row(i: int, row: Row, quick: bool) -> dict:
    """One row's runs, its whole model's numbers extrapolated (see ``measure``)."""
    with tempfile.TemporaryDirectory() as tmp:
        build = start_worker("memory_fit", "build", tmp, str(i), "0", quick=quick)
        blocks = worker_result(build)["blocks"]
        runs = {"checkpoint": {}, "default": {}}
        for n in cuts(row):
            start = [("checkpoint", ("--grad-checkpoint",))]
            if n:  # the whole model runs checkpointed only: the method's check
                start.append(("default", ()))
            train = partial(start_worker, "memory_fit", "train", tmp, str(i), str(n))
            procs = [
                (kind, train(*flags, quick=quick, without=("torch",))) for kind, flags in start
            ]
            for kind, proc in procs:
                runs[kind][str(n)] = worker_result(proc)
    result = {"row": row._asdict(), "blocks": blocks, "runs": runs, "date": now()}
    result["whole"] = {k: _extrapolated(r, blocks) for k, r in runs.items()}
    if "0" in runs["checkpoint"]:
        measured = runs["checkpoint"]["0"]["peak"]
        result["extrapolation_error"] = result["whole"]["checkpoint"]["peak"] / measured - 1
    return result


def smallest_mac(peak: float) -> str:
    """The smallest Mac whose working set holds ``peak`` bytes."""
    fits = [gb for gb in MACS if peak <= gb * WORKING_SET * 1e9]
    return f"{fits[0]} GB" if fits else f"over {MACS[-1]} GB"


def _gb(x: float) -> str:  # bytes as GB
    return f"{x / 1e9:.2f}"


def flags(row: dict) -> str:
    """The training flags of a row (beside --model and --data)."""
    base = f"--quantize {row['base']} " if row["base"] != "bf16" else ""
    return f"`{'--mode state ' * (row['mode'] == 'state')}{base}--max-seq-len {row['T']}`"


def table_lines(results: dict) -> list[str]:
    """The rows with goals as a Markdown table: what README.md's "which Mac" table shows."""
    lines = [
        "| model | train flags | peak, checkpointed (GB) | goal | defaults' peak | estimate "
        "| weights | smallest Mac |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results["rows"]:
        row, whole = r["row"], r["whole"]
        if row["goal"] is None:
            continue
        ckpt, plain = whole["checkpoint"], whole["default"]
        lines.append(
            f"| {row['model']} | {flags(row)} | {_gb(ckpt['peak'])} | <= {row['goal']:.1f} "
            f"| {_gb(plain['peak'])} | {_gb(ckpt['estimate'])} | {_gb(ckpt['weights'])} "
            f"| {smallest_mac(ckpt['peak'])} |"
        )
    return lines


def render(results: dict) -> Rendered:
    check = next(r for r in results["rows"] if "extrapolation_error" in r)
    measured = check["runs"]["checkpoint"]["0"]["peak"]
    row = check["row"]
    dates = sorted(r["date"] for r in results["rows"])
    cut = " and ".join(map(str, BLOCKS))
    lines = [
        f"Verified first: the per-block extrapolation on {row['model']} ({row['base']} "
        f"{row['mode']}, T={row['T']}, checkpointed), run whole ({check['blocks']} blocks): "
        f"measured {_gb(measured)} GB, extrapolated from {cut} blocks "
        f"{_gb(check['whole']['checkpoint']['peak'])} GB ({check['extrapolation_error']:+.1%}).",
        "",
        "Peak resident memory (Linux's VmHWM) of a whole training process: batch 1, two steps "
        "through `train()` as a run makes them, the default LoRA rank and targets, random "
        "weights saved in bf16 and loaded with the row's --quantize, torch not installed. Each "
        f"row's preset runs cut to {cut} blocks, each run a process of its own; the "
        "whole model's numbers are extrapolated per block. Checkpointed: --grad-checkpoint, "
        "what a run turns on by itself where it would not fit; defaults: without. The "
        "estimate is the run's own (printed before its first step), at the same cut and "
        f"extrapolated the same way. Smallest Mac: its working set taken as {WORKING_SET:.0%} "
        "of its memory. Measured on Linux (CPU), not on a Mac"
        + (f"; rows measured from {dates[0]} to {dates[-1]}." if len(set(dates)) > 1 else "."),
        "",
        *table_lines(results),
    ]
    off = 100 * abs(check["extrapolation_error"])
    goals = [Goal("extrapolated / measured whole, % off", off, 100 * EXTRAPOLATION_TOL, False)]
    errors = []
    for r in results["rows"]:
        for runs in r["runs"].values():
            errors += [abs(x["estimate"] / x["peak"] - 1) for x in runs.values()]
        if r["row"]["goal"] is not None:
            row = r["row"]
            name = f"{row['model']} {row['base']} {row['mode']} T={row['T']} peak resident, GB"
            goals.append(Goal(name, r["whole"]["checkpoint"]["peak"] / 1e9, row["goal"], False))
    name = "the run's estimate against every run's peak, % off (largest)"
    goals.append(Goal(name, 100 * max(errors), 100 * ESTIMATE_TOL, False))
    return with_goals(lines, goals)


SECTION = Section(measure, render, "which model each Mac can fine-tune: peaks per released shape")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("build", "train"))
    parser.add_argument("folder")
    parser.add_argument("row", type=int)
    parser.add_argument("blocks", type=int, help="the cut: 0 for the whole model")
    parser.add_argument("--grad-checkpoint", action="store_true", help="with train")

    def work(args) -> dict:
        row = sizes(ROWS, args.quick)[args.row]
        if args.part == "build":
            return build_worker(args.folder, row)
        return train_worker(args.folder, row, args.blocks, args.grad_checkpoint)

    worker_main(parser, work, argv)


if __name__ == "__main__":
    main()
