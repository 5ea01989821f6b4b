"""Saved states: the tokens of a text, the model's state after them and the identity of what
that state is valid for, in one safetensors file. The one format of a chat's saved conversation
(``Chat.save``) and of the server's ``--cache-dir`` (``PrefixCache``).

A file of ``STATE_FORMAT``:

- metadata: ``format``; ``model``, the identity the state is valid for (a conversation's is
  ``model_identity``'s: base fingerprint and adapter tensors; the prefix cache's its key, which
  adds the dtype, quantization and KV window); ``others``, a JSON list of the further snapshots'
  names, where there are any; and the writer's own strings (``kind``: ``conversation`` or
  ``prefix``; a conversation's messages, a cached state's scope);
- tensors: ``tokens`` (int32 ``[n]``); ``state.<block>.<array>``, each array of
  ``Model.init_state``'s form that holds anything (an empty KV cache comes back from
  ``init_state``; no state tensor at all: the state before any token); ``logits`` (``[1,
  vocab]``, the next token's after the tokens) where known; and for each further snapshot
  ``<name>`` (a chat's state before its last answer) ``<name>.tokens`` and
  ``<name>.state.<block>.<array>``.

``read_state`` checks a file against the model it is read for, and each failure is one
``CheckpointError`` naming the file and the problem: the format tag; the identity; every
tensor's name, shape (``Model.check_state``; an attention cache no longer than the tokens)
and dtype (a floating state array where ``init_state`` has one: another float dtype is
converted, as a conversation saved by a bfloat16 run resumes in a float32 one); finite values;
token ids within the vocabulary; logits ``[1, vocab]``; no tensor it does not know.

Files of the two formats before this one still load: ``OLD_CHAT_FORMAT`` (a conversation: its
snapshots ``now`` and ``before``, with their token counts in the metadata) and
``OLD_PREFIX_FORMAT`` (a cached state, whose ``key`` is its identity). Nothing writes them.
"""

from __future__ import annotations

import json
import os
import sys
from array import array
from dataclasses import dataclass, field

from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.atomic import atomic_target, check_target
from mlx_rwkvx.io.tensors import safetensors_header
from mlx_rwkvx.models.model import Model

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

STATE_FORMAT = "mlx_rwkvx.state/1"
OLD_CHAT_FORMAT = "mlx_rwkvx.chat/1"
OLD_PREFIX_FORMAT = "mlx_rwkvx-prefix-state"
FORMATS = (STATE_FORMAT, OLD_CHAT_FORMAT, OLD_PREFIX_FORMAT)
_RESERVED = ("format", "model", "others")  # metadata the writer's own strings may not use
_MAX_HEADER = 1 << 26  # a safetensors header larger than this is not a saved state's

Snapshot = tuple[list[int], list | None]  # tokens, and the state after them (None: no token)


@dataclass
class SavedState:
    """A saved state as ``read_state`` returns it, checked: ``tokens``, the ``state`` after
    them (``Model.init_state``'s form; None before any token), the next-token ``logits``
    where saved, the writer's ``meta`` strings (``kind`` among them), further snapshots by
    name (``others``) and the file's ``format`` tag."""

    tokens: list[int]
    state: list | None
    logits: mx.array | None = None
    meta: dict[str, str] = field(default_factory=dict)
    others: dict[str, Snapshot] = field(default_factory=dict)
    format: str = STATE_FORMAT


@dataclass
class StateHeader:
    """What a saved state's header says, read without its arrays: the ``format`` tag, the
    ``identity`` it is valid for, its ``kind`` (``conversation``, ``prefix``), the raw
    metadata, the tokens and the file's size in bytes."""

    format: str
    identity: str
    kind: str
    meta: dict[str, str]
    tokens: tuple[int, ...]
    size: int


def _name(dtype) -> str:
    return str(dtype).rsplit(".", 1)[-1]  # mlx.core.float32 -> float32


def _tensors(prefix: str, tokens, state) -> dict[str, mx.array]:
    out = {f"{prefix}tokens": mx.array(list(tokens), dtype=mx.int32)}
    if state is not None:
        out.update({f"{prefix}state.{k}": v for k, v in tree_flatten(state) if v.size})
    return out


def write_state(
    path: str,
    tokens,
    state: list | None,
    identity: str,
    *,
    logits: mx.array | None = None,
    meta: dict[str, str] | None = None,
    others: dict[str, Snapshot] | None = None,
) -> int:
    """Write a saved state to exactly ``path`` (a temporary name: ``save_state`` or the prefix
    cache renames it into place), readable by its owner only (0600: it holds a conversation's
    tokens); returns the file's size. OSError or RuntimeError (MLX's writer) when it cannot be
    written; ValueError for a name of the format's own in ``meta`` or ``others`` (a bug)."""
    meta = dict(meta or {})
    clash = sorted(set(meta) & set(_RESERVED))
    if clash:
        raise ValueError(f"write_state: {clash} are the format's own metadata")
    tensors = _tensors("", tokens, state)
    if logits is not None:
        tensors["logits"] = logits
    for name, (other_tokens, other_state) in (others or {}).items():
        if not name.isidentifier() or name in ("tokens", "state", "logits"):
            raise ValueError(f"write_state: {name!r} cannot name a snapshot")
        tensors.update(_tensors(f"{name}.", other_tokens, other_state))
    meta.update(format=STATE_FORMAT, model=identity)
    if others:
        meta["others"] = json.dumps(list(others))
    os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    mx.save_safetensors(path, tensors, metadata=meta)
    return os.stat(path).st_size


