"""The prefix cache (the server's state store, first step): longest stored prefix against a
brute-force reference under random operations, least-recently-used eviction under the byte
budget, and a trie that shrinks back as states go (no node leaks)."""

from __future__ import annotations

import random

from mlx_rwkvx.generation.prefix_cache import PrefixCache, state_bytes

import mlx.core as mx
import pytest
from helpers import tiny_model
from mlx.utils import tree_flatten


def state(n: int, tag: float = 0.0):
    """A state-like pytree of ``4 * n`` bytes."""
    return [{"x": mx.full((n,), tag, dtype=mx.float32)}]


def test_longest_stored_prefix():
    cache = PrefixCache(10**6)
    a, b, c = state(1, 1), state(1, 2), state(1, 3)
    cache.put([1, 2, 3], a)
    cache.put([1, 2, 3, 4, 5], b)
    cache.put([1, 2, 9], c)
    assert cache.get([1, 2, 3, 4, 5, 6]) == (5, b)
    assert cache.get([1, 2, 3, 4]) == (3, a)
    assert cache.get([1, 2, 9, 9]) == (3, c)
    assert cache.get([1, 2]) == (0, None) and cache.get([]) == (0, None)
    assert cache.get([7]) == (0, None)
    cache.put([1, 2, 3], c)  # replaced: the bytes counted once
    assert cache.get([1, 2, 3]) == (3, c) and len(cache) == 3 and cache.nbytes == 12


def test_random_operations_match_a_brute_force_reference():
    rng = random.Random(0)
    cache, reference = PrefixCache(10**9), {}
    for step in range(3000):
        tokens = tuple(rng.randrange(4) for _ in range(rng.randrange(0, 9)))
        if rng.random() < 0.5:
            s = state(1, step)
            cache.put(tokens, s)
            reference[tokens] = s
        else:
            found = [(len(k), v) for k, v in reference.items() if tokens[: len(k)] == k]
            n, s = cache.get(tokens)
            best = max(found, key=lambda f: f[0], default=(0, None))
            assert n == best[0] and s is best[1], (tokens, n, best)
    assert len(cache) == len(reference)


def test_least_recently_used_states_go_first():
    cache = PrefixCache(3 * 40)  # three states of 40 bytes
    for i in range(3):
        cache.put([i, 0, 0], state(10, i))
    cache.get([0, 0, 0, 5])  # the first is used again: the second is now the oldest
    cache.put([3, 0, 0], state(10, 3))
    assert cache.get([1, 0, 0]) == (0, None)
    assert [cache.get([i, 0, 0])[0] for i in (0, 2, 3)] == [3, 3, 3]
    assert cache.nbytes == 120 and len(cache) == 3
    assert not cache.put([9], state(31))  # alone over the budget: not stored, nothing evicted
    assert len(cache) == 3


def test_the_trie_shrinks_as_states_go():
    """Every state evicted one by one: the trie ends empty (branch points merged or pruned)."""
    rng = random.Random(1)
    cache = PrefixCache(40 * 20)  # twenty states at most
    for step in range(500):
        tokens = [rng.randrange(3) for _ in range(rng.randrange(1, 12))]
        cache.put(tokens, state(10, step))
        assert cache.nodes() <= 2 * len(cache)  # a radix trie: at most one branch node a leaf
    cache.max_bytes = 0
    cache.put([0], state(0))  # zero bytes fits; the rest is evicted to get under the budget
    assert len(cache) == 1 and cache.nodes() == 1


def test_real_model_states_resume_a_text():
    """The state stored after a prompt, fed the rest, gives the logits of the whole text."""
    model = tiny_model("rwkv-x", seed=2)
    tokens = list(range(1, 41))
    _, after = model.hidden(mx.array([tokens[:25]]))
    cache = PrefixCache(10**8)
    cache.put(tokens[:25], after)
    assert cache.nbytes == state_bytes(after) > 0
    n, resumed = cache.get(tokens)
    h, _ = model.hidden(mx.array([tokens[n:]]), resumed)
    whole, _ = model.hidden(mx.array([tokens]))
    assert n == 25 and mx.allclose(h, whole[:, 25:], atol=1e-5).item()


