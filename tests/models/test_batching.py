"""Rows of different histories in one batch (mlx-lm's ``BatchGenerator`` over our
``RowsCache``): every row is the computation of that row alone, for each family; padded
positions leave the recurrent state as it was; the cache's batching methods give each row
back exactly; rows that start from different state-tuned states share a batch."""

from __future__ import annotations

from mlx_rwkvx.models import Model
from mlx_rwkvx.models.cache import read_caches, write_caches

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator
from models.test_models_hybrid import CONFIGS

TOL = 1e-5  # a batched row's per-step log-probabilities within 1e-5 of the row alone
PROMPTS = (5, 19, 11, 1, 26)  # the last two join while the first three decode
STEPS = 10


def _prompts(vocab: int) -> list[list[int]]:
    rng = np.random.default_rng(0)
    return [rng.integers(1, vocab, size=n).tolist() for n in PROMPTS]


def _alone(model, prompt, n, state=None):
    """Greedy: the log-probabilities of each step for ``prompt`` alone (B = 1)."""
    cache = model.make_cache()
    if state is not None:
        write_caches(model.layers, cache, state)
    logits = model(mx.array([prompt]), cache)[0, -1]
    out = []
    for _ in range(n):
        logprobs = logits - mx.logsumexp(logits)
        out.append(np.array(logprobs))
        logits = model(mx.array([[int(mx.argmax(logits).item())]]), cache)[0, -1]
    return out


def _batched(model, prompts, n, caches=None, join_at=3, step=8):
    """Greedy rows through mlx-lm's BatchGenerator: the first three at once, the others
    joining at step ``join_at``; prompts prefilled ``step`` tokens at a time (padded)."""
    gen = BatchGenerator(model, max_tokens=n, prefill_step_size=step)
    caches = caches or [None] * len(prompts)
    got = {}
    uids = gen.insert(prompts[:3], caches=caches[:3] if caches[0] else None)
    for _ in range(500):
        if len(uids) < len(prompts) and sum(map(len, got.values())) >= join_at:
            uids += gen.insert(prompts[3:], caches=caches[3:] if caches[0] else None)
        for r in gen.next_generated():
            got.setdefault(r.uid, []).append((r.token, np.array(r.logprobs)))
        if len(uids) == len(prompts) and all(len(got.get(u, [])) == n for u in uids):
            break
    return [got[u] for u in uids]


def _assert_same(batched, alone):
    """Log-probabilities within TOL; greedy tokens equal while the top two differ by more."""
    for row, ref in zip(batched, alone, strict=True):
        assert len(row) == len(ref)
        for (token, logprobs), want in zip(row, ref, strict=True):
            assert np.abs(logprobs - want).max() <= TOL
            top2 = np.sort(want)[-2:]
            if top2[1] - top2[0] <= TOL:
                break  # a near tie: the rows may part here
            assert token == int(np.argmax(want))


@pytest.mark.parametrize("name", ["rwkv7", "rwkv-x-tiny", "rfa", "mixed"])
def test_a_batched_row_is_the_row_alone(name):
    model = Model(CONFIGS[name](), seed=3)
    prompts = _prompts(model.config.vocab_size)
    _assert_same(_batched(model, prompts, STEPS), [_alone(model, p, STEPS) for p in prompts])


def test_padded_positions_leave_the_state_unchanged():
    model = Model(CONFIGS["rwkv7"](), seed=1)
    short, long = [3, 4, 5], [6, 7, 8, 9, 10, 11, 12]
    cache = model.make_cache()
    for c in cache:
        c.prepare(lengths=[3, 7], right_padding=[4, 0])
    model(mx.array([short + [0] * 4, long]), cache)
    for c in cache:
        c.finalize()
    state, rows = read_caches(model.layers, cache, 2)
    assert rows is None  # finalized: nothing padded any more
    for i, ids in enumerate((short, long)):
        alone = model.make_cache()
        model(mx.array([ids]), alone)
        want, _ = read_caches(model.layers, alone, 1)
        for s, w in zip(state, want, strict=True):
            for key in w:
                assert np.abs(np.array(s[key][i : i + 1]) - np.array(w[key])).max() <= 1e-6


