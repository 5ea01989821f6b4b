"""Float64 oracle of a whole model: embedding, ln0, the blocks ``block_types`` lists, final
norm, head; forward and hand backward, composed from the blocks' own oracles.

Parameters are one flat dict: ``'emb' [V, C]``, ``'ln0_w'``, ``'ln0_b'`` (with ``ln0``),
``'norm_w'`` (and ``'norm_b'`` for a LayerNorm), ``'W_head' [V, C]`` (untied head), and each
block's parameters under ``'layers.<i>.'`` with the names of its own oracle
(``rwkv7_block_fwd_np`` / ``arwkv_block_fwd_np``, ``moba_block_fwd_np``, ``qwen2_block_fwd_np``).

``v_first`` is produced by the first RWKV block and read by every later one, across attention
blocks in between; its gradient is the sum of what every later RWKV block sends back, added to
the first block's own v in its backward.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from .blocks_attn import (
    init_moba_block_params,
    init_norm,
    init_qwen2_block_params,
    moba_block_bwd_np,
    moba_block_fwd_np,
    qwen2_block_bwd_np,
    qwen2_block_fwd_np,
    sub_params,
)
from .common import seeded_uniform
from .lm import embedding_bwd_np, embedding_fwd_np, head_bwd_np, head_fwd_np
from .norms import layer_norm_bwd_np, layer_norm_fwd_np, rms_norm_bwd_np, rms_norm_fwd_np
from .rwkv7 import (
    LAYER_NORM_EPS,
    RMS_NORM_EPS,
    arwkv_block_bwd_np,
    arwkv_block_fwd_np,
    init_arwkv_block_params,
    init_rwkv7_block_params,
    rwkv7_block_bwd_np,
    rwkv7_block_fwd_np,
)

RWKV7_STYLE = dict(rwkv_norm="layer", rwkv_ffn="channel_mix", use_gate=True, use_ln_x=True)
ARWKV_STYLE = dict(rwkv_norm="rms", rwkv_ffn="swiglu", use_gate=False, use_ln_x=False)


@dataclass
class ModelSpec:
    """What the oracle needs of a model config; the field names are ``ModelConfig``'s, so
    ``spec_of(cfg)`` copies them. The low-rank sizes serve ``init_model_params`` only."""

    vocab_size: int
    hidden_size: int
    block_types: list = field(default_factory=lambda: ["rwkv7"])
    head_size: int = 4
    intermediate_size: int = 12
    decay_low_rank: int = 4
    a_low_rank: int = 3
    v_low_rank: int = 3
    gate_low_rank: int = 4
    norm_eps: float = LAYER_NORM_EPS
    rms_norm_eps: float = RMS_NORM_EPS
    rwkv_norm: str = "layer"
    rwkv_ffn: str = "channel_mix"
    use_gate: bool = True
    use_ln_x: bool = True
    ln0: bool = True
    final_norm: str = "layer"
    n_q_heads: int = 2
    n_kv_heads: int = 1
    attn_head_dim: int = 4
    rope_theta: float = 1e6
    moba_chunk_size: int = 4
    moba_top_k: int = 1
    tie_embeddings: bool = False

    @property
    def n_heads(self) -> int:
        return self.hidden_size // self.head_size

    @property
    def arwkv(self) -> bool:
        """True for ARWKV-style RWKV blocks; raises for a mix the block oracles do not cover."""
        style = {k: getattr(self, k) for k in RWKV7_STYLE}
        if style not in (RWKV7_STYLE, ARWKV_STYLE):
            raise ValueError(f"oracle: RWKV blocks are RWKV-7 or ARWKV style, got {style}")
        # the block oracles hard-code their eps
        if style == RWKV7_STYLE and self.norm_eps != LAYER_NORM_EPS:
            raise ValueError(f"oracle: RWKV-7 blocks use LayerNorm eps {LAYER_NORM_EPS}")
        if style == ARWKV_STYLE and self.rms_norm_eps != RMS_NORM_EPS:
            raise ValueError(f"oracle: ARWKV blocks use RMSNorm eps {RMS_NORM_EPS}")
        return style == ARWKV_STYLE


def spec_of(cfg) -> ModelSpec:
    """A ``ModelSpec`` with the fields of any config object that has them (``ModelConfig``)."""
    return ModelSpec(**{f.name: getattr(cfg, f.name) for f in fields(ModelSpec)})


def _norm_fwd(kind, x, p, prefix, eps):
    if kind == "layer":
        return layer_norm_fwd_np(x, p[f"{prefix}_w"], p[f"{prefix}_b"], eps=eps)
    return rms_norm_fwd_np(x, p[f"{prefix}_w"], eps=eps)


def _norm_bwd(kind, cache, dy, grads, prefix):
    if kind == "layer":
        dx, grads[f"{prefix}_w"], grads[f"{prefix}_b"] = layer_norm_bwd_np(cache, dy)
    else:
        dx, grads[f"{prefix}_w"] = rms_norm_bwd_np(cache, dy)
    return dx


def model_fwd_np(tokens, p: dict, spec: ModelSpec, *, states=None, selections=None):
    """Logits ``[B, T, V]`` of ``tokens [B, T]`` (integers), and the cache for the backward.

    ``states``: ``{layer index: [B, H, N, N]}`` initial WKV states of RWKV blocks (others start
    at zero). ``selections``: ``{layer index: [B, Hq, T, T] bool}`` pins the MoBA masks; the ones
    used are in ``cache['selections']`` (pass them back to hold the selection fixed).
    """
    states, selections = states or {}, dict(selections or {})
    arwkv = spec.arwkv if "rwkv7" in spec.block_types else False
    h = embedding_fwd_np(p["emb"], tokens)
    cache = {"tokens": tokens, "spec": spec, "p": p, "blocks": [], "selections": selections}
    if spec.ln0:
        h, cache["ln0"] = layer_norm_fwd_np(h, p["ln0_w"], p["ln0_b"], eps=spec.norm_eps)
    v_first, n_rwkv = None, 0
    for i, kind in enumerate(spec.block_types):
        bp = sub_params(p, f"layers.{i}")
        if kind == "rwkv7":
            fwd = arwkv_block_fwd_np if arwkv else rwkv7_block_fwd_np
            h, _, v_out, c = fwd(
                h, bp, n_head=spec.n_heads, rwkv_index=n_rwkv, state=states.get(i), v_first=v_first
            )
            if n_rwkv == 0:
                v_first = v_out
            n_rwkv += 1
        elif kind == "moba":
            h, _, c = moba_block_fwd_np(
                h,
                bp,
                n_head=spec.n_q_heads,
                chunk_size=spec.moba_chunk_size,
                top_k=spec.moba_top_k,
                selection=selections.get(i),
            )
            selections[i] = c["selection"]
        elif kind == "qwen2":
            h, _, c = qwen2_block_fwd_np(
                h,
                bp,
                n_q_heads=spec.n_q_heads,
                n_kv_heads=spec.n_kv_heads,
                rope_theta=spec.rope_theta,
                rms_eps=spec.rms_norm_eps,
            )
        else:
            raise ValueError(f"oracle: unknown block type {kind!r}")
        cache["blocks"].append((kind, c))
    eps = spec.norm_eps if spec.final_norm == "layer" else spec.rms_norm_eps
    h, cache["norm"] = _norm_fwd(spec.final_norm, h, p, "norm", eps)
    cache["h_final"] = h
    W_head = p["emb"] if spec.tie_embeddings else p["W_head"]
    return head_fwd_np(h, W_head), cache


def model_bwd_np(cache: dict, d_logits) -> dict:
    """Backward of ``model_fwd_np`` (MoBA selections fixed): every key of p, and
    ``'layers.<i>.state'`` (the initial WKV state's gradient) for every RWKV block."""
    spec, p = cache["spec"], cache["p"]
    grads: dict = {}
    W_head = p["emb"] if spec.tie_embeddings else p["W_head"]
    d_h, d_W_head = head_bwd_np(cache["h_final"], W_head, d_logits)
    d_h = _norm_bwd(spec.final_norm, cache["norm"], d_h, grads, "norm")
    d_v_first = None  # the sum over the later RWKV blocks of their v_first gradients
    arwkv = spec.arwkv if "rwkv7" in spec.block_types else False
    for i in reversed(range(len(spec.block_types))):
        kind, c = cache["blocks"][i]
        if kind == "rwkv7":
            bwd = arwkv_block_bwd_np if arwkv else rwkv7_block_bwd_np
            if c["rwkv_index"] == 0:
                g = bwd(c, d_h, d_v_first=d_v_first)
            else:
                g = bwd(c, d_h)
                d_v_first = g["v_first"] if d_v_first is None else d_v_first + g["v_first"]
            grads[f"layers.{i}.state"] = g["state"]
            skip = ("h", "shift_att", "shift_ffn", "state", "v_first")
        elif kind == "moba":
            g = moba_block_bwd_np(c, d_h)
            skip = ("h", "shift_ffn")
        else:
            g = qwen2_block_bwd_np(c, d_h)
            skip = ("h",)
        grads.update({f"layers.{i}.{k}": v for k, v in g.items() if k not in skip})
        d_h = g["h"]
    if spec.ln0:
        d_h, grads["ln0_w"], grads["ln0_b"] = layer_norm_bwd_np(cache["ln0"], d_h)
    grads["emb"] = embedding_bwd_np(d_h, cache["tokens"], p["emb"].shape[0])
    if spec.tie_embeddings:
        grads["emb"] = grads["emb"] + d_W_head
    else:
        grads["W_head"] = d_W_head
    return grads


def init_model_params(rng: np.random.Generator, spec: ModelSpec) -> dict:
    """Foundry's non-degenerate init of every parameter of ``model_fwd_np``."""
    C, V, F = spec.hidden_size, spec.vocab_size, spec.intermediate_size
    p = {"emb": seeded_uniform(rng, (V, C), 1.0)}
    if spec.ln0:
        p.update(init_norm(rng, C, "ln0", True))
    low_rank = dict(
        Dw=spec.decay_low_rank, Da=spec.a_low_rank, Dv=spec.v_low_rank, Dg=spec.gate_low_rank
    )
    n_rwkv = 0
    for i, kind in enumerate(spec.block_types):
        if kind == "rwkv7":
            init = init_arwkv_block_params if spec.arwkv else init_rwkv7_block_params
            bp = init(rng, C, spec.n_heads, F, rwkv_index=n_rwkv, **low_rank)
            n_rwkv += 1
        elif kind == "moba":
            bp = init_moba_block_params(rng, C, F)
        else:
            bp = init_qwen2_block_params(
                rng, C, spec.n_q_heads, spec.n_kv_heads, spec.attn_head_dim, F
            )
        p.update({f"layers.{i}.{k}": v for k, v in bp.items()})
    p.update(init_norm(rng, C, "norm", spec.final_norm == "layer"))
    if not spec.tie_embeddings:
        p["W_head"] = seeded_uniform(rng, (V, C), 0.6)
    return p
