"""``python -m mlx_rwkvx.train``: LoRA, DoRA, state tuning, full fine-tuning or pretraining of
an RWKV-7, RWKV-X or RFA model (see ``--help``; settings in ``mlx_rwkvx/tuner/config.py``).

Exit codes: 0 done; 1 the loss or a gradient stopped being finite (the last checkpoint is
kept); 2 a problem with what was given (one line, nothing written); 130 Ctrl-C (the step in
flight finished and saved).
"""

from __future__ import annotations

import sys

from mlx_rwkvx.settings import parse
from mlx_rwkvx.tuner.config import MLX_LM_FLAGS, TrainConfig, from_yaml, parser
from mlx_rwkvx.tuner.trainer import NonFinite, TrainError, train


def config_from(argv: list[str] | None) -> TrainConfig:
    """The run's settings: defaults, then the YAML --config, then the flags."""
    args, settings = parse(parser(), argv, from_yaml)
    if "lora_alpha" in args:  # the command line's alpha beats the file's scale
        settings.pop("lora_scale", None)
    # mlx-lm's --train and --optimizer read as its config's keys: they beat the file too
    settings.update(from_yaml({k: args.pop(k) for k in MLX_LM_FLAGS if k in args}))
    settings.update(args)
    return TrainConfig(**settings)


def main(argv: list[str] | None = None) -> None:
    cfg = config_from(argv)
    try:
        out = train(cfg)
    except TrainError as e:
        print(f"mlx_rwkvx.train: error: {e}", file=sys.stderr)
        sys.exit(2)
    except NonFinite as e:
        print(f"mlx_rwkvx.train: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("mlx_rwkvx.train: interrupted", file=sys.stderr)
        sys.exit(130)
    print(f"done: {out}")


if __name__ == "__main__":
    main()
