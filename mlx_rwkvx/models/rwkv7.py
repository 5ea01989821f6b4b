"""RWKV-7 ("x070") blocks: time-mix, channel-mix, and the ARWKV variant used by RFA.

Equations in DESIGN.md; the float64 oracle in tests/oracle/rwkv7.py is checked against them.
Parameter layouts follow BlinkDL's checkpoints: ``k_k``, ``k_a`` and the lerps ``x_*`` are
``[C]``, ``r_k`` is ``[H, N]``; every large projection is an ``nn.Linear`` (LoRA adapters and
quantization find them by module path).
"""

from __future__ import annotations

import math

from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.ops.wkv import wkv7

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

# log of the decay: -exp(-0.5) * sigmoid(z), so the decay exp(log_w) lies in (exp(-e^-0.5), 1) =
# (0.545, 1). Other code writes -0.606531 for -exp(-0.5).
DECAY_SCALE = math.exp(-0.5)
LN_X_EPS = 64e-5  # the per-head group norm of the WKV output
KK_NORM_FLOOR = 1e-12  # as torch's F.normalize


class LowRank(nn.Module):
    """``up(act(down(x)))``: RWKV-7's low-rank projections (w, a, v, g), not LoRA adapters.

    ``down.weight`` is BlinkDL's ``w1`` transposed, ``up.weight`` its ``w2`` transposed and
    ``up.bias`` its ``w0`` (the decay; likewise ``a0``, ``v0``).
    """

    def __init__(self, dims: int, rank: int, activation: str | None, bias: bool):
        super().__init__()
        self.down = nn.Linear(dims, rank, bias=False)
        self.up = nn.Linear(rank, dims, bias=bias)
        self.activation = activation

    def __call__(self, x: mx.array) -> mx.array:
        h = self.down(x)
        if self.activation == "tanh":
            h = mx.tanh(h)
        elif self.activation == "sigmoid":
            h = mx.sigmoid(h)
        return self.up(h)


class HeadNorm(nn.Module):
    """GroupNorm with one group per head (``ln_x``): normalise each head's N values."""

    def __init__(self, n_heads: int, head_size: int, eps: float = LN_X_EPS):
        super().__init__()
        self.weight = mx.ones((n_heads * head_size,))
        self.bias = mx.zeros((n_heads * head_size,))
        self.n_heads, self.eps = n_heads, eps

    def __call__(self, y: mx.array) -> mx.array:  # y [B, T, H, N] -> [B, T, C]
        B, T, H, N = y.shape
        y = mx.fast.layer_norm(y, None, None, self.eps).reshape(B, T, H * N)
        return y * self.weight + self.bias


def token_shift(x: mx.array, previous: mx.array | None) -> mx.array:
    """The previous token's x for every position: ``[B, T, C]`` (zeros, or ``previous``, first)."""
    first = mx.zeros_like(x[:, :1]) if previous is None else previous.astype(x.dtype)
    return mx.concatenate([first, x[:, :-1]], axis=1)


class TimeMix(nn.Module):
    """RWKV-7 time-mix: token shift, six lerps, low-rank w/a/v/g, WKV7, ln_x, bonus, output.

    ``layer_id`` is the index among RWKV blocks: block 0 produces ``v_first``, later ones mix
    their values towards it. With ``use_gate=False, use_ln_x=False`` it is the ARWKV variant.
    """

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        C, H, N = cfg.hidden_size, cfg.n_heads, cfg.head_size
        self.layer_id, self.n_heads, self.head_size = layer_id, H, N
        self.use_gate, self.use_ln_x = cfg.use_gate, cfg.use_ln_x
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a") + (("x_g",) if cfg.use_gate else ()):
            setattr(self, name, mx.zeros((C,)))
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.decay = LowRank(C, cfg.decay_low_rank, "tanh", bias=True)
        self.iclr = LowRank(C, cfg.a_low_rank, None, bias=True)
        if layer_id > 0:
            self.value_mix = LowRank(C, cfg.v_low_rank, None, bias=True)
        if cfg.use_gate:
            self.gate = LowRank(C, cfg.gate_low_rank, "sigmoid", bias=False)
        self.k_k = mx.zeros((C,))
        self.k_a = mx.zeros((C,))
        self.r_k = mx.zeros((H, N))
        if cfg.use_ln_x:
            self.ln_x = HeadNorm(H, N)

    def enable_state_tuning(self) -> None:
        """Add a trainable initial WKV state ``state0 [H, N, N]`` (zeros: no change at first)."""
        self.state0 = mx.zeros((self.n_heads, self.head_size, self.head_size))

    def initial_state(self, batch: int) -> mx.array | None:
        if "state0" not in self:
            return None
        return mx.broadcast_to(self.state0.astype(mx.float32), (batch, *self.state0.shape))

    def __call__(self, x, v_first, cache=None):
        """x ``[B, T, C]`` (already normalised). ``cache``: the block's ArraysCache, whose
        slot 0 is the token-shift vector and slot 1 the WKV state. Returns (out, v_first)."""
        B, T, C = x.shape
        H, N = self.n_heads, self.head_size
        xx = token_shift(x, None if cache is None else cache[0]) - x
        r = self.receptance(x + xx * self.x_r).reshape(B, T, H, N)
        k = self.key(x + xx * self.x_k).reshape(B, T, H, N)
        v = self.value(x + xx * self.x_v).reshape(B, T, H, N)
        z = self.decay(x + xx * self.x_w).astype(mx.float32)
        log_w = (-DECAY_SCALE * mx.sigmoid(z)).reshape(B, T, H, N)
        a = mx.sigmoid(self.iclr(x + xx * self.x_a)).reshape(B, T, H, N)
        kk = (k * self.k_k.reshape(H, N)).astype(mx.float32)
        kk = kk / mx.maximum(mx.linalg.norm(kk, axis=-1, keepdims=True), KK_NORM_FLOOR)
        kk = kk.astype(k.dtype)
        k = k * (1 + (a - 1) * self.k_a.reshape(H, N))
        if self.layer_id == 0:
            v_first = v
        else:
            mix = mx.sigmoid(self.value_mix(x + xx * self.x_v)).reshape(B, T, H, N)
            v = v + (v_first - v) * mix
        state = None if cache is None else cache[1]
        if state is None:
            state = self.initial_state(B)
        y, state = wkv7(r, log_w, k, v, -kk, kk * a, state)
        o = self.ln_x(y) if self.use_ln_x else y.reshape(B, T, C)
        bonus = (r * k * self.r_k).sum(axis=-1, keepdims=True) * v  # [B, T, H, N]
        o = o + bonus.reshape(B, T, C)
        if self.use_gate:
            o = o * self.gate(x + xx * self.x_g)
        if cache is not None:
            cache[0] = x[:, -1:]
            cache[1] = state
        return self.output(o), v_first


