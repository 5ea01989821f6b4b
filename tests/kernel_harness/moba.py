"""MoBA kernels outside MLX: slots and their inverse index in NumPy, launches through a
flavour-agnostic callback (see kernel_harness.common), and the comparison with the float64 oracle.
Never imports mlx (tests/gpu/ runs it without MLX)."""

from __future__ import annotations

from kernel_harness import sources as standalone
from kernel_harness.common import TOL, check_errors, entry_arrays, from_storage, host, to_storage
from mlx_rwkvx.metal import sources

import numpy as np
from oracle.attention import (
    causal_mask,
    moba_attention_bwd_np,
    moba_attention_fwd_np,
    moba_chunk_selection_np,
    sum_kv_groups,
)
from oracle.common import rel_err

FWD = sources.entry("moba_fwd.h")
DQ = sources.entry("moba_bwd_dq.h")
DKV = sources.entry("moba_bwd_dkv.h")
ENTRIES = (FWD, DQ, DKV)
OUTPUTS = ("out", "lse")
GRADS = ("dq", "dk", "dv")


def slots_np(q, k, chunk_size: int, top_k: int, rng=None) -> tuple[np.ndarray, np.ndarray]:
    """The oracle's selection as slots: (chunk, limit) ``[B, T, Hq, S]`` int32, slot 0 the own
    chunk (limit t % cs), then the chosen earlier chunks (limit cs - 1), then empty slots (-1).
    With ``rng``, the slots after the first of each row are shuffled (empties included)."""
    B, T, Hq, _ = q.shape
    chosen = moba_chunk_selection_np(q, k, chunk_size=chunk_size, top_k=top_k)
    n = chosen.shape[-1]
    t = np.arange(T)
    own = t // chunk_size
    earlier = chosen & (np.arange(n) < own[:, None])  # [B, Hq, T, n]
    extra = int(earlier.sum(-1).max()) if T else 0
    picked = np.sort(np.where(earlier, np.arange(n), n), axis=-1)[..., :extra]
    valid = picked < n
    chunk = np.concatenate(
        [np.broadcast_to(own[:, None], (B, Hq, T, 1)), np.where(valid, picked, 0)], axis=-1
    )
    limit = np.concatenate(
        [
            np.broadcast_to((t % chunk_size)[:, None], (B, Hq, T, 1)),
            np.where(valid, chunk_size - 1, -1),
        ],
        axis=-1,
    )
    if rng is not None and extra > 1:
        order = np.argsort(rng.random(picked.shape), axis=-1) + 1
        order = np.concatenate([np.zeros((B, Hq, T, 1), dtype=order.dtype), order], axis=-1)
        chunk = np.take_along_axis(chunk, order, -1)
        limit = np.take_along_axis(limit, order, -1)
    as_rows = (0, 2, 1, 3)  # [B, Hq, T, S] -> [B, T, Hq, S]
    return (
        np.ascontiguousarray(chunk.transpose(as_rows), dtype=np.int32),
        np.ascontiguousarray(limit.transpose(as_rows), dtype=np.int32),
    )


