"""Feed-forward blocks: RWKV-7 channel-mix (token-shifted ReLU^2) and SwiGLU, float64.

Activations are ``[B, T, C]``; Linear weights are ``[out, in]`` (``y = x @ W.T``).
Also holds the token shift shared with the time-mix.
"""

from __future__ import annotations

import numpy as np

from .common import seeded_uniform


def token_shift_np(x: np.ndarray, x_prev: np.ndarray) -> np.ndarray:
    """The previous token's x, ``[x_prev, x[:, 0], ..., x[:, T-2]]``.

    x ``[B, T, C]``, x_prev ``[B, C]`` -> ``[B, T, C]``.
    """
    return np.concatenate([x_prev[:, None], x[:, :-1]], axis=1)


def token_shift_bwd_np(d_shifted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Backward of ``token_shift_np``: returns (dx ``[B, T, C]``, dx_prev ``[B, C]``)."""
    dx = np.zeros_like(d_shifted)
    dx[:, :-1] = d_shifted[:, 1:]
    return dx, d_shifted[:, 0].copy()


def outer_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``sum over leading axes of a[..., i] b[..., j]`` -> ``[I, J]`` (weight gradients)."""
    return a.reshape(-1, a.shape[-1]).T @ b.reshape(-1, b.shape[-1])


def _zeros_if_none(x_prev, x: np.ndarray) -> np.ndarray:
    return np.zeros((x.shape[0], x.shape[-1])) if x_prev is None else x_prev


def channel_mix_fwd_np(x: np.ndarray, x_prev, p: dict):
    """RWKV-7 channel-mix: ``xk = x + (shift(x) - x) * x_k;  out = relu(xk W_key^T)^2 W_value^T``.

    x ``[B, T, C]``; x_prev ``[B, C]`` the previous token's x (None = zeros); p: 'x_k' ``[C]``,
    'W_key' ``[F, C]``, 'W_value' ``[C, F]``. Returns (out ``[B, T, C]``, x_last ``[B, C]``, cache).
    """
    x_prev = _zeros_if_none(x_prev, x)
    xx = token_shift_np(x, x_prev) - x  # [B, T, C]
    xk = x + xx * p["x_k"]
    hid = np.maximum(xk @ p["W_key"].T, 0.0)  # [B, T, F]
    sq = hid * hid
    out = sq @ p["W_value"].T
    cache = {"p": p, "xx": xx, "xk": xk, "hid": hid, "sq": sq}
    return out, x[:, -1].copy(), cache


def channel_mix_bwd_np(cache: dict, d_out: np.ndarray, d_x_last=None) -> dict:
    """Gradients 'x', 'x_prev', 'x_k', 'W_key', 'W_value' of ``channel_mix_fwd_np``."""
    p = cache["p"]
    d_sq = d_out @ p["W_value"]  # [B, T, F]
    d_pre = 2.0 * cache["hid"] * d_sq
    d_xk = d_pre @ p["W_key"]  # [B, T, C]
    d_xx = d_xk * p["x_k"]
    dx, dx_prev = token_shift_bwd_np(d_xx)
    dx += d_xk - d_xx
    if d_x_last is not None:
        dx[:, -1] += d_x_last
    return {
        "x": dx,
        "x_prev": dx_prev,
        "x_k": (d_xk * cache["xx"]).sum(axis=(0, 1)),
        "W_key": outer_sum(d_pre, cache["xk"]),
        "W_value": outer_sum(d_out, cache["sq"]),
    }


def _sigmoid(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def swiglu_fwd_np(x: np.ndarray, p: dict):
    """Qwen2 MLP: ``out = (silu(x W_gate^T) * (x W_up^T)) W_down^T``.

    x ``[..., C]``; p: 'W_gate', 'W_up' ``[F, C]``, 'W_down' ``[C, F]``. Returns (out, cache).
    """
    gate = x @ p["W_gate"].T  # [..., F]
    up = x @ p["W_up"].T
    sig = _sigmoid(gate)
    hid = gate * sig * up
    cache = {"p": p, "x": x, "gate": gate, "up": up, "sig": sig, "hid": hid}
    return hid @ p["W_down"].T, cache


def swiglu_bwd_np(cache: dict, d_out: np.ndarray) -> dict:
    """Gradients 'x', 'W_gate', 'W_up', 'W_down' of ``swiglu_fwd_np``."""
    p, gate, sig, up = cache["p"], cache["gate"], cache["sig"], cache["up"]
    d_hid = d_out @ p["W_down"]  # [..., F]
    d_up = d_hid * gate * sig
    d_gate = d_hid * up * sig * (1.0 + gate * (1.0 - sig))
    return {
        "x": d_gate @ p["W_gate"] + d_up @ p["W_up"],
        "W_gate": outer_sum(d_gate, cache["x"]),
        "W_up": outer_sum(d_up, cache["x"]),
        "W_down": outer_sum(d_out, cache["hid"]),
    }


def init_channel_mix_params(rng: np.random.Generator, C: int, F: int) -> dict:
    """Foundry's non-degenerate init of a channel-mix (lerp 0.5, matrices 0.3)."""
    return {
        "x_k": seeded_uniform(rng, (C,), 0.5),
        "W_key": seeded_uniform(rng, (F, C), 0.3),
        "W_value": seeded_uniform(rng, (C, F), 0.3),
    }


def init_swiglu_params(rng: np.random.Generator, C: int, F: int) -> dict:
    """Foundry's non-degenerate init of a SwiGLU MLP (matrices 0.3)."""
    return {
        "W_gate": seeded_uniform(rng, (F, C), 0.3),
        "W_up": seeded_uniform(rng, (F, C), 0.3),
        "W_down": seeded_uniform(rng, (C, F), 0.3),
    }
