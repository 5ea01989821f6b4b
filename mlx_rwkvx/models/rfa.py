"""An RFA model made from a Qwen2 one: the attention of the layers not kept as Qwen2 becomes an
ARWKV time-mix initialised from it (``convert --to-rfa``). Entry point: ``qwen2_to_rfa``."""

from __future__ import annotations

from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.models.config import RFA_SWITCHES, rfa_config
from mlx_rwkvx.models.model import Model

import mlx.core as mx


def qwen2_to_rfa(model: Model, qwen_layers: list[int], head_size: int = 64, seed: int = 0) -> Model:
    """An RFA model from a model of Qwen2 blocks: layers not in ``qwen_layers`` get an ARWKV
    time-mix with receptance from q_proj, key and value from k_proj and v_proj repeated over the
    KV groups, output from o_proj, the rest the default init; MLP and norms are kept. The q, k, v
    biases of replaced layers have no place in a time-mix and are dropped. ``head_size``: the
    WKV head size (the 1.5B reference: 24 heads of 64)."""
    cfg = model.config
    if set(cfg.block_types) != {"qwen2"}:
        raise UsageError("--to-rfa needs a Qwen2 checkpoint (a model of Qwen2 blocks only)")
    n = len(cfg.block_types)
    bad = [i for i in qwen_layers if not 0 <= i < n]
    if bad:
        raise UsageError(f"--qwen-layers {bad} outside 0..{n - 1}")
    if cfg.n_q_heads * cfg.attn_head_dim != cfg.hidden_size:
        raise UsageError("--to-rfa needs n_q_heads * head_dim == hidden_size")
    fields = {k: v for k, v in cfg.to_dict().items() if k != "block_types"}
    fields.update(
        RFA_SWITCHES,
        block_types=["qwen2" if i in qwen_layers else "rwkv7" for i in range(n)],
        head_size=head_size,
    )
    try:
        new_cfg = rfa_config(**fields)
    except ValueError as e:
        raise UsageError(f"--to-rfa: {e}") from e
    new = Model(new_cfg, seed=seed)
    new.set_dtype(model.embed.weight.dtype)  # the new time-mixes in the checkpoint's dtype
    groups = cfg.n_q_heads // cfg.n_kv_heads
    D = cfg.attn_head_dim
    for old, block in zip(model.layers, new.layers, strict=True):
        if block.kind == "qwen2":
            block.update(old.parameters())
            continue
        attn = old.self_attn

        def per_query_head(w):  # [n_kv * D, C] -> [n_q * D, C]: each KV head G times
            return mx.repeat(w.reshape(cfg.n_kv_heads, D, -1), groups, axis=0).reshape(
                -1, w.shape[-1]
            )

        block.tmix.receptance.weight = attn.q_proj.weight
        block.tmix.key.weight = per_query_head(attn.k_proj.weight)
        block.tmix.value.weight = per_query_head(attn.v_proj.weight)
        block.tmix.output.weight = attn.o_proj.weight
        block.ln1.weight = old.input_layernorm.weight
        block.ln2.weight = old.post_attention_layernorm.weight
        block.ffn.update(old.mlp.parameters())
    new.embed.update(model.embed.parameters())
    new.norm.update(model.norm.parameters())
    if "lm_head" in model:
        new.lm_head.update(model.lm_head.parameters())
    return new
