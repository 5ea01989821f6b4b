"""The blas section: MLX's fp32 matmul with OpenBLAS (as set up, and with its Prescott kernels
forced), with MLX's bundled BLAS and NumPy's; memory read bandwidth.

``python -m benchmarks.blas --worker SIZE...`` is the matmul measured in a fresh process (the
BLAS is chosen when mlx_rwkvx is imported: the environment picks it)."""

from __future__ import annotations

import argparse
import os

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    run_worker,
    sizes,
    stream_size,
    with_goals,
    worker_main,
)
from mlx_rwkvx.perf import best_time, blas_in_use, matmul_gflops, numpy_blas, read_bandwidth_gbs

import mlx.core as mx
import numpy as np

BLAS = {
    "full": dict(sizes=(512, 1024, 2048), rounds=3, stream_bytes=1 << 30),
    "quick": dict(sizes=(64, 128, 256), rounds=2, stream_bytes=1 << 26),
}


def numpy_matmul_gflops(n: int) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), dtype=np.float32)
    b = rng.standard_normal((n, n), dtype=np.float32)
    return 2 * n**3 / best_time(lambda: a @ b) / 1e9


def matmul_worker(sizes) -> dict:
    """MLX fp32 matmul GFLOP/s per size in this process, with the BLAS and core type it found."""
    blas = blas_in_use()
    return {
        "blas": blas["blas"],
        "core": blas["core"],
        "core_note": blas["core_note"],
        "gflops": {str(n): matmul_gflops(n) for n in sizes},
    }


def verify_matmul() -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((300, 257)).astype(np.float32)
    b = rng.standard_normal((257, 129)).astype(np.float32)
    err = rel_err(mx.array(a) @ mx.array(b), a.astype(np.float64) @ b.astype(np.float64))
    if not err <= 1e-5:
        raise VerificationFailed(f"MLX fp32 matmul error {err:.2e} > 1e-5")
    return err


def measure(quick: bool = False) -> dict:
    """MLX matmul with OpenBLAS, with its Prescott kernels, with MLX's own BLAS, and NumPy's."""
    cfg = sizes(BLAS, quick)
    matmul_sizes, rounds = cfg["sizes"], cfg["rounds"]
    err = verify_matmul()
    ours = matmul_worker(matmul_sizes)
    numpy_rates = {str(n): numpy_matmul_gflops(n) for n in matmul_sizes}
    # More rounds, MLX and NumPy in turn, best of each: a burst of other load on the machine
    # then cannot fall on one side of the ratio only.
    for _ in range(rounds - 1):
        for n in map(str, matmul_sizes):
            ours["gflops"][n] = max(ours["gflops"][n], matmul_gflops(int(n)))
            numpy_rates[n] = max(numpy_rates[n], numpy_matmul_gflops(int(n)))
    worker_sizes = list(map(str, matmul_sizes))
    bundled = run_worker("blas", *worker_sizes, MLX_RWKVX_BLAS="0")
    # What a misdetected core costs: OpenBLAS's generic x86-64 kernels, as it falls back to on a
    # CPU it does not know (x86 only; other CPUs have no Prescott core).
    prescott = None
    if ours["core"] and blas_in_use()["x86_flags"]:
        prescott = run_worker(
            "blas", *worker_sizes, OPENBLAS_CORETYPE="Prescott", MLX_RWKVX_BLAS_CORETYPE="0"
        )
    nbytes = cfg["stream_bytes"]
    return {
        "verify_error": err,
        "rounds": rounds,
        "sizes": list(matmul_sizes),
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


def render(r: dict) -> Rendered:
    """Which BLAS each path ran, the GFLOP/s table, the goals, the physical limits."""
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
    fastest = ours["gflops"][big]
    goals = [
        Goal(
            f"MLX+OpenBLAS / bundled BLAS, fp32 n={big}", fastest / bundled["gflops"][big], 10, True
        ),
        Goal(f"MLX+OpenBLAS / NumPy, fp32 n={big}", fastest / numpy_rates[big], 0.8, True),
    ]
    if prescott:
        cost = ours["gflops"][big] / prescott["gflops"][big]
        lines += ["", f"A misdetected (Prescott) core would be {cost:.1f}x slower at n={big}."]
    limits = [
        "",
        "Physical limits for later benchmarks:",
        f"- fp32 matmul: {ours['gflops'][big]:.1f} GFLOP/s (MLX + OpenBLAS, n={big})",
        f"- memory read bandwidth: {r['bandwidth_gbs']:.1f} GB/s with {r['threads']} threads "
        f"({r['bandwidth_one_thread_gbs']:.1f} GB/s with one), streaming "
        f"{stream_size(r['stream_bytes'])} of fp32",
    ]
    return with_goals(lines, goals, after=limits)


SECTION = Section(
    measure, render, "MLX matmul with OpenBLAS (its core and Prescott), without, NumPy, bandwidth"
)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=matmul_worker.__doc__)
    parser.add_argument("sizes", nargs="+", type=int, metavar="SIZE")
    worker_main(parser, lambda args: matmul_worker(args.sizes), argv)


if __name__ == "__main__":
    main()
