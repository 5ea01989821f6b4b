"""The kernel self-check the op dispatchers share: on first use per shape class, a kernel is
run against its ops path on a tiny problem; if they disagree it is never used again, with one
warning (the fallback is always exact, only slower)."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import mlx.core as mx


def agree(a: Sequence[mx.array], b: Sequence[mx.array], tol: float) -> bool:
    """Every pair within ``tol`` norm-wise relative error (and finite)."""
    for x, y in zip(a, b, strict=True):
        x, y = x.astype(mx.float32), y.astype(mx.float32)
        err = mx.linalg.norm(x - y) / mx.maximum(mx.linalg.norm(y), 1e-30)
        if not err.item() <= tol:
            return False
    return True


class SelfCheck:
    """Remembers, per key (e.g. head size and dtype), whether ``check()`` passed."""

    def __init__(self, kernel: str, fallback: str):
        self.kernel, self.fallback = kernel, fallback
        self.results: dict = {}

    def passes(self, key, check: Callable[[], bool]) -> bool:
        if key not in self.results:
            ok = bool(check())
            if not ok:
                warnings.warn(
                    f"mlx_rwkvx: the {self.kernel} kernel {key} disagrees with the {self.fallback} "
                    f"path on this device; using the {self.fallback} path instead",
                    RuntimeWarning,
                    stacklevel=4,
                )
            self.results[key] = ok
        return self.results[key]
