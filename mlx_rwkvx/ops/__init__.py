"""Pure differentiable functions, one package per op: ``wkv7`` (the RWKV-7 recurrence) and
``moba`` (MoBA sparse attention), each with its contract, reference, fast path, kernel wrapper
and dispatcher; ``dispatch.prepare()`` runs the kernels' self-checks up front; ``loss``: the
head and cross-entropy fused. The kernel sources live in ``mlx_rwkvx.metal`` (importable
without MLX)."""

from mlx_rwkvx.ops.dispatch import configure_and_prepare, prepare
from mlx_rwkvx.ops.loss import cross_entropy_head
from mlx_rwkvx.ops.moba import (
    append_kv,
    empty_kv,
    moba_attention,
    moba_attention_blockwise,
    moba_attention_ref,
    moba_decode,
    moba_kernel,
)
from mlx_rwkvx.ops.wkv7 import (
    wkv7,
    wkv7_chunked,
    wkv7_chunked_kernel,
    wkv7_kernel,
    wkv7_ref,
    wkv7_step,
)

__all__ = [
    "append_kv",
    "cross_entropy_head",
    "empty_kv",
    "moba_attention",
    "moba_attention_blockwise",
    "moba_attention_ref",
    "moba_decode",
    "moba_kernel",
    "configure_and_prepare",
    "prepare",
    "wkv7",
    "wkv7_chunked",
    "wkv7_chunked_kernel",
    "wkv7_kernel",
    "wkv7_ref",
    "wkv7_step",
]
