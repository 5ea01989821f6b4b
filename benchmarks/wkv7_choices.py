"""Part of the wkv7 section: what two constants of ``ops/wkv7`` rest on, up to which T the
dispatcher takes the step loop (REF_MAX_T) and the chunk length of the chunked path (CHUNK);
each candidate verified against the step loop first."""

from __future__ import annotations

from benchmarks.common import VerificationFailed, rel_err, time_and_peak
from benchmarks.workloads import WKV7_N, fwd, fwd_bwd, wkv7_inputs
from mlx_rwkvx.ops.wkv7 import REF_MAX_T, chunk, wkv7_chunked, wkv7_ref

CHUNK_LENGTHS = (16, 32, 64)


def measure_choices(crossover_Ts: list[int], chunk_T: int) -> dict:
    """The step loop against the chunked path at each of ``crossover_Ts`` (H=8), and each of
    CHUNK_LENGTHS at ``chunk_T``."""
    crossover = []
    for T in crossover_Ts:
        xs = wkv7_inputs(T, 8)
        crossover.append(
            {
                "T": T,
                "ref_fwd": time_and_peak(fwd(wkv7_ref, xs), 5)["time"],
                "chunked_fwd": time_and_peak(fwd(wkv7_chunked, xs), 5)["time"],
                "ref_fb": time_and_peak(fwd_bwd(wkv7_ref, xs), 5)["time"],
                "chunked_fb": time_and_peak(fwd_bwd(wkv7_chunked, xs), 5)["time"],
            }
        )
    # the chunk length is the chunked path's module constant, read at each call: set it for
    # each candidate, then back
    lengths, chosen = [], chunk.CHUNK
    xs = wkv7_inputs(chunk_T, 8)
    want = wkv7_ref(*wkv7_inputs(64, 2))[0]
    try:
        for L in CHUNK_LENGTHS:
            chunk.CHUNK = L
            err = rel_err(wkv7_chunked(*wkv7_inputs(64, 2))[0], want)
            if not err <= 2e-6:
                raise VerificationFailed(f"wkv7 chunked with chunks of {L}: y off by {err:.1e}")
            fb = time_and_peak(fwd_bwd(wkv7_chunked, xs), 3)["time"]
            lengths.append(
                {"L": L, "fwd": time_and_peak(fwd(wkv7_chunked, xs), 3)["time"], "fb": fb}
            )
    finally:
        chunk.CHUNK = chosen
    return {
        "ref_max_t": REF_MAX_T,
        "crossover": crossover,
        "chunk": chosen,
        "chunk_T": chunk_T,
        "lengths": lengths,
    }


def render_choices(c: dict) -> list[str]:
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
        chosen = " (CHUNK)" if row["L"] == c["chunk"] else ""
        lines.append(
            f"| {row['L']}{chosen} | {row['fwd'] * 1e3:.1f} ms | {row['fb'] * 1e3:.1f} ms |"
        )
    return lines + [""]
