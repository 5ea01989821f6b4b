"""Batches of examples: length-bucketed, shuffled by (seed, epoch), padded so that compiled
steps see few shapes, resumable from any batch; and contiguous parts of a data set for
training on several machines. Entry points: ``batches``, ``count_batches``, ``split_parts``."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from mlx_rwkvx.data.examples import IGNORE_INDEX, Example

import numpy as np

BUCKET_BATCHES = 64  # a batch is drawn from a length-sorted window of this many batches' examples


# a batch's length is rounded up to a multiple of this (padding the loss skips): fewer distinct
# shapes, so the compiled step is traced a few times rather than once per length
PAD_MULTIPLE = 32


def _check_batching(batch_size: int, **nonnegative: int) -> None:
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    for name, value in nonnegative.items():
        if not isinstance(value, (int, np.integer)) or value < 0:
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


def count_batches(examples: Sequence[Example], batch_size: int) -> int:
    """How many batches ``batches`` yields for one epoch: every example once, the last batch
    possibly smaller."""
    _check_batching(batch_size)
    return -(-len(examples) // batch_size)


def batch_order(lengths: np.ndarray, batch_size: int, seed: int, epoch: int) -> list[np.ndarray]:
    """The example indices of each batch of one epoch. The examples are shuffled by (seed,
    epoch); each window of ``BUCKET_BATCHES * batch_size`` of them is sorted by length (ties
    in shuffled order) and cut into batches, and the batches are shuffled: batches of similar
    lengths whose make-up and order change from epoch to epoch."""
    _check_batching(batch_size, seed=seed, epoch=epoch)
    rng = np.random.default_rng([seed, epoch])
    # argsort of uniform draws rather than rng.permutation: the order rests on PCG64's stream
    # and its plainest draw, not on a shuffling algorithm a NumPy release may change
    order = np.argsort(rng.random(len(lengths)), kind="stable")
    window = batch_size * BUCKET_BATCHES
    groups = []
    for w in range(0, len(order), window):
        chunk = order[w : w + window]
        chunk = chunk[np.argsort(lengths[chunk], kind="stable")]
        groups += [chunk[i : i + batch_size] for i in range(0, len(chunk), batch_size)]
    return [groups[i] for i in np.argsort(rng.random(len(groups)), kind="stable")]


def batches(
    examples: Sequence[Example],
    *,
    batch_size: int,
    seed: int,
    epoch: int,
    start: int = 0,
    pad_to_multiple: int = 1,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Yield ``(inputs, targets)``, both int32 [B, T], for one epoch (``batch_order``): row b
    holds an example's tokens but its last as inputs and the next token of each as targets
    where it is trained, ``IGNORE_INDEX`` elsewhere (prompts, padding; inputs pad with 0).
    T is the batch's longest example less one, rounded up to ``pad_to_multiple`` (fewer
    distinct shapes for compiled steps). ``start`` skips that many batches (resuming): the same
    arguments always give the same batches."""
    _check_batching(batch_size, start=start, pad_to_multiple=pad_to_multiple)
    if pad_to_multiple < 1:
        raise ValueError("pad_to_multiple must be >= 1")
    lengths = np.array([len(e.tokens) for e in examples])
    for idx in batch_order(lengths, batch_size, seed, epoch)[start:]:
        longest = int(lengths[idx].max()) - 1
        T = -(-longest // pad_to_multiple) * pad_to_multiple
        inputs = np.zeros((len(idx), T), dtype=np.int32)
        targets = np.full((len(idx), T), IGNORE_INDEX, dtype=np.int32)
        for row, i in enumerate(idx):
            e = examples[i]
            n = len(e.tokens) - 1
            inputs[row, :n] = e.tokens[:-1]
            targets[row, :n] = np.where(e.trained[1:], e.tokens[1:], IGNORE_INDEX)
        yield inputs, targets


def split_parts(examples: Sequence[Example], weights: Sequence[float]) -> list[list[Example]]:
    """Contiguous shares of ``examples`` in proportion to ``weights`` (``[3, 1]``: the first
    three quarters, then the rest), for training on several machines. Raises ValueError for a
    weight that is not positive, or when a part would be empty."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ValueError(f"split weights must be positive numbers, got {list(weights)}")
    n = len(examples)
    bounds = [0, *(int(np.floor(c * n + 0.5)) for c in np.cumsum(w)[:-1] / w.sum()), n]
    parts = [list(examples[a:b]) for a, b in zip(bounds, bounds[1:], strict=False)]
    empty = [i for i, s in enumerate(parts) if not s]
    if empty:
        raise ValueError(
            f"cannot split {n} examples into {len(w)} parts by weights {list(weights)}: "
            f"part {empty[0]} would be empty"
        )
    return parts
