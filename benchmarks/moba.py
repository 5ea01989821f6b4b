"""The moba section: MoBA attention forward and forward+backward against dense causal SDPA,
time and peak memory, T up to 16384."""

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
from mlx_rwkvx.ops.moba import moba_attention, moba_attention_ref
from mlx_rwkvx.perf import matmul_gflops

import mlx.core as mx
import numpy as np

# The goals compare MoBA with dense attention at the longest T dense ran at, and MoBA's time at
# the longest T with a quarter of it. The verifying T has 8 chunks: top_k = 3 leaves chunks out,
# so the sparse path runs.
MOBA = {
    "full": dict(
        Ts=(2048, 4096, 8192, 16384),
        H=8,
        D=64,
        chunk_size=256,
        top_k=3,
        verify_T=2048,
        matmul_n=2048,
    ),
    "quick": dict(
        Ts=(128, 256, 512, 1024), H=2, D=32, chunk_size=32, top_k=3, verify_T=256, matmul_n=256
    ),
}
# Dense causal attention keeps [H, T, T] float32 scores (and more for its backward): at
# T = 16384 that is 8.6 GB for the forward alone, which with its backward did not fit in the
# RAM of the machine these benchmarks were first run on.
DENSE_MAX_T = 8192


def _attention_inputs(T: int, H: int, D: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((1, T, H, D)) for _ in range(3)]
    out = [mx.array(x.astype(np.float32)) for x in arrays]
    mx.eval(out)
    return out


def _dense_causal(q, k, v):
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask="causal")
    return out.transpose(0, 2, 1, 3)


def _fwd(fn, xs):
    return lambda: mx.eval(fn(*xs))


def _fwd_bwd(fn, xs):
    grad = mx.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))
    return lambda: mx.eval(grad(*xs))


def measure(quick: bool = False) -> dict:
    """MoBA attention forward and fwd+bwd against dense causal SDPA: time and peak memory."""
    cfg = sizes(MOBA, quick)
    H, D, cs, top_k = cfg["H"], cfg["D"], cfg["chunk_size"], cfg["top_k"]

    def moba(q, k, v):
        return moba_attention(q, k, v, chunk_size=cs, top_k=top_k)

    # verify first: the sparse path against the dense masked reference, outputs and gradients
    xs = _attention_inputs(cfg["verify_T"], H, D, seed=1)
    ref = moba_attention_ref(*xs, chunk_size=cs, top_k=top_k)
    err = rel_err(moba(*xs), ref)

    def grads(fn):
        return mx.grad(lambda *a: (fn(*a) * ref).sum(), argnums=(0, 1, 2))(*xs)

    g_err = max(
        rel_err(a, b)
        for a, b in zip(
            grads(moba),
            grads(lambda *a: moba_attention_ref(*a, chunk_size=cs, top_k=top_k)),
            strict=True,
        )
    )
    if not (err <= 2e-6 and g_err <= 1e-5):
        raise VerificationFailed(f"moba vs dense masked reference {err:.1e}, {g_err:.1e}")

    rate = matmul_gflops(cfg["matmul_n"])
    runs = {T: {} for T in cfg["Ts"]}
    # every MoBA run first, then dense: dense's gigabytes of freed buffers (kept in MLX's cache)
    # would otherwise slow the long MoBA runs after them
    for name, fn, reps in (("moba", moba, 3), ("dense", _dense_causal, 1)):
        for T in cfg["Ts"]:
            fits = name == "moba" or T <= DENSE_MAX_T
            inputs = _attention_inputs(T, H, D)
            runs[T][f"{name}_fwd"] = time_and_peak(_fwd(fn, inputs), reps) if fits else None
            runs[T][f"{name}_fb"] = time_and_peak(_fwd_bwd(fn, inputs), reps) if fits else None
            del inputs
            mx.clear_cache()
            done = {k: v for k, v in runs[T].items() if v and k.startswith(name)}
            print(f"T={T}: " + ", ".join(f"{k} {v['time']:.2f} s" for k, v in done.items()))
    return {
        "verify": {"T": cfg["verify_T"], "output": err, "grad": g_err},
        "H": H,
        "D": D,
        "chunk_size": cs,
        "top_k": top_k,
        "matmul_n": cfg["matmul_n"],
        "matmul_gflops": rate,
        "rows": [{"T": T, "runs": runs[T]} for T in cfg["Ts"]],
    }


