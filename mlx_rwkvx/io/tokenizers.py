"""Tokenizers: RWKV World (greedy longest match over the shipped vocabulary), Hugging Face
``tokenizer.json`` (through ``tokenizers``), and plain bytes for tiny models.

Each has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size`` and
``eos_token_ids``; the World and byte tokenizers also ``encode_bytes``/``decode_bytes``, which
round-trip any byte string, invalid UTF-8 included.
"""

from __future__ import annotations

import ast
import json
import os
from importlib import resources

WORLD_VOCAB = "rwkv_vocab_v20230424.txt"


class WorldTokenizer:
    """RWKV World: 65529 byte strings (ids 1..65529), id 0 ends a text. Encoding takes, at each
    position, the longest vocabulary entry that matches (a byte trie), as BlinkDL's does."""

    name = "world"
    eos_token_ids = {0}

    def __init__(self, vocab_path: str | None = None):
        if vocab_path is None:
            text = resources.files("mlx_rwkvx.io").joinpath("data", WORLD_VOCAB).read_text("utf-8")
        else:
            with open(vocab_path, encoding="utf-8") as f:
                text = f.read()
        self.id_to_bytes: dict[int, bytes] = {}
        self._trie: dict = {}
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            first, last = line.index(" "), line.rindex(" ")
            token = ast.literal_eval(line[first:last].strip())  # a str or bytes literal only
            token = token.encode("utf-8") if isinstance(token, str) else token
            if not isinstance(token, bytes) or len(token) != int(line[last:]):
                raise ValueError(f"{vocab_path or WORLD_VOCAB}:{line_no}: malformed entry")
            idx = int(line[:first])
            self.id_to_bytes[idx] = token
            node = self._trie
            for byte in token:
                node = node.setdefault(byte, {})
            node[None] = idx
        self.vocab_size = max(self.id_to_bytes) + 1

    def encode_bytes(self, data: bytes) -> list[int]:
        ids, i, n = [], 0, len(data)
        while i < n:
            node, j, best, best_end = self._trie, i, None, i
            while j < n and data[j] in node:
                node = node[data[j]]
                j += 1
                if None in node:
                    best, best_end = node[None], j
            if best is None:  # every single byte is in the vocabulary; this cannot happen
                raise ValueError(f"World tokenizer: byte {data[i]:#x} not in the vocabulary")
            ids.append(best)
            i = best_end
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_bytes(text.encode("utf-8"))

    def decode_bytes(self, ids) -> bytes:
        try:
            return b"".join(self.id_to_bytes[int(i)] for i in ids if int(i) != 0)
        except KeyError as e:
            raise ValueError(f"World tokenizer: unknown token id {e.args[0]}") from e

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class ByteTokenizer:
    """Bytes as tokens (ids 0..255; id 0, NUL, ends a text): for tiny test models."""

    name = "bytes"
    vocab_size = 256
    eos_token_ids = {0}

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode_bytes(self, ids) -> bytes:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < 256]
        if bad:
            raise ValueError(f"byte tokenizer: token ids {bad[:5]} outside 0..255")
        return bytes(ids)

    def decode(self, ids) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (e.g. Qwen2's) through the ``tokenizers`` library."""

    name = "hf"

    def __init__(self, folder: str):
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from e
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_token_ids = self._eos_ids(folder)

    def _eos_ids(self, folder: str) -> set[int]:
        names = []
        for fname, key in (
            ("generation_config.json", "eos_token_id"),
            ("tokenizer_config.json", "eos_token"),
            ("config.json", "eos_token_id"),
        ):
            path = os.path.join(folder, fname)
            if os.path.exists(path):
                with open(path) as f:
                    value = json.load(f).get(key)
                if value is not None:
                    names.extend(value if isinstance(value, list) else [value])
        ids = set()
        for v in names:
            if isinstance(v, dict):
                v = v.get("content")
            tid = v if isinstance(v, int) else self._tok.token_to_id(v)
            if tid is not None:
                ids.add(tid)
        return ids

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)


def load_tokenizer(path: str, vocab_size: int):
    """The tokenizer of a checkpoint: its ``tokenizer.json`` when it has one, else World for a
    65536-token vocabulary, else bytes for <= 256 tokens. Raises ValueError otherwise."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    if os.path.exists(os.path.join(folder, "tokenizer.json")):
        return HFTokenizer(folder)
    if os.path.exists(os.path.join(folder, WORLD_VOCAB)):
        return WorldTokenizer(os.path.join(folder, WORLD_VOCAB))
    if vocab_size == 65536:
        return WorldTokenizer()
    if vocab_size <= 256:
        return ByteTokenizer()
    raise ValueError(
        f"{path}: no tokenizer.json beside the checkpoint, and vocab_size {vocab_size} is "
        "neither RWKV World's (65536) nor bytes' (<= 256)"
    )


class HFStyle:
    """One of our tokenizers with the Hugging Face surface mlx-lm's ``TokenizerWrapper`` reads
    (``encode(text, add_special_tokens=...)``, ``decode``, ``eos_token_id``, ``get_vocab``), so
    that ``mlx_lm.generate.stream_generate`` runs our models with our tokenizers."""

    bos_token = None
    chat_template = None

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        eos = sorted(tokenizer.eos_token_ids)
        self.eos_token_id = eos[0] if eos else None
        self.eos_token_ids = eos
        self._vocab = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids, **_) -> str:
        return self.tokenizer.decode(ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **_):
        """RWKV's plain chat format: ``User: ...\n\nAssistant: ...``, one turn a paragraph."""
        text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
        if add_generation_prompt:
            text += "Assistant:"
        return self.encode(text) if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        if self._vocab is None:
            by_id = getattr(self.tokenizer, "id_to_bytes", None)
            if by_id is None and hasattr(self.tokenizer, "_tok"):
                self._vocab = self.tokenizer._tok.get_vocab()
            else:
                by_id = by_id or {i: bytes([i]) for i in range(256)}
                self._vocab = {b.decode("utf-8", errors="replace"): i for i, b in by_id.items()}
        return self._vocab


def for_mlx_lm(tokenizer):
    """mlx-lm's ``TokenizerWrapper`` around one of our tokenizers (for its generate functions)."""
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    return TokenizerWrapper(HFStyle(tokenizer), eos_token_ids=sorted(tokenizer.eos_token_ids))
