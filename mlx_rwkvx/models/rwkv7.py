"""RWKV-7 ("x070") blocks: time-mix, channel-mix, and the ARWKV variant used by RFA.

Equations in DESIGN.md; the float64 oracle in tests/oracle/rwkv7.py is checked against them.
Parameter layouts follow BlinkDL's checkpoints: ``k_k``, ``k_a`` and the lerps ``x_*`` are
``[C]``, ``r_k`` is ``[H, N]``; every large projection is an ``nn.Linear`` (LoRA adapters and
quantization find them by module path).
"""

from __future__ import annotations

import math

from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.ops.wkv7 import wkv7

import mlx.core as mx
import mlx.nn as nn

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


def token_shift(x: mx.array, previous: mx.array, valid: mx.array | None = None) -> mx.array:
    """The previous token's x for every position of ``x [B, T, C]``: ``previous [B, 1, C]``
    (zeros at the start of a text) first. ``valid [B, T]`` (a padded batch): a position after
    a padded one gets ``previous`` (left padding: a row's first token)."""
    shifted = mx.concatenate([previous.astype(x.dtype), x[:, :-1]], axis=1)
    if valid is None:
        return shifted
    after_token = mx.concatenate([mx.ones_like(valid[:, :1]), valid[:, :-1]], axis=1)
    return mx.where(after_token[..., None], shifted, previous.astype(x.dtype))


def last_token(x: mx.array, previous: mx.array, valid: mx.array | None = None) -> mx.array:
    """The new token shift after ``x [B, T, C]``: its last position's x (``valid``: each row's
    last real one, or ``previous`` for a row with none), in ``previous``'s dtype."""
    if valid is None:
        return x[:, -1:].astype(previous.dtype)
    T = x.shape[1]
    last = T - 1 - mx.argmax(valid[:, ::-1].astype(mx.int32), axis=1)  # [B]
    picked = mx.take_along_axis(x, last[:, None, None], axis=1).astype(previous.dtype)
    return mx.where(mx.any(valid, axis=1)[:, None, None], picked, previous)


class TimeMix(nn.Module):
    """RWKV-7 time-mix: token shift, six lerps, low-rank w/a/v/g, WKV7, ln_x, bonus, output.

    ``rwkv_index`` is the block's index among the model's RWKV blocks: block 0 produces
    ``v_first``, later ones mix their values towards it. With ``use_gate=False,
    use_ln_x=False`` it is the ARWKV variant.
    """

    def __init__(self, cfg: ModelConfig, rwkv_index: int):
        super().__init__()
        C, H, N = cfg.hidden_size, cfg.n_heads, cfg.head_size
        self.rwkv_index, self.n_heads, self.head_size = rwkv_index, H, N
        self.use_gate, self.use_ln_x = cfg.use_gate, cfg.use_ln_x
        for name in ("x_r", "x_w", "x_k", "x_v", "x_a") + (("x_g",) if cfg.use_gate else ()):
            setattr(self, name, mx.zeros((C,)))
        self.receptance = nn.Linear(C, C, bias=False)
        self.key = nn.Linear(C, C, bias=False)
        self.value = nn.Linear(C, C, bias=False)
        self.output = nn.Linear(C, C, bias=False)
        self.decay = LowRank(C, cfg.decay_low_rank, "tanh", bias=True)
        self.iclr = LowRank(C, cfg.a_low_rank, None, bias=True)
        if rwkv_index > 0:
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

    def initial_state(self, batch: int) -> mx.array:
        """The WKV state at the start of a text, ``[B, H, N, N]`` float32: zeros, or the trained
        ``state0`` (differentiable: state tuning trains it through this)."""
        H, N = self.n_heads, self.head_size
        if "state0" not in self:
            return mx.zeros((batch, H, N, N), dtype=mx.float32)
        return mx.broadcast_to(self.state0.astype(mx.float32), (batch, H, N, N))

    def __call__(self, x, v_first, shift, state, valid=None):
        """x ``[B, T, C]`` (already normalised); ``shift [B, 1, C]`` the previous token's x;
        ``state [B, H, N, N]`` float32; ``valid [B, T]`` (a padded batch, else None): the
        state is left as it was at the other positions. Returns (out, v_first, new shift, new
        state); the state keeps its dtypes, whatever x's."""
        B, T, C = x.shape
        H, N = self.n_heads, self.head_size
        xx = token_shift(x, shift, valid) - x  # [B, T, C]
        r = self.receptance(x + xx * self.x_r).reshape(B, T, H, N)
        k = self.key(x + xx * self.x_k).reshape(B, T, H, N)
        v = self.value(x + xx * self.x_v).reshape(B, T, H, N)
        z = self.decay(x + xx * self.x_w).astype(mx.float32)  # [B, T, C]
        log_w = (-DECAY_SCALE * mx.sigmoid(z)).reshape(B, T, H, N)
        a = mx.sigmoid(self.iclr(x + xx * self.x_a)).reshape(B, T, H, N)
        kk = (k * self.k_k.reshape(H, N)).astype(mx.float32)
        # max(|kk|, floor) as sqrt(max(|kk|^2, floor^2)): the same values, and F.normalize's
        # gradient (1 / floor) where a head's kk is zero (k_k = 0 in a model built without an
        # init), not norm's 0/0 = NaN; a trained k_k at zero gets that huge gradient too
        # (LoRA and state tuning never train it)
        squares = mx.sum(mx.square(kk), axis=-1, keepdims=True)
        kk = kk / mx.sqrt(mx.maximum(squares, KK_NORM_FLOOR**2))
        kk = kk.astype(k.dtype)  # [B, T, H, N], unit length per head
        k = k * (1 + (a - 1) * self.k_a.reshape(H, N))
        if self.rwkv_index == 0:
            v_first = v
        else:
            mix = mx.sigmoid(self.value_mix(x + xx * self.x_v)).reshape(B, T, H, N)
            v = v + (v_first - v) * mix
        a_in, b_in, k_in = -kk, kk * a, k
        if valid is not None:  # a padded position: decay 1, nothing written, nothing removed
            keep = valid[:, :, None, None]
            log_w = mx.where(keep, log_w, mx.zeros_like(log_w))
            a_in, b_in, k_in = (mx.where(keep, t, mx.zeros_like(t)) for t in (a_in, b_in, k))
        y, state = wkv7(r, log_w, k_in, v, a_in, b_in, state)  # y [B, T, H, N]
        o = self.ln_x(y) if self.use_ln_x else y.reshape(B, T, C)
        bonus = (r * k * self.r_k).sum(axis=-1, keepdims=True) * v  # [B, T, H, N]
        o = o + bonus.reshape(B, T, C)
        if self.use_gate:
            o = o * self.gate(x + xx * self.x_g)
        return self.output(o), v_first, last_token(x, shift, valid), state


