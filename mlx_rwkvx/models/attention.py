"""The attention blocks of the hybrids: MoBA (RWKV-X) and Qwen2 GQA (RFA).

Their state is their KV cache as plain arrays of its exact length, head-major
``[B, Hkv, S, D]`` (S, the tokens seen, is the shape: no counter to keep), plus for MoBA each
chunk's key sum and the channel-mix token shift.
"""

from __future__ import annotations

import math

from mlx_rwkvx.models.cache import row_of, stack_padded
from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.rwkv7 import ChannelMix, SwiGLU, state_problem
from mlx_rwkvx.ops.moba import append_kv, empty_kv, moba_attention, moba_decode, time_major

import mlx.core as mx
import mlx.nn as nn


class KVRows:
    """A batch of rows with KV caches of their own lengths: the rows' state, right-padded to
    the longest, with ``"lengths"`` (a list, one per row) when they differ."""

    chunk_size = 1  # how many tokens fill one entry of "key_sums" (MoBA's chunk size)

    def state_length(self, state: dict) -> int:
        return state["keys"].shape[2]

    def row_state(self, state: dict, b: int, n: int) -> dict:
        """Row ``b``'s own state, of its ``n`` tokens."""
        return row_of(state, b, n, self.chunk_size)

    def stack_rows(self, rows: list[dict]) -> dict:
        """The rows' states stacked, the time arrays right-padded with zeros."""
        return {name: stack_padded([r[name] for r in rows]) for name in rows[0]}

    def lengths_problem(self, state, batch: int) -> tuple[dict, str | None]:
        """``state`` without its row lengths, and what is wrong with them (None: nothing)."""
        if not isinstance(state, dict) or "lengths" not in state:
            return state, None
        lengths = state["lengths"]
        state = {k: v for k, v in state.items() if k != "lengths"}
        keys = state.get("keys")
        S = keys.shape[2] if isinstance(keys, mx.array) and keys.ndim == 4 else 0
        if (
            not isinstance(lengths, list)
            or len(lengths) != batch
            or any(not 0 <= n <= S for n in lengths)
        ):
            return state, f"lengths must be {batch} row lengths of at most {S}, got {lengths!r}"
        return state, None


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

    def __call__(self, x, keys, values, key_sums):
        """x ``[B, T, C]`` after the tokens the cache ``(keys, values, key_sums)`` holds.
        Returns (out, the cache with x's keys and values appended)."""
        B, T, C = x.shape
        shape = (B, T, self.n_heads, self.head_dim)
        q, k, v = (p(x).reshape(shape) for p in (self.q_proj, self.k_proj, self.v_proj))
        seen = keys.shape[2]
        cache = append_kv(keys, values, key_sums, k, v, self.chunk_size)  # in the cache's dtype
        attend = dict(chunk_size=self.chunk_size, top_k=self.top_k)
        if seen == 0:  # a fresh text: attend to this call's keys as they are
            out = moba_attention(q, k, v, **attend)
        elif T == 1:
            out = moba_decode(q.astype(keys.dtype), *cache, **attend)
        else:  # the queries are the last T of the cached keys
            keys_all, values_all = time_major(cache[0]), time_major(cache[1])
            out = moba_attention(q.astype(keys.dtype), keys_all, values_all, **attend)
        return self.o_proj(out.astype(x.dtype).reshape(B, T, C)), cache


