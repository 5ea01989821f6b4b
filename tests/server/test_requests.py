"""What one request may cost the others: a sampler that fails leaves the random state usable
for every other answer."""

from __future__ import annotations

import mlx.core as mx
import pytest
from helpers.parity import import_parity_extra

import_parity_extra(("fastapi", "uvicorn"), extra="server")


def test_a_failed_sampler_leaves_the_random_state_to_the_others():
    """mlx-lm's compiled top-k takes ``mx.random.state`` as an input and leaves it unusable
    when it raises (a top_k over the vocabulary): every later draw failed. The server's
    sampler draws from its own key and resets the state when a filter fails."""
    from mlx_rwkvx.server.answers import Params, sampler

    logprobs = mx.random.normal((1, 512))
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    with pytest.raises(ValueError, match="top_k"):
        mx.eval(sampler(Params(max_tokens=1, temp=1.0, top_k=600))(logprobs))
    for params in (Params(max_tokens=1, temp=1.0), Params(max_tokens=1, temp=0.7, top_k=5)):
        token = sampler(params)(logprobs)
        assert 0 <= token.item() < 512
    assert mx.random.uniform().item() < 1  # mx.random.state itself is usable