def _cell(runs: dict, key: str, field: str, show) -> str:
    return "does not fit" if runs[key] is None else show(runs[key][field])


def _ratio(runs: dict, key: str, ours: str, field: str) -> str:
    return "n/a" if runs[key] is None else f"{runs[key][field] / runs[ours][field]:.1f}x"


def _sec(x: float) -> str:
    return f"{x:.2f} s"


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f} MiB"


def render(r: dict) -> Rendered:
    """Times and peak memory against dense attention, the matmul rate reached, the goals."""
    H, D, cs, top_k, v = r["H"], r["D"], r["chunk_size"], r["top_k"], r["verify"]
    lines = [
        f"Verified first (T={v['T']}): moba_attention vs the dense masked reference: output "
        f"{v['output']:.1e}, gradients <= {v['grad']:.1e}.",
        "",
        f"B=1, {H} heads, D={D}, chunk_size {cs}, top_k {top_k}, float32. dense = "
        "`mx.fast.scaled_dot_product_attention` with a causal mask (one run: it takes seconds); "
        "moba = `mlx_rwkvx.ops.moba_attention` (best of 3 after a warm-up). Peak memory above "
        "the inputs.",
        "",
        "| T | moba fwd | dense fwd | fwd speed-up | moba fwd+bwd | dense fwd+bwd | fwd+bwd "
        "speed-up | moba peak (fwd+bwd) | dense peak (fwd+bwd) | memory ratio |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        runs = row["runs"]
        lines.append(
            f"| {row['T']} | {_sec(runs['moba_fwd']['time'])} "
            f"| {_cell(runs, 'dense_fwd', 'time', _sec)} "
            f"| {_ratio(runs, 'dense_fwd', 'moba_fwd', 'time')} | {_sec(runs['moba_fb']['time'])} "
            f"| {_cell(runs, 'dense_fb', 'time', _sec)} "
            f"| {_ratio(runs, 'dense_fb', 'moba_fb', 'time')} | {_mib(runs['moba_fb']['peak'])} "
            f"| {_cell(runs, 'dense_fb', 'peak', _mib)} "
            f"| {_ratio(runs, 'dense_fb', 'moba_fb', 'peak')} |"
        )
    n, rate = r["matmul_n"], r["matmul_gflops"]
    lines += [
        "",
        f"Limit measured in this run: fp32 matmul {rate:.0f} GFLOP/s ({n}^3).",
        "",
        "| T | moba fwd matmul work | achieved | of the matmul rate |",
        "|---|---|---|---|",
    ]
    for row in r["rows"]:
        T = row["T"]
        flops = 2 * 2 * T * H * (top_k + 1) * cs * D  # scores and values, own chunk included
        achieved = flops / row["runs"]["moba_fwd"]["time"] / 1e9
        lines.append(
            f"| {T} | {flops / 1e9:.1f} GFLOP | {achieved:.0f} GFLOP/s | {achieved / rate:.0%} |"
        )
    by_T = {row["T"]: row["runs"] for row in r["rows"]}
    dense_T = max(T for T, runs in by_T.items() if runs["dense_fb"] is not None)
    long_T = max(by_T)
    rd, rq, rl = by_T[dense_T], by_T[long_T // 4], by_T[long_T]
    goals = [
        Goal(
            f"fwd+bwd T={dense_T} vs dense",
            rd["dense_fb"]["time"] / rd["moba_fb"]["time"],
            3.0,
            True,
        ),
        Goal(
            f"fwd+bwd peak memory T={dense_T}, dense / moba",
            rd["dense_fb"]["peak"] / rd["moba_fb"]["peak"],
            4.0,
            True,
        ),
        Goal(
            f"fwd time T={long_T} / T={long_T // 4}",
            rl["moba_fwd"]["time"] / rq["moba_fwd"]["time"],
            5.0,
            False,
        ),
        Goal(
            f"fwd+bwd time T={long_T} / T={long_T // 4}",
            rl["moba_fb"]["time"] / rq["moba_fb"]["time"],
            5.0,
            False,
        ),
    ]
    return with_goals(lines, goals)


SECTION = Section(measure, render, "MoBA attention vs dense causal SDPA, time and memory")
