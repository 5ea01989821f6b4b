"""Tokenizers: RWKV World (greedy longest match over the shipped vocabulary), Hugging Face
``tokenizer.json`` (through ``tokenizers``), and plain bytes for tiny models.

Each has ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``eos_token_ids``, ``files`` (what ``save`` copies beside the weights), ``special_token_ids``
and ``encode_plain`` (special-token text as text: a chat message's), and the part of the
Hugging Face tokenizer surface that mlx-lm reads, so ``mlx_lm.generate.stream_generate`` takes
them as they are. The World and byte tokenizers also ``encode_bytes``/``decode_bytes``, which
round-trip any byte string, invalid UTF-8 included.
"""

from __future__ import annotations

import ast
import json
import os
from importlib import resources

from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.hub import resolve_model

WORLD_VOCAB = "rwkv_vocab_v20230424.txt"
# what a Hugging Face tokenizer folder may hold beside tokenizer.json (transformers 5 writes the
# chat template to its own file)
HF_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)


RWKV_ROLES = ("system", "user", "assistant")  # the turns RWKV's chat format has names for


def rwkv_chat_text(messages: list[dict], add_generation_prompt: bool = True) -> str:
    """RWKV's plain chat format: ``User: ...\n\nAssistant: ...\n\n``, one turn a paragraph
    (``System: ...`` first where there is one), and ``Assistant:`` to prompt an answer. Another
    role is a ValueError (it would become a speaker the model never saw, ``Wizard:``)."""
    for m in messages:
        if m["role"] not in RWKV_ROLES:
            raise ValueError(
                f"role {m['role']!r}: RWKV's chat format has {', '.join(RWKV_ROLES)} turns only "
                "(a tokenizer's own chat template may take others)"
            )
    text = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages)
    return text + "Assistant:" if add_generation_prompt else text


class _MlxLmSurface:
    """What mlx-lm's ``TokenizerWrapper`` reads of a Hugging Face tokenizer: ``encode`` with
    ``add_special_tokens`` (we add none), ``decode``, ``eos_token_id``, ``bos_token``,
    ``chat_template``, ``apply_chat_template`` and ``get_vocab``."""

    bos_token = None
    bos_token_id = None
    chat_template = None
    eos_token_ids: set[int] = set()
    # no text spells a special token of World (id 0 has no bytes) or of bytes (NUL is a byte)
    special_token_ids: frozenset[int] = frozenset()

    def encode_plain(self, text: str) -> list[int]:
        """``text`` with any special-token text in it spelled as text (as ``encode`` here)."""
        return self.encode(text)

    @property
    def eos_token_id(self) -> int | None:
        return min(self.eos_token_ids) if self.eos_token_ids else None

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **_):
        """RWKV's plain chat format (``rwkv_chat_text``)."""
        text = rwkv_chat_text(messages, add_generation_prompt)
        return self.encode(text) if tokenize else text

    def get_vocab(self) -> dict[str, int]:
        if getattr(self, "_vocab", None) is None:
            self._vocab = self._make_vocab()
        return self._vocab

    def _make_vocab(self) -> dict[str, int]:
        by_id = self.id_to_bytes
        return {b.decode("utf-8", errors="replace"): i for i, b in by_id.items()}


