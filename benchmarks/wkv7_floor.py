"""Part of the wkv7 section: the floor of the chunked WKV7 path at its chunk length (CHUNK) on
this machine, from parts measured in the same run. No arrangement of that chunk form's MLX ops
runs faster than the sum of what it cannot skip:

- one exponential per decay (``e^log_w``, by ``pow2_exp``, the fastest exponential MLX has
  here) over the ``[B, T, H, N]`` input;
- the state scan, ``T / CHUNK`` dependent ``addmm`` of ``[H, N, N]`` (nothing runs beside it);
- the chunk form's other matmul FLOPs (``chunked_flops`` less the scan's) at the rate of one
  large matmul, the best rate this machine reaches at all.

The backward adds a second scan and twice the forward's matmul FLOPs. The floor ignores every
other elementwise pass, every copy and every small-matmul inefficiency: the real path can only
be slower.
"""

from __future__ import annotations

from benchmarks.workloads import WKV7_N, chunked_flops
from mlx_rwkvx.ops.common import pow2_exp
from mlx_rwkvx.ops.wkv7 import chunk
from mlx_rwkvx.perf import best_time

import mlx.core as mx


def measure_floor(T: int, H: int, matmul_gflops: float, N: int = WKV7_N) -> dict:
    """Times of the parts above at (T, H), B = 1, and the fwd and fwd+bwd floors they add to."""
    log_w = -mx.random.uniform(shape=(1, T, H, N))
    n_chunks = -(-T // chunk.CHUNK)
    P = mx.random.normal((n_chunks, 1, H, N, N)) / N
    U = mx.random.normal((n_chunks, 1, H, N, N))
    state = mx.zeros((1, H, N, N))
    mx.eval(log_w, P, U, state)
    exp = best_time(lambda: mx.eval(pow2_exp(log_w)))
    scan = best_time(lambda: mx.eval(chunk.scan_states(P, U, state)))
    flops = chunked_flops(T, H, N) - H * n_chunks * 2 * N**3  # the scan is timed itself
    matmuls = flops / (matmul_gflops * 1e9)
    return {
        "T": T,
        "H": H,
        "chunk": chunk.CHUNK,
        "exp": exp,
        "scan": scan,
        "flops": flops,
        "matmuls": matmuls,
        "fwd": exp + scan + matmuls,
        "fb": exp + 2 * scan + 3 * matmuls,
    }


def render_floor(rows: list[dict], matmul_n: int) -> list[str]:
    """Each goal's floor and the best ratio the chunk form could reach here: ``rows`` of
    ``{"goal", "baseline" (seconds), "direction" ("fwd" or "fb"), "bound", "floor"}``."""
    lines = [
        f"The floor of the chunked path with chunks of {rows[0]['floor'].get('chunk', 'CHUNK')} "
        "here (`benchmarks/wkv7_floor.py`): one exponential pass, the state scan, and the chunk "
        "form's other matmul FLOPs at the large-matmul rate; fwd+bwd adds a second scan and "
        "twice the matmuls. Every other pass is left out: the path can only be slower. (Longer "
        "chunks halve the scan and add matmul work.)",
        "",
        f"| goal | exp pass | scan | other matmul FLOPs at the {matmul_n}^3 rate | floor "
        "| baseline | best ratio reachable | goal |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        f, d = row["floor"], row["direction"]
        scans = 2 if d == "fb" else 1
        lines.append(
            f"| {row['goal']} | {f['exp'] * 1e3:.1f} ms | {scans} x {f['scan'] * 1e3:.1f} ms "
            f"| {(3 if d == 'fb' else 1) * f['flops'] / 1e9:.2f} GFLOP, "
            f"{(3 if d == 'fb' else 1) * f['matmuls'] * 1e3:.1f} ms | {f[d] * 1e3:.1f} ms "
            f"| {row['baseline'] * 1e3:.1f} ms | {row['baseline'] / f[d]:.1f}x "
            f"| {row['bound']:g}x |"
        )
    return lines + [""]
