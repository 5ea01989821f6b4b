"""Structured output: ``response_format`` ``json_schema`` (and ``json_object``) through
llguidance, which compiles a JSON schema into a grammar and, at each step, the set of tokens
that keep the text on it. Why llguidance: it needs no torch (xgrammar requires torch and
triton), it builds its token tables from a ``tokenizer.json`` or from any vocabulary of byte
strings (RWKV World's, the byte tokenizer's: ours have no ``tokenizer.json``), and its masks
take well under a millisecond per token on a 65,536-token vocabulary. Its MLX helper applies
the mask with a Metal kernel; here the mask becomes an MLX ``where`` (the same on every
device).

``token_table(tokenizer, vocab_size)`` makes llguidance's view of a tokenizer once per model;
``grammar_of(response_format)`` a request's grammar (None for text), checked, so that a bad
schema is a 400 before the request waits; ``GrammarProcessor`` is the logits processor of one
answer (mlx-lm's protocol, ``(tokens, logits) -> logits``)."""

from __future__ import annotations

import os

from mlx_rwkvx.server.protocol import ResponseFormat, bad

import mlx.core as mx
import numpy as np


class _ByteVocabulary:
    """What llguidance's ``TokenizerWrapper`` reads of a tokenizer without a tokenizer.json:
    every id's bytes, the end-of-text id, and encoding."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        known = min(getattr(tokenizer, "vocab_size", vocab_size), vocab_size)
        self.tokens = [self._bytes(i) for i in range(known)]  # the head's padded rows: none
        self.eos_token_id = min(getattr(tokenizer, "eos_token_ids", None) or {0})
        self.bos_token_id = None
        self.special_token_ids = sorted(getattr(tokenizer, "eos_token_ids", None) or {0})

    def _bytes(self, i: int) -> bytes:
        try:
            return self._tokenizer.decode_bytes([i]) if i else b""
        except ValueError:  # a hole in the vocabulary
            return b""

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            return self._tokenizer.encode_bytes(text)
        return self._tokenizer.encode(text)


def token_table(tokenizer, vocab_size: int):
    """llguidance's ``LLTokenizer`` of ``tokenizer`` for a head of ``vocab_size`` rows."""
    import llguidance

    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or ()) or None
    folder = getattr(tokenizer, "folder", None)
    if folder is not None and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        with open(os.path.join(folder, "tokenizer.json"), encoding="utf-8") as f:
            return llguidance.LLTokenizer(f.read(), n_vocab=vocab_size, eos_token=eos)
    if not hasattr(tokenizer, "decode_bytes"):
        raise bad("response_format: this model's tokenizer cannot be constrained")
    wrapper = llguidance.TokenizerWrapper(_ByteVocabulary(tokenizer, vocab_size))
    return llguidance.LLTokenizer(wrapper, n_vocab=vocab_size, eos_token=eos)


def grammar_of(response_format: ResponseFormat | None, table) -> str | None:
    """The grammar of a request's ``response_format`` (None: plain text), checked against the
    model's token table; a 400 for a schema llguidance cannot compile."""
    import llguidance

    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        schema = {"type": "object"}
    else:
        spec = response_format.json_schema
        if spec is None or spec.schema_ is None:
            raise bad("response_format: json_schema needs its schema", "response_format")
        schema = spec.schema_
    try:
        # compact JSON: no whitespace between tokens (a blank line would end an RWKV turn)
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            schema, defaults={"whitespace_flexible": False}
        )
    except ValueError as e:
        raise bad(f"response_format: not a JSON schema ({e})", "response_format") from None
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
    if failed:
        raise bad(f"response_format: the schema cannot be used: {messages[0]}", "response_format")
    return grammar


# The tool-call formats a tool_choice can hold an answer to: mlx-lm's parser of the format ->
# how one call is written (a JSON object of its name and arguments between the markers)
FORCED_CALLS = {"json_tools": ("<tool_call>\n", "\n</tool_call>")}


def tool_grammar(kind: str, tools: list[dict], name: str | None, table) -> str:
    """The grammar of an answer that is one call (``tool_choice`` ``required``: of any of the
    tools; a named function: of that one), in the template's format ``kind``: its name, and
    arguments that validate against the tool's parameters. A 400 for a format it cannot
    hold."""
    import json

    import llguidance

    if kind not in FORCED_CALLS:
        raise bad(
            f"tool_choice: this model's tool-call format ({kind}) can only be auto or none",
            "tool_choice",
        )
    chosen = [t["function"] for t in tools if name is None or t["function"]["name"] == name]
    if not chosen:
        raise bad(f"tool_choice: no tool is named {name!r}", "tool_choice")
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                "arguments": f.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for f in chosen
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema["x-guidance"] = {"whitespace_flexible": False}  # compact, as response_format's
    start, end = FORCED_CALLS[kind]
    grammar = llguidance.LLMatcher.grammar_from_lark(
        f"start: {json.dumps(start)} call {json.dumps(end)}\ncall: %json {json.dumps(schema)}"
    )
    failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, table)
    if failed:
        raise bad(f"tools: a tool's parameters cannot be used: {messages[0]}", "tools")
    return grammar


class GrammarProcessor:
    """One answer held to a grammar: each call consumes the tokens sampled since the last one
    and masks every token that would leave the grammar (once the text is complete, all but
    the end of text). The first call sees the prompt only."""

    def __init__(self, table, grammar: str, vocab_size: int):
        import llguidance

        self.matcher = llguidance.LLMatcher(table, grammar, log_level=0)
        if self.matcher.is_error():  # checked by grammar_of; a limit reached while building
            raise bad(f"response_format: {self.matcher.get_error()}", "response_format")
        self.vocab_size = vocab_size
        self.seen: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self.seen is None:
            self.seen = tokens.size
        elif tokens.size > self.seen:
            new = [int(t) for t in tokens[self.seen :].tolist()]
            self.seen = tokens.size
            self.matcher.consume_tokens(new)
        if self.matcher.is_error():  # cannot happen with its own masks: leave logits as they are
            return logits
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        return mx.where(mx.array(allowed), logits, -mx.inf)