def test_bad_budget():
    with pytest.raises(ValueError, match="max_bytes must be an int >= 0"):
        PrefixCache(-1)


def test_states_persist_in_a_folder_and_come_back(tmp_path):
    """Stored states are written to the folder; a new cache of the same key loads them (equal
    arrays, the same lookups), another key's are left alone, a damaged file is skipped with one
    warning, and evicted states' files are deleted."""
    model = tiny_model("rwkv-x", seed=3)
    first = PrefixCache(10**8, folder=str(tmp_path), key="model-a")
    texts = {(1, 2, 3): None, (1, 2, 3, 4, 5): None, (7,): None}
    for tokens in texts:
        _, texts[tokens] = model.hidden(mx.array([list(tokens)]))
        first.put(tokens, texts[tokens])
    PrefixCache(10**8, folder=str(tmp_path), key="model-b").put([1, 2], state(4))
    assert len(list(tmp_path.glob("*.safetensors"))) == 4
    (tmp_path / "cut.safetensors").write_bytes(b"\x10\x00\x00")  # a write cut short

    again = PrefixCache(10**8, folder=str(tmp_path), key="model-a")
    with pytest.warns(UserWarning, match=r"cut\.safetensors: skipped, not a readable saved state"):
        assert again.load() == 3
    n, restored = again.get([1, 2, 3, 4, 5, 6])
    assert n == 5
    flat = lambda s: dict(tree_flatten(s))  # noqa: E731
    expected = flat(texts[(1, 2, 3, 4, 5)])
    assert flat(restored).keys() == expected.keys()
    assert all(mx.array_equal(flat(restored)[k], v) for k, v in expected.items())
    assert again.get([1, 2]) == (0, None)  # model-b's state is not model-a's

    budget = max(state_bytes(s) for s in texts.values())
    small = PrefixCache(budget, folder=str(tmp_path), key="model-a")
    with pytest.warns(UserWarning):
        small.load()  # over the budget: states evicted until it fits, their files deleted
    assert 1 <= len(small) < 3 and small.nbytes <= budget
    left = [p for p in tmp_path.glob("*.safetensors") if p.name != "cut.safetensors"]
    assert len(left) == len(small) + 1  # the kept ones and model-b's


def test_a_scope_never_finds_another_scopes_states(tmp_path):
    """States stored in one scope are invisible to a lookup in another (nor is their prefix's
    length revealed); scopes share one budget; a saved state comes back into its own scope."""
    cache = PrefixCache(3 * 40, folder=str(tmp_path), key="model")
    cache.put([1, 2, 3], state(10, 1), scope="alice")
    cache.put([1, 2], state(10, 2))
    assert cache.get([1, 2, 3, 4], scope="bob") == (0, None)
    assert cache.get([1, 2, 3, 4], scope="alice")[0] == 3
    assert cache.get([1, 2, 3, 4])[0] == 2 and cache.get([1, 2, 3], scope="alice")[0] == 3
    cache.put([5], state(10, 3), scope="bob")
    cache.put([6], state(10, 4), scope="bob")  # one budget: the least recently used goes
    assert len(cache) == 3 and cache.get([1, 2]) == (0, None)

    again = PrefixCache(10**6, folder=str(tmp_path), key="model")
    assert again.load() == 3
    assert again.get([1, 2, 3], scope="alice")[0] == 3 and again.get([1, 2, 3]) == (0, None)
    assert again.get([5], scope="bob")[0] == 1 and again.get([5], scope="alice") == (0, None)


def test_scopes_left_empty_are_pruned():
    cache = PrefixCache(40)
    for i in range(50):
        cache.put([i], state(10), scope=f"user-{i}")
    assert len(cache._roots) == 1 and cache.nodes() == 1
