"""Which layers get an adapter. Targets are module paths; the presets (Foundry's sets and ours):

- ``attn``: every MoBA block's Q, K, V, O and channel-mix key and value (6 a block: RWKV-X);
- ``qwen``: every Qwen2 block's Q, K, V, O, gate, up, down (7 a block: RFA);
- ``rwkv``: every RWKV block's time-mix receptance, key, value, output and FFN projections;
- ``all``: every projection but RWKV-7's low-rank ones, the embedding and the head;

or a comma list of glob patterns over module paths (``layers.*.attn.q_proj``), ours or mlx-lm's
(Hugging Face's) names. ``num_layers`` keeps the last N blocks of the model, of any kind."""

from __future__ import annotations

import fnmatch

from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.io.names import DROP, hf_rwkv7_rule
from mlx_rwkvx.models.model import Model

import mlx.nn as nn

# RWKV-7's low-rank projections: small and sensitive, never adapted (and not quantized)
_LOW_RANK = (".decay.", ".iclr.", ".value_mix.", ".gate.")


_PRESETS = {
    "attn": {
        "moba": ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "ffn.key", "ffn.value")
    },
    "qwen": {
        "qwen2": (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    },
    "rwkv": {
        "rwkv7": (
            "tmix.receptance",
            "tmix.key",
            "tmix.value",
            "tmix.output",
            "ffn.key",
            "ffn.value",
            "ffn.gate_proj",
            "ffn.up_proj",
            "ffn.down_proj",
        )
    },
}


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