class MobaBlock(KVRows, nn.Module):
    """RWKV-X attention block: ``h += o(MoBA(ln1 h)); h += ChannelMix(ln2 h)`` (LayerNorms)."""

    kind = "moba"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.chunk_size = cfg.moba_chunk_size
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = MobaAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.ffn = ChannelMix(cfg)

    def init_state(self, batch: int) -> dict:
        """An empty KV cache and a zero token shift."""
        dtype = self.ln1.weight.dtype
        keys, values, key_sums = empty_kv(batch, self.attn.n_heads, self.attn.head_dim, dtype)
        C = self.attn.n_heads * self.attn.head_dim
        shift = mx.zeros((batch, 1, C), dtype=dtype)
        return {"keys": keys, "values": values, "key_sums": key_sums, "ffn_shift": shift}

    def state_problem(self, state, batch: int) -> str | None:
        state, problem = self.lengths_problem(state, batch)
        if problem:
            return problem
        H, D, cs = self.attn.n_heads, self.attn.head_dim, self.attn.chunk_size
        keys = state.get("keys") if isinstance(state, dict) else None
        S = keys.shape[2] if isinstance(keys, mx.array) and keys.ndim == 4 else 0
        return state_problem(
            state,
            {
                "keys": (batch, H, S, D),
                "values": (batch, H, S, D),
                "key_sums": (batch, H, -(-S // cs), D),
                "ffn_shift": (batch, 1, H * D),
            },
        )

    def trim_state(self, state: dict, max_tokens: int) -> dict:
        """The state with its KV cache cut to at most the last ``max_tokens`` tokens, whole
        chunks dropped from the front so that the kept ones stay aligned with their key sums
        (MoBA has no positions: what is kept attends as it did)."""
        S, cs = state["keys"].shape[2], self.attn.chunk_size
        if S <= max_tokens:
            return state
        drop = -(-(S - max_tokens) // cs) * cs
        return {
            **state,
            "keys": state["keys"][:, :, drop:],
            "values": state["values"][:, :, drop:],
            "key_sums": state["key_sums"][:, :, drop // cs :],
        }

    def __call__(self, h, v_first, state):
        """h ``[B, T, C]`` -> (h, v_first, new state)."""
        a, (keys, values, key_sums) = self.attn(
            self.ln1(h), state["keys"], state["values"], state["key_sums"]
        )
        h = h + a
        dh, shift = self.ffn(self.ln2(h), state["ffn_shift"])
        new = {"keys": keys, "values": values, "key_sums": key_sums, "ffn_shift": shift}
        return h + dh, v_first, new


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

    def __call__(self, x, keys, values):
        """x ``[B, T, C]`` at the positions after the ``S`` tokens of the cache ``keys, values
        [B, n_kv, S, D]``. Returns (out, keys, values) with x's appended."""
        B, T, _ = x.shape
        q = self.q_proj(x).reshape(B, T, self.n_q, self.head_dim).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(B, T, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(B, T, self.n_kv, self.head_dim).transpose(0, 2, 1, 3)
        seen = keys.shape[2]
        q, k = self.rope(q, offset=seen), self.rope(k, offset=seen)
        # the cache keeps its dtype, whatever x's (a no-op when they agree)
        q, k, v = q.astype(keys.dtype), k.astype(keys.dtype), v.astype(values.dtype)
        if seen:
            k = mx.concatenate([keys, k], axis=2)
            v = mx.concatenate([values, v], axis=2)
        mask = _causal_mask(T, k.shape[2]) if T > 1 else None
        out = mx.fast.scaled_dot_product_attention(q, k, v, scale=self.scale, mask=mask)
        out = out.astype(x.dtype).transpose(0, 2, 1, 3).reshape(B, T, -1)
        return self.o_proj(out), k, v


def _causal_mask(T: int, S: int):
    # the queries are the last T of S positions
    if T == S:
        return "causal"
    return mx.arange(S)[None, :] <= mx.arange(S - T, S)[:, None]


class Qwen2Block(KVRows, nn.Module):
    """``h += Attn(RMSNorm h); h += SwiGLU(RMSNorm h)``, Hugging Face Qwen2 names."""

    kind = "qwen2"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Qwen2Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def init_state(self, batch: int) -> dict:
        """An empty KV cache."""
        attn = self.self_attn
        shape = (batch, attn.n_kv, 0, attn.head_dim)
        dtype = self.input_layernorm.weight.dtype
        return {"keys": mx.zeros(shape, dtype=dtype), "values": mx.zeros(shape, dtype=dtype)}

    def state_problem(self, state, batch: int) -> str | None:
        state, problem = self.lengths_problem(state, batch)
        if problem:
            return problem
        attn = self.self_attn
        keys = state.get("keys") if isinstance(state, dict) else None
        S = keys.shape[2] if isinstance(keys, mx.array) and keys.ndim == 4 else 0
        shape = (batch, attn.n_kv, S, attn.head_dim)
        return state_problem(state, {"keys": shape, "values": shape})

    def trim_state(self, state: dict, max_tokens: int) -> dict:
        """The state with its KV cache cut to its last ``max_tokens`` tokens. The kept keys
        are rotated back by the dropped count (RoPE composes: rotating by ``-d`` moves a key
        from position ``p`` to ``p - d``), so that the cache's length stays the next token's
        position and every query-key distance is what it was."""
        keys, values = state["keys"], state["values"]
        B, H, S, D = keys.shape
        if S <= max_tokens:
            return state
        drop = S - max_tokens
        kept = keys[:, :, drop:].astype(mx.float32)
        # one position per row: every key turns by the same -drop angles
        moved = self.self_attn.rope(kept.reshape(B, H * max_tokens, 1, D), offset=-drop)
        return {
            "keys": moved.reshape(B, H, max_tokens, D).astype(keys.dtype),
            "values": values[:, :, drop:],
        }

    def __call__(self, h, v_first, state):
        """h ``[B, T, C]`` -> (h, v_first, new state)."""
        a, keys, values = self.self_attn(self.input_layernorm(h), state["keys"], state["values"])
        h = h + a
        return (
            h + self.mlp(self.post_attention_layernorm(h)),
            v_first,
            {
                "keys": keys,
                "values": values,
            },
        )
