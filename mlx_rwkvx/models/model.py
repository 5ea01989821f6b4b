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
        self.check_token_ids = True  # see check_tokens
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

    def check_tokens(self, tokens) -> None:
        """Raise a ValueError (TypeError for a non-array) unless ``tokens`` is an integer
        ``[B, T]`` array of ids in ``0 .. vocab_size - 1``. The range check reads the ids back
        from the device (a host sync): ``model.check_token_ids = False`` turns it off where the
        caller checked them already; an id out of range then gives NaN logits, never a crash.
        """
        if not isinstance(tokens, mx.array):
            raise TypeError(
                f"model: tokens must be an mx.array of integer ids [B, T], got "
                f"{type(tokens).__name__}"
            )
        if tokens.ndim != 2 or tokens.size == 0:
            raise ValueError(f"model: tokens must be [B, T] with B, T >= 1, got {tokens.shape}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise ValueError(f"model: tokens must be integer ids, got dtype {tokens.dtype}")
        if self.check_token_ids:
            lo, hi = mx.min(tokens).item(), mx.max(tokens).item()
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"model: token id {bad} is outside the vocabulary (0 .. "
                    f"{self.config.vocab_size - 1})"
                )

    def check_cache(self, cache: list, batch: int) -> None:
        """One ValueError if ``cache`` does not belong to this model and batch size."""
        if not isinstance(cache, (list, tuple)) or len(cache) != len(self.layers):
            n = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
            raise ValueError(
                f"model: the cache has {n} entries for {len(self.layers)} layers "
                "(use model.make_cache())"
            )
        for i, (layer, c) in enumerate(zip(self.layers, cache, strict=True)):
            problem = layer.cache_problem(c, batch)
            if problem:
                raise ValueError(f"model: cache[{i}] ({layer.kind} block): {problem}")

    def _embed(self, tokens: mx.array) -> mx.array:
        if self.check_token_ids:
            return self.embed(tokens)
        # ids not checked: a bad one must not read outside the table (a crash); it gives NaN
        valid = (tokens >= 0) & (tokens < self.config.vocab_size)
        h = self.embed(mx.where(valid, tokens, 0))
        return mx.where(valid[..., None], h, mx.array(mx.nan, h.dtype))

    def hidden(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        """``tokens [B, T]`` -> final normalised hidden states ``[B, T, C]`` (before the head)."""
        self.check_tokens(tokens)
        if cache is not None:
            self.check_cache(cache, tokens.shape[0])
        h = self._embed(tokens)
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
