"""The head and the cross-entropy together, without the ``[tokens, vocab]`` logits.

``logits = h @ W.T`` is computed a block of the vocabulary at a time: the forward keeps, per
token, a running maximum and sum of exponentials (an online log-sum-exp, float32) and the
target's logit; the hand-written backward recomputes each block's logits from ``h`` and the
saved log-sum-exp instead of keeping them, so memory holds one block of logits at a time
(``[tokens, VOCAB_BLOCK]``), not the whole vocabulary. The head may be quantized
(``mx.quantize``'s ``weight, scales, biases``): it is then frozen, and only ``h`` gets a
gradient.
"""

from __future__ import annotations

import functools

from mlx_rwkvx.ops.common import FLOAT_DTYPES, require_arrays
from mlx_rwkvx.ops.quantized import quantized_matmul

import mlx.core as mx

VOCAB_BLOCK = 4096  # vocabulary entries per block: [tokens, VOCAB_BLOCK] float32 logits at a time


def _after(x: mx.array, done: list[mx.array]) -> mx.array:
    """``x``, to be read only once ``done`` is computed: the next block's logits then wait for
    everything that reads this block's, so one block of logits is alive at a time (MLX would
    otherwise be free to compute them all first)."""
    return mx.depends(x, done)


def _blocks(vocab: int, block: int) -> list[tuple[int, int]]:
    return [(a, min(vocab, a + block)) for a in range(0, vocab, block)]


@functools.cache
def _fused(vocab: int, block: int, quant: tuple[int, int] | None):
    """The fused loss for one vocabulary size, block and quantization ``(group_size, bits)``
    (None: a float head) as a custom function ``(h, targets, counted, weight, scales, biases)
    -> (loss sum, log-sum-exp)``."""

    def logits_of(h32, weight, scales, biases, a, b):
        if quant is None:
            return h32 @ weight[a:b].astype(mx.float32).T  # [N, b - a]
        group, bits = quant
        return quantized_matmul(
            h32, weight[a:b], scales[a:b], biases[a:b], transpose=True, group_size=group, bits=bits
        ).astype(mx.float32)

    @mx.custom_function
    def fused(h, targets, counted, weight, scales, biases):
        h32 = h.astype(mx.float32)
        N = h.shape[0]
        run_max = mx.full((N,), -mx.inf)
        run_sum = mx.zeros((N,))
        target_logit = mx.zeros((N,))
        for a, b in _blocks(vocab, block):
            logits = logits_of(h32, weight, scales, biases, a, b)
            new_max = mx.maximum(run_max, logits.max(axis=-1))
            run_sum = run_sum * mx.exp(run_max - new_max) + mx.exp(logits - new_max[:, None]).sum(
                axis=-1
            )
            run_max = new_max
            inside = (targets >= a) & (targets < b)
            picked = mx.take_along_axis(logits, mx.clip(targets - a, 0, b - a - 1)[:, None], -1)
            target_logit = target_logit + mx.where(inside, picked[:, 0], 0.0)
            h32 = _after(h32, [run_sum, target_logit])
        lse = run_max + mx.log(run_sum)
        loss = mx.where(counted, lse - target_logit, 0.0).sum()
        return loss, lse

    @fused.vjp
    def fused_vjp(primals, cotangents, outputs):
        h, targets, counted, weight, scales, biases = primals
        g = cotangents[0] if cotangents[0] is not None else mx.array(0.0)
        lse = outputs[1]
        h32 = h.astype(mx.float32)
        scale = mx.where(counted, g, 0.0)  # [N]: a token's share of the loss
        rows = mx.arange(h.shape[0])
        dh = mx.zeros(h32.shape)
        d_weight = []
        for a, b in _blocks(vocab, block):
            logits = logits_of(h32, weight, scales, biases, a, b)
            d_logits = mx.exp(logits - lse[:, None]) * scale[:, None]  # softmax, [N, b - a]
            inside = (targets >= a) & (targets < b)
            columns = mx.clip(targets - a, 0, b - a - 1)
            d_logits = d_logits.at[rows, columns].add(mx.where(inside, -scale, 0.0))
            if quant is None:
                dh = dh + d_logits @ weight[a:b].astype(mx.float32)
                d_weight.append(d_logits.T @ h32)  # [b - a, C]
                h32 = _after(h32, [dh, d_weight[-1]])
            else:
                group, bits = quant
                dh = dh + quantized_matmul(
                    d_logits,
                    weight[a:b],
                    scales[a:b],
                    biases[a:b],
                    transpose=False,
                    group_size=group,
                    bits=bits,
                )
                h32 = _after(h32, [dh])
        if quant is None:
            d_w = mx.concatenate(d_weight, axis=0).astype(weight.dtype)
        else:
            d_w = mx.zeros_like(weight)  # a quantized head is frozen
        return (
            dh.astype(h.dtype),
            mx.zeros_like(targets),
            mx.zeros_like(counted),
            d_w,
            mx.zeros_like(scales),
            mx.zeros_like(biases),
        )

    return fused


def cross_entropy_head(
    h: mx.array,
    weight: mx.array,
    targets: mx.array,
    *,
    ignore_index: int = -100,
    scales: mx.array | None = None,
    biases: mx.array | None = None,
    group_size: int = 64,
    bits: int | None = None,
    block: int = VOCAB_BLOCK,
) -> tuple[mx.array, mx.array]:
    """``(sum of -log softmax(h @ W.T)[target], number of counted tokens)`` over the tokens
    whose target is not ``ignore_index``, without forming the logits of the whole vocabulary.

    h ``[..., C]`` (any float dtype; accumulation is float32), targets ``[...]`` integers,
    weight ``[V, C]`` (a float head; its gradient comes back in its dtype) or, with ``bits``,
    the quantized head ``weight, scales, biases`` of ``mx.quantize`` (frozen: no gradient).
    Divide by the count for the mean (the count of every rank, for data parallelism). The loss
    is differentiable w.r.t. h and a float weight; the VJP recomputes each block's logits.
    """
    require_arrays("cross_entropy_head", {"h": h, "weight": weight, "targets": targets})
    if h.dtype not in FLOAT_DTYPES:
        raise ValueError(f"cross_entropy_head: h has dtype {h.dtype}, expected a float dtype")
    if tuple(targets.shape) != tuple(h.shape[:-1]) or not mx.issubdtype(targets.dtype, mx.integer):
        raise ValueError(
            f"cross_entropy_head: targets must be integers of shape {tuple(h.shape[:-1])} (that "
            f"of h without its last axis), got {targets.dtype} {tuple(targets.shape)}"
        )
    C = h.shape[-1]
    if bits is None:
        if weight.ndim != 2 or weight.shape[1] != C:
            raise ValueError(
                f"cross_entropy_head: weight has shape {tuple(weight.shape)}, expected [V, {C}]"
            )
        quant = None
        scales = biases = mx.zeros((1,))
    else:
        if scales is None or biases is None:
            raise ValueError("cross_entropy_head: a quantized head needs its scales and biases")
        quant = (group_size, bits)
    if type(block) is not int or block < 1:
        raise ValueError(f"cross_entropy_head: block must be an int >= 1, got {block!r}")
    vocab = weight.shape[0]
    flat_h = h.reshape(-1, C)
    flat_t = targets.reshape(-1).astype(mx.int32)
    counted = flat_t != ignore_index
    loss, _ = _fused(vocab, block, quant)(flat_h, flat_t, counted, weight, scales, biases)
    return loss, counted.sum()
