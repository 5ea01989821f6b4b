"""The presets of BlinkDL's released RWKV-7 shapes: each has about the parameters its name says,
counted on the lazily built model (nothing of a 13.3B is ever allocated)."""

from __future__ import annotations

from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.models.config import RWKV7_RELEASES

import pytest
from mlx.utils import tree_flatten


@pytest.mark.parametrize("size", sorted(RWKV7_RELEASES))
def test_released_shapes_have_the_parameters_their_names_say(size):
    config = preset(f"rwkv7-{size}")
    params = sum(x.size for _, x in tree_flatten(Model(config, seed=0).parameters()))
    named = float(size.removesuffix("b")) * 1e9
    # 0.1B is named for its blocks: 191M with the World vocabulary's embedding and head
    blocks = params - 2 * config.vocab_size * config.hidden_size if size == "0.1b" else params
    assert abs(blocks - named) <= 0.15 * named, (size, params)  # the 0.4B has 451M
    assert config.intermediate_size == 4 * config.hidden_size
