"""mlx-lm's view of a model's explicit state: ``Model.make_cache()`` gives one of mlx-lm's own
``ArraysCache`` per block, holding that block's state arrays in a fixed order
(``STATE_ORDER``; an RWKV-7 block's is that of mlx-lm's rwkv7 model). So mlx-lm's generation
utilities (``generate_step``, ``stream_generate``) drive our models, and its prompt-cache files
(``save_prompt_cache``, ``load_prompt_cache``) keep our caches with nothing registered in its
modules: ``load_prompt_cache`` knows the class. ``ArraysCache`` also has the batching methods
(``merge``, ``filter``, ``extend``, ``extract``) that generating several sequences at once
needs.

Entry points: ``make_caches``, ``read_caches`` (the state a forward starts from),
``write_caches`` (the state after it). The models themselves only see the state
(``Model.hidden``). mlx-lm is imported only when a cache is made or read: its package imports
transformers, and with it torch where that is installed (seconds per process).
"""

from __future__ import annotations

# Each block kind's state arrays, in their place in the block's ArraysCache; a block keeps those
# it has (an ARWKV block of RFA has no channel-mix token shift).
STATE_ORDER = {
    "rwkv7": ("tmix_shift", "wkv", "ffn_shift"),  # mlx-lm's rwkv7: token shift, WKV, ffn shift
    "moba": ("keys", "values", "key_sums", "ffn_shift"),
    "qwen2": ("keys", "values"),
}


def _arrays_cache() -> type:
    from mlx_lm.models.cache import ArraysCache

    return ArraysCache


def make_caches(layers) -> list:
    """One empty ``ArraysCache`` per block of ``layers``, sized for the block's state."""
    cache_class = _arrays_cache()
    return [cache_class(len(layer.init_state(1))) for layer in layers]


def read_caches(layers, caches, batch: int) -> list[dict]:
    """The state the caches hold (``Model.init_state``'s form): an empty cache gives the
    block's initial state. A ValueError for an object that is not such a cache, or one of mlx-lm's
    batched caches (left padding, lengths), which the models do not take yet; the state itself
    is checked by the model (``Model.check_state``)."""
    cache_class = _arrays_cache()
    state = []
    for i, (layer, c) in enumerate(zip(layers, caches, strict=True)):
        if not isinstance(c, cache_class):
            raise ValueError(
                f"model: cache[{i}] is a {type(c).__name__}, not one of model.make_cache()"
            )
        if c.left_padding is not None or c.lengths is not None:
            raise ValueError(
                f"model: cache[{i}] is batched with padding (mlx-lm's BatchGenerator), which "
                "these models do not take yet"
            )
        if c.empty():
            state.append(layer.init_state(batch))
            continue
        names = STATE_ORDER[layer.kind]
        # arrays past the block's names (a cache of another kind) keep a name of their own, so
        # that the model's check names what it found
        names += tuple(f"array {j}" for j in range(len(names), len(c.cache)))
        state.append(dict(zip(names, c.cache, strict=False)))  # ARWKV: no ffn_shift
    return state


def write_caches(layers, caches, state: list[dict]) -> None:
    """Put ``state`` (the model's, after a forward) into the caches, in place."""
    for layer, c, s in zip(layers, caches, state, strict=True):
        c.cache = [s[name] for name in STATE_ORDER[layer.kind] if name in s]
