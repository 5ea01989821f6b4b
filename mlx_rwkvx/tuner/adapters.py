"""Adapters: which layers get one (targets), mlx-lm's ``LoRALinear`` / ``DoRALinear`` on them,
state tuning, and the adapter files (mlx-lm's tensor names and ``adapter_config.json``, plus
what describes the run: alpha, targets, the base model's fingerprint).

Targets are module paths. Presets (Foundry's sets and ours):

- ``attn``: every MoBA block's Q, K, V, O and channel-mix key and value (6 a block: RWKV-X);
- ``qwen``: every Qwen2 block's Q, K, V, O, gate, up, down (7 a block: RFA);
- ``rwkv``: every RWKV block's time-mix receptance, key, value, output and FFN projections;
- ``all``: every projection but RWKV-7's low-rank ones, the embedding and the head;

or a comma list of glob patterns over module paths (``layers.*.attn.q_proj``). ``num_layers``
keeps the last N blocks of the model, of any kind.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os

from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, check_target, save_safetensors
from mlx_rwkvx.io.detect import read_json
from mlx_rwkvx.io.names import DROP, hf_rwkv7_rule
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.quantize import use_our_classes
from mlx_rwkvx.models.rwkv7 import HeadNorm
from mlx_rwkvx.tuner.lora_variants import (
    MissLinear,
    PissaLinear,
    load_saved_tensors,
    saved_tensors,
)

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

ADAPTER_LEAVES = ("lora_a", "lora_b", "m")  # what LoRALinear / DoRALinear train
# RWKV-7's low-rank projections: small and sensitive, never adapted (and not quantized)
_LOW_RANK = (".decay.", ".iclr.", ".value_mix.", ".gate.")
_PRESETS = {
    "attn": {"moba": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "ffn.key",
                      "ffn.value")},
    "qwen": {"qwen2": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")},
    "rwkv": {"rwkv7": ("tmix.receptance", "tmix.key", "tmix.value", "tmix.output", "ffn.key",
                       "ffn.value", "ffn.gate_proj", "ffn.up_proj", "ffn.down_proj")},
}  # fmt: skip
PRESETS = (*_PRESETS, "all")


def default_targets(model: Model) -> str:
    """The family's preset: RWKV-X ``attn``, RFA ``qwen``, RWKV-7 ``rwkv``."""
    kinds = set(model.config.block_types)
    return "attn" if "moba" in kinds else "qwen" if "qwen2" in kinds else "rwkv"


def native_path(model: Model, path: str) -> str:
    """Our module path for ``path`` written in mlx-lm's (Hugging Face's) names: RWKV-7's
    ``model.layers.3.attn.k_proj`` is our ``layers.3.tmix.key``; paths already ours, and
    Qwen2/MoBA paths with mlx-lm's ``model.`` prefix, map to themselves."""
    modules = dict(model.named_modules())
    for candidate in (path, path.removeprefix("model.")):
        if candidate in modules:
            return candidate
    mapped = hf_rwkv7_rule(path + ".weight")
    if mapped and mapped != DROP and mapped[1] is None and mapped[0].endswith(".weight"):
        return mapped[0].removesuffix(".weight")
    return path


def _projections(model: Model):
    """(path, module) of every adaptable projection: Linear or QuantizedLinear, not RWKV-7's
    low-rank ones, inside a block."""
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            continue
        if path.startswith("layers.") and not any(s in f".{path}." for s in _LOW_RANK):
            yield path, module


def target_paths(model: Model, targets: str, num_layers: int | None = None) -> list[str]:
    """The module paths ``targets`` (a preset or comma-separated globs) names in the last
    ``num_layers`` blocks (all when None or more than the model has). AdapterError if it, or
    one of its patterns (a typo), names nothing."""
    n = len(model.layers)
    if num_layers is not None and (type(num_layers) is not int or num_layers < 1):
        raise AdapterError(f"num_layers must be an int >= 1, got {num_layers!r}")
    first = max(n - (num_layers or n), 0)  # more than the model's blocks: all (as mlx-lm)
    found, matched = [], set()
    patterns = [p.strip() for p in targets.split(",") if p.strip()] if targets else []
    if not patterns:
        raise AdapterError(f"no adapter targets given (a preset of {PRESETS} or module globs)")
    for path, _ in _projections(model):
        index = int(path.split(".")[1])
        if index < first:
            continue
        kind = model.layers[index].kind
        inner = path.split(".", 2)[2]
        hits = set()
        for pattern in patterns:  # every one, to tell which match nothing
            if pattern == "all":
                hit = True
            elif pattern in _PRESETS:
                hit = inner in _PRESETS[pattern].get(kind, ())
            else:  # a glob over paths, or a block-relative name (ours or mlx-lm's)
                hit = (
                    fnmatch.fnmatchcase(path, pattern)
                    or fnmatch.fnmatchcase(inner, pattern)
                    or native_path(model, f"model.layers.{index}.{pattern}") == path
                )
            if hit:
                hits.add(pattern)
        if hits:
            found.append(path)
            matched |= hits
    where = f" in the last {num_layers} blocks" if num_layers else ""
    if not found:
        raise AdapterError(f"adapter targets {targets!r} match no projection{where}")
    unmatched = [p for p in patterns if p not in matched]
    if unmatched:
        raise AdapterError(
            f"adapter target {unmatched[0]!r} (of {targets!r}) matches no projection{where}"
        )
    return sorted(found, key=lambda p: (int(p.split(".")[1]), p))  # in the model's order