class WorldTokenizer(_MlxLmSurface):
    """RWKV World: 65529 byte strings (ids 1..65529), id 0 ends a text. Encoding takes, at each
    position, the longest vocabulary entry that matches (a byte trie), as BlinkDL's does."""

    name = "world"
    eos_token_ids = {0}

    def __init__(self, vocab_path: str | None = None):
        if vocab_path is None:
            vocab_path = str(resources.files("mlx_rwkvx.io").joinpath("data", WORLD_VOCAB))
        try:
            with open(vocab_path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"{vocab_path}: cannot read the World vocabulary ({e})") from e
        self.files = {WORLD_VOCAB: vocab_path}
        self.id_to_bytes: dict[int, bytes] = {}
        self._trie: dict = {}
        for line_no, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                first, last = line.index(" "), line.rindex(" ")
                token = ast.literal_eval(line[first:last].strip())  # a str or bytes literal only
                token = token.encode("utf-8") if isinstance(token, str) else token
                idx, length = int(line[:first]), int(line[last:])
            except (ValueError, SyntaxError, UnicodeEncodeError):
                token, idx, length = None, None, None
            if not isinstance(token, bytes) or len(token) != length or not 0 < idx < 1 << 20:
                raise ValueError(f"{vocab_path}:{line_no}: malformed entry {line[:60]!r}")
            self.id_to_bytes[idx] = token
            node = self._trie
            for byte in token:
                node = node.setdefault(byte, {})
            node[None] = idx
        if not self.id_to_bytes:
            raise ValueError(f"{vocab_path}: the World vocabulary is empty")
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_bytes(_utf8(text))

    def decode_bytes(self, ids) -> bytes:
        try:
            return b"".join(self.id_to_bytes[int(i)] for i in ids if int(i) != 0)
        except KeyError as e:
            raise ValueError(f"World tokenizer: unknown token id {e.args[0]}") from e

    def decode(self, ids, **_) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


def _utf8(text) -> bytes:
    if not isinstance(text, str):
        raise TypeError(f"tokenizer: expected a str to encode, got {type(text).__name__}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"tokenizer: the text is not valid Unicode ({e.reason} at {e.start})"
        ) from e


class ByteTokenizer(_MlxLmSurface):
    """Bytes as tokens (id 0, NUL, ends a text): for tiny test models. A model with fewer than
    256 tokens gets the bytes below its ``vocab_size``; encoding any other byte is an error."""

    name = "bytes"
    eos_token_ids = {0}
    files: dict[str, str] = {}

    def __init__(self, vocab_size: int = 256):
        self.vocab_size = min(vocab_size, 256)
        self.id_to_bytes = {i: bytes([i]) for i in range(self.vocab_size)}

    def encode_bytes(self, data: bytes) -> list[int]:
        ids = list(data)
        bad = sorted({i for i in ids if i >= self.vocab_size})
        if bad:
            raise ValueError(
                f"byte tokenizer: bytes {[hex(b) for b in bad[:5]]} are not in this model's "
                f"vocabulary of {self.vocab_size} tokens"
            )
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.encode_bytes(_utf8(text))

    def decode_bytes(self, ids) -> bytes:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(
                f"byte tokenizer: token ids {bad[:5]} outside 0..{self.vocab_size - 1}"
            )
        return bytes(ids)

    def decode(self, ids, **_) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")


