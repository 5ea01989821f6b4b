"""Model states after token prefixes, so that a conversation resumes from where it stopped: a
radix trie over token ids (each edge holds a run of tokens, so a long conversation is a few
nodes), whose nodes may hold the state after exactly the tokens from the root to them. A
lookup finds the longest stored prefix of a text's tokens; least-recently-used states go first
when their bytes pass the budget (an attention block's KV cache counts with the rest).

A cache holds the states of one model as it runs (its weights, adapter, dtype, quantization and
KV window): whoever keeps several keeps one cache per such key. With a ``folder``, every state
stored is also written there, and the folder is the truth that several processes share:

- one saved-state file a state (``io/states.py``'s format: tokens, state, logits where known,
  the key as its identity and the scope), ``<32 hex>.safetensors``, written under a temporary
  name and renamed into place (a kill leaves a whole file or none); files 0600, the folder 0700
  (they hold conversations' tokens). A state read back is checked against ``model`` (shapes,
  dtypes, finite values, the key): a file that fails is deleted, with one warning;
- ``load`` (at start) removes the temporary files of writers that died (``io/targets.py``'s
  names, with their pid) and takes in the folder's states of its key: only their names, tokens
  and sizes (read from the header), never a file held open; a state's arrays are read when a
  lookup first lands on it. A file that cannot be read is skipped, with one warning for all;
- every change (a state written or evicted) happens under an exclusive ``flock`` of
  ``.mlx_rwkvx-cache-lock``, which also counts the changes: a cache that finds the count moved
  takes in the other processes' new states and forgets the deleted ones first. So several
  servers share one folder, and its files (every byte of them, header and tokens included)
  stay within the budget: evicted states' files are deleted;
- a state that cannot be written (a full disk, a file-size limit, no permission) stays in
  memory only, with one warning for each cause; the cache serves on;
- each cache holds a shared ``flock`` of ``.mlx_rwkvx-cache-live`` while it lives, so that
  ``trim_cache_dir`` knows which folders of a ``--cache-dir`` nobody uses (other
  configurations, earlier runs): their states go, least recently used first (a lookup that
  lands on a state touches its file). Nothing but our own files is ever removed.

The folder's side (its files' names, the two locks, ``trim_cache_dir``) lives in
``cache_dir.py``; ``folder_for`` and ``trim_cache_dir`` are importable from here as well.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.generation.cache_dir import (
    folder_for,
    open_locks,
    read_change_count,
    take_flock,
    trim_cache_dir,
    write_change_count,
)
from mlx_rwkvx.io.states import read_header, read_state, write_state
from mlx_rwkvx.io.targets import reason, remove_stale, temp_path
from mlx_rwkvx.models.model import Model

from mlx.utils import tree_flatten

# the folder's names, where the server and older callers import them from
__all__ = ["PrefixCache", "folder_for", "state_bytes", "trim_cache_dir"]


def state_bytes(state) -> int:
    """The bytes of a state's arrays (a pytree of ``mx.array``)."""
    return sum(x.nbytes for _, x in tree_flatten(state))


class _Node:
    __slots__ = ("edge", "children", "parent", "state", "nbytes", "file")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None):
        self.edge, self.parent = edge, parent
        self.children: dict[int, _Node] = {}
        self.state, self.nbytes, self.file = None, 0, None  # file: its name in the folder

    def holds(self) -> bool:
        """Whether a state is stored here (in memory, in the folder, or both)."""
        return self.state is not None or self.file is not None


class _Root(_Node):
    """The root of one scope's trie (a scope's states are never found from another's)."""

    __slots__ = ("scope",)

    def __init__(self, scope: str):
        super().__init__((), None)
        self.scope = scope


