"""``python -m mlx_rwkvx.convert SRC DST``: convert a checkpoint between formats.

SRC is any format ``mlx_rwkvx.load`` reads. DST is written as ``--to native`` (a folder, or one
``.safetensors`` with the config in its metadata), ``hf`` (Hugging Face: plain RWKV-7 or Qwen2),
``blinkdl`` (BlinkDL's names, one ``.pth`` or ``.safetensors``) or ``rwkvx`` (the RWKV-X
authors' names, one ``.pth`` or ``.safetensors``). ``--quantize int8`` stores INT8 weights
(native only). ``--to-rfa`` turns a Qwen2 checkpoint into an RFA model: the attention of every
layer not listed in ``--qwen-layers`` becomes an ARWKV time-mix initialised from it.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx_rwkvx
from mlx_rwkvx import cli, settings
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.io.convert import WRITERS, convert
from mlx_rwkvx.io.load import DTYPES
from mlx_rwkvx.settings import Settings, opt

PROG = "mlx_rwkvx.convert"


@dataclass
class ConvertConfig(Settings):
    src: str = opt("checkpoint to read (folder, .safetensors or .pth)", positional=True)
    dst: str = opt("where to write", positional=True)
    to: str = opt("the format written", default="native", choices=tuple(sorted(WRITERS)))
    quantize: str | None = opt(
        "store INT8 (or int4) weights (bare: int8, as train and generate take it)",
        choices=("int8", "int4"),
        const="int8",
    )
    dtype: str | None = opt(
        "cast floating weights (default: as stored)", choices=tuple(sorted(DTYPES))
    )
    to_rfa: bool = opt("Qwen2 -> RFA (see above)", default=False)
    head_size: int | None = opt("--to-rfa: WKV head size (default: 64)")
    qwen_layers: str | None = opt(
        "--to-rfa: comma-separated layers kept as Qwen2 (default: 3, 7, 11, ...)"
    )
    overwrite: bool = opt("replace an existing checkpoint at DST", default=False)

    def layers(self) -> list[int] | None:
        """--qwen-layers as numbers."""
        if self.qwen_layers is None:
            return None
        try:
            return [int(x) for x in self.qwen_layers.split(",") if x.strip()]
        except ValueError:
            raise UsageError(
                f"--qwen-layers: expected comma-separated integers, got {self.qwen_layers!r}"
            ) from None

    def check_together(self) -> None:
        self.layers()


def main(argv: list[str] | None = None) -> None:
    def body():
        cfg = settings.load(ConvertConfig, argv, PROG, description=__doc__, yaml=False)
        mlx_rwkvx.configure()
        convert(
            cfg.src,
            cfg.dst,
            to=cfg.to,
            quantize=cfg.quantize,
            dtype=cfg.dtype,
            to_rfa=cfg.to_rfa,
            qwen_layers=cfg.layers(),
            head_size=cfg.head_size,
            overwrite=cfg.overwrite,
        )
        return cfg

    cfg = cli.run(PROG, body)
    print(f"wrote {cfg.dst} ({cfg.to})")


if __name__ == "__main__":
    main()