class HFTokenizer(_MlxLmSurface):
    """A Hugging Face ``tokenizer.json`` (e.g. Qwen2's) through the ``tokenizers`` library."""

    name = "hf"

    def __init__(self, folder: str):
        from tokenizers import Tokenizer

        path = os.path.join(folder, "tokenizer.json")
        try:
            self._tok = Tokenizer.from_file(path)
        except Exception as e:  # the library raises its own Exception subclass for any problem
            raise ValueError(f"{path}: cannot load tokenizer ({e})") from e
        self.folder, self._hf, self._plain = folder, None, None
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_token_ids = frozenset(
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        )
        self.eos_token_ids = self._eos_ids(folder)
        self.bos_token, self.bos_token_id = self._bos(folder)
        self.files = {
            name: os.path.join(folder, name)
            for name in HF_TOKENIZER_FILES
            if os.path.isfile(os.path.join(folder, name))
        }

    def _bos(self, folder: str) -> tuple[str | None, int | None]:
        """The BOS token of ``tokenizer_config.json`` (Qwen2 has none), and its id."""
        path = os.path.join(folder, "tokenizer_config.json")
        try:
            with open(path) as f:
                value = json.load(f).get("bos_token")
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, AttributeError) as e:
            raise ValueError(f"{path}: cannot read bos_token ({e})") from e
        if isinstance(value, dict):
            value = value.get("content")
        tid = self._tok.token_to_id(value) if isinstance(value, str) else None
        return (value, tid) if tid is not None else (None, None)

    def _eos_ids(self, folder: str) -> set[int]:
        names = []
        for fname, key in (
            ("generation_config.json", "eos_token_id"),
            ("tokenizer_config.json", "eos_token"),
            ("config.json", "eos_token_id"),
        ):
            path = os.path.join(folder, fname)
            if os.path.exists(path):
                try:
                    with open(path) as f:
                        value = json.load(f).get(key)
                except (OSError, ValueError, AttributeError) as e:
                    raise ValueError(f"{path}: cannot read {key} ({e})") from e
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

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        _utf8(text)
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_plain(self, text: str) -> list[int]:
        """``text`` with special-token text (``<|im_end|>``) spelled as text, not as the
        special token. A second ``Tokenizer`` does it: ``encode_special_tokens`` is a setting
        of the whole tokenizer, which other threads encode with at the same time."""
        _utf8(text)
        if self._plain is None:
            plain = type(self._tok).from_str(self._tok.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids, **_) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"tokenizer: token ids {bad[:5]} outside 0..{self.vocab_size - 1}")
        return self._tok.decode(ids, skip_special_tokens=False)

    def _make_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    @property
    def chat_template(self) -> str | None:
        """The folder's chat template (``chat_template.jinja`` or ``tokenizer_config.json``)."""
        path = os.path.join(self.folder, "chat_template.jinja")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                return f.read()
        config = os.path.join(self.folder, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                template = json.load(f).get("chat_template")
            return template if isinstance(template, str) else None
        return None

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, **kw):
        """The tokenizer's own chat template through transformers (which mlx-lm brings), or
        RWKV's plain format when it has none."""
        if self.chat_template is None:
            return super().apply_chat_template(messages, add_generation_prompt, tokenize)
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            self._hf = PreTrainedTokenizerFast(
                tokenizer_file=os.path.join(self.folder, "tokenizer.json")
            )
            self._hf.chat_template = self.chat_template
        text = self._hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **kw
        )
        return self.encode(text) if tokenize else text


BUILT_IN = ("world", "bytes")  # tokenizers named, not found in a file


def builtin_tokenizer(vocab_size: int):
    """The tokenizer a vocabulary size implies: RWKV World for 65536, bytes for <= 256; None
    for any other size."""
    if vocab_size == 65536:
        return WorldTokenizer()
    return ByteTokenizer(vocab_size) if vocab_size <= 256 else None


def token_byte_lengths(tokenizer, vocab_size: int):
    """``lengths[id]``: the UTF-8 bytes token ``id`` spells (0 for special tokens and ids the
    tokenizer lacks), so that a loss over targets is measured per byte of their text (bits per
    byte). World and byte tokens are bytes; a byte-level BPE token (Qwen2's, GPT-2's) maps its
    characters back to bytes; any other tokenizer's token is decoded alone (approximate where
    its decoder joins tokens, e.g. SentencePiece's leading spaces)."""
    import numpy as np

    lengths = np.zeros(vocab_size, dtype=np.int64)
    eos = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    table = getattr(tokenizer, "id_to_bytes", None)
    if table is not None:  # World, bytes
        for i, token in table.items():
            if i < vocab_size and i not in eos:
                lengths[i] = len(token)
        return lengths
    tok = tokenizer._tok
    special = {i for i, t in tok.get_added_tokens_decoder().items() if t.special} | eos
    byte_level = type(tok.decoder).__name__ == "ByteLevel"
    if byte_level:
        from transformers.convert_slow_tokenizer import bytes_to_unicode

        to_byte = {c: b for b, c in bytes_to_unicode().items()}
    for i in range(min(vocab_size, tokenizer.vocab_size)):
        if i in special:
            continue
        piece = tok.id_to_token(i)
        if piece is None:
            continue
        if byte_level and all(c in to_byte for c in piece):
            lengths[i] = len(piece)  # one character per byte
        else:
            lengths[i] = len(tok.decode([i], skip_special_tokens=False).encode("utf-8"))
    return lengths