def test_cache_methods_give_each_row_back(tmp_path):
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = Model(CONFIGS["mixed"](), seed=2)
    rows = []
    for n in (3, 9, 6):
        cache = model.make_cache()
        model(mx.array([list(range(1, n + 1))]), cache)
        rows.append(cache)
    merged = [type(c).merge([r[i] for r in rows]) for i, c in enumerate(rows[0])]
    for i, row in enumerate(rows):
        for m, c in zip(merged, row, strict=True):
            got = m.extract(i)
            assert all(mx.array_equal(a, b) for a, b in zip(got.cache, c.cache, strict=True))
    for m in merged:  # rows 2 and 0 kept, then row 1 appended again
        m.filter([2, 0])
    more = [type(c).merge([rows[1][i]]) for i, c in enumerate(rows[0])]
    for m, x in zip(merged, more, strict=True):
        m.extend(x)
    for i, row in enumerate([rows[2], rows[0], rows[1]]):
        extracted = [m.extract(i) for m in merged]
        for got, c in zip(extracted, row, strict=True):
            assert all(mx.array_equal(a, b) for a, b in zip(got.cache, c.cache, strict=True))
        step = mx.array([[7]])
        assert mx.array_equal(model(step, extracted), model(step, [c for c in row]))
    # an extracted row saves as mlx-lm's own ArraysCache and loads as it
    save_prompt_cache(str(tmp_path / "rows.safetensors"), [m.extract(0) for m in merged])
    loaded = load_prompt_cache(str(tmp_path / "rows.safetensors"))
    assert {type(c).__name__ for c in loaded} == {"ArraysCache"}


def test_rows_of_different_state_tuned_states_share_a_batch():
    base = Model(CONFIGS["rwkv7"](), seed=4)
    tuned = []
    for seed in (1, 2):
        m = Model(CONFIGS["rwkv7"](), seed=4)
        for layer in m.layers:
            layer.tmix.enable_state_tuning()
            layer.tmix.state0 = 0.3 * mx.random.normal(
                layer.tmix.state0.shape, key=mx.random.key(seed)
            )
        tuned.append(m)
    models = [base, tuned[0], tuned[1], tuned[0], base]
    prompts = _prompts(base.config.vocab_size)
    caches = []
    for m in models:  # each row starts from its own model's initial state
        cache = base.make_cache()
        write_caches(base.layers, cache, m.init_state(1))
        caches.append(cache)
    batched = _batched(base, prompts, STEPS, caches=caches)
    _assert_same(batched, [_alone(m, p, STEPS) for m, p in zip(models, prompts, strict=True)])


@pytest.mark.parametrize("name", ["rwkv7", "rwkv-x-tiny", "rfa", "mixed"])
def test_prefill_of_rows_of_different_lengths_is_each_row_alone(name):
    """``Model.prefill``: rows with histories of their own (merged caches) and prompts of
    their own lengths in one padded forward: each row's last logits and state are its own."""
    model = Model(CONFIGS[name](), seed=5)
    vocab = model.config.vocab_size
    histories, prompts = _prompts(vocab)[:3], _prompts(vocab)[2:]
    caches, want = [], []
    for h, p in zip(histories, prompts, strict=True):
        cache = model.make_cache()
        model(mx.array([h]), cache)
        caches.append(cache)
        alone = model.make_cache()
        model(mx.array([h]), alone)
        want.append((np.array(model(mx.array([p]), alone)[0, -1]), alone))
    merged = [type(c).merge([cache[k] for cache in caches]) for k, c in enumerate(caches[0])]
    lengths = [len(p) for p in prompts]
    T = max(lengths)
    tokens = mx.array([p + [0] * (T - len(p)) for p in prompts])
    logits = np.array(model.prefill(tokens, merged, lengths))
    for b, (want_logits, alone) in enumerate(want):
        assert np.abs(logits[b] - want_logits).max() <= TOL
        got, _ = read_caches(model.layers, [c.extract(b) for c in merged], 1)
        ref, _ = read_caches(model.layers, alone, 1)
        for g, r in zip(got, ref, strict=True):
            for key in r:
                assert g[key].shape == r[key].shape
                assert np.abs(np.array(g[key]) - np.array(r[key])).max() <= TOL
