"""A model as the server serves it: ``Served``, a model under one name (the base, or the base
with one adapter: the adapter's model shares the base's weight arrays, ``share_weights``, so
each adapter costs only its own tensors), its tokenizer, chat format, tool-call format and its
``PrefixCache`` of states, keyed by what makes a state valid (``state_key``)."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field

from mlx_rwkvx.adapters.fingerprint import model_identity
from mlx_rwkvx.generation import ChatFormat
from mlx_rwkvx.generation.prefix_cache import PrefixCache
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.server.tools import ToolCalls

import mlx.nn as nn


def share_weights(model: Model) -> Model:
    """A model of the same modules whose arrays are ``model``'s own (no copy): applying an
    adapter to it swaps its layers, never ``model``'s."""

    def copy_of(value):
        if isinstance(value, nn.Module):
            new = copy.copy(value)  # dict items and attributes, shallow
            sets = {k: set(v) for k, v in value.__dict__.items() if isinstance(v, set)}
            new.__dict__.update(sets)  # _no_grad: freezing one must not freeze the other
            for key, item in value.items():
                dict.__setitem__(new, key, copy_of(item))
            return new
        if isinstance(value, list):
            return [copy_of(v) for v in value]
        if isinstance(value, dict):
            return {k: copy_of(v) for k, v in value.items()}
        return value  # an array (shared), or a plain value

    return copy_of(model)


def state_key(model: Model, *, dtype: str | None, quantize: str | None, max_cache: int) -> str:
    """What a stored state is valid for: the weights (fingerprint and adapter tensors), the
    dtype and quantization they run in, and the KV window."""
    return f"{model_identity(model)}|{dtype or 'stored'}|{quantize or 'none'}|{max_cache}"


@dataclass
class Served:
    name: str
    model: Model
    tokenizer: object
    format: ChatFormat
    cache: PrefixCache
    adapter: str | None = None
    tool_calls: ToolCalls | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def token_table(self):
        """llguidance's view of the tokenizer (``schema.token_table``), made on first use."""
        if getattr(self, "_table", None) is None:
            from mlx_rwkvx.server.schema import token_table

            self._table = token_table(self.tokenizer, self.model.config.vocab_size)
        return self._table

    def token_bytes(self, token: int) -> bytes:
        """A token's bytes (none for a padded row of the head: no text)."""
        tok = self.tokenizer
        try:
            if hasattr(tok, "decode_bytes"):
                return tok.decode_bytes([token])
            return tok.decode([token]).encode("utf-8")
        except ValueError:
            return b""