def resolve_tokenizer(spec: str, vocab_size: int | None = None):
    """The one resolver every command uses. ``spec``: ``world`` or ``bytes``; a
    ``tokenizer.json`` or World vocabulary file; a checkpoint (its folder, or the folder of its
    file) or a tokenizer folder: its ``tokenizer.json``, else its World vocabulary, else the
    tokenizer ``vocab_size`` implies (``builtin_tokenizer``). ValueError when none fits, or when
    the tokenizer has more tokens than ``vocab_size`` (it belongs to another model)."""
    if spec == "world":
        return WorldTokenizer()
    if spec == "bytes":
        return ByteTokenizer(256 if vocab_size is None else vocab_size)
    try:  # a Hugging Face name: its tokenizer files in the hub's cache
        spec = resolve_model(spec, weights=False)
    except CheckpointError as e:
        raise ValueError(str(e)) from e
    if os.path.isfile(spec) and os.path.basename(spec) == "tokenizer.json":
        tokenizer = HFTokenizer(os.path.dirname(spec) or ".")
    elif os.path.isfile(spec) and spec.endswith(".txt"):
        tokenizer = WorldTokenizer(spec)
    else:
        folder = spec if os.path.isdir(spec) else os.path.dirname(spec) or "."
        if not os.path.exists(spec):
            raise ValueError(f"{spec}: no such file or folder (a tokenizer, 'world' or 'bytes')")
        if os.path.exists(os.path.join(folder, "tokenizer.json")):
            tokenizer = HFTokenizer(folder)
        elif os.path.exists(os.path.join(folder, WORLD_VOCAB)):
            tokenizer = WorldTokenizer(os.path.join(folder, WORLD_VOCAB))
        elif vocab_size is not None and builtin_tokenizer(vocab_size) is not None:
            return builtin_tokenizer(vocab_size)
        elif vocab_size is None:
            raise ValueError(
                f"{spec}: no tokenizer.json or {WORLD_VOCAB} here (or give 'world' or 'bytes')"
            )
        else:
            raise ValueError(
                f"{spec}: no tokenizer.json beside the checkpoint, and vocab_size {vocab_size} is "
                "neither RWKV World's (65536) nor bytes' (<= 256)"
            )
    if vocab_size is not None and tokenizer.vocab_size > vocab_size:
        raise ValueError(
            f"{spec}: the tokenizer has {tokenizer.vocab_size} tokens, more than the model's "
            f"{vocab_size}: it belongs to another model"
        )
    return tokenizer


def load_tokenizer(path: str, vocab_size: int):
    """The tokenizer of the checkpoint at ``path`` (``resolve_tokenizer``)."""
    return resolve_tokenizer(path, vocab_size)


def tokenizer_files_beside(path: str) -> list[str]:
    """The tokenizer files in the folder of checkpoint ``path`` (none: it has no tokenizer of
    its own)."""
    folder = path if os.path.isdir(path) else os.path.dirname(path) or "."
    return [n for n in ("tokenizer.json", WORLD_VOCAB) if os.path.exists(os.path.join(folder, n))]


def byte_tokenizer_files(folder: str, vocab_size: int = 256) -> dict[str, str]:
    """The byte tokenizer in Hugging Face's form, written into ``folder``: ``tokenizer.json``
    (byte-level BPE without merges: each UTF-8 byte its own token, id = the byte, as
    ``ByteTokenizer`` encodes) and ``tokenizer_config.json`` (id 0 ends a text). Returns name
    -> path, for ``write_hf``'s ``extra_files``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    char = bytes_to_unicode()  # GPT-2's printable stand-in of each byte
    n = min(vocab_size, 256)
    tok = Tokenizer(models.BPE(vocab={char[b]: b for b in range(n)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    paths = {
        name: os.path.join(folder, name) for name in ("tokenizer.json", "tokenizer_config.json")
    }
    tok.save(paths["tokenizer.json"])
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": char[0],
        "model_max_length": 1 << 30,
        "clean_up_tokenization_spaces": False,
    }
    with open(paths["tokenizer_config.json"], "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2)
    return paths


def tokenizer_files(tokenizer) -> dict[str, str]:
    """What to copy beside a saved checkpoint so that it loads with ``tokenizer``: name ->
    source path (empty for bytes, and for None)."""
    return dict(getattr(tokenizer, "files", None) or {})
