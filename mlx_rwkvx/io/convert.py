"""Converting a checkpoint between formats (``python -m mlx_rwkvx.convert``): read any format
``load`` reads, optionally make an RFA model of a Qwen2 one or quantize, and write ``native``,
``hf``, ``blinkdl`` or ``rwkvx`` with the tokenizer's files beside the weights. Entry point:
``convert``.

The model passes a tensor at a time: read lazily, renamed, cast and quantized lazily, each
tensor computed only when the writer comes to it and dropped once written, so that converting
a model never holds it whole (the peak is about its largest tensor). MLX reads no tensor lazily
from a ``.pth`` (a zip): its tensors are first copied one at a time into a temporary
``.safetensors`` beside DST (as large as the ``.pth``, removed when done), then read lazily from
it."""

from __future__ import annotations

import math
import os
import re
import tempfile

from mlx_rwkvx.errors import CheckpointError, UsageError
from mlx_rwkvx.io.atomic import check_target
from mlx_rwkvx.io.detect import checkpoint_path, is_checkpoint
from mlx_rwkvx.io.formats import write_blinkdl, write_hf, write_native, write_rwkvx
from mlx_rwkvx.io.hub import resolve_model
from mlx_rwkvx.io.load import read_model
from mlx_rwkvx.io.targets import (
    make_parents,
    output_lock,
    remove_empty,
    remove_path,
    remove_stale,
    resolve_target,
    temp_path,
)
from mlx_rwkvx.io.tensors import stage_pth
from mlx_rwkvx.io.tokenizers import (
    ByteTokenizer,
    byte_tokenizer_files,
    load_tokenizer,
    tokenizer_files,
)
from mlx_rwkvx.models.config import default_qwen_layers
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.models.quantize import GROUP_SIZE, quantize_bits, quantize_tensors
from mlx_rwkvx.models.rfa import qwen2_to_rfa

import mlx.core as mx
from mlx.utils import tree_flatten

WRITERS = {
    "native": write_native,
    "hf": write_hf,
    "blinkdl": write_blinkdl,
    "rwkvx": write_rwkvx,
}
SINGLE_FILES = (".safetensors", ".pth")  # what a DST that is not a folder ends with
STAGED = ".source.safetensors"  # a .pth source's tensors, beside DST while it is written


def convert(
    src,
    dst,
    *,
    to: str = "native",
    quantize=None,
    dtype=None,
    to_rfa: bool = False,
    qwen_layers=None,
    head_size: int | None = None,
    overwrite: bool = False,
) -> Model | None:
    """Read ``src``, transform, write ``dst`` with the tokenizer files of ``src`` beside the
    weights, a tensor at a time; returns the written model, its tensors read from ``dst`` when
    used (None for a ``.pth`` DST, which is read whole). A tensor holding NaN or infinite
    values is refused. An existing ``dst`` is replaced only with ``overwrite``, and only when
    it is a checkpoint; a ``dst`` that is, holds or lies inside
    ``src``, or would replace the current folder, is refused. ``head_size`` (default 64) and
    ``qwen_layers`` go with ``to_rfa``. While it runs, ``dst`` is locked (``io/targets.py``): a
    second conversion into it is refused. Raises CheckpointError, TargetError or UsageError
    (UserErrors) naming the problem."""
    if to not in WRITERS:
        raise UsageError(f"--to must be one of {sorted(WRITERS)}, got {to!r}")
    if not to_rfa and (head_size is not None or qwen_layers is not None):
        given = "--head-size" if head_size is not None else "--qwen-layers"
        raise UsageError(f"{given} sets up --to-rfa: it needs --to-rfa")
    bits = quantize_bits(quantize)
    if bits and to != "native":
        raise UsageError("--quantize writes INT8 weights, which only the native format holds")
    src = resolve_model(src)  # a Hugging Face name: its snapshot in the hub's cache
    real = resolve_target(dst, what="DST", inputs=[src])
    with output_lock(real, "DST"):
        folder, name = os.path.split(real)
        remove_stale(folder, name)
        remove_stale(folder, name + STAGED)  # a .pth's copy left by a killed conversion
        # the target first: a conversion that could not be written is not worth reading
        check_target(
            dst,
            overwrite=overwrite,
            folder=not os.fspath(dst).endswith(SINGLE_FILES),
            recognise=is_checkpoint,
        )
        path = checkpoint_path(src)
        args = path, dst, to, bits, to_rfa, qwen_layers, head_size, overwrite
        if not path.endswith(".pth"):
            return _convert(lambda: read_model(path, dtype=dtype), *args)
        staged = temp_path(real + STAGED)
        made = make_parents(staged, "DST")
        try:
            return _convert(lambda: _read_pth(path, staged, dtype), *args)
        finally:
            remove_path(staged)
            remove_empty(made)


