"""``python -m mlx_rwkvx.merge --output OUT ADAPTER...``: merge adapters trained on several
Macs or parts of the data (``fedavg``, ``delta``, ``concat``: see ``mlx_rwkvx.tuner.merge``),
or fold them into a model (``--fuse-into MODEL``).

OUT: a ``.safetensors`` file (the adapter, its config in the metadata), or a folder
(``adapter_final.safetensors`` and ``adapter_config.json``); with ``--fuse-into``, a native
model folder with the base's tokenizer files. An existing OUT is replaced only with
``--overwrite``. Exit codes: 0 done; 2 a problem with what was given (one line, nothing
written).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx_rwkvx
from mlx_rwkvx import cli, settings
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.settings import Settings, opt
from mlx_rwkvx.tuner import merge as merging

PROG = "mlx_rwkvx.merge"


@dataclass
class MergeConfig(Settings):
    adapters: list[str] = opt("adapter files or folders", positional=True, metavar="ADAPTER")
    output: str | None = opt("where to write (see above)", "o", required=True)
    method: str = opt(
        "fedavg (A and B averaged: Foundry's), delta (the updates averaged exactly, re-factored "
        "to --rank by SVD), concat (exact, rank = the sum)",
        default="fedavg",
        choices=tuple(merging.METHODS),
    )
    weights: str | None = opt(
        "one weight per adapter (6,2), or auto: the tokens each trained on (default: equal)"
    )
    rank: int | None = opt(
        "--method delta: the merged rank (default: the largest of the adapters')", ge=1
    )
    fuse_into: str | None = opt(
        "write MODEL with the merged update folded into its weights (float; a quantized base is "
        "dequantized)",
        metavar="MODEL",
    )
    quantize: str | None = opt(
        "with --fuse-into: quantize the fused model and report the error the rounding adds to "
        "the update (bare: int8)",
        choices=("int8", "int4"),
        const="int8",
    )
    force: bool = opt("fedavg adapters from different init seeds all the same", default=False)
    overwrite: bool = opt("replace an existing OUT", default=False)

    def merge_weights(self) -> list[float] | str | None:
        """--weights as numbers (or auto, or None: equal)."""
        if self.weights is None or self.weights == "auto":
            return self.weights
        try:
            return [float(x) for x in self.weights.split(",")]
        except ValueError:
            problem = f"--weights {self.weights!r}: give numbers like 6,2, or auto"
            raise UsageError(problem) from None


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = settings.load(MergeConfig, argv, PROG, description=__doc__, yaml=False)
        mlx_rwkvx.configure()
        return merging.merge_adapters(
            cfg.adapters,
            cfg.output,
            method=cfg.method,
            weights=cfg.merge_weights(),
            rank=cfg.rank,
            fuse_into=cfg.fuse_into,
            quantize=cfg.quantize,
            force=cfg.force,
            overwrite=cfg.overwrite,
        )

    print("\n".join(cli.run(PROG, body)))


if __name__ == "__main__":
    main()