def save_state(
    path: str,
    tokens,
    state: list | None,
    identity: str,
    *,
    logits: mx.array | None = None,
    meta: dict[str, str] | None = None,
    others: dict[str, Snapshot] | None = None,
) -> None:
    """Save a state to ``path`` (a ``.safetensors`` file) atomically (``io/atomic.py``): a
    file there is replaced only when it is a saved state itself, never another file. Raises
    CheckpointError naming the path when it cannot be written."""
    path = os.fspath(path)
    if not path.endswith(".safetensors"):
        raise CheckpointError(f"{path}: a state is saved as a .safetensors file")
    check_target(path, overwrite=True, folder=False, recognise=is_saved_state, kind="a saved state")
    with atomic_target(path, folder=False) as tmp:
        write_state(tmp, tokens, state, identity, logits=logits, meta=meta, others=others)


def is_saved_state(path: str) -> bool:
    """Whether ``path`` is a whole saved state of one of ``FORMATS`` (by its header)."""
    try:
        read_header(path)
    except (OSError, CheckpointError):
        return False
    return True


def read_header(path: str, *, what: str = "a saved state") -> StateHeader:
    """A saved state's header (its arrays are not read; the file is closed again). OSError
    when it cannot be read; CheckpointError naming the path (and the file as ``what``) when it
    is not a whole saved state of one of ``FORMATS``."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            header, data_start = safetensors_header(f, _MAX_HEADER)
            meta = header.pop("__metadata__", None) or {}
            fmt = meta.get("format")
            if fmt not in FORMATS:
                raise ValueError(f"no format tag of one: {str(fmt)[:40]!r}")
            end = max((t["data_offsets"][1] for t in header.values()), default=0)
            if data_start + end != size:
                raise ValueError("cut short")
            name = "now.tokens" if fmt == OLD_CHAT_FORMAT else "tokens"
            entry = header.get(name)
            if entry is None or entry["dtype"] != "I32":
                raise ValueError("no tokens")
            start, stop = entry["data_offsets"]
            f.seek(data_start + start)
            tokens = array("i", f.read(stop - start))
        if sys.byteorder == "big":
            tokens.byteswap()
        if fmt == OLD_CHAT_FORMAT:
            tokens = tokens[: int(meta["now.tokens"])]
        identity = meta.get("key" if fmt == OLD_PREFIX_FORMAT else "model")
        if not isinstance(identity, str):
            raise ValueError("no identity")
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
        raise CheckpointError(f"{path}: not {what} ({e})") from e
    kind = {OLD_CHAT_FORMAT: "conversation", OLD_PREFIX_FORMAT: "prefix"}.get(fmt)
    return StateHeader(fmt, identity, kind or meta.get("kind", ""), meta, tuple(tokens), size)


def read_state(
    path: str, model: Model | None, identity: str, *, what: str = "a saved state"
) -> SavedState:
    """The saved state in ``path``, checked against ``model`` (see the module docstring) and
    ``identity`` (the one it was saved with). ``model`` None checks all but the shapes,
    dtypes and token ids (a cache of states that are no model's). Raises CheckpointError
    naming the path and the problem (``what`` names the file in it); an OSError (no such
    file, too many open files) or MemoryError as it comes, so that a caller can tell a file
    it may read later from a bad one. The file is read whole and closed again."""
    path = os.fspath(path)
    header = read_header(path, what=what)  # the tag first: another file's are never read
    if header.identity != identity:
        raise CheckpointError(
            f"{path}: {what} of another model or adapter (saved for {header.identity}, this "
            f"is {identity})"
        )
    try:  # opened here, not by MLX, whose error would not tell a missing file from a limit
        with open(path, "rb") as f:
            tensors, meta = mx.load(f, format="safetensors", return_metadata=True)
            mx.eval(list(tensors.values()))  # every array read while the file is open
    except (RuntimeError, ValueError) as e:  # how MLX reports a damaged file
        raise CheckpointError(f"{path}: not {what} ({e})") from e
    return _Reader(path, model, tensors, meta).saved()


class _Reader:
    """One file's tensors taken apart into snapshots, each checked."""

    def __init__(self, path: str, model: Model | None, tensors: dict, meta: dict):
        self.path, self.model, self.tensors, self.meta = path, model, dict(tensors), meta
        self.fmt = meta.get("format")

    def fail(self, problem: str):
        raise CheckpointError(f"{self.path}: {problem}")

    def saved(self) -> SavedState:
        meta, fmt = dict(self.meta), self.fmt
        try:
            if fmt == OLD_CHAT_FORMAT:
                tokens, state = self.snapshot("now.", "now.", int(meta["now.tokens"]), "")
                others = {}
                if "before.tokens" in meta:
                    count = int(meta["before.tokens"])
                    others["before"] = self.snapshot("before.", "before.", count)
                meta = {k: v for k, v in meta.items() if not k.endswith(".tokens")}
                meta["kind"] = "conversation"
            else:
                tokens, state = self.snapshot("", "state.", label="")
                names = json.loads(meta.get("others", "[]"))
                if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                    self.fail("its list of further snapshots is damaged")
                others = {n: self.snapshot(f"{n}.", f"{n}.state.") for n in names}
                if fmt == OLD_PREFIX_FORMAT:
                    meta["kind"] = "prefix"
        except (KeyError, ValueError, TypeError) as e:
            if isinstance(e, CheckpointError):
                raise
            self.fail(f"damaged ({type(e).__name__}: {e})")
        logits = self.logits()
        if self.tensors:
            self.fail(f"holds tensors a saved state has not: {sorted(self.tensors)[:3]}")
        for k in _RESERVED + (("key",) if fmt == OLD_PREFIX_FORMAT else ()):
            meta.pop(k, None)
        return SavedState(tokens, state, logits, meta, others, fmt)

    def snapshot(
        self, at: str, state_at: str, count: int | None = None, label: str | None = None
    ) -> Snapshot:
        """The tokens under ``at + "tokens"`` (the first ``count``) and the state under
        ``state_at``, checked; a problem names the snapshot (``label``; a further one's name)."""
        if label is None:
            label = f"snapshot {at.rstrip('.')!r}: "
        t = self.tensors.pop(f"{at}tokens", None)
        if t is None or t.ndim != 1 or not mx.issubdtype(t.dtype, mx.integer):
            self.fail(f"no {label}tokens (a 1-d integer tensor)")
        tokens = [int(i) for i in t.tolist()]
        if count is not None:
            if not 0 <= count <= len(tokens):
                self.fail(f"{label}tokens: {len(tokens)} for {count}")
            tokens = tokens[:count]
        flat = {
            k[len(state_at) :]: self.tensors.pop(k)
            for k in list(self.tensors)
            if k.startswith(state_at)
        }
        if self.model is not None:
            vocab = self.model.config.vocab_size
            bad = next((i for i in tokens if not 0 <= i < vocab), None)
            if bad is not None:
                self.fail(f"{label}token id {bad} is outside the vocabulary (0 .. {vocab - 1})")
        if not flat:
            return tokens, None
        items = list(flat.items()) if self.model is None else self.model_state(flat, label)
        names = [k for k, x in items if mx.issubdtype(x.dtype, mx.floating)]
        if names:
            finite = mx.stack([mx.all(mx.isfinite(x)) for k, x in items if k in names])
            for k, ok in zip(names, finite.tolist(), strict=True):  # one read back
                if not ok:
                    self.fail(f"{label}state {k} holds NaN or infinite values")
        state = tree_unflatten(items)
        if self.model is not None:
            longest = max((s["keys"].shape[2] for s in state if "keys" in s), default=0)
            if longest > len(tokens):
                self.fail(
                    f"{label}state holds a KV cache of {longest} tokens after {len(tokens)} tokens"
                )
        return tokens, state

    def model_state(self, flat: dict, label: str) -> list[tuple[str, mx.array]]:
        """The model's state arrays in ``init_state``'s order, each the file's (missing
        ones of no size: the initial ones), checked against the model."""
        expected = dict(tree_flatten(self.model.init_state(1)))
        unknown = sorted(set(flat) - set(expected))
        if unknown:
            self.fail(
                f"{label}state array {unknown[0]!r} is none of this model's (its state "
                f"has {sorted(expected)[:4]}...)"
            )
        items = []
        for k, init in expected.items():
            x = flat.get(k)
            if x is None:
                if init.size:
                    self.fail(f"{label}state array {k} is missing")
                x = init
            elif mx.issubdtype(init.dtype, mx.floating) != mx.issubdtype(x.dtype, mx.floating):
                self.fail(
                    f"{label}state {k} is {_name(x.dtype)}, where {_name(init.dtype)} belongs"
                )
            elif x.dtype != init.dtype:
                x = x.astype(init.dtype)
            items.append((k, x))
        try:
            self.model.check_state(tree_unflatten(items), 1)
        except ValueError as e:
            self.fail(f"{label}{str(e).removeprefix('model: ')}")
        return items

    def logits(self) -> mx.array | None:
        x = self.tensors.pop("logits", None)
        if x is None:
            return None
        vocab = self.model.config.vocab_size if self.model is not None else x.shape[-1]
        if not mx.issubdtype(x.dtype, mx.floating) or x.shape != (1, vocab):
            self.fail(
                f"logits of shape {x.shape} ({_name(x.dtype)}) where [1, {vocab}] floats belong"
            )
        if not mx.all(mx.isfinite(x)).item():
            self.fail("logits hold NaN or infinite values")
        return x.astype(mx.float32)