class ChannelMix(nn.Module):
    """RWKV-7 channel-mix: ``value(relu(key(x + (x_prev - x) * x_k))^2)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, F = cfg.hidden_size, cfg.intermediate_size
        self.x_k = mx.zeros((C,))
        self.key = nn.Linear(C, F, bias=False)
        self.value = nn.Linear(F, C, bias=False)

    def __call__(self, x, cache=None, slot: int = 2):
        """x ``[B, T, C]``; ``cache[slot]`` holds the previous token's x."""
        xx = token_shift(x, None if cache is None else cache[slot]) - x
        if cache is not None:
            cache[slot] = x[:, -1:]
        return self.value(mx.square(nn.relu(self.key(x + xx * self.x_k))))


class SwiGLU(nn.Module):
    """Qwen2's MLP: ``down(silu(gate(x)) * up(x))`` (also the FFN of ARWKV blocks)."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x, cache=None):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def make_norm(kind: str, dims: int, cfg: ModelConfig) -> nn.Module:
    return (
        nn.LayerNorm(dims, eps=cfg.norm_eps)
        if kind == "layer"
        else nn.RMSNorm(dims, eps=cfg.rms_norm_eps)
    )


class RWKV7Block(nn.Module):
    """``h = h + TMix(ln1(h)); h = h + FFN(ln2(h))``. RWKV-7: LayerNorm and channel-mix;
    ARWKV (RFA): RMSNorm and SwiGLU. Cache: ArraysCache of 3 (time-mix shift, WKV state,
    channel-mix shift)."""

    kind = "rwkv7"

    def __init__(self, cfg: ModelConfig, rwkv_index: int):
        super().__init__()
        self.ln1 = make_norm(cfg.rwkv_norm, cfg.hidden_size, cfg)
        self.tmix = TimeMix(cfg, rwkv_index)
        self.ln2 = make_norm(cfg.rwkv_norm, cfg.hidden_size, cfg)
        if cfg.rwkv_ffn == "channel_mix":
            self.ffn = ChannelMix(cfg)
        else:
            self.ffn = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def cache_problem(self, cache, batch: int) -> str | None:
        """Why ``cache`` cannot continue this block for ``batch`` rows (None if it can)."""
        if not isinstance(cache, ArraysCache) or len(cache.cache) != 3:
            return f"expected an ArraysCache of 3 arrays, got {type(cache).__name__}"
        tm = self.tmix
        state_shape = (batch, tm.n_heads, tm.head_size, tm.head_size)
        shift_shape = (batch, 1, tm.n_heads * tm.head_size)
        for slot, want in ((0, shift_shape), (1, state_shape), (2, shift_shape)):
            if cache[slot] is not None and tuple(cache[slot].shape) != want:
                return (
                    f"holds an array of shape {tuple(cache[slot].shape)} where {want} belongs "
                    "(a cache from another model or batch size?)"
                )
        return None

    def __call__(self, h, v_first, cache=None):
        dh, v_first = self.tmix(self.ln1(h), v_first, cache)
        h = h + dh
        return h + self.ffn(self.ln2(h), cache), v_first
