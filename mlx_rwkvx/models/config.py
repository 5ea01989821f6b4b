"""One config for every model: RWKV-7, RWKV-X (RWKV-7 + MoBA) and RFA (RWKV-7 + Qwen2).

``block_types`` lists every layer: ``"rwkv7"``, ``"moba"`` or ``"qwen2"``. The RWKV blocks of
RFA are ARWKV-style (RMSNorm, SwiGLU FFN, no output gate, no group norm): four switches below.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

from mlx_rwkvx.ops.common import HEAD_SIZES

BLOCK_TYPES = ("rwkv7", "moba", "qwen2")


def _low_rank(c: int, factor: float, power: float) -> int:
    # BlinkDL's RWKV-7 sizes: max(32, round(factor * C^power / 32) * 32); C=768 gives 64/64/32/128
    return max(32, int(round(factor * c**power / 32)) * 32)


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


_LOW_RANK_SIZES = (
    ("decay_low_rank", 1.8, 0.5),
    ("a_low_rank", 1.8, 0.5),
    ("v_low_rank", 1.3, 0.5),
    ("gate_low_rank", 0.6, 0.8),
)
# the type of each field, checked before anything is derived from it
_FIELD_KINDS = {
    **dict.fromkeys(
        (
            "vocab_size",
            "hidden_size",
            "head_size",
            "intermediate_size",
            "moba_chunk_size",
            "max_cache",
        ),
        "size",
    ),
    **dict.fromkeys([name for name, _, _ in _LOW_RANK_SIZES], "size"),
    **dict.fromkeys(("n_q_heads", "n_kv_heads", "attn_head_dim"), "size"),
    "moba_top_k": "int",
    **dict.fromkeys(("norm_eps", "rope_theta", "rms_norm_eps"), "positive"),
    **dict.fromkeys(("use_gate", "use_ln_x", "ln0", "tie_embeddings"), "bool"),
    **dict.fromkeys(("rwkv_norm", "rwkv_ffn", "final_norm"), "str"),
}
_OPTIONAL = {
    "intermediate_size",
    "n_q_heads",
    "n_kv_heads",
    "attn_head_dim",
    "max_cache",
    *[name for name, _, _ in _LOW_RANK_SIZES],
}
# fields added after checkpoints were written without them: a missing one takes its default
_ADDED_LATER = {"max_cache"}


@dataclass
class ModelConfig:
    vocab_size: int = 65536
    hidden_size: int = 768
    block_types: list[str] = field(default_factory=lambda: ["rwkv7"] * 12)
    head_size: int = 64  # WKV heads: hidden_size // head_size of them
    intermediate_size: int | None = None  # FFN width; None: 4 * hidden_size
    decay_low_rank: int | None = None  # None: BlinkDL's size for hidden_size
    a_low_rank: int | None = None
    v_low_rank: int | None = None
    gate_low_rank: int | None = None
    norm_eps: float = 1e-5  # LayerNorm
    # RWKV blocks in the ARWKV style of RFA: RMSNorm, SwiGLU, no gate, no ln_x
    rwkv_norm: str = "layer"  # "layer" | "rms"
    rwkv_ffn: str = "channel_mix"  # "channel_mix" | "swiglu"
    use_gate: bool = True
    use_ln_x: bool = True
    ln0: bool = True  # LayerNorm on the embedding before the first block (RWKV-7 checkpoints)
    final_norm: str = "layer"  # "layer" | "rms"
    # attention blocks
    n_q_heads: int | None = None  # None: hidden_size // head_size
    n_kv_heads: int | None = None  # None: n_q_heads; Qwen2 blocks only (MoBA's are C x C)
    attn_head_dim: int | None = None  # None: hidden_size // n_q_heads
    rope_theta: float = 1e6  # Qwen2
    rms_norm_eps: float = 1e-6
    moba_chunk_size: int = 256
    moba_top_k: int = 3
    tie_embeddings: bool = False
    # the tokens attention blocks' KV caches hold unless --max-cache says otherwise (None:
    # Foundry's 2048); a long-context model records its own
    max_cache: int | None = None

    def __post_init__(self):
        if isinstance(self.block_types, (list, tuple)):
            self.block_types = list(self.block_types)
        self._check_types()
        c = self.hidden_size
        # None means "derive from hidden_size"; 0 or a negative size is an error (validate)
        if self.intermediate_size is None:
            self.intermediate_size = 4 * c
        for name, factor, power in _LOW_RANK_SIZES:
            if getattr(self, name) is None:
                setattr(self, name, _low_rank(c, factor, power))
        if self.n_q_heads is None:
            self.n_q_heads = c // self.head_size
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_q_heads
        if self.attn_head_dim is None and self.n_q_heads > 0:
            self.attn_head_dim = c // self.n_q_heads
        self.validate()

    @property
    def n_heads(self) -> int:
        """WKV heads."""
        return self.hidden_size // self.head_size

    def _check_types(self) -> None:
        """One ValueError naming every field whose value has the wrong type or is not a
        positive size (before anything is derived from them)."""
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            kind = _FIELD_KINDS.get(f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            if kind == "size":
                if not _is_int(value) or value < 1:
                    problems.append(f"{f.name} must be an int >= 1, got {value!r}")
            elif kind == "int":
                if not _is_int(value):
                    problems.append(f"{f.name} must be an int, got {value!r}")
            elif kind == "positive":
                if not _is_number(value) or not 0 < value < math.inf:
                    problems.append(f"{f.name} must be a finite number > 0, got {value!r}")
            elif kind == "bool":
                if not isinstance(value, bool):
                    problems.append(f"{f.name} must be true or false, got {value!r}")
            elif kind == "str":
                if not isinstance(value, str):
                    problems.append(f"{f.name} must be a string, got {value!r}")
        if not isinstance(self.block_types, list) or not all(
            isinstance(t, str) for t in self.block_types
        ):
            problems.append(f"block_types must be a list of strings, got {self.block_types!r}")
        if problems:
            raise ValueError("ModelConfig: " + "; ".join(problems))

    def validate(self) -> None:
        """One ValueError naming the fields that do not fit together."""
        problems = []
        bad = [t for t in self.block_types if t not in BLOCK_TYPES]
        if not self.block_types or bad:
            problems.append(f"block_types must be a non-empty list of {BLOCK_TYPES}, got {bad}")
        if "rwkv7" in self.block_types:  # the WKV heads: nothing else reads head_size
            if self.hidden_size % self.head_size:
                problems.append(
                    f"hidden_size {self.hidden_size} is not a multiple of head_size "
                    f"{self.head_size}"
                )
            if self.head_size not in HEAD_SIZES:
                problems.append(f"head_size must be one of {HEAD_SIZES}, got {self.head_size}")
        for name in ("n_q_heads", "n_kv_heads", "attn_head_dim"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                problems.append(f"{name} must be an int >= 1, got {value!r}")
        if not problems and self.n_q_heads % self.n_kv_heads:
            problems.append(
                f"n_q_heads {self.n_q_heads} is not a multiple of n_kv_heads {self.n_kv_heads}"
            )
        if (
            not problems
            and "moba" in self.block_types
            and self.n_q_heads * self.attn_head_dim != self.hidden_size
        ):
            problems.append("moba blocks need n_q_heads * attn_head_dim == hidden_size")
        if (
            not problems and "qwen2" not in self.block_types and self.n_kv_heads != self.n_q_heads
        ):  # only Qwen2 blocks group their KV heads; MoBA's projections are C x C
            problems.append(
                f"n_kv_heads {self.n_kv_heads} != n_q_heads {self.n_q_heads}, but only qwen2 "
                "blocks have grouped KV heads (moba blocks have n_q_heads of them)"
            )
        for name, allowed in (
            ("rwkv_norm", ("layer", "rms")),
            ("final_norm", ("layer", "rms")),
            ("rwkv_ffn", ("channel_mix", "swiglu")),
        ):
            if getattr(self, name) not in allowed:
                problems.append(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if problems:
            raise ValueError("ModelConfig: " + "; ".join(problems))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict, *, complete: bool = False) -> ModelConfig:
        """A config from a dict. ``complete``: every field must be present (a checkpoint's
        config: a missing field is an error, not a default its weights were not trained with).
        """
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ModelConfig: unknown fields {unknown}")
        missing = sorted(known - set(d) - _ADDED_LATER) if complete else []
        if missing:
            raise ValueError(f"ModelConfig: missing fields {missing}")
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)


def rwkv_x_block_types(n_rwkv: int, n_attn: int) -> list[str]:
    """RWKV-X layout: one MoBA block after each group of ``n_rwkv // n_attn`` RWKV-7 blocks.

    With one attention block it goes last; leftover RWKV blocks (when n_attn does not divide
    n_rwkv) come at the end.
    """
    if n_attn < 0 or n_rwkv < 1:
        raise ValueError(f"rwkv_x_block_types: need n_rwkv >= 1, n_attn >= 0, got {n_rwkv, n_attn}")
    if n_attn == 0:
        return ["rwkv7"] * n_rwkv
    interval = n_rwkv // n_attn
    if interval < 1:
        raise ValueError(f"rwkv_x_block_types: {n_attn} attention blocks for {n_rwkv} RWKV blocks")
    types: list[str] = []
    for _ in range(n_attn):
        types += ["rwkv7"] * interval + ["moba"]
    return types + ["rwkv7"] * (n_rwkv - interval * n_attn)


def default_qwen_layers(n_layers: int) -> list[int]:
    """Where RFA keeps Qwen2 blocks unless told otherwise: after every three ARWKV blocks."""
    return list(range(3, n_layers, 4))


def rfa_block_types(n_layers: int, qwen_layers: list[int]) -> list[str]:
    """RFA layout: Qwen2 blocks at the given layer indices, RWKV-7 (ARWKV) blocks elsewhere."""
    bad = [i for i in qwen_layers if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"rfa_block_types: layer indices {bad} outside 0..{n_layers - 1}")
    return ["qwen2" if i in set(qwen_layers) else "rwkv7" for i in range(n_layers)]


# What makes RFA's RWKV blocks ARWKV-style, and its norms Qwen2's
RFA_SWITCHES = dict(
    rwkv_norm="rms", rwkv_ffn="swiglu", use_gate=False, use_ln_x=False, ln0=False, final_norm="rms"
)


def rfa_config(**overrides) -> ModelConfig:
    """An RFA config: ARWKV-style RWKV blocks, Qwen2 GQA blocks, RMSNorm, untied head."""
    return ModelConfig(**{**RFA_SWITCHES, **overrides})


# The 1.5B RFA reference (DESIGN.md): 28 layers, 21 ARWKV + 7 Qwen2. Checkpoints carry their own
# block_types; this preset puts a Qwen2 block after every three ARWKV blocks.
RFA_1P5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    block_types=rfa_block_types(28, default_qwen_layers(28)),
    head_size=64,
    intermediate_size=8960,
    n_q_heads=12,
    n_kv_heads=2,
    attn_head_dim=128,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
)

# BlinkDL's RWKV-7 releases (World and G0/G1, World vocabulary): (layers, hidden size, and the
# decay = a, v and gate low ranks), as their checkpoints' tensors have them (checked against the
# fla-hub configs of 0.1B-2.9B and independent model registries of 7.2B and 13.3B: BlinkDL's
# size formula gives the 0.4B's gate 160 where it has 128, and is not used for 13.3B at all).
# FFN 4x hidden throughout.
RWKV7_RELEASES = {
    "0.1b": (12, 768, 64, 32, 128),
    "0.4b": (24, 1024, 64, 32, 128),
    "1.5b": (24, 2048, 96, 64, 256),
    "2.9b": (32, 2560, 96, 64, 320),
    "7.2b": (32, 4096, 128, 96, 480),
    "13.3b": (61, 4096, 192, 128, 384),
}


def rwkv7_release(size: str) -> ModelConfig:
    """The config of BlinkDL's released RWKV-7 of ``size`` (``"1.5b"``), random weights aside."""
    layers, c, decay, v, gate = RWKV7_RELEASES[size]
    return ModelConfig(
        vocab_size=65536,
        hidden_size=c,
        block_types=["rwkv7"] * layers,
        decay_low_rank=decay,
        a_low_rank=decay,
        v_low_rank=v,
        gate_low_rank=gate,
    )


PRESETS = {
    "rfa-1.5b": lambda: rfa_config(**RFA_1P5B),
    **{f"rwkv7-{size}": (lambda size=size: rwkv7_release(size)) for size in RWKV7_RELEASES},
    "rwkv-x-tiny": lambda: ModelConfig(
        vocab_size=256,
        hidden_size=64,
        head_size=16,
        block_types=rwkv_x_block_types(4, 2),
        moba_chunk_size=8,
        moba_top_k=2,
    ),
}


def preset(name: str) -> ModelConfig:
    """A named config: ``rfa-1.5b``, ``rwkv7-0.1b`` ... ``rwkv7-13.3b`` (the released RWKV-7
    shapes), ``rwkv-x-tiny``."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[name]()