def apply_lora(
    model: Model,
    paths: list[str],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    dora: bool = False,
    variant: str | None = None,
) -> None:
    """Wrap the projections at ``paths`` in mlx-lm's ``LoRALinear`` (``DoRALinear`` with
    ``dora``; ``variant`` ``"pissa"`` or ``"miss"``: ``lora_variants``' layers), scale =
    alpha / rank, in place. The base is frozen, the adapters trainable."""
    if type(rank) is not int or rank < 1:
        raise AdapterError(f"the LoRA rank must be an int >= 1, got {rank!r}")
    if not 0.0 <= dropout < 1.0:
        raise AdapterError(f"the LoRA dropout must be in [0, 1), got {dropout!r}")
    modules = dict(model.named_modules())
    if dora and any(isinstance(modules[p], nn.QuantizedLinear) for p in paths):
        raise AdapterError(
            "DoRA on a quantized base: mlx-lm's DoRALinear dequantizes the whole base weight "
            "on every forward (the float copy a quantized base exists to avoid); use LoRA"
        )
    if variant == "pissa" and any(isinstance(modules[p], nn.QuantizedLinear) for p in paths):
        raise AdapterError("PiSSA needs a float base (its residual would be quantized anew)")
    model.freeze()
    layer = {"pissa": PissaLinear, "miss": MissLinear}.get(variant) or (
        DoRALinear if dora else LoRALinear
    )
    wrapped = [
        (p, layer.from_base(modules[p], r=rank, dropout=dropout, scale=alpha / rank)) for p in paths
    ]
    model.update_modules(tree_unflatten(wrapped))


def check_rank(model: Model, paths: list[str], rank: int) -> None:
    """Training refuses a rank above a layer's ``min(in, out)``: such an update has no more
    directions to give, only more parameters (a merged ``concat`` adapter may exceed it)."""
    modules = dict(model.named_modules())
    for p in paths:
        layer = modules[p]
        out, inp = layer.weight.shape
        if isinstance(layer, nn.QuantizedLinear):
            inp = inp * 32 // layer.bits
        if rank > min(inp, out):
            raise AdapterError(
                f"--lora-rank {rank} is above the size of {p} ({inp} -> {out}): at most "
                f"{min(inp, out)}"
            )


def enable_state_tuning(model: Model) -> list[str]:
    """Give every RWKV block a trainable initial WKV state (zeros: no change at first) and
    freeze everything else. Returns the trained parameters' paths."""
    blocks = [(i, b) for i, b in enumerate(model.layers) if b.kind == "rwkv7"]
    if not blocks:
        raise AdapterError("state tuning needs RWKV blocks; this model has none")
    model.freeze()
    for _, block in blocks:
        if "state0" not in block.tmix:
            block.tmix.enable_state_tuning()
        block.tmix.unfreeze(keys=["state0"], recurse=False)
    return [f"layers.{i}.tmix.state0" for i, _ in blocks]


def trainable_count(model: nn.Module) -> int:
    return sum(x.size for _, x in tree_flatten(model.trainable_parameters()))


def adapter_tensors(model: nn.Module) -> dict[str, mx.array]:
    """The trained tensors of a LoRA/DoRA/PiSSA/MiSS/state-tuned model, under their module
    paths; PiSSA's and MiSS's as the LoRA update they are against the original base."""
    tensors = {
        name: x
        for name, x in tree_flatten(model.trainable_parameters())
        if name.rsplit(".", 1)[-1] in (*ADAPTER_LEAVES, "state0")
    }
    tensors.update(saved_tensors(model))
    return tensors


def load_adapter_tensors(model: nn.Module, tensors: dict) -> None:
    """Put ``adapter_tensors``' tensors back into the model they came from (a resumed run)."""
    model.load_weights(list(load_saved_tensors(model, tensors).items()), strict=False)


