"""Conversations into tokens and their training mask: the chat template renders the turns, and
each assistant turn's tokens are found as exact token prefixes of the whole conversation's (a
template that rewrites earlier turns, or a tokenizer that merges text across a turn's edge, is
an error, never a wrong mask)."""

from __future__ import annotations

from mlx_rwkvx.data.records import BadRecord
from mlx_rwkvx.io.tokenizers import ByteTokenizer, WorldTokenizer

import numpy as np


def encode_text(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except (ValueError, TypeError) as e:  # text the tokenizer cannot encode (bad Unicode, ...)
        raise BadRecord(str(e)) from e


def check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise BadRecord("'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise BadRecord(f"message {i} is a {type(m).__name__}, expected an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise BadRecord(f"message {i} has no 'role'")
        if not isinstance(m.get("content"), str) and not (
            m.get("content") is None and m.get("tool_calls")
        ):
            raise BadRecord(f"message {i} has no 'content' text")


def chat_example(tokenizer, messages: list[dict], tools=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n], trained bool [n]) of a conversation rendered by the tokenizer's chat
    template, the assistant turns trained. Raises ValueError when the template rewrites earlier
    turns or the tokenizer merges text across a turn's edge (no exact mask exists)."""
    try:
        tokens, trained = chat_tokens(tokenizer, messages, tools)
    except BadRecord as e:
        raise ValueError(str(e)) from None
    return tokens.astype(np.int32), trained


def _greedy_token_ends(tokenizer, ids: list[int]) -> dict[int, int] | None:
    """For World and bytes (greedy longest match, left to right): {byte offset: tokens} where
    each token of ``ids`` ends. A prefix of the text encodes to a prefix of ``ids`` exactly when
    it ends at one of these offsets (greedy matches inside the prefix are the whole text's), so
    the prefix need not be encoded again. None for other tokenizers (subclasses included)."""
    if type(tokenizer) not in (WorldTokenizer, ByteTokenizer):
        return None
    table = tokenizer.id_to_bytes
    offsets = np.cumsum([len(table[i]) for i in ids])
    return {0: 0} | {int(end): n for n, end in enumerate(offsets, 1)}


def chat_tokens(tokenizer, messages, tools, first: int = 0):
    # Chat turns are rendered by the tokenizer's apply_chat_template (a Hugging Face
    # tokenizer's own template, else RWKV's "User: ...\n\nAssistant: ...\n\n"). An assistant
    # turn's tokens run from the rendering of the conversation before it with the generation
    # prompt to the rendering that ends with it, each checked to be a token prefix of the
    # whole conversation's tokens: a template that rewrites earlier turns (or a tokenizer that
    # merges text across a turn's edge) is an error, never a wrong mask
    # (``first``: the assistant turns from message ``first`` on are trained, the earlier ones
    # are context: a preference pair's prompt)
    check_messages(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    if not turns:
        roles = sorted({m["role"] for m in messages})
        raise BadRecord(f"no assistant message to train on (the roles are {roles})")
    extra = {} if tools is None else {"tools": tools}

    def render(k: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:k], add_generation_prompt=generation_prompt, tokenize=False, **extra
            )
        except (ImportError, OSError):
            raise
        except Exception as e:  # the template's own errors: jinja2's, raise_exception(), ...
            raise BadRecord(f"the chat template fails on messages 1-{k}: {e}") from e

    whole = render(len(messages), False)
    ids = encode_text(tokenizer, whole)
    ends = _greedy_token_ends(tokenizer, ids)

    def boundary(k: int, generation_prompt: bool) -> int:
        if k == len(messages) and not generation_prompt:
            return len(ids)
        text = render(k, generation_prompt)
        what = f"messages 1-{k}" if k else "no message"
        what += " and the generation prompt" if generation_prompt else ""
        if not whole.startswith(text):
            raise BadRecord(
                f"the chat template rewrites earlier turns: the rendering of {what} is not a "
                "prefix of the whole conversation's, so no exact mask exists"
            )
        if ends is not None:
            n = ends.get(len(text.encode("utf-8", "surrogatepass")))
        else:
            prefix = encode_text(tokenizer, text)
            n = len(prefix) if ids[: len(prefix)] == prefix else None
        if n is None:
            raise BadRecord(
                f"the tokens of {what} are not a prefix of the whole conversation's (the "
                "tokenizer merges text across the edge), so no exact mask exists"
            )
        return n

    trained = np.zeros(len(ids), dtype=bool)
    for i in turns:
        start, end = boundary(i, True), boundary(i + 1, False)
        trained[start:end] = True
    trained[:1] = False
    return np.array(ids, dtype=np.int64), trained
