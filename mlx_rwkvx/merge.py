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

import argparse

import mlx_rwkvx
from mlx_rwkvx import cli
from mlx_rwkvx.cli import help_text
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.tuner import merge as merging

PROG = "mlx_rwkvx.merge"


def _weights(text: str | None):
    if text is None or text == "auto":
        return text
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--weights {text!r}: give numbers like 6,2, or auto") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("adapters", nargs="+", metavar="ADAPTER", help="adapter files or folders")
    p.add_argument("--output", "-o", required=True, help="where to write (see above)")
    p.add_argument("--method", choices=merging.METHODS, default="fedavg",
                   help="fedavg (A and B averaged: Foundry's), delta (the updates averaged "
                   "exactly, re-factored to --rank by SVD), concat (exact, rank = the sum) "
                   "(default: fedavg)")  # fmt: skip
    p.add_argument("--weights", help="one weight per adapter (6,2), or auto: the tokens each "
                   "trained on (default: equal)")  # fmt: skip
    p.add_argument("--rank", type=int, help="--method delta: the merged rank (default: the "
                   "largest of the adapters')")  # fmt: skip
    p.add_argument("--fuse-into", metavar="MODEL", help="write MODEL with the merged update "
                   "folded into its weights (float; a quantized base is dequantized)")  # fmt: skip
    p.add_argument("--quantize", choices=("int8", "int4"), nargs="?", const="int8",
                   help="with --fuse-into: quantize the fused model and report the error the "
                   "rounding adds to the update (bare: int8)")  # fmt: skip
    p.add_argument("--force", action="store_true", help="fedavg adapters from different init "
                   "seeds all the same")  # fmt: skip
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    def body():
        mlx_rwkvx.configure()
        return merging.merge_adapters(
            args.adapters, args.output, method=args.method, weights=_weights(args.weights),
            rank=args.rank, fuse_into=args.fuse_into, quantize=args.quantize, force=args.force,
            overwrite=args.overwrite,
        )  # fmt: skip

    print("\n".join(cli.run(PROG, body)))


if __name__ == "__main__":
    main()