def fingerprint(model: Model) -> str:
    """A short hash of a base model, the same in any of our formats and in float32, bfloat16 or
    INT8 (its architecture, and its norm weights rounded to bfloat16: norms are never
    quantized), and different between bases whose norms differ."""
    architecture = model.config.to_dict()
    architecture.pop("max_cache")  # a default of generation's, not what the weights compute
    h = hashlib.sha256(json.dumps(architecture, sort_keys=True).encode())
    for path, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
            h.update(path.encode())
            h.update(memoryview(module.weight.astype(mx.bfloat16).view(mx.uint16)))
    return h.hexdigest()[:16]


# ----- adapter files ---------------------------------------------------------------------------

ADAPTER_CONFIG = "adapter_config.json"
FINAL_ADAPTER = "adapter_final.safetensors"  # Foundry's names: adapter_final, checkpoint_<step>
MLX_LM_ADAPTER = "adapters.safetensors"  # what mlx-lm writes and reads


def adapter_config(
    model: Model,
    *,
    fine_tune_type: str,
    paths: list[str],
    rank: int | None = None,
    alpha: float | None = None,
    dropout: float = 0.0,
    targets: str = "",
    base_fingerprint: str,
    **facts,
) -> dict:
    """``adapter_config.json``: mlx-lm's fields (``fine_tune_type``, ``num_layers``,
    ``lora_parameters`` with ``rank``, ``scale``, ``dropout`` and the module paths as ``keys``)
    and ours (alpha, targets, the base's fingerprint, and ``facts`` such as the init seed and
    the tokens trained on)."""
    config = {
        "format": "mlx_rwkvx",
        "fine_tune_type": fine_tune_type,
        "num_layers": len(model.layers),
        "targets": targets,
        "base_fingerprint": base_fingerprint,
        **facts,
    }
    if fine_tune_type in ("lora", "dora"):
        config["lora_parameters"] = {
            "rank": rank,
            "scale": alpha / rank,
            "dropout": dropout,
            "keys": list(paths),
        }
        config["alpha"] = alpha
    return config


def save_adapter(path, model: Model, config: dict, *, overwrite: bool = True) -> None:
    """The adapter tensors of ``model`` in one ``.safetensors`` file whose metadata carries
    ``config`` (so a file copied alone describes itself), written atomically."""
    save_adapter_tensors(path, adapter_tensors(model), config, overwrite=overwrite)


def save_adapter_tensors(path, tensors: dict, config: dict, *, overwrite: bool = True) -> None:
    """``save_adapter`` of adapter tensors in hand (a merge's). An existing file is replaced
    only when it is an adapter file (``is_adapter_file``)."""
    path = os.fspath(path)
    check_target(path, overwrite=overwrite, folder=False, recognise=is_adapter_file,
                 kind="an adapter file")  # fmt: skip
    with atomic_target(path, folder=False) as tmp:
        save_safetensors(tmp, tensors, {"adapter_config": json.dumps(config)})


def is_adapter_file(path) -> bool:
    """Whether ``path`` is an adapter file: a safetensors file whose metadata carries an adapter
    config (ours), or whose tensors are all adapter tensors (mlx-lm's ``adapters.safetensors``)."""
    try:
        tensors, metadata = read_safetensors(os.fspath(path))
    except CheckpointError:
        return False
    leaves = (*ADAPTER_LEAVES, "state0")
    return "adapter_config" in metadata or (
        bool(tensors) and all(n.rsplit(".", 1)[-1] in leaves for n in tensors)
    )


def read_adapter(path) -> tuple[dict, dict[str, mx.array]]:
    """(config, tensors) of an adapter: a ``.safetensors`` file (its metadata, else the
    ``adapter_config.json`` beside it) or a folder (``adapter_final.safetensors``, else mlx-lm's
    ``adapters.safetensors``, with the folder's ``adapter_config.json``)."""
    path = os.fspath(path)
    if os.path.isdir(path):
        for name in (FINAL_ADAPTER, MLX_LM_ADAPTER):
            if os.path.exists(os.path.join(path, name)):
                file = os.path.join(path, name)
                break
        else:
            raise AdapterError(f"{path}: no {FINAL_ADAPTER} or {MLX_LM_ADAPTER} in the folder")
    elif os.path.isfile(path):
        file = path
    else:
        raise AdapterError(f"{path}: no such adapter file or folder")
    tensors, metadata = read_safetensors(file)
    if "adapter_config" in metadata:
        try:
            config = json.loads(metadata["adapter_config"])
        except json.JSONDecodeError as e:
            raise AdapterError(f"{file}: damaged adapter_config in its metadata ({e})") from e
    else:
        beside = os.path.join(os.path.dirname(file), ADAPTER_CONFIG)
        if not os.path.exists(beside):
            raise AdapterError(f"{file}: no adapter_config in its metadata, and no {beside}")
        config = read_json(beside)
    if not isinstance(config, dict):
        raise AdapterError(f"{file}: the adapter config is not a JSON object")
    return config, tensors


