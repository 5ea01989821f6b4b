"""INT8 (and INT4) weights: what is quantized, and the one path that quantizes a model, layer
by layer, from its own weights or from blocks of rows drawn or read one at a time (so that no
float copy of a big matrix exists: a seeded init, a checkpoint read row-wise)."""

from __future__ import annotations

from collections.abc import Callable

from mlx_rwkvx.ops.quantized import quantized_matmul

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

QUANTIZE_BITS = {"int8": 8, "int4": 4}


def quantize_bits(quantize) -> int | None:
    """``None``, ``"int8"``/``"int4"`` (or 8/4) -> bits. Anything else is a ValueError (a bare
    ``True`` would otherwise read as 1 bit)."""
    if quantize is None:
        return None
    if isinstance(quantize, str) and quantize in QUANTIZE_BITS:
        return QUANTIZE_BITS[quantize]
    if type(quantize) is int and quantize in QUANTIZE_BITS.values():
        return quantize
    raise ValueError(
        f"quantize must be one of {sorted(QUANTIZE_BITS)} (or 8, 4) or None, got {quantize!r}"
    )


GROUP_SIZE = 64
HALF = (mx.bfloat16, mx.float16)


def _on_cpu() -> bool:
    return mx.default_device().type == mx.cpu


class QuantizedLinear(nn.QuantizedLinear):
    """``nn.QuantizedLinear`` whose product on the CPU is ``ops.quantized.quantized_matmul``'s
    (float32 tiles through BLAS from 16 rows of input), half-precision inputs multiplied in
    float32.

    MLX's CPU quantized matmul accumulates bf16/f16 inputs in that type: 4-10% off the exact
    product at widths 1536-8960, where a dense bf16 matmul is 0.2% off, and ~8x slower than the
    same product in float32 (mlx 0.32; Metal's accumulates in float32 already, so the GPU path
    is MLX's own). The output keeps the input's dtype."""

    def __call__(self, x: mx.array) -> mx.array:
        if not _on_cpu():
            return super().__call__(x)
        y = _product(self, x.astype(mx.float32) if x.dtype in HALF else x)
        if "bias" in self:
            y = y + self["bias"]
        return y.astype(x.dtype)


class QuantizedEmbedding(nn.QuantizedEmbedding):
    """``nn.QuantizedEmbedding`` whose use as a tied head multiplies as ``QuantizedLinear``
    does on the CPU."""

    def as_linear(self, x: mx.array) -> mx.array:
        if not _on_cpu():
            return super().as_linear(x)
        x32 = x.astype(mx.float32) if x.dtype in HALF else x
        return _product(self, x32).astype(x.dtype)


def _product(layer: nn.QuantizedLinear | nn.QuantizedEmbedding, x: mx.array) -> mx.array:
    """``x`` times the transposed quantized weight of ``layer``."""
    weight, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    return quantized_matmul(
        x, weight, scales, biases, group_size=layer.group_size, bits=layer.bits, mode=layer.mode
    )


_OURS = {nn.QuantizedLinear: QuantizedLinear, nn.QuantizedEmbedding: QuantizedEmbedding}


def quantize_modules(model: nn.Module, group_size: int, bits: int, predicate) -> None:
    """``nn.quantize`` of the modules ``predicate(path, module)`` picks, as the classes above
    (subclasses of MLX's: mlx-lm's LoRA layers and ``isinstance`` checks take them as they
    are)."""
    nn.quantize(model, group_size, bits, class_predicate=predicate)
    use_our_classes(model)


def use_our_classes(model: nn.Module) -> None:
    """Every ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` of ``model`` becomes ours (the
    same fields, one method more: the class is swapped in place), also after code that makes
    MLX's own, such as mlx-lm's ``LoRALinear.fuse``."""
    for _, module in model.named_modules():
        if type(module) in _OURS:
            module.__class__ = _OURS[type(module)]


# RWKV-7's low-rank projections are small and sensitive: they stay in floating point
_LOW_RANK = (".decay.", ".iclr.", ".value_mix.", ".gate.")