class ChannelMix(nn.Module):
    """RWKV-7 channel-mix: ``value(relu(key(x + (x_prev - x) * x_k))^2)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, F = cfg.hidden_size, cfg.intermediate_size
        self.x_k = mx.zeros((C,))
        self.key = nn.Linear(C, F, bias=False)
        self.value = nn.Linear(F, C, bias=False)

    def __call__(self, x, shift, valid=None):
        """x ``[B, T, C]``, ``shift [B, 1, C]`` the previous token's x (``valid``: as the
        time-mix's). Returns (out, new shift); the state keeps its dtype, whatever x's."""
        xx = token_shift(x, shift, valid) - x
        k = mx.square(nn.relu(self.key(x + xx * self.x_k)))  # [B, T, F]
        return self.value(k), last_token(x, shift, valid)


class SwiGLU(nn.Module):
    """Qwen2's MLP: ``down(silu(gate(x)) * up(x))`` (also the FFN of ARWKV blocks)."""

    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.gate_proj = nn.Linear(dims, hidden, bias=False)
        self.up_proj = nn.Linear(dims, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dims, bias=False)

    def __call__(self, x):
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


def make_norm(kind: str, dims: int, cfg: ModelConfig) -> nn.Module:
    return (
        nn.LayerNorm(dims, eps=cfg.norm_eps)
        if kind == "layer"
        else nn.RMSNorm(dims, eps=cfg.rms_norm_eps)
    )


def state_problem(state, expected: dict) -> str | None:
    """Why a block's ``state`` does not have the arrays of ``expected`` (name -> shape), or
    None. Shapes only: no array is read."""
    if not isinstance(state, dict) or set(state) != set(expected):
        got = sorted(state) if isinstance(state, dict) else type(state).__name__
        return f"expected a state with {sorted(expected)}, got {got}"
    for name, shape in expected.items():
        x = state[name]
        got = tuple(x.shape) if isinstance(x, mx.array) else type(x).__name__
        if got != tuple(shape):
            return (
                f"{name} has shape {got} where {tuple(shape)} belongs (a state from another "
                "model or batch size?)"
            )
    return None


class RWKV7Block(nn.Module):
    """``h = h + TMix(ln1(h)); h = h + FFN(ln2(h))``. RWKV-7: LayerNorm and channel-mix;
    ARWKV (RFA): RMSNorm and SwiGLU. State: the time-mix token shift and WKV state, and the
    channel-mix token shift (none for SwiGLU)."""

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

    def _state_shapes(self, batch: int) -> dict:
        H, N = self.tmix.n_heads, self.tmix.head_size
        shapes = {"tmix_shift": (batch, 1, H * N), "wkv": (batch, H, N, N)}
        if isinstance(self.ffn, ChannelMix):
            shapes["ffn_shift"] = (batch, 1, H * N)
        return shapes

    def init_state(self, batch: int) -> dict:
        """The state at the start of a text: zero token shifts, the initial WKV state."""
        dtype = self.ln1.weight.dtype
        state = {n: mx.zeros(s, dtype=dtype) for n, s in self._state_shapes(batch).items()}
        state["wkv"] = self.tmix.initial_state(batch)
        return state

    def state_problem(self, state, batch: int) -> str | None:
        return state_problem(state, self._state_shapes(batch))

    def trim_state(self, state: dict, max_tokens: int) -> dict:
        """The state as it is: an RWKV block's is the same size after any number of tokens."""
        return state

    def __call__(self, h, v_first, state, valid=None):
        """h ``[B, T, C]`` -> (h, v_first, new state). ``valid [B, T]``: a padded batch's real
        positions (the state is unchanged by the others), or None."""
        dh, v_first, tmix_shift, wkv = self.tmix(
            self.ln1(h), v_first, state["tmix_shift"], state["wkv"], valid
        )
        h = h + dh
        new = {"tmix_shift": tmix_shift, "wkv": wkv}
        if "ffn_shift" in state:
            dh, new["ffn_shift"] = self.ffn(self.ln2(h), state["ffn_shift"], valid)
        else:
            dh = self.ffn(self.ln2(h))
        return h + dh, v_first, new
