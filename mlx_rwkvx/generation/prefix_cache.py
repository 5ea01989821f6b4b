"""Model states after token prefixes, so that a conversation resumes from where it stopped: a
radix trie over token ids (each edge holds a run of tokens, so a long conversation is a few
nodes), whose nodes may hold the state after exactly the tokens from the root to them. A
lookup finds the longest stored prefix of a text's tokens; least-recently-used states go first
when their bytes pass the budget (an attention block's KV cache counts with the rest).

A cache holds the states of one model as it runs (its weights, adapter, dtype, quantization and
KV window): whoever keeps several keeps one cache per such key. With a ``folder``, every state
stored is also written there (one safetensors file each, atomically, under the key), evicted
ones are deleted, and ``load`` brings back the states of the same key after a restart: a file
that cannot be read is skipped with one warning. The first step of the server issue."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections import OrderedDict
from collections.abc import Sequence

from mlx_rwkvx.io.atomic import atomic_target, save_safetensors

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

FILE_FORMAT = "mlx_rwkvx-prefix-state"


def state_bytes(state) -> int:
    """The bytes of a state's arrays (a pytree of ``mx.array``)."""
    return sum(x.nbytes for _, x in tree_flatten(state))


class _Node:
    __slots__ = ("edge", "children", "parent", "state", "nbytes", "file")

    def __init__(self, edge: tuple[int, ...], parent: _Node | None):
        self.edge, self.parent = edge, parent
        self.children: dict[int, _Node] = {}
        self.state, self.nbytes, self.file = None, 0, None


class _Root(_Node):
    """The root of one scope's trie (a scope's states are never found from another's)."""

    __slots__ = ("scope",)

    def __init__(self, scope: str):
        super().__init__((), None)
        self.scope = scope


