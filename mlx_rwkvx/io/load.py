"""``load(path) -> (model, tokenizer)`` for every supported checkpoint, and ``save``.

Loading checks every tensor's name, shape and dtype against the model before anything is
assigned, so a bad checkpoint raises one CheckpointError naming the file and the tensor and
leaves no half-loaded model. With ``quantize="int8"`` each large projection is quantized as it
is read (``mx.quantize``, group size 64), a big one a block of rows at a time straight from its
safetensors file: no float copy of the base weights exists (a ``.pth`` is unpickled whole).
"""

from __future__ import annotations

import re

from mlx_rwkvx.io.formats import CheckpointError, checkpoint_path, read_checkpoint, write_native
from mlx_rwkvx.io.hub import resolve_model
from mlx_rwkvx.io.tensors import read_rows
from mlx_rwkvx.io.tokenizers import load_tokenizer, tokenizer_files
from mlx_rwkvx.models.init import ROW_BLOCK_BYTES
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.quantize import (
    GROUP_SIZE,
    quantizable,
    quantize_bits,
    quantize_model,
    quantize_modules,
)

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


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


class _RowBlock:
    """Rows ``start:stop`` of a stored tensor, read from disk only when quantized."""

    def __init__(self, file, name, start, stop, like):
        self.args = (file, name, start, stop)
        self.shape = (stop - start, *like.shape[1:])

    def read(self) -> mx.array:
        return read_rows(*self.args)


