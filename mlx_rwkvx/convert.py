"""``python -m mlx_rwkvx.convert SRC DST``: convert a checkpoint between formats.

SRC is any format ``mlx_rwkvx.load`` reads. DST is written as ``--to native`` (a folder, or one
``.safetensors`` with the config in its metadata), ``hf`` (Hugging Face: plain RWKV-7 or Qwen2)
or ``blinkdl`` (BlinkDL's names, ``.safetensors``). ``--quantize int8`` stores INT8 weights
(native only). ``--to-rfa`` turns a Qwen2 checkpoint into an RFA model: the attention of every
layer not listed in ``--qwen-layers`` becomes an ARWKV time-mix initialised from it.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import mlx_rwkvx
from mlx_rwkvx import cli
from mlx_rwkvx.cli import help_text
from mlx_rwkvx.errors import UserError
from mlx_rwkvx.io.atomic import check_target
from mlx_rwkvx.io.detect import is_checkpoint
from mlx_rwkvx.io.formats import write_blinkdl, write_hf, write_native
from mlx_rwkvx.io.load import DTYPES, load
from mlx_rwkvx.io.targets import output_lock, remove_stale, resolve_target
from mlx_rwkvx.io.tokenizers import ByteTokenizer, byte_tokenizer_files, tokenizer_files
from mlx_rwkvx.models.config import RFA_SWITCHES, default_qwen_layers, rfa_config
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.quantize import quantize_bits

import mlx.core as mx
from mlx.utils import tree_flatten

PROG = "mlx_rwkvx.convert"
WRITERS = {"native": write_native, "hf": write_hf, "blinkdl": write_blinkdl}


class UsageError(UserError):
    """Flags that do not fit together or do not fit the checkpoint."""


def qwen2_to_rfa(model: Model, qwen_layers: list[int], head_size: int = 64, seed: int = 0) -> Model:
    """An RFA model from a model of Qwen2 blocks: layers not in ``qwen_layers`` get an ARWKV
    time-mix with receptance from q_proj, key and value from k_proj and v_proj repeated over the
    KV groups, output from o_proj, the rest the default init; MLP and norms are kept. The q, k, v
    biases of replaced layers have no place in a time-mix and are dropped. ``head_size``: the
    WKV head size (the 1.5B reference: 24 heads of 64)."""
    cfg = model.config
    if set(cfg.block_types) != {"qwen2"}:
        raise UsageError("--to-rfa needs a Qwen2 checkpoint (a model of Qwen2 blocks only)")
    n = len(cfg.block_types)
    bad = [i for i in qwen_layers if not 0 <= i < n]
    if bad:
        raise UsageError(f"--qwen-layers {bad} outside 0..{n - 1}")
    if cfg.n_q_heads * cfg.attn_head_dim != cfg.hidden_size:
        raise UsageError("--to-rfa needs n_q_heads * head_dim == hidden_size")
    fields = {k: v for k, v in cfg.to_dict().items() if k != "block_types"}
    fields.update(
        RFA_SWITCHES,
        block_types=["qwen2" if i in qwen_layers else "rwkv7" for i in range(n)],
        head_size=head_size,
    )
    try:
        new_cfg = rfa_config(**fields)
    except ValueError as e:
        raise UsageError(f"--to-rfa: {e}") from e
    new = Model(new_cfg, seed=seed)
    new.set_dtype(model.embed.weight.dtype)  # the new time-mixes in the checkpoint's dtype
    groups = cfg.n_q_heads // cfg.n_kv_heads
    D = cfg.attn_head_dim
    for old, block in zip(model.layers, new.layers, strict=True):
        if block.kind == "qwen2":
            block.update(old.parameters())
            continue
        attn = old.self_attn

        def per_query_head(w):  # [n_kv * D, C] -> [n_q * D, C]: each KV head G times
            return mx.repeat(w.reshape(cfg.n_kv_heads, D, -1), groups, axis=0).reshape(
                -1, w.shape[-1]
            )

        block.tmix.receptance.weight = attn.q_proj.weight
        block.tmix.key.weight = per_query_head(attn.k_proj.weight)
        block.tmix.value.weight = per_query_head(attn.v_proj.weight)
        block.tmix.output.weight = attn.o_proj.weight
        block.ln1.weight = old.input_layernorm.weight
        block.ln2.weight = old.post_attention_layernorm.weight
        block.ffn.update(old.mlp.parameters())
    new.embed.update(model.embed.parameters())
    new.norm.update(model.norm.parameters())
    if "lm_head" in model:
        new.lm_head.update(model.lm_head.parameters())
    return new


def convert(
    src,
    dst,
    *,
    to: str = "native",
    quantize=None,
    dtype=None,
    to_rfa: bool = False,
    qwen_layers=None,
    head_size: int | None = None,
    overwrite: bool = False,
) -> Model:
    """Read ``src``, transform, write ``dst`` with the tokenizer files of ``src`` beside the
    weights; returns the written model. An existing ``dst`` is replaced only with
    ``overwrite``, and only when it is a checkpoint; a ``dst`` that is, holds or lies inside
    ``src``, or would replace the current folder, is refused. ``head_size`` (default 64) and
    ``qwen_layers`` go with ``to_rfa``. While it runs, ``dst`` is locked (``io/targets.py``): a
    second conversion into it is refused. Raises CheckpointError, TargetError or UsageError
    (UserErrors) naming the problem."""
    if to not in WRITERS:
        raise UsageError(f"--to must be one of {sorted(WRITERS)}, got {to!r}")
    if not to_rfa and (head_size is not None or qwen_layers is not None):
        given = "--head-size" if head_size is not None else "--qwen-layers"
        raise UsageError(f"{given} sets up --to-rfa: it needs --to-rfa")
    bits = quantize_bits(quantize)
    if bits and to != "native":
        raise UsageError("--quantize writes INT8 weights, which only the native format holds")
    real = resolve_target(dst, what="DST", inputs=[src])
    with output_lock(real, "DST"):
        remove_stale(os.path.dirname(real), os.path.basename(real))
        return _convert(src, dst, to, bits, dtype, to_rfa, qwen_layers, head_size, overwrite)


def _convert(src, dst, to, bits, dtype, to_rfa, qwen_layers, head_size, overwrite) -> Model:
    # the target first: a conversion that could not be written is not worth reading
    check_target(dst, overwrite=overwrite, folder=not os.fspath(dst).endswith(".safetensors"),
                 recognise=is_checkpoint)  # fmt: skip
    model, tokenizer = load(src, dtype=dtype)
    if to_rfa:
        n = len(model.config.block_types)
        layers = qwen_layers if qwen_layers is not None else default_qwen_layers(n)
        model = qwen2_to_rfa(model, layers, head_size=64 if head_size is None else head_size)
    if bits:
        model.quantize(bits=bits)
        mx.eval(model.parameters())
    tensors = dict(tree_flatten(model.parameters()))
    # the native config records the quantization, without which its tensors do not load
    extra = {"quantization": model.quantization} if to == "native" else {}
    if to == "hf" and isinstance(tokenizer, ByteTokenizer):  # files for transformers too
        with tempfile.TemporaryDirectory() as folder:
            files = byte_tokenizer_files(folder, tokenizer.vocab_size)
            WRITERS[to](dst, model.config, tensors, extra_files=files, overwrite=overwrite)
        return model
    files = tokenizer_files(tokenizer)
    WRITERS[to](dst, model.config, tensors, extra_files=files, overwrite=overwrite, **extra)
    return model


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
