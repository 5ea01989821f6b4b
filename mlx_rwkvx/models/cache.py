"""mlx-lm's view of a model's explicit state: ``Model.make_cache()`` gives one ``RowsCache`` per
block, an ``ArraysCache`` of mlx-lm holding that block's state arrays in a fixed order
(``STATE_ORDER``; an RWKV-7 block's is that of mlx-lm's rwkv7 model). So mlx-lm's generation
utilities (``generate_step``, ``stream_generate``, ``BatchGenerator``) drive our models, and its
prompt-cache files (``save_prompt_cache``, ``load_prompt_cache``) keep our caches with nothing
registered in its modules: a ``RowsCache`` is saved under mlx-lm's own class name, and a file
loads, with mlx-lm alone, as a plain ``ArraysCache`` the models read as they always did.

Batches (mlx-lm's ``BatchGenerator``): ``RowsCache`` adds what rows of different histories need
to its base's batching methods (``merge``, ``filter``, ``extend``, ``extract``, ``prepare``,
``finalize``, ``make_mask``, ``advance``). An attention block's rows each keep their own number
of tokens: the KV arrays are right-padded to the longest row and ``kv_lengths`` says how much of
each is real (None: every row is as long as the arrays). A forward whose rows are padded
(``prepare(lengths=...)`` or left padding) gets a mask of the real positions: RWKV blocks leave
their state unchanged at the others, attention blocks run each row on its own tokens against its
own cache (``Model._hidden``), so a row in a batch is the computation of that row alone.

Entry points: ``make_caches``, ``read_caches`` (the state a forward starts from, and its rows),
``write_caches`` (the state after it). The models themselves only see the state
(``Model.hidden``), and so does the rest of the package: the explicit state is what a
``Session``, a ``Chat``, the prefix cache and a saved-state file (``io/states.py``) hold, an
immutable pytree whose reference is a free snapshot. A ``RowsCache`` is the state only where
mlx-lm's ``BatchGenerator`` holds it (the server's batches), filled and read back at that
boundary; mlx-lm's ``generate_step`` steps a ``Session`` through a model callable of its own
(``generation/stream.py``: the KV window trimmed after every token, and the state one token
behind what ``generate_step`` fed, as the session holds it). mlx-lm is imported only when a
cache is made or read: its package imports transformers, and with it torch where that is
installed (seconds per process).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

# Each block kind's state arrays, in their place in the block's ArraysCache; a block keeps those
# it has (an ARWKV block of RFA has no channel-mix token shift).
STATE_ORDER = {
    "rwkv7": ("tmix_shift", "wkv", "ffn_shift"),  # mlx-lm's rwkv7: token shift, WKV, ffn shift
    "moba": ("keys", "values", "key_sums", "ffn_shift"),
    "qwen2": ("keys", "values"),
}
# The arrays whose axis 2 is time (a row of them has the row's own length), and how many entries
# of it n tokens fill: keys and values one per token, MoBA's key sums one per started chunk.
TIME_ARRAYS = ("keys", "values", "key_sums")


@dataclass
class Rows:
    """What a batched forward needs beyond the state: ``valid [B, T]`` (None: every position is
    a token of its row) and each row's span of real positions in this call."""

    valid: mx.array | None
    spans: list[tuple[int, int]]


