"""The wkv7 section: WKV7 forward and forward+backward, our dispatcher against autograd through
the step loop and mlx-lm's CPU loop, with peak memory and the matmul rate reached; and what two
constants of ``ops/wkv7`` rest on (``wkv7_choices``)."""

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
from benchmarks.wkv7_choices import measure_choices, render_choices
from benchmarks.wkv7_floor import measure_floor, render_floor
from benchmarks.workloads import WKV7_N, chunked_flops, fwd, fwd_bwd, wkv7_inputs
from mlx_rwkvx.ops.wkv7 import wkv7, wkv7_ref
from mlx_rwkvx.perf import best_time, matmul_gflops

import mlx.core as mx

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
# Step loops longer than this many head-steps take seconds a run: they are timed once.
SLOW_LOOP_HEAD_STEPS = 8 * 1024
# MLX autograd through a step loop keeps one full [B, T, H, N] cotangent per step (the VJP of
# each per-step slice): memory grows as (T H)^2. Larger runs did not fit in the RAM of the
# machine these benchmarks were first run on; the table reports them as such, with their
# memory extrapolated from the largest run that fitted.
LOOP_GRAD_MAX_HEAD_STEPS = 16384


def mlx_lm_wkv7(r, log_w, k, v, a, b, state):
    """mlx-lm's own CPU WKV7 path (its time-mix ``_wkv7`` method), fed the decay it expects."""
    from mlx_rwkvx._mlx_lm import time_mix_wkv7

    return time_mix_wkv7(r, mx.exp(log_w), k, v, a, b, state)


def bmm_gflops(batch: int = 2048) -> float:
    """GFLOP/s of the batched 16 x 64 x 64 matmuls the chunked WKV7 path is made of."""
    a = mx.random.normal((batch, 16, 64))
    b = mx.random.normal((batch, 64, 64))
    mx.eval(a, b)
    return 2 * batch * 16 * 64 * 64 / best_time(lambda: mx.eval(a @ b)) / 1e9


def verify(T: int, H: int) -> dict:
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


def measure(quick: bool = False) -> dict:
    """WKV7 forward and fwd+bwd: our dispatcher, mlx-lm's loop, autograd through ``wkv7_ref``."""
    cfg = sizes(WKV7, quick)
    verified = verify(*cfg["verify"])
    rate = matmul_gflops(cfg["matmul_n"])
    bmm_rate = bmm_gflops(cfg["bmm_batch"])
    rows = []
    for T, H in cfg["shapes"]:
        xs = wkv7_inputs(T, H)
        reps = 1 if T * H > SLOW_LOOP_HEAD_STEPS else 3
        fits = T * H <= LOOP_GRAD_MAX_HEAD_STEPS
        runs = {
            "ours_fwd": time_and_peak(fwd(wkv7, xs), 3),
            "ours_fb": time_and_peak(fwd_bwd(wkv7, xs), 3),
            "lm_fwd": time_and_peak(fwd(mlx_lm_wkv7, xs), reps),
            "ref_fwd": time_and_peak(fwd(wkv7_ref, xs), reps),
            "lm_fb": time_and_peak(fwd_bwd(mlx_lm_wkv7, xs), reps) if fits else None,
            "ref_fb": time_and_peak(fwd_bwd(wkv7_ref, xs), 1) if fits else None,
        }
        rows.append({"T": T, "H": H, "flops": chunked_flops(T, H, WKV7_N), "runs": runs})
        print(
            f"T={T} H={H}: "
            + ", ".join(f"{k} {v['time'] * 1e3:.1f} ms" for k, v in runs.items() if v)
        )
    T, H = cfg["base"]
    return {
        "verify": verified,
        "choices": measure_choices(cfg["crossover"], cfg["chunk_T"]),
        "floors": {"fb": measure_floor(T, H, rate), "fwd": measure_floor(4 * T, H, rate)},
        "N": WKV7_N,
        "slow_loop_head_steps": SLOW_LOOP_HEAD_STEPS,
        "matmul_n": cfg["matmul_n"],
        "matmul_gflops": rate,
        "bmm_gflops": bmm_rate,
        "base": list(cfg["base"]),
        "rows": rows,
    }


def _loop_peak_estimate(rows: list, key: str, T: int, H: int) -> float | None:
    """Peak bytes a step loop's autograd that was not run would need, from the largest run of
    the same path that fitted: it grows as (T H)^2. None when no run fitted."""
    done = [row for row in rows if row["runs"][key] is not None]
    if not done:
        return None
    top = max(done, key=lambda row: row["T"] * row["H"])
    return top["runs"][key]["peak"] * (T * H / (top["T"] * top["H"])) ** 2


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms"


