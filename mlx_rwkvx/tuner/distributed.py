"""Data parallelism across Macs over ``mx.distributed`` (``mlx.launch``): the group of ranks,
each rank's share of the examples, the gradient all-sum (one collective per 32 MB bucket) and
rank 0's run state broadcast to every rank. Entry points: ``data_parallel_group``,
``rank_share``, ``all_sum``, ``all_sum_int``, ``broadcast``, ``broadcast_json``,
``all_gather_json``, ``broadcast_state``, ``peers_lost``."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from mlx_rwkvx.errors import TrainError

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

ALL_SUM_BUCKET = 32 << 20  # bytes of gradients summed in one collective (mlx-lm's size)


def all_sum(tree, group):
    """Every array of ``tree`` summed over the ranks of ``group``, in one collective (the
    leaves flattened into one float32 vector and split again)."""
    # in the order of the names: ranks may hold equal trees built in another order (an
    # optimizer state read from a checkpoint, one made fresh)
    leaves = sorted(tree_flatten(tree), key=lambda item: item[0])
    arrays = [mx.array(v) if not isinstance(v, mx.array) else v for _, v in leaves]
    parts, bucket, size = {}, [], 0

    def flush():  # one collective per bucket of at most ALL_SUM_BUCKET bytes (a copy each)
        flat = mx.concatenate([a.astype(mx.float32).reshape(-1) for _, a in bucket])
        summed = mx.distributed.all_sum(flat, group=group)
        start = 0
        for name, a in bucket:
            parts[name] = summed[start : start + a.size].reshape(a.shape).astype(a.dtype)
            start += a.size
        mx.eval([parts[name] for name, _ in bucket])

    for (name, _), a in zip(leaves, arrays, strict=True):
        if bucket and size + 4 * a.size > ALL_SUM_BUCKET:
            flush()
            bucket, size = [], 0
        bucket.append((name, a))
        size += 4 * a.size
    if bucket:
        flush()
    return tree_unflatten([(name, parts[name]) for name, _ in tree_flatten(tree)])


def broadcast(tree, group):
    """``tree`` as rank 0 of ``group`` holds it, on every rank (an all-sum of rank 0's values
    and everybody else's zeros): a resumed run's state reaches the other Macs without files."""
    if group is None or group.size() == 1:
        return tree
    if group.rank() != 0:
        tree = tree_unflatten([(k, mx.zeros_like(v)) for k, v in tree_flatten(tree)])
    return all_sum(tree, group)


def broadcast_json(value, group):
    """``value`` (anything ``json`` writes) as rank 0 of ``group`` holds it, on every rank: its
    length, then its UTF-8 bytes, each an all-sum of rank 0's and everybody else's zeros."""
    if group is None or group.size() == 1:
        return value
    mine = json.dumps(value).encode() if group.rank() == 0 else b""
    size = int(mx.distributed.all_sum(mx.array(len(mine)), group=group).item())
    data = list(mine) if group.rank() == 0 else [0] * size
    summed = mx.distributed.all_sum(mx.array(data, dtype=mx.int32), group=group)
    return json.loads(bytes(summed.tolist()).decode())


def all_sum_int(n: int, group) -> int:
    """``n`` summed over the ranks of ``group``."""
    if group is None or group.size() == 1:
        return n
    return int(mx.distributed.all_sum(mx.array(n), group=group).item())


def all_gather_json(value, group) -> list:
    """``value`` (anything ``json`` writes) of every rank of ``group``, in rank order, on every
    rank: the lengths, then each rank's UTF-8 bytes in its own row, each an all-sum."""
    if group is None or group.size() == 1:
        return [value]
    ranks, rank = group.size(), group.rank()
    mine = json.dumps(value).encode()
    sizes = np.zeros(ranks, np.int32)
    sizes[rank] = len(mine)
    sizes = mx.distributed.all_sum(mx.array(sizes), group=group).tolist()
    rows = np.zeros((ranks, max(sizes)), np.int32)
    rows[rank, : len(mine)] = np.frombuffer(mine, np.uint8)
    rows = mx.distributed.all_sum(mx.array(rows), group=group).tolist()
    return [json.loads(bytes(row[:n]).decode()) for row, n in zip(rows, sizes, strict=True)]


def data_parallel_group():
    """The data-parallel group when launched by ``mlx.launch`` on several ranks, else None."""
    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


def rank_share(examples, group):
    """Rank r's share of the examples: every size-th from r, the remainder of the division
    left out, so that every rank has as many (and so as many batches and steps)."""
    if group is None:
        return examples
    size = group.size()
    keep = len(examples) // size * size
    if keep == 0:
        raise TrainError(
            f"{len(examples)} training examples for {size} ranks: too few for one each"
        )
    if keep < len(examples) and group.rank() == 0:
        print(
            f"note: {len(examples) - keep} of {len(examples)} examples left out: every one of "
            f"the {size} ranks trains as many",
            file=sys.stderr,
        )
    return examples[group.rank() : keep : size]


def broadcast_state(model, optimizer, state, group) -> None:
    """Rank 0's trainable parameters, optimizer state, and ``state``'s (a ``TrainState``)
    step, tokens and data position on every rank."""
    model.update(broadcast(model.trainable_parameters(), group))
    if optimizer.state:
        optimizer.state = broadcast(optimizer.state, group)
    pos = state.position
    counters = [state.step, state.tokens, pos["epoch"], pos["batch"], *state.stack_tokens]
    # integers summed as integers (a float32 sum would round a count above 2^24); tokens as
    # two 31-bit halves, so that no count overflows int32
    ints = [part for c in counters for part in (c >> 31, c & (2**31 - 1))]
    mine = mx.array(ints if group.rank() == 0 else [0] * len(ints), dtype=mx.int32)
    summed = mx.distributed.all_sum(mine, group=group).tolist()
    step, tokens, epoch, batch, *stacks = [
        (hi << 31) + lo for hi, lo in zip(summed[::2], summed[1::2], strict=True)
    ]
    state.step, state.tokens, state.position = step, tokens, {"epoch": epoch, "batch": batch}
    state.stack_tokens = stacks
    mx.eval(model.parameters(), optimizer.state)


PEER_LOST = "connection to a peer was lost"  # MLX's ring backend, when another rank exits


@contextmanager
def peers_lost(group):
    """A rank whose peer stopped (its own error, Ctrl-C, a kill) says so in one line: the
    collective it waited in fails with MLX's RuntimeError, a TrainError here (the peer's own
    message says why; rank 0's checkpoints saved before are kept)."""
    try:
        yield
    except RuntimeError as e:
        if group is None or PEER_LOST not in str(e):
            raise
        raise TrainError(
            f"rank {group.rank()}: another rank stopped, and this one with it (its "
            "own message says why); the checkpoints saved before are kept"
        ) from e
