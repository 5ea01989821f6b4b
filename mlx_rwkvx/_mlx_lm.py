"""Everything mlx_rwkvx uses of mlx-lm, and what for: the one module that imports ``mlx_lm``
(``tests/test_package_boundaries.py`` keeps it so; the tests may import mlx-lm directly where
they compare against it).

``pyproject.toml`` pins ``mlx-lm<0.33``. When mlx-lm 0.33 comes, this is the place to look:
``tests/test_mlx_lm.py`` fails naming any name listed here that the installed mlx-lm no longer
has (at import, inside the functions below, and their attributes), and anything ``RELIED``
lists that we use inside them (methods, fields, keyword parameters). Names marked *internal*
are mlx-lm's own machinery, not documented for others (an underscore, or a class we subclass
or whose attributes we read): they may change in any release. The others are what mlx-lm's
README and examples use.

Importing this module imports mlx-lm (some 3 s, with transformers): a module that needs
mlx-lm only on some paths imports this one inside the function, as ``models/cache.py`` and
``server/tools.py`` do. The private names we reach are behind functions, so that one gone
breaks its feature, not every import.
"""

from __future__ import annotations

# The decode loop and what it yields, for generation/stream.py (and the benchmarks' parity)
from mlx_lm.generate import (
    BatchGenerator,  # internal: the server's continuous batching (server/batch.py), RowsCache rows
    GenerationResponse,  # what stream_generate yields: ours are mlx-lm's, so callers take either
    TextStateMachine,  # internal: stop strings as text streams (its split / flush / make_state)
    generate_step,  # the decode loop, one step ahead of its caller, with samplers and processors
    generation_stream,  # internal: the stream generate_step runs on (wired_limit waits on it)
    wired_limit,  # internal: keeps the model's weights wired in memory while generating
)

# Caches: RowsCache (models/cache.py) subclasses ArraysCache, internal: its state list,
# left_padding, and the batch methods BatchGenerator calls (filter, extend, extract, prepare,
# finalize, make_mask, merge)
from mlx_lm.models.cache import ArraysCache

# Sampling: generation/stream.py and server/answers.py build mlx-lm's samplers and processors;
# the server composes a row's own sampler from the apply_* filters (internal helpers)
from mlx_lm.sample_utils import (
    apply_min_p,
    apply_top_k,
    apply_top_p,
    make_logits_processors,
    make_sampler,
)

# Detokenizing: NaiveStreamingDetokenizer for a tokenizer that brings none; our byte-level
# one subclasses StreamingDetokenizer (internal: reset, add_token, finalize, and the text,
# tokens and offset fields its last_segment reads)
from mlx_lm.tokenizer_utils import NaiveStreamingDetokenizer, StreamingDetokenizer

# Adapters: adapters/lora.py wraps projections in these; adapters/variants.py subclasses
# LoRALinear for PiSSA and MiSS and tuner/parallel.py stacks it (internal: its linear, lora_a,
# lora_b, scale and dropout attributes); adapters/fuse.py calls their fuse()
from mlx_lm.tuner.dora import DoRALinear
from mlx_lm.tuner.lora import LoRALinear

# Benchmarks only, mlx-lm's side of a comparison: its model from our Hugging Face export, its
# trainer's loss and LoRA conversion (benchmarks/workloads.py, benchmarks/train.py)
from mlx_lm.tuner.trainer import default_loss
from mlx_lm.tuner.utils import linear_to_lora_layers
from mlx_lm.utils import load_model