def _read_pth(path: str, staged: str, dtype):
    """The model of the ``.pth`` at ``path`` read lazily through its copy ``staged``."""
    stage_pth(path, staged)
    try:
        model, _ = read_model(staged, dtype=dtype, tokenizer=False)
        return model, load_tokenizer(path, model.config.vocab_size)
    except (CheckpointError, ValueError) as e:  # named as the user knows it
        raise CheckpointError(str(e).replace(staged, path)) from e


def _convert(read, src, dst, to, bits, to_rfa, qwen_layers, head_size, overwrite):
    # read here, so that this frame alone holds the model (and drops it below)
    model, tokenizer = read()  # lazy: nothing is read yet
    if to_rfa:
        n = len(model.config.block_types)
        layers = qwen_layers if qwen_layers is not None else default_qwen_layers(n)
        model = qwen2_to_rfa(model, layers, head_size=64 if head_size is None else head_size)
    cfg, quantization = model.config, model.quantization
    if bits and quantization and quantization["bits"] != bits:
        raise CheckpointError(
            f"{src}: stored in {quantization['bits']}-bit; it cannot be converted to "
            f"{bits}-bit (convert its float original)"
        )
    tensors = dict(tree_flatten(model.parameters()))
    floats = {}  # layer -> the float weight quantized as it is written, checked then
    if bits and not quantization:
        given = dict(tensors)
        quantization = quantize_tensors(model, tensors, bits, GROUP_SIZE)
        layers = (n.removesuffix(".scales") for n in tensors if n.endswith(".scales"))
        floats = {layer: given[f"{layer}.weight"] for layer in layers}
        del given
    del model  # ``tensors`` holds them alone now: each is freed once written
    check = _finite_check(src, floats, quantized=bool(quantization))
    # the native config records the quantization, without which its tensors do not load
    extra = {"quantization": quantization} if to == "native" else {}
    if to == "hf" and isinstance(tokenizer, ByteTokenizer):  # files for transformers too
        with tempfile.TemporaryDirectory() as folder:
            files = byte_tokenizer_files(folder, tokenizer.vocab_size)
            WRITERS[to](dst, cfg, tensors, extra_files=files, overwrite=overwrite, check=check)
    else:
        files = tokenizer_files(tokenizer)
        WRITERS[to](dst, cfg, tensors, extra_files=files, overwrite=overwrite, check=check, **extra)
    if os.fspath(dst).endswith(".pth"):
        return None
    return read_model(dst, tokenizer=False)[0]


def _finite_check(src, floats: dict, quantized: bool):
    """The check a writer runs on each tensor it computes: a floating one holding NaN or
    infinite values is refused, named as written (a quantized weight's scales and biases as
    its weight). A weight quantized as it is written (``floats``: layer -> float weight) is
    checked itself when its layer's first part is written: computing that part read it, and
    quantizing may hide a NaN; it is dropped once checked."""

    def refuse_non_finite(name: str, x: mx.array) -> None:
        # one sum; the exact test only where the sum is not finite (float16 may overflow)
        if math.isfinite(mx.sum(x).astype(mx.float32).item()) or mx.isfinite(x).all().item():
            return
        if quantized:
            name = re.sub(r"\.(scales|biases)\Z", ".weight", name)
        raise CheckpointError(f"{src}: {name} holds NaN or infinite values")

    def check(name: str, x: mx.array) -> None:
        layer = name.rpartition(".")[0]
        if layer in floats:
            refuse_non_finite(f"{layer}.weight", floats.pop(layer))
        if mx.issubdtype(x.dtype, mx.floating):
            refuse_non_finite(name, x)

    return check
