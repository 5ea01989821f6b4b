"""Checkpoint formats: detection, reading into native tensor names, writing.

Native names are our module paths (``layers.3.tmix.receptance.weight``). Formats read:

- ``native``: a folder with ``config.json`` (``"format": "mlx_rwkvx"``) and ``model.safetensors``
  (optional ``adapters.safetensors``);
- ``native_file``: one ``.safetensors`` whose metadata holds the config (incl. ``block_types``);
- ``hf_rwkv7``: Hugging Face RWKV-7 as flash-linear-attention and mlx-lm name it;
- ``hf_qwen2``: Hugging Face Qwen2 (loaded as a model of Qwen2 blocks);
- ``blinkdl``: BlinkDL's ``.pth`` (read without torch) or its ``.safetensors`` export.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from mlx_rwkvx.io.atomic import (
    TMP_TAG,
    CheckpointError,
    atomic_target,
    check_target,
    copy_file,
    save_safetensors,
    save_text,
)
from mlx_rwkvx.io.pth import PthError, read_pth
from mlx_rwkvx.models.config import ModelConfig, rfa_config

import mlx.core as mx

FORMAT_TAG = "mlx_rwkvx"
WEIGHTS_FILE = "model.safetensors"
ADAPTERS_FILE = "adapters.safetensors"
CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"  # a sharded checkpoint's tensor -> file map

__all__ = ["CheckpointError"]  # defined in io/atomic.py, raised by both reading and writing


def read_safetensors(path: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Tensors and metadata of one ``.safetensors`` file (lazy: read when evaluated)."""
    try:
        tensors, metadata = mx.load(path, return_metadata=True)
    except Exception as e:  # MLX raises RuntimeError/ValueError for damaged files
        raise CheckpointError(f"{path}: cannot read safetensors ({e})") from e
    return tensors, metadata or {}


_ST_DTYPES = {
    "F32": ("<f4", None),
    "F16": ("<f2", None),
    "BF16": ("<u2", mx.bfloat16),
    "I32": ("<i4", None),
    "U32": ("<u4", None),
    "I8": ("i1", None),
    "U8": ("u1", None),
}


def read_rows(path: str, name: str, start: int, stop: int) -> mx.array:
    """Rows ``start:stop`` of tensor ``name`` of a ``.safetensors`` file, read from disk alone
    (a big embedding can be quantized a slice at a time, never whole in floating point)."""
    import numpy as np

    with open(path, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(header_len))
        info = header[name]
        np_dtype, view = _ST_DTYPES[info["dtype"]]
        shape = info["shape"]
        row_bytes = int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(np_dtype).itemsize
        f.seek(8 + header_len + info["data_offsets"][0] + start * row_bytes)
        raw = f.read((stop - start) * row_bytes)
    x = mx.array(np.frombuffer(raw, dtype=np_dtype).reshape(stop - start, *shape[1:]))
    return x.view(view) if view is not None else x


def read_folder_safetensors(folder: str) -> tuple[dict[str, mx.array], dict[str, str]]:
    """The tensors of a (possibly sharded) Hugging Face folder, and the file of each tensor.

    With ``model.safetensors.index.json`` exactly the files it lists are read, and every
    tensor must sit in the file the index names (as transformers reads it); without one, every
    ``*.safetensors`` but adapters and interrupted saves (``.tmp-`` names)."""
    index_path = os.path.join(folder, INDEX_FILE)
    weight_map = None
    if os.path.exists(index_path):
        weight_map = _read_json(index_path).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index_path}: no 'weight_map' of tensor names to files")
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not os.path.exists(os.path.join(folder, n))]
        if missing:
            raise CheckpointError(f"{index_path}: lists shards that are missing: {missing}")
    else:
        names = sorted(
            n
            for n in os.listdir(folder)
            if n.endswith(".safetensors") and n != ADAPTERS_FILE and TMP_TAG not in n
        )
    if not names:
        raise CheckpointError(f"{folder}: no .safetensors weights in the folder")
    tensors: dict[str, mx.array] = {}
    files: dict[str, str] = {}
    for name in names:
        part, _ = read_safetensors(os.path.join(folder, name))
        twice = sorted(set(part) & set(tensors))
        if twice:
            raise CheckpointError(f"{folder}: tensors {twice[:4]} are in more than one shard")
        tensors.update(part)
        files.update(dict.fromkeys(part, os.path.join(folder, name)))
    if weight_map is not None:
        misplaced = sorted(n for n in tensors if weight_map.get(n) != os.path.basename(files[n]))
        unlisted = sorted(set(weight_map) - set(tensors))
        if misplaced or unlisted:
            raise CheckpointError(
                f"{index_path}: does not match its shards (tensors not where it says: "
                f"{misplaced[:4]}; listed but absent: {unlisted[:4]})"
            )
    return tensors, files