# What we use inside those names, checked against the installed mlx-lm by tests/test_mlx_lm.py:
# an mlx-lm path -> the attributes we call, read or override on it (on the class, or on an
# instance its __init__ builds) and, written "name=", the keyword parameters we pass it (a
# class: its constructor's). Anything we start to use of mlx-lm's classes belongs here.
RELIED: dict[str, tuple[str, ...]] = {
    # RowsCache (models/cache.py) subclasses it: its state, what read_caches / write_caches
    # call on a plain one (empty, make_mask, advance), the batch methods BatchGenerator calls
    # that RowsCache overrides (extend, finalize and make_mask call the base's)
    "mlx_lm.models.cache.ArraysCache": (
        "left_padding=",
        "cache",
        "left_padding",
        "lengths",
        "batch_size",
        "state",
        "empty",
        "advance",
        "filter",
        "extend",
        "extract",
        "prepare",
        "finalize",
        "make_mask",
        "merge",
    ),
    # generation/stream.py's StopStrings: a state from make_state, stepped by the static
    # split and flush (the state a tuple whose first item is None after a stop string)
    "mlx_lm.generate.TextStateMachine": ("make_state", "split", "flush"),
    # generation/stream.py's _ByteDetokenizer subclasses it: the three methods it overrides,
    # and last_segment, which reads the text and offset fields (tokens: declared beside them)
    "mlx_lm.tokenizer_utils.StreamingDetokenizer": (
        "reset",
        "add_token",
        "finalize",
        "last_segment",
        "text",
        "tokens",
        "offset",
    ),
    # for a tokenizer that brings no detokenizer (generation/stream.py, server/engine.py)
    "mlx_lm.tokenizer_utils.NaiveStreamingDetokenizer": ("add_token", "finalize", "last_segment"),
    # generation/stream.py yields ours, built by keyword
    "mlx_lm.generate.GenerationResponse": (
        "text=",
        "token=",
        "logprobs=",
        "from_draft=",
        "prompt_tokens=",
        "prompt_tps=",
        "generation_tokens=",
        "generation_tps=",
        "peak_memory=",
        "finish_reason=",
    ),
    # generation/stream.py's decode loop from the second token (prompt and model positional)
    "mlx_lm.generate.generate_step": (
        "max_tokens=",
        "sampler=",
        "logits_processors=",
        "prompt_cache=",
    ),
    # generation/stream.py and server/answers.py
    "mlx_lm.sample_utils.make_sampler": ("temp=", "top_p=", "min_p=", "top_k="),
    "mlx_lm.sample_utils.make_logits_processors": (
        "logit_bias=",
        "repetition_penalty=",
        "presence_penalty=",
        "frequency_penalty=",
    ),
    # server/batch.py builds one a batch; server/engine.py inserts rows with their caches,
    # steps them and takes a row's cache and tokens out (extract_cache, remove: uid -> both)
    "mlx_lm.generate.BatchGenerator": (
        "max_tokens=",
        "stop_tokens=",
        "completion_batch_size=",
        "insert",
        "next_generated",
        "extract_cache",
        "remove",
    ),
    "mlx_lm.generate.BatchGenerator.insert": (
        "max_tokens=",
        "caches=",
        "all_tokens=",
        "samplers=",
        "logits_processors=",
    ),
    "mlx_lm.generate.BatchGenerator.remove": ("return_prompt_caches=",),
    # what next_generated yields, read by server/engine.py's _token
    "mlx_lm.generate.GenerationBatch.Response": (
        "uid",
        "token",
        "logprobs",
        "finish_reason",
        "prompt_cache",
        "all_tokens",
    ),
    # adapters/lora.py wraps with from_base, adapters/fuse.py fuses, adapters/variants.py
    # subclasses it (built by keyword; its from_base, __call__ overridden) and tuner/parallel.py
    # stacks its fields
    "mlx_lm.tuner.lora.LoRALinear": (
        "r=",
        "dropout=",
        "scale=",
        "from_base",
        "fuse",
        "linear",
        "lora_a",
        "lora_b",
        "scale",
        "dropout",
    ),
    "mlx_lm.tuner.lora.LoRALinear.from_base": ("r=", "dropout=", "scale="),
    # adapters/lora.py and fuse.py as LoRALinear; adapters/tensors.py saves its m with lora_a/b
    "mlx_lm.tuner.dora.DoRALinear": ("from_base", "fuse", "lora_a", "lora_b", "m"),
    "mlx_lm.tuner.dora.DoRALinear.from_base": ("r=", "dropout=", "scale="),
}

__all__ = [
    "RELIED",
    "ArraysCache",
    "BatchGenerator",
    "DoRALinear",
    "GenerationResponse",
    "LoRALinear",
    "NaiveStreamingDetokenizer",
    "StreamingDetokenizer",
    "TextStateMachine",
    "apply_min_p",
    "apply_top_k",
    "apply_top_p",
    "default_loss",
    "generate_step",
    "generation_stream",
    "infer_tool_parser",
    "linear_to_lora_layers",
    "load_model",
    "make_logits_processors",
    "make_sampler",
    "time_mix_wkv7",
    "tool_parser",
    "wired_limit",
]


def infer_tool_parser(tokenizer) -> str | None:
    """The name of the tool-call parser mlx-lm's server picks for ``tokenizer`` from its chat
    template and vocabulary, or None (server/tools.py). Internal: mlx-lm's private
    ``tokenizer_utils._infer_tool_parser``."""
    from mlx_lm.tokenizer_utils import _infer_tool_parser

    return _infer_tool_parser(tokenizer)


def tool_parser(kind: str):
    """The module ``mlx_lm.tool_parsers.<kind>``; we rely on its ``tool_call_start``,
    ``tool_call_end`` and ``parse_tool_call(text, tools)`` (server/tools.py)."""
    import importlib

    return importlib.import_module(f"mlx_lm.tool_parsers.{kind}")


def time_mix_wkv7(r, w, k, v, a, b, state):
    """mlx-lm's own WKV7 recurrence, ``r, w, k, v, a, b`` ``[B, T, H, N]`` with ``w`` the
    decay itself (not its log), ``state`` ``[B, H, N, N]``: ``(y, state)`` (benchmarks/wkv7.py's
    reference). Internal: the private method ``Rwkv7TimeMixing._wkv7``, called unbound with an
    object carrying the two attributes it reads."""
    from types import SimpleNamespace

    from mlx_lm.models.rwkv7 import Rwkv7TimeMixing

    owner = SimpleNamespace(num_heads=r.shape[2], head_dim=r.shape[3])
    return Rwkv7TimeMixing._wkv7(owner, r, w, k, v, a, b, state)
