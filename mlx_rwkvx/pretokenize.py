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

from dataclasses import dataclass

from mlx_rwkvx import cli, settings
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.settings import Settings, opt
from mlx_rwkvx.tuner.pretokenize import pretokenize

PROG = "mlx_rwkvx.pretokenize"


@dataclass
class PretokenizeConfig(Settings):
    tokenizer: str | None = opt("tokenizer.json, a World vocabulary, world or bytes")
    data: str | None = opt(".jsonl, SQLite, .bin or mlx-lm folder", required=True)
    output: str | None = opt("the .bin to write (a folder for one)", required=True)
    max_seq_len: int | None = opt("inputs per example (default: whole)", ge=1)
    split: int | None = opt("K equal parts", ge=1, exclusive="split")
    split_weights: str | None = opt("parts by weight, e.g. 6,2", exclusive="split")
    sql: str | None = opt("query of (conversation, role, content) rows")
    skip_bad: bool = opt("skip and count bad records", default=False)
    overwrite: bool = opt("replace existing outputs", default=False)

    def weights(self) -> list[float] | None:
        """The parts' weights: --split K equal ones, or --split-weights (None: one part)."""
        if self.split is not None:
            return [1.0] * self.split
        if self.split_weights is None:
            return None
        try:
            weights = [float(x) for x in self.split_weights.split(",")]
        except ValueError:
            weights = []
        if not weights or any(not w > 0 or w == float("inf") for w in weights):
            raise UsageError(
                f"--split-weights: expected positive numbers separated by commas, got "
                f"{self.split_weights!r}"
            )
        return weights

    def check_together(self) -> None:
        self.weights()


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = settings.load(PretokenizeConfig, argv, PROG, description=__doc__, yaml=False)
        return pretokenize(
            cfg.data,
            cfg.output,
            cfg.tokenizer,
            max_seq_len=cfg.max_seq_len,
            weights=cfg.weights(),
            sql=cfg.sql,
            skip_bad=cfg.skip_bad,
            overwrite=cfg.overwrite,
        )

    cli.run(PROG, body)


if __name__ == "__main__":
    main()
