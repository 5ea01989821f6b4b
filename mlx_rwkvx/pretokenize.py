"""``python -m mlx_rwkvx.pretokenize``: tokenize training data once into the seeds' binary.

    python -m mlx_rwkvx.pretokenize --tokenizer T --data D --output O [--max-seq-len N]
                                    [--split K | --split-weights 6,2]

D is anything training reads (``.jsonl`` text / chat / prompt-completion, a SQLite database
with ``--sql``, a ``.bin`` to re-split); O receives ``[n: u32] ([len: u32] [tokens: u32 x
len]) x n``, little endian, each example at most N + 1 tokens (N inputs). ``--split K`` writes
K equal contiguous shards, ``--split-weights 6,2`` shards in those proportions, as
``<base>_0.bin``, ``<base>_1.bin``, ... (one per machine). D an mlx-lm folder: O is a folder
that gets ``train.bin``, ``valid.bin``, ``test.bin`` for the splits D has, which training reads
as it reads the folder. The format carries no mask: chat prompts are trained on too.

T: a ``tokenizer.json`` (or its folder, with its chat template), a World vocabulary file or a
folder holding one, ``world`` (RWKV World) or ``bytes``. Bad data stops with one line naming
the file and the line (exit 2) unless ``--skip-bad``, which skips, counts and reports them.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from contextlib import ExitStack

from mlx_rwkvx import cli
from mlx_rwkvx.cli import help_text
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.io.targets import output_lock, remove_stale, resolve_target
from mlx_rwkvx.io.tokenizers import WORLD_VOCAB, resolve_tokenizer
from mlx_rwkvx.tuner.batches import split_parts
from mlx_rwkvx.tuner.data import (
    SPLITS,
    DataError,
    cut_note,
    find_split,
    is_bin,
    load_examples,
    write_bin,
)

PROG = "mlx_rwkvx.pretokenize"
PROGRESS_EVERY_TTY = 0.5  # seconds between progress updates on a terminal (one line, redrawn)
PROGRESS_EVERY_LOG = 10.0  # ... and in a log, a line each
SKIPS_SHOWN = 10  # bad records reported one by one under --skip-bad; the rest are counted


def open_tokenizer(spec: str):
    """The tokenizer ``spec`` names (``io.tokenizers.resolve_tokenizer``); UsageError when it
    names none."""
    try:
        return resolve_tokenizer(spec)
    except ValueError as e:
        raise UsageError(str(e)) from e


class _Progress:
    """One progress line: how much of the input is read, and how fast."""

    def __init__(self, name: str):
        self.name, self.tty = name, sys.stderr.isatty()
        self.t0 = self.last = time.perf_counter()
        self.done, self.records, self.shown = 0, 0, False

    def __call__(self, done: int, total: int | None, records: int) -> None:
        self.done, self.records = done, records
        now = time.perf_counter()
        if now - self.last < (PROGRESS_EVERY_TTY if self.tty else PROGRESS_EVERY_LOG):
            return
        self.last, self.shown = now, True
        share = f" of {total / 1e6:.1f} MB ({100 * done / total:.0f}%)" if total else ""
        line = (
            f"{self.name}: {done / 1e6:.1f} MB{share}, {records:,} records, "
            f"{done / 1e6 / max(now - self.t0, 1e-9):.2f} MB/s"
        )
        print(f"\r{line}" if self.tty else line, end="" if self.tty else "\n", file=sys.stderr)

    def finish(self) -> float:
        if self.tty and self.shown:
            print(file=sys.stderr)
        return time.perf_counter() - self.t0


def _weights(args) -> list[float] | None:
    if args.split is not None:
        if args.split < 1:
            raise UsageError(f"--split must be >= 1, got {args.split}")
        return [1.0] * args.split
    if args.split_weights is not None:
        try:
            weights = [float(x) for x in args.split_weights.split(",")]
        except ValueError:
            weights = []
        if not weights or any(not w > 0 or w == float("inf") for w in weights):
            raise UsageError(
                f"--split-weights: expected positive numbers separated by commas, got "
                f"{args.split_weights!r}"
            )
        return weights
    return None


def _jobs(args, weights) -> list[tuple[str, str, list[str]]]:
    """(split, input file, output files) for each file to tokenize."""
    if os.path.isdir(args.data):
        if weights is not None:
            raise UsageError(
                f"--split shards one file: give --data {os.path.join(args.data, 'train.jsonl')}"
            )
        jobs = [
            (s, find_split(args.data, s), [os.path.join(args.output, f"{s}.bin")]) for s in SPLITS
        ]
        jobs = [j for j in jobs if j[1] is not None]
        if not jobs:
            raise UsageError(
                f"{args.data}: no train.jsonl, valid.jsonl or test.jsonl in this folder"
            )
        if os.path.exists(args.output) and not os.path.isdir(args.output):
            raise UsageError(f"{args.output}: is a file; a data folder is written to a folder")
        return jobs
    if not os.path.exists(args.data):
        raise UsageError(f"{args.data}: no such file or folder")
    if weights is None:
        return [("train", args.data, [args.output])]
    base = args.output[:-4] if args.output.endswith(".bin") else args.output
    return [("train", args.data, [f"{base}_{i}.bin" for i in range(len(weights))])]


def pretokenize(args) -> None:
    weights = _weights(args)
    jobs = _jobs(args, weights)
    inputs = [args.data]
    if args.tokenizer not in (None, "world", "bytes"):  # a file, or a folder holding one
        spec = args.tokenizer
        names = ("tokenizer.json", WORLD_VOCAB) if os.path.isdir(spec) else ("",)
        inputs += [os.path.join(spec, name) if name else spec for name in names]
    outputs = [resolve_target(out, what="--output", inputs=inputs)
               for _, _, outs in jobs for out in outs]  # fmt: skip
    with ExitStack() as locks:
        for out in sorted(set(outputs)):
            locks.enter_context(output_lock(out, "--output"))
            remove_stale(os.path.dirname(out), os.path.basename(out))
        _pretokenize(args, weights, jobs)


def _pretokenize(args, weights, jobs) -> None:
    for _, _, outputs in jobs:
        for out in outputs:
            if os.path.isdir(out):
                raise UsageError(f"{out}: is a folder; expected a file name")
            if os.path.exists(out) and not args.overwrite:
                raise UsageError(f"{out}: already exists (--overwrite replaces it)")
            if os.path.exists(out) and not is_bin(out):
                raise UsageError(
                    f"{out}: already exists and is not a pre-tokenized .bin (its counts do not "
                    "fit its size); refusing to replace it"
                )
            above = os.path.dirname(os.path.abspath(out))
            while not os.path.exists(above):  # the folder that would hold it, made below
                above = os.path.dirname(above)
            if not os.path.isdir(above):
                raise UsageError(f"{out}: {above} is a file, not a folder")
    needs_tokenizer = any(not file.endswith(".bin") for _, file, _ in jobs)
    if needs_tokenizer and args.tokenizer is None:
        raise UsageError(
            "--tokenizer is needed to tokenize text: a tokenizer.json (or the model's folder), "
            "a World vocabulary, 'world', or 'bytes' for a byte-level model (vocabulary <= 256)"
        )
    tokenizer = open_tokenizer(args.tokenizer) if args.tokenizer is not None else None

    ready = []  # every split read and checked before any file is written
    for _, file, outputs in jobs:
        shown = []

        def on_skip(error: DataError, shown=shown) -> None:
            if len(shown) < SKIPS_SHOWN:
                print(f"skipped: {error}", file=sys.stderr)
            shown.append(error)

        progress = _Progress(os.path.basename(file))
        examples, skipped = load_examples(
            file,
            tokenizer,
            sql=args.sql,
            max_seq_len=args.max_seq_len,
            skip_bad=args.skip_bad,
            on_skip=on_skip,
            progress=progress,
        )
        seconds = progress.finish()
        n_tokens = sum(len(e.tokens) for e in examples)
        mb = progress.done / 1e6
        print(
            f"{file}: {len(examples):,} examples, {n_tokens:,} tokens from {mb:.1f} MB in "
            f"{seconds:.1f} s ({mb / max(seconds, 1e-9):.2f} MB/s)"
        )
        if skipped:
            print(f"{file}: skipped {skipped} bad records (--skip-bad)")
        note = cut_note(examples, args.max_seq_len, "--max-seq-len")
        if note:
            print(note)
        masked = sum(1 for e in examples if not e.trained[1:].all())
        if masked:
            print(
                f"note: the .bin format has no mask: the prompts of {masked:,} examples will be "
                "trained on too"
            )
        try:
            ready.append((outputs, split_parts(examples, weights) if weights else [examples]))
        except ValueError as e:
            raise UsageError(str(e)) from e
    for outputs, shards in ready:
        for out, shard in zip(outputs, shards, strict=True):
            write_bin(out, [e.tokens for e in shard], overwrite=args.overwrite)
            print(f"wrote {out} ({len(shard):,} examples)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tokenizer", help="tokenizer.json, a World vocabulary, world or bytes")
    parser.add_argument("--data", required=True, help=".jsonl, SQLite, .bin or mlx-lm folder")
    parser.add_argument("--output", required=True, help="the .bin to write (a folder for one)")
    parser.add_argument(
        "--max-seq-len", type=int, default=None, help="inputs per example (default: whole)"
    )
    split = parser.add_mutually_exclusive_group()
    split.add_argument("--split", type=int, default=None, help="K equal shards")
    split.add_argument("--split-weights", default=None, help="shards by weight, e.g. 6,2")
    parser.add_argument("--sql", default=None, help="query of (conversation, role, content) rows")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count bad records")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_seq_len is not None and args.max_seq_len < 1:
        parser.error(f"--max-seq-len must be >= 1, got {args.max_seq_len}")
    cli.run(PROG, lambda: pretokenize(args))


if __name__ == "__main__":
    main()
