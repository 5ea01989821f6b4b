"""Training losses over the models' explicit state: the summed token cross-entropy of a batch
(through the fused head + loss, ``ops.cross_entropy_head``: no ``[tokens, vocab]`` logits), the
cutting of a long batch into segments for ``--carry-state``, and ``dataset_loss``, the one
definition of the loss on a data set (the trainer's validation and test, and ``evaluate``)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from mlx_rwkvx._crash import crash_point
from mlx_rwkvx.data.batches import PAD_MULTIPLE, batches
from mlx_rwkvx.data.examples import IGNORE_INDEX
from mlx_rwkvx.models import Model
from mlx_rwkvx.ops import cross_entropy_head

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def head_arrays(model: Model) -> dict:
    """The head's arrays for ``cross_entropy_head``: the tied embedding or the head layer,
    float or quantized."""
    layer = model.embed if model.config.tie_embeddings else model.lm_head
    if isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
        return dict(
            weight=layer.weight,
            scales=layer.scales,
            biases=layer.biases,
            group_size=layer.group_size,
            bits=layer.bits,
        )
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


@dataclass
class LossSum:
    """The summed token loss of a data set (nats), the tokens it is over and the UTF-8 bytes
    those tokens spell (0 unless byte lengths were given); ``stopped``: the Ctrl-C or SIGTERM
    that ended it early (None: every batch asked for was evaluated), for the caller to raise
    again once it has used the sum so far."""

    loss: float = 0.0
    tokens: int = 0
    bytes: int = 0
    batches: int = 0
    stopped: KeyboardInterrupt | None = None

    @property
    def complete(self) -> bool:
        return self.stopped is None

    @property
    def mean(self) -> float:
        return self.loss / max(self.tokens, 1)

    @property
    def perplexity(self) -> float:
        return math.exp(self.mean) if self.mean < 700 else math.inf

    @property
    def bits_per_byte(self) -> float:
        return self.loss / math.log(2) / self.bytes if self.bytes else math.nan


def dataset_loss(
    model: Model,
    examples,
    batch_size: int,
    max_batches: int | None = None,
    segment: int | None = None,
    max_cache: int | None = None,
    *,
    byte_lengths: np.ndarray | None = None,
    on_batch: Callable[[LossSum, int], None] | None = None,
) -> LossSum:
    """The summed token loss over ``examples`` (the first ``max_batches`` batches, in a fixed
    order) with dropout off. ``segment``: long texts a segment of that many tokens at a time,
    the state carried (its KV caches cut to ``max_cache`` tokens), as --carry-state trains.
    ``byte_lengths[id]``: the UTF-8 bytes each token spells (for bits per byte).
    ``on_batch(sum so far, tokens of the batch)`` after each batch. Ctrl-C (or SIGTERM) returns
    the sum so far with the interruption in ``stopped``."""
    result = LossSum()
    was_training = model.training
    model.eval()
    try:
        stream = batches(
            examples, batch_size=batch_size, seed=0, epoch=0, pad_to_multiple=PAD_MULTIPLE
        )
        for i, (inputs, targets) in enumerate(stream):
            if max_batches is not None and i >= max_batches:
                break
            state, done = None, result.tokens
            for x, y in segments(mx.array(inputs), mx.array(targets), segment):
                if state is not None and max_cache is not None:
                    state = model.trim_state(state, max_cache)
                loss, n, state = segment_loss(model, x, y, state)
                mx.eval(loss, n, state)
                result.loss, result.tokens = result.loss + loss.item(), result.tokens + n.item()
            if byte_lengths is not None:
                result.bytes += int(byte_lengths[targets[targets != IGNORE_INDEX]].sum())
            result.batches += 1
            crash_point("eval", result.batches)
            if on_batch is not None:
                on_batch(result, result.tokens - done)
    except KeyboardInterrupt as e:
        result.stopped = e
    finally:
        model.train(was_training)
    return result
