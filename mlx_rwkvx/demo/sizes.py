"""The demo's sizes in one place: the corpus, the model and its training runs. ``FULL`` (the
default) meets the goals the README states; ``QUICK`` (``--quick``) runs the same stages at toy
sizes, for the tests."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Sizes:
    """How big each part of the demo is (``FULL`` meets the goals; ``QUICK`` only runs)."""

    pairs: int  # key=value pairs before the question mark
    queries: int  # keys asked after it
    word: int  # letters of a word to copy
    pretrain_units: int  # a recall text, two copy texts and a sum text each
    finetune_examples: int
    held_out: int  # examples per task for the accuracy table
    hidden: int
    head_size: int
    blocks: tuple[str, ...]
    chunk: int
    top_k: int
    batch: int
    pretrain_lr: float
    finetune_lr: float
    finetune_epochs: int
    lora_rank: int


FULL = Sizes(
    pairs=8,
    queries=8,
    word=6,
    pretrain_units=3600,
    finetune_examples=1600,
    held_out=200,
    hidden=128,
    head_size=32,
    blocks=("rwkv7", "rwkv7", "moba", "rwkv7"),
    chunk=16,
    top_k=3,
    batch=16,
    pretrain_lr=1e-3,
    finetune_lr=1e-3,
    finetune_epochs=4,
    lora_rank=32,
)
QUICK = Sizes(
    pairs=4,
    queries=2,
    word=4,
    pretrain_units=64,
    finetune_examples=128,
    held_out=16,
    hidden=64,
    head_size=16,
    blocks=("rwkv7", "moba", "rwkv7"),
    chunk=8,
    top_k=2,
    batch=8,
    pretrain_lr=3e-3,
    finetune_lr=2e-3,
    finetune_epochs=1,
    lora_rank=4,
)