def _row_blocks(ckpt, name: str) -> list:
    """One stored weight as blocks of rows: read from disk block by block when it is stored as
    is in a safetensors file and big, else whole."""
    w = ckpt.tensors.pop(name)
    rows = w.shape[0]
    step = max(1, ROW_BLOCK_BYTES // (w.size // rows * w.itemsize))
    if name not in ckpt.sources or rows <= step:
        return [w]
    file, stored = ckpt.sources[name]
    return [_RowBlock(file, stored, a, min(rows, a + step), w) for a in range(0, rows, step)]


def load_model(path, *, quantize=None, dtype=None) -> Model:
    """The model of any supported checkpoint (see ``mlx_rwkvx.io.formats``)."""
    bits = quantize_bits(quantize)
    dtype = float_dtype(dtype)
    path = checkpoint_path(resolve_model(path))
    return _model_of(path, read_checkpoint(path), bits, quantize, dtype)


def model_as_loaded(path, *, quantize=None, dtype=None) -> Model:
    """The model ``load_model`` makes of ``path``, its parameters lazy and never computed: their
    shapes, dtypes and quantization, for estimating memory before loading (the config and the
    tensors' dtypes are read, no tensor's data; a ``.pth``'s from its pickle alone)."""
    bits = quantize_bits(quantize)
    dtype = float_dtype(dtype)
    path = checkpoint_path(resolve_model(path))
    ckpt = read_checkpoint(path, shapes_only=True)
    model = Model(ckpt.config, init=None)
    floats = [x.dtype for x in ckpt.tensors.values() if _floating(x)]
    most = max(set(floats), key=floats.count) if floats else mx.float32
    model.set_dtype(dtype or (mx.float32 if most == mx.float64 else most))
    stored = ckpt.quantization
    if stored:
        quantize_modules(
            model, stored["group_size"], stored["bits"], quantizable(stored["group_size"])
        )
    elif bits:
        quantize_modules(model, GROUP_SIZE, bits, quantizable(GROUP_SIZE))
    return model


def read_model(path, *, dtype=None, tokenizer: bool = True) -> tuple[Model, object]:
    """``(model, tokenizer)`` of any supported checkpoint with the model's tensors lazy: checked
    against the model (names, shapes, dtypes) and cast to ``dtype``, but never computed; each is
    read from its file when evaluated (a ``.pth`` is read whole). For writing a model a tensor
    at a time: nothing else holds them. Not checked for NaN or infinite values (``load`` is).
    ``tokenizer=False``: the tokenizer is None."""
    dtype = float_dtype(dtype)
    path = checkpoint_path(resolve_model(path))
    ckpt = read_checkpoint(path)
    found = _tokenizer_of(path, ckpt) if tokenizer else None
    model, _ = _unevaluated(path, ckpt, None, None, dtype)
    model.load_weights(list(ckpt.tensors.items()), strict=True)
    return model, found


def _unevaluated(path: str, ckpt, bits: int | None, quantize, dtype) -> tuple[Model, int | None]:
    """The model of ``ckpt`` without its weights, quantized as stored, the checkpoint's tensors
    checked against it and cast (in ``ckpt.tensors``); the bits still to quantize to."""
    cfg, tensors = ckpt.config, ckpt.tensors
    stored = ckpt.quantization
    if stored and bits and bits != stored["bits"]:
        raise CheckpointError(
            f"{path}: the checkpoint is stored in {stored['bits']}-bit; it cannot be loaded "
            f"as {quantize!r} (load it without quantize, or convert its float original)"
        )
    model = Model(cfg, init=None)  # lazy: its own initial values are never computed
    for name in tensors:  # a state-tuned model: its blocks carry a trainable initial state
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "layers" and parts[2:] == ["tmix", "state0"]:
            index = int(parts[1]) if parts[1].isdigit() else -1
            if 0 <= index < len(model.layers) and model.layers[index].kind == "rwkv7":
                model.layers[index].tmix.enable_state_tuning()
            # any other is reported below as an unexpected tensor
    if stored:  # a checkpoint saved quantized: its tensors are already (weight, scales, biases)
        group, bits_ = stored["group_size"], stored["bits"]
        quantize_modules(model, group, bits_, quantizable(group))
        bits = None
    _check_tensors(path, dict(tree_flatten(model.parameters())), tensors)
    cast = {n for n, x in tensors.items() if x.dtype == mx.float64 or (dtype and _floating(x))}
    if cast:
        for n in cast:
            ckpt.sources.pop(n, None)  # cast tensors are no longer as stored
            tensors[n] = tensors[n].astype(dtype or mx.float32)
    return model, bits


def _model_of(path: str, ckpt, bits: int | None, quantize, dtype) -> Model:
    model, bits = _unevaluated(path, ckpt, bits, quantize, dtype)
    tensors = ckpt.tensors
    if not bits:
        model.load_weights(list(tensors.items()), strict=True)
        _eval_finite(path, model)
        return model

    def read(layer: str, module):
        if f"{layer}.bias" in tensors:  # the float bias goes with the layer into quantization
            module.bias = tensors.pop(f"{layer}.bias")
        return _row_blocks(ckpt, f"{layer}.weight")

    quantize_model(model, bits, GROUP_SIZE, read)
    model.load_weights(list(tensors.items()), strict=False)
    _eval_finite(path, model, quantized=True)
    # the float rows read and quantized were freed into MLX's buffer pool, in sizes nothing
    # later asks for (measured on 4 blocks of the 1.5B RFA, INT8 LoRA at T = 256: 0.23 GB of
    # the training process's resident peak, 1.54 -> 1.31 GB): given back
    mx.clear_cache()
    return model


def _eval_finite(path: str, model: Model, quantized: bool = False) -> None:
    """Evaluate the loaded parameters, and refuse (CheckpointError naming the tensor) a
    floating one holding NaN or infinite values: such a model answers junk or NaN losses.
    Cheap: one sum per tensor, evaluated with the loading itself (a NaN or an infinity makes
    the sum so; 4x faster than ``isfinite().all()`` on a CPU, 0.26 s for 1.2 GB here), and
    the exact test only for a tensor whose sum is not finite (a float16 one may overflow).
    A weight quantized as it was read is checked through its scales and biases, and named
    as stored (``quantized``)."""
    floating = [(n, x) for n, x in tree_flatten(model.parameters()) if _floating(x)]
    if not floating:
        mx.eval(model.parameters())
        return
    sums = mx.stack([mx.sum(x).astype(mx.float32) for _, x in floating])
    mx.eval(model.parameters(), sums)
    suspects = [floating[i] for i in np.flatnonzero(~np.isfinite(np.array(sums)))]
    bad = [n for n, x in suspects if not mx.isfinite(x).all().item()]
    if quantized:  # the stored tensor, not the scales and biases made of it
        bad = list(dict.fromkeys(re.sub(r"\.(scales|biases)\Z", ".weight", n) for n in bad))
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        raise CheckpointError(f"{path}: {bad[0]} holds NaN or infinite values{more}")


def _floating(x: mx.array) -> bool:
    return mx.issubdtype(x.dtype, mx.floating)


def load(path, *, quantize=None, dtype=None, tokenizer: bool = True):
    """``(model, tokenizer)`` of a checkpoint in any supported format, detected from the path.

    ``quantize``: None, ``"int8"`` (or ``"int4"``) quantizes the large projections, head and
    embedding as they are read (a checkpoint stored quantized loads as it is; asking for other
    bits is an error). ``dtype``: cast floating tensors (``mx.bfloat16`` or ``"bfloat16"``).
    ``tokenizer=False``: the tokenizer is None (for code that brings its own; ``load_model``
    likewise). Raises CheckpointError (a ValueError) naming the file and the problem.
    """
    bits = quantize_bits(quantize)
    dtype = float_dtype(dtype)
    path = checkpoint_path(resolve_model(path))
    ckpt = read_checkpoint(path)  # the config and lazy tensors: the tokenizer is found first
    found = _tokenizer_of(path, ckpt) if tokenizer else None
    return _model_of(path, ckpt, bits, quantize, dtype), found


def _tokenizer_of(path: str, ckpt):
    """The checkpoint's tokenizer; CheckpointError naming what is wrong with it."""
    try:
        return load_tokenizer(path, ckpt.config.vocab_size)
    except ValueError as e:
        raise CheckpointError(str(e)) from e


def save(model: Model, path, *, tokenizer=None, overwrite: bool = False) -> None:
    """Save in the native format: a folder, or one ``.safetensors`` file with the config in its
    metadata when ``path`` ends in ``.safetensors``; ``tokenizer``'s files (``load`` returns
    it) are copied beside the weights. Atomic (temporary name, then rename); an existing
    checkpoint at ``path`` is replaced only with ``overwrite=True``."""
    if not isinstance(model, Model):
        raise TypeError(f"save: expected an mlx_rwkvx Model, got {type(model).__name__}")
    tensors = dict(tree_flatten(model.parameters()))
    if any(n.endswith((".lora_a", ".lora_b")) for n in tensors):
        raise CheckpointError(
            f"{checkpoint_path(path)}: the model holds LoRA/DoRA adapters; fuse them first "
            "(mlx_rwkvx.adapters.fuse.fuse_adapters) or save the adapter itself"
        )
    write_native(
        path,
        model.config,
        tensors,
        quantization=model.quantization,
        extra_files=tokenizer_files(tokenizer),
        overwrite=overwrite,
    )
