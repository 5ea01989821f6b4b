"""``python -m mlx_rwkvx.info --bench``: a short benchmark of this device a user can paste in an
issue. Each implementation of WKV7 and MoBA available here (the step loop and dense attention
at short lengths only, each kernel -- WKV7's sequential and chunked ones -- only when it passed
its self-check) forward and forward + backward at a few training shapes, and a LoRA step on the
rwkv7-0.1b shape: tokens/s and peak memory; then one row of README.md's "which Mac" table, the
peak memory of training the rwkv7-1.5b shape in int4. About a minute on a Mac; on a CPU the
shapes are scaled down (each line names its shape)."""

from __future__ import annotations

import importlib
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial

import mlx_rwkvx
from mlx_rwkvx.ops import tuning

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten

PREFIX = "bench      "


@dataclass(frozen=True)
class Shapes:
    """What ``bench`` measures: WKV7 ``(B, T, H, N)``, MoBA ``(B, T, Hq, Hkv, D, chunk, top_k)``
    (queries and keys of length T), the LoRA step's batch and length, and the calls timed per
    measurement after one warm-up call."""

    wkv7: tuple[tuple[int, int, int, int], ...]
    moba: tuple[tuple[int, int, int, int, int, int, int], ...]
    lora_batch: int
    lora_length: int
    lora_steps: int = 3
    repeats: int = 3
    model: str = "rwkv7-0.1b"
    # the row of README.md's "which Mac" table measured here: a preset, its base, T; and the
    # blocks it is cut to, the whole extrapolated from them (fewer over-estimate it)
    fit: tuple[str, str, int] = ("rwkv7-1.5b", "int4", 512)
    fit_cuts: tuple[int, int] = (4, 8)


# On an accelerator: the training shapes of a 0.1B model
GPU_SHAPES = Shapes(
    wkv7=((1, 64, 12, 64), (1, 512, 12, 64), (1, 2048, 12, 64)),
    moba=((1, 1024, 12, 2, 64, 64, 3), (1, 4096, 12, 2, 64, 256, 3)),
    lora_batch=1,
    lora_length=512,
    lora_steps=5,
    repeats=5,
)
# On a CPU (a few cores): shorter, so the whole run stays near a minute
CPU_SHAPES = replace(
    GPU_SHAPES,
    moba=((1, 1024, 12, 2, 64, 64, 3), (1, 2048, 12, 2, 64, 256, 3)),
    lora_length=256,
    lora_steps=3,
    repeats=3,
    fit=("rwkv7-1.5b", "int4", 64),
)


def shapes_here() -> Shapes:
    return CPU_SHAPES if mx.default_device().type == mx.cpu else GPU_SHAPES


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn()`` (which evaluates its results) in ms, after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def _fwd_and_fwd_bwd(fn: Callable, args: list[mx.array], repeats: int) -> tuple[float, float]:
    """ms per call of ``fn(*args)``, then of it and its gradient w.r.t. every argument."""
    both = tuning.forward_backward(fn, args)
    return median_ms(lambda: fn(*args), repeats), median_ms(both, repeats)


def _line(op: str, shape: str, impl: str, fwd: float, fwd_bwd: float) -> str:
    return f"{PREFIX}{op:<5} {shape:<34} {impl:<17} fwd {fwd:9.2f} ms   fwd+bwd {fwd_bwd:9.2f} ms"


def _op_module(name: str):
    # the package ``mlx_rwkvx.ops.wkv7``, not the function ``ops`` re-exports under its name
    return importlib.import_module(f"mlx_rwkvx.ops.{name}")


def wkv7_lines(shapes: Shapes) -> list[str]:
    W = _op_module("wkv7")
    lines = []
    for B, T, H, N in shapes.wkv7:
        args = W.timing_inputs(B, T, H, N)
        mx.eval(args)
        for name in W.DISPATCH.candidates((N, mx.float32), (B, T, H)):
            fwd, both = _fwd_and_fwd_bwd(W.DISPATCH.impls[name], args, shapes.repeats)
            lines.append(_line("wkv7", f"B={B} T={T} H={H} N={N} float32", name, fwd, both))
    return lines


def moba_lines(shapes: Shapes) -> list[str]:
    M = _op_module("moba")
    lines = []
    for B, T, Hq, Hkv, D, chunk, top_k in shapes.moba:
        qkv = M.timing_inputs(B, T, Hq, T, Hkv, D)
        mx.eval(qkv)
        shape = f"B={B} T={T} H={Hq}/{Hkv} D={D} c={chunk} k={top_k}"
        call = (B, T, Hq, T, Hkv, chunk, top_k)
        for name in M.DISPATCH.candidates((D, mx.float32), call):
            impl = M.DISPATCH.impls[name]

            def fn(q, k, v, impl=impl, chunk=chunk, top_k=top_k):
                return impl(q, k, v, chunk, top_k, None)

            fwd, both = _fwd_and_fwd_bwd(fn, qkv, shapes.repeats)
            lines.append(_line("moba", shape, name, fwd, both))
    return lines


