"""Training losses over the models' explicit state: the summed token cross-entropy of a batch
(through the fused head + loss, ``ops.cross_entropy_head``: no ``[tokens, vocab]`` logits) and
the cutting of a long batch into segments for ``--carry-state``."""

from __future__ import annotations

from mlx_rwkvx.models import Model
from mlx_rwkvx.ops import cross_entropy_head
from mlx_rwkvx.tuner.data import IGNORE_INDEX

import mlx.core as mx
import mlx.nn as nn


def head_arrays(model: Model) -> dict:
    """The head's arrays for ``cross_entropy_head``: the tied embedding or the head layer,
    float or quantized."""
    layer = model.embed if model.config.tie_embeddings else model.lm_head
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return dict(weight=layer.weight, scales=layer.scales, biases=layer.biases,
                    group_size=layer.group_size, bits=layer.bits)  # fmt: skip
    return dict(weight=layer.weight)


def token_loss(model: Model, h: mx.array, targets: mx.array):
    """(sum of the token losses, number of trained tokens) of hidden states ``h``."""
    return cross_entropy_head(h, targets=targets, ignore_index=IGNORE_INDEX, **head_arrays(model))


def batch_loss(model: Model, inputs: mx.array, targets: mx.array, checkpoint: bool = False):
    """(sum of the token losses, number of trained tokens) of one batch."""
    loss, count, _ = segment_loss(model, inputs, targets, None, checkpoint)
    return loss, count


def segment_loss(model: Model, inputs, targets, state=None, checkpoint: bool = False):
    """(sum of the token losses, number of trained tokens, the state after) of one batch that
    continues from ``state`` (None: the start of its texts)."""
    h, state = model.hidden(inputs, state, checkpoint=checkpoint)
    loss, count = token_loss(model, h, targets)
    return loss, count, state


def segments(inputs, targets, length: int | None):
    """A batch's columns cut into consecutive segments of ``length`` (None: the batch whole).
    A batch longer than one segment is padded to a whole number of them (padding the loss
    skips), so every segment has the same shape: the compiled step sees one segment length."""
    B, T = inputs.shape
    if length is None or T <= length:
        return [(inputs, targets)]
    pad = -T % length
    if pad:
        inputs = mx.concatenate([inputs, mx.zeros((B, pad), dtype=inputs.dtype)], axis=1)
        ignored = mx.full((B, pad), IGNORE_INDEX, dtype=targets.dtype)
        targets = mx.concatenate([targets, ignored], axis=1)
    return [(inputs[:, a : a + length], targets[:, a : a + length]) for a in range(0, T, length)]
