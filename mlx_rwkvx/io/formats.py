"""Checkpoint formats: reading any of them into native tensor names, writing ours.

Native names are our module paths (``layers.3.tmix.receptance.weight``). Formats read:

- ``native``: a folder with ``config.json`` (``"format": "mlx_rwkvx"``) and ``model.safetensors``
  (optional ``adapters.safetensors``);
- ``native_file``: one ``.safetensors`` whose metadata holds the config (incl. ``block_types``);
- ``hf_rwkv7``: Hugging Face RWKV-7 as flash-linear-attention and mlx-lm name it;
- ``hf_qwen2``: Hugging Face Qwen2 (loaded as a model of Qwen2 blocks);
- ``blinkdl``: BlinkDL's ``.pth`` (read without torch) or its ``.safetensors`` export;
- ``rwkvx``: the RWKV-X authors' ``.pth`` (``howard-hou/RWKV-X``: BlinkDL's names under
  ``rwkv.``, the attention blocks under ``moba.<j>.``) or the same names in ``.safetensors``.

The jobs live beside this module: ``detect.py`` (which format), ``tensors.py`` (reading,
row-wise too), ``names.py`` (the name tables), ``configs.py`` (configs), ``atomic.py``
(writing so that nothing is ever half-written).
"""

from __future__ import annotations

import json
import os
import re
from contextlib import ExitStack
from dataclasses import dataclass, field

from mlx_rwkvx.io.atomic import (
    CheckpointError,
    atomic_target,
    check_target,
    copy_file,
    save_text,
)
from mlx_rwkvx.io.configs import (
    RWKV7_FIXED,
    hf_rwkv7_config,
    hf_rwkv7_config_dict,
    native_config,
    native_config_dict,
    qwen2_config,
    qwen2_config_dict,
    rwkv7_config_from_native,
    rwkvx_config,
)
from mlx_rwkvx.io.detect import (
    CONFIG_FILE,
    FORMAT_TAG,
    WEIGHTS_FILE,
    checkpoint_path,
    detect,
    is_checkpoint,
    read_json,
)
from mlx_rwkvx.io.names import (
    BLINKDL,
    HF_RWKV7,
    QWEN2,
    RwkvXNaming,
    hf_rwkv7_rule,
    rename,
    rwkvx_layout,
)
from mlx_rwkvx.io.pth import StoredTensor, pth_names, write_pth
from mlx_rwkvx.io.stream import raw_bytes, write_safetensors
from mlx_rwkvx.io.tensors import (
    INDEX_FILE,
    pth_placeholders,
    read_folder_safetensors,
    read_pth_tensors,
    read_safetensors,
)
from mlx_rwkvx.models.config import ModelConfig, rwkv_x_block_types

import mlx.core as mx
import numpy as np

__all__ = ["CheckpointError", "checkpoint_path", "detect"]  # raised and used by both sides


@dataclass
class Checkpoint:
    """What a checkpoint holds: its config, its tensors under native names, its format, and
    for tensors stored as is in a .safetensors file, ``(file, stored name)`` (for ``read_rows``).
    """

    config: ModelConfig
    tensors: dict[str, mx.array]
    format: str
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)
    quantization: dict | None = None  # {"group_size", "bits"} of a checkpoint saved quantized


