"""The loss of a model on a data set: any data set the trainer reads (text, chat, prompt /
completion JSONL, SQLite, ``.bin``, an mlx-lm folder) or a plain text file, through
``data.loss.dataset_loss``, the trainer's validation loss too (the fused head and loss: no
``[tokens, vocab]`` logits).

Long texts go in windows of ``max_seq_len`` tokens with the state carried from one to the next
(for RWKV-7 the same as one pass over the whole text; attention blocks keep ``max_cache``
tokens), or, with ``carry_state=False``, cut to ``max_seq_len`` as the trainer's validation cuts
them without --carry-state. Bits per byte: the targets' summed loss / ln 2 / the UTF-8 bytes
those targets spell (the assistant turns only, for chat data), comparable across tokenizers."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from mlx_rwkvx.data.examples import Example, load_examples
from mlx_rwkvx.data.loss import LossSum, dataset_loss
from mlx_rwkvx.data.records import find_split
from mlx_rwkvx.errors import DataError
from mlx_rwkvx.io.tokenizers import token_byte_lengths
from mlx_rwkvx.models import Model

import numpy as np

PLAIN_TEXT = (".txt", ".md", ".text")  # read whole, as one text


def default_seq_len(model: Model) -> int:
    """The trainer's default --max-seq-len for this model: Foundry's 256 with Qwen2 blocks,
    else 512."""
    return 256 if "qwen2" in model.config.block_types else 512


def pick_split(path: str, split: str | None) -> str:
    """The file of ``path`` to evaluate: a file itself; a folder's ``split``, by default its
    test split, else its valid split."""
    if not os.path.isdir(path):
        return path
    for name in [split] if split else ["test", "valid"]:
        found = find_split(path, name)
        if found:
            return found
    wanted = f"{split}.jsonl or {split}.bin" if split else "test.jsonl, valid.jsonl (or .bin)"
    raise DataError(f"{path}: no {wanted} to evaluate (--split train evaluates the training set)")


def eval_examples(
    path: str,
    tokenizer,
    vocab: int,
    *,
    max_seq_len: int,
    carry_state: bool,
    split: str | None = None,
    sql: str | None = None,
) -> tuple[list[Example], str]:
    """(the examples of the data set at ``path``, the file they came from; ``sql``: the query
    of a SQLite database); DataError naming the file and the problem (none, empty, a text
    shorter than two tokens)."""
    file = pick_split(path, split)
    cut = None if carry_state else max_seq_len
    if os.path.isfile(file) and file.endswith(PLAIN_TEXT):
        try:
            with open(file, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise DataError(f"{file}: cannot read it as UTF-8 text ({e})") from e
        if tokenizer is None:
            raise DataError(f"{file}: a text needs the model's tokenizer, and it has none")
        ids = np.asarray(tokenizer.encode(text), dtype=np.int32)
        if len(ids) < 2:
            raise DataError(f"{file}: the text is shorter than two tokens: nothing to predict")
        if cut is not None:
            ids = ids[: cut + 1]
        trained = np.ones(len(ids), dtype=bool)
        trained[0] = False
        return [Example(ids, trained, source=file)], file
    examples, _ = load_examples(
        file, tokenizer, split=split or "test", sql=sql, max_seq_len=cut, vocab_size=vocab
    )
    if not any(e.trained.any() for e in examples):
        raise DataError(f"{file}: no token to predict (every text is shorter than two tokens)")
    return examples, file


@dataclass
class Row:
    """One model (and adapter) on one data set: the summed loss and the time it took."""

    model: str
    adapter: str | None
    loss: LossSum
    seconds: float

    def record(self) -> dict:
        r = self.loss
        return {
            "model": self.model,
            "adapter": self.adapter,
            "loss": r.mean,
            "perplexity": r.perplexity,
            "bits_per_byte": r.bits_per_byte,
            "tokens": r.tokens,
            "bytes": r.bytes,
            "tokens_per_s": r.tokens / self.seconds if self.seconds > 0 else 0.0,
            "complete": r.complete,
        }


def evaluate_loss(
    model: Model,
    tokenizer,
    examples,
    *,
    batch_size: int,
    max_seq_len: int,
    carry_state: bool = True,
    max_cache: int | None = None,
    max_batches: int | None = None,
    on_batch=None,
    byte_lengths=None,
) -> tuple[LossSum, float]:
    """(the summed loss of ``model`` on ``examples``, seconds). ``on_batch(sum, tokens)`` after
    each batch (a progress bar); Ctrl-C returns the sum so far, the interruption in its
    ``stopped``. ``byte_lengths``: the tokenizer's ``token_byte_lengths`` when already made."""
    lengths = byte_lengths
    if lengths is None and tokenizer is not None:
        lengths = token_byte_lengths(tokenizer, model.config.vocab_size)
    start = time.perf_counter()
    result = dataset_loss(
        model,
        examples,
        batch_size,
        max_batches,
        max_seq_len if carry_state else None,
        max_cache,
        byte_lengths=lengths,
        on_batch=on_batch,
    )
    return result, time.perf_counter() - start
