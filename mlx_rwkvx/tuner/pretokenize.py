"""Tokenizing training data once into Foundry's pre-tokenized binary (``python -m
mlx_rwkvx.pretokenize``): a data file, or an mlx-lm data folder's splits, read and checked
whole, then written as one ``.bin`` or as parts by weight (one a machine). Entry point:
``pretokenize``."""

from __future__ import annotations

import os
import sys
import time
from contextlib import ExitStack

from mlx_rwkvx.data.batches import split_parts
from mlx_rwkvx.data.examples import cut_note, load_examples
from mlx_rwkvx.data.records import SPLITS, find_split, is_bin, write_bin
from mlx_rwkvx.errors import DataError, UsageError
from mlx_rwkvx.io.atomic import check_target
from mlx_rwkvx.io.targets import output_lock, remove_stale, resolve_target
from mlx_rwkvx.io.tokenizers import WORLD_VOCAB, resolve_tokenizer

from tqdm import tqdm

PROGRESS_EVERY_TTY = 0.5  # seconds between progress updates on a terminal (one line, redrawn)
PROGRESS_EVERY_LOG = 10.0  # ... and in a log, a line each
SKIPS_SHOWN = 10  # bad records reported one by one under skip_bad; the rest are counted


def pretokenize(
    data: str,
    output: str,
    tokenizer: str | None = None,
    *,
    max_seq_len: int | None = None,
    weights: list[float] | None = None,
    sql: str | None = None,
    skip_bad: bool = False,
    overwrite: bool = False,
) -> list[tuple[str, int]]:
    """Tokenize ``data`` (a ``.jsonl``, SQLite with ``sql`` or ``.bin`` file, or an mlx-lm
    folder: then ``output`` is a folder receiving ``<split>.bin``) with ``tokenizer`` (see
    ``resolve_tokenizer``) into ``output``; ``weights``: write parts ``<base>_<i>.bin`` in
    these proportions. Every output is checked, locked and refused when it would replace an
    input or anything but a ``.bin``; every split is read and checked before anything is
    written. Returns ``(file written, examples)`` pairs. UserErrors name the problem."""
    jobs = _jobs(data, output, weights)
    inputs = [data]
    if tokenizer not in (None, "world", "bytes"):  # a file, or a folder holding one
        names = ("tokenizer.json", WORLD_VOCAB) if os.path.isdir(tokenizer) else ("",)
        inputs += [os.path.join(tokenizer, name) if name else tokenizer for name in names]
    outputs = [
        resolve_target(out, what="--output", inputs=inputs) for _, _, outs in jobs for out in outs
    ]
    with ExitStack() as locks:
        for out in sorted(set(outputs)):
            locks.enter_context(output_lock(out, "--output"))
            remove_stale(os.path.dirname(out), os.path.basename(out))
            check_target(
                out,
                overwrite=overwrite,
                folder=False,
                recognise=is_bin,
                kind="a pre-tokenized .bin (its counts do not fit its size)",
            )
        if tokenizer is None and any(not file.endswith(".bin") for _, file, _ in jobs):
            raise UsageError(
                "--tokenizer is needed to tokenize text: a tokenizer.json (or the model's "
                "folder), a World vocabulary, 'world', or 'bytes' for a byte-level model "
                "(vocabulary <= 256)"
            )
        try:
            found = resolve_tokenizer(tokenizer) if tokenizer is not None else None
        except ValueError as e:
            raise UsageError(str(e)) from e
        ready = [
            (outs, _read(file, found, max_seq_len, weights, sql, skip_bad))
            for _, file, outs in jobs
        ]
        written = []
        for outs, parts in ready:
            for out, part in zip(outs, parts, strict=True):
                write_bin(out, [e.tokens for e in part], overwrite=overwrite)
                print(f"wrote {out} ({len(part):,} examples)")
                written.append((out, len(part)))
    return written


def _read(file: str, tokenizer, max_seq_len, weights, sql, skip_bad) -> list[list]:
    """The examples of ``file``, said how many and how fast, in parts by ``weights``."""
    shown = []

    def on_skip(error: DataError) -> None:
        if len(shown) < SKIPS_SHOWN:
            print(f"skipped: {error}", file=sys.stderr)
        shown.append(error)

    every = PROGRESS_EVERY_TTY if sys.stderr.isatty() else PROGRESS_EVERY_LOG
    bar = tqdm(
        desc=os.path.basename(file),
        unit="B",
        unit_scale=True,
        leave=False,
        mininterval=every,
        delay=every,
        file=sys.stderr,
    )
    seen = [0]

    def progress(done: int, total: int | None, records: int) -> None:
        bar.total = total
        bar.update(done - seen[0])
        seen[0] = done

    started = time.perf_counter()
    try:
        examples, skipped = load_examples(
            file,
            tokenizer,
            sql=sql,
            max_seq_len=max_seq_len,
            skip_bad=skip_bad,
            on_skip=on_skip,
            progress=progress,
        )
    finally:
        bar.close()
    seconds, mb = time.perf_counter() - started, seen[0] / 1e6
    n_tokens = sum(len(e.tokens) for e in examples)
    print(
        f"{file}: {len(examples):,} examples, {n_tokens:,} tokens from {mb:.1f} MB in "
        f"{seconds:.1f} s ({mb / max(seconds, 1e-9):.2f} MB/s)"
    )
    if skipped:
        print(f"{file}: skipped {skipped} bad records (--skip-bad)")
    note = cut_note(examples, max_seq_len, "--max-seq-len")
    if note:
        print(note)
    masked = sum(1 for e in examples if not e.trained[1:].all())
    if masked:
        print(
            f"note: the .bin format has no mask: the prompts of {masked:,} examples will be "
            "trained on too"
        )
    try:
        return split_parts(examples, weights) if weights else [examples]
    except ValueError as e:
        raise UsageError(str(e)) from e


def _jobs(data: str, output: str, weights) -> list[tuple[str, str, list[str]]]:
    """(split, input file, output files) for each file to tokenize."""
    if os.path.isdir(data):
        if weights is not None:
            raise UsageError(
                f"--split splits one file: give --data {os.path.join(data, 'train.jsonl')}"
            )
        jobs = [(s, find_split(data, s), [os.path.join(output, f"{s}.bin")]) for s in SPLITS]
        jobs = [j for j in jobs if j[1] is not None]
        if not jobs:
            raise UsageError(f"{data}: no train.jsonl, valid.jsonl or test.jsonl in this folder")
        if os.path.exists(output) and not os.path.isdir(output):
            raise UsageError(f"{output}: is a file; a data folder is written to a folder")
        return jobs
    if not os.path.exists(data):
        raise UsageError(f"{data}: no such file or folder")
    if weights is None:
        return [("train", data, [output])]
    base = output[:-4] if output.endswith(".bin") else output
    return [("train", data, [f"{base}_{i}.bin" for i in range(len(weights))])]
