"""``python -m mlx_rwkvx.convert SRC DST``: convert a checkpoint between formats.

SRC is any format ``mlx_rwkvx.load`` reads. DST is written as ``--to native`` (a folder, or one
``.safetensors`` with the config in its metadata), ``hf`` (Hugging Face: plain RWKV-7 or Qwen2),
``blinkdl`` (BlinkDL's names, one ``.pth`` or ``.safetensors``) or ``rwkvx`` (the RWKV-X
authors' names, one ``.pth`` or ``.safetensors``). ``--quantize int8`` stores INT8 weights
(native only). ``--to-rfa`` turns a Qwen2 checkpoint into an RFA model: the attention of every
layer not listed in ``--qwen-layers`` becomes an ARWKV time-mix initialised from it.
"""

from __future__ import annotations

import argparse

import mlx_rwkvx
from mlx_rwkvx import cli
from mlx_rwkvx.cli import help_text
from mlx_rwkvx.io.convert import WRITERS, convert
from mlx_rwkvx.io.load import DTYPES

PROG = "mlx_rwkvx.convert"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("src", help="checkpoint to read (folder, .safetensors or .pth)")
    parser.add_argument("dst", help="where to write")
    parser.add_argument("--to", choices=sorted(WRITERS), default="native")
    parser.add_argument(
        "--quantize",
        choices=("int8", "int4"),
        nargs="?",
        const="int8",
        default=None,
        help="store INT8 (or int4) weights (bare: int8, as train and generate take it)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default=None,
        help="cast floating weights (default: as stored)",
    )
    parser.add_argument("--to-rfa", action="store_true", help="Qwen2 -> RFA (see above)")
    parser.add_argument("--head-size", type=int, default=None,
                        help="--to-rfa: WKV head size (default: 64)")  # fmt: skip
    parser.add_argument(
        "--qwen-layers",
        default=None,
        help="--to-rfa: comma-separated layers kept as Qwen2 (default: 3, 7, 11, ...)",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="replace an existing checkpoint at DST"
    )
    args = parser.parse_args(argv)
    layers = None
    if args.qwen_layers is not None:
        try:
            layers = [int(x) for x in args.qwen_layers.split(",") if x.strip()]
        except ValueError:
            parser.error(
                f"--qwen-layers: expected comma-separated integers, got {args.qwen_layers!r}"
            )

    def body():
        mlx_rwkvx.configure()
        convert(
            args.src,
            args.dst,
            to=args.to,
            quantize=args.quantize,
            dtype=args.dtype,
            to_rfa=args.to_rfa,
            qwen_layers=layers,
            head_size=args.head_size,
            overwrite=args.overwrite,
        )

    cli.run(PROG, body)
    print(f"wrote {args.dst} ({args.to})")


if __name__ == "__main__":
    main()
