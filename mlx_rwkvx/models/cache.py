"""mlx-lm's view of a model's explicit state: one cache object per block holding that block's
state (a dict of arrays), so mlx-lm's generation utilities (``generate_step``,
``stream_generate``) and prompt-cache files (``save_prompt_cache``, ``load_prompt_cache``) work
with our models. The models themselves only ever see the state (``Model.hidden``).

``BlockStateCache`` has the surface of mlx-lm's cache classes without deriving from them, so
that importing the models does not import mlx-lm (whose package imports transformers, and with
it torch where that is installed: seconds per process).
"""

from __future__ import annotations

import importlib
import sys

import mlx.core as mx
from mlx.utils import tree_flatten


class BlockStateCache:
    """One block's state for mlx-lm: None until the model first runs with it."""

    def __init__(self, state: dict | None = None):
        self._state = state

    @property
    def state(self) -> dict | None:
        return self._state

    @state.setter
    def state(self, value: dict | None) -> None:
        self._state = value

    @classmethod
    def from_state(cls, state: dict | None) -> BlockStateCache:
        """What mlx-lm's ``load_prompt_cache`` calls with a saved ``state`` (one argument in
        the mlx-lm series pyproject.toml pins)."""
        return cls(state)

    def empty(self) -> bool:
        return self._state is None

    def is_trimmable(self) -> bool:
        return False  # a recurrent state cannot forget its last tokens

    def size(self) -> int:
        return 0

    @property
    def nbytes(self) -> int:
        return sum(x.nbytes for _, x in tree_flatten(self._state or {}) if isinstance(x, mx.array))


def register_with_mlx_lm(*, import_it: bool = True) -> None:
    """Make ``BlockStateCache`` known to mlx-lm's ``load_prompt_cache``, which looks cache
    classes up by name in its own module. Idempotent. ``Model.make_cache`` calls it (mlx-lm is
    imported then: the caches are for mlx-lm's utilities); ``Model()`` calls it with
    ``import_it=False``, registering only if mlx-lm's cache module is imported already, so a
    process that imports mlx-lm, then loads a model, then a prompt cache, finds the class."""
    module = sys.modules.get("mlx_lm.models.cache")
    if module is None and import_it:
        module = importlib.import_module("mlx_lm.models.cache")
    if module is not None:
        module.BlockStateCache = BlockStateCache