class PrefixCache:
    """States by token prefix under ``max_bytes`` (see the module docstring). ``put(tokens,
    state)`` stores the state after ``tokens``; ``get(tokens)`` returns ``(n, state)`` for the
    longest stored prefix ``tokens[:n]`` (``(0, None)`` when none is). ``folder`` and ``key``:
    where states persist, and what they are valid for (see the module docstring).

    ``scope`` (of ``put`` and ``get``): who may see a state. Each scope has a trie of its own,
    so that a lookup never finds (nor reveals the length of) another scope's prefix; all share
    the one byte budget and least-recently-used order, and a saved state keeps its scope."""

    def __init__(self, max_bytes: int, folder: str | None = None, key: str = ""):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes < 0:
            raise ValueError(f"max_bytes must be an int >= 0, got {max_bytes!r}")
        self.max_bytes, self.folder, self.key = max_bytes, folder, key
        self.nbytes = 0
        self._roots: dict[str, _Root] = {}
        self._lru: OrderedDict[int, _Node] = OrderedDict()  # id -> node holding a state

    def __len__(self) -> int:
        return len(self._lru)

    def nodes(self) -> int:
        """Nodes in the trie besides its root (what its structure costs)."""
        count, todo = 0, [c for root in self._roots.values() for c in root.children.values()]
        while todo:
            node = todo.pop()
            count += 1
            todo.extend(node.children.values())
        return count

    def get(self, tokens: Sequence[int], *, scope: str = "") -> tuple[int, object | None]:
        tokens = tuple(tokens)
        node, at = self._roots.get(scope), 0
        if node is None:
            return 0, None
        best = (0, node if node.state is not None else None)  # the state after no tokens
        while at < len(tokens):
            child = node.children.get(tokens[at])
            if child is None or tokens[at : at + len(child.edge)] != child.edge:
                break
            node, at = child, at + len(child.edge)
            if node.state is not None:
                best = (at, node)
        if best[1] is None:
            return 0, None
        self._lru.move_to_end(id(best[1]))
        return best[0], best[1].state

    def put(self, tokens: Sequence[int], state, *, scope: str = "") -> bool:
        """Store ``state`` as the state after ``tokens`` in ``scope`` (replacing one stored
        there); False when it alone is over the budget (then nothing is stored)."""
        tokens = tuple(tokens)
        size = state_bytes(state)
        if size > self.max_bytes:
            return False
        file = self._write(tokens, state, scope) if self.folder else None
        node = self._insert(tokens, scope)
        if node.state is not None:
            self.nbytes -= node.nbytes
        node.state, node.nbytes, node.file = state, size, file
        self.nbytes += size
        self._lru[id(node)] = node
        self._lru.move_to_end(id(node))
        while self.nbytes > self.max_bytes:
            _, oldest = self._lru.popitem(last=False)
            self._drop(oldest)
        return True

    def load(self) -> int:
        """The states of this key saved in ``folder`` (by an earlier process), stored again;
        returns how many. Files of other keys are left alone; one that cannot be read (cut
        short by a kill, damaged) is skipped with one warning."""
        if not self.folder or not os.path.isdir(self.folder):
            return 0
        loaded = 0
        for name in sorted(os.listdir(self.folder)):
            if not name.endswith(".safetensors") or name.startswith("."):
                continue
            path = os.path.join(self.folder, name)
            try:
                arrays, meta = mx.load(path, return_metadata=True)
                if meta.get("format") != FILE_FORMAT:
                    raise ValueError("not a saved state")
                if meta.get("key") != self.key:
                    continue
                scope = meta.get("scope", "")
                tokens = [int(t) for t in arrays.pop("tokens").tolist()]
                state = tree_unflatten(list(arrays.items()))
            except (OSError, ValueError, RuntimeError, KeyError) as e:
                warnings.warn(f"{path}: skipped, not a readable saved state ({e})", stacklevel=2)
                continue
            node = self._insert(tuple(tokens), scope)
            if node.state is None:
                node.state, node.nbytes, node.file = state, state_bytes(state), path
                self.nbytes += node.nbytes
                self._lru[id(node)] = node
                loaded += 1
        while self.nbytes > self.max_bytes:
            _, oldest = self._lru.popitem(last=False)
            self._drop(oldest)
        return loaded

    def _write(self, tokens: tuple[int, ...], state, scope: str) -> str:
        named = [self.key, tokens] if not scope else [self.key, scope, tokens]
        name = hashlib.sha256(json.dumps(named).encode()).hexdigest()[:32]
        path = os.path.join(self.folder, name + ".safetensors")
        arrays = dict(tree_flatten(state))
        arrays["tokens"] = mx.array(tokens, dtype=mx.int32)
        meta = {"format": FILE_FORMAT, "key": self.key, "scope": scope}
        with atomic_target(path, folder=False) as tmp:
            save_safetensors(tmp, arrays, meta)
        return path

    # ----- the trie ----------------------------------------------------------------------

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
            while common < len(edge) and at + common < len(tokens) and (
                    edge[common] == tokens[at + common]):  # fmt: skip
                common += 1
            if common < len(edge):  # split the edge where the tokens leave it
                middle = _Node(edge[:common], node)
                node.children[edge[0]] = middle
                child.edge, child.parent = edge[common:], middle
                middle.children[child.edge[0]] = child
                child = middle
            node, at = child, at + common
        return node

    def _drop(self, node: _Node) -> None:
        """``node``'s state evicted; nodes left holding nothing are pruned or merged."""
        self.nbytes -= node.nbytes
        if node.file is not None:
            try:
                os.remove(node.file)
            except FileNotFoundError:
                pass
        node.state, node.nbytes, node.file = None, 0, None
        while node.parent is not None and node.state is None and len(node.children) <= 1:
            parent = node.parent
            if node.children:  # one child: merge it into this node's place
                (child,) = node.children.values()
                child.edge, child.parent = node.edge + child.edge, parent
                parent.children[node.edge[0]] = child
                return
            del parent.children[node.edge[0]]
            node = parent
        if node.parent is None and node.state is None and not node.children:
            del self._roots[node.scope]  # a scope left empty costs nothing
