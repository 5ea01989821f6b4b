"""The loss section: the fused head + cross-entropy against the dense one, time and peak
memory."""

from __future__ import annotations

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    time_and_peak,
    with_goals,
)
from mlx_rwkvx.ops import cross_entropy_head
from mlx_rwkvx.ops.loss import VOCAB_BLOCK

import mlx.core as mx
import mlx.nn as nn

LOSS = {
    "full": dict(tokens=8192, vocab=65536, width=768),
    "quick": dict(tokens=256, vocab=4096, width=64),
}


def measure(quick: bool = False) -> dict:
    """The fused head + cross-entropy against MLX's dense one (logits of the whole vocabulary,
    ``nn.losses.cross_entropy``): loss and both gradients, time and peak memory."""
    cfg = sizes(LOSS, quick)
    N, V, C = cfg["tokens"], cfg["vocab"], cfg["width"]
    keys = mx.random.split(mx.random.key(0), 3)
    h = mx.random.normal((N, C), key=keys[0])
    W = 0.02 * mx.random.normal((V, C), key=keys[1])
    targets = mx.random.randint(0, V, (N,), key=keys[2])
    mx.eval(h, W, targets)

    def dense(h_, W_):
        return nn.losses.cross_entropy(h_ @ W_.T, targets, reduction="sum")

    def fused(h_, W_):
        return cross_entropy_head(h_, W_, targets)[0]

    grads = {
        name: mx.value_and_grad(fn, argnums=(0, 1))
        for name, fn in (("dense", dense), ("fused", fused))
    }
    (d_loss, d_grads), (f_loss, f_grads) = (grads[n](h, W) for n in ("dense", "fused"))
    verify = {
        "loss": rel_err(f_loss, d_loss),
        "dh": rel_err(f_grads[0], d_grads[0]),
        "dW": rel_err(f_grads[1], d_grads[1]),
    }
    if not max(verify.values()) <= 1e-5:
        raise VerificationFailed(f"fused head + loss vs dense: {verify}")
    del d_grads, f_grads
    runs = {
        n: time_and_peak(lambda n=n: mx.eval(grads[n](h, W)), 1 if not quick else 2) for n in grads
    }
    return {"tokens": N, "vocab": V, "width": C, "block": VOCAB_BLOCK, "verify": verify, **runs}


def render(r: dict) -> Rendered:
    """Time and peak memory of both, the goal."""
    dense, fused = r["dense"], r["fused"]
    ratio = dense["peak"] / fused["peak"]
    lines = [
        f"Verified first: fused vs dense loss {r['verify']['loss']:.1e}, dh "
        f"{r['verify']['dh']:.1e}, dW {r['verify']['dW']:.1e}.",
        "",
        f"Loss and both gradients (h, W), {r['tokens']} tokens, vocab {r['vocab']}, C = "
        f"{r['width']}, float32. dense = `nn.losses.cross_entropy(h @ W.T, ...)`; fused = "
        f"`ops.cross_entropy_head` (blocks of {r['block']} vocabulary entries). Peak memory "
        "above the inputs.",
        "",
        "| | time | peak memory |",
        "|---|---|---|",
        f"| dense | {dense['time']:.2f} s | {dense['peak'] / 2**20:.0f} MiB |",
        f"| fused | {fused['time']:.2f} s | {fused['peak'] / 2**20:.0f} MiB |",
        "",
    ]
    return with_goals(lines, [Goal("loss+backward peak memory, dense / fused", ratio, 8, True)])


SECTION = Section(measure, render, "fused head + cross-entropy vs the dense one, memory")
