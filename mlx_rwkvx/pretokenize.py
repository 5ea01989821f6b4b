"""``python -m mlx_rwkvx.pretokenize``: tokenize training data once into Foundry's binary.

    python -m mlx_rwkvx.pretokenize --tokenizer T --data D --output O [--max-seq-len N]
                                    [--split K | --split-weights 6,2]

D is anything training reads (``.jsonl`` text / chat / prompt-completion, a SQLite database
with ``--sql``, a ``.bin`` to re-split); O receives ``[n: u32] ([len: u32] [tokens: u32 x
len]) x n``, little endian, each example at most N + 1 tokens (N inputs). ``--split K`` writes
K equal contiguous parts, ``--split-weights 6,2`` parts in those proportions, as
``<base>_0.bin``, ``<base>_1.bin``, ... (one per machine). D an mlx-lm folder: O is a folder
that gets ``train.bin``, ``valid.bin``, ``test.bin`` for the splits D has, which training reads
as it reads the folder. The format carries no mask: chat prompts are trained on too.

T: a ``tokenizer.json`` (or its folder, with its chat template), a World vocabulary file or a
folder holding one, ``world`` (RWKV World) or ``bytes``. Bad data stops with one line naming
the file and the line (exit 2) unless ``--skip-bad``, which skips, counts and reports them.
"""

from __future__ import annotations

import argparse

from mlx_rwkvx import cli
from mlx_rwkvx.cli import help_text
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.tuner.pretokenize import pretokenize

PROG = "mlx_rwkvx.pretokenize"


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
    split.add_argument("--split", type=int, default=None, help="K equal parts")
    split.add_argument("--split-weights", default=None, help="parts by weight, e.g. 6,2")
    parser.add_argument("--sql", default=None, help="query of (conversation, role, content) rows")
    parser.add_argument("--skip-bad", action="store_true", help="skip and count bad records")
    parser.add_argument("--overwrite", action="store_true", help="replace existing outputs")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_seq_len is not None and args.max_seq_len < 1:
        parser.error(f"--max-seq-len must be >= 1, got {args.max_seq_len}")
    cli.run(PROG, lambda: pretokenize(
        args.data, args.output, args.tokenizer, max_seq_len=args.max_seq_len,
        weights=_weights(args), sql=args.sql, skip_bad=args.skip_bad, overwrite=args.overwrite,
    ))  # fmt: skip


if __name__ == "__main__":
    main()
