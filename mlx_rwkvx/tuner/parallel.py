"""``--parallel N``: N LoRA adapters trained at once on one frozen base, each on its own shard of
the data, in one batched forward.

Every adapted projection becomes a ``StackedLoRALinear`` whose ``lora_a [N, in, r]`` and
``lora_b [N, r, out]`` hold the N adapters, all starting from the same init (element-wise
averaging at the end is meaningful only from a common start). A batch holds the N shards' rows
shard after shard (``[N * B, T]``): each row goes through its shard's adapter as a batched
matmul over the leading axis, so the base weights are read once for all N. The loss of shard i
is its own token mean; since shard i's rows reach only adapter i, the gradient of the summed
losses, each slice scaled by its shard's token count and clipped by its own norm, is exactly
what N separate runs compute (AdamW is element-wise).
"""

from __future__ import annotations

from mlx_rwkvx.tuner.adapters import AdapterError

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear


class StackedLoRALinear(nn.Module):
    """N LoRA adapters of one base projection; ``x [N * B, T, in]`` holds shard i's rows at
    ``i * B .. (i + 1) * B``. ``merged = True`` uses their average (FedAvg) for every row."""

    def __init__(self, lora: LoRALinear, n: int):
        super().__init__()
        self.linear = lora.linear
        self.scale, self.dropout, self.n = lora.scale, lora.dropout, n
        self.lora_a = mx.repeat(lora.lora_a[None], n, axis=0)  # [N, in, r], one init for all
        self.lora_b = mx.repeat(lora.lora_b[None], n, axis=0)  # [N, r, out]
        self.merged = False

    def __call__(self, x):
        y = self.linear(x)
        if self.merged:
            z = (self.dropout(x) @ self.lora_a.mean(0)) @ self.lora_b.mean(0)
            return y + (self.scale * z).astype(x.dtype)
        rows = x.shape[0]
        if rows % self.n:
            raise ValueError(f"--parallel {self.n}: a batch of {rows} rows is not N shards")
        shape, dtype = x.shape, x.dtype
        x = self.dropout(x).reshape(self.n, -1, shape[-1])  # [N, B * T, in]
        z = (x @ self.lora_a) @ self.lora_b  # [N, B * T, out]
        return y + (self.scale * z).astype(dtype).reshape(*shape[:-1], -1)


def stack_adapters(model: nn.Module, n: int) -> None:
    """Every ``LoRALinear`` of ``model`` as a ``StackedLoRALinear`` of ``n`` copies, in place
    (the base stays frozen, the stacked adapters trainable)."""
    found = [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]
    if not found:
        raise AdapterError("--parallel needs LoRA adapters to stack")
    model.update_modules(tree_unflatten([(p, StackedLoRALinear(m, n)) for p, m in found]))


def set_merged(model: nn.Module, merged: bool) -> None:
    """Evaluate with the adapters' average (True) or train them side by side (False)."""
    for _, m in model.named_modules():
        if isinstance(m, StackedLoRALinear):
            m.merged = merged


def per_shard(grads, counts: mx.array, clip: float):
    """The summed loss's gradients of N stacked adapters -> each shard's token mean's
    gradients, clipped by each shard's own global norm (as ``optim.clip_grad_norm`` clips one
    run's). Returns (gradients, norms ``[N]`` before clipping)."""
    inv = 1.0 / mx.maximum(counts, 1).astype(mx.float32)  # [N]
    flat = [(k, g * inv.reshape(-1, *([1] * (g.ndim - 1)))) for k, g in tree_flatten(grads)]
    norms = mx.sqrt(sum(mx.sum(mx.square(g), axis=tuple(range(1, g.ndim))) for _, g in flat))
    if clip > 0:
        factor = mx.minimum(clip / (norms + 1e-6), 1.0)
        flat = [(k, g * factor.reshape(-1, *([1] * (g.ndim - 1)))) for k, g in flat]
    return tree_unflatten(flat), norms


def shard_tensors(tensors: dict[str, mx.array], i: int) -> dict[str, mx.array]:
    """Adapter i's tensors (mlx-lm's LoRALinear layout) of the stacked ones."""
    return {name: x[i] for name, x in tensors.items()}


def averaged(tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """FedAvg of the stacked adapters: A and B averaged element-wise."""
    return {name: x.mean(axis=0) for name, x in tensors.items()}


def equal_shards(examples: list, n: int) -> list[list]:
    """The examples split into ``n`` contiguous shards of equal size (the remainder of the
    division left out), as ``pretokenize --split`` splits a data set."""
    size = len(examples) // n
    if size == 0:
        raise ValueError(f"--parallel {n}: {len(examples)} examples cannot make {n} shards")
    return [examples[i * size : (i + 1) * size] for i in range(n)]
