"""``python -m mlx_rwkvx.train``: LoRA, DoRA, state tuning, full fine-tuning or pretraining of
an RWKV-7, RWKV-X or RFA model (see ``--help``; settings in ``mlx_rwkvx/tuner/config.py``).

Exit codes: 0 done; 1 the loss or a gradient stopped being finite (the last checkpoint is
kept); 2 a problem with what was given (one line, nothing written); 130 Ctrl-C, 143 SIGTERM
(the step in flight finished and saved).
"""

from __future__ import annotations

import sys

from mlx_rwkvx import cli, settings
from mlx_rwkvx.errors import NonFinite
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config

PROG = "mlx_rwkvx.train"


def read_settings(argv: list[str] | None) -> TrainConfig:
    """The run's settings as ``python -m mlx_rwkvx.train argv`` reads them (``settings.load``;
    the demo runs its stages through it): UsageError or TrainError for what does not fit."""
    return settings.load(TrainConfig, argv, PROG)


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = read_settings(argv)
        try:
            return train_from_config(cfg)
        except NonFinite as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            sys.exit(1)

    out = cli.run(PROG, body, kept="the checkpoints saved before are kept")
    if out is not None:  # rank 0 (or the only process): the one that wrote
        print(f"done: {out}")


if __name__ == "__main__":
    main()
