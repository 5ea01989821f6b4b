"""State tuning's learning rate, measured: the demo's pretrained model state-tuned on the task it
never saw (reversing a word) at RWKV-PEFT's schedule (1.0 decaying to 0.01) and at small rates,
then the held-out loss on that task and on the base's own data, before and after.

    python -m mlx_rwkvx.demo --out demo/            # the base, its data and the new task
    python scripts/state_tuning_lr.py --demo demo/ --out state-lr/

Writes ``state-lr/results.json`` and prints the table README's "State tuning" recipe quotes.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the package, from a checkout

import mlx_rwkvx  # noqa: E402
from mlx_rwkvx.data.examples import load_examples  # noqa: E402
from mlx_rwkvx.tuner.config import TrainConfig  # noqa: E402
from mlx_rwkvx.tuner.from_config import train_from_config  # noqa: E402
from mlx_rwkvx.tuner.trainer import evaluate  # noqa: E402

RATES = (1.0, 3e-2, 3e-3, 3e-4)  # RWKV-PEFT's, then smaller ones (rwkv-metal's 3e-4 among them)


def _losses(model, tokenizer, task: Path, base: Path) -> dict:
    out = {}
    for name, path in (("task", task), ("base data", base)):
        examples, _ = load_examples(str(path), tokenizer, max_seq_len=512)
        out[name] = evaluate(model, examples, batch_size=16)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--demo", required=True, help="the folder python -m mlx_rwkvx.demo wrote")
    parser.add_argument("--out", required=True, help="where the runs and results.json go")
    parser.add_argument("--iters", type=int, default=300, help="steps of each run")
    args = parser.parse_args()
    demo, out = Path(args.demo), Path(args.out).resolve()  # "x/.." is the folder it names
    if not args.out or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        parser.error(f"--out {args.out!r}: give a new or empty folder (nothing there is replaced)")
    if not (demo / "pretrain" / "model").is_dir():
        parser.error(f"--demo {args.demo!r}: no pretrain/model in it (python -m mlx_rwkvx.demo)")
    base = demo / "pretrain" / "model"
    lines = (demo / "data" / "reverse.jsonl").read_text().splitlines()
    cut = len(lines) * 9 // 10
    task = out / "task"
    task.mkdir(parents=True, exist_ok=True)
    (task / "train.jsonl").write_text("\n".join(lines[:cut]) + "\n")
    (task / "valid.jsonl").write_text("\n".join(lines[cut:]) + "\n")
    base_valid = demo / "data" / "pretrain" / "valid.jsonl"
    model, tokenizer = mlx_rwkvx.load(base)
    rows = [{"run": "base", **_losses(model, tokenizer, task / "valid.jsonl", base_valid)}]
    print(rows[-1], flush=True)
    for lr in RATES:
        run = out / f"lr-{lr:g}"
        tic = time.time()
        cfg = TrainConfig(
            model=str(base),
            data=str(task),
            output=str(run),
            mode="state",
            lr=lr,
            iters=args.iters,
            batch_size=16,
            log_every=100,
            save_every=10**6,
            seed=0,
        )
        train_from_config(cfg)
        model, _ = mlx_rwkvx.load(base, adapter=run)
        rows.append(
            {
                "run": f"lr {lr:g}",
                "seconds": time.time() - tic,
                **_losses(model, tokenizer, task / "valid.jsonl", base_valid),
            }
        )
        print(rows[-1], flush=True)
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(
        f"\n| state tuning ({args.iters} steps, batch 16) | reverse-a-word loss (held out) | "
        "the base's own data |"
    )
    print("|---|---|---|")
    for row in rows:
        print(f"| {row['run']} | {row['task']:.3f} | {row['base data']:.3f} |")


if __name__ == "__main__":
    main()
