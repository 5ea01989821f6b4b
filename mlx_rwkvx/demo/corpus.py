"""The demo's synthetic corpus, as text: key-value recall (``key=value;`` pairs, then ``?`` and
the keys asked again), copying and small sums for pretraining; reversing a word, the new task
of the fine-tuning; held-out questions that training never draws."""

from __future__ import annotations

import json
import random
import string
from pathlib import Path

from mlx_rwkvx.demo.sizes import Sizes

ANSWER_DIGITS = 3  # a recall answer: 1 in 1000 by chance


class Tasks:
    """The tasks, each a (prompt, answer) maker over a seeded ``random.Random``.

    ``recall``: ``abc=123;...;xyz=456;?xyz=`` -> ``456``; ``copy``: ``copy:hello|`` ->
    ``hello``; ``sum``: ``12+34=`` -> ``46``; ``reverse`` (fine-tuning only, a task the base
    never saw): ``reverse:hello|`` -> ``olleh``. A training text puts several answers in a row
    (all the keys asked after one context). The fine-tuning task keeps to letters the base has
    seen: a LoRA adapter leaves the head as it is, and the rows of bytes never seen in
    pretraining stay untrained."""

    def __init__(self, sizes: Sizes):
        self.sizes = sizes
        self.held_out: set[str] = set()  # prompts (and recall contexts) training never draws

    def context(self, rng: random.Random) -> tuple[str, list[tuple[str, str]]]:
        keys: list[str] = []
        while len(keys) < self.sizes.pairs:
            key = "".join(rng.choice(string.ascii_lowercase) for _ in range(3))
            if key not in keys:
                keys.append(key)
        pairs = [(k, f"{rng.randrange(10**ANSWER_DIGITS):0{ANSWER_DIGITS}d}") for k in keys]
        return "".join(f"{k}={v};" for k, v in pairs), pairs

    def hold_out(self, questions: list[tuple[str, str]]) -> None:
        """Never draw these questions (nor, for recall, their contexts) for training."""
        for prompt, _ in questions:
            self.held_out |= {prompt, prompt.split("?")[0]}

    def question(self, task: str, rng: random.Random) -> tuple[str, str]:
        while True:
            prompt, answer = self._question(task, rng)
            if prompt not in self.held_out and prompt.split("?")[0] not in self.held_out:
                return prompt, answer

    def _question(self, task: str, rng: random.Random) -> tuple[str, str]:
        if task == "recall":
            ctx, pairs = self.context(rng)
            key, value = rng.choice(pairs)
            return f"{ctx}?{key}=", value
        if task in ("copy", "reverse"):
            word = "".join(rng.choice(string.ascii_lowercase) for _ in range(self.sizes.word))
            return f"{task}:{word}|", word[::-1] if task == "reverse" else word
        if task == "sum":
            a, b = rng.randrange(50), rng.randrange(50)
            return f"{a}+{b}=", str(a + b)
        raise ValueError(task)

    def text(self, task: str, rng: random.Random) -> str:
        if task == "recall":
            ctx, pairs = self.context(rng)
            while ctx in self.held_out:
                ctx, pairs = self.context(rng)
            asked = rng.sample(pairs, self.sizes.queries)
            return ctx + "?" + "".join(f"{k}={v};" for k, v in asked)
        n = {"sum": 6}.get(task, 4)
        return "".join(p + a + ";" for p, a in (self.question(task, rng) for _ in range(n)))

    def pretrain_corpus(self, units: int, rng: random.Random) -> list[str]:
        """``units`` times a recall text, two copy texts and a sum text."""
        return [self.text(t, rng) for _ in range(units) for t in ("recall", "copy", "copy", "sum")]

    def finetune_corpus(self, n: int, rng: random.Random) -> list[str]:
        return [self.text("reverse", rng) for _ in range(n)]


def write_jsonl(path: Path, texts: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
