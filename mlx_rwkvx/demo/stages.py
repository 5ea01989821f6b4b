"""The demo's stages on its output folder: the corpus written, the pretraining, the data split
and the LoRA fine-tuning of two Macs, the merges, and the report (the accuracy table, the time
per stage, the goals, ``loss.png`` and the command that chats with the result). Each stage runs
the command-line tools' own code with the arguments printed beside it, scores the held-out
questions after it and appends its line to ``metrics.jsonl``."""

from __future__ import annotations

import json
import random
import shlex
import time
from dataclasses import asdict
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx import train as train_cli
from mlx_rwkvx.demo.corpus import Tasks, write_jsonl
from mlx_rwkvx.demo.sizes import Sizes
from mlx_rwkvx.models import Model, ModelConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.merge import merge_adapters
from mlx_rwkvx.tuner.pretokenize import pretokenize

import mlx.core as mx
import numpy as np

TRAIN_SEED, HELD_OUT_SEED, VALID_SEED = 0, 1, 2  # the training texts never hold a held-out question
SPLIT = "3,1"  # the fine-tuning data: 3 parts on the first Mac, 1 on the second


# ----- scoring -----------------------------------------------------------------------------------


def accuracy(model: Model, tokenizer, questions: list[tuple[str, str]]) -> float:
    """Exact-match accuracy of greedy answers, for the whole list in one batched forward: each
    token of the answer and its closing ``;`` is scored as the argmax after the prompt and the
    tokens before it, which is exactly when greedy decoding writes that answer and stops."""
    rows = [(tokenizer.encode(p), tokenizer.encode(a + ";")) for p, a in questions]
    width = max(len(p) + len(a) for p, a in rows)
    ids = np.zeros((len(rows), width), dtype=np.int32)
    for i, (p, a) in enumerate(rows):
        ids[i, : len(p) + len(a)] = p + a
    right = 0
    for start in range(0, len(rows), 64):
        pred = np.array(mx.argmax(model(mx.array(ids[start : start + 64])), axis=-1))
        for j, (p, a) in enumerate(rows[start : start + 64]):
            right += all(pred[j, len(p) - 1 + t] == a[t] for t in range(len(a)))
    return right / len(rows)


def greedy(model: Model, tokenizer, prompt: str, answer: str) -> str:
    """The model's greedy text through the generation API, as long as the answer and its
    closing ``;``."""
    return mlx_rwkvx.generate(model, tokenizer, prompt, max_tokens=len(answer) + 1, temp=0.0)


# ----- the stages --------------------------------------------------------------------------------