def max_rss_mib() -> float:
    """This process's peak resident memory (``ru_maxrss``: KiB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 2**20 if sys.platform == "darwin" else rss / 2**10


def lora_lines(shapes: Shapes) -> list[str]:
    """Steps of LoRA training (rank 16 on the "rwkv" targets, AdamW, compiled) on a randomly
    initialised model of ``shapes.model``'s shape: tokens/s and peak memory."""
    from mlx_rwkvx.adapters import apply_lora, target_paths
    from mlx_rwkvx.models import Model, preset

    import mlx.nn as nn
    import mlx.optimizers as optim

    B, T = shapes.lora_batch, shapes.lora_length
    model = Model(preset(shapes.model), seed=0)
    apply_lora(model, target_paths(model, "rwkv"), rank=16, alpha=32.0)
    tokens = mx.random.randint(0, model.config.vocab_size, (B, T + 1), key=mx.random.key(0))
    optimizer = optim.AdamW(learning_rate=1e-4)

    def loss(model, x, y):
        return nn.losses.cross_entropy(model(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss)
    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(x, y):
        value, grads = loss_and_grad(model, x, y)
        optimizer.update(model, grads)
        return value

    x, y = tokens[:, :-1], tokens[:, 1:]
    mx.eval(step(x, y), state)  # compiles
    mx.reset_peak_memory()
    t0 = time.perf_counter()
    for _ in range(shapes.lora_steps):
        mx.eval(step(x, y), state)
    seconds = (time.perf_counter() - t0) / shapes.lora_steps
    params = sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6
    return [
        f"{PREFIX}lora  {shapes.model} ({params:.0f}M params, random init) rank 16 on 'rwkv', "
        f"batch {B} x T={T}, AdamW, compiled, mean of {shapes.lora_steps} steps",
        f"{PREFIX}lora  {B * T / seconds:9.0f} tokens/s   {seconds * 1e3:9.1f} ms/step   "
        f"peak MLX memory {mx.get_peak_memory() / 2**20:8.0f} MiB   "
        f"max RSS {max_rss_mib():8.0f} MiB",
    ]


def _child_peak(cmd: list[str], log: str) -> int:
    """Run ``cmd``; its peak resident memory in bytes (RuntimeError with its last lines where
    it fails: a bug, the inputs being ours)."""
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        tail = "".join(open(log).readlines()[-5:])
        raise RuntimeError(f"{' '.join(cmd[1:4])} failed ({proc.returncode}):\n{tail}")
    return usage.ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def fit_lines(shapes: Shapes) -> list[str]:
    """One row of README.md's "which Mac" table on this machine, as the benchmark measures it:
    ``python -m mlx_rwkvx.train`` (LoRA, --grad-checkpoint, two steps, batch 1) on the preset
    cut to 4 and to 8 blocks, random weights, each run a process of its own; its peak resident
    memory, and the whole model's extrapolated per block."""
    from mlx_rwkvx.data.records import write_bin
    from mlx_rwkvx.io.load import save
    from mlx_rwkvx.models import Model, preset

    name, base, T = shapes.fit
    cfg = preset(name)
    rng = np.random.default_rng(0)
    peaks = []
    with tempfile.TemporaryDirectory() as tmp:
        write_bin(f"{tmp}/data.bin", [rng.integers(0, cfg.vocab_size, T + 1) for _ in range(4)])
        for n in shapes.fit_cuts:
            model = Model(replace(cfg, block_types=cfg.block_types[:n]), init=None)
            model.set_dtype(mx.bfloat16)
            save(model, f"{tmp}/m{n}")
            del model
            flags = {
                "--model": f"{tmp}/m{n}",
                "--data": f"{tmp}/data.bin",
                "--iters": "2",
                "--output": f"{tmp}/out{n}",
                "--max-seq-len": str(T),
                "--save-every": "99",
            }
            cmd = [sys.executable, "-m", "mlx_rwkvx.train", "--grad-checkpoint"]
            cmd += [x for pair in flags.items() for x in pair]
            if base != "bf16":
                cmd += ["--quantize", base]
            peaks.append(_child_peak(cmd, f"{tmp}/log{n}"))
    blocks = len(cfg.block_types)
    (m, n), (few, more) = shapes.fit_cuts, peaks
    whole = few + (blocks - m) * (more - few) / (n - m)
    return [
        f"{PREFIX}memory {name} {base} LoRA T={T} --grad-checkpoint, batch 1, 2 steps: peak "
        f"RSS {few / 1e9:.2f} GB with {m} blocks, {more / 1e9:.2f} GB with {n}, "
        f"{whole / 1e9:.2f} GB extrapolated to its {blocks} (README's which-Mac table)",
    ]


def bench(shapes: Shapes | None = None) -> list[str]:
    """The benchmark's lines: the device, then WKV7, MoBA and the LoRA step."""
    shapes = shapes or shapes_here()
    info = ", ".join(f"{k} {v}" for k, v in sorted(mx.device_info().items()))
    lines = [
        f"{PREFIX}device {mx.default_device()} ({info}), MLX {mx.__version__}, "
        f"mlx_rwkvx {mlx_rwkvx.__version__}",
        f"{PREFIX}shapes for {'a CPU (scaled down)' if shapes == CPU_SHAPES else 'an accelerator'}"
        f"; times are the median of {shapes.repeats} calls after a warm-up, float32",
    ]
    lines += wkv7_lines(shapes) + moba_lines(shapes) + lora_lines(shapes)
    return lines + fit_lines(shapes)
