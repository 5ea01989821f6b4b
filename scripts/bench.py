"""Benchmarks: each subcommand verifies its fast path against a reference, then times it.

    python scripts/bench.py blas
    python scripts/bench.py wkv7
    python scripts/bench.py moba
    python scripts/bench.py models

Results are appended to BENCHMARKS.md with the machine, the command, the times and every ratio,
each set beside the physical limits measured in the same run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx_rwkvx  # noqa: F401  (loads OpenBLAS before mlx.core)
from mlx_rwkvx import _blas
from mlx_rwkvx.perf import best_time, machine_description, matmul_gflops, read_bandwidth_gbs

import mlx.core as mx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "BENCHMARKS.md"
MATMUL_SIZES = (512, 1024, 2048)
BLAS_ROUNDS = 3


def rel_err(x, ref) -> float:
    x = np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)
    ref = np.asarray(ref.astype(mx.float32) if isinstance(ref, mx.array) else ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def goal_lines(goals) -> list[str]:
    """``- name: value (goal >= bound): met`` for each ``(name, value, bound, at_least)``."""
    lines = ["", "Goals:", ""]
    for name, value, bound, at_least in goals:
        met = value >= bound if at_least else value <= bound
        sign = ">=" if at_least else "<="
        lines.append(f"- {name}: {value:.2f} (goal {sign} {bound:g}): {'met' if met else 'MISSED'}")
    return lines


def write_section(title: str, command: str, lines: list[str]) -> None:
    """Append one result section to BENCHMARKS.md and echo it."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = "\n".join(
        [
            f"## {title} ({stamp})",
            "",
            f"Machine: {machine_description()}",
            f"Command: `{command}`",
            "",
        ]
        + lines
        + [""]
    )
    if not RESULTS.exists():
        RESULTS.write_text(
            "# Benchmarks\n\nWritten by `scripts/bench.py`; newest sections last.\n\n"
        )
    with RESULTS.open("a") as f:
        f.write(text + "\n")
    print(text)


def numpy_matmul_gflops(n: int) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / best_time(lambda: a @ b) / 1e9


def numpy_blas() -> str:
    """NumPy's own BLAS: its version, core type and threads when it is an OpenBLAS copy."""
    mlx_one = _blas.mapped_openblas()
    libs = _blas.mapped_blas_libraries()
    own = [p for p in libs if "openblas" in os.path.basename(p).lower() and p != mlx_one]
    return _blas.openblas_summary(own[0]) if own else "not an OpenBLAS"


def matmul_worker(sizes) -> dict:
    """MLX fp32 matmul GFLOP/s per size in this process, with the BLAS and core type it found."""
    return {
        "blas": _blas.describe(),
        "core": _blas.running_core(),
        "core_note": _blas.status.core_note,
        "gflops": {str(n): matmul_gflops(n) for n in sizes},
    }


def matmul_in_subprocess(sizes, **env) -> dict:
    """``matmul_worker`` in a fresh interpreter with ``env`` added: the BLAS is chosen at load."""
    cmd = [sys.executable, __file__, "_matmul-worker", *map(str, sizes)]
    full_env = dict(os.environ, **env)
    out = subprocess.run(cmd, env=full_env, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def verify_matmul() -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 257)).astype(np.float32)
    b = rng.standard_normal((257, 129)).astype(np.float32)
    err = rel_err(mx.array(a) @ mx.array(b), a.astype(np.float64) @ b.astype(np.float64))
    if not err <= 1e-5:
        raise SystemExit(f"verify failed: MLX fp32 matmul error {err:.2e} > 1e-5")
    return err


