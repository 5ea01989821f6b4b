"""Benchmarks: each section verifies its fast path against a reference, then times it.

    python scripts/bench.py blas
    python scripts/bench.py wkv7 moba models    # several sections, one after another
    python scripts/bench.py all                 # every section: BENCHMARKS.md written anew
    python scripts/bench.py all --skip train-int8   # that one carried over from the last run
    python scripts/bench.py render              # BENCHMARKS.md again from benchmarks.json
    python scripts/bench.py all --quick --output /tmp/bench   # the smoke run

A section run on its own is appended to BENCHMARKS.md with the machine, the command, the times
and every ratio, each set beside the physical limits measured in the same run. ``all`` runs
every section and only then rewrites BENCHMARKS.md (a failed verification leaves the old one
whole): a header naming the machine, MLX, its BLAS and NumPy; a summary of every section's
goals; one section each. Beside it go the raw measurements (benchmarks.json: ``--skip``
carries a section over from it, ``render`` re-renders from it without measuring) and
benchmarks.png where matplotlib is installed (the ``plot`` extra). ``--output DIR`` writes
elsewhere than the repository's root. ``--quick`` runs at small sizes: a smoke test of the
script, whose numbers say nothing about the code's speed; it writes into a new temporary folder
unless given ``--output``, and never into the repository. While ``all`` runs,
benchmarks.partial.json holds the sections measured so far: after a failure or Ctrl-C,
``--skip`` carries them over from it.

Each section is ``measure_<section>(quick)``, which verifies and then times and returns plain
data (JSON-serialisable), and ``render_<section>(results)``, which turns that data into the
markdown lines, goals and ratios included, without measuring anything; ``goal_lines`` writes
a section's goals and, for the summary, records them (``render_with_goals``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx_rwkvx  # first: it loads OpenBLAS before mlx.core
from mlx_rwkvx import _blas
from mlx_rwkvx.perf import best_time, machine_description, matmul_gflops, read_bandwidth_gbs

import mlx.core as mx
import mlx.nn as nn
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "BENCHMARKS.md"


class VerificationFailed(RuntimeError):
    """A fast path disagrees with its reference; nothing has been timed."""


def rel_err(x, ref) -> float:
    x = np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)
    ref = np.asarray(ref.astype(mx.float32) if isinstance(ref, mx.array) else ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


# The goals each goal_lines call judged go to the innermost list here while render_with_goals
# collects them: a goal is defined once, in its section's renderer.
_GOAL_LOGS: list[list[dict]] = []


def judge(goals) -> list[dict]:
    """Each ``(name, value, bound, at_least)`` as a record that says whether it is met."""
    judged = []
    for name, value, bound, at_least in goals:
        met = value >= bound if at_least else value <= bound
        judged.append(
            dict(name=name, value=float(value), bound=bound, at_least=at_least, met=bool(met))
        )
    return judged


def _goal_bound(goal: dict) -> str:
    return f"{'>=' if goal['at_least'] else '<='} {goal['bound']:g}"


def _goal_verdict(goal: dict) -> str:
    return "met" if goal["met"] else "MISSED"


def goal_lines(goals) -> list[str]:
    """``- name: value (goal >= bound): met`` for each ``(name, value, bound, at_least)``."""
    judged = judge(goals)
    if _GOAL_LOGS:
        _GOAL_LOGS[-1].extend(judged)
    lines = ["", "Goals:", ""]
    for g in judged:
        lines.append(f"- {g['name']}: {g['value']:.2f} (goal {_goal_bound(g)}): {_goal_verdict(g)}")
    return lines


def _now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def write_section(title: str, command: str, lines: list[str], path: Path | None = None) -> None:
    """Echo one result section, then append it to ``path`` (default BENCHMARKS.md); ReportError
    where it cannot be written."""
    path = path or RESULTS
    stamp = _now()
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
    print(text)
    try:
        if not path.exists():
            path.write_text(
                "# Benchmarks\n\nWritten by `scripts/bench.py`; newest sections last.\n\n"
            )
        with path.open("a") as f:
            f.write(text + "\n")
    except OSError as e:
        raise ReportError(f"{path}: cannot be written ({e.strerror or e})") from None


def _sizes(table: dict, quick: bool) -> dict:
    return table["quick" if quick else "full"]


def _stream_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def _measure(run, repeats) -> dict:
    """Best time in seconds and peak memory in bytes above what was allocated before."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    run()
    peak = mx.get_peak_memory() - base
    t = best_time(run, repeats=repeats, warmup=0)
    return {"time": t, "peak": peak}


BLAS = {
    "full": dict(sizes=(512, 1024, 2048), rounds=3, stream_bytes=1 << 30),
    "quick": dict(sizes=(64, 128, 256), rounds=2, stream_bytes=1 << 26),
}


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
        raise VerificationFailed(f"MLX fp32 matmul error {err:.2e} > 1e-5")
    return err


def measure_blas(quick: bool = False) -> dict:
    """MLX matmul with OpenBLAS, with its Prescott kernels, with MLX's own BLAS, and NumPy's."""
    cfg = _sizes(BLAS, quick)
    sizes, rounds = cfg["sizes"], cfg["rounds"]
    err = verify_matmul()
    ours = matmul_worker(sizes)
    numpy_rates = {str(n): numpy_matmul_gflops(n) for n in sizes}
    # More rounds, MLX and NumPy in turn, best of each: a burst of other load on the machine
    # then cannot fall on one side of the ratio only.
    for _ in range(rounds - 1):
        for n in map(str, sizes):
            ours["gflops"][n] = max(ours["gflops"][n], matmul_gflops(int(n)))
            numpy_rates[n] = max(numpy_rates[n], numpy_matmul_gflops(int(n)))
    bundled = matmul_in_subprocess(sizes, MLX_RWKVX_BLAS="0")
    # What a misdetected core costs: OpenBLAS's generic x86-64 kernels, as it falls back to on a
    # CPU it does not know (x86 only; other CPUs have no Prescott core).
    prescott = None
    if ours["core"] and _blas.cpu_flags():
        prescott = matmul_in_subprocess(
            sizes, OPENBLAS_CORETYPE="Prescott", MLX_RWKVX_BLAS_CORETYPE="0"
        )
    nbytes = cfg["stream_bytes"]
    return {
        "verify_error": err,
        "rounds": rounds,
        "sizes": list(sizes),
        "ours": ours,
        "prescott": prescott,
        "bundled": bundled,
        "numpy_gflops": numpy_rates,
        "numpy_blas": numpy_blas(),
        "threads": os.cpu_count(),
        "stream_bytes": nbytes,
        "bandwidth_gbs": read_bandwidth_gbs(nbytes),
        "bandwidth_one_thread_gbs": read_bandwidth_gbs(nbytes, threads=1),
    }