def _mib(x: float) -> str:
    return f"{x / 2**20:.0f} MiB"


def _ratio(runs: dict, slow: str, fast: str, field: str = "time", fmt: str = ".0f") -> str:
    if runs[slow] is None:
        return "n/a"
    return f"{runs[slow][field] / runs[fast][field]:{fmt}}x"


def _cell(rows: list, row: dict, key: str, field: str, show) -> str:
    if row["runs"][key] is not None:
        return show(row["runs"][key][field])
    estimate = _loop_peak_estimate(rows, key, row["T"], row["H"])
    return "does not fit" if estimate is None else f"does not fit ({estimate / 1e9:.0f} GB)"


def _goals(r: dict) -> list[Goal]:
    T, H = r["base"]
    by_shape = {(row["T"], row["H"]): row["runs"] for row in r["rows"]}
    r1, r2, r4 = by_shape[(T, H)], by_shape[(2 * T, H)], by_shape[(4 * T, H)]
    memory_goal = f"fwd+bwd peak memory ref / ours at T={2 * T}"
    if r4["ref_fb"] is None:
        memory_goal += f" (T={4 * T}: the step loop does not fit; its share only grows with T)"

    def ratio(a: dict, key_a: str, b: dict, key_b: str, field: str = "time") -> float:
        return a[key_a][field] / b[key_b][field]

    return [
        Goal(f"fwd+bwd T={T} H={H} vs ref autograd", ratio(r1, "ref_fb", r1, "ours_fb"), 100, True),
        Goal(f"fwd T={4 * T} H={H} vs mlx-lm", ratio(r4, "lm_fwd", r4, "ours_fwd"), 20, True),
        Goal(memory_goal, ratio(r2, "ref_fb", r2, "ours_fb", "peak"), 10, True),
        Goal(f"T={4 * T} / T={T} fwd time", ratio(r4, "ours_fwd", r1, "ours_fwd"), 4.5, False),
        Goal(f"T={4 * T} / T={T} fwd+bwd time", ratio(r4, "ours_fb", r1, "ours_fb"), 4.5, False),
    ]


def _floor_rows(r: dict, goals: list[Goal]) -> list[dict]:
    """The two speed goals beside the floor of the chunked path at their shapes."""
    T, H = r["base"]
    by_shape = {(row["T"], row["H"]): row["runs"] for row in r["rows"]}
    return [
        {
            "goal": goals[0].name,
            "baseline": by_shape[(T, H)]["ref_fb"]["time"],
            "direction": "fb",
            "bound": goals[0].bound,
            "floor": r["floors"]["fb"],
        },
        {
            "goal": goals[1].name,
            "baseline": by_shape[(4 * T, H)]["lm_fwd"]["time"],
            "direction": "fwd",
            "bound": goals[1].bound,
            "floor": r["floors"]["fwd"],
        },
    ]


def render(r: dict) -> Rendered:
    """Times, peak memory and the matmul rate reached, what the constants rest on, the goals."""
    rows, v, N = r["rows"], r["verify"], r["N"]
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
            f"| {T} | {H} | {_ms(runs['ours_fwd']['time'])} | {_ms(runs['lm_fwd']['time'])} "
            f"| {_ms(runs['ref_fwd']['time'])} "
            f"| {runs['lm_fwd']['time'] / runs['ours_fwd']['time']:.1f}x "
            f"| {_ms(runs['ours_fb']['time'])} | {_cell(rows, row, 'lm_fb', 'time', _ms)} "
            f"| {_cell(rows, row, 'ref_fb', 'time', _ms)} | {_ratio(runs, 'ref_fb', 'ours_fb')} "
            f"| {_ratio(runs, 'lm_fb', 'ours_fb')} |"
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
            f"| {row['T']} | {row['H']} | {_mib(runs['ours_fb']['peak'])} "
            f"| {_cell(rows, row, 'lm_fb', 'peak', _mib)} "
            f"| {_cell(rows, row, 'ref_fb', 'peak', _mib)} "
            f"| {_ratio(runs, 'ref_fb', 'ours_fb', 'peak', '.1f')} |"
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
    goals = _goals(r)
    lines += ["", *render_choices(r["choices"])]
    if "floors" in r:  # runs before the floor was measured have none
        lines += render_floor(_floor_rows(r, goals), r["matmul_n"])
    return with_goals(lines, goals)


SECTION = Section(measure, render, "WKV7 forward and fwd+bwd vs the step loop and mlx-lm")
