"""MoBA's contract: the argument checks every entry point runs once."""

from __future__ import annotations

from mlx_rwkvx.ops.common import FLOAT_DTYPES, require_arrays


def check_inputs(q, k, v, chunk_size, top_k) -> None:
    """One ValueError naming the first argument that does not fit (TypeError for one that is
    not an mx.array)."""
    require_arrays("moba_attention", {"q": q, "k": k, "v": v})
    if type(chunk_size) is not int or chunk_size < 1:
        raise ValueError(f"moba_attention: chunk_size must be an int >= 1, got {chunk_size!r}")
    if type(top_k) is not int:
        raise ValueError(f"moba_attention: top_k must be an int, got {top_k!r}")
    if q.ndim != 4 or 0 in q.shape:
        raise ValueError(
            f"moba_attention: q must be [B, T, Hq, D], none of them 0, got shape {tuple(q.shape)}"
        )
    B, T, Hq, D = q.shape
    for name, x in (("k", k), ("v", v)):
        if x.ndim != 4 or x.shape[0] != B or x.shape[1] < T or x.shape[3] != D or not x.shape[2]:
            raise ValueError(
                f"moba_attention: {name} has shape {tuple(x.shape)}, expected "
                f"[{B}, S >= {T}, Hkv >= 1, {D}] (batch and head dim of q, at least its length)"
            )
    if k.shape != v.shape:
        raise ValueError(f"moba_attention: v has shape {tuple(v.shape)}, expected {k.shape}")
    if Hq % k.shape[2]:
        raise ValueError(
            f"moba_attention: q has {Hq} heads, not a multiple of the {k.shape[2]} heads of k, v"
        )
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.dtype not in FLOAT_DTYPES or x.dtype != q.dtype:
            raise ValueError(
                f"moba_attention: {name} has dtype {x.dtype}, expected {q.dtype} "
                f"(one of float32, bfloat16, float16 for all three)"
            )