@functools.cache
def _classes() -> tuple[type, type]:
    from mlx_rwkvx._mlx_lm import ArraysCache

    class RowsCache(ArraysCache):
        """An ``ArraysCache`` whose rows may hold different numbers of tokens (see the module
        docstring). ``kind``: the block kind whose state it holds; ``chunk_size``: MoBA's."""

        chunk_size: int | None = None

        def __init__(self, size: int, kind: str, left_padding=None):
            super().__init__(size, left_padding)
            self.kind = kind
            self.kv_lengths: list[int] | None = None
            self.padded_left = False  # left padding beyond zeros: known without a read back

        # ----- the rows -----
        def row_length(self, i: int) -> int:
            """The tokens row ``i`` holds in an attention block (0 for an RWKV block)."""
            if self.kind == "rwkv7" or self.cache[0] is None:
                return 0
            return self.cache[0].shape[2] if self.kv_lengths is None else self.kv_lengths[i]

        def _row(self, i: int) -> list:
            named = dict(zip(STATE_ORDER[self.kind], self.cache, strict=False))
            n = None if self.kv_lengths is None else self.kv_lengths[i]
            return list(row_of(named, i, n, self.chunk_size).values())

        def _like(self, kind: str | None = None) -> RowsCache:
            new = RowsCache(len(self.cache), kind or self.kind)
            new.chunk_size = self.chunk_size
            return new

        def _set_rows(self, rows: list[list], lengths: list[int]) -> None:
            """The cache of ``rows`` (each a list of ``[1, ...]`` arrays) stacked, the time
            arrays right-padded to the longest row."""
            self.cache = [stack_padded([r[e] for r in rows]) for e in range(len(rows[0]))]
            ragged = self.kind != "rwkv7" and len(set(lengths)) > 1
            if ragged and self.kind == "moba" and self.chunk_size is None:
                raise ValueError(
                    "RowsCache: MoBA rows of different lengths need the chunk size (merge "
                    "caches made by model.make_cache())"
                )
            self.kv_lengths = list(lengths) if ragged else None

        def _rows(self) -> tuple[list[list], list[int]]:
            n = self.batch_size
            return [self._row(i) for i in range(n)], [self.row_length(i) for i in range(n)]

        # ----- mlx-lm's batching methods -----
        def filter(self, batch_indices):
            if isinstance(batch_indices, mx.array):
                batch_indices = batch_indices.tolist()
            idx = [int(i) for i in batch_indices]
            keep = mx.array(idx, dtype=mx.int32)
            if self.left_padding is not None:
                self.left_padding = self.left_padding[keep]
            if self.lengths is not None:
                self.lengths = self.lengths[keep]
            if self.cache[0] is not None:
                self._set_rows([self._row(i) for i in idx], [self.row_length(i) for i in idx])

        def extend(self, other):
            a_rows, a_lengths = self._rows() if self.cache[0] is not None else (None, None)
            b_rows, b_lengths = other._rows() if other.cache[0] is not None else (None, None)
            if a_rows is None or b_rows is None:  # an empty side: mlx-lm's zeros for it
                super().extend(other)
            else:
                na, nb = self.batch_size, other.batch_size
                self.left_padding = _cat(self.left_padding, other.left_padding, na, nb)
                self.lengths = _cat(self.lengths, other.lengths, na, nb)
                self._set_rows(a_rows + b_rows, a_lengths + b_lengths)
            self.padded_left = self.padded_left or getattr(other, "padded_left", False)

        def extract(self, idx):
            cache = self._like()
            if self.cache[0] is not None:
                cache.cache = [mx.contiguous(a) for a in self._row(idx)]
            return cache

        def prepare(self, *, lengths=None, left_padding=None, right_padding=None, **kwargs):
            if lengths is not None:
                self.lengths = mx.array(lengths)
            if left_padding is not None and max(left_padding) > 0:
                pad = mx.array(left_padding)
                self.left_padding = pad if self.left_padding is None else self.left_padding + pad
                self.padded_left = True

        def finalize(self):
            super().finalize()
            self.padded_left = False

        def make_mask(self, N: int):
            """``[B, N]``: which of the next ``N`` positions are tokens (None: all)."""
            if self.lengths is None and not self.padded_left:
                return None
            return super().make_mask(N)

        @classmethod
        def merge(cls, caches):
            first = next((c for c in caches if isinstance(c, cls)), caches[0])
            kind = getattr(first, "kind", None) or _kind_of(first)
            if all(c.empty() for c in caches):
                merged = cls(len(first.cache), kind, [0] * len(caches))
                merged.chunk_size = first.chunk_size if isinstance(first, cls) else None
                return merged
            rows, lengths = [], []
            for c in caches:
                if c.empty():
                    raise ValueError(
                        "RowsCache.merge: an empty cache beside filled ones (fill it with the "
                        "model's initial state first)"
                    )
                if not isinstance(c, cls):  # a plain ArraysCache, loaded from a file
                    plain, c = c, cls(len(c.cache), kind)
                    c.cache = list(plain.cache)
                for i in range(c.batch_size):
                    rows.append(c._row(i))
                    lengths.append(c.row_length(i))
            merged = first._like(kind) if isinstance(first, cls) else cls(len(first.cache), kind)
            merged._set_rows(rows, lengths)
            return merged

    # saved under mlx-lm's name: load_prompt_cache makes it mlx-lm's ArraysCache, which the
    # models read the same (a saved cache is one row of exact length, never a padded batch)
    RowsCache.__name__ = "ArraysCache"
    return ArraysCache, RowsCache


def _kind_of(cache) -> str:
    """A plain cache's block kind, from its arrays: MoBA's four (three of them 4-d), Qwen2's
    two 4-d, else RWKV-7's."""
    arrays = [a for a in cache.cache if a is not None]
    dims = [a.ndim for a in arrays]
    if dims[:3] == [4, 4, 4]:
        return "moba"
    if dims == [4, 4]:
        return "qwen2"
    return "rwkv7"


def _cat(a, b, na: int, nb: int):
    """Two rows' optional per-row arrays (paddings, lengths) side by side, zeros for a side
    that has none."""
    if a is None and b is None:
        return None
    a = mx.zeros((na,), dtype=mx.int32) if a is None else a
    b = mx.zeros((nb,), dtype=mx.int32) if b is None else b
    return mx.concatenate([a, b])