def render_blas(r: dict) -> list[str]:
    """The BLAS section: which BLAS each path ran, the GFLOP/s table, goals, physical limits."""
    ours, bundled, prescott, numpy_rates = r["ours"], r["bundled"], r["prescott"], r["numpy_gflops"]
    lines = [
        "Verified first: MLX fp32 matmul vs NumPy float64, relative error "
        f"{r['verify_error']:.1e}.",
        f"MLX and NumPy timed in turn: best of {r['rounds']} rounds of best-of-3.",
        "",
        f"- with mlx_rwkvx: {ours['blas']}",
        f"- core type: {ours['core'] or 'n/a'} ({ours['core_note'] or 'no OpenBLAS loaded'})",
        f"- NumPy's own: {r['numpy_blas']}",
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
    for n in map(str, r["sizes"]):
        o, b, p = ours["gflops"][n], bundled["gflops"][n], numpy_rates[n]
        forced = f"{prescott['gflops'][n]:.1f} GFLOP/s" if prescott else "n/a"
        lines.append(
            f"| {n} | {o:.1f} GFLOP/s | {forced} | {b:.1f} GFLOP/s | {p:.1f} GFLOP/s "
            f"| {o / b:.1f}x | {o / p:.2f}x |"
        )
    big = str(r["sizes"][-1])
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
    return (
        lines
        + goal_lines(goals)
        + [
            "",
            "Physical limits for later benchmarks:",
            f"- fp32 matmul: {ours['gflops'][big]:.1f} GFLOP/s (MLX + OpenBLAS, n={big})",
            f"- memory read bandwidth: {r['bandwidth_gbs']:.1f} GB/s with {r['threads']} threads "
            f"({r['bandwidth_one_thread_gbs']:.1f} GB/s with one), streaming "
            f"{_stream_size(r['stream_bytes'])} of fp32",
        ]
    )


# (T, H) of the timed runs, B = 1, N = 64; the goals compare ``base`` with twice and four
# times its length.
WKV7 = {
    "full": dict(
        shapes=[(256, 8), (1024, 8), (2048, 8), (4096, 8), (1024, 24)],
        verify=(300, 4),
        base=(1024, 8),
        matmul_n=2048,
        bmm_batch=2048,
        crossover=[4, 8, 12, 16, 32],  # T: the step loop against the chunked path, H=8
        chunk_T=1024,  # the chunk lengths compared at this T, H=8
    ),
    "quick": dict(
        shapes=[(32, 2), (64, 2), (128, 2), (256, 2), (64, 6)],
        verify=(100, 2),
        base=(64, 2),
        matmul_n=256,
        crossover=[4, 16],
        chunk_T=64,
        bmm_batch=128,
    ),
}
WKV7_N = 64
# Step loops longer than this many head-steps take seconds a run: they are timed once.
SLOW_LOOP_HEAD_STEPS = 8 * 1024
# MLX autograd through a step loop keeps one full [B, T, H, N] cotangent per step (the VJP of
# each per-step slice): memory grows as (T H)^2. Larger runs did not fit in the RAM of the
# machine these benchmarks were first run on; the table reports them as such, with their
# memory extrapolated from the largest run that fitted.
LOOP_GRAD_MAX_HEAD_STEPS = 16384


def wkv7_inputs(T: int, H: int, N: int = WKV7_N, seed: int = 0) -> list:
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
    """Matmul FLOPs of the chunked forward (ops/wkv7/chunk.py), B = 1, counted from its shapes."""
    from mlx_rwkvx.ops.wkv7.chunk import CHUNK as L
    from mlx_rwkvx.ops.wkv7.chunk import SUB as S

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


def _bmm_gflops(batch: int = 2048) -> float:
    """GFLOP/s of the batched 16 x 64 x 64 matmuls the chunked WKV7 path is made of."""
    a = mx.random.normal((batch, 16, 64))
    b = mx.random.normal((batch, 64, 64))
    mx.eval(a, b)
    return 2 * batch * 16 * 64 * 64 / best_time(lambda: mx.eval(a @ b)) / 1e9


def _fwd(fn, args):
    return lambda: mx.eval(fn(*args))


def _fwd_bwd(fn, args):
    def loss(*xs):
        y, s = fn(*xs)
        return y.sum() + s.sum()

    grad = mx.grad(loss, argnums=list(range(7)))
    return lambda: mx.eval(grad(*args))


def _verify_wkv7(wkv7, wkv7_ref, T: int, H: int) -> dict:
    """The dispatcher's path against the step loop (outputs and gradients), and mlx-lm's loop."""
    xs = wkv7_inputs(T, H)
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
        raise VerificationFailed(f"wkv7 vs ref {errs}, gradients {g_err:.1e}")
    return {"T": T, "H": H, "y": errs[0], "state": errs[1], "grad": g_err, "mlx_lm_y": errs[2]}


def measure_wkv7(quick: bool = False) -> dict:
    """WKV7 forward and fwd+bwd: our dispatcher, mlx-lm's loop, autograd through ``wkv7_ref``."""
    from mlx_rwkvx.ops.wkv7 import wkv7, wkv7_ref

    cfg = _sizes(WKV7, quick)
    verify = _verify_wkv7(wkv7, wkv7_ref, *cfg["verify"])
    rate = matmul_gflops(cfg["matmul_n"])
    bmm_rate = _bmm_gflops(cfg["bmm_batch"])
    rows = []
    for T, H in cfg["shapes"]:
        xs = wkv7_inputs(T, H)
        reps = 1 if T * H > SLOW_LOOP_HEAD_STEPS else 3
        fits = T * H <= LOOP_GRAD_MAX_HEAD_STEPS
        runs = {
            "ours_fwd": _measure(_fwd(wkv7, xs), 3),
            "ours_fb": _measure(_fwd_bwd(wkv7, xs), 3),
            "lm_fwd": _measure(_fwd(mlx_lm_wkv7, xs), reps),
            "ref_fwd": _measure(_fwd(wkv7_ref, xs), reps),
            "lm_fb": _measure(_fwd_bwd(mlx_lm_wkv7, xs), reps) if fits else None,
            "ref_fb": _measure(_fwd_bwd(wkv7_ref, xs), 1) if fits else None,
        }
        rows.append({"T": T, "H": H, "flops": chunked_flops(T, H, WKV7_N), "runs": runs})
        print(
            f"T={T} H={H}: "
            + ", ".join(f"{k} {v['time'] * 1e3:.1f} ms" for k, v in runs.items() if v)
        )
    return {
        "verify": verify,
        "choices": _wkv7_choices(cfg),
        "N": WKV7_N,
        "slow_loop_head_steps": SLOW_LOOP_HEAD_STEPS,
        "matmul_n": cfg["matmul_n"],
        "matmul_gflops": rate,
        "bmm_gflops": bmm_rate,
        "base": list(cfg["base"]),
        "rows": rows,
    }


CHUNK_LENGTHS = (16, 32, 64)


def _wkv7_choices(cfg: dict) -> dict:
    """What the code's two constants rest on: up to which T the dispatcher takes the step loop
    (REF_MAX_T), and the chunk length of the chunked path (CHUNK); each candidate verified
    against the step loop first."""
    from mlx_rwkvx.ops.wkv7 import REF_MAX_T, chunk, wkv7_ref

    crossover = []
    for T in cfg["crossover"]:
        xs = wkv7_inputs(T, 8)
        crossover.append(
            {
                "T": T,
                "ref_fwd": _measure(_fwd(wkv7_ref, xs), 5)["time"],
                "chunked_fwd": _measure(_fwd(chunk.chunked, xs), 5)["time"],
                "ref_fb": _measure(_fwd_bwd(wkv7_ref, xs), 5)["time"],
                "chunked_fb": _measure(_fwd_bwd(chunk.chunked, xs), 5)["time"],
            }
        )
    lengths, chosen = [], chunk.CHUNK
    xs = wkv7_inputs(cfg["chunk_T"], 8)
    want = wkv7_ref(*wkv7_inputs(64, 2))[0]
    try:
        for L in CHUNK_LENGTHS:
            chunk.CHUNK = L
            err = rel_err(chunk.chunked(*wkv7_inputs(64, 2))[0], want)
            if not err <= 2e-6:
                raise VerificationFailed(f"wkv7 chunked with chunks of {L}: y off by {err:.1e}")
            fb = _measure(_fwd_bwd(chunk.chunked, xs), 3)["time"]
            lengths.append({"L": L, "fwd": _measure(_fwd(chunk.chunked, xs), 3)["time"], "fb": fb})
    finally:
        chunk.CHUNK = chosen
    return {
        "ref_max_t": REF_MAX_T,
        "crossover": crossover,
        "chunk": chosen,
        "chunk_T": cfg["chunk_T"],
        "lengths": lengths,
    }


def _render_wkv7_choices(c: dict) -> list[str]:
    lines = [
        f"What two constants of `ops/wkv7` rest on (H=8, N={WKV7_N}, best of 5 / 3): the "
        f"dispatcher takes the step loop up to T = REF_MAX_T = {c['ref_max_t']}, then the "
        f"chunked path, whose chunks are CHUNK = {c['chunk']} steps.",
        "",
        "| T | step loop fwd | chunked fwd | step loop fwd+bwd | chunked fwd+bwd |",
        "|---|---|---|---|---|",
    ]
    for row in c["crossover"]:
        lines.append(
            f"| {row['T']} | {row['ref_fwd'] * 1e3:.2f} ms | {row['chunked_fwd'] * 1e3:.2f} ms | "
            f"{row['ref_fb'] * 1e3:.2f} ms | {row['chunked_fb'] * 1e3:.2f} ms |"
        )
    lines += ["", f"| chunk length (T={c['chunk_T']}) | fwd | fwd+bwd |", "|---|---|---|"]
    for row in c["lengths"]:
        lines.append(f"| {row['L']} | {row['fwd'] * 1e3:.1f} ms | {row['fb'] * 1e3:.1f} ms |")
    return lines + [""]


def _loop_peak_estimate(rows: list, key: str, T: int, H: int) -> float | None:
    """Peak bytes a step loop's autograd that was not run would need, from the largest run of
    the same path that fitted: it grows as (T H)^2. None when no run fitted."""
    done = [row for row in rows if row["runs"][key] is not None]
    if not done:
        return None
    top = max(done, key=lambda row: row["T"] * row["H"])
    return top["runs"][key]["peak"] * (T * H / (top["T"] * top["H"])) ** 2


def render_wkv7(r: dict) -> list[str]:
    """The WKV7 section: times, peak memory and the matmul rate reached, then the goals."""
    rows, v, N = r["rows"], r["verify"], r["N"]

    def ms(x):
        return f"{x * 1e3:.1f} ms"

    def mib(x):
        return f"{x / 2**20:.0f} MiB"

    def ratio(runs, slow, fast, field="time", fmt=".0f"):
        if runs[slow] is None:
            return "n/a"
        return f"{runs[slow][field] / runs[fast][field]:{fmt}}x"

    def cell(row, key, field, show):
        if row["runs"][key] is not None:
            return show(row["runs"][key][field])
        estimate = _loop_peak_estimate(rows, key, row["T"], row["H"])
        return "does not fit" if estimate is None else f"does not fit ({estimate / 1e9:.0f} GB)"

    lines = [
        f"Verified first (T={v['T']}, H={v['H']}): wkv7 vs wkv7_ref y {v['y']:.1e}, state "
        f"{v['state']:.1e}, gradients <= {v['grad']:.1e}; mlx-lm's loop vs wkv7_ref y "
        f"{v['mlx_lm_y']:.1e}.",
        "",
        f"B=1, N={N}, float32. `wkv7` = our dispatcher (the chunked path on this CPU); "
        "`ref autograd` = MLX autograd through our step loop `wkv7_ref`; `mlx-lm` = "
        "`Rwkv7TimeMixing._wkv7`'s CPU loop of its compiled step (given exp(log_w), the exp "
        "not timed), differentiated by MLX autograd. Best of 3 after a warm-up, except runs "
        f"over ~{r['slow_loop_head_steps'] // 1024}k head-steps of the two step loops: one run "
        "after the memory-measuring one.",
        "",
        "| T | H | wkv7 fwd | mlx-lm fwd | ref fwd | fwd speed-up vs mlx-lm | wkv7 fwd+bwd "
        "| mlx-lm fwd+bwd | ref autograd fwd+bwd | fwd+bwd speed-up vs ref autograd "
        "| vs mlx-lm |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        T, H, runs = row["T"], row["H"], row["runs"]
        lines.append(
            f"| {T} | {H} | {ms(runs['ours_fwd']['time'])} | {ms(runs['lm_fwd']['time'])} "
            f"| {ms(runs['ref_fwd']['time'])} "
            f"| {runs['lm_fwd']['time'] / runs['ours_fwd']['time']:.1f}x "
            f"| {ms(runs['ours_fb']['time'])} | {cell(row, 'lm_fb', 'time', ms)} "
            f"| {cell(row, 'ref_fb', 'time', ms)} | {ratio(runs, 'ref_fb', 'ours_fb')} "
            f"| {ratio(runs, 'lm_fb', 'ours_fb')} |"
        )
    lines += [
        "",
        "Peak memory of fwd+bwd (above the inputs):",
        "",
        "| T | H | wkv7 | mlx-lm | ref autograd | ref autograd / wkv7 |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        runs = row["runs"]
        lines.append(
            f"| {row['T']} | {row['H']} | {mib(runs['ours_fb']['peak'])} "
            f"| {cell(row, 'lm_fb', 'peak', mib)} | {cell(row, 'ref_fb', 'peak', mib)} "
            f"| {ratio(runs, 'ref_fb', 'ours_fb', 'peak', '.1f')} |"
        )
    n, rate, bmm_rate = r["matmul_n"], r["matmul_gflops"], r["bmm_gflops"]
    lines += [
        "",
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s ({n}^3), {bmm_rate:.0f} "
        "GFLOP/s for the batched 16 x 64 x 64 matmuls the chunked path is made of.",
        "",
        f"| T | H | chunked fwd matmul work | achieved | of {n}^3 rate | of batched rate |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        gf = row["flops"] / row["runs"]["ours_fwd"]["time"] / 1e9
        lines.append(
            f"| {row['T']} | {row['H']} | {row['flops'] / 1e9:.2f} GFLOP | {gf:.0f} GFLOP/s "
            f"| {gf / rate:.0%} | {gf / bmm_rate:.0%} |"
        )
    T, H = r["base"]
    by_shape = {(row["T"], row["H"]): row["runs"] for row in rows}
    r1, r2, r4 = by_shape[(T, H)], by_shape[(2 * T, H)], by_shape[(4 * T, H)]
    memory_goal = f"fwd+bwd peak memory ref / ours at T={2 * T}"
    if r4["ref_fb"] is None:
        memory_goal += f" (T={4 * T}: the step loop does not fit; its share only grows with T)"
    goals = [
        (
            f"fwd+bwd T={T} H={H} vs ref autograd",
            r1["ref_fb"]["time"] / r1["ours_fb"]["time"],
            100,
            True,
        ),
        (f"fwd T={4 * T} H={H} vs mlx-lm", r4["lm_fwd"]["time"] / r4["ours_fwd"]["time"], 20, True),
        (memory_goal, r2["ref_fb"]["peak"] / r2["ours_fb"]["peak"], 10, True),
        (
            f"T={4 * T} / T={T} fwd time",
            r4["ours_fwd"]["time"] / r1["ours_fwd"]["time"],
            4.5,
            False,
        ),
        (
            f"T={4 * T} / T={T} fwd+bwd time",
            r4["ours_fb"]["time"] / r1["ours_fb"]["time"],
            4.5,
            False,
        ),
    ]
    lines += ["", *_render_wkv7_choices(r["choices"])]
    return lines + goal_lines(goals)


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


def measure_moba(quick: bool = False) -> dict:
    """MoBA attention forward and fwd+bwd against dense causal SDPA: time and peak memory."""
    from mlx_rwkvx.ops.moba import moba_attention, moba_attention_ref

    cfg = _sizes(MOBA, quick)
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

    def fwd(fn, xs):
        return lambda: mx.eval(fn(*xs))

    def fwd_bwd(fn, xs):
        grad = mx.grad(lambda *a: fn(*a).sum(), argnums=(0, 1, 2))
        return lambda: mx.eval(grad(*xs))

    rate = matmul_gflops(cfg["matmul_n"])
    runs = {T: {} for T in cfg["Ts"]}
    # every MoBA run first, then dense: dense's gigabytes of freed buffers (kept in MLX's cache)
    # would otherwise slow the long MoBA runs after them
    for name, fn, reps in (("moba", moba, 3), ("dense", _dense_causal, 1)):
        for T in cfg["Ts"]:
            fits = name == "moba" or T <= DENSE_MAX_T
            inputs = _attention_inputs(T, H, D)
            runs[T][f"{name}_fwd"] = _measure(fwd(fn, inputs), reps) if fits else None
            runs[T][f"{name}_fb"] = _measure(fwd_bwd(fn, inputs), reps) if fits else None
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


def render_moba(r: dict) -> list[str]:
    """The MoBA section: times and peak memory against dense attention, rate reached, goals."""
    H, D, cs, top_k, v = r["H"], r["D"], r["chunk_size"], r["top_k"], r["verify"]

    def cell(runs, key, field, show):
        return "does not fit" if runs[key] is None else show(runs[key][field])

    def ratio(runs, key, ours, field):
        return "n/a" if runs[key] is None else f"{runs[key][field] / runs[ours][field]:.1f}x"

    def sec(x):
        return f"{x:.2f} s"

    def mib(x):
        return f"{x / 2**20:.0f} MiB"

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
            f"| {row['T']} | {sec(runs['moba_fwd']['time'])} "
            f"| {cell(runs, 'dense_fwd', 'time', sec)} "
            f"| {ratio(runs, 'dense_fwd', 'moba_fwd', 'time')} | {sec(runs['moba_fb']['time'])} "
            f"| {cell(runs, 'dense_fb', 'time', sec)} "
            f"| {ratio(runs, 'dense_fb', 'moba_fb', 'time')} | {mib(runs['moba_fb']['peak'])} "
            f"| {cell(runs, 'dense_fb', 'peak', mib)} "
            f"| {ratio(runs, 'dense_fb', 'moba_fb', 'peak')} |"
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
        (
            f"fwd+bwd T={dense_T} vs dense",
            rd["dense_fb"]["time"] / rd["moba_fb"]["time"],
            3.0,
            True,
        ),
        (
            f"fwd+bwd peak memory T={dense_T}, dense / moba",
            rd["dense_fb"]["peak"] / rd["moba_fb"]["peak"],
            4.0,
            True,
        ),
        (
            f"fwd time T={long_T} / T={long_T // 4}",
            rl["moba_fwd"]["time"] / rq["moba_fwd"]["time"],
            5.0,
            False,
        ),
        (
            f"fwd+bwd time T={long_T} / T={long_T // 4}",
            rl["moba_fb"]["time"] / rq["moba_fb"]["time"],
            5.0,
            False,
        ),
    ]
    return lines + goal_lines(goals)


MODELS = {
    "full": dict(prefill_T=1024, small_T=4096, matmul_n=2048, stream_bytes=1 << 30),
    "quick": dict(prefill_T=64, small_T=256, matmul_n=256, stream_bytes=1 << 26),
}
# The 1.5B RFA INT8 model is to fit in 2.3 GB while it is built and loaded.
RFA_INT8_PEAK_GOAL_GB = 2.3


def _model_configs(quick: bool):
    """The prefill/decode model (RWKV-7 0.1B's shape) and a recurrence-dominated small one."""
    from mlx_rwkvx.models import ModelConfig, preset

    if quick:
        return (
            ModelConfig(vocab_size=1024, hidden_size=128, block_types=["rwkv7"] * 2),
            ModelConfig(vocab_size=512, hidden_size=64, block_types=["rwkv7"] * 2),
        )
    return (
        preset("rwkv7-0.1b"),
        ModelConfig(vocab_size=4096, hidden_size=256, block_types=["rwkv7"] * 4),
    )


def _rfa_config(quick: bool):
    """The 1.5B RFA preset, or a tiny RFA config with the same block kinds."""
    from mlx_rwkvx.models import preset, rfa_config
    from mlx_rwkvx.models.config import default_qwen_layers, rfa_block_types

    if not quick:
        return preset("rfa-1.5b")
    return rfa_config(
        vocab_size=512,
        hidden_size=128,
        block_types=rfa_block_types(4, default_qwen_layers(4)),
        intermediate_size=256,
        n_q_heads=2,
        n_kv_heads=1,
        attn_head_dim=64,
    )


def _mlx_lm_twin(model, tmp: str):
    """mlx-lm's own model with the same weights (through our Hugging Face export)."""
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


def _verified_twin(ours, tmp: str, T: int, seed: int):
    """mlx-lm's twin of ``ours``, the tokens of a T-long prefill and the logits' relative error."""
    theirs = _mlx_lm_twin(ours, tmp)
    tokens = mx.array(np.random.default_rng(seed).integers(0, ours.config.vocab_size, (1, T)))
    err = rel_err(ours(tokens), theirs(tokens))
    if not err <= 1e-4:
        raise VerificationFailed(f"logits vs mlx-lm {err:.1e}")
    return theirs, tokens, err


def _model_facts(cfg, T: int, err: float) -> dict:
    return {
        "layers": len(cfg.block_types),
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "T": T,
        "logits_error": err,
    }


def measure_models(quick: bool = False) -> dict:
    """Prefill and decode against mlx-lm and the physical bounds; the RFA preset in INT8."""
    import tempfile

    from mlx_rwkvx.models.build import build

    sizes = _sizes(MODELS, quick)
    cfg, small_cfg = _model_configs(quick)
    with tempfile.TemporaryDirectory() as tmp:
        # random weights (the seeds' init), ours and mlx-lm's, both checked before any timing
        ours = build(cfg)
        theirs, tokens, err = _verified_twin(ours, tmp + "/hf", sizes["prefill_T"], seed=0)
        ours_s = build(small_cfg)
        theirs_s, tokens_s, err_s = _verified_twin(ours_s, tmp + "/hf_small", sizes["small_T"], 1)
        rate = matmul_gflops(sizes["matmul_n"])
        bandwidth = read_bandwidth_gbs(sizes["stream_bytes"])
        t_ours = best_time(lambda: mx.eval(ours(tokens)), repeats=3)
        t_lm = best_time(lambda: mx.eval(theirs(tokens)), repeats=2)
        decode = {"fp32": _decode_rate(ours), "mlx-lm fp32": _decode_rate(theirs)}
        bf16 = build(cfg)
        bf16.set_dtype(mx.bfloat16)
        decode["bf16"] = _decode_rate(bf16)
        del bf16
        decode["int8"] = _decode_rate(build(cfg, quantize="int8"))
        t_s = best_time(lambda: mx.eval(ours_s(tokens_s)), repeats=3)
        t_s_lm = best_time(lambda: mx.eval(theirs_s(tokens_s)), repeats=1)
        n_lin = _linear_params(ours)
    # the RFA model in INT8, in a fresh process so that nothing else is in memory
    cmd = [sys.executable, __file__, "_rfa-int8-worker", *(["--quick"] if quick else [])]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    rfa = json.loads(out.strip().splitlines()[-1])
    rfa["name"], rfa["label"] = (
        ("tiny RFA config", "tiny RFA") if quick else ("1.5B RFA preset", "1.5B")
    )
    return {
        "matmul_n": sizes["matmul_n"],
        "matmul_gflops": rate,
        "bandwidth_gbs": bandwidth,
        "model": {**_model_facts(cfg, sizes["prefill_T"], err), "linear_params": n_lin},
        "prefill_s": {"mlx_rwkvx": t_ours, "mlx-lm": t_lm},
        "decode_tok_s": decode,
        "small": {
            **_model_facts(small_cfg, sizes["small_T"], err_s),
            "prefill_s": {"mlx_rwkvx": t_s, "mlx-lm": t_s_lm},
        },
        "rfa": rfa,
        "rfa_peak_goal_gb": RFA_INT8_PEAK_GOAL_GB,
    }


def render_models(r: dict) -> list[str]:
    """The models section: prefill and decode against their bounds and mlx-lm, RFA in INT8."""
    n, rate, bandwidth = r["matmul_n"], r["matmul_gflops"], r["bandwidth_gbs"]
    m, small, rfa = r["model"], r["small"], r["rfa"]
    t_ours, t_lm = r["prefill_s"]["mlx_rwkvx"], r["prefill_s"]["mlx-lm"]
    T, n_lin = m["T"], m["linear_params"]
    bound = 2 * T * n_lin / (rate * 1e9)
    lines = [
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s ({n}^3), memory read "
        f"{bandwidth:.1f} GB/s.",
        "",
        f"Verified first: logits of the {m['layers']}-layer C={m['hidden']} vocab-{m['vocab']} "
        f"model vs mlx-lm's, T={T}: relative error {m['logits_error']:.1e}.",
        "",
        f"| prefill T={T}, {m['layers']} x C={m['hidden']}, vocab {m['vocab']} (all logits) "
        "| time | vs matmul bound |",
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
    lines += [
        f"Decode (one token, cache) of the same model; weight-read bound "
        f"{weight_bytes / 1e6:.0f} MB fp32 / {bandwidth:.1f} GB/s = {decode_bound:.1f} tok/s.",
        "",
        "| decode | tok/s | of the fp32 bound |",
        "|---|---|---|",
    ]
    for name, rate_tok in r["decode_tok_s"].items():
        lines.append(f"| {name} | {rate_tok:.1f} | {rate_tok / decode_bound:.0%} |")
    t_s, t_s_lm = small["prefill_s"]["mlx_rwkvx"], small["prefill_s"]["mlx-lm"]
    goal_gb = r["rfa_peak_goal_gb"]
    lines += [
        "",
        f"Prefill T={small['T']} of a {small['layers']}-layer C={small['hidden']} "
        f"vocab-{small['vocab']} model (logits vs mlx-lm {small['logits_error']:.1e}): "
        f"mlx_rwkvx {t_s:.2f} s, mlx-lm {t_s_lm:.2f} s: {t_s_lm / t_s:.1f}x faster.",
        "",
        f"The {rfa['name']} (random weights) in INT8:",
        "",
        f"- {rfa['n_params'] / 1e9:.2f}B parameters (projections, head and embedding in INT8 "
        "with group-64 scales and biases; norms and low-rank matrices float32)",
        f"- build: peak {rfa['peak_build'] / 1e9:.2f} GB, at rest {rfa['at_rest'] / 1e9:.2f} GB "
        f"(goal <= {goal_gb:g} GB)",
        f"- load of the saved INT8 checkpoint: peak {rfa['peak_load'] / 1e9:.2f} GB, at rest "
        f"{rfa['rest_load'] / 1e9:.2f} GB",
        f"- decode {rfa['decode']:.2f} tok/s (MLX's CPU quantized matmul; see the INT8 row above)",
    ]
    goals = [
        (f"prefill T={T} / matmul bound", t_ours / bound, 1.3, False),
        (f"prefill T={small['T']} small model vs mlx-lm", t_s_lm / t_s, 10.0, True),
        ("fp32 decode / weight-read bound", r["decode_tok_s"]["fp32"] / decode_bound, 0.85, True),
        (f"{rfa['label']} INT8 peak while building, GB", rfa["peak_build"] / 1e9, goal_gb, False),
        (f"{rfa['label']} INT8 peak while loading, GB", rfa["peak_load"] / 1e9, goal_gb, False),
    ]
    return lines + goal_lines(goals)


def rfa_int8_worker(quick: bool = False) -> dict:
    """Build the RFA model in INT8, save it, load it back: memory and decode rate."""
    import tempfile

    from mlx_rwkvx.io.load import load_model, save
    from mlx_rwkvx.models import Model
    from mlx_rwkvx.models.build import build

    from mlx.utils import tree_flatten

    cfg = _rfa_config(quick)
    mx.reset_peak_memory()
    big = build(cfg, quantize="int8")
    result = {"peak_build": mx.get_peak_memory(), "at_rest": mx.get_active_memory()}
    lazy = Model(cfg, init=None)  # shapes only: nothing is computed
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


LOSS = {
    "full": dict(tokens=8192, vocab=65536, width=768),
    "quick": dict(tokens=256, vocab=4096, width=64),
}


def measure_loss(quick: bool = False) -> dict:
    """The fused head + cross-entropy against MLX's dense one (logits of the whole vocabulary,
    ``nn.losses.cross_entropy``): loss and both gradients, time and peak memory."""
    from mlx_rwkvx.ops import cross_entropy_head
    from mlx_rwkvx.ops.loss import VOCAB_BLOCK

    import mlx.nn as nn

    cfg = _sizes(LOSS, quick)
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

    grads = {name: mx.value_and_grad(fn, argnums=(0, 1)) for name, fn in (("dense", dense),
             ("fused", fused))}  # fmt: skip
    (d_loss, d_grads), (f_loss, f_grads) = (grads[n](h, W) for n in ("dense", "fused"))
    verify = {
        "loss": rel_err(f_loss, d_loss),
        "dh": rel_err(f_grads[0], d_grads[0]),
        "dW": rel_err(f_grads[1], d_grads[1]),
    }
    if not max(verify.values()) <= 1e-5:
        raise VerificationFailed(f"fused head + loss vs dense: {verify}")
    del d_grads, f_grads
    runs = {n: _measure(lambda n=n: mx.eval(grads[n](h, W)), 1 if not quick else 2) for n in grads}
    return {"tokens": N, "vocab": V, "width": C, "block": VOCAB_BLOCK, "verify": verify, **runs}


def render_loss(r: dict) -> list[str]:
    dense, fused = r["dense"], r["fused"]
    ratio = dense["peak"] / fused["peak"]
    return [
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
        *goal_lines([("loss+backward peak memory, dense / fused", ratio, 8, True)]),
    ]


INT8_MARGIN = 4.0  # INT8 (bf16 activations) vs its exact twin, over bf16 vs float32
TRAIN = {
    "full": dict(
        shapes={
            "0.1B": dict(layers=12, C=768, vocab=65536, T=512, batch=4, ours=3, theirs=2),
            "recurrent": dict(layers=4, C=256, vocab=4096, T=2048, batch=1, ours=3, theirs=1),
        },
        rank=32,
        matmul_n=2048,
        int8_T=256,
    ),
    "quick": dict(
        shapes={
            "0.1B": dict(layers=2, C=128, vocab=1024, T=64, batch=2, ours=2, theirs=2),
            "recurrent": dict(layers=2, C=64, vocab=512, T=128, batch=1, ours=2, theirs=1),
        },
        rank=4,
        matmul_n=256,
        int8_T=32,
    ),
}
# mlx-lm's rwkv7 names of our "rwkv" LoRA targets: the same projections on both sides
MLX_LM_RWKV_TARGETS = ["attn.r_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "ffn.key",
                       "ffn.value"]  # fmt: skip


def _train_bound_flops(cfg, tokens: int) -> float:
    """Forward plus input-gradient FLOPs of every projection and the head (frozen weights need
    no weight gradient), plus WKV7's forward and backward (3x the chunked forward's matmuls)."""
    from mlx_rwkvx.models import Model

    model = Model(cfg, init=None)  # shapes only
    linear = _linear_params(model)
    wkv = 3 * chunked_flops(tokens, cfg.n_heads, cfg.head_size) * len(cfg.block_types)
    return 2 * 2 * linear * tokens + wkv


def _time_steps(step, n: int) -> float:
    step()  # compiles
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times)


# MLX autograd through mlx-lm's WKV7 step loop keeps a full [B, T, H, N] cotangent per step, per
# layer: ~8 B T^2 H N bytes a layer (the wkv7 section measures 3.3 GB at T=1024, H=8, one layer).
# A shape whose estimate passes this share of RAM is run at a shorter T (halved until it fits).
MLX_LM_RAM_SHARE = 0.3


def _mlx_lm_fit(cfg, B: int, T: int) -> tuple[int, int]:
    """(batch, T) at which mlx-lm's LoRA step fits in memory here."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    need = lambda b, t: 8 * b * t * t * cfg.n_heads * cfg.head_size * len(cfg.block_types)  # noqa: E731
    if need(B, T) > MLX_LM_RAM_SHARE * ram:
        B = 1
    while need(B, T) > MLX_LM_RAM_SHARE * ram and T > 16:
        T //= 2
    return B, T


def _train_shape(shape: dict, rank: int, tmp: str) -> dict:
    """LoRA steps of ours and of mlx-lm's trainer machinery on the same weights and batch."""
    from mlx_rwkvx.models import Model, ModelConfig
    from mlx_rwkvx.tuner.adapters import apply_lora, target_paths
    from mlx_rwkvx.tuner.config import TrainConfig
    from mlx_rwkvx.tuner.optimizer import make_optimizer
    from mlx_rwkvx.tuner.trainer import Step

    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx_lm.tuner.trainer import default_loss
    from mlx_lm.tuner.utils import linear_to_lora_layers

    cfg = ModelConfig(vocab_size=shape["vocab"], hidden_size=shape["C"],
                      block_types=["rwkv7"] * shape["layers"])  # fmt: skip
    model = Model(cfg, seed=0)
    mx.eval(model.parameters())
    theirs = _mlx_lm_twin(model, tmp)
    B, T = shape["batch"], shape["T"]
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.vocab_size, (B, T + 1)).astype(np.int32)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    # ours: the trainer's own step
    apply_lora(model, target_paths(model, "rwkv"), rank=rank, alpha=2.0 * rank)
    tcfg = TrainConfig(mode="lora", lr=1e-4, warmup=0)
    optimizer, _ = make_optimizer(tcfg.resolved(), 100)
    step = Step(model, optimizer, tcfg.resolved())
    ours_loss = step([(inputs, targets)]).loss / (B * T)
    # mlx-lm: its LoRA layers, loss and a compiled step as its trainer builds them
    theirs.freeze()
    keys = MLX_LM_RWKV_TARGETS
    linear_to_lora_layers(theirs, len(theirs.layers), {"rank": rank, "scale": 2.0,
                                                       "dropout": 0.0, "keys": keys})  # fmt: skip
    opt = optim.AdamW(learning_rate=1e-4)
    loss_grad = nn.value_and_grad(theirs, default_loss)
    state = [theirs.state, opt.state]
    their_B, their_T = _mlx_lm_fit(cfg, B, T)
    batch = mx.array(tokens[:their_B, : their_T + 1])
    lengths = mx.array([[1, their_T]] * their_B)

    @functools.partial(mx.compile, inputs=state, outputs=state)
    def their_step(batch, lengths):
        (loss, _), grads = loss_grad(theirs, batch, lengths)
        opt.update(theirs, grads)
        return loss

    their_loss = their_step(batch, lengths).item()
    # the same batch for ours, to verify before timing
    check_model = Model(cfg, seed=0)
    apply_lora(check_model, target_paths(check_model, "rwkv"), rank=rank, alpha=2.0 * rank)
    check_step = Step(check_model, make_optimizer(tcfg.resolved(), 100)[0], tcfg.resolved())
    check = check_step([(inputs[:their_B, :their_T], targets[:their_B, :their_T])])
    check_loss = check.loss / (their_B * their_T)
    if not rel_err(np.array([check_loss]), np.array([their_loss])) <= 1e-3:
        raise VerificationFailed(f"first LoRA loss: ours {check_loss}, mlx-lm {their_loss}")
    del check_model, check_step
    ours_t = _time_steps(lambda: step([(inputs, targets)]), shape["ours"])
    theirs_t = _time_steps(lambda: mx.eval(their_step(batch, lengths)), shape["theirs"])
    return {
        "shape": shape,
        "loss": check_loss,
        "mlx_lm_loss": their_loss,
        "ours_s": ours_t,
        "mlx_lm_s": theirs_t,
        "mlx_lm_batch": their_B,
        "mlx_lm_T": their_T,
        "bound_flops": _train_bound_flops(cfg, B * T),
        "first_loss": ours_loss,
    }


def int8_checkpoint_worker(folder: str, quick: bool = False) -> dict:
    """Write the RFA config's random weights as a bf16 checkpoint and a small .bin data set,
    and the logits the caller verifies INT8 with (a process of its own: the training process's
    peak memory must not include this): the checkpoint loaded with --quantize; its exact
    float32 twin (the same checkpoint in float32 with every quantized weight replaced by the
    INT8 model's own dequantized integers); the INT8 model with its float parameters cast to
    float32 (which must equal the twin: the quantized arithmetic is exact); and the checkpoint
    unquantized in bf16 and in float32 (the noise floor of bf16 activations in this deep random
    network, the yardstick for INT8 with its bf16 activations against the twin)."""
    from mlx_rwkvx.io.load import load, save
    from mlx_rwkvx.models import Model
    from mlx_rwkvx.tuner.data import write_bin

    cfg = _rfa_config(quick)
    model = Model(cfg, init=None)  # lazy: cast to bf16 before anything is computed
    model.set_dtype(mx.bfloat16)
    save(model, folder + "/bf16")
    T = TRAIN["quick" if quick else "full"]["int8_T"]
    rng = np.random.default_rng(0)
    write_bin(folder + "/data.bin", [rng.integers(0, cfg.vocab_size, T + 1) for _ in range(2)])
    del model
    tokens = mx.array(rng.integers(0, cfg.vocab_size, (1, 4)))

    def logits(m):
        return np.array(m(tokens).astype(mx.float32))

    out = {"bf16": logits(load(folder + "/bf16", tokenizer=False)[0])}
    int8 = load(folder + "/bf16", quantize="int8", tokenizer=False)[0]
    out["int8"] = logits(int8)
    f32 = load(folder + "/bf16", dtype="float32", tokenizer=False)[0]
    out["f32"] = logits(f32)
    quantized = dict(int8.named_modules())
    for path, m in f32.named_modules():
        q = quantized[path]
        if isinstance(q, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            scales, biases = (a.astype(mx.float32) for a in (q.scales, q.biases))  # exact
            m.weight = mx.dequantize(q.weight, scales, biases, q.group_size, q.bits)
            mx.eval(m.weight)
    out["twin"] = logits(f32)
    del f32
    int8.set_dtype(mx.float32)  # every float parameter cast exactly, the integers unchanged
    out["int8_f32"] = logits(int8)
    for name, value in out.items():  # verified by the caller, before any timing
        np.save(f"{folder}/logits_{name}.npy", value)
    return {"T": T}


def int8_train_worker(folder: str, quick: bool = False, grad_checkpoint: bool = False) -> dict:
    """One INT8 LoRA training step through ``train()`` on the checkpoint above: the process's
    peak resident memory and the run's time."""
    import resource

    from mlx_rwkvx.tuner.config import TrainConfig
    from mlx_rwkvx.tuner.trainer import train

    T = TRAIN["quick" if quick else "full"]["int8_T"]
    # configure() keeps up to a quarter of RAM of freed buffers for reuse on the CPU: with no
    # cache, the resident memory is what the step needs (Metal manages its own)
    mx.set_cache_limit(0)
    t0 = time.perf_counter()
    settings = dict(quantize="int8", iters=1, batch_size=1, max_seq_len=T, save_every=10,
                    grad_checkpoint=grad_checkpoint)  # fmt: skip
    out = folder + ("/out_checkpoint" if grad_checkpoint else "/out")
    train(TrainConfig(model=folder + "/bf16", data=folder + "/data.bin", output=out, **settings))
    return {
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "mlx_peak": mx.get_peak_memory(),
        "seconds": time.perf_counter() - t0,
        "T": T,
    }


def _start(name: str, *args, quick: bool) -> subprocess.Popen:
    cmd = [sys.executable, str(Path(__file__)), name, *args] + (["--quick"] if quick else [])
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(name: str, proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise VerificationFailed(f"{name} failed: {err[-2000:]}")
    return json.loads(out.strip().splitlines()[-1])


def _worker(name: str, *args, quick: bool) -> dict:
    return _result(name, _start(name, *args, quick=quick))


def measure_train(quick: bool = False) -> dict:
    """LoRA training speed against the bound and mlx-lm's trainer (verified first)."""
    import tempfile

    cfg = _sizes(TRAIN, quick)
    shapes = {}
    for name, shape in cfg["shapes"].items():  # each verified, then timed
        with tempfile.TemporaryDirectory() as tmp:
            shapes[name] = _train_shape(shape, cfg["rank"], tmp)
        print(name, shapes[name])
    rate = matmul_gflops(cfg["matmul_n"])
    return {"matmul_gflops": rate, "matmul_n": cfg["matmul_n"], "rank": cfg["rank"],
            "shapes": shapes}  # fmt: skip


def measure_train_int8(quick: bool = False) -> dict:
    """Peak memory of one INT8 LoRA step of the RFA config, in processes of their own."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        _worker("_int8-checkpoint-worker", tmp, quick=quick)
        logits = {k: np.load(f"{tmp}/logits_{k}.npy").astype(np.float64)
                  for k in ("int8", "int8_f32", "twin", "bf16", "f32")}  # fmt: skip
        exact = rel_err(logits["int8_f32"], logits["twin"])
        err = rel_err(logits["int8"], logits["twin"])
        floor = rel_err(logits["bf16"], logits["f32"])
        if not exact <= 1e-5:
            raise VerificationFailed(
                f"INT8 in float32 vs its exact twin: relative error {exact:.3g}"
            )
        # with bf16 activations, INT8 may be as far from the twin as the bf16 model is from the
        # float32 one (one draw of a chaotic network's noise: a margin; the bf16 CPU quantized
        # matmul this once caught was 12x)
        if not err <= INT8_MARGIN * floor:
            raise VerificationFailed(
                f"INT8 (bf16 activations) vs its exact float32 twin: relative error {err:.3g}, "
                f"over {INT8_MARGIN} x the bf16 model's own {floor:.3g}"
            )
        # with and without --grad-checkpoint, side by side (each a process of its own, each
        # mostly one core: MLX's CPU quantized matmul is single-threaded)
        name = "_int8-train-worker"
        plain = _start(name, tmp, quick=quick)
        checkpointed = _start(name, tmp, "--grad-checkpoint", quick=quick)
        runs = {"plain": _result(name, plain), "grad_checkpoint": _result(name, checkpointed)}
    return {
        "runs": runs,
        "int8_f32_vs_twin": exact,
        "int8_vs_twin": err,
        "bf16_vs_f32": floor,
        "int8_vs_bf16": rel_err(logits["int8"], logits["bf16"]),
        "preset": "rfa-1.5b" if not quick else "tiny",
    }


def _train_tokens_per_s(s: dict) -> tuple[float, float]:
    """Tokens per second of one shape's LoRA step: ours, mlx-lm's (at the batch and T it fit)."""
    sh = s["shape"]
    ours = sh["batch"] * sh["T"] / s["ours_s"]
    return ours, s["mlx_lm_batch"] * s["mlx_lm_T"] / s["mlx_lm_s"]


def render_train(r: dict) -> list[str]:
    lines = [
        "Verified first: the first LoRA step's loss, ours vs mlx-lm's on the same weights "
        "and batch: "
        + ", ".join(
            f"{n} {s['loss']:.5f} vs {s['mlx_lm_loss']:.5f}" for n, s in r["shapes"].items()
        )
        + ".",
        "",
        f"LoRA rank {r['rank']} on every RWKV block's receptance, key, value, output and "
        "channel-mix key and value (mlx-lm: the same projections), AdamW, float32, one step = "
        "forward, backward and update of one batch (best of the timed steps after a compiling "
        f"one). Bound: forward + input-gradient FLOPs of every projection and the head, plus "
        f"WKV7's forward and backward, at the {r['matmul_gflops']:.0f} GFLOP/s of a "
        f"{r['matmul_n']}^3 fp32 matmul measured in this run.",
        "",
        "mlx-lm's step loop does not fit in memory at every shape (its autograd keeps ~8 B "
        "T^2 H N bytes a layer): it then runs at batch 1 and the longest T that fits, and the "
        "speed-up compares tokens per second (which understates ours: its cost grows as T^2).",
        "",
        "| shape | ours tokens/s | mlx-lm tokens/s (at batch, T) | speed-up | bound tokens/s | "
        "of bound |",
        "|---|---|---|---|---|---|",
    ]
    goals = []
    for name, s in r["shapes"].items():
        sh = s["shape"]
        ours, theirs = _train_tokens_per_s(s)
        bound = sh["batch"] * sh["T"] / (s["bound_flops"] / (r["matmul_gflops"] * 1e9))
        lines.append(
            f"| {name}: {sh['layers']} x C={sh['C']}, vocab {sh['vocab']}, T={sh['T']}, batch "
            f"{sh['batch']} | {ours:.0f} | {theirs:.0f} ({s['mlx_lm_batch']}, {s['mlx_lm_T']}) "
            f"| {ours / theirs:.1f}x | {bound:.0f} | {ours / bound:.0%} |"
        )
        if name == "0.1B":
            goals.append((f"{name} LoRA tokens/s / bound", ours / bound, 0.7, True))
        else:
            goals.append((f"{name} LoRA tokens/s vs mlx-lm", ours / theirs, 20, True))
    return lines + goal_lines(goals)


def render_train_int8(q: dict) -> list[str]:
    lines = [
        f"Verified first, logits of 4 tokens of the {q['preset']} RFA checkpoint loaded with "
        f"--quantize int8, against its exact float32 twin (the same integers dequantized): "
        f"{q['int8_f32_vs_twin']:.1e} relative error with the INT8 model's float parameters "
        f"cast to float32 (exact arithmetic), {q['int8_vs_twin']:.3f} with its bf16 activations "
        f"(within {INT8_MARGIN:g} x the bf16 model's own error against float32, "
        f"{q['bf16_vs_f32']:.3f}: bf16 rounding in a deep random network); INT8 vs bf16 "
        f"{q['int8_vs_bf16']:.3f}.",
        "",
        f"INT8 LoRA (the default targets, rank 32) on the {q['preset']} RFA config (random "
        "weights saved in bf16, loaded with --quantize), batch 1, one step through `train()`, "
        "with and without --grad-checkpoint, each in a process of its own (the two side by "
        "side) with MLX's buffer cache off; the time is the whole run's (loading, quantizing, "
        "compiling, the step, saving).",
        "",
        "| run | T | peak resident | MLX's own peak | run time |",
        "|---|---|---|---|---|",
    ]
    goals = []
    for name, r in q["runs"].items():
        flag = "--grad-checkpoint" if name == "grad_checkpoint" else "default"
        lines.append(
            f"| {flag} | {r['T']} | {r['peak_rss'] / 1e9:.2f} GB | {r['mlx_peak'] / 1e9:.2f} GB "
            f"| {r['seconds']:.0f} s |"
        )
        goals.append((f"INT8 RFA LoRA ({flag}) peak resident memory, GB",
                      r["peak_rss"] / 1e9, 3.0, False))  # fmt: skip
    return lines + goal_lines(goals)


GENERATE = {
    "full": dict(prompt_T=2000, first_turn=1500, new_turn=100, decode_steps=48, matmul_n=2048,
                 stream_bytes=1 << 30),
    "quick": dict(prompt_T=64, first_turn=48, new_turn=8, decode_steps=8, matmul_n=256,
                  stream_bytes=1 << 26),
}  # fmt: skip


def _rwkv_x_chat_config(quick: bool):
    """The 4-block C=256 RWKV-X model of the second-turn goal (3 RWKV-7 blocks, 1 MoBA)."""
    from mlx_rwkvx.models import ModelConfig
    from mlx_rwkvx.models.config import rwkv_x_block_types

    if quick:
        return ModelConfig(vocab_size=512, hidden_size=64, head_size=16,
                           block_types=rwkv_x_block_types(3, 1), moba_chunk_size=16)  # fmt: skip
    return ModelConfig(vocab_size=4096, hidden_size=256, block_types=rwkv_x_block_types(3, 1))


class _AnyIdTokenizer:
    """Every id of a model is one character (``chr(id)``), so that any generated text encodes
    back to its ids; no end of text: generation runs the number of steps asked for."""

    eos_token_ids: set = set()

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def decode(self, ids) -> str:
        return "".join(map(chr, ids))

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]


def _first_token_time(session_factory, ids, repeats: int) -> float:
    """Best time from nothing to the first sampled token of ``ids`` in a fresh session."""

    def run():
        session = session_factory()
        mx.eval(mx.argmax(session.feed(ids), axis=-1))

    return best_time(run, repeats=repeats)


def _generate_step_ttft(model, ids, repeats: int) -> float:
    """Best time from nothing to the first token of mlx-lm's ``generate_step`` with ``model``
    (ours, through its mlx-lm caches, or mlx-lm's own): its prefill runs the prompt but its last
    token in pieces (only the caches evaluated: no head), then the last token as a step of its
    own. It starts the next step before it yields: each run waits for that step, untimed, before
    the next one begins."""
    from mlx_lm.generate import generate_step

    prompt = mx.array(ids)
    times = []
    for _ in range(repeats + 1):  # the first one warms up
        t0 = time.perf_counter()
        next(generate_step(prompt, model, max_tokens=1))
        times.append(time.perf_counter() - t0)
        mx.synchronize()
    return min(times[1:])


def _verify_generation(ours, theirs, ids) -> float:
    """Our generated steps against the full forward, and our first token's log-probabilities
    against mlx-lm's generate_step: the larger relative error."""
    from mlx_rwkvx.generation import stream_generate

    from mlx_lm.generate import generate_step

    tokenizer = _AnyIdTokenizer(ours.config.vocab_size)
    seq, worst = list(ids), 0.0
    for r in stream_generate(ours, tokenizer, ids, max_tokens=4):
        full = ours(mx.array([seq]))[0, -1].astype(mx.float32)
        worst = max(worst, rel_err(r.logprobs, full - mx.logsumexp(full)))
        seq.append(r.token)
    _, theirs_lp = next(generate_step(mx.array(ids), theirs, max_tokens=1))
    first = next(stream_generate(ours, tokenizer, ids, max_tokens=1))
    worst = max(worst, rel_err(first.logprobs, theirs_lp))
    if not worst <= 1e-4:
        raise VerificationFailed(f"generation logits vs the full forward / mlx-lm {worst:.1e}")
    return worst


def _decode_tps(model, steps: int) -> float:
    """Tokens per second of our generation loop (greedy), after a short prompt."""
    from mlx_rwkvx.generation import Session

    return _decode_tps_with(model, steps, lambda: Session(model))


def _matvec_tps(model, steps: int) -> dict:
    """One-row matmuls of every Linear weight of ``model`` (what a decode step reads), as
    tokens per second: MLX's ``x @ W.T`` as the layers run it, the same with the weights
    transposed once ([in, out], row-major), and the whole set under ``mx.compile``."""
    weights = [m.weight for _, m in model.named_modules() if isinstance(m, nn.Linear)]
    transposed = [mx.array(np.ascontiguousarray(np.array(w).T)) for w in weights]
    mx.eval(transposed)
    xs = [mx.random.normal((1, w.shape[1])) for w in weights]

    def rows(ws, t):
        return [x @ (w.T if not t else w) for x, w in zip(xs, ws, strict=True)]

    compiled = mx.compile(lambda *ws: rows(ws, False))
    out = {}
    for name, fn in (("x @ W.T", lambda: rows(weights, False)),
                     ("x @ W, W transposed once", lambda: rows(transposed, True)),
                     ("x @ W.T, compiled", lambda: compiled(*weights))):  # fmt: skip

        def run(fn=fn):
            for _ in range(steps):
                mx.eval(fn())

        out[name] = steps / best_time(run, repeats=3)
    return out


def _second_turn(model, tokenizer, first_turn: int, new_turn: int, repeats: int) -> dict:
    """Time to the first token of a chat's second turn (first turn ``first_turn`` tokens, an
    answer of 8, then ``new_turn`` tokens), against prefilling the new turn's tokens alone."""
    from mlx_rwkvx.generation import Chat, ChatFormat, stream_generate

    def render(messages, add_generation_prompt):  # answers rendered as generated
        text = "".join(f"{m['role']}:{m['content']}\n" for m in messages)
        return text + "assistant:" if add_generation_prompt else text

    rng = np.random.default_rng(5)
    words = lambda n: bytes(rng.integers(97, 123, n).tolist()).decode()  # noqa: E731
    first, second = words(first_turn), words(new_turn)
    times, fed, reused = [], None, None
    for _ in range(repeats + 1):
        chat = Chat(model, tokenizer, max_tokens=8)
        chat.format = ChatFormat("bench", render, [])
        for _ in chat.ask(first):
            pass
        t0 = time.perf_counter()
        next(chat.ask(second))
        times.append(time.perf_counter() - t0)
        fed, reused = chat.prefilled, chat.reused
    ids = chat.session.tokens[reused : reused + fed]

    def alone_turn():  # the same tokens through the same generation loop, in a fresh session
        next(stream_generate(model, tokenizer, ids, max_tokens=8))

    alone = best_time(alone_turn, repeats=repeats)
    return {"second_turn_s": min(times[1:]), "alone_s": alone, "new_tokens": fed,
            "held_tokens": reused}  # fmt: skip


def measure_generate(quick: bool = False) -> dict:
    """Time to first token, decode and the second chat turn, against mlx-lm and the bounds."""
    import tempfile

    from mlx_rwkvx.generation import Session
    from mlx_rwkvx.models.build import build

    sizes = _sizes(GENERATE, quick)
    cfg, _ = _model_configs(quick)
    T = sizes["prompt_T"]
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, T).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        ours = build(cfg)
        theirs = _mlx_lm_twin(ours, tmp + "/hf")
        err = _verify_generation(ours, theirs, ids[:64])
        rate = matmul_gflops(sizes["matmul_n"])
        bandwidth = read_bandwidth_gbs(sizes["stream_bytes"])
        ttft = {
            "mlx_rwkvx": _first_token_time(lambda: Session(ours), ids, repeats=2),
            "generate_step, our model": _generate_step_ttft(ours, ids, repeats=2),
            "mlx-lm": _generate_step_ttft(theirs, ids, repeats=2),
        }
        del theirs
        turn = ids[: sizes["new_turn"]]  # a chat turn's size: where the one-token step shows
        short_ttft = {
            "tokens": len(turn),
            "mlx_rwkvx": _first_token_time(lambda: Session(ours), turn, repeats=5),
            "generate_step, our model": _generate_step_ttft(ours, turn, repeats=5),
        }
        steps = sizes["decode_steps"]
        decode = {"fp32": _decode_tps(ours, steps)}

        def compiled():  # the same loop with the one-token step under mx.compile
            s = Session(ours)
            s._step = mx.compile(s._forward)
            return s

        decode["fp32, step compiled"] = _decode_tps_with(ours, steps, compiled)
        matvec = _matvec_tps(ours, steps)
        lin = _linear_params(ours)
        head = ours.lm_head.weight.size
        bf16 = build(cfg)
        bf16.set_dtype(mx.bfloat16)
        decode["bf16"] = _decode_tps(bf16, steps)
        del bf16
        decode["int8"] = _decode_tps(build(cfg, quantize="int8"), steps)
        turns = sizes["first_turn"], sizes["new_turn"], 2
        chat = {"rwkv7": _second_turn(ours, _AnyIdTokenizer(cfg.vocab_size), *turns)}
        x_cfg = _rwkv_x_chat_config(quick)
        x_model = build(x_cfg)
        chat["rwkv-x"] = _second_turn(x_model, _AnyIdTokenizer(x_cfg.vocab_size), *turns)
    wkv = chunked_flops(T, cfg.n_heads, cfg.head_size) * len(cfg.block_types)
    return {
        "matmul_n": sizes["matmul_n"], "matmul_gflops": rate, "bandwidth_gbs": bandwidth,
        "model": _model_facts(cfg, T, err), "linear_params": lin, "head_params": head,
        "wkv_flops": wkv, "ttft_s": ttft, "short_ttft_s": short_ttft, "decode_tok_s": decode,
        "matvec_tok_s": matvec,
        "chat": chat,
        "x_model": {"layers": len(x_cfg.block_types), "hidden": x_cfg.hidden_size,
                    "block_types": x_cfg.block_types},
    }  # fmt: skip


def _decode_tps_with(model, steps: int, factory) -> float:
    """``_decode_tps`` with sessions from ``factory``."""
    from mlx_rwkvx.generation import stream_generate

    tokenizer = _AnyIdTokenizer(model.config.vocab_size)

    def run():
        for _ in stream_generate(model, tokenizer, [1, 2, 3, 4], max_tokens=steps,
                                 session=factory()):  # fmt: skip
            pass

    def prompt_only():
        factory().feed([1, 2, 3, 4])

    return (steps - 1) / (best_time(run, repeats=2) - best_time(prompt_only, repeats=2))


def render_generate(r: dict) -> list[str]:
    """The generate section: first token, decode, second chat turn, each against its bound."""
    rate, bw, m = r["matmul_gflops"], r["bandwidth_gbs"], r["model"]
    T, lin, head = m["T"], r["linear_params"], r["head_params"]
    flops = 2 * T * (lin - head) + 2 * head + r["wkv_flops"]
    bound = flops / (rate * 1e9)
    ours, theirs = r["ttft_s"]["mlx_rwkvx"], r["ttft_s"]["mlx-lm"]
    lines = [
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s ({r['matmul_n']}^3), "
        f"memory read {bw:.1f} GB/s.",
        "",
        f"Verified first: each generated step's log-probabilities against the full forward "
        f"over the same tokens, and the first token's against mlx-lm's generate_step on the "
        f"same weights (its rwkv7 through our Hugging Face export): largest relative error "
        f"{m['logits_error']:.1e}.",
        "",
        f"Time to first token, a {T}-token prompt, {m['layers']} x C={m['hidden']}, vocab "
        f"{m['vocab']} (random weights, fp32). Bound: the layers' matmul FLOPs for every "
        f"position, the head for the last one, and the chunked WKV7's matmuls, "
        f"{flops / 1e9:.1f} GFLOP at {rate:.0f} GFLOP/s.",
        "",
        "| first token | time | vs bound |",
        "|---|---|---|",
        f"| bound | {bound:.2f} s | 1.00 |",
        f"| mlx_rwkvx (head on the last position) | {ours:.2f} s | {ours / bound:.2f} |",
    ]
    step = r["ttft_s"].get("generate_step, our model")  # absent from runs before it was measured
    if step is not None:
        lines.append(f"| mlx-lm generate_step, our model (the last token a step of its own) "
                     f"| {step:.2f} s | {step / bound:.2f} |")  # fmt: skip
    lines += [
        f"| mlx-lm generate_step, its rwkv7 (its WKV a step loop on the CPU) | {theirs:.2f} s "
        f"| {theirs / bound:.2f} |",
        "",
        f"mlx_rwkvx reaches the first token {theirs / ours:.1f}x sooner than mlx-lm on its own "
        "model.",
        "",
    ]
    short = r.get("short_ttft_s")
    if short is not None and step is not None:
        rows = [(T, ours, step), (short["tokens"], short["mlx_rwkvx"],
                                  short["generate_step, our model"])]  # fmt: skip
        lines += [
            "Our prefill against mlx-lm's generate_step on the same model (why generation keeps "
            "its own prefill, and decodes with generate_step):",
            "",
            "| prompt | mlx_rwkvx prefill | generate_step's prefill | generate_step / ours |",
            "|---|---|---|---|",
        ]
        for n, a, b in rows:
            lines.append(f"| {n} tokens | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {b / a:.2f} |")
        lines.append("")
    weight_bytes = lin * 4
    read_bound = bw * 1e9 / weight_bytes
    mv = r["matvec_tok_s"]
    base = mv["x @ W.T"]
    lines += [
        f"Decode of the same model (greedy, our generation: mlx-lm's generate_step over our "
        f"state): tokens/s against MLX's own "
        f"one-row matmuls over the same {lin / 1e6:.0f}M weights "
        f"({weight_bytes / 1e6:.0f} MB fp32, one read per token: {read_bound:.1f} tok/s at "
        f"{bw:.1f} GB/s).",
        "",
        "| decode | tok/s | vs MLX's one-row matmuls | of the read bound |",
        "|---|---|---|---|",
    ]
    for name, tps in r["decode_tok_s"].items():
        lines.append(f"| {name} | {tps:.1f} | {tps / base:.0%} | {tps / read_bound:.0%} |")
    lines += ["", "What MLX's one-row matmul reaches over those weights, three ways:", "",
              "| one-row matmuls of every Linear | tok/s | GB/s streamed | of the read bound |",
              "|---|---|---|---|"]  # fmt: skip
    for name, tps in mv.items():
        lines.append(
            f"| {name} | {tps:.1f} | {tps * weight_bytes / 1e9:.1f} | {tps / read_bound:.0%} |"
        )
    lines += ["", "Second chat turn: time to its first token against prefilling its new tokens "
              "alone in a fresh session (the history is not re-read: RWKV blocks carry their "
              "state, attention blocks attend to their caches).", "",
              "| model | first turn | new tokens | second turn | new tokens alone | ratio |",
              "|---|---|---|---|---|---|"]  # fmt: skip
    xm = r["x_model"]
    names = {"rwkv7": f"RWKV-7 {m['layers']} x C={m['hidden']}",
             "rwkv-x": f"RWKV-X {xm['layers']} blocks C={xm['hidden']}"}  # fmt: skip
    goals = [
        (f"time to first token T={T} / bound", ours / bound, 1.3, False),
        ("fp32 decode / MLX one-row matmuls", r["decode_tok_s"]["fp32"] / base, 0.9, True),
    ]
    for key, c in r["chat"].items():
        ratio = c["second_turn_s"] / c["alone_s"]
        lines.append(
            f"| {names[key]} | {c['held_tokens']} tokens held | {c['new_tokens']} "
            f"| {c['second_turn_s'] * 1e3:.0f} ms | {c['alone_s'] * 1e3:.0f} ms | {ratio:.2f} |"
        )
        goals.append((f"second turn / new turn alone, {names[key]}", ratio, 1.1, False))
    return lines + [""] + goal_lines(goals)


PARALLEL = {
    "full": dict(layers=4, C=256, vocab=4096, T=512, batch=4, shards=4, rank=32, steps=3),
    "quick": dict(layers=2, C=64, vocab=256, T=32, batch=2, shards=4, rank=4, steps=2),
}


def _lora_model(p: dict, shards: int = 1):
    from mlx_rwkvx.models import Model, ModelConfig
    from mlx_rwkvx.tuner.adapters import apply_lora, target_paths
    from mlx_rwkvx.tuner.parallel import stack_adapters

    cfg = ModelConfig(
        vocab_size=p["vocab"], hidden_size=p["C"], block_types=["rwkv7"] * p["layers"]
    )
    mx.random.seed(0)
    model = Model(cfg, seed=0)
    apply_lora(model, target_paths(model, "rwkv"), rank=p["rank"], alpha=2.0 * p["rank"])
    if shards > 1:
        stack_adapters(model, shards)
    return model


def _lora_step(model, shards: int = 1, group=None, eps: float | None = None):
    from mlx_rwkvx.tuner.config import TrainConfig
    from mlx_rwkvx.tuner.optimizer import make_optimizer
    from mlx_rwkvx.tuner.trainer import Step

    cfg = TrainConfig(mode="lora", lr=1e-3, warmup=0, parallel=shards).resolved()
    optimizer = make_optimizer(cfg, 100)[0]
    if eps is not None:  # AdamW's eps in place of RWKV's (measure_parallel's check)
        optimizer.eps = eps
    return Step(model, optimizer, cfg, group)


def _shard_rows(p: dict, shard: int):
    rng = np.random.default_rng(shard)
    tokens = rng.integers(0, p["vocab"], (p["batch"], p["T"] + 1)).astype(np.int32)
    return tokens[:, :-1], tokens[:, 1:]


def measure_parallel(quick: bool = False) -> dict:
    """--parallel N (one batched step of N stacked adapters) against one shard's step, verified
    first; and 2-rank data parallel on localhost (mlx.launch), its all-reduce's share."""
    import shutil

    from mlx.utils import tree_flatten

    p = _sizes(PARALLEL, quick)
    n = p["shards"]
    rows = [_shard_rows(p, i) for i in range(n)]
    # verify: after one step, the stacked adapter of shard 0 is a single run's on shard 0 (B
    # starts at zero, so B is the step's update; A's gradient is zero while B is zero). AdamW's
    # eps = 1, far above sqrt(v) = 0.1 |g| (the gradient clipped to norm 1), makes the update
    # lr 0.1 g / (0.1 |g| + eps) proportional to the gradient; with eps = 1e-8 it is about
    # +-lr whatever the gradient's size, and a near-zero gradient's sign that another
    # summation order flips would make a 2 lr difference.
    single, stacked = _lora_model(p), _lora_model(p, n)
    _lora_step(single, eps=1.0)([rows[0]])
    together = (np.concatenate([r[0] for r in rows]), np.concatenate([r[1] for r in rows]))
    _lora_step(stacked, n, eps=1.0)([together])
    a = dict(tree_flatten(single.trainable_parameters()))
    b = dict(tree_flatten(stacked.trainable_parameters()))
    err = max(rel_err(b[k][0], a[k]) for k in a if k.endswith("lora_b"))
    # Error model: the same float32 sums in other orders (other batch shapes, another BLAS
    # blocking), so the update errs by at most about K u relative, K the longest sum (the
    # vocabulary, the FFN width, a shard's tokens), u = 2^-24: the worst case of one sum, which
    # also covers the step's chain of a few dozen sums (random errors: sqrt(D K) u); +1: the
    # update's own rounding.
    longest = max(p["vocab"], single.config.intermediate_size, p["batch"] * p["T"])
    bound = (longest + 1) * 2.0**-24
    if not err <= bound:
        raise VerificationFailed(
            f"--parallel shard 0 vs one run after a step: {err:.1e} (bound {bound:.1e})"
        )
    del single, stacked
    one_step = _lora_step(_lora_model(p))
    t_one = _time_steps(lambda: one_step([rows[0]]), p["steps"])
    par_step = _lora_step(_lora_model(p, n), n)
    t_par = _time_steps(lambda: par_step([together]), p["steps"])
    trainable = sum(v.size for _, v in tree_flatten(_lora_model(p).trainable_parameters()))
    # 2 ranks on localhost, each its own batch of the single shard's size
    launcher = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")
    cmd = [launcher, "--backend", "ring", "-n", "2", "--hosts", "127.0.0.1", "--starting-port",
           str(40000 + os.getpid() % 20000), "--python", sys.executable, __file__,
           "_data-parallel-worker", *(["--quick"] if quick else [])]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    ranks = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {"p": p, "verify_error": err, "verify_bound": bound, "one_shard_s": t_one,
            "parallel_s": t_par, "trainable": trainable,
            "ranks": sorted(ranks, key=lambda r: r["rank"])}  # fmt: skip


def data_parallel_worker(quick: bool = False) -> dict:
    """One rank of 2 under mlx.launch: LoRA steps on its batch, and the gradient all-sum alone
    (the same bytes) to time its share of a step."""
    from mlx_rwkvx.tuner.distributed import all_sum, data_parallel_group

    from mlx.utils import tree_flatten

    p = _sizes(PARALLEL, quick)
    group = data_parallel_group()
    model = _lora_model(p)
    step = _lora_step(model, group=group)
    batch = [_shard_rows(p, group.rank())]
    t_step = _time_steps(lambda: step(batch), p["steps"])
    grads = model.trainable_parameters()
    nbytes = sum(v.size * 4 for _, v in tree_flatten(grads))

    def reduce():
        mx.eval(all_sum(grads, group))

    t_reduce = best_time(reduce, repeats=5)
    return {"rank": group.rank(), "step_s": t_step, "all_sum_s": t_reduce, "bytes": nbytes,
            "tokens": p["batch"] * p["T"]}  # fmt: skip


def render_parallel(r: dict) -> list[str]:
    p, n = r["p"], r["p"]["shards"]
    tokens = p["batch"] * p["T"]
    one, par = tokens / r["one_shard_s"], n * tokens / r["parallel_s"]
    lines = [
        f"LoRA (rank {p['rank']}, the rwkv targets: {r['trainable']:,} trainable parameters a "
        f"shard) on a {p['layers']}-block C={p['C']} RWKV-7, vocab {p['vocab']}, T={p['T']}, "
        f"batch {p['batch']} per shard.",
        "",
        f"Verified first: after one step, shard 0's adapter of `--parallel {n}` against a run of "
        f"its own on the same rows, relative error {r['verify_error']:.1e}"
        + (f" (bound {r['verify_bound']:.1e})." if "verify_bound" in r else "."),
        "",
        "| run | step | tokens/s | vs one shard |",
        "|---|---|---|---|",
        f"| one shard | {r['one_shard_s']:.2f} s | {one:.0f} | 1.00 |",
        f"| --parallel {n} (one batched step) | {r['parallel_s']:.2f} s | {par:.0f} "
        f"| {par / one:.2f} |",
        "",
        "Data parallel, 2 ranks on localhost (mlx.launch, ring backend; both share this "
        "machine's cores), each a batch of one shard's size:",
        "",
        "| rank | step | tokens/s | gradient all-sum | its share of the step | bytes a step |",
        "|---|---|---|---|---|---|",
    ]
    for k in r["ranks"]:
        lines.append(
            f"| {k['rank']} | {k['step_s']:.2f} s | {k['tokens'] / k['step_s']:.0f} | "
            f"{k['all_sum_s'] * 1e3:.1f} ms | {k['all_sum_s'] / k['step_s']:.1%} | "
            f"{k['bytes'] / 1e6:.1f} MB |"
        )
    total = sum(k["tokens"] / k["step_s"] for k in r["ranks"])
    lines += ["", f"Both ranks together: {total:.0f} tokens/s ({total / one:.2f} x one process "
              "alone on this machine).", ""]  # fmt: skip
    return lines + goal_lines([(f"--parallel {n} tokens/s vs one shard", par / one, 2.5, True)])


SECTIONS = {
    "blas": (
        measure_blas,
        render_blas,
        "MLX matmul with OpenBLAS (its core and Prescott), without, NumPy, bandwidth",
    ),
    "wkv7": (measure_wkv7, render_wkv7, "WKV7 forward and fwd+bwd vs the step loop and mlx-lm"),
    "moba": (measure_moba, render_moba, "MoBA attention vs dense causal SDPA, time and memory"),
    "models": (
        measure_models,
        render_models,
        "prefill and decode vs mlx-lm and the physical bounds",
    ),
    "loss": (measure_loss, render_loss, "fused head + cross-entropy vs the dense one, memory"),
    "train": (measure_train, render_train, "LoRA steps vs the bound and mlx-lm"),
    "generate": (
        measure_generate,
        render_generate,
        "time to first token, decode and the second chat turn vs mlx-lm and the bounds",
    ),
    "parallel": (
        measure_parallel,
        render_parallel,
        "--parallel N against one shard; 2-rank data parallel on localhost",
    ),
    "train-int8": (
        measure_train_int8,
        render_train_int8,
        "INT8 RFA LoRA step's peak memory (1.5B: tens of minutes on a CPU)",
    ),
}


def section_command(name: str, quick: bool) -> str:
    return f"python scripts/bench.py {name}" + (" --quick" if quick else "")


def run_section(name: str, quick: bool = False, path: Path | None = None) -> dict:
    """Measure one section, render it, append it to ``path`` (default BENCHMARKS.md); returns
    the measurements."""
    measure, render, _ = SECTIONS[name]
    results = measure(quick=quick)
    write_section(name, section_command(name, quick), render(results), path)
    return results


def render_with_goals(name: str, results: dict) -> tuple[list[str], list[dict]]:
    """A section's markdown lines and the goals (``judge``'s records) its renderer judged."""
    _GOAL_LOGS.append([])
    try:
        lines = SECTIONS[name][1](results)
    finally:
        goals = _GOAL_LOGS.pop()
    return lines, goals


REPORT_NAME, JSON_NAME, PLOT_NAME = "BENCHMARKS.md", "benchmarks.json", "benchmarks.png"
# What ``all`` saves after each measured section: a late failure or Ctrl-C keeps what was
# measured, and ``--skip`` carries it over.
PARTIAL_NAME = "benchmarks.partial.json"
REPORT_FORMAT = 1  # of benchmarks.json
# The fields of benchmarks.json the report is rendered from, checked by read_report: the run's,
# its environment's (``environment``'s keys) and a measured section's.
RUN_FIELDS = {"date": str, "command": str, "quick": bool, "environment": dict, "sections": dict}
ENVIRONMENT_FIELDS = ("machine", "mlx", "blas", "blas_core_note", "numpy", "numpy_blas", "python")
ENTRY_FIELDS = {"date": str, "command": str, "quick": bool, "machine": str, "seconds": (int, float)}
# What a renderer or a plot panel raises on data of a layout it no longer reads.
DATA_ERRORS = (KeyError, IndexError, TypeError, ValueError, ZeroDivisionError)
QUICK_WARNING = (
    "**A `--quick` run: small sizes, a smoke test of `scripts/bench.py`. Its numbers mean "
    "nothing about the code's speed.**"
)


class ReportError(ValueError):
    """A benchmarks.json that cannot be read back, or a report that cannot be written."""


def environment() -> dict:
    """What a report's numbers were measured on: the machine, MLX, its BLAS, NumPy, Python."""
    return {
        "machine": machine_description(),
        "mlx": mx.__version__,
        "blas": _blas.describe(),
        "blas_core_note": _blas.status.core_note,
        "numpy": np.__version__,
        "numpy_blas": numpy_blas(),
        "python": platform.python_version(),
    }


def _entry_problem(entry) -> str | None:
    """What is wrong with one section of a benchmarks.json, or None."""
    if not isinstance(entry, dict):
        return "is not an object"
    if "results" not in entry:
        return None if isinstance(entry.get("not_run"), str) else "has neither results nor not_run"
    bad = [k for k, kind in ENTRY_FIELDS.items() if not isinstance(entry.get(k), kind)]
    if bad:
        return f"has results but no valid {', '.join(bad)} (expected {', '.join(ENTRY_FIELDS)})"
    return None


def read_report(path: Path) -> dict:
    """A benchmarks.json written by ``all``, checked for every field its report is rendered
    from: the run's, its environment's and each section's."""
    try:
        report = json.loads(path.read_text())
    except OSError as e:
        raise ReportError(f"{path}: cannot be read ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not JSON ({e})") from None
    ok = isinstance(report, dict) and report.get("format") == REPORT_FORMAT
    if not (ok and all(isinstance(report.get(k), kind) for k, kind in RUN_FIELDS.items())):
        raise ReportError(
            f"{path}: not a benchmarks.json of `scripts/bench.py all` (format {REPORT_FORMAT} "
            f"with {', '.join(RUN_FIELDS)})"
        )
    missing = [k for k in ENVIRONMENT_FIELDS if k not in report["environment"]]
    if missing:
        raise ReportError(f"{path}: its environment has no {', '.join(missing)}")
    for name, entry in report["sections"].items():
        problem = _entry_problem(entry)
        if problem:
            raise ReportError(f"{path}: section {name} {problem}")
    return report


def _previous_reports(out_dir: Path) -> list[dict]:
    """The reports ``--skip`` carries sections over from, newest first: ``out_dir``'s
    benchmarks.json and the benchmarks.partial.json an unfinished ``all`` left there."""
    paths = [p for p in (out_dir / PARTIAL_NAME, out_dir / JSON_NAME) if p.exists()]
    paths.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    return [read_report(p) for p in paths]


def _carried_over(previous: list[dict], name: str, quick: bool) -> dict:
    """A skipped section's entry: the newest of the earlier reports' measurements of the same
    kind (--quick or full), or why there is none."""
    entries = [r["sections"][name] for r in previous if name in r["sections"]]
    if not entries:
        where = "not in benchmarks.json" if previous else "no earlier benchmarks.json"
        return {"not_run": f"skipped; {where}"}
    measured = [e for e in entries if "results" in e]
    if not measured:
        return {"not_run": "skipped; not run in the earlier run either"}
    same = [e for e in measured if e["quick"] == quick]
    if not same:
        kind = "a --quick" if measured[0]["quick"] else "a full"
        return {"not_run": f"skipped; the earlier measurement was {kind} run's"}
    return {**same[0], "carried_over": True}


def _write_atomic(path: Path, text: str) -> None:
    """``text`` written to a temporary file beside ``path``, then renamed over it."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise ReportError(f"{path}: cannot be written ({e.strerror or e})") from None


def run_all(quick: bool, skip: list[str], out_dir: Path, command: str) -> dict:
    """Every section but ``skip`` verified and measured, skipped ones carried over from
    ``out_dir``'s benchmarks.json (or a newer benchmarks.partial.json); then the report written
    (``write_report``). The report is written only once every section verified and measured;
    until then benchmarks.partial.json holds what was measured, rewritten after each section."""
    previous = _previous_reports(out_dir) if skip else []
    env = environment()
    report = {
        "format": REPORT_FORMAT,
        "date": _now(),
        "command": command,
        "quick": quick,
        "environment": env,
        "sections": {},
    }
    partial, kept = out_dir / PARTIAL_NAME, []  # the sections measured and saved there
    try:
        for name in SECTIONS:
            if name in skip:
                report["sections"][name] = _carried_over(previous, name, quick)
                continue
            print(f"== {name}: {section_command(name, quick)}", flush=True)
            t0 = time.perf_counter()
            # rendered from exactly what is saved
            results = json.loads(json.dumps(SECTIONS[name][0](quick=quick)))
            seconds = time.perf_counter() - t0
            report["sections"][name] = {
                "date": report["date"],
                "command": command,
                "quick": quick,
                "machine": env["machine"],
                "seconds": seconds,
                "results": results,
            }
            try:
                _write_atomic(partial, json.dumps(report, indent=1) + "\n")
                kept.append(name)
            except ReportError as e:
                print(f"{e}; measuring goes on", file=sys.stderr)
            print("\n".join(render_with_goals(name, results)[0]) + f"\n\n({seconds:.0f} s)\n")
        write_report(report, out_dir)
    except BaseException:
        if kept:
            done = ",".join(n for n in SECTIONS if n in skip or n in kept)
            print(
                f"{', '.join(kept)} measured and kept in {partial}: "
                f"`all --skip {done}` carries them over",
                file=sys.stderr,
            )
        raise
    return report


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _section_status(entry: dict, machine: str) -> str:
    if "results" not in entry:
        return f"not run ({entry['not_run']})"
    done = f"{entry['seconds']:.0f} s"
    if not entry.get("carried_over"):
        return f"measured in this run ({done})"
    elsewhere = f", on {entry['machine']}" if entry["machine"] != machine else ""
    return f"carried over from the run of {entry['date']} (`{entry['command']}`{elsewhere}; {done})"


def _count_line(met: int, goals: int, not_run: int) -> str:
    """``M of N goals met.``, with ``; K sections not run`` where some did not run."""
    sections = f"; {not_run} section{'s' if not_run != 1 else ''} not run" if not_run else ""
    return f"{met} of {goals} goals met{sections}."


def render_report(report: dict, plot: str | None = None) -> str:
    """BENCHMARKS.md of a report: header, summary of every goal, contents, one section each.
    A carried-over section whose data this bench.py no longer renders is reported as not run;
    one measured in the report's own run raises ReportError."""
    env, quick = report["environment"], report["quick"]
    core_note = f" (core: {env['blas_core_note']})" if env["blas_core_note"] else ""
    lines = ["# Benchmarks", ""] + ([QUICK_WARNING, ""] if quick else [])
    lines += [
        "Written by `scripts/bench.py all`: every section verifies its fast path against a "
        "reference, then times it, beside baselines and physical limits measured in the same "
        f"run. The raw measurements are in `{JSON_NAME}` beside this file; "
        "`python scripts/bench.py render` writes this file again from them.",
        "",
        f"- Date: {report['date']}",
        f"- Machine: {env['machine']}",
        f"- MLX: {env['mlx']}",
        f"- MLX's BLAS: {env['blas']}{core_note}",
        f"- NumPy: {env['numpy']}, its own BLAS: {env['numpy_blas']}",
        f"- Python: {env['python']}",
        f"- Command: `{report['command']}`",
        "",
    ]
    rendered, summary, met, judged, not_run = {}, [], 0, 0, 0
    for name in SECTIONS:
        entry = report["sections"].get(name, {"not_run": "not in benchmarks.json"})
        body, goals = None, []
        if "results" in entry:
            try:
                body, goals = render_with_goals(name, entry["results"])
            except DATA_ERRORS as e:
                if not entry.get("carried_over"):
                    raise ReportError(
                        f"section {name} does not render ({e!r}): measured by another version "
                        "of scripts/bench.py?"
                    ) from None
                # measured by an older bench.py whose data this renderer no longer reads
                entry = {"not_run": f"carried over, but its data no longer renders ({e!r})"}
        rendered[name] = (entry, body)
        label = f"[{name}](#{name})" + (" (carried over)" if entry.get("carried_over") else "")
        if body is None:
            not_run += 1
            summary.append(f"| {label} | not run ({_cell(entry['not_run'])}) | | | |")
        for g in goals:
            summary.append(
                f"| {label} | {_cell(g['name'])} | {g['value']:.2f} | {_goal_bound(g)} "
                f"| {_goal_verdict(g)} |"
            )
            met += g["met"]
        judged += len(goals)
    lines += ["## Summary", "", _count_line(met, judged, not_run), ""]
    lines += ["| section | goal | value | bound | |", "|---|---|---|---|---|", *summary, ""]
    lines += ["## Contents", ""]
    for name, (entry, _) in rendered.items():
        status = _section_status(entry, env["machine"])
        lines.append(f"- [{name}](#{name}): {SECTIONS[name][2]}; {status}")
    lines.append("")
    if plot:
        lines += [f"![WKV7 and MoBA time against T, LoRA training tokens/s]({plot})", ""]
    for name, (entry, body) in rendered.items():
        status = _section_status(entry, env["machine"])
        lines += [f"## {name}", "", f"Command: `{section_command(name, quick)}`", ""]
        lines += [status[0].upper() + status[1:] + ".", ""]
        if body is not None:
            lines += body + [""]
    return "\n".join(lines) + "\n"  # a blank line last: sections run alone are appended


def _first(pair):
    return pair[0]


def _draw_times(ax, lines: list, Ts: list, title: str) -> None:
    """Time against T, log-log: ``lines`` of (label, color, line style, points)."""
    for label, color, style, points in lines:
        ax.plot(*zip(*points, strict=True), style, color=color, marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="seconds", title=title)
    ax.set_xticks(Ts, [str(T) for T in Ts])
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=7)


def _times_panel(rows: list, series: list, title: str):
    """``_draw_times`` of ``rows`` of (T, runs), ``series`` of (key, label, color, line style);
    runs that did not run (None) are left out."""
    lines = []
    for key, label, color, style in series:
        points = [(int(T), float(runs[key]["time"])) for T, runs in rows if runs.get(key)]
        if points:
            lines.append((label, color, style, points))
    Ts = sorted({int(T) for T, _ in rows})
    return functools.partial(_draw_times, lines=lines, Ts=Ts, title=title)


def _fwd_and_fb(implementations) -> list:
    """``_times_panel`` series of ``(run key prefix, label, color)``: fwd solid, fwd+bwd dashed."""
    return [
        (f"{key}_{kind}", f"{label} {name}", color, style)
        for kind, name, style in (("fwd", "fwd", "-"), ("fb", "fwd+bwd", "--"))
        for key, label, color in implementations
    ]


def _wkv7_panel(r: dict):
    H = r["base"][1]
    rows = sorted(((row["T"], row["runs"]) for row in r["rows"] if row["H"] == H), key=_first)
    implementations = (("ours", "wkv7", "C0"), ("ref", "step loop", "C1"), ("lm", "mlx-lm", "C2"))
    return _times_panel(rows, _fwd_and_fb(implementations), f"WKV7, B=1 H={H} N={r['N']}")


def _moba_panel(r: dict):
    rows = [(row["T"], row["runs"]) for row in r["rows"]]
    series = _fwd_and_fb((("moba", "MoBA", "C0"), ("dense", "dense SDPA", "C3")))
    return _times_panel(rows, series, f"MoBA vs dense causal attention, H={r['H']} D={r['D']}")


def _draw_bars(ax, names: list, rates: list, ratios: list, ylim: tuple, title: str) -> None:
    """Tokens/s of ours and mlx-lm's per shape, log scale, each pair with its ratio."""
    x = np.arange(len(names))
    for i, (label, color) in enumerate((("mlx_rwkvx", "C0"), ("mlx-lm", "C2"))):
        ax.bar(x + (i - 0.5) * 0.4, [rate[i] for rate in rates], 0.4, label=label, color=color)
    for xi, (ours, _), ratio in zip(x, rates, ratios, strict=True):
        ax.annotate(f"{ratio:.1f}x", (xi, ours), ha="center", va="bottom", fontsize=8)
    ax.set(xticks=x, xticklabels=names, yscale="log", ylabel="tokens/s (log)", title=title)
    ax.set_ylim(*ylim)
    ax.legend(fontsize=7)


def _train_panel(r: dict):
    shapes = r["shapes"]
    rates = [tuple(map(float, _train_tokens_per_s(s))) for s in shapes.values()]
    ratios = [ours / theirs for ours, theirs in rates]
    names = [f"{n}\nT={s['shape']['T']}, batch {s['shape']['batch']}" for n, s in shapes.items()]
    ylim = (min(min(rate) for rate in rates) / 3, 3 * max(max(rate) for rate in rates))
    title = f"LoRA training step (rank {r['rank']}): ours vs mlx-lm"
    return functools.partial(
        _draw_bars, names=names, rates=rates, ratios=ratios, ylim=ylim, title=title
    )


# Each panel's function reads its section's results into a drawer of one axes: data of a
# layout it no longer reads fails there, before anything is drawn.
PLOT_PANELS = (("wkv7", _wkv7_panel), ("moba", _moba_panel), ("train", _train_panel))


def plot_panels(report: dict) -> list:
    """The drawers of the panels whose sections the report holds; a panel whose data does not
    fit (an older bench.py's layout) is left out, with one printed line."""
    drawers = []
    for name, panel in PLOT_PANELS:
        entry = report["sections"].get(name, {})
        if "results" not in entry:
            continue
        try:
            drawers.append(panel(entry["results"]))
        except DATA_ERRORS as e:
            print(f"{PLOT_NAME}: the {name} panel is left out, its data does not fit ({e!r})")
    return drawers


def plot_report(report: dict, path: Path) -> bool:
    """benchmarks.png at ``path``: the panels of ``plot_panels``. False, with one printed line,
    where matplotlib is not installed or no panel has data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{PLOT_NAME} not drawn: matplotlib is not installed (pip install 'mlx_rwkvx[plot]')")
        return False
    drawers = plot_panels(report)
    if not drawers:
        names = ", ".join(n for n, _ in PLOT_PANELS)
        print(f"{PLOT_NAME} not drawn: no {names} section run, or none whose data fits")
        return False
    fig, axes = plt.subplots(1, len(drawers), figsize=(5.5 * len(drawers), 4.2), squeeze=False)
    for ax, draw in zip(axes[0], drawers, strict=True):
        draw(ax)
    note = " (--quick: these numbers mean nothing)" if report["quick"] else ""
    fig.suptitle(f"scripts/bench.py, {report['date']}{note}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return True


def write_report(report: dict, out_dir: Path, with_json: bool = True) -> list[Path]:
    """benchmarks.png (where matplotlib imports), benchmarks.json and BENCHMARKS.md in
    ``out_dir``: each written to a temporary file first, renamed over the old one once all are
    written, so that a failure leaves the old report whole. Then a benchmarks.png the new
    report does not show is removed, and with the JSON the benchmarks.partial.json."""
    png = out_dir / (PLOT_NAME + ".tmp")
    staged = {}
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if plot_report(report, png):
            staged[out_dir / PLOT_NAME] = png
        texts = {JSON_NAME: json.dumps(report, indent=1) + "\n"} if with_json else {}
        texts[REPORT_NAME] = render_report(report, PLOT_NAME if staged else None)
        for name, text in texts.items():
            staged[out_dir / name] = out_dir / (name + ".tmp")
            staged[out_dir / name].write_text(text)
        for path, tmp in staged.items():
            os.replace(tmp, path)
    except BaseException as e:
        for tmp in [png, *staged.values()]:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise ReportError(
                f"{out_dir}: the report cannot be written ({e.strerror or e})"
            ) from None
        raise
    stale = [] if out_dir / PLOT_NAME in staged else [out_dir / PLOT_NAME]
    if with_json:
        stale.append(out_dir / PARTIAL_NAME)
    for path in stale:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
    print(f"wrote {', '.join(path.name for path in staged)} in {out_dir}")
    return list(staged)


def output_folder(path: Path) -> Path:
    """``path`` made where it is missing and checked writable, before anything is measured."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as e:
        raise ReportError(f"{path}: cannot hold the report ({e.strerror or e})") from None
    return path


def _in_repository(path: Path) -> bool:
    path = path.resolve()
    return path == ROOT or ROOT in path.parents


def _section_list(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"no section {', '.join(unknown)} (sections: {', '.join(SECTIONS)})"
        )
    return names


def main(argv=None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    mlx_rwkvx.configure()  # MLX's CPU buffer cache, as the CLIs set it
    if argv and argv[0] == "_matmul-worker":
        print(json.dumps(matmul_worker([int(n) for n in argv[1:]])))
        return
    if argv and argv[0] == "_data-parallel-worker":
        print(json.dumps(data_parallel_worker(quick="--quick" in argv[1:])))
        return
    if argv and argv[0] == "_rfa-int8-worker":
        print(json.dumps(rfa_int8_worker(quick="--quick" in argv[1:])))
        return
    for name, worker in (("_int8-checkpoint-worker", int8_checkpoint_worker),
                         ("_int8-train-worker", int8_train_worker)):  # fmt: skip
        if argv and argv[0] == name:
            flags = {"grad_checkpoint": True} if "--grad-checkpoint" in argv[2:] else {}
            print(json.dumps(worker(argv[1], quick="--quick" in argv[2:], **flags)))
            return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    commands = {
        "all": "every section; rewrites BENCHMARKS.md, benchmarks.json and benchmarks.png",
        "render": "BENCHMARKS.md and benchmarks.png again from benchmarks.json, measuring nothing",
    }
    parser.add_argument(
        "sections",
        nargs="+",
        choices=[*SECTIONS, *commands],
        metavar="SECTION",
        help="\n".join(f"{name}: {help_text}" for name, (_, _, help_text) in SECTIONS.items())
        + "\n"
        + "\n".join(f"{name}: {help_text}" for name, help_text in commands.items()),
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="small sizes: a smoke test of the sections; its numbers mean nothing",
    )
    parser.add_argument(
        "--skip",
        type=_section_list,
        action="extend",
        default=[],
        metavar="SECTION[,SECTION]",
        help="with all: leave these sections out, carried over from the folder's benchmarks.json "
        "(or a newer benchmarks.partial.json) when it has them",
    )
    parser.add_argument(
        "--output",
        type=Path,
        metavar="DIR",
        help="the folder of BENCHMARKS.md (and, for all and render, benchmarks.json and "
        "benchmarks.png); default the repository's root, with --quick a new temporary folder "
        "(a --quick run never writes into the repository)",
    )
    args = parser.parse_args(argv)
    command = next((c for c in commands if c in args.sections), None)
    if command and len(args.sections) > 1:
        parser.error(f"{command} takes no other section")
    if args.skip and command != "all":
        parser.error("--skip goes with all")
    if command == "render" and args.quick:
        parser.error("render takes no --quick: benchmarks.json says whether its run was quick")
    if args.quick and args.output is not None and _in_repository(args.output):
        parser.error(
            f"--quick does not write into the repository ({args.output}): give --output a "
            "folder outside it"
        )
    out_dir = args.output or RESULTS.parent
    temporary = args.quick and args.output is None
    if temporary:
        out_dir = Path(tempfile.mkdtemp(prefix="mlx_rwkvx-bench-quick-"))
        print(f"--quick: writing into a new temporary folder, {out_dir}", flush=True)
    try:
        if command != "render":
            output_folder(out_dir)  # before anything is measured
        if command == "all":
            run_all(args.quick, args.skip, out_dir, "python scripts/bench.py " + shlex.join(argv))
        elif command == "render":
            write_report(read_report(out_dir / JSON_NAME), out_dir, with_json=False)
        else:
            for name in args.sections:
                run_section(name, quick=args.quick, path=out_dir / REPORT_NAME)
    except VerificationFailed as e:
        raise SystemExit(f"verify failed: {e}") from None
    except ReportError as e:
        parser.exit(2, f"{parser.prog}: error: {e}\n")
    except KeyboardInterrupt:
        parser.exit(130, f"{parser.prog}: interrupted\n")
    finally:
        if temporary:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only where nothing was written into it


if __name__ == "__main__":
    main()
