"""``python -m mlx_rwkvx.merge --output OUT ADAPTER...``: merge adapters trained on several
Macs or shards (``fedavg``, ``delta``, ``concat``: see ``mlx_rwkvx.tuner.merge``), or fold them
into a model (``--fuse-into MODEL``).

OUT: a ``.safetensors`` file (the adapter, its config in the metadata), or a folder
(``adapter_final.safetensors`` and ``adapter_config.json``); with ``--fuse-into``, a native
model folder with the base's tokenizer files. An existing OUT is replaced only with
``--overwrite``. Exit codes: 0 done; 2 a problem with what was given (one line, nothing
written).
"""

from __future__ import annotations

import argparse
import json
import os

import mlx_rwkvx
from mlx_rwkvx import cli
from mlx_rwkvx.cli import help_text
from mlx_rwkvx.errors import UserError
from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, check_target, save_text
from mlx_rwkvx.io.detect import is_checkpoint
from mlx_rwkvx.io.load import load, save
from mlx_rwkvx.io.targets import output_lock, remove_stale, resolve_target
from mlx_rwkvx.models.quantize import dequantize_model, quantize_bits
from mlx_rwkvx.tuner import merge as merging
from mlx_rwkvx.tuner.adapters import (
    ADAPTER_CONFIG,
    FINAL_ADAPTER,
    apply_adapter_tensors,
    fuse_adapters,
    is_adapter_file,
    save_adapter_tensors,
)

import mlx.core as mx

PROG = "mlx_rwkvx.merge"


class UsageError(UserError):
    """Flags that do not fit together."""


def _weights(text: str | None):
    if text is None or text == "auto":
        return text
    try:
        return [float(x) for x in text.split(",")]
    except ValueError:
        raise UsageError(f"--weights {text!r}: give numbers like 6,2, or auto") from None


def write_adapter(path: str, tensors: dict, config: dict, overwrite: bool) -> None:
    """An adapter file (config in its metadata) or folder (and ``adapter_config.json``). An
    existing one is replaced only with ``overwrite``, only when it is an adapter, and a folder
    only when it holds nothing else (a training run's checkpoints and metrics are never
    dropped)."""
    if path.endswith(".safetensors"):
        save_adapter_tensors(path, tensors, config, overwrite=overwrite)
        return
    _check_adapter_folder(path, overwrite)
    with atomic_target(path, folder=True) as tmp:
        save_adapter_tensors(os.path.join(tmp, FINAL_ADAPTER), tensors, config)
        save_text(os.path.join(tmp, ADAPTER_CONFIG), json.dumps(config, indent=2))


def _is_adapter_folder(path: str) -> bool:
    return is_adapter_file(os.path.join(path, FINAL_ADAPTER))


def _check_adapter_folder(path: str, overwrite: bool) -> None:
    check_target(path, overwrite=overwrite, folder=True, recognise=_is_adapter_folder,
                 kind="an adapter folder")  # fmt: skip
    if os.path.isdir(path):
        lost = sorted(set(os.listdir(path)) - {FINAL_ADAPTER, ADAPTER_CONFIG, ".DS_Store"})
        if lost:
            raise CheckpointError(
                f"{path}: replacing it would drop {lost[:6]}, which a merged adapter does not "
                "bring; write to a new folder"
            )


def _requantize_error(model, fused_float: dict, bits: int) -> float:
    """Quantize ``model`` (float, adapters fused) and return how much of the fused updates the
    rounding swallows: ||(deq(Q(W')) - W) - delta|| / ||delta|| over the adapted layers, where
    ``fused_float`` holds (W, delta) per layer."""
    model.quantize(bits)
    modules = dict(model.named_modules())
    lost, total = 0.0, 0.0
    for path, (base, delta) in fused_float.items():
        m = modules[path]
        if "scales" not in m:  # a layer the quantizer leaves in float (an odd width)
            continue
        w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
        lost += float(mx.sum(((w - base) - delta) ** 2))
        total += float(mx.sum(delta**2))
    return (lost / total) ** 0.5 if total > 0 else 0.0


