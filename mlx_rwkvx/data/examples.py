"""Data into examples (``load_examples``): each record of ``records.py`` tokenized (chat turns
by ``chat.py``), checked against the vocabulary and cut to ``max_seq_len + 1`` tokens. Bad data
raises one ``DataError`` naming the file and the line, row or record, or is skipped and counted
(``skip_bad``). Batches of examples: ``batches.py``."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mlx_rwkvx.data.chat import chat_tokens, encode_text
from mlx_rwkvx.data.records import (
    MAX_TOKEN_ID,
    BadRecord,
    Progress,
    bin_records,
    find_split,
    jsonl_records,
    source_kind,
    sqlite_records,
)
from mlx_rwkvx.errors import DataError
from mlx_rwkvx.io.tokenizers import ByteTokenizer

import numpy as np

IGNORE_INDEX = -100  # targets the loss skips (padding, prompts): PyTorch's and mlx-lm's value


@dataclass(eq=False)
class Example:
    """One training text. ``tokens`` int32 [n]; ``trained`` bool [n]: token i is a target the
    loss counts, predicted from ``tokens[:i]`` (``trained[0]`` is always False). ``source``
    names where it came from (``train.jsonl:12``)."""

    tokens: np.ndarray
    trained: np.ndarray
    source: str = ""
    cut_from: int = 0  # its length before it was cut to max_seq_len + 1 tokens (0: not cut)

    def __len__(self) -> int:
        return len(self.tokens)


def _tokens_of(fmt: str, record, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(tokens as int64, trained) of one record, before truncation."""
    if fmt == "bin":
        tokens = record.astype(np.int64)
        return tokens, np.arange(len(tokens)) > 0
    if fmt == "text":
        text = record["text"]
        if not isinstance(text, str):
            raise BadRecord(f"'text' must be a string, got {type(text).__name__}")
        ids = encode_text(tokenizer, text)
        if not ids:
            raise BadRecord("empty example: the text has no tokens")
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and eos in ids:  # the text would end in the middle
            at = ids.index(eos)
            what = "a NUL character" if isinstance(tokenizer, ByteTokenizer) else "text"
            raise BadRecord(
                f"{what} at token {at} encodes to the end-of-text token (id {eos}): "
                "remove it from the text"
            )
        tokens = np.array(ids + ([] if eos is None else [eos]), dtype=np.int64)
        return tokens, np.arange(len(tokens)) > 0
    if fmt == "completion":
        prompt, completion = record["prompt"], record["completion"]
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise BadRecord(f"'{name}' must be a string, got {type(value).__name__}")
        if not completion:
            raise BadRecord("empty example: the completion is empty")
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return chat_tokens(tokenizer, messages, None)
    if fmt == "preference":
        raise BadRecord(
            "a preference record ('prompt', 'chosen', 'rejected'): supervised "
            "training reads 'messages', 'prompt' and 'completion', or 'text'"
        )
    return chat_tokens(tokenizer, record["messages"], record.get("tools"))


