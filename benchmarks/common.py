"""What every section shares: verification errors, timing, goals, the section record and the
workers that run in processes of their own."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import mlx_rwkvx
from mlx_rwkvx.perf import best_time

import mlx.core as mx
import numpy as np

# The folder holding the benchmarks package (the repository's root in a checkout).
PACKAGE_ROOT = Path(__file__).resolve().parent.parent
# Where the recorded results live (BENCHMARKS.md, benchmarks.json, benchmarks.png): beside the
# code that measured them.
RESULTS_DIR = Path(__file__).resolve().parent


class VerificationFailed(RuntimeError):
    """A fast path disagrees with its reference; nothing has been timed."""


def rel_err(x, ref) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    x = np.asarray(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)
    ref = np.asarray(ref.astype(mx.float32) if isinstance(ref, mx.array) else ref, np.float64)
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def now() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d %H:%M")


def sizes(table: dict, quick: bool) -> dict:
    """A section's ``{"full": ..., "quick": ...}`` table, the part for this run."""
    return table["quick" if quick else "full"]


def resident_memory() -> tuple[int, int]:
    """(resident, peak resident) bytes of this process: /proc where there is one (Linux), else
    the peak alone from getrusage (macOS counts it in bytes, Linux in KiB)."""
    try:
        fields = dict(line.split(":", 1) for line in open("/proc/self/status", encoding="ascii"))
        kib = [int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")]
        return kib[0] * 1024, kib[1] * 1024
    except OSError:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peak *= 1 if sys.platform == "darwin" else 1024
        return peak, peak


def stream_size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def time_and_peak(run: Callable[[], object], repeats: int) -> dict:
    """Best time in seconds and peak memory in bytes above what was allocated before."""
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    run()
    peak = mx.get_peak_memory() - base
    t = best_time(run, repeats=repeats, warmup=0)
    return {"time": t, "peak": peak}


def time_steps(step: Callable[[], object], n: int) -> float:
    """Best of ``n`` timed calls of a training step, after one that compiles."""
    step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times)


@dataclass(frozen=True)
class Goal:
    """A goal a section sets itself: ``value`` against ``bound``, met when the value is at
    least the bound (``at_least``) or at most it."""

    name: str
    value: float
    bound: float
    at_least: bool

    def __post_init__(self):
        object.__setattr__(self, "value", float(self.value))  # a NumPy or MLX scalar too

    @property
    def met(self) -> bool:
        return bool(self.value >= self.bound if self.at_least else self.value <= self.bound)

    @property
    def bound_text(self) -> str:
        return f"{'>=' if self.at_least else '<='} {self.bound:g}"

    @property
    def verdict(self) -> str:
        return "met" if self.met else "MISSED"


class Rendered(NamedTuple):
    """A section's markdown lines (its goals' lines among them) and its goals."""

    lines: list[str]
    goals: list[Goal]


def with_goals(lines: list[str], goals: Sequence[Goal], after: Sequence[str] = ()) -> Rendered:
    """``lines``, then a ``Goals:`` list (``- name: value (goal >= bound): met`` each), then
    ``after``; with the goals, for the report's summary."""
    listed = [f"- {g.name}: {g.value:.2f} (goal {g.bound_text}): {g.verdict}" for g in goals]
    return Rendered([*lines, "", "Goals:", "", *listed, *after], list(goals))


class Section(NamedTuple):
    """One benchmark: ``measure(quick=...)`` verifies then times and returns plain data;
    ``render(results)`` turns that data into a ``Rendered``; ``help`` says what it measures."""

    measure: Callable[..., dict]
    render: Callable[[dict], Rendered]
    help: str


def worker_command(module: str, *args: str, quick: bool = False) -> list[str]:
    """``python -m benchmarks.<module> --worker ARGS [--quick]`` with this interpreter."""
    return [sys.executable, "-m", f"benchmarks.{module}", "--worker", *args] + (
        ["--quick"] if quick else []
    )


def worker_env(**env: str) -> dict:
    """This process's environment with ``env`` added and the benchmarks package importable
    (PYTHONPATH), wherever the worker starts."""
    path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, **env, PYTHONPATH=path)


def last_json(out: str) -> dict:
    return json.loads(out.strip().splitlines()[-1])


def run_worker(module: str, *args: str, quick: bool = False, **env: str) -> dict:
    """A worker's result, the last line it prints (CalledProcessError where it fails)."""
    cmd = worker_command(module, *args, quick=quick)
    out = subprocess.run(cmd, env=worker_env(**env), check=True, capture_output=True, text=True)
    return last_json(out.stdout)


def start_worker(
    module: str, *args: str, quick: bool = False, without: tuple[str, ...] = ()
) -> subprocess.Popen:
    """A worker started, to run beside others; ``worker_result`` waits for it. ``without``:
    packages its interpreter cannot import, as in an environment without them."""
    cmd = worker_command(module, *args, quick=quick)
    if without:  # python -m benchmarks.X ... -> python -c "<hide them>; run benchmarks.X" ...
        hide = "".join(f"sys.modules[{name!r}] = None; " for name in without)
        run = f"runpy.run_module('benchmarks.{module}', run_name='__main__')"
        cmd[1:3] = ["-c", f"import runpy, sys; {hide}{run}"]
    return subprocess.Popen(
        cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def worker_result(proc: subprocess.Popen) -> dict:
    """A started worker's result; VerificationFailed with the end of its errors where it fails."""
    out, err = proc.communicate()
    if proc.returncode:
        command = " ".join(["python", *proc.args[1:]])
        raise VerificationFailed(f"{command} failed: {err[-2000:]}")
    return last_json(out)


def worker_main(parser: argparse.ArgumentParser, work: Callable, argv=None) -> None:
    """A section's worker entry point: ``--worker`` (required) and ``--quick`` beside the
    parser's own arguments; prints ``work(args)`` as one JSON line, after setting MLX up as
    the commands do."""
    parser.add_argument(
        "--worker", action="store_true", required=True, help="run this section's worker"
    )
    parser.add_argument("--quick", action="store_true", help="the section's --quick sizes")
    args = parser.parse_args(argv)
    mlx_rwkvx.configure()  # MLX's CPU buffer cache, as the CLIs set it
    print(json.dumps(work(args)))