def row_of(state: dict, i: int, n: int | None, chunk_size: int | None) -> dict:
    """Row ``i`` of a batch's state arrays (by name; ``"lengths"`` left out), its time arrays
    cut to its ``n`` tokens (None: as they are): keys and values one entry a token, MoBA's key
    sums one a started chunk of ``chunk_size``."""
    row = {}
    for name, a in state.items():
        if name == "lengths":
            continue
        a = a[i : i + 1]
        if n is not None and name in TIME_ARRAYS:
            a = a[:, :, : -(-n // chunk_size) if name == "key_sums" else n]
        row[name] = a
    return row


def stack_padded(arrays: list[mx.array]) -> mx.array:
    """``[1, ...]`` arrays stacked on axis 0; time arrays (4-d) right-padded with zeros on
    axis 2 to the longest."""
    if arrays[0].ndim == 4:
        S = max(a.shape[2] for a in arrays)
        arrays = [
            a if a.shape[2] == S else mx.pad(a, [(0, 0), (0, 0), (0, S - a.shape[2]), (0, 0)])
            for a in arrays
        ]
    return mx.concatenate(arrays, axis=0) if len(arrays) > 1 else arrays[0]


def make_caches(layers) -> list:
    """One empty ``RowsCache`` per block of ``layers``, sized for the block's state."""
    _, rows_cache = _classes()
    caches = []
    for layer in layers:
        c = rows_cache(len(layer.init_state(1)), layer.kind)
        if layer.kind == "moba":
            c.chunk_size = layer.attn.chunk_size
        caches.append(c)
    return caches


def read_caches(layers, caches, batch: int, T: int = 1) -> tuple[list[dict], Rows | None]:
    """The state the caches hold (``Model.init_state``'s form; an empty cache gives the block's
    initial state) and, for a batch whose rows differ (padding, or attention caches of
    different lengths), its ``Rows`` for the next ``T`` positions (else None). A ValueError for
    an object that is not such a cache; the state itself is checked by the model
    (``Model.check_state``)."""
    plain, rows_cache = _classes()
    state, ragged = [], False
    for i, (layer, c) in enumerate(zip(layers, caches, strict=True)):
        if not isinstance(c, plain):
            raise ValueError(
                f"model: cache[{i}] is a {type(c).__name__}, not one of model.make_cache()"
            )
        if c.empty():
            state.append(layer.init_state(batch))
            continue
        names = STATE_ORDER[layer.kind]
        # arrays past the block's names (a cache of another kind) keep a name of their own, so
        # that the model's check names what it found
        names += tuple(f"array {j}" for j in range(len(names), len(c.cache)))
        s = dict(zip(names, c.cache, strict=False))  # ARWKV: no ffn_shift
        if isinstance(c, rows_cache) and c.kv_lengths is not None:
            s["lengths"] = list(c.kv_lengths)
            ragged = True
        state.append(s)
    first = caches[0]
    mask = first.make_mask(T) if isinstance(first, rows_cache) else None
    if mask is None and (first.lengths is not None or first.left_padding is not None):
        mask = plain.make_mask(first, T)  # a plain cache prepared by hand
        if mask is not None and bool(mx.all(mask).item()):
            mask = None
    if mask is None and not ragged:
        return state, None
    if mask is None:
        return state, Rows(None, [(0, T)] * batch)
    return state, Rows(mask, spans_of(mask))


def spans_of(valid: mx.array) -> list[tuple[int, int]]:
    """Each row's span of real positions in ``valid [B, T]`` (read back: host ints); a
    ValueError unless each row's are contiguous."""
    spans = []
    for row in np.array(valid).astype(bool):
        real = np.flatnonzero(row)
        if real.size and real[-1] - real[0] + 1 != real.size:
            raise ValueError("model: a row's tokens must be contiguous (left or right padding)")
        spans.append((int(real[0]), int(real[-1]) + 1) if real.size else (0, 0))
    return spans


def write_caches(layers, caches, state: list[dict], T: int = 0) -> None:
    """Put ``state`` (the model's, after a forward of ``T`` positions) into the caches, in
    place, and move their padding past those positions (mlx-lm's ``advance``)."""
    for layer, c, s in zip(layers, caches, state, strict=True):
        c.cache = [s[name] for name in STATE_ORDER[layer.kind] if name in s]
        if hasattr(c, "kv_lengths"):
            lengths = s.get("lengths")
            c.kv_lengths = lengths if lengths and len(set(lengths)) > 1 else None
        if T and (c.lengths is not None or c.left_padding is not None):
            c.advance(T)