def load_examples(
    path: str,
    tokenizer=None,
    *,
    split: str = "train",
    sql: str | None = None,
    max_seq_len: int | None = None,
    skip_bad: bool = False,
    vocab_size: int | None = None,
    on_skip: Callable[[DataError], None] | None = None,
    progress: Progress | None = None,
    mask_prompt: bool = True,
) -> tuple[list[Example], int]:
    """The examples of a file (``.jsonl``, ``.bin``, a SQLite database with ``sql``; read
    whatever ``split``) or of an mlx-lm folder's ``<split>.jsonl`` / ``<split>.bin``, each
    truncated to ``max_seq_len + 1`` tokens (None: whole); returns (examples, number of bad
    records skipped).

    ``tokenizer`` encodes text (not needed for ``.bin``). Token ids ``>= vocab_size`` (default:
    the tokenizer's) are bad data. Bad data raises one DataError naming the file and the line,
    row or record; with ``skip_bad`` it is skipped, counted and passed to ``on_skip``. No
    example left (an empty file, everything skipped) is an error too. ``progress(bytes done,
    bytes in all or None, records)`` is called as the file is read. ``mask_prompt=False``
    trains every token after the first (prompts too)."""
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    file = find_split(path, split)
    if file is None:
        raise DataError(
            f"{path}: no {split}.jsonl or {split}.bin (an mlx-lm data folder holds "
            "train.jsonl, valid.jsonl, test.jsonl)"
        )
    kind = source_kind(file, sql)
    if kind != "bin" and tokenizer is None:
        raise DataError(
            f"{file}: text data needs a tokenizer, and the model has none (no tokenizer.json "
            "beside it): pre-tokenize the data, or put the tokenizer beside the model"
        )
    if vocab_size is None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
    limit = min(vocab_size or MAX_TOKEN_ID + 1, MAX_TOKEN_ID + 1)
    if kind == "jsonl":
        records, total = jsonl_records(file), os.path.getsize(file)
    elif kind == "sqlite":
        records, total = sqlite_records(file, sql), None
    else:
        records, total = bin_records(file, skip_bad), os.path.getsize(file)

    examples, skipped = [], 0
    try:
        for n_records, (where, fmt, record, done) in enumerate(records, 1):
            if progress is not None:
                progress(done, total, n_records)
            try:
                tokens, trained, cut_from = _example_of(
                    fmt, record, tokenizer, limit, max_seq_len, mask_prompt
                )
            except BadRecord as e:
                error = DataError(where if e.args[0] is None else f"{where}: {e.args[0]}")
                if not skip_bad:
                    raise error from None
                skipped += 1
                if on_skip is not None:
                    on_skip(error)
                continue
            examples.append(Example(tokens.astype(np.int32), trained, where, cut_from))
    except OSError as e:  # no permission, a disk error
        raise DataError(f"{file}: cannot read it ({e.strerror or e})") from e
    if not examples:
        raise DataError(
            f"{file}: no examples" + (f" ({skipped} bad records skipped)" if skipped else "")
        )
    return examples, skipped


def _example_of(fmt, record, tokenizer, limit: int, max_seq_len: int | None, mask_prompt: bool):
    """(tokens, trained, length before the cut or 0) of one record; BadRecord when it is bad."""
    if isinstance(record, BadRecord):
        raise record
    tokens, trained = _tokens_of(fmt, record, tokenizer)
    if not mask_prompt:  # every token after the first is a target
        trained = np.arange(len(tokens)) > 0
    if tokens.size < 2:
        raise BadRecord(f"empty example: {tokens.size} tokens, nothing to predict")
    bad = np.flatnonzero((tokens >= limit) | (tokens < 0))
    if bad.size:
        raise BadRecord(
            f"token id {tokens[bad[0]]} at position {bad[0]} is beyond the vocabulary "
            f"of {limit} tokens"
        )
    if not trained.any():
        raise BadRecord("empty example: no token to train on")
    if max_seq_len is None or tokens.size <= max_seq_len + 1:
        return tokens, trained, 0
    first = int(np.argmax(trained))
    if first > max_seq_len:
        raise BadRecord(
            f"nothing to train on within max_seq_len {max_seq_len}: the first "
            f"trained token is token {first} (a prompt of {first} tokens)"
        )
    return tokens[: max_seq_len + 1], trained[: max_seq_len + 1], tokens.size


def cut_note(examples: Sequence[Example], max_seq_len: int | None, flag: str) -> str | None:
    """One line on the examples cut to ``max_seq_len`` (None when none was)."""
    cut = [e.cut_from for e in examples if e.cut_from]
    if not cut:
        return None
    return (
        f"note: {len(cut):,} of {len(examples):,} examples are longer than {flag} "
        f"{max_seq_len} and were cut to {max_seq_len + 1} tokens (the longest had "
        f"{max(cut):,})"
    )
