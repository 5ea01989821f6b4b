"""``load(path) -> (model, tokenizer)`` for every supported checkpoint, and ``save``.

Loading checks every tensor's name and shape against the model before anything is assigned,
so a bad checkpoint raises one CheckpointError naming the file and the tensor and leaves no
half-loaded model. With ``quantize="int8"`` each large projection is quantized as it is read
(``mx.quantize``, group size 64), a big one a block of rows at a time straight from its
safetensors file: no float copy of the base weights exists (a ``.pth`` is unpickled whole).
"""

from __future__ import annotations

from mlx_rwkvx.io.formats import (
    CheckpointError,
    checkpoint_path,
    read_checkpoint,
    read_rows,
    write_native,
)
from mlx_rwkvx.io.tokenizers import load_tokenizer, tokenizer_files
from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.init import ROW_BLOCK_BYTES, seeds_scale, uniform_row_blocks
from mlx_rwkvx.models.model import GROUP_SIZE, Model, quantizable

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

QUANTIZE_BITS = {"int8": 8, "int4": 4}
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


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


def float_dtype(dtype) -> mx.Dtype | None:
    """None, an MLX floating dtype or its name (``"bfloat16"``) -> the dtype; else ValueError."""
    if dtype is None:
        return None
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"dtype must be one of {sorted(DTYPES)} or None, got {dtype!r}")


def _kind(dtype) -> str:
    return "floating" if mx.issubdtype(dtype, mx.floating) else str(dtype)


