"""``python -m mlx_rwkvx.demo [--quick] [--out DIR]``: the toolkit's whole job in minutes, offline.

1. A synthetic corpus, as text: key-value recall (``key=value;`` pairs, then ``?`` and the keys
   asked again: each value is 3 digits, chance 1 in 1000), copying and small sums; held-out
   examples from another seed.
2. Pretraining a tiny RWKV-X (byte tokenizer, RWKV-7 and MoBA blocks) on it with
   ``python -m mlx_rwkvx.train --mode pretrain``.
3. A new task the base never saw, reversing a word, fine-tuned as two Macs would:
   the data split 3:1 by ``python -m mlx_rwkvx.pretokenize --split-weights 3,1``, the larger
   part trained with ``--parallel 2``, the other alone, and the Macs' LoRA adapters merged by
   ``python -m mlx_rwkvx.merge``: Foundry's FedAvg (A and B averaged apart), and exactly (the
   updates B @ A of the three parts averaged by their tokens, re-factored by SVD).
4. Answers to a few held-out prompts before and after each stage and a table of held-out
   accuracy per task and stage.

Every stage runs the command-line tools' own ``main`` with the arguments printed beside it.
Everything lands in ``--out`` (default ``./mlx_rwkvx-demo``; what an earlier run wrote there is
replaced, what else is there is kept): the model, the adapters, ``metrics.jsonl`` (a line per
stage), ``loss.png`` (with matplotlib), and the data. Accuracy is exact match of the whole
answer under greedy decoding (computed for a batch at once: the answer's tokens are each the
argmax after the ones before them). ``--quick`` runs the same stages at toy sizes (for the
tests; accuracy meaningless): seconds, after the first run on a machine, which compiles MLX's
CPU kernels (about a minute and a half on 2 cores).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx import cli, settings
from mlx_rwkvx.demo.folder import prepare
from mlx_rwkvx.demo.sizes import FULL, QUICK
from mlx_rwkvx.demo.stages import Demo
from mlx_rwkvx.io.targets import output_lock, remove_stale, resolve_target
from mlx_rwkvx.settings import Settings, opt

PROG = "mlx_rwkvx.demo"
DEFAULT_OUT = "./mlx_rwkvx-demo"


@dataclass
class DemoConfig(Settings):
    """The demo's settings: where it writes, and at which sizes."""

    out: str = opt("where everything goes", default=DEFAULT_OUT)
    quick: bool = opt(
        "toy sizes: seconds, once MLX has compiled its CPU kernels (the first run on a machine: "
        "a minute and a half on 2 cores)",
        default=False,
    )


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = settings.load(DemoConfig, argv, PROG, description=__doc__, yaml=False)
        # resolved: the printed commands run from any folder; never the current folder or one
        # above it, the home folder or /
        out = Path(os.path.realpath(resolve_target(Path(cfg.out).expanduser(), what="--out")))
        with output_lock(str(out), "--out"):
            remove_stale(str(out.parent), out.name)
            prepare(out)
            started = time.perf_counter()
            mlx_rwkvx.configure()
            demo = Demo(out, QUICK if cfg.quick else FULL, cfg.quick)
            demo.corpus()
            base = demo.pretrain()
            merged = demo.finetune(base)
            demo.report(base, merged, started)

    cli.run(PROG, body, kept="the stages finished so far are in --out")
