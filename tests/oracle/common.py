"""Shared helpers of the float64 oracle: seeded init, norm-wise error, finite differences.

Convention for every oracle computation ``foo``:

* ``foo_np(...)`` is the forward. It takes float64 arrays and returns its outputs.
* ``foo_fwd_np(inputs) -> (outs, cache)`` and ``foo_bwd_np(cache, d_outs) -> grads`` are the
  pair the gradient checks use: ``inputs`` is a flat ``dict[str, ndarray]`` (activations and
  parameters alike), ``outs`` a tuple of arrays, ``d_outs`` a tuple of cotangents of the same
  shapes, and ``grads`` a dict with the same keys as the differentiable entries of ``inputs``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

Arrays = dict[str, np.ndarray]


def rel_err(x: np.ndarray, ref: np.ndarray) -> float:
    """Norm-wise relative error ``||x - ref|| / ||ref||`` (DESIGN.md: the only error we quote)."""
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(x - ref)
    if denom == 0.0:
        return float(num)
    return float(num / denom)


def seeded_uniform(
    rng: np.random.Generator, shape, scale: float, offset: float = 0.0
) -> np.ndarray:
    """Foundry's init: ``offset + scale * uniform(-0.5, 0.5)`` (non-degenerate, never all zero)."""
    return offset + scale * (rng.random(shape) - 0.5)


def numeric_grads(
    fwd: Callable[[Arrays], tuple],
    inputs: Arrays,
    d_outs: tuple,
    keys,
    eps: float = 1e-6,
) -> Arrays:
    """Central finite differences of ``L = sum_i <d_outs[i], outs[i]>`` w.r.t. ``inputs[key]``."""

    def loss(x: Arrays) -> float:
        outs, _ = fwd(x)
        return float(sum(np.sum(d * o) for d, o in zip(d_outs, outs, strict=True) if d is not None))

    grads = {}
    for key in keys:
        base = inputs[key]
        g = np.zeros_like(base)
        flat = g.reshape(-1)
        for i in range(base.size):
            plus = dict(inputs)
            minus = dict(inputs)
            p = base.copy().reshape(-1)
            m = base.copy().reshape(-1)
            p[i] += eps
            m[i] -= eps
            plus[key] = p.reshape(base.shape)
            minus[key] = m.reshape(base.shape)
            flat[i] = (loss(plus) - loss(minus)) / (2 * eps)
        grads[key] = g
    return grads


def random_cotangents(rng: np.random.Generator, outs: tuple) -> tuple:
    """One standard-normal cotangent per output (``None`` outputs get ``None``)."""
    return tuple(None if o is None else rng.standard_normal(np.shape(o)) for o in outs)


def check_grads(
    fwd: Callable[[Arrays], tuple],
    bwd: Callable[[object, tuple], Arrays],
    inputs: Arrays,
    *,
    seed: int = 0,
    keys=None,
    tol: float = 1e-6,
    eps: float = 1e-6,
) -> dict[str, float]:
    """Compare the hand backward with central differences; return the error per input name.

    Raises AssertionError naming every tensor whose norm-wise relative error exceeds ``tol``,
    and refuses a vacuous check (an analytic gradient that is exactly zero).
    """
    rng = np.random.default_rng(seed)
    outs, cache = fwd(inputs)
    d_outs = random_cotangents(rng, outs)
    analytic = bwd(cache, d_outs)
    keys = list(analytic) if keys is None else list(keys)
    numeric = numeric_grads(fwd, inputs, d_outs, keys, eps=eps)
    errors = {k: rel_err(analytic[k], numeric[k]) for k in keys}
    bad = {k: e for k, e in errors.items() if not e <= tol}
    vacuous = [k for k in keys if not np.any(analytic[k])]
    assert not bad, f"gradient mismatch (norm-wise relative error > {tol}): {bad}"
    assert not vacuous, f"vacuous gradient check, analytic gradient is all zero for: {vacuous}"
    return errors
