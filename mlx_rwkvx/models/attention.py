"""The attention blocks of the hybrids: MoBA (RWKV-X) and Qwen2 GQA (RFA)."""

from __future__ import annotations

import math

from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.rwkv7 import ChannelMix, SwiGLU
from mlx_rwkvx.ops.moba import MobaKVCache, moba_attention, moba_decode

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import cache as mlx_lm_cache
from mlx_lm.models.cache import KVCache, _BaseCache


class MobaBlockCache(_BaseCache):
    """What a MoBA block needs to continue: its KV cache with chunk key sums, and the
    channel-mix token shift (index 2, as in an RWKV block's ArraysCache)."""

    def __init__(self, chunk_size: int):
        self.kv = MobaKVCache(chunk_size)
        self.shift = None

    def __getitem__(self, i):
        if i != 2:
            raise IndexError(i)
        return self.shift

    def __setitem__(self, i, value):
        if i != 2:
            raise IndexError(i)
        self.shift = value

    @property
    def offset(self) -> int:
        return self.kv.offset

    @property
    def state(self):
        """Arrays only (mlx-lm evaluates and saves them): the keys, values and key sums so far,
        the chunk size, and the channel-mix shift (empty when there is none yet)."""
        kv = self.kv
        shift = mx.zeros((0,)) if self.shift is None else self.shift
        if kv.keys is None:
            nothing = mx.zeros((0,))
            return [nothing, nothing, nothing, mx.array([kv.chunk_size]), shift]
        used = -(-kv.offset // kv.chunk_size)
        return [
            kv.keys[:, :, : kv.offset],
            kv.values[:, :, : kv.offset],
            kv.key_sums[:, :, :used],
            mx.array([kv.chunk_size]),
            shift,
        ]

    @state.setter
    def state(self, v):
        keys, values, sums, chunk_size, shift = v
        cs = int(chunk_size.item())
        self.kv = MobaKVCache(cs)
        self.shift = None if shift.size == 0 else shift
        if keys.size == 0:
            return
        B, Hkv, n, D = keys.shape
        capacity = -(-n // cs) * cs
        pad = ((0, 0), (0, 0), (0, capacity - n), (0, 0))
        self.kv.keys, self.kv.values = mx.pad(keys, pad), mx.pad(values, pad)
        self.kv.key_sums, self.kv.offset = sums, n

    def empty(self):
        return self.kv.keys is None

    @property
    def nbytes(self):
        return sum(x.nbytes for x in self.state)


# mlx-lm's load_prompt_cache looks cache classes up by name in its own cache module: ours must
# be there for a saved RWKV-X prompt cache to load.
mlx_lm_cache.MobaBlockCache = MobaBlockCache


class MobaAttention(nn.Module):
    """C x C query/key/value/output projections around MoBA sparse attention; no positions."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C = cfg.hidden_size
        self.n_heads, self.head_dim = cfg.n_q_heads, cfg.attn_head_dim
        self.chunk_size, self.top_k = cfg.moba_chunk_size, cfg.moba_top_k
        self.q_proj = nn.Linear(C, C, bias=False)
        self.k_proj = nn.Linear(C, C, bias=False)
        self.v_proj = nn.Linear(C, C, bias=False)
        self.o_proj = nn.Linear(C, C, bias=False)

    def __call__(self, x, cache: MobaBlockCache | None = None):
        B, T, C = x.shape
        shape = (B, T, self.n_heads, self.head_dim)
        q, k, v = (p(x).reshape(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        if cache is None:
            out = moba_attention(q, k, v, chunk_size=self.chunk_size, top_k=self.top_k)
        else:
            cache.kv.update(k, v)
            if T == 1:
                out = moba_decode(q, cache.kv, top_k=self.top_k)
            else:
                keys, values = cache.kv.kv()
                out = moba_attention(q, keys, values, chunk_size=self.chunk_size, top_k=self.top_k)
        return self.o_proj(out.reshape(B, T, C))


class MobaBlock(nn.Module):
    """RWKV-X attention block: ``h += o(MoBA(ln1 h)); h += ChannelMix(ln2 h)`` (LayerNorms)."""

    kind = "moba"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = MobaAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ffn = ChannelMix(cfg)

    def cache_problem(self, cache, batch: int) -> str | None:
        """Why ``cache`` cannot continue this block for ``batch`` rows (None if it can)."""
        if not isinstance(cache, MobaBlockCache):
            return f"expected a MobaBlockCache, got {type(cache).__name__}"
        if cache.kv.chunk_size != self.attn.chunk_size:
            return f"chunk size {cache.kv.chunk_size}, expected {self.attn.chunk_size}"
        C = self.attn.n_heads * self.attn.head_dim
        problem = _kv_problem(cache.kv.keys, batch, self.attn.n_heads, self.attn.head_dim)
        if problem is None and cache.shift is not None and cache.shift.shape != (batch, 1, C):
            problem = f"token shift of shape {tuple(cache.shift.shape)}, expected {(batch, 1, C)}"
        return problem

    def __call__(self, h, v_first, cache=None):
        h = h + self.attn(self.ln1(h), cache)
        return h + self.ffn(self.ln2(h), cache), v_first


class Qwen2Attention(nn.Module):
    """Qwen2 GQA self-attention: biases on q, k, v (not o), RoPE (non-interleaved)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, D = cfg.hidden_size, cfg.attn_head_dim
        self.n_q, self.n_kv, self.head_dim = cfg.n_q_heads, cfg.n_kv_heads, D
        self.scale = 1.0 / math.sqrt(D)
        self.q_proj = nn.Linear(C, self.n_q * D, bias=True)
        self.k_proj = nn.Linear(C, self.n_kv * D, bias=True)
        self.v_proj = nn.Linear(C, self.n_kv * D, bias=True)
        self.o_proj = nn.Linear(self.n_q * D, C, bias=False)
        self.rope = nn.RoPE(D, traditional=False, base=cfg.rope_theta)

    def __call__(self, x, cache: KVCache | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_q, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        offset = 0 if cache is None else cache.offset
        q, k = self.rope(q, offset=offset), self.rope(k, offset=offset)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        mask = _causal_mask(T, k.shape[2]) if T > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, T, -1))


def _kv_problem(keys, batch: int, heads: int, head_dim: int) -> str | None:
    """Keys cached head-major ``[B, heads, n, D]`` that do not fit: why (None if they do)."""
    if keys is None:
        return None
    B, H, _, D = keys.shape
    if (B, H, D) != (batch, heads, head_dim):
        return (
            f"keys for batch {B}, {H} heads of {D}; expected batch {batch}, {heads} heads of "
            f"{head_dim} (a cache from another model or batch size?)"
        )
    return None


def _causal_mask(T: int, S: int):
    # the queries are the last T of S positions
    if T == S:
        return "causal"
    return mx.arange(S)[None, :] <= mx.arange(S - T, S)[:, None]


class Qwen2Block(nn.Module):
    """``h += Attn(RMSNorm h); h += SwiGLU(RMSNorm h)``, Hugging Face Qwen2 names."""

    kind = "qwen2"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Qwen2Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def cache_problem(self, cache, batch: int) -> str | None:
        """Why ``cache`` cannot continue this block for ``batch`` rows (None if it can)."""
        if not isinstance(cache, KVCache):
            return f"expected a KVCache, got {type(cache).__name__}"
        attn = self.self_attn
        return _kv_problem(cache.keys, batch, attn.n_kv, attn.head_dim)

    def __call__(self, h, v_first, cache=None):
        h = h + self.self_attn(self.input_layernorm(h), cache)
        return h + self.mlp(self.post_attention_layernorm(h)), v_first