def mask_np(chunk: np.ndarray, limit: np.ndarray, chunk_size: int, n_keys: int) -> np.ndarray:
    """The keys the slots let each query see, as the oracle's ``[B, Hq, T, n_keys]`` mask."""
    keys = np.arange(n_keys)
    sees = (chunk[..., None] == keys // chunk_size) & (keys % chunk_size <= limit[..., None])
    return sees.any(axis=3).transpose(0, 2, 1, 3)


def pair_index_np(chunk, limit, n_kv_heads: int, chunk_size: int, n_keys: int):
    """The inverse index of moba_bwd_dkv.h: (pairs ``[R * S]``, offsets ``[M + 1]``) int32."""
    B, T, Hq, _ = chunk.shape
    n_chunks = -(-n_keys // chunk_size)
    n_mats = B * n_kv_heads * n_chunks
    kv_head = np.arange(Hq) // (Hq // n_kv_heads)
    mats = (np.arange(B)[:, None, None, None] * n_kv_heads + kv_head[:, None]) * n_chunks + chunk
    mats = np.where(limit >= 0, mats, n_mats).reshape(-1)  # empty slots sort last
    pairs = np.argsort(mats, kind="stable").astype(np.int32)
    counts = np.bincount(mats, minlength=n_mats + 1)
    offsets = np.concatenate([[0], np.cumsum(counts[:n_mats])]).astype(np.int32)
    return pairs, offsets


def plan(x: dict, chunk_size: int, scale: float, dtype: str, xp=np):
    """The three launches on float64 ``x`` (q, k, v, chunk, limit, dout, dlse), every buffer
    allocated: ``([(name, groups, threads, arrays)], outputs by name)``. Outputs that later
    kernels read (out, lse, delta) are passed on as the same buffers."""
    B, T, Hq, N = x["q"].shape
    _, Tk, Hkv, _ = x["k"].shape
    S = x["chunk"].shape[-1]
    R = B * T * Hq
    groups_dkv = B * Hkv * -(-Tk // chunk_size) * -(-chunk_size // N)
    consts = {"dims": np.array([T, Tk, Hq, Hkv, S, chunk_size]), "scale": np.array([scale])}
    pairs, offsets = pair_index_np(x["chunk"], x["limit"], Hkv, chunk_size, Tk)
    values = {**x, **consts, "pairs": pairs, "offsets": offsets}
    launches, made = [], {}
    for e, groups, shapes in (
        (FWD, R, {"out": x["q"].shape, "lse": (R,)}),
        (DQ, R, {"dq": x["q"].shape, "delta": (R,)}),
        (DKV, groups_dkv, {"dk": x["k"].shape, "dv": x["k"].shape}),
    ):
        arrays = entry_arrays(e, dtype, values, shapes, xp, ready=made)
        made |= dict(zip(e.output_names, arrays[len(e.inputs) :], strict=True))
        launches.append((standalone.instance_name(e, dtype, N), groups, N, arrays))
    return launches, made


def run(launch, x: dict, chunk_size: int, scale: float, dtype: str, xp=np) -> dict:
    """The three kernels on float64 ``x`` (see ``plan``). Returns float64 numpy arrays: out,
    lse, delta, dq, dk, dv."""
    launches, made = plan(x, chunk_size, scale, dtype, xp)
    for name, groups, threads, arrays in launches:
        launch(name, groups, threads, arrays)
    result = {}
    for e in ENTRIES:
        for name, ptype in e.outputs:
            raw = host(made[name])
            result[name] = from_storage(raw, dtype) if ptype == "InT" else raw.astype(np.float64)
    return result


def reference(x: dict, chunk_size: int, scale: float) -> dict:
    """The float64 oracle on the same slots: out, lse, dq, dk, dv (lse's cotangent dlse
    included: d lse / d score = p)."""
    q, k, v = x["q"], x["k"], x["v"]
    B, T, Hq, _ = q.shape
    Tk = k.shape[1]
    mask = mask_np(x["chunk"], x["limit"], chunk_size, Tk)
    out, cache = moba_attention_fwd_np(
        q, k, v, chunk_size=chunk_size, top_k=0, scale=scale, selection=mask
    )
    dq, dk, dv = moba_attention_bwd_np(cache, x["dout"])
    scores = scale * np.einsum("bthd,bshd->bhts", q, cache["k_rep"])
    allowed = mask & causal_mask(T, Tk)
    top = np.max(np.where(allowed, scores, -np.inf), axis=-1)  # [B, Hq, T]
    lse = top + np.log(np.sum(np.where(allowed, np.exp(scores - top[..., None]), 0.0), -1))
    dlse = x["dlse"].reshape(B, T, Hq).transpose(0, 2, 1)
    ds = cache["probs"] * dlse[..., None]
    dq = dq + scale * np.einsum("bhts,bshd->bthd", ds, cache["k_rep"])
    dk = dk + sum_kv_groups(scale * np.einsum("bhts,bthd->bshd", ds, q), k.shape[2])
    return {"out": out, "lse": lse.transpose(0, 2, 1).reshape(-1), "dq": dq, "dk": dk, "dv": dv}


def random_inputs(
    rng, B, T, Hq, Hkv, D, chunk_size, top_k, *, prefix=0, shuffle=False, with_dlse=True
):
    """Seeded q, k, v ``~ N(0, 1)`` and cotangents, with the oracle's selection as slots. With
    ``prefix`` > 0 the keys are ``prefix + T`` long and the queries are the last T (the
    selection of all ``prefix + T`` queries, restricted to those)."""
    Tk = prefix + T
    x = {
        "q": rng.standard_normal((B, Tk, Hq, D)),
        "k": rng.standard_normal((B, Tk, Hkv, D)),
        "v": rng.standard_normal((B, Tk, Hkv, D)),
        "dout": rng.standard_normal((B, T, Hq, D)),
        "dlse": rng.standard_normal(B * T * Hq) if with_dlse else np.zeros(B * T * Hq),
    }
    chunk, limit = slots_np(x["q"], x["k"], chunk_size, top_k, rng=rng if shuffle else None)
    for name, full in (("q", x["q"]), ("chunk", chunk), ("limit", limit)):
        x[name] = np.ascontiguousarray(full[:, prefix:])
    return x


def rounded(x: dict, dtype: str) -> dict:
    """The inputs as the kernels see them: q, k, v, dout in ``dtype``, dlse float32."""
    out = dict(x)
    for name in ("q", "k", "v", "dout"):
        out[name] = from_storage(to_storage(x[name], dtype), dtype)
    out["dlse"] = from_storage(to_storage(x["dlse"], "float32"), "float32")
    return out


def compare(launch, x: dict, chunk_size: int, dtype: str, scale=None, xp=np) -> dict[str, float]:
    """Run the kernels and the oracle (on the rounded inputs); return the norm-wise relative
    error per named tensor, and assert each is within DESIGN.md's bounds."""
    B, T, Hq, D = x["q"].shape
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    scale = float(np.float32(scale))  # what the kernel receives
    x = rounded(x, dtype)
    got = run(launch, x, chunk_size, scale, dtype, xp)
    ref = reference(x, chunk_size, scale)
    errors = {name: rel_err(got[name], ref[name]) for name in (*OUTPUTS, *GRADS)}
    _, Tk, Hkv, _ = x["k"].shape
    shape = f"B={B} T={T} Tk={Tk} Hq={Hq} Hkv={Hkv} D={D} cs={chunk_size}"
    check_errors(f"MoBA kernel ({dtype}, {shape})", TOL[dtype], errors, OUTPUTS, got, GRADS)
    return errors
