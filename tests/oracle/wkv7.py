"""WKV7, the RWKV-7 (x070) recurrence: float64 step loop, unrolled cross-check, hand backward.

Layouts: r, log_w, k, v, a, b are ``[B, T, H, N]``; the state is ``[B, H, N, N]`` with
``S[i, j]``, i = value index, j = key index. Per head and step t (``w_t = exp(log_w_t)``):

    sa = S a_t;  S = S diag(w_t) + v_t k_t^T + sa b_t^T;  y_t = S r_t

that is ``S_t = S_{t-1} D_t + v_t k_t^T`` with the transition ``D_t = diag(w_t) + a_t b_t^T``.
"""

from __future__ import annotations

import numpy as np

from .common import seeded_uniform

WKV7_INPUTS = ("r", "log_w", "k", "v", "a", "b")
# Ranges of the per-step decay w the kernel tests draw from (random_wkv7_inputs' decay_range)
MIXED = (1e-4, 0.9999)
NEAR_ONE = (0.9999, 0.9999)
TINY = (1e-4, 1e-4)
DEFAULT = (0.5, 0.999)


def _initial_state(r: np.ndarray, state) -> np.ndarray:
    B, _, H, N = r.shape
    if state is None:
        return np.zeros((B, H, N, N))
    return np.array(state, dtype=np.float64)


def _matvec(S: np.ndarray, x: np.ndarray) -> np.ndarray:
    """``S x`` per batch and head: S ``[B, H, N, N]``, x ``[B, H, N]`` -> ``[B, H, N]``."""
    return (S @ x[..., None])[..., 0]


def _outer(u: np.ndarray, v: np.ndarray) -> np.ndarray:
    """``u v^T`` per batch and head: ``[B, H, N]`` x ``[B, H, N]`` -> ``[B, H, N, N]``."""
    return u[..., :, None] * v[..., None, :]


def _states(r, log_w, k, v, a, b, state) -> list[np.ndarray]:
    """Every state of the recurrence: ``[S_0, S_1, ..., S_T]``, each ``[B, H, N, N]``."""
    w = np.exp(log_w)
    states = [_initial_state(r, state)]
    for t in range(r.shape[1]):
        S = states[-1]
        sa = _matvec(S, a[:, t])  # [B, H, N]
        states.append(S * w[:, t, :, None, :] + _outer(v[:, t], k[:, t]) + _outer(sa, b[:, t]))
    return states


def wkv7_np(r, log_w, k, v, a, b, state=None) -> tuple[np.ndarray, np.ndarray]:
    """WKV7 step loop. Inputs ``[B, T, H, N]``, state ``[B, H, N, N]`` (None = zeros).

    Returns (y ``[B, T, H, N]``, final state ``[B, H, N, N]``); y_t uses the updated state S_t.
    """
    states = _states(r, log_w, k, v, a, b, state)
    y = np.stack([_matvec(S, r[:, t]) for t, S in enumerate(states[1:])], axis=1)
    return y, states[-1]


def _chain(mats: list[np.ndarray], start: int, stop: int) -> np.ndarray:
    """``mats[start] @ ... @ mats[stop - 1]`` (the identity when empty)."""
    prod = np.eye(mats[0].shape[0])
    for m in mats[start:stop]:
        prod = prod @ m
    return prod


def wkv7_unrolled_np(r, log_w, k, v, a, b, state=None) -> tuple[np.ndarray, np.ndarray]:
    """WKV7 from the closed form, one (batch, head) matrix at a time (forward cross-check).

    ``S_t = S_0 D_1...D_t + sum_{s<=t} v_s k_s^T D_{s+1}...D_t``, ``y_t = S_t r_t``;
    same signature and result as ``wkv7_np``.
    """
    B, T, H, _ = r.shape
    S0 = _initial_state(r, state)
    y = np.zeros_like(r, dtype=np.float64)
    S_end = np.zeros_like(S0)
    for bi in range(B):
        for h in range(H):
            D = [
                np.diag(np.exp(log_w[bi, t, h])) + np.outer(a[bi, t, h], b[bi, t, h])
                for t in range(T)
            ]
            for t in range(T):
                S = S0[bi, h] @ _chain(D, 0, t + 1)
                for s in range(t + 1):
                    S = S + np.outer(v[bi, s, h], k[bi, s, h]) @ _chain(D, s + 1, t + 1)
                y[bi, t, h] = S @ r[bi, t, h]
            S_end[bi, h] = S
    return y, S_end


