"""MoBA sparse attention: per query and head, its own chunk plus the top-k earlier chunks
(fla's layout: one package per op).

Per query t (chunk c_t = t // chunk_size) and query head h: keys s <= t of chunk c_t are always
attended; each earlier chunk c < c_t gets the gate <q_t, mean of chunk c's keys>, and the top_k
highest (ties: the lower chunk index) are attended too. ``top_k <= 0`` or ``top_k >=`` the number
of earlier chunks means full causal attention. The selection is held fixed in the backward.

Layouts: q ``[B, T, Hq, D]``, k and v ``[B, S, Hkv, D]`` with Hq a multiple of Hkv (GQA: query
head h reads kv head h // (Hq // Hkv)). Scores, softmax and accumulation are float32.

- ``contract.py``: the argument checks, run once per call;
- ``selection.py``: the chunk selection and the (query, chunk) slots;
- ``naive.py``: ``moba_attention_ref``, dense attention with the mask built explicitly;
- ``blockwise.py``: ``moba_attention_blockwise``, the fast MLX path;
- ``kernel.py``: ``moba_kernel``, Metal/CUDA kernels (bodies in ``mlx_rwkvx/metal/``);
- ``decode.py``: a KV cache as plain arrays and one-token ``moba_decode``;
- here: ``moba_attention``, the dispatcher.
"""

from __future__ import annotations

import functools

from mlx_rwkvx.ops import tuning
from mlx_rwkvx.ops.dispatch import KERNEL, Dispatcher
from mlx_rwkvx.ops.moba import blockwise, kernel, naive
from mlx_rwkvx.ops.moba.blockwise import moba_attention_blockwise
from mlx_rwkvx.ops.moba.contract import check_inputs
from mlx_rwkvx.ops.moba.decode import append_kv, empty_kv, moba_decode, time_major
from mlx_rwkvx.ops.moba.kernel import moba_kernel
from mlx_rwkvx.ops.moba.naive import moba_attention_ref
from mlx_rwkvx.ops.moba.selection import moba_selection, selection_mask

import mlx.core as mx

__all__ = [
    "append_kv",
    "empty_kv",
    "moba_attention",
    "moba_attention_blockwise",
    "moba_attention_ref",
    "moba_decode",
    "moba_kernel",
    "moba_selection",
    "selection_mask",
    "time_major",
]

ENV_VAR = "MLX_RWKVX_MOBA"
# Dense attention is measured against the blockwise path up to this many keys (its memory is
# O(T S))
REF_TUNE_MAX_S = 1024


def _self_check(key, impl) -> dict:
    """``impl``'s output and gradients on the problem of ``key = (D, dtype)`` (lazy)."""
    D, dtype = key
    keys = mx.random.split(mx.random.key(0), 3)
    q = mx.random.normal((1, 50, 4, D), key=keys[0]).astype(dtype)
    k, v = (mx.random.normal((1, 50, 2, D), key=key).astype(dtype) for key in keys[1:])
    f = functools.partial(impl, chunk_size=8, top_k=2)
    grads = mx.grad(lambda *a: f(*a).astype(mx.float32).sum(), argnums=(0, 1, 2))(q, k, v)
    return dict(zip(["out", "dq", "dk", "dv"], [f(q, k, v), *grads], strict=True))


def timing_inputs(B: int, T: int, Hq: int, S: int, Hkv: int, D: int, dtype=mx.float32) -> list:
    """Synthetic ``(q, k, v)`` of a call's shape (T queries, S keys): what the tuner and ``info
    --bench`` time the implementations on."""
    keys = mx.random.split(mx.random.key(1), 3)
    q = mx.random.normal((B, T, Hq, D), key=keys[0]).astype(dtype)
    k, v = (mx.random.normal((B, S, Hkv, D), key=key).astype(dtype) for key in keys[1:])
    return [q, k, v]


def _workload(key, shape) -> tuning.Workload:
    """A training step's call (forward and backward) for the tuner, at the call's batch,
    heads, chunk size and top_k and the top of its length buckets."""
    (D, dtype), (B, T, Hq, S, Hkv, chunk_size, top_k) = key, shape
    T, S = tuning.length_bucket(T), tuning.length_bucket(S)

    def make(fn):
        qkv = timing_inputs(B, T, Hq, S, Hkv, D, dtype)
        return tuning.forward_backward(lambda *a: fn(*a, chunk_size, top_k, None), qkv)

    names = ("ref", "blockwise") if S <= REF_TUNE_MAX_S else ("blockwise",)
    where = (f"chunk={chunk_size}", f"top_k={top_k}", f"T<={T}", f"S<={S}")
    return tuning.Workload((f"D={D}", tuning.dtype_name(dtype), *where), names, make)


DISPATCH = Dispatcher(
    "moba",
    {"ref": naive.dense, "blockwise": blockwise.attention, KERNEL: kernel.attention},
    env_var=ENV_VAR,
    fallback="blockwise",
    kernel_names=(KERNEL,),
    kernels=lambda key=None: (KERNEL,) if kernel.available(key) else (),
    self_check=_self_check,
    workload=_workload,
)


def moba_attention(q, k, v, *, chunk_size: int, top_k: int, scale=None, impl: str | None = None):
    """MoBA sparse causal attention (see the module docstring for the selection rule).

    q ``[B, T, Hq, D]``, k and v ``[B, S, Hkv, D]`` (S >= T: the queries are the last T of S
    positions; Hq a multiple of Hkv), float32, bfloat16 or float16; scale defaults to
    1/sqrt(D). Softmax and accumulation in float32; returns ``[B, T, Hq, D]`` in q's dtype.
    Gradients w.r.t. q, k, v are exact for the selection, which is held fixed.

    ``impl`` (``"ref"``, ``"blockwise"``, ``"kernel"``), else ``MLX_RWKVX_MOBA``, picks the
    implementation; by default the fastest of those available, measured on this device once per
    head dim, dtype, chunk size, top_k and length bucket (``ops/tuning.py``); with
    ``MLX_RWKVX_TUNE=0`` the kernel where the device has one for this head dim and it passed its
    self-check, else the blockwise path. A kernel competes only when it passed its self-check
    (one that raises, returns non-finite values or disagrees falls back, with one warning); a
    kernel forced by ``impl`` or the variable is not checked: its failure is raised.
    """
    check_inputs(q, k, v, chunk_size, top_k)
    shape = (*q.shape[:3], *k.shape[1:3], chunk_size, top_k)
    name = DISPATCH.pick(impl, (q.shape[-1], q.dtype), q, "blockwise", shape=shape)
    return DISPATCH.impls[name](q, k, v, chunk_size, top_k, scale)