def bench_blas(args) -> None:
    err = verify_matmul()
    ours = matmul_worker(MATMUL_SIZES)
    numpy_rates = {str(n): numpy_matmul_gflops(n) for n in MATMUL_SIZES}
    # More rounds, MLX and NumPy in turn, best of each: a burst of other load on the machine
    # then cannot fall on one side of the ratio only.
    for _ in range(BLAS_ROUNDS - 1):
        for n in map(str, MATMUL_SIZES):
            ours["gflops"][n] = max(ours["gflops"][n], matmul_gflops(int(n)))
            numpy_rates[n] = max(numpy_rates[n], numpy_matmul_gflops(int(n)))
    bundled = matmul_in_subprocess(MATMUL_SIZES, MLX_RWKVX_BLAS="0")
    # What a misdetected core costs: OpenBLAS's generic x86-64 kernels, as it falls back to on a
    # CPU it does not know (x86 only; other CPUs have no Prescott core).
    prescott = None
    if ours["core"] and _blas.cpu_flags():
        prescott = matmul_in_subprocess(
            MATMUL_SIZES, OPENBLAS_CORETYPE="Prescott", MLX_RWKVX_BLAS_CORETYPE="0"
        )
    bw_all = read_bandwidth_gbs()
    bw_one = read_bandwidth_gbs(threads=1)
    lines = [
        f"Verified first: MLX fp32 matmul vs NumPy float64, relative error {err:.1e}.",
        f"MLX and NumPy timed in turn: best of {BLAS_ROUNDS} rounds of best-of-3.",
        "",
        f"- with mlx_rwkvx: {ours['blas']}",
        f"- core type: {ours['core'] or 'n/a'} ({ours['core_note'] or 'no OpenBLAS loaded'})",
        f"- NumPy's own: {numpy_blas()}",
    ]
    if prescott:
        lines.append(f"- Prescott forced (`OPENBLAS_CORETYPE=Prescott`): {prescott['blas']}")
    lines += [
        f"- without (`MLX_RWKVX_BLAS=0`): {bundled['blas']}",
        "",
        "| fp32 matmul n x n x n | MLX + OpenBLAS | MLX + OpenBLAS, Prescott forced "
        "| MLX bundled BLAS | NumPy | OpenBLAS / bundled | MLX+OpenBLAS / NumPy |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in map(str, MATMUL_SIZES):
        o, b, p = ours["gflops"][n], bundled["gflops"][n], numpy_rates[n]
        forced = f"{prescott['gflops'][n]:.1f} GFLOP/s" if prescott else "n/a"
        lines.append(
            f"| {n} | {o:.1f} GFLOP/s | {forced} | {b:.1f} GFLOP/s | {p:.1f} GFLOP/s "
            f"| {o / b:.1f}x | {o / p:.2f}x |"
        )
    big = str(MATMUL_SIZES[-1])
    goals = [
        (
            f"MLX+OpenBLAS / bundled BLAS, fp32 n={big}",
            ours["gflops"][big] / bundled["gflops"][big],
            10,
            True,
        ),
        (f"MLX+OpenBLAS / NumPy, fp32 n={big}", ours["gflops"][big] / numpy_rates[big], 0.8, True),
    ]
    if prescott:
        cost = ours["gflops"][big] / prescott["gflops"][big]
        lines += ["", f"A misdetected (Prescott) core would be {cost:.1f}x slower at n={big}."]
    lines += goal_lines(goals) + [
        "",
        "Physical limits for later benchmarks:",
        f"- fp32 matmul: {ours['gflops'][big]:.1f} GFLOP/s (MLX + OpenBLAS, n={big})",
        f"- memory read bandwidth: {bw_all:.1f} GB/s with {os.cpu_count()} threads "
        f"({bw_one:.1f} GB/s with one), streaming 1 GiB of fp32",
    ]
    write_section("blas", "python scripts/bench.py blas", lines)


WKV7_SHAPES = [(256, 8), (1024, 8), (2048, 8), (4096, 8), (1024, 24)]  # (T, H); B = 1, N = 64
# MLX autograd through a step loop keeps one full [B, T, H, N] cotangent per step (the VJP of
# each per-step slice): memory grows as (T H)^2, measured 3.3 GB at T H = 8192. Larger runs
# would not fit in this machine's RAM and are reported as such.
LOOP_GRAD_MAX_HEAD_STEPS = 16384


def wkv7_inputs(T: int, H: int, N: int = 64, seed: int = 0) -> list:
    """RWKV-7-like inputs: decays in (0.5, 0.999), a = -kk, b = kk * iclr."""
    rng = np.random.default_rng(seed)
    shape = (1, T, H, N)
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    arrays = [
        rng.uniform(-0.5, 0.5, shape),
        np.log(rng.uniform(0.5, 0.999, shape)),
        rng.uniform(-0.5, 0.5, shape),
        rng.uniform(-0.5, 0.5, shape),
        -kk,
        kk * rng.uniform(0, 1, shape),
        rng.uniform(-0.5, 0.5, (1, H, N, N)),
    ]
    out = [mx.array(x.astype(np.float32)) for x in arrays]
    mx.eval(out)
    return out


def mlx_lm_wkv7(r, log_w, k, v, a, b, state):
    """mlx-lm's own CPU WKV7 path (its time-mix ``_wkv7`` method), fed the decay it expects."""
    from types import SimpleNamespace

    from mlx_lm.models.rwkv7 import Rwkv7TimeMixing

    _, _, H, N = r.shape
    owner = SimpleNamespace(num_heads=H, head_dim=N)
    return Rwkv7TimeMixing._wkv7(owner, r, mx.exp(log_w), k, v, a, b, state)


def chunked_flops(T: int, H: int, N: int) -> float:
    """Matmul FLOPs of the chunked forward (ops/wkv.py), B = 1, counted from its shapes."""
    from mlx_rwkvx.ops.wkv import CHUNK as L
    from mlx_rwkvx.ops.wkv import SUB as S

    nq = L // S
    per_chunk = (
        2 * nq * (2 * S) * N * (2 * L)  # scores of r, a against k, b
        + 2 * nq * 4 * S**3
        + 2 * 2 * (L // 2) ** 3  # (I - A)^-1
        + 2 * L * L * N
        + 2 * L * L * (2 * N)
        + 2 * L * L * N  # A_ak v, the solve, Qm
        + 2 * L * (2 * L) * N  # Y0
        + 2 * N * L * N
        + 2 * N * (2 * L) * N  # P, U
        + 2 * N**3
        + 2 * L * N * N  # the scan, Y from the states
    )
    return H * -(-T // L) * per_chunk


def _fwd(fn, args):
    return lambda: mx.eval(fn(*args))


def _fwd_bwd(fn, args):
    def loss(*xs):
        y, s = fn(*xs)
        return y.sum() + s.sum()

    grad = mx.grad(loss, argnums=list(range(7)))
    return lambda: mx.eval(grad(*args))


def _measure(run, repeats):
    """(best time, peak memory in bytes above what was allocated before)."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    run()
    peak = mx.get_peak_memory() - base
    t = best_time(run, repeats=repeats, warmup=0)
    return t, peak


def bench_wkv7(args) -> None:
    from mlx_rwkvx.ops.wkv import wkv7, wkv7_ref

    # verify first: the dispatcher's path against the step loop, outputs and gradients
    xs = wkv7_inputs(300, 4)
    y_ref, s_ref = wkv7_ref(*xs)
    y, s = wkv7(*xs)
    y_lm, s_lm = mlx_lm_wkv7(*xs)
    errs = [
        rel_err(y, y_ref),
        rel_err(s, s_ref),
        rel_err(y_lm[..., 0] if y_lm.ndim == 5 else y_lm, y_ref),
    ]
    g_ref = mx.grad(lambda *a: sum(o.sum() for o in wkv7_ref(*a)), argnums=list(range(7)))(*xs)
    g = mx.grad(lambda *a: sum(o.sum() for o in wkv7(*a)), argnums=list(range(7)))(*xs)
    g_err = max(rel_err(x, r) for x, r in zip(g, g_ref, strict=True))
    if not (max(errs[:2]) <= 2e-6 and g_err <= 1e-5 and errs[2] <= 2e-6):
        raise SystemExit(f"verify failed: wkv7 vs ref {errs}, gradients {g_err:.1e}")

    rate = matmul_gflops(2048)
    small_rate = _bmm_gflops()
    rows, results = [], {}
    for T, H in WKV7_SHAPES:
        xs = wkv7_inputs(T, H)
        slow = T * H > 8 * 1024  # step loops of more than ~8k head-steps: one timed run
        reps = 1 if slow else 3
        fits = T * H <= LOOP_GRAD_MAX_HEAD_STEPS
        res = {
            "ours_fwd": _measure(_fwd(wkv7, xs), 3),
            "ours_fb": _measure(_fwd_bwd(wkv7, xs), 3),
            "lm_fwd": _measure(_fwd(mlx_lm_wkv7, xs), reps),
            "ref_fwd": _measure(_fwd(wkv7_ref, xs), reps),
            "lm_fb": _measure(_fwd_bwd(mlx_lm_wkv7, xs), reps) if fits else None,
            "ref_fb": _measure(_fwd_bwd(wkv7_ref, xs), 1) if fits else None,
        }
        results[(T, H)] = res
        flops = chunked_flops(T, H, 64)
        rows.append((T, H, res, flops / res["ours_fwd"][0] / 1e9))
        print(f"T={T} H={H}: " + ", ".join(f"{k} {v[0] * 1e3:.1f} ms" for k, v in res.items() if v))

    def ms(x):
        return f"{x * 1e3:.1f} ms"

    def mib(x):
        return f"{x / 2**20:.0f} MiB"

    def ratio(res, slow, fast, index=0, fmt=".0f"):
        if res[slow] is None:
            return "n/a"
        return f"{res[slow][index] / res[fast][index]:{fmt}}x"

    def cell(res, key, index, show):
        if res[key] is None:
            return f"does not fit ({(T * H / 8192) ** 2 * 3.3:.0f} GB)"
        return show(res[key][index])

    lines = [
        f"Verified first (T=300, H=4): wkv7 vs wkv7_ref y {errs[0]:.1e}, state {errs[1]:.1e}, "
        f"gradients <= {g_err:.1e}; mlx-lm's loop vs wkv7_ref y {errs[2]:.1e}.",
        "",
        "B=1, N=64, float32. `wkv7` = our dispatcher (the chunked path on this CPU); "
        "`ref autograd` = MLX autograd through our step loop `wkv7_ref`; `mlx-lm` = "
        "`Rwkv7TimeMixing._wkv7`'s CPU loop of its compiled step (given exp(log_w), the exp "
        "not timed), differentiated by MLX autograd. Best of 3 after a warm-up, except runs "
        "over ~8k head-steps of the two step loops: one run after the memory-measuring one.",
        "",
        "| T | H | wkv7 fwd | mlx-lm fwd | ref fwd | fwd speed-up vs mlx-lm | wkv7 fwd+bwd "
        "| mlx-lm fwd+bwd | ref autograd fwd+bwd | fwd+bwd speed-up vs ref autograd "
        "| vs mlx-lm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for T, H, res, _ in rows:
        lines.append(
            f"| {T} | {H} | {ms(res['ours_fwd'][0])} | {ms(res['lm_fwd'][0])} "
            f"| {ms(res['ref_fwd'][0])} | {res['lm_fwd'][0] / res['ours_fwd'][0]:.1f}x "
            f"| {ms(res['ours_fb'][0])} | {cell(res, 'lm_fb', 0, ms)} "
            f"| {cell(res, 'ref_fb', 0, ms)} | {ratio(res, 'ref_fb', 'ours_fb')} "
            f"| {ratio(res, 'lm_fb', 'ours_fb')} |"
        )
    lines += [
        "",
        "Peak memory of fwd+bwd (above the inputs):",
        "",
        "| T | H | wkv7 | mlx-lm | ref autograd | ref autograd / wkv7 |",
        "|---|---|---|---|---|---|",
    ]
    for T, H, res, _ in rows:
        lines.append(
            f"| {T} | {H} | {mib(res['ours_fb'][1])} | {cell(res, 'lm_fb', 1, mib)} "
            f"| {cell(res, 'ref_fb', 1, mib)} | {ratio(res, 'ref_fb', 'ours_fb', 1, '.1f')} |"
        )
    lines += [
        "",
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s (2048^3), {small_rate:.0f} "
        "GFLOP/s for the batched 16 x 64 x 64 matmuls the chunked path is made of.",
        "",
        "| T | H | chunked fwd matmul work | achieved | of 2048^3 rate | of batched rate |",
        "|---|---|---|---|---|---|",
    ]
    for T, H, _res, gf in rows:
        lines.append(
            f"| {T} | {H} | {chunked_flops(T, H, 64) / 1e9:.2f} GFLOP | {gf:.0f} GFLOP/s "
            f"| {gf / rate:.0%} | {gf / small_rate:.0%} |"
        )
    r1, r2, r4 = results[(1024, 8)], results[(2048, 8)], results[(4096, 8)]
    goals = [
        ("fwd+bwd T=1024 H=8 vs ref autograd", r1["ref_fb"][0] / r1["ours_fb"][0], 100, True),
        ("fwd T=4096 H=8 vs mlx-lm", r4["lm_fwd"][0] / r4["ours_fwd"][0], 20, True),
        (
            "fwd+bwd peak memory ref / ours at T=2048 (T=4096: the step loop does not fit; "
            "its share only grows with T)",
            r2["ref_fb"][1] / r2["ours_fb"][1],
            10,
            True,
        ),
        ("T=4096 / T=1024 fwd time", r4["ours_fwd"][0] / r1["ours_fwd"][0], 4.5, False),
        ("T=4096 / T=1024 fwd+bwd time", r4["ours_fb"][0] / r1["ours_fb"][0], 4.5, False),
    ]
    write_section("wkv7", "python scripts/bench.py wkv7", lines + goal_lines(goals))


MOBA_TS = (2048, 4096, 8192, 16384)
MOBA = dict(H=8, D=64, chunk_size=256, top_k=3)
# Dense causal attention keeps [H, T, T] float32 scores (and more for its backward): at
# T = 16384 that is 8.6 GB for the forward alone, beyond this machine with its backward.
DENSE_MAX_T = 8192


def _attention_inputs(T: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    arrays = [rng.standard_normal((1, T, MOBA["H"], MOBA["D"])) for _ in range(3)]
    out = [mx.array(x.astype(np.float32)) for x in arrays]
    mx.eval(out)
    return out


def _dense_causal(q, k, v):
    qh, kh, vh = (x.transpose(0, 2, 1, 3) for x in (q, k, v))
    scale = 1.0 / np.sqrt(q.shape[-1])
    out = mx.fast.scaled_dot_product_attention(qh, kh, vh, scale=scale, mask="causal")
    return out.transpose(0, 2, 1, 3)


def bench_moba(args) -> None:
    from mlx_rwkvx.ops.moba import moba_attention, moba_attention_ref

    cs, top_k = MOBA["chunk_size"], MOBA["top_k"]

    def moba(q, k, v):
        return moba_attention(q, k, v, chunk_size=cs, top_k=top_k)

    # verify first: the sparse path against the dense masked reference, outputs and gradients
    # (T=2048: 8 chunks, so top_k=3 leaves chunks out and the sparse path runs)
    xs = _attention_inputs(2048, seed=1)
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
        raise SystemExit(f"verify failed: moba vs dense masked reference {err:.1e}, {g_err:.1e}")

    def fwd(fn, xs):
        return lambda: mx.eval(fn(*xs))

    def fwd_bwd(fn, xs):
        grad = mx.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))
        return lambda: mx.eval(grad(*xs))

    rate = matmul_gflops(2048)
    rows = {T: {} for T in MOBA_TS}
    # every MoBA run first, then dense: dense's gigabytes of freed buffers (kept in MLX's cache)
    # would otherwise slow the long MoBA runs after them
    for name, fn, reps in (("moba", moba, 3), ("dense", _dense_causal, 1)):
        for T in MOBA_TS:
            fits = name == "moba" or T <= DENSE_MAX_T
            inputs = _attention_inputs(T)
            rows[T][f"{name}_fwd"] = _measure(fwd(fn, inputs), reps) if fits else None
            rows[T][f"{name}_fb"] = _measure(fwd_bwd(fn, inputs), reps) if fits else None
            del inputs
            mx.clear_cache()
            done = {k: v for k, v in rows[T].items() if v and k.startswith(name)}
            print(f"T={T}: " + ", ".join(f"{k} {v[0]:.2f} s" for k, v in done.items()))

    def cell(res, key, index, show):
        return "does not fit" if res[key] is None else show(res[key][index])

    def ratio(res, key, ours, index):
        return "n/a" if res[key] is None else f"{res[key][index] / res[ours][index]:.1f}x"

    def sec(x):
        return f"{x:.2f} s"

    def mib(x):
        return f"{x / 2**20:.0f} MiB"

    H, D = MOBA["H"], MOBA["D"]
    lines = [
        f"Verified first (T=2048): moba_attention vs the dense masked reference: output {err:.1e}"
        f", gradients <= {g_err:.1e}.",
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
    for T, res in rows.items():
        lines.append(
            f"| {T} | {sec(res['moba_fwd'][0])} | {cell(res, 'dense_fwd', 0, sec)} "
            f"| {ratio(res, 'dense_fwd', 'moba_fwd', 0)} | {sec(res['moba_fb'][0])} "
            f"| {cell(res, 'dense_fb', 0, sec)} | {ratio(res, 'dense_fb', 'moba_fb', 0)} "
            f"| {mib(res['moba_fb'][1])} | {cell(res, 'dense_fb', 1, mib)} "
            f"| {ratio(res, 'dense_fb', 'moba_fb', 1)} |"
        )
    lines += [
        "",
        f"Limit measured in this run: fp32 matmul {rate:.0f} GFLOP/s (2048^3).",
        "",
        "| T | moba fwd matmul work | achieved | of the matmul rate |",
        "|---|---|---|---|",
    ]
    for T, res in rows.items():
        flops = 2 * 2 * T * H * (top_k + 1) * cs * D  # scores and values, own chunk included
        achieved = flops / res["moba_fwd"][0] / 1e9
        lines.append(
            f"| {T} | {flops / 1e9:.1f} GFLOP | {achieved:.0f} GFLOP/s | {achieved / rate:.0%} |"
        )
    r8, r4, r16 = rows[8192], rows[4096], rows[16384]
    goals = [
        ("fwd+bwd T=8192 vs dense", r8["dense_fb"][0] / r8["moba_fb"][0], 3.0, True),
        (
            "fwd+bwd peak memory T=8192, dense / moba",
            r8["dense_fb"][1] / r8["moba_fb"][1],
            4.0,
            True,
        ),
        ("fwd time T=16384 / T=4096", r16["moba_fwd"][0] / r4["moba_fwd"][0], 5.0, False),
        ("fwd+bwd time T=16384 / T=4096", r16["moba_fb"][0] / r4["moba_fb"][0], 5.0, False),
    ]
    write_section("moba", "python scripts/bench.py moba", lines + goal_lines(goals))


def _mlx_lm_twin(model, tmp: str):
    """mlx-lm's own model with the same weights (through our Hugging Face export)."""
    from pathlib import Path

    from mlx_rwkvx.io.formats import write_hf

    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    write_hf(tmp, model.config, dict(tree_flatten(model.parameters())))
    theirs, _ = load_model(Path(tmp))
    return theirs


def _linear_params(model) -> int:
    """Parameters of every Linear (the head included, the embedding not): one read per token."""
    import mlx.nn as nn

    total = 0
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear):
            total += m.weight.size + (m.bias.size if "bias" in m else 0)
    return total


def _decode_rate(model, steps: int = 24) -> float:
    """Tokens per second of one-token steps with the cache, after a short prefill."""
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache))
    token = mx.array([[5]])

    def run():
        nonlocal token
        for _ in range(steps):
            logits = model(token, cache)
            token = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(token)

    return steps / best_time(run, repeats=2, warmup=1)


