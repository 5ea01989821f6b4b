"""``--parallel N`` (rfa_train's): N LoRA adapters trained at once on one frozen base, each on
its own part of the data, in one batched forward: the stacked adapters, the loss and update of
a stack, batches of the N parts side by side, evaluation with their average, and the
``thread_<i>`` files (rfa_train's name) with their FedAvg as ``adapter_final``.

Every adapted projection becomes a ``StackedLoRALinear`` whose ``lora_a [N, in, r]`` and
``lora_b [N, r, out]`` hold the N adapters, all from one init (element-wise averaging at the
end is meaningful only from a common start). A batch holds the N parts' rows one part after the
other (``[N * B, T]``): each row goes through its adapter in a batched matmul over the leading
axis, so the base weights are read once for all N. Adapter i's loss is its own token mean, and
since part i's rows reach only adapter i, the gradient of the summed losses, each slice scaled
by its part's token count and clipped by its own norm, is what N separate runs compute (AdamW
is element-wise).
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager

from mlx_rwkvx._mlx_lm import LoRALinear
from mlx_rwkvx.adapters.files import FINAL_ADAPTER, save_adapter_tensors
from mlx_rwkvx.adapters.tensors import adapter_tensors
from mlx_rwkvx.data.examples import IGNORE_INDEX
from mlx_rwkvx.data.loss import token_loss
from mlx_rwkvx.errors import AdapterError, TrainError

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten


class StackedLoRALinear(nn.Module):
    """N LoRA adapters of one base projection; ``x [N * B, T, in]`` holds part i's rows at
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
            raise ValueError(f"--parallel {self.n}: a batch of {rows} rows is not N parts")
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


@contextmanager
def merged(model: nn.Module):
    """Within the block every stacked adapter computes with the adapters' average (FedAvg):
    what ``adapter_final`` will be, and what validation measures."""
    stacked = [m for _, m in model.named_modules() if isinstance(m, StackedLoRALinear)]
    for m in stacked:
        m.merged = True
    try:
        yield
    finally:
        for m in stacked:
            m.merged = False


class Stacked:
    """How a step trains a stack of ``n`` adapters (the trainer's ``Single`` trains one): the
    summed losses with each adapter's token count, and each adapter's mean gradient clipped
    by its own norm."""

    def __init__(self, n: int):
        self.n = n

    def loss_sum(self, model, inputs, targets, before, checkpoint: bool):
        """(summed losses, token counts ``[n]``, None): rows part after part."""
        h, _ = model.hidden(inputs, None, checkpoint=checkpoint)
        rows = inputs.shape[0] // self.n
        total, counts = 0.0, []
        for i in range(self.n):
            part = slice(i * rows, (i + 1) * rows)
            loss, count = token_loss(model, h[part], targets[part])
            total, counts = total + loss, counts + [count]
        return total, mx.stack(counts), None

    def mean_grads(self, grads, counts: mx.array, clip: float):
        """(each adapter's mean gradient clipped by its own norm, the largest norm before
        clipping)."""
        grads, norms = per_stack(grads, counts, clip)
        return grads, mx.max(norms)


def per_stack(grads, counts: mx.array, clip: float):
    """The summed loss's gradients of N stacked adapters -> each adapter's token mean's
    gradients, clipped by its own global norm (as ``optim.clip_grad_norm`` clips one run's).
    Returns (gradients, norms ``[N]`` before clipping)."""
    inv = 1.0 / mx.maximum(counts, 1).astype(mx.float32)  # [N]
    flat = [(k, g * inv.reshape(-1, *([1] * (g.ndim - 1)))) for k, g in tree_flatten(grads)]
    norms = mx.sqrt(sum(mx.sum(mx.square(g), axis=tuple(range(1, g.ndim))) for _, g in flat))
    if clip > 0:
        factor = mx.minimum(clip / (norms + 1e-6), 1.0)
        flat = [(k, g * factor.reshape(-1, *([1] * (g.ndim - 1)))) for k, g in flat]
    return tree_unflatten(flat), norms


def side_by_side(batches, rows: int):
    """The N parts' batches as one: each padded to ``rows`` rows and the longest length (rows
    and columns that the loss skips; a recurrent row's padding after it changes nothing)."""
    T = max(x.shape[1] for x, _ in batches)
    inputs = np.zeros((len(batches) * rows, T), dtype=np.int32)
    targets = np.full((len(batches) * rows, T), IGNORE_INDEX, dtype=np.int32)
    for i, (x, y) in enumerate(batches):
        inputs[i * rows : i * rows + x.shape[0], : x.shape[1]] = x
        targets[i * rows : i * rows + y.shape[0], : y.shape[1]] = y
    return inputs, targets


def write_threads(out, model: nn.Module, config: dict, tokens: list[int]) -> None:
    """rfa_train's outputs: adapter i as ``thread_<i>.safetensors`` (its own token count in its
    config) and their FedAvg as ``adapter_final.safetensors``."""
    stacked = adapter_tensors(model)
    n = len(tokens)
    for i in range(n):
        thread = {**config, "parallel": n, "thread": i, "tokens_trained": tokens[i]}
        one = {name: x[i] for name, x in stacked.items()}
        save_adapter_tensors(os.path.join(out, f"thread_{i}.safetensors"), one, thread)
    averaged = {name: x.mean(axis=0) for name, x in stacked.items()}
    save_adapter_tensors(os.path.join(out, FINAL_ADAPTER), averaged, config)


def parts(examples: list, n: int) -> list[list]:
    """The examples as ``n`` equal parts, one an adapter (``[examples]`` for one adapter); the
    remainder of the division is left out, and said."""
    if n == 1:
        return [examples]
    try:
        split = equal_parts(examples, n)
    except ValueError as e:
        raise TrainError(str(e)) from e
    left = len(examples) - n * len(split[0])
    if left:
        print(
            f"note: --parallel {n}: {left} of {len(examples)} examples left out (the "
            "parts are equal: the remainder of the division)",
            file=sys.stderr,
        )
    return split


def equal_parts(examples: list, n: int) -> list[list]:
    """The examples split into ``n`` contiguous parts of equal size (the remainder of the
    division left out), as ``pretokenize --split`` splits a data set."""
    size = len(examples) // n
    if size == 0:
        raise ValueError(f"--parallel {n}: {len(examples)} examples cannot make {n} parts")
    return [examples[i * size : (i + 1) * size] for i in range(n)]
