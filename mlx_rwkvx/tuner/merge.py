"""Merging adapters trained on several Macs (or parts of the data): three methods over mlx-lm's LoRA
tensors (``lora_a [in, r]``, ``lora_b [r, out]``, update ``scale * A @ B``), plus the initial
states of state tuning, which every method averages exactly.

- ``fedavg``: A and B averaged element-wise (Foundry's method). Meaningful only when the
  adapters started from the same A (the same init seed): the average of products is not the
  product of averages, and only a common start keeps it close.
- ``delta``: the weighted average of the updates ``sum_i w_i s_i A_i B_i``, exact, re-factored
  to rank R by an SVD of its (at most sum r_i)-dimensional core: the relative error of the
  truncation is reported.
- ``concat``: the adapters side by side, rank ``sum r_i``, whose update is exactly the weighted
  average (the weights and scales folded into B).

Weights are normalised to sum to 1 (``auto``: the tokens each adapter trained on). Entry
points: ``merge_adapters`` (files in, a file or folder out: ``python -m mlx_rwkvx.merge``),
``read``, ``check``, ``weights_of``, ``merge``, ``fuse``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mlx_rwkvx.adapters.apply import apply_adapter_tensors
from mlx_rwkvx.adapters.files import (
    ADAPTER_CONFIG,
    FINAL_ADAPTER,
    is_adapter_file,
    read_adapter,
    save_adapter_tensors,
)
from mlx_rwkvx.adapters.fuse import fuse_adapters
from mlx_rwkvx.errors import CheckpointError, MergeError, UsageError
from mlx_rwkvx.io.atomic import atomic_target, check_target, save_text
from mlx_rwkvx.io.detect import is_checkpoint
from mlx_rwkvx.io.hub import resolve_model
from mlx_rwkvx.io.load import load, save
from mlx_rwkvx.io.targets import output_lock, remove_stale, resolve_target
from mlx_rwkvx.models.quantize import dequantize_model, quantize_bits

import mlx.core as mx
import numpy as np

METHODS = ("fedavg", "delta", "concat")


@dataclass
class Adapter:
    path: str
    config: dict
    tensors: dict[str, np.ndarray]  # float64

    @property
    def kind(self) -> str:
        return self.config.get("fine_tune_type", "lora")

    @property
    def scale(self) -> float:
        return float((self.config.get("lora_parameters") or {}).get("scale", 1.0))

    def modules(self) -> list[str]:
        return sorted({n.rsplit(".", 1)[0] for n in self.tensors if n.endswith(".lora_a")})


def read(path) -> Adapter:
    """An adapter file or folder (``read_adapter``) with its tensors in float64."""
    config, tensors = read_adapter(path)
    arrays = {n: np.array(x.astype(mx.float32), dtype=np.float64) for n, x in tensors.items()}
    bad = [n for n, x in arrays.items() if not np.all(np.isfinite(x))]
    if bad:
        raise MergeError(f"{os.fspath(path)}: {bad[0]} holds NaN or infinite values")
    return Adapter(os.fspath(path), config, arrays)


def weights_of(adapters: list[Adapter], weights) -> np.ndarray:
    """``weights``: None (equal), ``"auto"`` (tokens trained on, from each adapter's config),
    or numbers, one per adapter; normalised to sum to 1."""
    n = len(adapters)
    if weights is None:
        w = np.ones(n)
    elif weights == "auto":
        tokens = [a.config.get("tokens_trained") for a in adapters]
        missing = [a.path for a, t in zip(adapters, tokens, strict=True) if not t]
        if missing:
            raise MergeError(
                f"--weights auto: {missing[0]} does not say how many tokens it "
                "trained on (tokens_trained); give the weights"
            )
        w = np.array(tokens, dtype=np.float64)
    else:
        w = np.array(list(weights), dtype=np.float64)
        with np.errstate(over="ignore"):  # an overflowing sum is refused below, not warned of
            total = w.sum() if len(w) else 0.0
        if len(w) != n:
            raise MergeError(f"{len(w)} weights for {n} adapters")
        if not np.all(np.isfinite(w)) or np.any(w < 0) or not 0 < total < np.inf:
            raise MergeError(
                f"the weights must be finite and non-negative with a positive, finite sum, "
                f"got {list(weights)}"
            )
    return w / w.sum()


def check(adapters: list[Adapter], method: str, force: bool = False) -> None:
    """Refuse (MergeError) what cannot be merged: another base, other targets or shapes, ranks
    that differ for fedavg, DoRA for a method other than fedavg, a common start that cannot be
    assumed for fedavg (unless ``force``)."""
    if method not in METHODS:
        raise MergeError(f"unknown method {method!r}; one of {list(METHODS)}")
    if len(adapters) < 2:
        raise MergeError("give at least two adapters to merge")
    first = adapters[0]
    for a in adapters[1:]:
        fa, fb = first.config.get("base_fingerprint"), a.config.get("base_fingerprint")
        if fa and fb and fa != fb:
            raise MergeError(
                f"{a.path} was trained on another base model than {first.path} (fingerprints "
                f"{fb} and {fa})"
            )
        if a.kind != first.kind:
            raise MergeError(f"{a.path} is a {a.kind} adapter, {first.path} a {first.kind} one")
        if sorted(a.tensors) != sorted(first.tensors) and (
            method == "fedavg" or a.modules() != first.modules()
        ):
            extra = sorted(set(a.tensors) ^ set(first.tensors))[:3]
            raise MergeError(f"{a.path} and {first.path} adapt other layers ({extra})")
        for name in first.tensors:
            sa, sb = first.tensors[name].shape, a.tensors[name].shape
            leaf = name.rsplit(".", 1)[1]
            need_equal = method == "fedavg" or leaf in ("m", "state0")
            outer = (sa[0], sb[0]) if leaf == "lora_a" else (sa[-1], sb[-1])
            if (need_equal and sa != sb) or outer[0] != outer[1]:
                what = "ranks or shapes" if method == "fedavg" else "shapes"
                raise MergeError(
                    f"{name}: {a.path} has shape {sb}, {first.path} {sa}: the {what} differ"
                    + (
                        " (delta or concat merge adapters of different ranks)"
                        if method == "fedavg" and leaf != "state0"
                        else ""
                    )
                )
    if first.kind == "dora" and method != "fedavg":
        raise MergeError(f"DoRA adapters merge by fedavg only (--method {method} needs LoRA)")
    if method == "fedavg" and first.kind in ("lora", "dora"):
        seeds = {a.config.get("seed") for a in adapters}
        if len(seeds) > 1 and not force:
            raise MergeError(
                f"the adapters started from different init seeds ({sorted(map(str, seeds))}): "
                "fedavg averages A and B element-wise, which is meaningful only from a common "
                "start; use --method delta or concat, or --force"
            )


def merge(adapters: list[Adapter], method: str, weights: np.ndarray, rank: int | None = None):
    """(merged tensors in float32, lora rank, lora scale, {"relative_error": delta's
    truncation error over all modules, "max_relative_error": the worst module's}).
    ``weights``: one per adapter, summing to 1 (``weights_of``); MergeError otherwise."""
    if method not in METHODS:
        raise MergeError(f"unknown method {method!r}; one of {list(METHODS)}")
    weights = np.asarray(weights, dtype=np.float64)
    if weights.shape != (len(adapters),) or not np.isclose(weights.sum(), 1.0):
        raise MergeError(
            f"merge: one weight per adapter summing to 1 ({len(adapters)} adapters), "
            f"got {weights.tolist()} (weights_of makes them)"
        )
    first = adapters[0]
    out: dict[str, np.ndarray] = {}
    report = {"relative_error": 0.0, "max_relative_error": 0.0}
    for name in first.tensors:  # the states of state tuning, DoRA magnitudes: averaged
        if name.endswith((".state0", ".m")):
            out[name] = sum(w * a.tensors[name] for w, a in zip(weights, adapters, strict=True))
    scale = first.scale
    if first.kind not in ("lora", "dora"):
        return as_float32(out), None, None, report
    ranks = [a.tensors[f"{first.modules()[0]}.lora_a"].shape[1] for a in adapters]
    if method == "fedavg":
        for name in first.tensors:
            if name.endswith(".lora_a"):
                out[name] = sum(w * a.tensors[name] for w, a in zip(weights, adapters, strict=True))
            elif name.endswith(".lora_b"):  # scales folded in, so that they may differ
                out[name] = sum(
                    w * (a.scale / scale) * a.tensors[name]
                    for w, a in zip(weights, adapters, strict=True)
                )
        return as_float32(out), ranks[0], scale, report
    total, lost = 0.0, 0.0
    new_rank = sum(ranks) if method == "concat" else rank
    if method == "delta" and (not isinstance(new_rank, int) or new_rank < 1):
        raise MergeError(f"--method delta needs --rank R >= 1, got {rank!r}")
    for module in first.modules():
        A = np.concatenate([a.tensors[f"{module}.lora_a"] for a in adapters], axis=1)
        B = np.concatenate(
            [
                w * a.scale * a.tensors[f"{module}.lora_b"]
                for w, a in zip(weights, adapters, strict=True)
            ],
            axis=0,
        )
        if method == "concat":  # scale * A @ (B / scale) is the average exactly
            out[f"{module}.lora_a"], out[f"{module}.lora_b"] = A, B / scale
            continue
        # delta: A @ B = Qa (Ra Rb^T) Qb^T; the SVD of the small core gives the best rank R
        Qa, Ra = np.linalg.qr(A)
        Qb, Rb = np.linalg.qr(B.T)
        U, S, Vt = np.linalg.svd(Ra @ Rb.T)
        r = min(new_rank, len(S))
        root = np.sqrt(S[:r])
        a_new = np.zeros((A.shape[0], new_rank))
        b_new = np.zeros((new_rank, B.shape[1]))
        a_new[:, :r] = (Qa @ U[:, :r]) * root
        b_new[:r] = (root[:, None] * (Vt[:r] @ Qb.T)) / scale
        out[f"{module}.lora_a"], out[f"{module}.lora_b"] = a_new, b_new
        energy, left = float(np.sum(S**2)), float(np.sum(S[r:] ** 2))
        total, lost = total + energy, lost + left
        if energy > 0:
            report["max_relative_error"] = max(report["max_relative_error"], (left / energy) ** 0.5)
    if method == "delta" and total > 0:
        report["relative_error"] = (lost / total) ** 0.5
    return as_float32(out), new_rank, scale, report


def as_float32(tensors: dict[str, np.ndarray]) -> dict[str, mx.array]:
    return {n: mx.array(x.astype(np.float32)) for n, x in sorted(tensors.items())}


def merged_config(adapters, method, weights, rank, scale, report) -> dict:
    """The merged adapter's config: the first's, with the new rank, scale and layer keys, the
    tokens of all, and where it came from."""
    config = dict(adapters[0].config)
    if rank is not None:
        lora = dict(config.get("lora_parameters") or {})
        lora.update(rank=rank, scale=scale)
        config["lora_parameters"] = lora
        config["alpha"] = scale * rank
    tokens = [a.config.get("tokens_trained") for a in adapters]
    if all(isinstance(t, int) for t in tokens):
        config["tokens_trained"] = sum(tokens)
    config["merged_from"] = [
        {"path": a.path, "weight": float(w)} for a, w in zip(adapters, weights, strict=True)
    ]
    config["merge_method"] = method
    if method == "delta":
        config["merge_relative_error"] = report["relative_error"]
    return config


# ----- merging adapter files (python -m mlx_rwkvx.merge) ---------------------------------------


def merge_adapters(
    paths: list,
    output,
    *,
    method: str = "fedavg",
    weights=None,
    rank: int | None = None,
    fuse_into=None,
    quantize=None,
    force: bool = False,
    overwrite: bool = False,
) -> list[str]:
    """Merge the adapter files or folders ``paths`` (``weights``: numbers, ``"auto"`` or None)
    and write the result to ``output``: an adapter file (``.safetensors``) or folder, or with
    ``fuse_into`` a model (its weights with the merged update folded in; ``quantize`` after).
    ``output`` is checked before anything is read, locked while it is written, and never an
    input (``io/targets.py``). Returns the lines of a report; UserErrors name the problem."""
    if quantize and not fuse_into:
        raise UsageError("--quantize goes with --fuse-into (an adapter has no base weights)")
    if rank is not None and method != "delta":
        raise UsageError("--rank goes with --method delta")
    if fuse_into is not None:
        fuse_into = resolve_model(fuse_into)  # a Hugging Face name: its snapshot in the cache
    out = resolve_target(output, what="--output", inputs=[*paths, fuse_into])
    with output_lock(out, "--output"):
        remove_stale(os.path.dirname(out), os.path.basename(out))
        _check_output(out, fuse_into, overwrite)
        adapters = [read(path) for path in paths]
        if fuse_into and adapters[0].kind == "state":
            raise UsageError(
                f"{adapters[0].path}: a state-tuning adapter has no weights to fuse into a "
                "model; use it as it is (--adapter)"
            )
        if len(adapters) == 1 and fuse_into:  # fusing one adapter: nothing to merge
            config, tensors = adapters[0].config, as_float32(adapters[0].tensors)
            lines = [f"read {adapters[0].path}"]
        else:
            config, tensors, lines = _merged(adapters, method, weights, rank, force)
        if fuse_into:
            lines.append(fuse(fuse_into, config, tensors, out, quantize, overwrite))
        else:
            write_adapter(out, tensors, config, overwrite)
    lines.append(f"wrote {os.fspath(output)}")
    return lines


def _check_output(out: str, fuse_into, overwrite: bool) -> None:
    single = out.endswith(".safetensors")
    if fuse_into:
        check_target(
            out, overwrite=overwrite, folder=not single, recognise=is_checkpoint, kind="a model"
        )
    elif single:
        check_target(
            out,
            overwrite=overwrite,
            folder=False,
            recognise=is_adapter_file,
            kind="an adapter file",
        )
    else:
        _check_adapter_folder(out, overwrite)


def _merged(adapters: list[Adapter], method: str, weights, rank, force: bool):
    """(config, tensors, report lines) of the merge."""
    check(adapters, method, force=force)
    weights = weights_of(adapters, weights)
    if method == "delta" and rank is None and adapters[0].modules():
        rank = max(a.tensors[f"{a.modules()[0]}.lora_a"].shape[1] for a in adapters)
    tensors, new_rank, scale, report = merge(adapters, method, weights, rank)
    config = merged_config(adapters, method, weights, new_rank, scale, report)
    lines = [
        f"merged {len(adapters)} adapters by {method}, weights "
        + ", ".join(f"{w:.3f}" for w in weights)
        + (f", rank {new_rank}" if new_rank else "")
    ]
    if method == "delta" and new_rank:
        lines.append(
            f"the rank-{new_rank} factors leave {report['relative_error']:.2%} of the "
            f"averaged update (relative, over all layers; worst layer "
            f"{report['max_relative_error']:.2%})"
        )
    return config, tensors, lines


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
    check_target(
        path,
        overwrite=overwrite,
        folder=True,
        recognise=_is_adapter_folder,
        kind="an adapter folder",
    )
    if os.path.isdir(path) and not os.path.islink(path):  # a link: replaced, its folder kept
        lost = sorted(set(os.listdir(path)) - {FINAL_ADAPTER, ADAPTER_CONFIG, ".DS_Store"})
        if lost:
            raise CheckpointError(
                f"{path}: replacing it would drop {lost[:6]}, which a merged adapter does not "
                "bring; write to a new folder"
            )


def requantize_error(model, fused_float: dict, bits: int) -> float:
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


def fuse(model_path, config: dict, tensors: dict, out: str, quantize=None, overwrite=False) -> str:
    """Load ``model_path`` (a quantized one dequantized), apply the adapter, fold it in, save
    the float (or ``quantize``d) model with its tokenizer to ``out``. Returns a line of
    report."""
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
    bits = quantize_bits(quantize)
    if bits is not None:
        err = requantize_error(model, fused, bits)
        report += f"; re-quantized to {bits} bits: the rounding changes the fused update by "
        report += f"{err:.1%} (relative)"
    save(model, out, tokenizer=tokenizer, overwrite=overwrite)
    return report
