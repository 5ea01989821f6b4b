"""``python -m mlx_rwkvx.train``: LoRA, DoRA, state tuning, full fine-tuning or pretraining of
an RWKV-7, RWKV-X or RFA model (see ``--help``; settings in ``mlx_rwkvx/tuner/config.py``).

Exit codes: 0 done; 1 the loss or a gradient stopped being finite (the last checkpoint is
kept); 2 a problem with what was given (one line, nothing written); 130 Ctrl-C, 143 SIGTERM
(the step in flight finished and saved).
"""

from __future__ import annotations

import sys

from mlx_rwkvx import cli
from mlx_rwkvx.settings import parse
from mlx_rwkvx.tuner.config import (
    MLX_LM_FLAGS,
    MODE_ONLY,
    TrainConfig,
    from_yaml,
    mode_only_problem,
    parser,
)
from mlx_rwkvx.tuner.trainer import NonFinite, TrainError, train

PROG = "mlx_rwkvx.train"


def config_from(argv: list[str] | None) -> TrainConfig:
    """The run's settings: defaults, then the YAML --config, then the flags. A setting that
    does not apply to the run's --mode is refused (TrainError) on the command line, and noted
    and dropped from the file."""
    args, settings = parse(parser(), argv, from_yaml)
    if "lora_alpha" in args:  # the command line's alpha beats the file's scale
        settings.pop("lora_scale", None)
    # mlx-lm's --train and --optimizer read as its config's keys: they beat the file too
    settings.update(from_yaml({k: args.pop(k) for k in MLX_LM_FLAGS if k in args}))
    mode = args.get("mode", settings.get("mode", "lora"))
    for name in MODE_ONLY:
        problem = mode_only_problem(name, mode)
        if problem and name in args:
            raise TrainError(problem)
    unused = [name for name in MODE_ONLY if mode_only_problem(name, mode) and name in settings]
    if unused:  # an mlx-lm config carries lora_parameters whatever its fine_tune_type
        verb = "does" if len(unused) == 1 else "do"
        print(f"note: --config: {', '.join(unused)} {verb} not apply to --mode {mode}: ignored",
              file=sys.stderr)  # fmt: skip
        for name in unused:
            settings.pop(name)
    settings.update(args)
    return TrainConfig(**settings)


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = config_from(argv)
        try:
            return train(cfg)
        except NonFinite as e:
            print(f"{PROG}: {e}", file=sys.stderr)
            sys.exit(1)

    out = cli.run(PROG, body, kept="the checkpoints saved before are kept")
    if out is not None:  # rank 0 (or the only process): the one that wrote
        print(f"done: {out}")


if __name__ == "__main__":
    main()