def fuse_into(model_path: str, config: dict, tensors: dict, out: str, args) -> str:
    """Load ``model_path`` (a quantized one dequantized), apply the adapter, fold it in, save
    the float (or ``--quantize``d) model with its tokenizer. Returns a line of report."""
    model, tokenizer = load(model_path)
    was = model.quantization
    if was is not None:
        dequantize_model(model)
    apply_adapter_tensors(model, config, tensors, "the merged adapter")
    wrapped = {p: m for p, m in model.named_modules() if hasattr(m, "lora_a")}
    before = {p: m.linear.weight for p, m in wrapped.items()}
    fuse_adapters(model)
    modules = dict(model.named_modules())
    fused = {p: (before[p], modules[p].weight - before[p]) for p in wrapped}
    mx.eval(fused)
    report = f"fused {len(wrapped)} layers into {model_path}" + (
        f" (its {was['bits']}-bit weights dequantized)" if was else ""
    )
    bits = quantize_bits(args.quantize)
    if bits is not None:
        err = _requantize_error(model, fused, bits)
        report += f"; re-quantized to {bits} bits: the rounding changes the fused update by "
        report += f"{err:.1%} (relative)"
    save(model, out, tokenizer=tokenizer, overwrite=args.overwrite)
    return report


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description=help_text(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("adapters", nargs="+", metavar="ADAPTER", help="adapter files or folders")
    p.add_argument("--output", "-o", required=True, help="where to write (see above)")
    p.add_argument("--method", choices=merging.METHODS, default="fedavg",
                   help="fedavg (A and B averaged: the seeds'), delta (the updates averaged "
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


def run(args) -> str:
    if args.quantize and not args.fuse_into:
        raise UsageError("--quantize goes with --fuse-into (an adapter has no base weights)")
    if args.rank is not None and args.method != "delta":
        raise UsageError("--rank goes with --method delta")
    inputs = [*args.adapters, args.fuse_into]
    out = resolve_target(args.output, what="--output", inputs=inputs)
    with output_lock(out, "--output"):
        remove_stale(os.path.dirname(out), os.path.basename(out))
        return _run(args, out)


def _run(args, out: str) -> str:
    single = out.endswith(".safetensors")
    if args.fuse_into:
        check_target(out, overwrite=args.overwrite, folder=not single, recognise=is_checkpoint,
                     kind="a model")  # fmt: skip
    elif single:
        check_target(out, overwrite=args.overwrite, folder=False, recognise=is_adapter_file,
                     kind="an adapter file")  # fmt: skip
    else:
        _check_adapter_folder(out, args.overwrite)
    adapters = [merging.read(path) for path in args.adapters]
    if args.fuse_into and adapters[0].kind == "state":
        raise UsageError(
            f"{adapters[0].path}: a state-tuning adapter has no weights to fuse into a model; "
            "use it as it is (--adapter)"
        )
    if len(adapters) == 1 and args.fuse_into:  # fusing one adapter: nothing to merge
        only = adapters[0]
        config, tensors = only.config, merging.as_float32(only.tensors)
        lines = [f"read {only.path}"]
    else:
        merging.check(adapters, args.method, force=args.force)
        weights = merging.weights_of(adapters, _weights(args.weights))
        rank = args.rank
        if args.method == "delta" and rank is None and adapters[0].modules():
            rank = max(a.tensors[f"{a.modules()[0]}.lora_a"].shape[1] for a in adapters)
        tensors, new_rank, scale, report = merging.merge(adapters, args.method, weights, rank)
        config = merging.merged_config(adapters, args.method, weights, new_rank, scale, report)
        lines = [
            f"merged {len(adapters)} adapters by {args.method}, weights "
            + ", ".join(f"{w:.3f}" for w in weights)
            + (f", rank {new_rank}" if new_rank else "")
        ]
        if args.method == "delta" and new_rank:
            lines.append(
                f"the rank-{new_rank} factors leave {report['relative_error']:.2%} of the "
                f"averaged update (relative, over all layers; worst layer "
                f"{report['max_relative_error']:.2%})"
            )
    if args.fuse_into:
        lines.append(fuse_into(args.fuse_into, config, tensors, out, args))
    else:
        write_adapter(out, tensors, config, args.overwrite)
    lines.append(f"wrote {args.output}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)

    def body():
        mlx_rwkvx.configure()
        return run(args)

    print(cli.run(PROG, body))


if __name__ == "__main__":
    main()