class PrefixCache:
    """States by token prefix under ``max_bytes`` (see the module docstring). ``put(tokens,
    entry)`` stores the entry after ``tokens``: ``{"state": ..., "logits": ...}``, the model's
    state (``Model.init_state``'s form) and, where known, the next-token logits after them;
    ``get(tokens)`` returns ``(n, entry)`` for the longest stored prefix ``tokens[:n]`` (``(0,
    None)`` when none is). ``folder`` and ``key``: where states persist, and what they are
    valid for (see the module docstring); ``model``: the model whose states they are, against
    which a state read from the folder is checked (None: all but shapes and dtypes). With a
    folder, a state's bytes are its file's (what the disk holds); else its arrays'.

    ``scope`` (of ``put`` and ``get``): who may see a state. Each scope has a trie of its own,
    so that a lookup never finds (nor reveals the length of) another scope's prefix; all share
    the one byte budget and least-recently-used order, and a saved state keeps its scope."""

    def __init__(
        self, max_bytes: int, folder: str | None = None, key: str = "", model: Model | None = None
    ):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes, self.folder, self.key, self.model = max_bytes, folder, key, model
        self.nbytes = 0
        self._roots: dict[str, _Root] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # id -> node holding a state
        self._files: dict[str, _Node] = {}  # name in the folder -> the node it holds
        self._foreign: set[str] = set()  # names in the folder not ours to hold
        self._live = self._lock = None  # the two lock files, open while the cache lives
        self._seen = -1  # the folder's change count when this cache last looked
        self._changed = False
        self._warned: set = set()

    def __len__(self) -> int:
        return len(self._lru)

    def nodes(self) -> int:
        """Nodes in the tries besides their roots (what their structure costs)."""
        count, todo = 0, [c for root in self._roots.values() for c in root.children.values()]
        while todo:
            node = todo.pop()
            count += 1
            todo.extend(node.children.values())
        return count

    def get(self, tokens: Sequence[int], *, scope: str = "") -> tuple[int, object | None]:
        tokens = tuple(tokens)
        with self._changing():
            unreadable: set[int] = set()  # states that could not be read now: kept, passed over
            while True:
                at, node = self._longest(tokens, scope, unreadable)
                if node is None:
                    return 0, None
                if node.state is None:
                    read = self._read(node, tokens[:at], scope)
                    if read is None:
                        unreadable.add(id(node))
                        continue
                    if not read:
                        self._drop(node)  # deleted by another process, or damaged
                        continue
                self._lru.move_to_end(id(node))
                if node.file is not None:  # its place in the order survives a restart
                    try:
                        os.utime(os.path.join(self.folder, node.file))
                    except OSError:
                        pass
                return at, node.state

    def put(self, tokens: Sequence[int], state, *, scope: str = "") -> bool:
        """Store ``state`` (an entry: see the class docstring) as the one after ``tokens`` in
        ``scope`` (replacing one stored there); False when it alone is over the budget (then
        nothing is stored)."""
        tokens = tuple(tokens)
        size = state_bytes(state)
        if size > self.max_bytes:
            return False
        with self._changing():
            saved = self._write(tokens, state, scope) if self._lock is not None else None
            node = self._insert(tokens, scope)
            if node.holds():
                self.nbytes -= node.nbytes
            node.state = state
            if saved is not None:
                node.file, node.nbytes = saved
                self._files[node.file] = node
            elif node.file is None:  # kept in memory only
                node.nbytes = size
            # (else the write failed and the file of these same tokens before stays)
            self.nbytes += node.nbytes
            self._lru[id(node)] = node
            self._lru.move_to_end(id(node))
            self._evict()
        return True

    def load(self) -> int:
        """Take in the states of this key saved in ``folder`` (by an earlier process or one
        running beside it), after removing the temporary files of writers that died; returns
        how many. Their arrays are read when first used. Files of other keys are left alone;
        one that cannot be read is skipped, with one warning for all such files. An OSError
        when the folder cannot be made or locked (not writable, ...)."""
        if not self.folder:
            return 0
        self._open()
        with self._changing(fresh=True) as taken:
            pass
        return taken[0]

    def close(self) -> None:
        """Let go of the folder's lock files (the states stay; a later call opens them again)."""
        for f in (self._lock, self._live):
            if f is not None:
                f.close()
        self._lock = self._live = None

    # ----- the folder --------------------------------------------------------------------

    def _open(self) -> None:
        """The folder's locks taken (see ``cache_dir.open_locks``), once."""
        if self._lock is None:
            self._live, self._lock = open_locks(self.folder)

    @contextmanager
    def _changing(self, fresh: bool = False) -> Iterator[list[int]]:
        """The block under the folder's change lock (nothing without a folder), after taking
        in what other processes changed since this cache last looked (everything: ``fresh``);
        yields a list that holds how many states were taken in, once the block has run."""
        taken = [0]
        if not self.folder:
            yield taken
            return
        if self._lock is None:
            try:
                self._open()
            except OSError as e:
                self._warn_once(("open", e.errno), f"cannot keep states there ({reason(e)})")
                self.folder = None  # memory only from now on
                yield taken
                return
        fd = self._lock.fileno()
        locked = take_flock(fd, fcntl.LOCK_EX)
        if not locked:
            self._warn_once(
                "nolock",
                "this file system has no locks, so another process "
                "using the folder would not be noticed",
            )
        try:
            count = read_change_count(fd)
            if fresh:
                remove_stale(self.folder)
            if fresh or count != self._seen:
                taken[0] = self._rescan(warn=fresh)
            self._changed = False
            yield taken
            self._evict()
            if self._changed:
                count += 1
                write_change_count(fd, count)
            self._seen = count
        finally:
            if locked:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _rescan(self, warn: bool) -> int:
        """Take in the folder's states of this key that this cache does not hold (oldest
        first: least recently used), and forget those whose files are gone; how many."""
        try:
            names = {
                n
                for n in os.listdir(self.folder)
                if n.endswith(".safetensors") and not n.startswith(".")
            }
        except OSError:
            names = set()
        for name in [n for n in self._files if n not in names]:
            node = self._files.pop(name)
            node.file = None
            if node.state is None:
                self._drop(node)
            else:  # still in memory: kept there
                self.nbytes += state_bytes(node.state) - node.nbytes
                node.nbytes = state_bytes(node.state)
        self._foreign &= names
        found, bad = [], []
        for name in names - self._files.keys() - self._foreign:
            path = os.path.join(self.folder, name)
            try:
                header = read_header(path)
                mtime = os.stat(path).st_mtime_ns
            except (OSError, CheckpointError) as e:
                self._foreign.add(name)
                bad.append(f"{name} ({str(e).removeprefix(path + ': ')})")
                continue
            tokens, scope = header.tokens, header.meta.get("scope", "")
            if header.identity != self.key or name != self._name(tokens, scope):
                self._foreign.add(name)
                continue
            found.append((mtime, name, tokens, scope, header.size))
        if bad and warn:
            warnings.warn(
                f"{self.folder}: {len(bad)} files skipped, not readable saved "
                f"states: {', '.join(bad[:3])}" + (", ..." if len(bad) > 3 else ""),
                stacklevel=4,
            )
        for _, name, tokens, scope, size in sorted(found):
            try:  # earlier versions wrote them readable by everyone
                os.chmod(os.path.join(self.folder, name), 0o600)
            except OSError:
                pass
            node = self._insert(tokens, scope)
            if node.holds():
                self.nbytes -= node.nbytes
            node.file, node.nbytes = name, size
            self._files[name] = node
            self.nbytes += size
            self._lru[id(node)] = node
            self._lru.move_to_end(id(node))
        return len(found)

    def _name(self, tokens: tuple[int, ...], scope: str) -> str:
        named = [self.key, list(tokens)] if not scope else [self.key, scope, list(tokens)]
        return hashlib.sha256(json.dumps(named).encode()).hexdigest()[:32] + ".safetensors"

    def _write(self, tokens: tuple[int, ...], state, scope: str) -> tuple[str, int] | None:
        """The state's file written (its name and size), or None: it could not be (one
        warning a cause), or alone it is over the budget."""
        name = self._name(tokens, scope)
        path = os.path.join(self.folder, name)
        tmp = temp_path(path)
        meta = {"kind": "prefix", "scope": scope}
        try:  # renamed here, not by atomic_target: a file of the same state may appear meanwhile
            size = write_state(
                tmp, tokens, state["state"], self.key, logits=state.get("logits"), meta=meta
            )
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            if size > self.max_bytes:
                os.remove(tmp)
                return None
            os.replace(tmp, path)  # a file of the same state another process wrote: replaced
        except (OSError, RuntimeError) as e:  # RuntimeError: how MLX's writer reports one
            try:
                os.remove(tmp)
            except OSError:
                pass
            cause = e.errno if isinstance(e, OSError) else "write"
            text = (
                reason(e)
                if isinstance(e, OSError)
                else f"{e}; is the disk full, or a file-size limit reached?"
            )
            self._warn_once(
                ("write", cause),
                f"a state could not be saved ({text}); such "
                "states are kept in memory only, and this is said once",
            )
            return None
        self._changed = True
        return name, size

    def _read(self, node: _Node, tokens: tuple[int, ...], scope: str) -> bool | None:
        """A saved state read into ``node`` (``read_state``: checked against the model and the
        key; the file closed again): True; False when the file is gone or is not this state
        (damaged, refused by a check: one warning for all such, another key's, another
        scope's); None when it cannot be read now (too many open files, an I/O error, no
        memory): kept for a later lookup, with one warning a cause."""
        path = os.path.join(self.folder, node.file)
        try:
            saved = read_state(path, self.model, self.key)
        except FileNotFoundError:
            return False
        except CheckpointError as e:
            self._warn_once(
                "refused",
                f"a saved state failed its checks and was deleted ({e}); this is said once",
            )
            return False
        except (OSError, MemoryError) as e:
            text = reason(e) if isinstance(e, OSError) else "out of memory"
            self._warn_once(
                ("read", getattr(e, "errno", None)),
                f"a saved state could not be read now ({text}); it is kept for later lookups",
            )
            return None
        if tuple(saved.tokens) != tokens or saved.meta.get("scope", "") != scope:
            return False
        node.state = {"state": saved.state}
        if saved.logits is not None:
            node.state["logits"] = saved.logits
        return True

    def _warn_once(self, cause, text: str) -> None:
        if cause not in self._warned:
            self._warned.add(cause)
            warnings.warn(f"{self.folder}: {text}", stacklevel=4)

    # ----- the trie ----------------------------------------------------------------------

    def _longest(
        self, tokens: tuple[int, ...], scope: str, skip: set[int] = frozenset()
    ) -> tuple[int, _Node | None]:
        """The longest stored prefix of ``tokens`` in ``scope`` and its node, passing over
        the nodes whose ids are in ``skip``."""
        node, at = self._roots.get(scope), 0
        if node is None:
            return 0, None
        best = (0, node if node.holds() and id(node) not in skip else None)  # after no tokens
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None or tokens[at : at + len(child.edge)] != child.edge:
                break
            node, at = child, at + len(child.edge)
            if node.holds() and id(node) not in skip:
                best = (at, node)
        return best

    def _insert(self, tokens: tuple[int, ...], scope: str) -> _Node:
        node, at = self._roots.get(scope), 0
        if node is None:
            node = self._roots[scope] = _Root(scope)
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None:  # a new leaf holding the rest
                leaf = _Node(tokens[at:], node)
                node.children[tokens[at]] = leaf
                return leaf
            edge = child.edge
            common = 0
            while (
                common < len(edge)
                and at + common < len(tokens)
                and (edge[common] == tokens[at + common])
            ):
                common += 1
            if common < len(edge):  # split the edge where the tokens leave it
                middle = _Node(edge[:common], node)
                node.children[edge[0]] = middle
                child.edge, child.parent = edge[common:], middle
                middle.children[child.edge[0]] = child
                child = middle
            node, at = child, at + common
        return node

    def _evict(self) -> None:
        while self.nbytes > self.max_bytes:
            _, oldest = self._lru.popitem(last=False)
            self._drop(oldest)

    def _drop(self, node: _Node) -> None:
        """``node``'s state evicted (its file deleted); nodes left holding nothing are pruned
        or merged."""
        self._lru.pop(id(node), None)
        self.nbytes -= node.nbytes
        if node.file is not None:
            self._files.pop(node.file, None)
            try:
                os.remove(os.path.join(self.folder, node.file))
                self._changed = True
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn_once(
                    ("remove", e.errno), f"a state's file could not be deleted ({reason(e)})"
                )
        node.state, node.nbytes, node.file = None, 0, None
        while node.parent is not None and not node.holds() and len(node.children) <= 1:
            parent = node.parent
            if node.children:  # one child: merge it into this node's place
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[node.edge[0]] = child
                return
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is None and not node.holds() and not node.children:
            del self._roots[node.scope]  # a scope left empty costs nothing