def read_checkpoint(path, *, shapes_only: bool = False) -> Checkpoint:
    """Any supported checkpoint (see the module docstring), under native names.
    ``shapes_only``: a ``.pth``'s tensors are zeros of their shapes, never to be computed (its
    data is not read; the others' are read only when computed anyway)."""
    path = checkpoint_path(path)
    read_pth = pth_placeholders if shapes_only else read_pth_tensors
    fmt = detect(path)
    if fmt == "native":
        config_path = os.path.join(path, CONFIG_FILE)
        cfg, quantization = native_config(config_path, read_json(config_path))
        weights = os.path.join(path, WEIGHTS_FILE)
        if not os.path.exists(weights):
            raise CheckpointError(f"{path}: missing {WEIGHTS_FILE}")
        tensors, _ = read_safetensors(weights)
        return Checkpoint(cfg, tensors, fmt, {n: (weights, n) for n in tensors}, quantization)
    if fmt == "native_file":
        tensors, metadata = read_safetensors(path)
        try:
            cfg_dict = json.loads(metadata["config"])
        except (KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: bad or missing 'config' in the metadata ({e})") from e
        cfg, quantization = native_config(path, cfg_dict)
        return Checkpoint(cfg, tensors, fmt, {n: (path, n) for n in tensors}, quantization)
    if fmt == "blinkdl":
        from_pth = path.endswith(".pth")
        raw = read_pth(path) if from_pth else read_safetensors(path)[0]
        tensors, kept = rename(path, raw, BLINKDL.read)
        sources = {} if from_pth else {n: (path, stored) for n, stored in kept.items()}
        cfg = rwkv7_config_from_native(path, tensors, **RWKV7_FIXED)
        return Checkpoint(cfg, tensors, fmt, sources)
    if fmt == "rwkvx":
        from_pth = path.endswith(".pth")
        raw = read_pth(path) if from_pth else read_safetensors(path)[0]
        block_types = rwkv_x_block_types(*rwkvx_layout(path, raw))
        tensors, kept = rename(path, raw, RwkvXNaming(block_types).read)
        sources = {} if from_pth else {n: (path, stored) for n, stored in kept.items()}
        return Checkpoint(rwkvx_config(path, tensors, block_types), tensors, fmt, sources)
    config_path = os.path.join(path, CONFIG_FILE)
    hf = read_json(config_path)
    raw, files = read_folder_safetensors(path)
    rule = hf_rwkv7_rule if fmt == "hf_rwkv7" else QWEN2.read
    tensors, kept = rename(path, raw, rule)
    sources = {n: (files[stored], stored) for n, stored in kept.items()}
    if fmt == "hf_rwkv7":
        cfg = hf_rwkv7_config(config_path, hf, tensors)
    else:
        cfg = qwen2_config(config_path, hf, tensors)
        if cfg.tie_embeddings and "lm_head.weight" in tensors:
            _drop_tied_head(config_path, tensors, sources)
    return Checkpoint(cfg, tensors, fmt, sources)


def block_kinds(path) -> set[str]:
    """The kinds of block (``rwkv7``, ``moba``, ``qwen2``) of the checkpoint at ``path``, from
    its config alone (no tensor is read: a ``.pth`` is plain RWKV-7)."""
    path = checkpoint_path(path)
    fmt = detect(path)
    if fmt in ("blinkdl", "hf_rwkv7"):
        return {"rwkv7"}
    if fmt == "rwkvx":
        names = pth_names(path) if path.endswith(".pth") else read_safetensors(path)[0]
        return {"rwkv7", "moba"} if any(n.startswith("moba.") for n in names) else {"rwkv7"}
    if fmt == "hf_qwen2":
        return {"qwen2"}
    try:
        if fmt == "native":
            config = read_json(os.path.join(path, CONFIG_FILE))
        else:
            config = json.loads(read_safetensors(path)[1].get("config", "{}") or "{}")
    except (CheckpointError, ValueError):
        config = None
    kinds = config.get("block_types") if isinstance(config, dict) else None
    if not isinstance(kinds, list):
        return set(read_checkpoint(path).config.block_types)  # let the reader say what is wrong
    return set(map(str, kinds))


def _drop_tied_head(path: str, tensors: dict, sources: dict) -> None:
    """A tied model's file may also carry the head: the same matrix as the embedding (then it
    is dropped), else the config contradicts the tensors."""
    head, embed = tensors.pop("lm_head.weight"), tensors.get("embed.weight")
    sources.pop("lm_head.weight", None)
    if embed is None or head.shape != embed.shape or not mx.array_equal(head, embed):
        raise CheckpointError(
            f"{path}: tie_word_embeddings = True, but lm_head.weight differs from the embedding"
        )


def _exportable(cfg: ModelConfig, tensors: dict, fmt: str, rwkv7: bool = True) -> None:
    """One CheckpointError unless the model fits ``fmt``: float weights, no trainable state,
    and (``rwkv7``) plain RWKV-7 blocks: LayerNorms, channel-mix, gate and ln_x."""
    plain = (
        (set(cfg.block_types) == {"rwkv7"} or fmt == "RWKV-X")
        and cfg.rwkv_ffn == "channel_mix"
        and cfg.use_gate
        and cfg.use_ln_x
        and cfg.rwkv_norm == cfg.final_norm == "layer"
    )
    if rwkv7 and not plain:
        raise CheckpointError(f"only plain RWKV-7 models can be written as {fmt}; use native")
    if any(n.endswith(".scales") for n in tensors):
        raise CheckpointError(f"{fmt} holds float weights; this model is quantized: use native")
    tuned = [n for n in tensors if n.endswith(".state0")]
    if tuned:
        raise CheckpointError(f"{fmt} has no place for trained initial states {tuned[:3]}")


def to_blinkdl(cfg: ModelConfig, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Native tensors of a plain RWKV-7 model in BlinkDL's names and shapes (``.pth`` layout)."""
    _exportable(cfg, tensors, "BlinkDL")
    return BLINKDL.write(tensors)


def to_rwkvx(cfg: ModelConfig, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Native tensors of an RWKV-X model in its authors' names and shapes: RWKV-7 blocks as
    BlinkDL's, MoBA blocks in the order their code runs them (see ``io/names.py``)."""
    kinds = cfg.block_types
    n_rwkv, n_moba = kinds.count("rwkv7"), kinds.count("moba")
    C = cfg.hidden_size
    problems = []
    if set(kinds) - {"rwkv7", "moba"} or n_rwkv < 1:
        problems.append(f"blocks {sorted(set(kinds))}: only RWKV-7 and MoBA blocks")
    elif (n_moba > 1 and n_rwkv % n_moba) or kinds != rwkv_x_block_types(n_rwkv, n_moba):
        problems.append(
            "the blocks are not in the authors' order (one MoBA block after each "
            f"{n_rwkv // max(n_moba, 1)} RWKV-7 blocks, every RWKV-7 block run)"
        )
    if cfg.head_size != 64:
        problems.append(f"head_size {cfg.head_size}: their code fixes 64")
    if n_moba and (cfg.attn_head_dim != 64 or cfg.n_q_heads * 64 != C):
        problems.append(f"attention heads of {cfg.attn_head_dim}: their code fixes 64")
    if n_moba and cfg.intermediate_size != 4 * C:
        problems.append(f"intermediate_size {cfg.intermediate_size}: their MoBA blocks fix 4 x C")
    if not cfg.ln0 or cfg.tie_embeddings:
        problems.append("their code needs ln0 and an untied head")
    if problems:
        raise CheckpointError("cannot write the RWKV-X authors' layout: " + "; ".join(problems))
    _exportable(cfg, tensors, "RWKV-X")
    return RwkvXNaming(kinds).write(tensors)


def to_hf(cfg: ModelConfig, tensors: dict[str, mx.array]) -> tuple[dict, dict[str, mx.array]]:
    """(config.json, tensors) in Hugging Face form: RWKV-7 as flash-linear-attention names it,
    or Qwen2 for a model of Qwen2 blocks only. Hybrids have no Hugging Face form."""
    if set(cfg.block_types) == {"qwen2"}:
        if cfg.ln0 or cfg.final_norm != "rms":
            raise CheckpointError(
                "a Qwen2 model for Hugging Face has no ln0 and an RMSNorm final norm; this one "
                f"has ln0={cfg.ln0}, final_norm={cfg.final_norm!r}: use native"
            )
        _exportable(cfg, tensors, "Hugging Face", rwkv7=False)
        return qwen2_config_dict(cfg), QWEN2.write(tensors)
    _exportable(cfg, tensors, "Hugging Face")
    return hf_rwkv7_config_dict(cfg), HF_RWKV7.write(tensors)


def _write(path, write, *, folder: bool, overwrite: bool, extra_files: dict | None) -> None:
    """Check the target, then ``write(tmp)`` and the extra files (name -> source path, copied
    beside the weights) atomically; see ``io/atomic.py``. A single file's extra files are
    committed just before it, so a failure anywhere leaves the old state."""
    check_target(path, overwrite=overwrite, folder=folder, recognise=is_checkpoint)
    extra = dict(extra_files or {})
    if folder:
        _check_nothing_lost(path, extra)
        with atomic_target(path, folder=True) as tmp:
            write(tmp)
            for name, src in extra.items():
                copy_file(src, os.path.join(tmp, name))
        return
    beside = os.path.dirname(os.path.abspath(path))
    for name, src in extra.items():
        dst = os.path.join(beside, name)
        if os.path.exists(dst) and not _same_file(src, dst):
            raise CheckpointError(
                f"{dst}: a different {name} is already there; save into a folder of its own"
            )
    with ExitStack() as commits:  # committed last in, first out: the weights last
        write(commits.enter_context(atomic_target(path, folder=False)))
        for name, src in extra.items():
            dst = os.path.join(beside, name)
            if not os.path.exists(dst):
                copy_file(src, commits.enter_context(atomic_target(dst, folder=False)))


# What a checkpoint folder may hold that a new checkpoint written over it replaces anyway: its
# config, its weights (one file, or Hugging Face's shards and their index), a Mac's .DS_Store
_REPLACED = (CONFIG_FILE, INDEX_FILE, WEIGHTS_FILE, ".DS_Store")
_SHARD = re.compile(r"model-\d+-of-\d+\.safetensors\Z")


def _check_nothing_lost(path: str, extra: dict) -> None:
    """Replacing a folder must not drop a file the new checkpoint does not bring (another
    tokenizer's files, adapters, a backup of weights, notes): one CheckpointError naming
    them."""
    if not os.path.isdir(path) or os.path.islink(path):  # a link: replaced, its folder kept
        return
    lost = sorted(
        name
        for name in os.listdir(path)
        if name not in extra and name not in _REPLACED and not _SHARD.match(name)
    )
    if lost:
        raise CheckpointError(
            f"{path}: replacing it would drop {lost[:6]}, which the new checkpoint does not "
            "bring (pass its tokenizer, or move them away first)"
        )


def _same_file(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def write_hf(
    path,
    cfg: ModelConfig,
    tensors: dict[str, mx.array],
    *,
    extra_files=None,
    overwrite=False,
    check=None,
) -> None:
    """A Hugging Face folder (``config.json``, ``model.safetensors``, the tokenizer files in
    ``extra_files``), written atomically, a tensor at a time (``tensors`` is emptied: see
    ``write_native``)."""
    path = checkpoint_path(path)
    hf, out = to_hf(cfg, tensors)
    tensors.clear()  # renamed: ``out`` holds them now

    def write(tmp):
        write_safetensors(os.path.join(tmp, WEIGHTS_FILE), out, {"format": "pt"}, check=check)
        save_text(os.path.join(tmp, CONFIG_FILE), json.dumps(hf, indent=2))

    _write(path, write, folder=True, overwrite=overwrite, extra_files=extra_files)


def write_blinkdl(
    path,
    cfg: ModelConfig,
    tensors: dict[str, mx.array],
    *,
    extra_files=None,
    overwrite=False,
    check=None,
) -> None:
    """BlinkDL's names and shapes in one ``.pth`` (as ``torch.save`` writes it) or
    ``.safetensors`` file, written atomically, a tensor at a time (``tensors`` is emptied)."""
    renamed = lambda: to_blinkdl(cfg, tensors)  # noqa: E731  (after the path is checked)
    _write_one_file(path, "BlinkDL", renamed, tensors, extra_files, overwrite, check)


def write_rwkvx(
    path,
    cfg: ModelConfig,
    tensors: dict[str, mx.array],
    *,
    extra_files=None,
    overwrite=False,
    check=None,
) -> None:
    """The RWKV-X authors' names and shapes in one ``.pth`` (what their ``RWKV_X`` loads) or
    ``.safetensors`` file, written atomically, a tensor at a time (``tensors`` is emptied)."""
    renamed = lambda: to_rwkvx(cfg, tensors)  # noqa: E731  (after the path is checked)
    _write_one_file(path, "RWKV-X", renamed, tensors, extra_files, overwrite, check)


def _write_one_file(path, fmt: str, renamed, tensors, extra_files, overwrite, check) -> None:
    path = checkpoint_path(path)
    if not path.endswith((".pth", ".safetensors")):
        raise CheckpointError(
            f"{path}: the {fmt} format is one .pth or .safetensors file: name it so"
        )
    out = renamed()
    tensors.clear()  # renamed: ``out`` holds them now
    if path.endswith(".pth"):

        def write(tmp):
            stored = {n: _pth_tensor(n, out.pop(n), check) for n in list(out)}
            with open(tmp, "wb") as f:
                write_pth(f, stored)
    else:

        def write(tmp):
            write_safetensors(tmp, out, check=check)

    _write(path, write, folder=False, overwrite=overwrite, extra_files=extra_files)


_NUMPY = {
    mx.bfloat16: np.uint16,  # stored as its bits
    **{getattr(mx, t): getattr(np, t) for t in ("float16", "float32", "float64")},
    **{getattr(mx, t): getattr(np, t) for t in ("int8", "int16", "int32", "int64", "uint8")},
    mx.bool_: np.bool_,
}


def _pth_tensor(name: str, x: mx.array, check) -> StoredTensor:
    """``x`` as ``write_pth`` takes it: its bytes made only when its record is written."""
    if x.dtype not in _NUMPY:
        raise CheckpointError(f"{name}: cannot store dtype {x.dtype} in a .pth")

    def read():
        mx.eval(x)
        if check is not None:
            check(name, x)
        return np.frombuffer(raw_bytes(x), _NUMPY[x.dtype]).reshape(x.shape)

    return StoredTensor(tuple(x.shape), np.dtype(_NUMPY[x.dtype]), x.dtype == mx.bfloat16, read)


def write_native(
    path,
    cfg: ModelConfig,
    tensors: dict[str, mx.array],
    *,
    quantization: dict | None = None,
    extra_files=None,
    overwrite=False,
    check=None,
) -> None:
    """A native folder (``config.json`` + ``model.safetensors``) or, for a path ending in
    ``.safetensors``, one file with the config in its metadata (``quantization``: the
    ``{"group_size", "bits"}`` of quantized weights, None for float ones); ``extra_files``
    (name -> source, the tokenizer's files) are copied into the folder, or beside the file.
    Written atomically:
    under a temporary name, then renamed, so a failed save never leaves a damaged checkpoint
    or a temporary file, and replaces an existing checkpoint only with ``overwrite``.

    Written a tensor at a time (``io/stream.py``): each is taken out of ``tensors`` (the dict is
    left empty), computed if lazy, handed to ``check(name, array)`` (which may refuse it),
    written and dropped, so that a lazy model is never whole in memory."""
    path = checkpoint_path(path)
    if path.endswith(".safetensors"):
        meta = {
            "format": FORMAT_TAG,
            "config": json.dumps(native_config_dict(cfg, quantization)),
            "block_types": json.dumps(cfg.block_types),
        }
        _write(
            path,
            lambda tmp: write_safetensors(tmp, tensors, meta, check=check),
            folder=False,
            overwrite=overwrite,
            extra_files=extra_files,
        )
        return

    def write(tmp):
        weights = os.path.join(tmp, WEIGHTS_FILE)
        write_safetensors(weights, tensors, {"format": FORMAT_TAG}, check=check)
        config = {"format": FORMAT_TAG, **native_config_dict(cfg, quantization)}
        config = json.dumps(config, indent=2)
        save_text(os.path.join(tmp, CONFIG_FILE), config)

    _write(path, write, folder=True, overwrite=overwrite, extra_files=extra_files)