def _from_pth(path: str) -> dict[str, mx.array]:
    try:
        state = read_pth(path)
    except PthError as e:
        raise CheckpointError(str(e)) from e
    out = {}
    for name, t in state.items():
        x = mx.array(t.array)
        out[name] = x.view(mx.bfloat16) if t.bfloat16 else x
    return out


def _read_json(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read JSON ({e})") from e


def checkpoint_path(path) -> str:
    """``path`` as a str: a str or an ``os.PathLike`` (``pathlib.Path``), else a TypeError."""
    if isinstance(path, bytes) or not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"checkpoint path must be a str or a pathlib.Path, got {path!r}")
    return os.fspath(path)


def detect(path: str) -> str:
    """The format of ``path`` (see the module docstring). Raises CheckpointError if unknown."""
    path = checkpoint_path(path)
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        cfg_path = os.path.join(path, CONFIG_FILE)
        if not os.path.exists(cfg_path):
            raise CheckpointError(f"{path}: a checkpoint folder needs {CONFIG_FILE}")
        cfg = _read_json(cfg_path)
        if not isinstance(cfg, dict):
            raise CheckpointError(f"{cfg_path}: expected a JSON object")
        if cfg.get("format") == FORMAT_TAG:
            return "native"
        kind = cfg.get("model_type")
        if kind in ("rwkv7", "qwen2"):
            return f"hf_{kind}"
        raise CheckpointError(
            f"{cfg_path}: unknown checkpoint (model_type {kind!r}; expected an mlx_rwkvx "
            "config, or model_type rwkv7 or qwen2)"
        )
    if path.endswith(".pth"):
        return "blinkdl"
    if path.endswith(".safetensors"):
        tensors, metadata = read_safetensors(path)
        if metadata.get("format") == FORMAT_TAG:
            return "native_file"
        if "emb.weight" in tensors and any(n.startswith("blocks.0.att.") for n in tensors):
            return "blinkdl"
        raise CheckpointError(
            f"{path}: unknown safetensors checkpoint (no mlx_rwkvx config in its metadata, and "
            "not BlinkDL's RWKV-7 naming)"
        )
    raise CheckpointError(
        f"{path}: unknown checkpoint format (expected a folder, .safetensors or .pth)"
    )


# Each mapping turns a format's tensor dict into native names. A rule is
# (pattern on the format's name, native template, transform).


def _flat(x: mx.array) -> mx.array:
    return x.reshape(-1)


def _t(x: mx.array) -> mx.array:
    return x.T


_LERPS = ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g")
_LOW_RANKS = (("w", "decay"), ("a", "iclr"), ("v", "value_mix"), ("g", "gate"))
_SHARED_TMIX = {
    **{name: (name, _flat) for name in _LERPS},
    "k_k": ("k_k", _flat),
    "k_a": ("k_a", _flat),
    "r_k": ("r_k", None),
}
_BLINKDL_TMIX = {
    **_SHARED_TMIX,
    **{f"{p}0": (f"{m}.up.bias", _flat) for p, m in _LOW_RANKS if p != "g"},
    **{f"{p}1": (f"{m}.down.weight", _t) for p, m in _LOW_RANKS},
    **{f"{p}2": (f"{m}.up.weight", _t) for p, m in _LOW_RANKS},
    **{f"{n}.weight": (f"{n}.weight", None) for n in ("receptance", "key", "value", "output")},
    "ln_x.weight": ("ln_x.weight", None),
    "ln_x.bias": ("ln_x.bias", None),
}
_HF_RWKV_TMIX = {
    **_SHARED_TMIX,
    **{
        f"{p}_proj.weight": (f"{n}.weight", None)
        for p, n in (("r", "receptance"), ("k", "key"), ("v", "value"), ("o", "output"))
    },
    **{f"{p}_lora.lora.0.weight": (f"{m}.down.weight", None) for p, m in _LOW_RANKS},
    **{f"{p}_lora.lora.2.weight": (f"{m}.up.weight", None) for p, m in _LOW_RANKS},
    **{f"{p}_lora.lora.2.bias": (f"{m}.up.bias", None) for p, m in _LOW_RANKS if p != "g"},
    "g_norm.weight": ("ln_x.weight", _flat),
    "g_norm.bias": ("ln_x.bias", _flat),
}