def bench_models(args) -> None:
    import tempfile

    from mlx_rwkvx.io.load import build
    from mlx_rwkvx.models import ModelConfig, preset

    rate = matmul_gflops(2048)
    bandwidth = read_bandwidth_gbs()
    lines = [
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s (2048^3), memory read "
        f"{bandwidth:.1f} GB/s.",
        "",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        # the RWKV-7 0.1B shape, random weights (the seeds' init), ours and mlx-lm's
        cfg = preset("rwkv7-0.1b")
        ours = build(cfg)
        theirs = _mlx_lm_twin(ours, tmp + "/hf")
        tokens = mx.array(np.random.default_rng(0).integers(0, 65536, (1, 1024)))
        a, b = ours(tokens), theirs(tokens)
        err = rel_err(a, b)
        if not err <= 1e-4:
            raise SystemExit(f"verify failed: logits vs mlx-lm {err:.1e}")
        t_ours = best_time(lambda: mx.eval(ours(tokens)), repeats=3)
        t_lm = best_time(lambda: mx.eval(theirs(tokens)), repeats=2)
        n_lin = _linear_params(ours)
        bound = 2 * 1024 * n_lin / (rate * 1e9)
        lines += [
            f"Verified first: logits of the 12-layer C=768 vocab-65536 model vs mlx-lm's, T=1024: "
            f"relative error {err:.1e}.",
            "",
            "| prefill T=1024, 12 x C=768, vocab 65536 (all logits) | time | vs matmul bound |",
            "|---|---|---|",
            f"| matmul bound: 2 T x {n_lin / 1e6:.0f}M Linear+head params / {rate:.0f} GFLOP/s "
            f"| {bound:.2f} s | 1.00 |",
            f"| mlx_rwkvx | {t_ours:.2f} s | {t_ours / bound:.2f} |",
            f"| mlx-lm | {t_lm:.2f} s | {t_lm / bound:.2f} |",
            "",
            f"mlx_rwkvx is {t_lm / t_ours:.1f}x faster than mlx-lm here.",
            "",
        ]
        weight_bytes = n_lin * 4
        decode_bound = bandwidth * 1e9 / weight_bytes
        rates = {"fp32": _decode_rate(ours), "mlx-lm fp32": _decode_rate(theirs)}
        bf16 = build(cfg)
        bf16.set_dtype(mx.bfloat16)
        rates["bf16"] = _decode_rate(bf16)
        del bf16
        rates["int8"] = _decode_rate(build(cfg, quantize="int8"))
        lines += [
            f"Decode (one token, cache) of the same model; weight-read bound "
            f"{weight_bytes / 1e6:.0f} MB fp32 / {bandwidth:.1f} GB/s = {decode_bound:.1f} tok/s.",
            "",
            "| decode | tok/s | of the fp32 bound |",
            "|---|---|---|",
        ]
        for name, r in rates.items():
            lines.append(f"| {name} | {r:.1f} | {r / decode_bound:.0%} |")
        # recurrence-dominated: 4 layers, C=256, vocab 4096, T=4096
        small = ModelConfig(vocab_size=4096, hidden_size=256, block_types=["rwkv7"] * 4)
        ours_s = build(small)
        theirs_s = _mlx_lm_twin(ours_s, tmp + "/hf_small")
        tokens = mx.array(np.random.default_rng(1).integers(0, 4096, (1, 4096)))
        err_s = rel_err(ours_s(tokens), theirs_s(tokens))
        t_s = best_time(lambda: mx.eval(ours_s(tokens)), repeats=3)
        t_s_lm = best_time(lambda: mx.eval(theirs_s(tokens)), repeats=1)
        lines += [
            "",
            f"Prefill T=4096 of a 4-layer C=256 vocab-4096 model (logits vs mlx-lm {err_s:.1e}): "
            f"mlx_rwkvx {t_s:.2f} s, mlx-lm {t_s_lm:.2f} s: {t_s_lm / t_s:.1f}x faster.",
        ]
    # the 1.5B RFA preset in INT8, in a fresh process so that nothing else is in memory
    cmd = [sys.executable, __file__, "_rfa-int8-worker"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rfa = json.loads(out.strip().splitlines()[-1])
    peak_build, at_rest, peak_load, rest_load = (
        rfa[k] for k in ("peak_build", "at_rest", "peak_load", "rest_load")
    )
    n_params, rfa_rate = rfa["n_params"], rfa["decode"]
    lines += [
        "",
        "The 1.5B RFA preset (random weights) in INT8:",
        "",
        f"- {n_params / 1e9:.2f}B parameters (projections, head and embedding in INT8 with "
        "group-64 scales and biases; norms and low-rank matrices float32)",
        f"- build: peak {peak_build / 1e9:.2f} GB, at rest {at_rest / 1e9:.2f} GB (goal <= 2.3 GB)",
        f"- load of the saved INT8 checkpoint: peak {peak_load / 1e9:.2f} GB, at rest "
        f"{rest_load / 1e9:.2f} GB",
        f"- decode {rfa_rate:.2f} tok/s (MLX's CPU quantized matmul; see the INT8 row above)",
    ]
    goals = [
        ("prefill T=1024 / matmul bound", t_ours / bound, 1.3, False),
        ("prefill T=4096 small model vs mlx-lm", t_s_lm / t_s, 10.0, True),
        ("fp32 decode / weight-read bound", rates["fp32"] / decode_bound, 0.85, True),
        ("1.5B INT8 peak while building, GB", peak_build / 1e9, 2.3, False),
        ("1.5B INT8 peak while loading, GB", peak_load / 1e9, 2.3, False),
    ]
    write_section("models", "python scripts/bench.py models", lines + goal_lines(goals))


def rfa_int8_worker() -> dict:
    """Build the 1.5B RFA preset in INT8, save it, load it back: memory and decode rate."""
    import tempfile

    from mlx_rwkvx.io.load import build, load_model, save
    from mlx_rwkvx.models import Model, preset

    from mlx.utils import tree_flatten

    mx.reset_peak_memory()
    big = build(preset("rfa-1.5b"), quantize="int8")
    result = {"peak_build": mx.get_peak_memory(), "at_rest": mx.get_active_memory()}
    lazy = Model(preset("rfa-1.5b"), init=None)  # shapes only: nothing is computed
    result["n_params"] = sum(v.size for _, v in tree_flatten(lazy.parameters()))
    result["decode"] = _decode_rate(big, steps=8)
    with tempfile.TemporaryDirectory() as tmp:
        save(big, tmp + "/rfa8")
        del big
        mx.clear_cache()
        mx.reset_peak_memory()
        loaded = load_model(tmp + "/rfa8")
        result["peak_load"], result["rest_load"] = mx.get_peak_memory(), mx.get_active_memory()
        del loaded
    return result


def _bmm_gflops() -> float:
    a = mx.random.normal((2048, 16, 64))
    b = mx.random.normal((2048, 64, 64))
    mx.eval(a, b)
    return 2 * 2048 * 16 * 64 * 64 / best_time(lambda: mx.eval(a @ b)) / 1e9


def main(argv=None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_matmul-worker":
        print(json.dumps(matmul_worker([int(n) for n in argv[1:]])))
        return
    if argv and argv[0] == "_rfa-int8-worker":
        print(json.dumps(rfa_int8_worker()))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="bench", required=True)
    sub.add_parser(
        "blas", help="MLX matmul with OpenBLAS (its core and Prescott), without, NumPy, bandwidth"
    )
    sub.add_parser("wkv7", help="WKV7 forward and fwd+bwd vs the step loop and mlx-lm")
    sub.add_parser("moba", help="MoBA attention vs dense causal SDPA, time and memory")
    sub.add_parser("models", help="prefill and decode vs mlx-lm and the physical bounds")
    args = parser.parse_args(argv)
    benches = {"blas": bench_blas, "wkv7": bench_wkv7, "moba": bench_moba, "models": bench_models}
    benches[args.bench](args)


if __name__ == "__main__":
    main()
