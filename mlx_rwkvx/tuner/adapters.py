"""Adapters: which layers get one (targets), mlx-lm's ``LoRALinear`` / ``DoRALinear`` on them,
state tuning, and the adapter files (mlx-lm's tensor names and ``adapter_config.json``, plus
what describes the run: alpha, targets, the base model's fingerprint).

Targets are module paths. Presets (the seeds' sets and ours):

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

from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.rwkv7 import HeadNorm

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


class AdapterError(ValueError):
    """Adapters that cannot be made or applied: the message names the problem."""


def default_targets(model: Model) -> str:
    """The family's preset: RWKV-X ``attn``, RFA ``qwen``, RWKV-7 ``rwkv``."""
    kinds = set(model.config.block_types)
    return "attn" if "moba" in kinds else "qwen" if "qwen2" in kinds else "rwkv"


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
    ``num_layers`` blocks (all when None). AdapterError if it names nothing."""
    n = len(model.layers)
    if num_layers is not None and (type(num_layers) is not int or not 1 <= num_layers <= n):
        raise AdapterError(f"num_layers must be 1..{n} (this model's blocks), got {num_layers}")
    first = n - (num_layers or n)
    found = []
    patterns = [p.strip() for p in targets.split(",") if p.strip()] if targets else []
    if not patterns:
        raise AdapterError(f"no adapter targets given (a preset of {PRESETS} or module globs)")
    for path, _ in _projections(model):
        index = int(path.split(".")[1])
        if index < first:
            continue
        kind = model.layers[index].kind
        inner = path.split(".", 2)[2]
        for pattern in patterns:
            if pattern == "all":
                hit = True
            elif pattern in _PRESETS:
                hit = inner in _PRESETS[pattern].get(kind, ())
            else:
                hit = fnmatch.fnmatchcase(path, pattern)
            if hit:
                found.append(path)
                break
    if not found:
        where = f" in the last {num_layers} blocks" if num_layers else ""
        raise AdapterError(f"adapter targets {targets!r} match no projection{where}")
    return sorted(found, key=lambda p: (int(p.split(".")[1]), p))  # in the model's order


def apply_lora(
    model: Model,
    paths: list[str],
    *,
    rank: int,
    alpha: float,
    dropout: float = 0.0,
    dora: bool = False,
) -> None:
    """Wrap the projections at ``paths`` in mlx-lm's ``LoRALinear`` (``DoRALinear`` with
    ``dora``), scale = alpha / rank, in place. The base is frozen, the adapters trainable."""
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
    model.freeze()
    layer = DoRALinear if dora else LoRALinear
    wrapped = [
        (p, layer.from_base(modules[p], r=rank, dropout=dropout, scale=alpha / rank)) for p in paths
    ]
    model.update_modules(tree_unflatten(wrapped))


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
    """The trained tensors of a LoRA/DoRA/state-tuned model, under their module paths."""
    return {
        name: x
        for name, x in tree_flatten(model.trainable_parameters())
        if name.rsplit(".", 1)[-1] in (*ADAPTER_LEAVES, "state0")
    }


def fingerprint(model: Model) -> str:
    """A short hash of a base model, the same in any of our formats and in float32, bfloat16 or
    INT8 (its architecture, and its norm weights rounded to bfloat16: norms are never
    quantized), and different between bases whose norms differ."""
    h = hashlib.sha256(json.dumps(model.config.to_dict(), sort_keys=True).encode())
    for path, module in sorted(model.named_modules(), key=lambda item: item[0]):
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
            h.update(path.encode())
            h.update(memoryview(module.weight.astype(mx.bfloat16).view(mx.uint16)))
    return h.hexdigest()[:16]
