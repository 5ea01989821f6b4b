"""Benchmarks: each subcommand verifies its fast path against a reference, then times it.

    python scripts/bench.py blas

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


def rel_err(x, ref) -> float:
    x = np.asarray(x, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


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


def matmul_worker(sizes) -> dict:
    """MLX fp32 matmul GFLOP/s per size in this process, with the BLAS it found."""
    return {"blas": _blas.describe(), "gflops": {n: matmul_gflops(n) for n in sizes}}


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
    env = dict(os.environ, MLX_RWKVX_BLAS="0")
    cmd = [sys.executable, __file__, "_matmul-worker", *map(str, MATMUL_SIZES)]
    out = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True).stdout
    bundled = json.loads(out.strip().splitlines()[-1])
    numpy_rates = {n: numpy_matmul_gflops(n) for n in MATMUL_SIZES}
    bw_all = read_bandwidth_gbs()
    bw_one = read_bandwidth_gbs(threads=1)
    lines = [
        f"Verified first: MLX fp32 matmul vs NumPy float64, relative error {err:.1e}.",
        "",
        f"- with mlx_rwkvx: {ours['blas']}",
        f"- without (`MLX_RWKVX_BLAS=0`): {bundled['blas']}",
        "",
        "| fp32 matmul n x n x n | MLX + OpenBLAS | MLX bundled BLAS | NumPy | OpenBLAS / bundled "
        "| MLX+OpenBLAS / NumPy |",
        "|---|---|---|---|---|---|",
    ]
    for n in MATMUL_SIZES:
        o, b, p = ours["gflops"][n], bundled["gflops"][str(n)], numpy_rates[n]
        lines.append(
            f"| {n} | {o:.1f} GFLOP/s | {b:.1f} GFLOP/s | {p:.1f} GFLOP/s | {o / b:.1f}x "
            f"| {o / p:.2f}x |"
        )
    big = MATMUL_SIZES[-1]
    goal = ours["gflops"][big] / bundled["gflops"][str(big)]
    lines += [
        "",
        f"Goal >= 10x at n={big}: {goal:.1f}x, {'met' if goal >= 10 else 'MISSED'}.",
        "",
        "Physical limits for later benchmarks:",
        f"- fp32 matmul: {ours['gflops'][big]:.1f} GFLOP/s (MLX + OpenBLAS, n={big})",
        f"- memory read bandwidth: {bw_all:.1f} GB/s with {os.cpu_count()} threads "
        f"({bw_one:.1f} GB/s with one), streaming 1 GiB of fp32",
    ]
    write_section("blas", "python scripts/bench.py blas", lines)


def main(argv=None) -> None:
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "_matmul-worker":
        print(json.dumps(matmul_worker([int(n) for n in argv[1:]])))
        return
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    sub = parser.add_subparsers(dest="bench", required=True)
    sub.add_parser("blas", help="MLX matmul with and without OpenBLAS, NumPy, read bandwidth")
    args = parser.parse_args(argv)
    {"blas": bench_blas}[args.bench](args)


if __name__ == "__main__":
    main()