class Demo:
    def __init__(self, out: Path, sizes: Sizes, quick: bool):
        self.out, self.sizes, self.quick = out, sizes, quick
        self.tasks = Tasks(sizes)
        rng = random.Random(HELD_OUT_SEED)
        self.held_out = {
            t: [self.tasks.question(t, rng) for _ in range(sizes.held_out)]
            for t in ("recall", "copy", "sum", "reverse")
        }
        for questions in self.held_out.values():
            self.tasks.hold_out(questions)
        self.table: list[tuple[str, dict[str, float]]] = []
        self.times: dict[str, float] = {}
        self.records: list[dict] = []
        self.steps: dict[str, list[tuple[int, float]]] = {}  # a training run's (step, loss)

    def say(self, text: str = "") -> None:
        print(text, flush=True)

    def stage(self, name: str) -> None:
        self.say(f"\n=== {name} " + "=" * max(3, 72 - len(name)))

    def run(self, command: str, args: list[str], call) -> None:
        """Show the command a user would type, then do what it does (through the library)."""
        self.say("$ python -m " + command + " " + " ".join(shlex.quote(a) for a in args))
        call()

    def train(self, name: str, args: list[str]) -> list[tuple[int, float]]:
        """``python -m mlx_rwkvx.train`` with ``args``; returns the run's (step, loss)."""
        steps = []

        def log(record: dict) -> None:
            if "loss" in record:
                steps.append((record["step"], record["loss"]))

        read = train_cli.read_settings
        self.run("mlx_rwkvx.train", args, lambda: train_from_config(read(args), log=log))
        self.steps[name] = steps
        return steps

    def score(self, label: str, model: Model, tokenizer) -> dict[str, float]:
        scores = {t: accuracy(model, tokenizer, q) for t, q in self.held_out.items()}
        self.table.append((label, scores))
        self.say(
            f"held-out accuracy ({label}): " + ", ".join(f"{t} {s:.0%}" for t, s in scores.items())
        )
        for task in ("recall", "copy", "sum", "reverse"):
            prompt, answer = self.held_out[task][0]
            got = greedy(model, tokenizer, prompt, answer)
            mark = "right" if got == answer + ";" else "wrong"
            self.say(f"  {task:8s} {prompt}  ->  {got!r}  (expected {answer + ';'!r}: {mark})")
        return scores

    def record(self, stage: str, seconds: float, **facts) -> None:
        self.times[stage] = seconds
        self.records.append({"stage": stage, "seconds": round(seconds, 2), **facts})
        with open(self.out / "metrics.jsonl", "a") as f:
            f.write(json.dumps(self.records[-1]) + "\n")

    # --- 1. corpus
    def corpus(self) -> None:
        self.stage("1. corpus")
        t0 = time.perf_counter()
        s, rng = self.sizes, random.Random(TRAIN_SEED)
        data = self.out / "data"
        pretrain = self.tasks.pretrain_corpus(s.pretrain_units, rng)
        write_jsonl(data / "pretrain" / "train.jsonl", pretrain)
        valid_rng = random.Random(VALID_SEED)
        valid = self.tasks.pretrain_corpus(max(2, s.pretrain_units // 50), valid_rng)
        write_jsonl(data / "pretrain" / "valid.jsonl", valid)
        write_jsonl(data / "reverse.jsonl", self.tasks.finetune_corpus(s.finetune_examples, rng))
        with open(data / "held_out.jsonl", "w") as f:
            for task, questions in self.held_out.items():
                for p, a in questions:
                    f.write(json.dumps({"task": task, "prompt": p, "answer": a}) + "\n")
        self.say(f"{len(pretrain)} pretraining texts in {data / 'pretrain'}, for example:")
        for text in pretrain[:1] + pretrain[3:5]:
            self.say(f"  {text}")
        self.say(
            f"{s.finetune_examples} fine-tuning texts (the new task: the word reversed) in "
            f"{data / 'reverse.jsonl'}, for example:\n  "
            + (data / "reverse.jsonl").read_text().split("\n")[0]
        )
        self.say(
            f"held-out questions ({s.held_out} a task, seed {HELD_OUT_SEED}): "
            f"{data / 'held_out.jsonl'}"
        )
        self.record("corpus", time.perf_counter() - t0, pretrain_texts=len(pretrain))

    def model_config(self) -> ModelConfig:
        s = self.sizes
        return ModelConfig(
            vocab_size=256,
            hidden_size=s.hidden,
            head_size=s.head_size,
            block_types=list(s.blocks),
            moba_chunk_size=s.chunk,
            moba_top_k=s.top_k,
        )

    # --- 2. pretraining
    def pretrain(self) -> Path:
        self.stage("2. pretraining a tiny RWKV-X")
        s = self.sizes
        cfg = self.model_config()
        cfg_path = self.out / "model_config.json"
        cfg_path.write_text(json.dumps(asdict(cfg), indent=2))
        untrained = Model(cfg, init="pretrain", seed=TRAIN_SEED)
        self.say(
            f"model: {', '.join(cfg.block_types)}; hidden {cfg.hidden_size}; MoBA chunks "
            f"of {cfg.moba_chunk_size}, top {cfg.moba_top_k}"
        )
        tokenizer = mlx_rwkvx.io.tokenizers.ByteTokenizer(256)
        before = self.score("untrained", untrained, tokenizer)
        self.say(
            "(batches group texts of one length, so mostly of one task: the logged loss jumps "
            "between tasks; the validation loss at the end covers them all)"
        )
        t0 = time.perf_counter()
        out = self.out / "pretrain"
        steps = self.train(
            "pretrain",
            [
                "--mode",
                "pretrain",
                "--model",
                str(cfg_path),
                "--data",
                str(self.out / "data" / "pretrain"),
                "--output",
                str(out),
                "--epochs",
                "1",
                "--batch-size",
                str(s.batch),
                "--lr",
                str(s.pretrain_lr),
                "--warmup",
                "50",
                "--max-seq-len",
                "256",
                "--log-every",
                "25",
                "--save-every",
                "100000",
                "--seed",
                str(TRAIN_SEED),
            ],
        )
        seconds = time.perf_counter() - t0
        model, tokenizer = mlx_rwkvx.load(out / "model")
        after = self.score("pretrained", model, tokenizer)
        self.record("pretrain", seconds, **_losses(steps), before=before, after=after)
        return out / "model"

    # --- 3. fine-tuning as two Macs, and the merge
    def finetune(self, base: Path) -> Path:
        s = self.sizes
        self.stage("3. the data split for two Macs (3:1)")
        t0 = time.perf_counter()
        parts = self.out / "data" / "reverse.bin"
        source = self.out / "data" / "reverse.jsonl"
        weights = [float(w) for w in SPLIT.split(",")]
        self.run(
            "mlx_rwkvx.pretokenize",
            [
                "--tokenizer",
                "bytes",
                "--data",
                str(source),
                "--output",
                str(parts),
                "--split-weights",
                SPLIT,
            ],
            lambda: pretokenize(str(source), str(parts), "bytes", weights=weights),
        )
        self.record("split", time.perf_counter() - t0)
        common = [
            "--model",
            str(base),
            "--mode",
            "lora",
            "--lora-rank",
            str(s.lora_rank),
            "--lora-targets",
            "all",
            "--lr",
            str(s.finetune_lr),
            "--warmup",
            "20",
            "--epochs",
            str(s.finetune_epochs),
            "--batch-size",
            str(s.batch // 2),
            "--log-every",
            "25",
            "--save-every",
            "100000",
            "--seed",
            str(TRAIN_SEED),
        ]
        adapters = []
        for mac, part, extra in (("mac-1", 0, ["--parallel", "2"]), ("mac-2", 1, [])):
            what = "two parts at once (--parallel 2)" if extra else "one part"
            self.stage(f"4. LoRA fine-tuning on {mac}: part {part}, {what}")
            t0 = time.perf_counter()
            out = self.out / mac
            steps = self.train(
                mac,
                [
                    *common,
                    "--data",
                    str(parts.with_name(f"reverse_{part}.bin")),
                    "--output",
                    str(out),
                    *extra,
                ],
            )
            seconds = time.perf_counter() - t0
            adapter = out / "adapter_final.safetensors"
            model, tokenizer = mlx_rwkvx.load(base, adapter=adapter)
            scores = self.score(f"{mac} adapter", model, tokenizer)
            self.record(mac, seconds, **_losses(steps), after=scores)
            adapters.append(adapter)
        self.stage("5. merging the two Macs' adapters")
        # Foundry's way first: each Mac's FedAvg (A and B averaged, not their product), then
        # the FedAvg of the two; then the exact merge: the three parts' updates B @ A averaged
        # by the tokens each trained on, re-factored to the adapters' rank
        t0 = time.perf_counter()
        fedavg = self.out / "merged-fedavg"
        self.merge(fedavg, adapters, "fedavg")
        model, tokenizer = mlx_rwkvx.load(base, adapter=fedavg)
        self.score("merged by FedAvg", model, tokenizer)
        merged = self.out / "merged"
        threads = [self.out / "mac-1" / f"thread_{i}.safetensors" for i in range(2)]
        self.merge(merged, [*threads, adapters[1]], "delta")
        seconds = time.perf_counter() - t0
        model, tokenizer = mlx_rwkvx.load(base, adapter=merged)
        scores = self.score("merged exactly", model, tokenizer)
        self.record("merge", seconds, after=scores)
        return merged

    def merge(self, output: Path, adapters: list[Path], method: str) -> None:
        """``python -m mlx_rwkvx.merge``, the adapters weighed by the tokens they trained on."""
        args = [
            "--output",
            str(output),
            "--weights",
            "auto",
            "--method",
            method,
            *map(str, adapters),
        ]

        def call():
            report = merge_adapters(adapters, output, method=method, weights="auto")
            self.say("\n".join(report))

        self.run("mlx_rwkvx.merge", args, call)

    def report(self, base: Path, merged: Path, started: float) -> None:
        self.stage("results")
        tasks = list(self.held_out)
        self.say(
            f"held-out accuracy, {self.sizes.held_out} questions a task (exact match, greedy):"
        )
        self.say("| stage | " + " | ".join(tasks) + " |")
        self.say("|---|" + "---:|" * len(tasks))
        for label, scores in self.table:
            self.say(f"| {label} | " + " | ".join(f"{scores[t]:.1%}" for t in tasks) + " |")
        total = time.perf_counter() - started
        self.say(
            "\ntime per stage: "
            + ", ".join(f"{k} {v:.0f} s" for k, v in self.times.items())
            + f"; in all {total:.0f} s"
        )
        goals = {
            "recall after pretraining": self.table[1][1]["recall"],
            "reverse after the merge": self.table[-1][1]["reverse"],
        }
        for name, value in goals.items():
            met = "met" if value >= 0.9 else "MISSED"
            self.say(
                f"goal: {name} {value:.1%} (>= 90%): {met}"
                + (" (--quick: sizes too small to mean anything)" if self.quick else "")
            )
        self.record("total", total, goals=goals, quick=self.quick)
        _plot(self.out, self.steps)
        prompt, answer = self.held_out["reverse"][1]
        self.say("\nChat with the result (the merged adapter on the pretrained model):")
        self.say(
            f"  python -m mlx_rwkvx.generate --model {shlex.quote(str(base))} --adapter "
            f"{shlex.quote(str(merged))} --temp 0 --max-tokens {len(answer) + 1} --prompt "
            f"{shlex.quote(prompt)}"
        )


def _losses(steps: list[tuple[int, float]]) -> dict:
    """A run's mean training loss over its first and over its last tenth of steps."""
    losses = [loss for _, loss in steps]
    n = max(1, len(losses) // 10)
    return {
        "first_loss": sum(losses[:n]) / n,
        "last_loss": sum(losses[-n:]) / n,
        "steps": len(losses),
    }


def _plot(out: Path, steps: dict[str, list[tuple[int, float]]]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib is not installed: no loss.png; pip install 'mlx_rwkvx[plot]')")
        return
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, runs, title in (
        (axes[0], ["pretrain"], "pretraining"),
        (axes[1], ["mac-1", "mac-2"], "LoRA fine-tuning (the new task)"),
    ):
        for run in runs:
            ax.plot(*zip(*steps[run], strict=True), label=run)
        ax.set_xlabel("step")
        ax.set_ylabel("training loss (nats per byte)")
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(out / "loss.png", dpi=100)
    plt.close(fig)
    print(f"wrote {out / 'loss.png'}")
