"""How each format names the tensors, both ways: native names are our module paths
(``layers.3.tmix.receptance.weight``); one table per format serves reading and writing."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from mlx_rwkvx.io.atomic import CheckpointError

import mlx.core as mx

DROP = "drop"  # what a reading rule returns for a tensor that carries no information


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


def hf_rwkv7_rule(name: str):
    """Reading rule of Hugging Face RWKV-7 names, with or without the ``model.`` prefix."""
    if name != "lm_head.weight" and not name.startswith("model."):
        name = "model." + name  # some exports drop the "model." prefix
    return HF_RWKV7.read(name)


@dataclass(frozen=True)
class _Qwen2Naming:
    """Hugging Face Qwen2 names, both ways: our Qwen2 blocks use them inside ``layers``."""

    fixed = {"embed_tokens.weight": "embed.weight", "norm.weight": "norm.weight"}

    def read(self, name: str):
        if name == "lm_head.weight":
            return name, None
        name = name.removeprefix("model.")
        if name in self.fixed:
            return self.fixed[name], None
        if re.fullmatch(r"layers\.\d+\.self_attn\.rotary_emb\.inv_freq", name):
            return DROP  # older transformers saved RoPE's frequencies, derived from the config
        if name.startswith("layers."):
            return name, None
        return None

    def write(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        back = {native: fmt for fmt, native in self.fixed.items()}
        return {
            n if n == "lm_head.weight" else "model." + back.get(n, n): x for n, x in tensors.items()
        }


QWEN2 = _Qwen2Naming()


class RwkvXNaming:
    """The RWKV-X authors' names (``howard-hou/RWKV-X``): BlinkDL's RWKV-7 names under
    ``rwkv.``, numbered among the RWKV blocks alone, and the attention blocks under
    ``moba.<j>.``, numbered among themselves; ``block_types`` places both in our one
    ``layers`` list."""

    _ATT = {"receptance": "q_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}

    def __init__(self, block_types: list[str]):
        self.rwkv = [i for i, kind in enumerate(block_types) if kind == "rwkv7"]
        self.moba = [i for i, kind in enumerate(block_types) if kind == "moba"]
        self.native_index = {("rwkv", r): i for r, i in enumerate(self.rwkv)}
        self.native_index.update({("moba", j): i for j, i in enumerate(self.moba)})

    def read(self, name: str):
        m = re.fullmatch(r"rwkv\.blocks\.(\d+)\.(.+)", name)
        if m:
            i = self.native_index.get(("rwkv", int(m[1])))
            return None if i is None else BLINKDL.read(f"blocks.{i}.{m[2]}")
        if name.startswith("rwkv."):
            inner = name.removeprefix("rwkv.")
            return BLINKDL.read(inner) if not inner.startswith("blocks.") else None
        m = re.fullmatch(r"moba\.(\d+)\.(.+)", name)
        i = self.native_index.get(("moba", int(m[1]))) if m else None
        if i is None:
            return None
        part = m[2]
        if re.fullmatch(r"ln[12]\.(weight|bias)", part):
            return f"layers.{i}.{part}", None
        a = re.fullmatch(r"att\.(receptance|key|value|output)\.weight", part)
        if a:
            return f"layers.{i}.attn.{self._ATT[a[1]]}.weight", None
        if part in ("ffn.key.weight", "ffn.value.weight"):
            return f"layers.{i}.{part}", None
        if part == "ffn.x_k":
            return f"layers.{i}.ffn.x_k", _flat
        return None

    def write(self, tensors: dict[str, mx.array]) -> dict[str, mx.array]:
        rwkv_of = {i: r for r, i in enumerate(self.rwkv)}
        moba_of = {i: j for j, i in enumerate(self.moba)}
        att = {native: fmt for fmt, native in self._ATT.items()}
        rwkv, out = {}, {}
        for name, x in tensors.items():
            if not name.startswith("layers."):
                rwkv[name] = x
                continue
            _, i, rest = name.split(".", 2)
            if int(i) in rwkv_of:
                rwkv[f"layers.{rwkv_of[int(i)]}.{rest}"] = x
                continue
            prefix = f"moba.{moba_of[int(i)]}"
            if rest.startswith("attn."):
                proj, tail = rest.removeprefix("attn.").split(".", 1)
                out[f"{prefix}.att.{att[proj]}.{tail}"] = x
            elif rest == "ffn.x_k":
                out[f"{prefix}.ffn.x_k"] = _row(x)
            else:
                out[f"{prefix}.{rest}"] = x
        return {**{"rwkv." + n: x for n, x in BLINKDL.write(rwkv).items()}, **out}


def rwkvx_layout(path: str, names) -> tuple[int, int]:
    """(RWKV-7 blocks, attention blocks) of a checkpoint in the RWKV-X authors' names."""
    rwkv = {int(m[1]) for n in names if (m := re.match(r"rwkv\.blocks\.(\d+)\.", n))}
    moba = {int(m[1]) for n in names if (m := re.match(r"moba\.(\d+)\.", n))}
    for kind, found in (("rwkv.blocks", rwkv), ("moba", moba)):
        if found != set(range(len(found))):
            missing = sorted(set(range(max(found) + 1)) - found)
            raise CheckpointError(f"{path}: {kind}.{missing[0]} is missing (found {sorted(found)})")
    if not rwkv:
        raise CheckpointError(f"{path}: no RWKV blocks (rwkv.blocks.*) found")
    if len(moba) > 1 and len(rwkv) % len(moba):
        raise CheckpointError(
            f"{path}: {len(moba)} attention blocks for {len(rwkv)} RWKV blocks: the authors' "
            f"code runs one after each {len(rwkv) // len(moba)} RWKV blocks and never runs the "
            f"last {len(rwkv) % len(moba)}; such a file is not read (its last blocks were never "
            "trained or used)"
        )
    return len(rwkv), len(moba)


# Several versions of BlinkDL's x070 training script create the value-mix low-rank projection
# (att.v0, v1, v2) in every layer, layer 0 included, where it is never used (layer 0 produces
# v_first); their checkpoints carry it. It holds no information: accepted and dropped.
UNUSED_LAYER0 = tuple(
    f"layers.0.tmix.value_mix.{n}" for n in ("down.weight", "up.weight", "up.bias")
)


def rename(path: str, tensors: dict, rule) -> tuple[dict[str, mx.array], dict[str, str]]:
    """Native-named tensors by ``rule`` (a naming's ``read``), and the stored name of each one
    kept as stored (no reshape). A tensor the rule does not know is an error."""
    out, kept = {}, {}
    for name, x in tensors.items():
        mapped = rule(name)
        if mapped is None:
            raise CheckpointError(f"{path}: unexpected tensor {name!r} for this format")
        if mapped == DROP:
            continue
        target, fn = mapped
        if target in UNUSED_LAYER0:
            continue
        if target in out:
            raise CheckpointError(f"{path}: tensor {name!r} appears twice (as {target!r})")
        out[target] = x if fn is None else fn(x)
        if fn is None:
            kept[target] = name
    return out, kept
