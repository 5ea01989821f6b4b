"""``python -m mlx_rwkvx.demo``: the built-in default run.

For now a smoke run of what the toolkit has: the environment report with its matmul timing;
the WKV7 recurrence forward and backward on a random RWKV-7-like problem, checked against the
plain step loop; and a tiny random RWKV-X model saved, loaded and decoded greedily, its last
decode step checked against a full prefill. Exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import mlx_rwkvx
from mlx_rwkvx import info

GRAD_TOL = 1e-5  # DESIGN.md, float32 ops: gradients within 1e-5 of the reference
DECODE_TOL = 1e-5  # a whole tiny model: decode and prefill agree within 1e-5


def wkv7_smoke(T: int = 512, H: int = 4, N: int = 64) -> tuple[list[str], bool]:
    """Run ``wkv7`` and ``wkv7_ref`` on the same inputs; report agreement and times."""
    from mlx_rwkvx.ops.wkv7 import wkv7, wkv7_ref

    import mlx.core as mx

    keys = mx.random.split(mx.random.key(0), 6)
    shape = (1, T, H, N)
    r, k, v = (mx.random.uniform(-0.5, 0.5, shape, key=keys[i]) for i in range(3))
    log_w = mx.log(mx.random.uniform(0.5, 0.999, shape, key=keys[3]))
    kk = mx.random.normal(shape, key=keys[4])
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    b = kk * mx.random.uniform(shape=shape, key=keys[5])
    args = [r, log_w, k, v, -kk, b]

    def run(fn):
        def loss(*xs):
            y, s = fn(*xs)
            return (y * y).sum() + s.sum()

        t0 = time.perf_counter()
        value, grads = mx.value_and_grad(loss, argnums=list(range(6)))(*args)
        mx.eval(value, grads)
        return value, grads, time.perf_counter() - t0

    fast, fast_grads, t_fast = run(wkv7)
    ref, ref_grads, t_ref = run(wkv7_ref)
    grad_err = max(
        (mx.linalg.norm(g - h) / mx.linalg.norm(h)).item()
        for g, h in zip(fast_grads, ref_grads, strict=True)
    )
    return [
        f"wkv7       T={T} H={H} N={N}: loss {fast.item():.6f} (step loop {ref.item():.6f}), "
        f"gradients within {grad_err:.1e} of the step loop",
        f"           forward+backward {t_fast * 1e3:.0f} ms, step loop {t_ref * 1e3:.0f} ms",
    ], grad_err <= GRAD_TOL


def model_smoke(tmp: str) -> tuple[list[str], bool]:
    """Build, save, load and decode a tiny random RWKV-X model; check decode against prefill."""
    import mlx_rwkvx
    from mlx_rwkvx.models import Model, preset

    import mlx.core as mx

    model = Model(preset("rwkv-x-tiny"), seed=0)
    mlx_rwkvx.save(model, tmp)
    model, tokenizer = mlx_rwkvx.load(tmp)
    prompt = tokenizer.encode("RWKV-X says: ")
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache)
    tokens = []
    for _ in range(12):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        logits = model(mx.array([tokens[-1:]]), cache)
    full = model(mx.array([prompt + tokens]))
    err = (mx.abs(full[0, -1] - logits[0, -1]).max() / mx.abs(full[0, -1]).max()).item()
    layout = ", ".join(model.config.block_types)
    return [
        f"model      rwkv-x-tiny [{layout}], saved and loaded from {tmp}",
        f"           greedy bytes after the prompt: {tokenizer.decode_bytes(tokens)!r}",
        f"           last decode step vs full prefill: max relative difference {err:.1e}",
    ], err <= DECODE_TOL


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m mlx_rwkvx.demo", description=__doc__)
    parser.parse_args(argv)
    mlx_rwkvx.configure()
    print("\n".join(info.report(timing=True)))
    lines, ok_wkv = wkv7_smoke()
    print("\n".join(lines))
    with tempfile.TemporaryDirectory() as tmp:
        lines, ok_model = model_smoke(os.path.join(tmp, "rwkv-x-tiny"))
    print("\n".join(lines))
    if not (ok_wkv and ok_model):
        print("demo: a check FAILED (see above)", file=sys.stderr)
        sys.exit(1)
    print("demo: all checks passed")


if __name__ == "__main__":
    main()
