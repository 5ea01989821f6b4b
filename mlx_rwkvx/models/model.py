"""The model: embedding, the blocks ``block_types`` lists, final norm, head.

Follows mlx-lm's model protocol (``model(tokens, cache) -> logits``, ``model.make_cache()``,
``model.layers``), so mlx-lm's generation utilities take it as is; ``hidden`` and ``head`` split
the call so training can fuse head and loss and generation can run the head on the last
position only.
"""

from __future__ import annotations

from mlx_rwkvx.models.attention import MobaBlock, MobaBlockCache, Qwen2Block
from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.init import initialise
from mlx_rwkvx.models.rwkv7 import RWKV7Block, make_norm

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache, KVCache

GROUP_SIZE = 64
# RWKV-7's low-rank projections are small and sensitive: they stay in floating point
_LOW_RANK = (".decay.", ".iclr.", ".value_mix.", ".gate.")


def quantizable(group_size: int = GROUP_SIZE):
    """The predicate ``(path, module) -> bool`` of what is quantized: every large projection,
    the head and the embedding whose input width is a multiple of ``group_size``; not RWKV-7's
    low-rank matrices."""

    def predicate(path: str, module: nn.Module) -> bool:
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            return False
        if any(s in path for s in _LOW_RANK):
            return False
        return module.weight.shape[-1] % group_size == 0

    return predicate


class Model(nn.Module):
    """A model of ``cfg``. ``init``: ``"seeds"`` (default, seeded and non-degenerate),
    ``"pretrain"`` (RWKV-7's published init) or None (leave MLX's, e.g. before loading weights).
    """

    def __init__(self, cfg: ModelConfig, *, init: str | None = "seeds", seed: int = 0):
        super().__init__()
        self.config = cfg
        self.model_type = "mlx_rwkvx"
        C = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, C)
        if cfg.ln0:
            self.ln0 = nn.LayerNorm(C, eps=cfg.norm_eps)
        self.layers = []
        n_rwkv = 0
        for kind in cfg.block_types:
            if kind == "rwkv7":
                self.layers.append(RWKV7Block(cfg, n_rwkv))
                n_rwkv += 1
            elif kind == "moba":
                self.layers.append(MobaBlock(cfg))
            else:
                self.layers.append(Qwen2Block(cfg))
        self.norm = make_norm(cfg.final_norm, C, cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
        if init is not None:
            initialise(self, init, seed)

    def quantize(self, bits: int = 8, group_size: int = GROUP_SIZE) -> Model:
        """Quantize the large projections, head and embedding in place (``nn.QuantizedLinear``,
        ``nn.QuantizedEmbedding``); RWKV-7's low-rank projections and the norms stay float."""
        nn.quantize(self, group_size, bits, class_predicate=quantizable(group_size))
        self.config.quantization = {"group_size": group_size, "bits": bits}
        return self

    def make_cache(self) -> list:
        """One cache per block: ArraysCache(3) (RWKV), MobaBlockCache (MoBA), KVCache (Qwen2)."""
        caches = []
        for layer in self.layers:
            if layer.kind == "rwkv7":
                caches.append(ArraysCache(size=3))
            elif layer.kind == "moba":
                caches.append(MobaBlockCache(self.config.moba_chunk_size))
            else:
                caches.append(KVCache())
        return caches

    def hidden(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        """``tokens [B, T]`` -> final normalised hidden states ``[B, T, C]`` (before the head)."""
        if tokens.ndim != 2:
            raise ValueError(f"model: tokens must be [B, T], got shape {tuple(tokens.shape)}")
        h = self.embed(tokens)
        if "ln0" in self:
            h = self.ln0(h)
        caches = cache if cache is not None else [None] * len(self.layers)
        v_first = None
        for layer, c in zip(self.layers, caches, strict=True):
            h, v_first = layer(h, v_first, c)
        return self.norm(h)

    def head(self, h: mx.array) -> mx.array:
        """Hidden states ``[..., C]`` -> logits ``[..., vocab]``."""
        if self.config.tie_embeddings:
            return self.embed.as_linear(h)
        return self.lm_head(h)

    def __call__(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        return self.head(self.hidden(tokens, cache))