def _row(x: mx.array) -> mx.array:
    return x.reshape(1, 1, -1)


@dataclass(frozen=True)
class _RwkvNaming:
    """How a format names a plain RWKV-7 model, both ways (native <-> format)."""

    fixed: dict  # format name -> native name, outside the blocks
    block: str  # the blocks' prefix: "blocks" or "model.layers"
    att: str  # the time-mix's name inside a block
    norms: dict  # format norm name -> ln1 / ln2
    tmix: dict  # format time-mix suffix -> (native suffix, transform when reading)
    rows: tuple  # time-mix suffixes stored as [1, 1, C]
    ffn_x_k_row: bool  # ffn.x_k stored as [1, 1, C]

    def read(self, name: str) -> tuple[str, Callable | None] | None:
        if name in self.fixed:
            return self.fixed[name], None
        block = re.escape(self.block)
        m = re.fullmatch(rf"{block}\.(\d+)\.(\w+)\.(weight|bias)", name)
        if m and m[2] in self.norms:
            return f"layers.{m[1]}.{self.norms[m[2]]}.{m[3]}", None
        m = re.fullmatch(rf"{block}\.(\d+)\.{self.att}\.(.+)", name)
        if m and m[2] in self.tmix:
            target, fn = self.tmix[m[2]]
            return f"layers.{m[1]}.tmix.{target}", fn
        m = re.fullmatch(rf"{block}\.(\d+)\.ffn\.(x_k|key\.weight|value\.weight)", name)
        if m:
            return f"layers.{m[1]}.ffn.{m[2]}", _flat if m[2] == "x_k" else None
        return None

    def write(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        fixed = {native: fmt for fmt, native in self.fixed.items()}
        norms = {native: fmt for fmt, native in self.norms.items()}
        tmix = {}
        for fmt, (native, fn) in self.tmix.items():
            tmix[native] = (fmt, _t if fn is _t else (_row if fmt in self.rows else None))
        out = {}
        for name, x in tensors.items():
            if name in fixed:
                out[fixed[name]] = x
                continue
            _, i, part, rest = name.split(".", 3)
            prefix = f"{self.block}.{i}"
            if part == "tmix":
                fmt_name, fn = tmix[rest]
                out[f"{prefix}.{self.att}.{fmt_name}"] = x if fn is None else fn(x)
            elif part == "ffn":
                row = rest == "x_k" and self.ffn_x_k_row
                out[f"{prefix}.ffn.{rest}"] = _row(x) if row else x
            else:
                out[f"{prefix}.{norms[part]}.{rest}"] = x
        return out


BLINKDL = _RwkvNaming(
    fixed={
        "emb.weight": "embed.weight",
        "blocks.0.ln0.weight": "ln0.weight",
        "blocks.0.ln0.bias": "ln0.bias",
        "ln_out.weight": "norm.weight",
        "ln_out.bias": "norm.bias",
        "head.weight": "lm_head.weight",
    },
    block="blocks",
    att="att",
    norms={"ln1": "ln1", "ln2": "ln2"},
    tmix=_BLINKDL_TMIX,
    rows=_LERPS + ("w0", "a0", "v0", "k_k", "k_a"),
    ffn_x_k_row=True,
)
HF_RWKV7 = _RwkvNaming(
    fixed={
        "model.embeddings.weight": "embed.weight",
        "model.layers.0.pre_norm.weight": "ln0.weight",
        "model.layers.0.pre_norm.bias": "ln0.bias",
        "model.norm.weight": "norm.weight",
        "model.norm.bias": "norm.bias",
        "lm_head.weight": "lm_head.weight",
    },
    block="model.layers",
    att="attn",
    norms={"attn_norm": "ln1", "ffn_norm": "ln2"},
    tmix=_HF_RWKV_TMIX,
    rows=_LERPS,
    ffn_x_k_row=False,  # flash-linear-attention keeps the channel-mix x_k as [C]
)


def _blinkdl_rule(name: str):
    return BLINKDL.read(name)


def _hf_rwkv7_rule(name: str):
    if name != "lm_head.weight" and not name.startswith("model."):
        name = "model." + name  # some exports drop the "model." prefix
    return HF_RWKV7.read(name)


def _hf_qwen2_rule(name: str) -> tuple[str, Callable | None] | None:
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight", None
    if name in ("norm.weight", "lm_head.weight"):
        return name, None
    if name.startswith("layers.") and ".rotary_emb." not in name:
        return name, None  # our Qwen2 blocks use Hugging Face's names
    return None


# Several versions of BlinkDL's x070 training script create the value-mix low-rank projection
# (att.v0, v1, v2) in every layer, layer 0 included, where it is never used (layer 0 produces
# v_first); their checkpoints carry it. It holds no information: accepted and dropped.
UNUSED_LAYER0 = tuple(
    f"layers.0.tmix.value_mix.{n}" for n in ("down.weight", "up.weight", "up.bias")
)


def _rename(path: str, tensors: dict, rule) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Native-named tensors, and the stored name of each one kept as stored (no reshape)."""
    out, kept = {}, {}
    for name, x in tensors.items():
        mapped = rule(name)
        if mapped is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for this format")
        target, fn = mapped
        if target in UNUSED_LAYER0:
            continue
        if target in out:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice (as {target!r})")
        out[target] = x if fn is None else fn(x)
        if fn is None:
            kept[target] = name
    return out, kept


def _need(path: str, tensors: dict, name: str) -> mx.array:
    if name not in tensors:
        raise CheckpointError(f"{path}: missing tensor {name!r}")
    return tensors[name]


# What BlinkDL's and flash-linear-attention's RWKV-7 always have: a missing gate, group norm,
# ln0 or head is a damaged file (a missing-tensor error), not a different model
RWKV7_FIXED = dict(use_gate=True, use_ln_x=True, ln0=True, tie_embeddings=False)


def _rwkv7_config_from_native(path: str, t: dict, **fixed) -> ModelConfig:
    """An RWKV-7 config whose sizes are read from native-named tensors (formats without a
    config); ``fixed`` fields are not inferred."""
    vocab, C = _need(path, t, "embed.weight").shape
    layers = sorted({int(n.split(".")[1]) for n in t if n.startswith("layers.")})
    if not layers:
        raise CheckpointError(f"{path}: no RWKV blocks found")
    H, N = _need(path, t, "layers.0.tmix.r_k").shape
    tm = "layers.0.tmix"
    gate = f"{tm}.gate.down.weight" in t
    v_rank = (
        t["layers.1.tmix.value_mix.down.weight"].shape[0]
        if "layers.1.tmix.value_mix.down.weight" in t
        else None
    )
    fields = dict(
        vocab_size=vocab,
        hidden_size=C,
        block_types=["rwkv7"] * (layers[-1] + 1),
        head_size=N,
        intermediate_size=_need(path, t, "layers.0.ffn.key.weight").shape[0],
        decay_low_rank=_need(path, t, f"{tm}.decay.down.weight").shape[0],
        a_low_rank=_need(path, t, f"{tm}.iclr.down.weight").shape[0],
        v_low_rank=v_rank,
        gate_low_rank=t[f"{tm}.gate.down.weight"].shape[0] if gate else None,
        use_gate=gate,
        use_ln_x=f"{tm}.ln_x.weight" in t,
        ln0="ln0.weight" in t,
        tie_embeddings="lm_head.weight" not in t,
    )
    fields.update(fixed)
    try:
        return ModelConfig(**fields)
    except ValueError as e:
        raise CheckpointError(f"{path}: tensors describe no valid model ({e})") from e


@dataclass
class Checkpoint:
    """What a checkpoint holds: its config, its tensors under native names, its format, and
    for tensors stored as is in a .safetensors file, ``(file, stored name)`` (for ``read_rows``).
    """

    config: ModelConfig
    tensors: dict[str, mx.array]
    format: str
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)


def read_checkpoint(path) -> Checkpoint:
    """Any supported checkpoint (see the module docstring), under native names."""
    path = checkpoint_path(path)
    fmt = detect(path)
    if fmt == "native":
        cfg = _config_from_dict(path, _read_json(os.path.join(path, CONFIG_FILE)))
        weights = os.path.join(path, WEIGHTS_FILE)
        if not os.path.exists(weights):
            raise CheckpointError(f"{path}: missing {WEIGHTS_FILE}")
        tensors, _ = read_safetensors(weights)
        return Checkpoint(cfg, tensors, fmt, {n: (weights, n) for n in tensors})
    if fmt == "native_file":
        tensors, metadata = read_safetensors(path)
        try:
            cfg_dict = json.loads(metadata["config"])
        except (KeyError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: bad or missing 'config' in the metadata ({e})") from e
        return Checkpoint(
            _config_from_dict(path, cfg_dict), tensors, fmt, {n: (path, n) for n in tensors}
        )
    if fmt == "blinkdl":
        from_pth = path.endswith(".pth")
        raw = _from_pth(path) if from_pth else read_safetensors(path)[0]
        tensors, kept = _rename(path, raw, _blinkdl_rule)
        sources = {} if from_pth else {n: (path, stored) for n, stored in kept.items()}
        cfg = _rwkv7_config_from_native(path, tensors, **RWKV7_FIXED)
        return Checkpoint(cfg, tensors, fmt, sources)
    hf = _read_json(os.path.join(path, CONFIG_FILE))
    raw, files = read_folder_safetensors(path)
    rule = _hf_rwkv7_rule if fmt == "hf_rwkv7" else _hf_qwen2_rule
    tensors, kept = _rename(path, raw, rule)
    sources = {n: (files[stored], stored) for n, stored in kept.items()}
    config_path = os.path.join(path, CONFIG_FILE)
    if fmt == "hf_rwkv7":
        cfg = _hf_rwkv7_config(config_path, hf, tensors)
    else:
        cfg = _qwen2_config(config_path, hf, tensors)
    return Checkpoint(cfg, tensors, fmt, sources)


def _config_from_dict(path: str, d: dict) -> ModelConfig:
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: bad config (expected a JSON object)")
    d = {k: v for k, v in d.items() if k != "format"}
    try:
        return ModelConfig.from_dict(d, complete=True)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad config ({e})") from e


# Hugging Face config fields that do not change what a model computes: generation defaults,
# token ids, bookkeeping of transformers 4.x and 5.x (PretrainedConfig's own fields), training
# switches. Every other field is either honoured below or refused by name.
_HF_BOOKKEEPING = frozenset(
    """_name_or_path _attn_implementation_autoset add_cross_attention architectures auto_map
    bad_words_ids begin_suppress_tokens bos_token_id chunk_size_feed_forward
    cross_attention_hidden_size decoder_start_token_id diversity_penalty do_sample dtype
    early_stopping encoder_no_repeat_ngram_size eos_token_id exponential_decay_length_penalty
    finetuning_task forced_bos_token_id forced_eos_token_id id2label initializer_range
    is_decoder is_encoder_decoder label2id length_penalty max_length max_position_embeddings
    min_length model_type no_repeat_ngram_size num_beam_groups num_beams num_return_sequences
    output_attentions output_hidden_states output_scores pad_token_id prefix problem_type
    pruned_heads remove_invalid_values repetition_penalty return_dict return_dict_in_generate
    sep_token_id suppress_tokens task_specific_params temperature tf_legacy_loss
    tie_encoder_decoder tokenizer_class top_k top_p torch_dtype torchscript
    transformers_version typical_p use_bfloat16 use_cache""".split()
)


class _HFConfig:
    """A Hugging Face config.json read field by field: every field read is marked, and
    ``finish`` refuses those neither read nor known to be bookkeeping."""

    def __init__(self, path: str, d: dict, harmless: frozenset = frozenset()):
        if not isinstance(d, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        self.path, self.d, self.seen = path, d, set(_HF_BOOKKEEPING | harmless)

    def get(self, key: str, default=None, *, required: bool = False):
        self.seen.add(key)
        if key not in self.d or self.d[key] is None:
            if required:
                raise CheckpointError(f"{self.path}: missing field {key!r}")
            return default
        return self.d[key]

    def refuse(self, key: str, why: str):
        raise CheckpointError(f"{self.path}: {key} = {self.d.get(key)!r}: {why}")

    def finish(self) -> None:
        unknown = sorted(set(self.d) - self.seen)
        if unknown:
            raise CheckpointError(
                f"{self.path}: fields {unknown} are not understood by mlx_rwkvx and may change "
                "what the model computes; remove them from config.json if they do not"
            )


def _build_config(path: str, build, **fields) -> ModelConfig:
    try:
        return build(**fields)
    except ValueError as e:
        raise CheckpointError(f"{path}: {e}") from e


def _agree(cfg: _HFConfig, key: str, value, from_tensors) -> None:
    """A config field that the tensors also tell must agree with them."""
    if value is not None and value != from_tensors:
        raise CheckpointError(
            f"{cfg.path}: {key} = {value!r}, but the tensors say {from_tensors!r}"
        )


def _hf_rwkv7_config(path: str, hf: dict, tensors: dict) -> ModelConfig:
    """flash-linear-attention's RWKV7Config (as mlx-lm reads it), checked against the
    tensors the sizes are read from."""
    c = _HFConfig(path, hf, frozenset(
        "attn_mode fuse_norm fuse_cross_entropy fuse_linear_cross_entropy use_l2warp".split()
    ))  # fmt: skip
    inferred = _rwkv7_config_from_native(
        path,
        tensors,
        **{
            **RWKV7_FIXED,
            "ln0": c.get("norm_first", True),  # RWKV7Config's defaults
            "tie_embeddings": c.get("tie_word_embeddings", False),
        },
    )
    C = inferred.hidden_size
    if c.get("hidden_act", "sqrelu") != "sqrelu":
        c.refuse("hidden_act", "RWKV-7's channel-mix is squared ReLU ('sqrelu')")
    if c.get("attn") is not None:
        c.refuse("attn", "hybrid attention layers of flash-linear-attention are not supported")
    if not c.get("norm_bias", True):
        c.refuse("norm_bias", "LayerNorms without bias are not supported")
    value_dim = c.get("value_dim")
    if value_dim is not None and set(value_dim if isinstance(value_dim, list) else [value_dim]) != {
        C
    }:
        c.refuse("value_dim", f"only value_dim == hidden_size ({C}) is supported")
    _agree(c, "vocab_size", c.get("vocab_size"), inferred.vocab_size)
    _agree(c, "hidden_size", c.get("hidden_size"), C)
    _agree(c, "num_hidden_layers", c.get("num_hidden_layers"), len(inferred.block_types))
    _agree(c, "head_dim", c.get("head_dim"), inferred.head_size)
    _agree(c, "num_heads", c.get("num_heads"), inferred.n_heads)
    ratio = c.get("hidden_ratio")
    width = c.get("intermediate_size")
    if width is None and ratio is not None:
        width = int(C * ratio)
    _agree(c, "intermediate_size", width, inferred.intermediate_size)
    for key, name in (
        ("decay_low_rank_dim", "decay_low_rank"),
        ("a_low_rank_dim", "a_low_rank"),
        ("v_low_rank_dim", "v_low_rank"),
        ("gate_low_rank_dim", "gate_low_rank"),
    ):
        _agree(c, key, c.get(key), getattr(inferred, name))
    norm_eps = c.get("norm_eps", required=True)
    c.finish()
    return _build_config(path, ModelConfig, **{**inferred.to_dict(), "norm_eps": norm_eps})


def _qwen2_rope_theta(c: _HFConfig) -> float:
    """The RoPE base: transformers 5 keeps it in ``rope_parameters``, 4.x at the top level
    (and a scaled variant in ``rope_scaling``). Only unscaled RoPE is supported."""
    params = c.get("rope_parameters")
    scaling = c.get("rope_scaling")
    theta = c.get("rope_theta")
    for key, spec in (("rope_parameters", params), ("rope_scaling", scaling)):
        if spec is None:
            continue
        if not isinstance(spec, dict):
            c.refuse(key, "expected an object")
        kind = spec.get("rope_type", spec.get("type", "default"))
        if kind != "default":
            c.refuse(key, f"RoPE type {kind!r} is not supported (only 'default', unscaled)")
        if "rope_theta" in spec:
            if theta is not None and spec["rope_theta"] != theta:
                c.refuse(key, f"its rope_theta disagrees with the top-level {theta!r}")
            theta = spec["rope_theta"]
    if theta is None:
        return 10000.0  # transformers' Qwen2Config default, in 4.x and 5.x alike
    return theta


def _qwen2_config(path: str, hf: dict, tensors: dict) -> ModelConfig:
    """transformers' Qwen2Config (4.x and 5.x layouts). Sizes are required; fields with a
    transformers default take that default, as transformers does."""
    c = _HFConfig(path, hf, frozenset({"attention_dropout", "max_window_layers"}))
    C = c.get("hidden_size", required=True)
    n_heads = c.get("num_attention_heads", required=True)
    if c.get("hidden_act", "silu") != "silu":
        c.refuse("hidden_act", "Qwen2's MLP is SwiGLU ('silu')")
    if c.get("use_sliding_window", False):
        c.refuse("use_sliding_window", "sliding-window attention is not supported")
    c.get("sliding_window")  # used only with use_sliding_window
    kinds = set(c.get("layer_types", ["full_attention"]))
    if kinds != {"full_attention"}:
        c.refuse("layer_types", "only full attention layers are supported")
    if c.get("quantization_config") is not None:
        c.refuse("quantization_config", "quantized Hugging Face checkpoints are not supported")
    tie = c.get("tie_word_embeddings", False)  # Qwen2Config's default
    if tie and "lm_head.weight" in tensors:
        embed = _need(path, tensors, "embed.weight")
        if tensors["lm_head.weight"].shape != embed.shape or not mx.array_equal(
            tensors["lm_head.weight"], embed
        ):
            c.refuse("tie_word_embeddings", "but lm_head.weight differs from the embedding")
        del tensors["lm_head.weight"]
    fields = dict(
        vocab_size=c.get("vocab_size", required=True),
        hidden_size=C,
        block_types=["qwen2"] * c.get("num_hidden_layers", required=True),
        intermediate_size=c.get("intermediate_size", required=True),
        n_q_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads", n_heads),
        attn_head_dim=c.get("head_dim", C // n_heads if isinstance(C, int) and n_heads else None),
        rope_theta=_qwen2_rope_theta(c),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=tie,
        head_size=64 if isinstance(C, int) and C % 64 == 0 else 32,
    )
    c.finish()
    return _build_config(path, rfa_config, **fields)


def _exportable(cfg: ModelConfig, tensors: dict, fmt: str, rwkv7: bool = True) -> None:
    """One CheckpointError unless the model fits ``fmt``: float weights, no trainable state,
    and (``rwkv7``) plain RWKV-7 blocks: LayerNorms, channel-mix, gate and ln_x."""
    plain = (
        set(cfg.block_types) == {"rwkv7"}
        and cfg.rwkv_ffn == "channel_mix"
        and cfg.use_gate
        and cfg.use_ln_x
        and cfg.rwkv_norm == cfg.final_norm == "layer"
    )
    if rwkv7 and not plain:
        raise CheckpointError(f"only plain RWKV-7 models can be written as {fmt}; use native")
    if cfg.quantization:
        raise CheckpointError(f"{fmt} holds float weights; this model is quantized: use native")
    tuned = [n for n in tensors if n.endswith(".state0")]
    if tuned:
        raise CheckpointError(f"{fmt} has no place for trained initial states {tuned[:3]}")


def to_blinkdl(cfg: ModelConfig, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
    """Native tensors of a plain RWKV-7 model in BlinkDL's names and shapes (``.pth`` layout)."""
    _exportable(cfg, tensors, "BlinkDL")
    return BLINKDL.write(tensors)


def to_hf(cfg: ModelConfig, tensors: dict[str, mx.array]) -> tuple[dict, dict[str, mx.array]]:
    """(config.json, tensors) in Hugging Face form: RWKV-7 as flash-linear-attention names it,
    or Qwen2 for a model of Qwen2 blocks only. Hybrids have no Hugging Face form."""
    if set(cfg.block_types) == {"qwen2"}:
        _exportable(cfg, tensors, "Hugging Face", rwkv7=False)
        hf = {
            "model_type": "qwen2",
            "architectures": ["Qwen2ForCausalLM"],
            "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": len(cfg.block_types),
            "num_attention_heads": cfg.n_q_heads,
            "num_key_value_heads": cfg.n_kv_heads,
            "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_norm_eps,
            "tie_word_embeddings": cfg.tie_embeddings,
        }
        out = {("model." + n if n != "lm_head.weight" else n): x for n, x in tensors.items()}
        out["model.embed_tokens.weight"] = out.pop("model.embed.weight")
        return hf, out
    _exportable(cfg, tensors, "Hugging Face")
    hf = {
        "model_type": "rwkv7",
        "architectures": ["RWKV7ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "head_dim": cfg.head_size,
        "num_heads": cfg.n_heads,
        "num_hidden_layers": len(cfg.block_types),
        "intermediate_size": cfg.intermediate_size,
        "hidden_ratio": None,
        "decay_low_rank_dim": cfg.decay_low_rank,
        "a_low_rank_dim": cfg.a_low_rank,
        "v_low_rank_dim": cfg.v_low_rank,
        "gate_low_rank_dim": cfg.gate_low_rank,
        "norm_eps": cfg.norm_eps,
        "norm_first": cfg.ln0,
        "tie_word_embeddings": cfg.tie_embeddings,
    }
    return hf, HF_RWKV7.write(tensors)


def is_checkpoint(path: str) -> bool:
    """Whether ``path`` holds a checkpoint we read (what ``overwrite`` may replace)."""
    try:
        detect(path)
    except CheckpointError:
        return False
    return True


def _write(path, write, *, folder: bool, overwrite: bool, extra_files: dict | None) -> None:
    """Check the target, then ``write(tmp)`` and the extra files (name -> source path, copied
    beside the weights) atomically; see ``io/atomic.py``."""
    check_target(path, overwrite=overwrite, folder=folder, is_checkpoint=is_checkpoint)
    extra = dict(extra_files or {})
    if not folder:
        _check_beside(path, extra)
    with atomic_target(path, folder=folder) as tmp:
        write(tmp)
        if folder:
            for name, src in extra.items():
                copy_file(src, os.path.join(tmp, name))
    for name, src in extra.items() if not folder else ():
        _copy_beside(src, os.path.join(os.path.dirname(os.path.abspath(path)), name))


def _check_beside(path: str, extra: dict) -> None:
    """Files to put beside a single-file checkpoint: each absent there or already the same."""
    folder = os.path.dirname(os.path.abspath(path))
    for name, src in extra.items():
        dst = os.path.join(folder, name)
        if os.path.exists(dst) and not _same_file(src, dst):
            raise CheckpointError(
                f"{dst}: a different {name} is already there; save into a folder of its own"
            )


def _copy_beside(src: str, dst: str) -> None:
    if os.path.exists(dst) and _same_file(src, dst):
        return
    with atomic_target(dst, folder=False) as tmp:
        copy_file(src, tmp)


def _same_file(a: str, b: str) -> bool:
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def write_hf(
    path, cfg: ModelConfig, tensors: dict[str, mx.array], *, extra_files=None, overwrite=False
) -> None:
    """A Hugging Face folder (``config.json``, ``model.safetensors``, the tokenizer files in
    ``extra_files``), written atomically."""
    path = checkpoint_path(path)
    hf, out = to_hf(cfg, tensors)

    def write(tmp):
        save_safetensors(os.path.join(tmp, WEIGHTS_FILE), out, {"format": "pt"})
        save_text(os.path.join(tmp, CONFIG_FILE), json.dumps(hf, indent=2))

    _write(path, write, folder=True, overwrite=overwrite, extra_files=extra_files)


def write_blinkdl(
    path, cfg: ModelConfig, tensors: dict[str, mx.array], *, extra_files=None, overwrite=False
) -> None:
    """BlinkDL's names and shapes in one ``.safetensors`` file, written atomically."""
    path = checkpoint_path(path)
    if not path.endswith(".safetensors"):
        raise CheckpointError(f"{path}: BlinkDL export writes one .safetensors file: name it so")
    out = to_blinkdl(cfg, tensors)
    _write(
        path,
        lambda tmp: save_safetensors(tmp, out),
        folder=False,
        overwrite=overwrite,
        extra_files=extra_files,
    )


def write_native(
    path, cfg: ModelConfig, tensors: dict[str, mx.array], *, extra_files=None, overwrite=False
) -> None:
    """A native folder (``config.json`` + ``model.safetensors``) or, for a path ending in
    ``.safetensors``, one file with the config in its metadata; ``extra_files`` (name -> source,
    the tokenizer's files) are copied into the folder, or beside the file. Written atomically:
    under a temporary name, then renamed, so a failed save never leaves a damaged checkpoint
    or a temporary file, and replaces an existing checkpoint only with ``overwrite``."""
    path = checkpoint_path(path)
    if path.endswith(".safetensors"):
        meta = {
            "format": FORMAT_TAG,
            "config": cfg.to_json(),
            "block_types": json.dumps(cfg.block_types),
        }
        _write(
            path,
            lambda tmp: save_safetensors(tmp, tensors, meta),
            folder=False,
            overwrite=overwrite,
            extra_files=extra_files,
        )
        return

    def write(tmp):
        save_safetensors(os.path.join(tmp, WEIGHTS_FILE), tensors, {"format": FORMAT_TAG})
        config = json.dumps({"format": FORMAT_TAG, **cfg.to_dict()}, indent=2)
        save_text(os.path.join(tmp, CONFIG_FILE), config)

    _write(path, write, folder=True, overwrite=overwrite, extra_files=extra_files)