def quantizable(group_size: int = GROUP_SIZE):
    """The predicate ``(path, module) -> bool`` of what is quantized: every large projection,
    the head and the embedding whose input width is a multiple of ``group_size``; not RWKV-7's
    low-rank matrices."""

    def predicate(path: str, module: nn.Module) -> bool:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return False
        if any(s in path for s in _LOW_RANK):
            return False
        return module.weight.shape[-1] % group_size == 0

    return predicate


def quantize_blocks(blocks: list, bits: int, group_size: int = GROUP_SIZE):
    """``mx.quantize`` of a matrix given as blocks of rows (arrays, or objects with ``shape``
    and ``read()`` that load theirs when its turn comes), one block at a time into preallocated
    outputs, each float block dropped once done (quantization groups lie within rows: the same
    result as quantizing the whole). Returns (weight, scales, biases)."""
    rows = sum(b.shape[0] for b in blocks)
    out, start = None, 0
    for i in range(len(blocks)):
        block, blocks[i] = blocks[i], None
        if not isinstance(block, mx.array):
            block = block.read()
        parts = mx.quantize(block, group_size, bits)
        if out is None:
            out = [mx.zeros((rows, *p.shape[1:]), dtype=p.dtype) for p in parts]
        n = block.shape[0]
        for o, p in zip(out, parts, strict=True):
            o[start : start + n] = p  # in place: the output is its only reference
        mx.eval(out)
        start += n
        del block, parts
    return tuple(out)


def quantize_model(
    model: nn.Module,
    bits: int,
    group_size: int = GROUP_SIZE,
    weights: Callable[[str, nn.Module], list | None] | None = None,
) -> nn.Module:
    """Quantize ``model``'s large projections, head and embedding in place (``quantizable``),
    one layer at a time. ``weights(path, module)``, asked before anything changes, gives that
    layer's float weight as blocks of rows (see ``quantize_blocks``), or None for the module's
    own weight. Returns the model."""
    predicate = quantizable(group_size)
    targets = {p for p, m in model.named_modules() if predicate(p, m)}
    sources = {p: weights(p, m) for p, m in model.named_modules() if p in targets and weights}
    quantize_modules(model, group_size, bits, lambda p, m: p in targets)
    for path, module in model.named_modules():
        if path not in targets:
            continue
        if sources.get(path) is not None:
            blocks = sources.pop(path)
            module.weight, module.scales, module.biases = quantize_blocks(blocks, bits, group_size)
        mx.eval(module.parameters())  # one layer's float weight at a time, then dropped
    return model


def quantize_tensors(
    model: nn.Module, tensors: dict[str, mx.array], bits: int, group_size: int = GROUP_SIZE
) -> dict:
    """Quantize ``tensors`` (``model``'s flattened parameters, lazy or not) in place: each
    layer ``quantize_model`` would quantize has its weight replaced by the ``weight``,
    ``scales`` and ``biases`` of ``mx.quantize``, still lazy, so that a writer evaluating one
    tensor at a time holds one float weight at a time. The same values as ``quantize_model``'s
    (``model`` itself is only read for its layers). Returns ``{"group_size", "bits"}``."""
    predicate = quantizable(group_size)
    for path, module in model.named_modules():
        if predicate(path, module):
            w = tensors.pop(f"{path}.weight")
            parts = mx.quantize(w, group_size, bits)
            tensors.update(zip((f"{path}.{n}" for n in _PARTS), parts, strict=True))
    return {"group_size": group_size, "bits": bits}


_PARTS = ("weight", "scales", "biases")  # what mx.quantize returns, in its order


def dequantize_model(model: nn.Module) -> nn.Module:
    """Every quantized layer of ``model`` back to float (its dequantized weights, in the dtype
    of its scales), in place. Returns the model."""
    swapped = []
    for path, m in model.named_modules():
        if isinstance(m, nn.QuantizedLinear):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            out, inp = w.shape
            layer = nn.Linear(inp, out, bias="bias" in m)
            layer.weight = w
            if "bias" in m:
                layer.bias = m.bias
            swapped.append((path, layer))
        elif isinstance(m, nn.QuantizedEmbedding):
            w = mx.dequantize(m.weight, m.scales, m.biases, m.group_size, m.bits)
            layer = nn.Embedding(*w.shape)
            layer.weight = w
            swapped.append((path, layer))
    if swapped:
        model.update_modules(tree_unflatten(swapped))
        mx.eval(model.parameters())
    return model
