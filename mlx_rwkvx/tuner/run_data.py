"""The data of a run, as its settings pick it: the train, validation and test examples (bad
data stops the start; what was skipped or cut is said once), and the stream of micro-batches
from a data position on, which the loop follows (it owns the position). Entry points:
``train_examples``, ``validation_examples``, ``test_examples`` (built from the settings),
``Stream``."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

from mlx_rwkvx.data.batches import PAD_MULTIPLE, batches
from mlx_rwkvx.data.examples import cut_note, load_examples
from mlx_rwkvx.data.records import find_split
from mlx_rwkvx.errors import DataError, TrainError
from mlx_rwkvx.tuner import parallel
from mlx_rwkvx.tuner.config import TrainConfig


def train_examples(cfg: TrainConfig, tokenizer, vocab: int, split="train", path=None):
    """The examples of ``split`` (``path``, else ``cfg.data``), as the settings read them: cut
    to --max-seq-len (whole with --carry-state), prompts masked unless --no-mask-prompt."""
    reasons = []
    try:
        examples, skipped = load_examples(
            path or cfg.data,
            tokenizer,
            split=split,
            sql=cfg.sql,
            max_seq_len=None if cfg.carry_state else cfg.max_seq_len,  # else: whole, in segments
            skip_bad=cfg.skip_bad,
            vocab_size=vocab,
            on_skip=reasons.append,
            mask_prompt=cfg.mask_prompt,
        )
    except DataError as e:
        raise TrainError(str(e)) from e
    if skipped:
        print(f"skipped {skipped} bad examples of {path or cfg.data} ({split}):", file=sys.stderr)
        for reason in reasons[:10]:
            print(f"  {reason}", file=sys.stderr)
    note = cut_note(examples, cfg.max_seq_len, "--max-seq-len")
    if note:
        print(f"{note} ({split}; --carry-state trains long texts whole)", file=sys.stderr)
    return examples


def _split_of_folder(cfg: TrainConfig, split: str) -> str | None:
    try:
        return find_split(cfg.data, split) if os.path.isdir(cfg.data) else None
    except DataError as e:
        raise TrainError(str(e)) from e


def validation_examples(cfg: TrainConfig, tokenizer, vocab: int):
    """--val-data, else the data folder's valid split (valid.jsonl or valid.bin), if any."""
    if cfg.val_data:
        return train_examples(cfg, tokenizer, vocab, "valid", cfg.val_data)
    found = _split_of_folder(cfg, "valid")
    return train_examples(cfg, tokenizer, vocab, "valid", found) if found else []


def test_examples(cfg: TrainConfig, tokenizer, vocab: int):
    """--test: the data folder's test split (none there: said, and nothing to evaluate)."""
    if not cfg.test:
        return []
    found = _split_of_folder(cfg, "test")
    if found is None:
        print(f"--test: {cfg.data} has no test split (test.jsonl or test.bin)", file=sys.stderr)
        return []
    return train_examples(cfg, tokenizer, vocab, "test", found)


class Stream:
    """The micro-batches of ``parts`` (the examples, or with --parallel their N parts: each
    micro-batch then holds the parts' batches side by side) from ``position`` (``{"epoch",
    "batch"}``) on, epoch after epoch; ``position`` follows it: the data position after the
    last micro-batch given (what a checkpoint saves)."""

    def __init__(self, parts: list, batch_size: int, seed: int, position: dict):
        self.parts, self.batch_size, self.seed = parts, batch_size, seed
        self.position = dict(position)
        self._batches = self._from(self.position)

    def __iter__(self) -> Iterator:
        return self

    def __next__(self) -> tuple:
        batch, self.position = next(self._batches)
        return batch

    def _from(self, position: dict) -> Iterator[tuple[tuple, dict]]:
        epoch, start = position["epoch"], position["batch"]
        while True:
            options = dict(
                batch_size=self.batch_size,
                seed=self.seed,
                epoch=epoch,
                start=start,
                pad_to_multiple=PAD_MULTIPLE,
            )
            streams = [batches(part, **options) for part in self.parts]
            # equal parts: equally many batches (strict=False: zip stops with the shortest)
            for i, group in enumerate(zip(*streams, strict=False)):
                one = len(group) == 1
                batch = group[0] if one else parallel.side_by_side(group, self.batch_size)
                yield batch, {"epoch": epoch, "batch": start + i + 1}
            epoch, start = epoch + 1, 0
