"""``load(path) -> (model, tokenizer)`` for every supported checkpoint, and ``save``.

Loading checks every tensor's name and shape against the model before anything is assigned,
so a bad checkpoint raises one CheckpointError naming the file and the tensor and leaves no
half-loaded model. With ``quantize="int8"`` each large projection is quantized as it is read
(``mx.quantize``, group size 64): no float copy of the base weights exists at any time.
"""

from __future__ import annotations

from mlx_rwkvx.io.formats import CheckpointError, read_checkpoint, write_native
from mlx_rwkvx.io.tokenizers import load_tokenizer
from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.model import GROUP_SIZE, Model, quantizable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

QUANTIZE_BITS = {"int8": 8, "int4": 4}


def _bits(quantize: str | int | None) -> int | None:
    if quantize is None or isinstance(quantize, int):
        return quantize
    if quantize not in QUANTIZE_BITS:
        raise ValueError(
            f"quantize must be one of {sorted(QUANTIZE_BITS)} or None, got {quantize!r}"
        )
    return QUANTIZE_BITS[quantize]


def _check_tensors(path: str, expected: dict, tensors: dict) -> None:
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [
        f"{n} has shape {tuple(tensors[n].shape)}, expected {tuple(expected[n])}"
        for n in sorted(set(expected) & set(tensors))
        if tuple(tensors[n].shape) != tuple(expected[n])
    ]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:8]}" + (" ..." if len(missing) > 8 else ""))
    if unexpected:
        problems.append(
            f"unexpected tensors {unexpected[:8]}" + (" ..." if len(unexpected) > 8 else "")
        )
    if wrong:
        problems.append("; ".join(wrong[:8]))
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))


def _quantized_paths(model: nn.Module) -> set[str]:
    return {p for p, m in model.named_modules() if quantizable(p, m)}


def build(cfg: ModelConfig, *, quantize=None, init: str | None = "seeds", seed: int = 0) -> Model:
    """A model of ``cfg``, optionally quantized. The initial values are only computed (lazily)
    as each layer is quantized, so a quantized random model never holds its float weights."""
    model = Model(cfg, init=init, seed=seed)
    bits = _bits(quantize)
    if bits:
        nn.quantize(model, GROUP_SIZE, bits, class_predicate=quantizable)
        for _, module in model.named_modules():
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                mx.eval(module.parameters())
        mx.eval(model.parameters())
    return model


def load_model(path: str, *, quantize=None, dtype=None) -> Model:
    """The model of any supported checkpoint (see ``mlx_rwkvx.io.formats``)."""
    cfg, tensors, _ = read_checkpoint(path)
    bits = _bits(quantize)
    stored = cfg.quantization
    model = Model(cfg, init=None)  # lazy: its own initial values are never computed
    expected = {n: p.shape for n, p in tree_flatten(model.parameters())}
    if stored:  # a checkpoint saved quantized: its tensors are already (weight, scales, biases)
        nn.quantize(model, stored["group_size"], stored["bits"], class_predicate=quantizable)
        expected = {n: p.shape for n, p in tree_flatten(model.parameters())}
        bits = None
    _check_tensors(path, expected, tensors)
    if dtype is not None:
        tensors = {
            n: x.astype(dtype) if mx.issubdtype(x.dtype, mx.floating) else x
            for n, x in tensors.items()
        }
    if not bits:
        model.load_weights(list(tensors.items()), strict=True)
        mx.eval(model.parameters())
        return model
    targets = _quantized_paths(model)
    nn.quantize(model, GROUP_SIZE, bits, class_predicate=lambda p, m: p in targets)
    modules = dict(model.named_modules())
    for target in sorted(targets):
        w, scales, biases = mx.quantize(tensors.pop(f"{target}.weight"), GROUP_SIZE, bits)
        module = modules[target]
        module.weight, module.scales, module.biases = w, scales, biases
        if f"{target}.bias" in tensors:
            module.bias = tensors.pop(f"{target}.bias")
        mx.eval(module.parameters())  # one layer's float weight at a time, then dropped
    model.load_weights(list(tensors.items()), strict=False)
    mx.eval(model.parameters())
    model.config.quantization = {"group_size": GROUP_SIZE, "bits": bits}
    return model


def load(path: str, *, quantize=None, dtype=None):
    """``(model, tokenizer)`` of a checkpoint in any supported format, detected from the path.

    ``quantize``: None, ``"int8"`` (or ``"int4"``) quantizes the large projections, head and
    embedding as they are read. ``dtype``: cast floating tensors (e.g. ``mx.bfloat16``).
    """
    model = load_model(path, quantize=quantize, dtype=dtype)
    return model, load_tokenizer(path, model.config.vocab_size)


def save(model: Model, path: str) -> None:
    """Save in the native format: a folder, or one ``.safetensors`` file with the config in its
    metadata when ``path`` ends in ``.safetensors``. Atomic (temporary file, then rename)."""
    write_native(path, model.config, dict(tree_flatten(model.parameters())))