def _native_tensors(model: Model, tensors: dict) -> tuple[list[str], dict[str, mx.array]]:
    """(the wrapped module paths, the tensors under our paths) of an adapter file: ours name
    our paths; mlx-lm's name its model's (``model.layers.3.attn.k_proj.lora_a``). The file's
    tensors say which layers it adapts, whatever its config's ``keys`` and ``num_layers``."""
    renamed = {}
    for name, x in tensors.items():
        module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if leaf not in (*ADAPTER_LEAVES, "state0"):
            raise AdapterError(f"{name!r} is not an adapter tensor (lora_a, lora_b, m, state0)")
        renamed[f"{native_path(model, module)}.{leaf}"] = x
    paths = sorted({n.rsplit(".", 1)[0] for n in renamed if not n.endswith(".state0")})
    return paths, renamed


def apply_adapter(model: Model, path) -> Model:
    """Wrap ``model`` in the adapter at ``path`` (see ``read_adapter``) and load its tensors;
    refused (AdapterError) when it was trained on another base or does not fit."""
    config, tensors = read_adapter(path)
    return apply_adapter_tensors(model, config, tensors, os.fspath(path))


def apply_adapter_tensors(model: Model, config: dict, tensors: dict, path: str = "adapter"):
    """``apply_adapter`` of an adapter in memory (``config`` and tensors as an adapter file
    holds them; ``path`` names it in errors)."""
    want = config.get("base_fingerprint")
    if want and want != fingerprint(model):
        raise AdapterError(
            f"{os.fspath(path)}: the adapter was trained on another base model (fingerprint "
            f"{want}, this model's {fingerprint(model)})"
        )
    kind = config.get("fine_tune_type", "lora")
    paths, tensors = _native_tensors(model, tensors)
    for name, x in tensors.items():  # a diverged run's NaNs would give empty answers
        if mx.issubdtype(x.dtype, mx.floating) and not mx.all(mx.isfinite(x)).item():
            raise AdapterError(f"{os.fspath(path)}: {name} holds NaN or infinite values")
    if kind in ("lora", "dora"):
        lora = config.get("lora_parameters") or {}
        try:
            rank, scale = int(lora["rank"]), float(lora["scale"])
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"{os.fspath(path)}: bad lora_parameters ({e})") from e
        modules = dict(model.named_modules())
        missing = [p for p in paths if p not in modules]
        if missing or not paths:
            raise AdapterError(
                f"{os.fspath(path)}: the adapter's layers {missing[:4]} are not in this model"
                if missing
                else f"{os.fspath(path)}: the adapter holds no LoRA tensors"
            )
        apply_lora(
            model,
            paths,
            rank=rank,
            alpha=scale * rank,
            dropout=float(lora.get("dropout", 0.0)),
            dora=kind == "dora",
        )
    elif kind == "state":
        enable_state_tuning(model)
    else:
        raise AdapterError(f"{os.fspath(path)}: fine_tune_type {kind!r} is not an adapter")
    expected = {n: x.shape for n, x in adapter_tensors(model).items()}
    wrong = sorted(set(tensors) ^ set(expected)) + [
        n for n in tensors if n in expected and tuple(tensors[n].shape) != tuple(expected[n])
    ]
    if wrong:
        raise AdapterError(f"{os.fspath(path)}: tensors that do not fit this model: {wrong[:6]}")
    model.load_weights(list(tensors.items()), strict=False)
    model.eval()  # LoRA dropout is for training
    mx.eval(model.parameters())
    return model


def has_adapters(model: nn.Module) -> bool:
    """Whether ``model`` holds adapter layers (to be fused, or saved as an adapter)."""
    return any(isinstance(m, (LoRALinear, DoRALinear)) for _, m in model.named_modules())


def fuse_adapters(model: Model) -> Model:
    """Fold every LoRA/DoRA adapter into its base layer (mlx-lm's ``fuse``; a quantized base
    stays quantized), in place."""
    fused = [
        (p, m.fuse()) for p, m in model.named_modules() if isinstance(m, (LoRALinear, DoRALinear))
    ]
    if fused:
        model.update_modules(tree_unflatten(fused))
        use_our_classes(model)  # mlx-lm re-quantizes a fused layer as MLX's class
    return model
