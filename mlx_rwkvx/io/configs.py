"""Model configs of every format: read (native ``config.json`` or metadata; Hugging Face
configs field by field; inferred from the tensors where a format has none) and written."""

from __future__ import annotations

from mlx_rwkvx.io.atomic import CheckpointError
from mlx_rwkvx.models.config import ModelConfig, rfa_config

import mlx.core as mx

# mx.quantize's bits and group sizes: what a quantized checkpoint may hold
QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)


def need(path: str, tensors: dict, name: str) -> mx.array:
    if name not in tensors:
        raise CheckpointError(f"{path}: missing tensor {name!r}")
    return tensors[name]


def matrix_shape(path: str, tensors: dict, name: str) -> tuple[int, int]:
    """The shape of a tensor that must be a matrix (sizes are read from it)."""
    shape = tuple(need(path, tensors, name).shape)
    if len(shape) != 2:
        raise CheckpointError(f"{path}: {name} has shape {shape}, expected a matrix")
    return shape


# What BlinkDL's and flash-linear-attention's RWKV-7 always have: a missing gate, group norm,
# ln0 or head is a damaged file (a missing-tensor error), not a different model
RWKV7_FIXED = dict(use_gate=True, use_ln_x=True, ln0=True, tie_embeddings=False)


def rwkv7_config_from_native(path: str, t: dict, block_types=None, **fixed) -> ModelConfig:
    """An RWKV-7 config whose sizes are read from native-named tensors (formats without a
    config); ``fixed`` fields are not inferred. ``block_types``: the layout when it holds more
    than RWKV-7 blocks (their sizes are read from the RWKV-7 ones)."""
    vocab, C = matrix_shape(path, t, "embed.weight")
    layers = sorted({int(n.split(".")[1]) for n in t if n.startswith("layers.")})
    if not layers:
        raise CheckpointError(f"{path}: no RWKV blocks found")
    block_types = block_types or ["rwkv7"] * (layers[-1] + 1)
    rwkv = [i for i, kind in enumerate(block_types) if kind == "rwkv7"]
    H, N = matrix_shape(path, t, "layers.0.tmix.r_k")
    tm = "layers.0.tmix"
    gate = f"{tm}.gate.down.weight" in t
    v_mix = f"layers.{rwkv[1]}.tmix.value_mix.down.weight" if len(rwkv) > 1 else None
    v_rank = t[v_mix].shape[0] if v_mix in t else None
    fields = dict(
        vocab_size=vocab,
        hidden_size=C,
        block_types=block_types,
        head_size=N,
        intermediate_size=need(path, t, "layers.0.ffn.key.weight").shape[0],
        decay_low_rank=need(path, t, f"{tm}.decay.down.weight").shape[0],
        a_low_rank=need(path, t, f"{tm}.iclr.down.weight").shape[0],
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


# The RWKV-X authors' checkpoints carry no config. Their attention has heads of 64 (their
# loader: n_head = n_embd // 64) and no MoBA settings of its own: their inference attends densely
# over the prompt, and their long-context training (pretrain/training-run_prolong_0.2B.sh in
# howard-hou/RWKV-X, the 0.2B 64k model) used chunks of 2048 and a top-k of 4 counting the
# query's own chunk, our top_k 3; 64k context (64,000 tokens trained, 65,536 kept: 32 chunks).
RWKVX_FIXED = dict(
    RWKV7_FIXED, attn_head_dim=64, moba_chunk_size=2048, moba_top_k=3, max_cache=65536
)


def rwkvx_config(path: str, t: dict, block_types: list[str]) -> ModelConfig:
    """The config of an RWKV-X checkpoint in its authors' layout (see ``RWKVX_FIXED``)."""
    C = matrix_shape(path, t, "embed.weight")[1]
    if C % 64:
        raise CheckpointError(
            f"{path}: hidden size {C} is not a multiple of 64, the RWKV-X authors' attention "
            "head size"
        )
    return rwkv7_config_from_native(path, t, block_types, n_q_heads=C // 64, **RWKVX_FIXED)


def native_config(path: str, d: dict) -> tuple[ModelConfig, dict | None]:
    """A native config (every field required) and its quantization (None: float)."""
    if not isinstance(d, dict):
        raise CheckpointError(f"{path}: bad config (expected a JSON object)")
    d = {k: v for k, v in d.items() if k != "format"}
    quantization = check_quantization(path, d.pop("quantization", None))
    try:
        return ModelConfig.from_dict(d, complete=True), quantization
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: bad config ({e})") from e


def check_quantization(path: str, q) -> dict | None:
    """A checkpoint's ``quantization`` entry: null or ``{"group_size", "bits"}`` that
    ``mx.quantize`` takes."""
    if q is not None and (
        not isinstance(q, dict)
        or set(q) != {"group_size", "bits"}
        or q["group_size"] not in QUANT_GROUP_SIZES
        or q["bits"] not in QUANT_BITS
    ):
        raise CheckpointError(
            f"{path}: bad config (quantization must be null or {{'group_size': one of "
            f"{QUANT_GROUP_SIZES}, 'bits': one of {QUANT_BITS}}}, got {q!r})"
        )
    return q


def native_config_dict(cfg: ModelConfig, quantization: dict | None) -> dict:
    """What a native ``config.json`` (or a single file's metadata) holds."""
    return {**cfg.to_dict(), "quantization": quantization}


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


class HFConfig:
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

    def get_int(self, key: str) -> int:
        """A required size: an int >= 1 (sizes computed from it must not fail on a string)."""
        value = self.get(key, required=True)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            self.refuse(key, "expected an integer >= 1")
        return value

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


def _agree(cfg: HFConfig, key: str, value, from_tensors) -> None:
    """A config field that the tensors also tell must agree with them."""
    if value is not None and value != from_tensors:
        raise CheckpointError(
            f"{cfg.path}: {key} = {value!r}, but the tensors say {from_tensors!r}"
        )


def hf_rwkv7_config(path: str, hf: dict, tensors: dict) -> ModelConfig:
    """flash-linear-attention's RWKV7Config (as mlx-lm reads it), checked against the
    tensors the sizes are read from."""
    c = HFConfig(
        path,
        hf,
        frozenset(
            "attn_mode fuse_norm fuse_cross_entropy fuse_linear_cross_entropy use_l2warp".split()
        ),
    )
    inferred = rwkv7_config_from_native(
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
        if not isinstance(ratio, (int, float)) or isinstance(ratio, bool):
            c.refuse("hidden_ratio", "expected a number")
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


def _qwen2_rope_theta(c: HFConfig) -> float:
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


def qwen2_config(path: str, hf: dict, tensors: dict) -> ModelConfig:
    """transformers' Qwen2Config (4.x and 5.x layouts). Sizes are required; fields with a
    transformers default take that default, as transformers does."""
    c = HFConfig(path, hf, frozenset({"attention_dropout", "max_window_layers"}))
    C = c.get_int("hidden_size")
    n_heads = c.get_int("num_attention_heads")
    if c.get("hidden_act", "silu") != "silu":
        c.refuse("hidden_act", "Qwen2's MLP is SwiGLU ('silu')")
    if c.get("use_sliding_window", False):
        c.refuse("use_sliding_window", "sliding-window attention is not supported")
    c.get("sliding_window")  # used only with use_sliding_window
    kinds = c.get("layer_types", ["full_attention"])
    if not isinstance(kinds, list) or set(kinds) != {"full_attention"}:
        c.refuse("layer_types", "only full attention layers are supported")
    if c.get("quantization_config") is not None:
        c.refuse("quantization_config", "quantized Hugging Face checkpoints are not supported")
    tie = c.get("tie_word_embeddings", False)  # Qwen2Config's default
    fields = dict(
        vocab_size=c.get("vocab_size", required=True),
        hidden_size=C,
        block_types=["qwen2"] * c.get_int("num_hidden_layers"),
        intermediate_size=c.get("intermediate_size", required=True),
        n_q_heads=n_heads,
        n_kv_heads=c.get("num_key_value_heads", n_heads),
        attn_head_dim=c.get("head_dim", C // n_heads),
        rope_theta=_qwen2_rope_theta(c),
        rms_norm_eps=c.get("rms_norm_eps", 1e-6),
        tie_embeddings=tie,
    )
    c.finish()
    return _build_config(path, rfa_config, **fields)


def qwen2_config_dict(cfg: ModelConfig) -> dict:
    """transformers' Qwen2 ``config.json`` of a model of Qwen2 blocks (4.x layout, which
    transformers 5 reads too); ``head_dim`` only where it is not hidden_size / heads."""
    head_dim = {}
    if cfg.attn_head_dim * cfg.n_q_heads != cfg.hidden_size:
        head_dim["head_dim"] = cfg.attn_head_dim
    return {
        "model_type": "qwen2",
        "architectures": ["Qwen2ForCausalLM"],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": len(cfg.block_types),
        "num_attention_heads": cfg.n_q_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        **head_dim,
        "rope_theta": cfg.rope_theta,
        "rms_norm_eps": cfg.rms_norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings,
    }


def hf_rwkv7_config_dict(cfg: ModelConfig) -> dict:
    """flash-linear-attention's RWKV-7 ``config.json`` (as mlx-lm reads it)."""
    return {
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