def _check_tensors(path: str, expected: dict, tensors: dict) -> None:
    """Names, shapes and dtypes of ``tensors`` against ``expected`` (name -> parameter): one
    CheckpointError listing what does not fit. A floating parameter takes any floating dtype
    (float64 is cast to float32 on loading); a quantized weight must be uint32."""
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    common = sorted(set(expected) & set(tensors))
    wrong = [
        f"{n} has shape {tuple(tensors[n].shape)}, expected {tuple(expected[n].shape)}"
        for n in common
        if tuple(tensors[n].shape) != tuple(expected[n].shape)
    ]
    wrong += [
        f"{n} has dtype {tensors[n].dtype}, expected {_kind(expected[n].dtype)}"
        for n in common
        if _kind(tensors[n].dtype) != _kind(expected[n].dtype)
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
    predicate = quantizable(GROUP_SIZE)
    return {p for p, m in model.named_modules() if predicate(p, m)}


def build(cfg: ModelConfig, *, quantize=None, init: str | None = "seeds", seed: int = 0) -> Model:
    """A model of ``cfg`` with a fresh init, optionally quantized layer by layer: with the
    seeds' init a big matrix is even drawn and quantized a block of rows at a time, so a
    quantized random model never holds its float weights (the 1.5B preset fits in ~2 GB)."""
    model = Model(cfg, init=init, seed=seed)  # lazy: nothing is computed yet
    bits = quantize_bits(quantize)
    if not bits:
        mx.eval(model.parameters())
        return model
    targets = _quantized_paths(model)
    scales = {p: seeds_scale(m, "weight") for p, m in model.named_modules() if p in targets}
    nn.quantize(model, GROUP_SIZE, bits, class_predicate=lambda p, m: p in targets)
    for path, module in model.named_modules():
        if path not in targets:
            continue
        if init == "seeds":
            scale, offset = scales[path]
            blocks = uniform_row_blocks(seed, f"{path}.weight", _shape(module), scale, offset)
            module.weight, module.scales, module.biases = _quantize_blocks(blocks, bits)
        mx.eval(module.parameters())
    mx.eval(model.parameters())
    model.config.quantization = {"group_size": GROUP_SIZE, "bits": bits}
    return model


def _quantize_blocks(blocks: list, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """Quantize row blocks (arrays, or ``_RowBlock``s read from disk when their turn comes) one
    at a time into preallocated outputs, dropping each float block once it is done."""
    rows = sum(b.shape[0] for b in blocks)
    out, start = None, 0
    for i in range(len(blocks)):
        block, blocks[i] = blocks[i], None
        if isinstance(block, _RowBlock):
            block = block.read()
        parts = mx.quantize(block, GROUP_SIZE, bits)
        if out is None:
            out = [mx.zeros((rows, *p.shape[1:]), dtype=p.dtype) for p in parts]
        n = block.shape[0]
        for o, p in zip(out, parts, strict=True):
            o[start : start + n] = p  # in place: the output is its only reference
        mx.eval(out)
        start += n
        del block, parts
    return tuple(out)


def _shape(module: nn.Module) -> tuple[int, int]:
    """The float weight shape of a quantized module: rows and (packed) input dims unpacked."""
    rows, packed = module.weight.shape
    return rows, packed * 32 // module.bits


def _quantize_weight(ckpt, name: str, bits: int) -> tuple[mx.array, mx.array, mx.array]:
    """``mx.quantize`` of one weight; a big one stored as is in a safetensors file is read and
    quantized a block of rows at a time (quantization groups lie within rows: same result)."""
    w = ckpt.tensors.pop(name)
    rows = w.shape[0]
    step = max(1, ROW_BLOCK_BYTES // (w.size // rows * w.itemsize))
    if name not in ckpt.sources or rows <= step:
        return mx.quantize(w, GROUP_SIZE, bits)
    file, stored = ckpt.sources[name]
    blocks = [_RowBlock(file, stored, a, min(rows, a + step), w) for a in range(0, rows, step)]
    return _quantize_blocks(blocks, bits)


class _RowBlock:
    """Rows ``start:stop`` of a stored tensor, read from disk only when quantized."""

    def __init__(self, file, name, start, stop, like):
        self.args = (file, name, start, stop)
        self.shape = (stop - start, *like.shape[1:])

    def read(self) -> mx.array:
        return read_rows(*self.args)


def load_model(path, *, quantize=None, dtype=None) -> Model:
    """The model of any supported checkpoint (see ``mlx_rwkvx.io.formats``)."""
    bits = quantize_bits(quantize)
    dtype = float_dtype(dtype)
    path = checkpoint_path(path)
    ckpt = read_checkpoint(path)
    cfg, tensors = ckpt.config, ckpt.tensors
    stored = cfg.quantization
    if stored and bits and bits != stored["bits"]:
        raise CheckpointError(
            f"{path}: the checkpoint is stored in {stored['bits']}-bit; it cannot be loaded "
            f"as {quantize!r} (load it without quantize, or convert its float original)"
        )
    model = Model(cfg, init=None)  # lazy: its own initial values are never computed
    for name in tensors:  # a state-tuned model: its blocks carry a trainable initial state
        if name.endswith(".tmix.state0"):
            model.layers[int(name.split(".")[1])].tmix.enable_state_tuning()
    if stored:  # a checkpoint saved quantized: its tensors are already (weight, scales, biases)
        group, bits_ = stored["group_size"], stored["bits"]
        nn.quantize(model, group, bits_, class_predicate=quantizable(group))
        bits = None
    _check_tensors(path, dict(tree_flatten(model.parameters())), tensors)
    cast = {n for n, x in tensors.items() if x.dtype == mx.float64 or (dtype and _floating(x))}
    if cast:
        for n in cast:
            ckpt.sources.pop(n, None)  # cast tensors are no longer as stored
            tensors[n] = tensors[n].astype(dtype or mx.float32)
    if not bits:
        model.load_weights(list(tensors.items()), strict=True)
        mx.eval(model.parameters())
        return model
    targets = _quantized_paths(model)
    nn.quantize(model, GROUP_SIZE, bits, class_predicate=lambda p, m: p in targets)
    modules = dict(model.named_modules())
    for target in sorted(targets):
        module = modules[target]
        module.weight, module.scales, module.biases = _quantize_weight(
            ckpt, f"{target}.weight", bits
        )
        if f"{target}.bias" in tensors:
            module.bias = tensors.pop(f"{target}.bias")
        mx.eval(module.parameters())  # one layer's float weight at a time, then dropped
    model.load_weights(list(tensors.items()), strict=False)
    mx.eval(model.parameters())
    model.config.quantization = {"group_size": GROUP_SIZE, "bits": bits}
    return model


def _floating(x: mx.array) -> bool:
    return mx.issubdtype(x.dtype, mx.floating)


def load(path, *, quantize=None, dtype=None):
    """``(model, tokenizer)`` of a checkpoint in any supported format, detected from the path.

    ``quantize``: None, ``"int8"`` (or ``"int4"``) quantizes the large projections, head and
    embedding as they are read (a checkpoint stored quantized loads as it is; asking for other
    bits is an error). ``dtype``: cast floating tensors (``mx.bfloat16`` or ``"bfloat16"``).
    Raises CheckpointError (a ValueError) naming the file and the problem.
    """
    model = load_model(path, quantize=quantize, dtype=dtype)
    try:
        tokenizer = load_tokenizer(checkpoint_path(path), model.config.vocab_size)
    except ValueError as e:
        raise CheckpointError(str(e)) from e
    return model, tokenizer


def save(model: Model, path, *, tokenizer=None, overwrite: bool = False) -> None:
    """Save in the native format: a folder, or one ``.safetensors`` file with the config in its
    metadata when ``path`` ends in ``.safetensors``; ``tokenizer``'s files (``load`` returns
    it) are copied beside the weights. Atomic (temporary name, then rename); an existing
    checkpoint at ``path`` is replaced only with ``overwrite=True``."""
    if not isinstance(model, Model):
        raise TypeError(f"save: expected an mlx_rwkvx Model, got {type(model).__name__}")
    write_native(
        path,
        model.config,
        dict(tree_flatten(model.parameters())),
        extra_files=tokenizer_files(tokenizer),
        overwrite=overwrite,
    )
