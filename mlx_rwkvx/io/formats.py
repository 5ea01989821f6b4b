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

from mlx_rwkvx.io.pth import PthError, read_pth
from mlx_rwkvx.models.config import ModelConfig, rfa_config

import mlx.core as mx

FORMAT_TAG = "mlx_rwkvx"
WEIGHTS_FILE = "model.safetensors"
ADAPTERS_FILE = "adapters.safetensors"
CONFIG_FILE = "config.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and the tensor."""


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
    """Every ``*.safetensors`` in a folder (a sharded checkpoint), adapters excluded; and the
    file of each tensor."""
    names = sorted(
        n
        for n in os.listdir(folder)
        if n.endswith(".safetensors") and n != ADAPTERS_FILE and ".tmp-" not in n
    )  # a .tmp- file is an interrupted save (see _atomic_safetensors): never part of it
    if not names:
        raise CheckpointError(f"{folder}: no .safetensors weights in the folder")
    tensors: dict[str, mx.array] = {}
    files: dict[str, str] = {}
    for name in names:
        part, _ = read_safetensors(os.path.join(folder, name))
        tensors.update(part)
        files.update(dict.fromkeys(part, os.path.join(folder, name)))
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


def detect(path: str) -> str:
    """The format of ``path`` (see the module docstring). Raises CheckpointError if unknown."""
    if not os.path.exists(path):
        raise CheckpointError(f"{path}: no such file or folder")
    if os.path.isdir(path):
        cfg_path = os.path.join(path, CONFIG_FILE)
        if not os.path.exists(cfg_path):
            raise CheckpointError(f"{path}: a checkpoint folder needs {CONFIG_FILE}")
        cfg = _read_json(cfg_path)
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


def _rename(path: str, tensors: dict, rule) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Native-named tensors, and the stored name of each one kept as stored (no reshape)."""
    out, kept = {}, {}
    for name, x in tensors.items():
        mapped = rule(name)
        if mapped is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for this format")
        target, fn = mapped
        out[target] = x if fn is None else fn(x)
        if fn is None:
            kept[target] = name
    return out, kept


def _need(path: str, tensors: dict, name: str) -> mx.array:
    if name not in tensors:
        raise CheckpointError(f"{path}: missing tensor {name!r}")
    return tensors[name]


def _rwkv7_config_from_native(path: str, t: dict, **extra) -> ModelConfig:
    """An RWKV-7 config inferred from native-named tensors (formats without a config)."""
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
    return ModelConfig(
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
        **extra,
    )


@dataclass
class Checkpoint:
    """What a checkpoint holds: its config, its tensors under native names, its format, and
    for tensors stored as is in a .safetensors file, ``(file, stored name)`` (for ``read_rows``).
    """

    config: ModelConfig
    tensors: dict[str, mx.array]
    format: str
    sources: dict[str, tuple[str, str]] = field(default_factory=dict)


def read_checkpoint(path: str) -> Checkpoint:
    """Any supported checkpoint (see the module docstring), under native names."""
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
        return Checkpoint(_rwkv7_config_from_native(path, tensors), tensors, fmt, sources)
    hf = _read_json(os.path.join(path, CONFIG_FILE))
    raw, files = read_folder_safetensors(path)
    rule = _hf_rwkv7_rule if fmt == "hf_rwkv7" else _hf_qwen2_rule
    tensors, kept = _rename(path, raw, rule)
    sources = {n: (files[stored], stored) for n, stored in kept.items()}
    if fmt == "hf_rwkv7":
        cfg = _rwkv7_config_from_native(path, tensors, norm_eps=hf.get("norm_eps", 1e-5))
    else:
        cfg = _qwen2_config(path, hf)
    return Checkpoint(cfg, tensors, fmt, sources)


def _config_from_dict(path: str, d: dict) -> ModelConfig:
    d = {k: v for k, v in d.items() if k != "format"}
    try:
        return ModelConfig.from_dict(d)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad config ({e})") from e


def _qwen2_config(path: str, hf: dict) -> ModelConfig:
    try:
        n_heads = hf["num_attention_heads"]
        return rfa_config(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            block_types=["qwen2"] * hf["num_hidden_layers"],
            intermediate_size=hf["intermediate_size"],
            n_q_heads=n_heads,
            n_kv_heads=hf.get("num_key_value_heads", n_heads),
            attn_head_dim=hf["hidden_size"] // n_heads,
            rope_theta=hf.get("rope_theta", 10000.0),  # Hugging Face's Qwen2Config default
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_embeddings=hf.get("tie_word_embeddings", False),
            head_size=64 if hf["hidden_size"] % 64 == 0 else 32,
        )
    except KeyError as e:
        raise CheckpointError(f"{os.path.join(path, CONFIG_FILE)}: missing field {e}") from e


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


def write_hf(path: str, cfg: ModelConfig, tensors: dict[str, mx.array]) -> None:
    """A Hugging Face folder (``config.json``, ``model.safetensors``), written atomically."""
    hf, out = to_hf(cfg, tensors)
    os.makedirs(path, exist_ok=True)
    _atomic_safetensors(os.path.join(path, WEIGHTS_FILE), out, {"format": "pt"})
    _atomic_text(os.path.join(path, CONFIG_FILE), json.dumps(hf, indent=2))


def write_native(path: str, cfg: ModelConfig, tensors: dict[str, mx.array]) -> None:
    """A native folder (``config.json`` + ``model.safetensors``) or, for a path ending in
    ``.safetensors``, one file with the config in its metadata. Written atomically: to a
    temporary name, then renamed, so an interrupted save never leaves a damaged checkpoint."""
    if path.endswith(".safetensors"):
        meta = {
            "format": FORMAT_TAG,
            "config": cfg.to_json(),
            "block_types": json.dumps(cfg.block_types),
        }
        _atomic_safetensors(path, tensors, meta)
        return
    os.makedirs(path, exist_ok=True)
    _atomic_safetensors(os.path.join(path, WEIGHTS_FILE), tensors, {"format": FORMAT_TAG})
    _atomic_text(
        os.path.join(path, CONFIG_FILE),
        json.dumps({"format": FORMAT_TAG, **cfg.to_dict()}, indent=2),
    )


def atomic_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """Write to ``<path>.tmp-<pid>.safetensors``, then rename over ``path``."""
    _atomic_safetensors(path, tensors, metadata or {})


def _atomic_safetensors(path: str, tensors: dict, metadata: dict) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.safetensors"
    mx.save_safetensors(tmp, tensors, metadata=metadata)
    os.replace(tmp, path)


def _atomic_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