def wkv7_bwd_np(r, log_w, k, v, a, b, state, dy, dstate=None) -> dict:
    """Backward through time of ``wkv7_np``.

    ``state`` is the initial state (None = zeros), ``dy [B, T, H, N]`` the cotangent of y,
    ``dstate [B, H, N, N]`` that of the final state (None = zeros). Returns the gradients
    'r', 'log_w' (chained through exp), 'k', 'v', 'a', 'b' and 'state' (of the initial state).
    """
    w = np.exp(log_w)
    states = _states(r, log_w, k, v, a, b, state)
    dS = np.zeros_like(states[0]) if dstate is None else np.array(dstate, dtype=np.float64)
    g = {name: np.zeros_like(r, dtype=np.float64) for name in WKV7_INPUTS}
    for t in reversed(range(r.shape[1])):
        S_prev, S_t = states[t], states[t + 1]
        dS = dS + _outer(dy[:, t], r[:, t])  # y_t = S_t r_t
        g["r"][:, t] = _matvec(np.swapaxes(S_t, -1, -2), dy[:, t])
        g["v"][:, t] = _matvec(dS, k[:, t])
        g["k"][:, t] = _matvec(np.swapaxes(dS, -1, -2), v[:, t])
        dD = np.swapaxes(S_prev, -1, -2) @ dS  # S_{t-1}^T dS_t, [B, H, N, N]
        g["log_w"][:, t] = np.diagonal(dD, axis1=-2, axis2=-1) * w[:, t]
        g["a"][:, t] = _matvec(dD, b[:, t])
        g["b"][:, t] = _matvec(np.swapaxes(dD, -1, -2), a[:, t])
        # dS_{t-1} = dS_t D_t^T = dS_t diag(w_t) + (dS_t b_t) a_t^T
        dS = dS * w[:, t, :, None, :] + _outer(_matvec(dS, b[:, t]), a[:, t])
    g["state"] = dS
    return g


def wkv7_fwd_np(inputs: dict):
    """Flat-dict forward (common.py convention): keys of WKV7_INPUTS and 'state'.

    Returns ((y, state_out), cache).
    """
    args = [inputs[name] for name in WKV7_INPUTS]
    return wkv7_np(*args, inputs.get("state")), dict(inputs)


def wkv7_bwd_np_flat(cache: dict, d_outs) -> dict:
    """Flat-dict backward: ``d_outs = (dy, dstate)`` -> gradients of every key of the inputs."""
    dy, dstate = d_outs
    args = [cache[name] for name in WKV7_INPUTS]
    return wkv7_bwd_np(*args, cache.get("state"), dy, dstate)


def random_wkv7_inputs(
    rng: np.random.Generator,
    B: int,
    T: int,
    H: int,
    N: int,
    *,
    decay_range: tuple[float, float] = (0.5, 0.999),
    with_state: bool = True,
) -> dict:
    """Realistic WKV7 inputs as RWKV-7 makes them (a flat dict for ``wkv7_fwd_np``).

    Decays ``w`` uniform in ``decay_range`` (``log_w = log w``); ``a = -kk``, ``b = kk * iclr``
    with kk L2-normalised per head and the in-context learning rate iclr in (0, 1), which keeps
    the transition contractive; r, k, v uniform(-0.5, 0.5). ``state`` is uniform(-0.5, 0.5), or
    zeros when ``with_state`` is False.
    """
    shape = (B, T, H, N)
    lo, hi = decay_range
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    iclr = rng.uniform(0.0, 1.0, shape)
    state_shape = (B, H, N, N)
    return {
        "r": seeded_uniform(rng, shape, 1.0),
        "log_w": np.log(rng.uniform(lo, hi, shape)),
        "k": seeded_uniform(rng, shape, 1.0),
        "v": seeded_uniform(rng, shape, 1.0),
        "a": -kk,
        "b": kk * iclr,
        "state": seeded_uniform(rng, state_shape, 1.0) if with_state else np.zeros(state_shape),
    }
