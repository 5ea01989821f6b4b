"""Training data into examples (``load_examples``): a ``.jsonl`` file in one of mlx-lm's
formats (``text``, ``messages``: the assistant turns trained, ``prompt``/``completion``), an
mlx-lm data folder's split, a SQLite database with a query of ``(conversation, role,
content)`` rows, or Foundry's pre-tokenized binary (``read_bin``, ``write_bin``; it carries no
mask). Bad data raises one ``DataError`` naming the file and the line, row or record, or is
skipped and counted (``skip_bad``). Batches of examples: ``tuner/batches.py``."""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from mlx_rwkvx.errors import DataError, in_words
from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, check_target
from mlx_rwkvx.io.tokenizers import ByteTokenizer, WorldTokenizer

import numpy as np

IGNORE_INDEX = -100  # targets the loss skips (padding, prompts): PyTorch's and mlx-lm's value
SPLITS = ("train", "valid", "test")  # the files of an mlx-lm data folder
SQLITE_MAGIC = b"SQLite format 3\x00"
MAX_TOKEN_ID = 2**31 - 1  # ids travel as int32
# a JSONL file's format, by the field that marks it (checked in this order, as mlx-lm does)
FORMATS = (
    ("messages", ("messages",)),
    ("completion", ("prompt", "completion")),
    ("text", ("text",)),
    ("preference", ("prompt", "chosen", "rejected")),  # tuner/preference.py reads these
)

Progress = Callable[[int, "int | None", int], None]  # (bytes done, bytes in all, records read)
Record = tuple[str, str, object, int]  # (where, format, the record or a _Bad, bytes read so far)


class _Bad(Exception):
    """A problem with one record; ``load_examples`` puts where it is in front (``_Bad(None)``:
    the record's ``where`` is the whole message)."""


@dataclass(eq=False)
class Example:
    """One training text. ``tokens`` int32 [n]; ``trained`` bool [n]: token i is a target the
    loss counts, predicted from ``tokens[:i]`` (``trained[0]`` is always False). ``source``
    names where it came from (``train.jsonl:12``)."""

    tokens: np.ndarray
    trained: np.ndarray
    source: str = ""
    cut_from: int = 0  # its length before it was cut to max_seq_len + 1 tokens (0: not cut)

    def __len__(self) -> int:
        return len(self.tokens)


# ----- the pre-tokenized binary ----------------------------------------------------------------


def write_bin(path: str, token_lists: Sequence, *, overwrite: bool = True) -> None:
    """Write Foundry's pre-tokenized binary: ``[n: u32] ([len: u32] [tokens: u32 x len]) x n``,
    little endian. The file appears whole or not at all (written beside, then renamed); an
    existing file is replaced only with ``overwrite`` and only when it is such a binary
    (``is_bin``: the format has no header, so its counts must add up to its size)."""
    parts = [np.array([len(token_lists)], dtype="<u4")]
    for i, tokens in enumerate(token_lists):
        arr = np.asarray(tokens)
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise ValueError(f"write_bin: sequence {i} is not a 1-D array of integer token ids")
        if arr.size and (arr.min() < 0 or arr.max() > 0xFFFFFFFF):
            raise ValueError(f"write_bin: sequence {i} holds ids outside u32")
        parts += [np.array([arr.size], dtype="<u4"), arr.astype("<u4")]
    try:
        check_target(path, overwrite=overwrite, folder=False, recognise=is_bin,
                     kind="a pre-tokenized .bin (its counts do not fit its size)")  # fmt: skip
        with atomic_target(path, folder=False) as tmp, open(tmp, "wb") as f:
            f.write(np.concatenate(parts).tobytes())
    except CheckpointError as e:
        raise DataError(str(e)) from e


def is_bin(path: str) -> bool:
    """Whether ``path`` is a pre-tokenized binary: its record count and lengths add up to
    exactly its size (the format has no header to recognise it by)."""
    try:
        words = np.memmap(path, dtype="<u4", mode="r") if os.path.getsize(path) >= 4 else None
    except (OSError, ValueError):
        return False
    if words is None or os.path.getsize(path) % 4:
        return False
    n, pos = int(words[0]), 1
    for _ in range(n):
        if pos >= words.size:
            return False
        pos += 1 + int(words[pos])
    return pos == words.size


def _parse_bin(path: str) -> tuple[list[np.ndarray], str | None, int]:
    """(complete records as uint32 arrays, the problem if the file is damaged, records lost)."""
    raw = np.fromfile(path, dtype=np.uint8)
    if raw.size < 4:
        return [], f"{path}: truncated: {raw.size} bytes, too short for the record count", 0
    words = raw[: raw.size // 4 * 4].view("<u4")
    n, pos, records = int(words[0]), 1, []
    for i in range(n):
        if pos >= words.size:
            return records, f"{path}: truncated after record {i} of {n}", n - i
        length = int(words[pos])
        if pos + 1 + length > words.size:
            left = raw.size - 4 * (pos + 1)
            problem = (
                f"{path}: record {i + 1} of {n} is truncated: {length} tokens, {left} bytes left"
            )
            return records, problem, n - i
        records.append(words[pos + 1 : pos + 1 + length])
        pos += 1 + length
    if 4 * pos != raw.size:
        extra = raw.size - 4 * pos
        return records, f"{path}: {extra} bytes after its {n} records (a damaged file?)", 1
    return records, None, 0


def read_bin(path: str) -> list[np.ndarray]:
    """The token sequences of a pre-tokenized binary (uint32 arrays). A truncated file, or one
    with bytes after its last record, raises DataError."""
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    records, problem, _ = _parse_bin(path)
    if problem:
        raise DataError(problem)
    return records


# ----- reading examples ------------------------------------------------------------------------


def find_split(path: str, split: str = "train") -> str | None:
    """The file holding ``split`` of ``path``: a folder's ``<split>.jsonl`` or ``<split>.bin``
    (None when it has none); a file is itself, whatever the split (its caller chose it)."""
    if os.path.isdir(path):
        try:
            names = set(os.listdir(path))
        except OSError as e:
            raise DataError(f"{path}: cannot read the folder ({e.strerror or e})") from e
        found = []
        for name in (split + ".jsonl", split + ".bin"):
            p = os.path.join(path, name)
            if name in names and not os.path.exists(p):
                raise DataError(f"{p}: a broken symbolic link, or one that loops")
            if name in names:
                found.append(p)
        if len(found) > 1:
            raise DataError(f"{path}: holds both {split}.jsonl and {split}.bin: keep one")
        return found[0] if found else None
    if os.path.lexists(path) and not os.path.exists(path):
        raise DataError(f"{path}: a broken symbolic link, or one that loops")
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file or folder")
    return path


def _kind(path: str, sql: str | None) -> str:
    try:
        with open(path, "rb") as f:
            is_sqlite = f.read(len(SQLITE_MAGIC)) == SQLITE_MAGIC
    except OSError as e:  # no permission, a folder, a disk error
        raise DataError(f"{path}: cannot read it ({e.strerror or e})") from e
    if is_sqlite:
        if sql is None:
            raise DataError(
                f"{path}: a SQLite database: give a query (--sql) returning (conversation, role, "
                "content) rows"
            )
        return "sqlite"
    if sql is not None:
        raise DataError(f"{path}: --sql reads a SQLite database, and this is not one")
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".jsonl", ".bin"):
        raise DataError(f"{path}: expected a .jsonl file, a .bin file or a SQLite database")
    return ext[1:]


def _record_format(record, fmt: str | None, fmt_line: int) -> str:
    """The format of one JSONL record: the file's (``fmt``, set by its first good record from
    line ``fmt_line``) or, for the first, the one its fields mark."""
    if not isinstance(record, dict):
        raise _Bad(f"expected a JSON object, got {type(record).__name__}")
    found = [name for name, keys in FORMATS if all(k in record for k in keys)]
    if len(found) > 1:
        fields_ = " and ".join("/".join(repr(k) for k in dict(FORMATS)[f]) for f in found)
        raise _Bad(f"holds the fields of several formats ({fields_}): keep the one to train on")
    if fmt is None:
        if not found:
            kinds = "; ".join(in_words(map(repr, keys)) for _, keys in FORMATS)
            raise _Bad(f"expected the fields of one format ({kinds}); the keys are "
                       f"{sorted(record)[:8]}")  # fmt: skip
        return found[0]
    missing = [k for k in dict(FORMATS)[fmt] if k not in record]
    if missing:
        raise _Bad(
            f"no '{missing[0]}' field (this file holds {fmt} records, as on line {fmt_line}); "
            f"the keys are {sorted(record)[:8]}"
        )
    return fmt


def _jsonl_records(path: str) -> Iterator[Record]:
    """Each non-blank line; a bad line's record is a _Bad."""
    done, fmt, fmt_line = 0, None, 0
    with open(path, "rb") as f:
        for line_no, line in enumerate(f, 1):
            done += len(line)
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
                kind = _record_format(record, fmt, fmt_line)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
                yield where, "", _Bad(f"not valid JSON ({e})"), done
                continue
            except RecursionError:
                yield where, "", _Bad("JSON nested too deeply to read"), done
                continue
            except _Bad as e:
                yield where, "", e, done
                continue
            if fmt is None:
                fmt, fmt_line = kind, line_no
            yield where, kind, record, done


def _sqlite_text(raw: bytes) -> str | bytes:
    """SQLite TEXT as str; text that is not UTF-8 stays bytes, for its row to be reported."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def _sqlite_records(path: str, sql: str) -> Iterator[Record]:
    """A "messages" record for each conversation of the query's rows (bytes: of the contents)."""
    uri = "file:" + urllib.parse.quote(os.path.abspath(path)) + "?mode=ro"
    conversations: dict = {}  # id -> [first row, messages, problem, bytes of content]
    try:
        con = sqlite3.connect(uri, uri=True)
        con.text_factory = _sqlite_text
        try:
            cursor = con.execute(sql)
            columns = [d[0] for d in cursor.description or ()]
            if len(columns) != 3:
                raise DataError(
                    f"{path}: the query must return (conversation, role, content) rows; it "
                    f"returns {len(columns)} columns {columns}"
                )
            for row_no, (conv, role, content) in enumerate(cursor, 1):
                if conv not in conversations:
                    conversations[conv] = [row_no, [], None, 0]
                entry = conversations[conv]
                if entry[2] is not None:
                    continue
                if conv is None:
                    entry[2] = f"{path}: row {row_no}: the conversation is NULL"
                elif not isinstance(role, str) or not role:
                    entry[2] = f"{path}: row {row_no}: the role is {role!r}, expected a name"
                elif not isinstance(content, str):
                    kind = {type(None): "NULL", bytes: "not UTF-8 text"}.get(
                        type(content), type(content).__name__
                    )
                    entry[2] = f"{path}: row {row_no}: the content is {kind}, expected text"
                else:
                    entry[1].append({"role": role, "content": content})
                    entry[3] += len(content.encode("utf-8", "surrogatepass"))
        finally:
            con.close()
    except sqlite3.Error as e:
        raise DataError(f"{path}: the query failed: {e}") from e
    done = 0
    for conv, (first_row, messages, problem, size) in conversations.items():
        done += size
        if problem is not None:
            yield problem, "", _Bad(None), done
        else:
            where = f"{path}: conversation {conv!r} (row {first_row})"
            yield where, "messages", {"messages": messages}, done


def _bin_records(path: str, skip_bad: bool) -> Iterator[Record]:
    records, problem, lost = _parse_bin(path)
    if problem and not skip_bad:
        raise DataError(problem)
    done = 4
    for i, tokens in enumerate(records, 1):
        done += 4 * (1 + len(tokens))
        yield f"{path}: record {i}", "bin", tokens, done
    for _ in range(lost):
        yield problem, "", _Bad(None), done


def _encode(tokenizer, text: str) -> list[int]:
    try:
        return list(tokenizer.encode(text))
    except (ValueError, TypeError) as e:  # text the tokenizer cannot encode (bad Unicode, ...)
        raise _Bad(str(e)) from e


def _check_messages(messages) -> None:
    if not isinstance(messages, list) or not messages:
        raise _Bad("'messages' must be a non-empty list of {'role', 'content'} objects")
    for i, m in enumerate(messages, 1):
        if not isinstance(m, dict):
            raise _Bad(f"message {i} is a {type(m).__name__}, expected an object")
        if not isinstance(m.get("role"), str) or not m["role"]:
            raise _Bad(f"message {i} has no 'role'")
        if not isinstance(m.get("content"), str) and not (
            m.get("content") is None and m.get("tool_calls")
        ):
            raise _Bad(f"message {i} has no 'content' text")


def chat_example(tokenizer, messages: list[dict], tools=None) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 [n], trained bool [n]) of a conversation rendered by the tokenizer's chat
    template, the assistant turns trained. Raises ValueError when the template rewrites earlier
    turns or the tokenizer merges text across a turn's edge (no exact mask exists)."""
    try:
        tokens, trained = _chat(tokenizer, messages, tools)
    except _Bad as e:
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


def _chat(tokenizer, messages, tools, first: int = 0):
    # Chat turns are rendered by the tokenizer's apply_chat_template (a Hugging Face
    # tokenizer's own template, else RWKV's "User: ...\n\nAssistant: ...\n\n"). An assistant
    # turn's tokens run from the rendering of the conversation before it with the generation
    # prompt to the rendering that ends with it, each checked to be a token prefix of the
    # whole conversation's tokens: a template that rewrites earlier turns (or a tokenizer that
    # merges text across a turn's edge) is an error, never a wrong mask
    # (``first``: the assistant turns from message ``first`` on are trained, the earlier ones
    # are context: a preference pair's prompt)
    _check_messages(messages)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant" and i >= first]
    if not turns:
        roles = sorted({m["role"] for m in messages})
        raise _Bad(f"no assistant message to train on (the roles are {roles})")
    extra = {} if tools is None else {"tools": tools}

    def render(k: int, generation_prompt: bool) -> str:
        try:
            return tokenizer.apply_chat_template(
                messages[:k], add_generation_prompt=generation_prompt, tokenize=False, **extra
            )
        except (ImportError, OSError):
            raise
        except Exception as e:  # the template's own errors: jinja2's, raise_exception(), ...
            raise _Bad(f"the chat template fails on messages 1-{k}: {e}") from e

    whole = render(len(messages), False)
    ids = _encode(tokenizer, whole)
    ends = _greedy_token_ends(tokenizer, ids)

    def boundary(k: int, generation_prompt: bool) -> int:
        if k == len(messages) and not generation_prompt:
            return len(ids)
        text = render(k, generation_prompt)
        what = f"messages 1-{k}" if k else "no message"
        what += " and the generation prompt" if generation_prompt else ""
        if not whole.startswith(text):
            raise _Bad(
                f"the chat template rewrites earlier turns: the rendering of {what} is not a "
                "prefix of the whole conversation's, so no exact mask exists"
            )
        if ends is not None:
            n = ends.get(len(text.encode("utf-8", "surrogatepass")))
        else:
            prefix = _encode(tokenizer, text)
            n = len(prefix) if ids[: len(prefix)] == prefix else None
        if n is None:
            raise _Bad(
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


def _tokens_of(fmt: str, record, tokenizer) -> tuple[np.ndarray, np.ndarray]:
    """(tokens as int64, trained) of one record, before truncation."""
    if fmt == "bin":
        tokens = record.astype(np.int64)
        return tokens, np.arange(len(tokens)) > 0
    if fmt == "text":
        text = record["text"]
        if not isinstance(text, str):
            raise _Bad(f"'text' must be a string, got {type(text).__name__}")
        ids = _encode(tokenizer, text)
        if not ids:
            raise _Bad("empty example: the text has no tokens")
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is not None and eos in ids:  # the text would end in the middle
            at = ids.index(eos)
            what = "a NUL character" if isinstance(tokenizer, ByteTokenizer) else "text"
            raise _Bad(f"{what} at token {at} encodes to the end-of-text token (id {eos}): "
                       "remove it from the text")  # fmt: skip
        tokens = np.array(ids + ([] if eos is None else [eos]), dtype=np.int64)
        return tokens, np.arange(len(tokens)) > 0
    if fmt == "completion":
        prompt, completion = record["prompt"], record["completion"]
        for name, value in (("prompt", prompt), ("completion", completion)):
            if not isinstance(value, str):
                raise _Bad(f"'{name}' must be a string, got {type(value).__name__}")
        if not completion:
            raise _Bad("empty example: the completion is empty")
        messages = [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": completion},
        ]
        return _chat(tokenizer, messages, None)
    if fmt == "preference":
        raise _Bad("a preference record ('prompt', 'chosen', 'rejected'): supervised "
                   "training reads 'messages', 'prompt' and 'completion', or 'text'")  # fmt: skip
    return _chat(tokenizer, record["messages"], record.get("tools"))


def load_examples(
    path: str,
    tokenizer=None,
    *,
    split: str = "train",
    sql: str | None = None,
    max_seq_len: int | None = None,
    skip_bad: bool = False,
    vocab_size: int | None = None,
    on_skip: Callable[[DataError], None] | None = None,
    progress: Progress | None = None,
    mask_prompt: bool = True,
) -> tuple[list[Example], int]:
    """The examples of a file (``.jsonl``, ``.bin``, a SQLite database with ``sql``; read
    whatever ``split``) or of an mlx-lm folder's ``<split>.jsonl`` / ``<split>.bin``, each
    truncated to ``max_seq_len + 1`` tokens (None: whole); returns (examples, number of bad
    records skipped).

    ``tokenizer`` encodes text (not needed for ``.bin``). Token ids ``>= vocab_size`` (default:
    the tokenizer's) are bad data. Bad data raises one DataError naming the file and the line,
    row or record; with ``skip_bad`` it is skipped, counted and passed to ``on_skip``. No
    example left (an empty file, everything skipped) is an error too. ``progress(bytes done,
    bytes in all or None, records)`` is called as the file is read. ``mask_prompt=False``
    trains every token after the first (prompts too)."""
    if max_seq_len is not None and max_seq_len < 1:
        raise ValueError(f"max_seq_len must be >= 1, got {max_seq_len}")
    file = find_split(path, split)
    if file is None:
        raise DataError(
            f"{path}: no {split}.jsonl or {split}.bin (an mlx-lm data folder holds "
            "train.jsonl, valid.jsonl, test.jsonl)"
        )
    kind = _kind(file, sql)
    if kind != "bin" and tokenizer is None:
        raise DataError(
            f"{file}: text data needs a tokenizer, and the model has none (no tokenizer.json "
            "beside it): pre-tokenize the data, or put the tokenizer beside the model"
        )
    if vocab_size is None:
        vocab_size = getattr(tokenizer, "vocab_size", None)
    limit = min(vocab_size or MAX_TOKEN_ID + 1, MAX_TOKEN_ID + 1)
    if kind == "jsonl":
        records, total = _jsonl_records(file), os.path.getsize(file)
    elif kind == "sqlite":
        records, total = _sqlite_records(file, sql), None
    else:
        records, total = _bin_records(file, skip_bad), os.path.getsize(file)

    examples, skipped = [], 0
    try:
        for n_records, (where, fmt, record, done) in enumerate(records, 1):
            if progress is not None:
                progress(done, total, n_records)
            try:
                tokens, trained, cut_from = _example_of(fmt, record, tokenizer, limit,
                                                        max_seq_len, mask_prompt)  # fmt: skip
            except _Bad as e:
                error = DataError(where if e.args[0] is None else f"{where}: {e.args[0]}")
                if not skip_bad:
                    raise error from None
                skipped += 1
                if on_skip is not None:
                    on_skip(error)
                continue
            examples.append(Example(tokens.astype(np.int32), trained, where, cut_from))
    except OSError as e:  # no permission, a disk error
        raise DataError(f"{file}: cannot read it ({e.strerror or e})") from e
    if not examples:
        raise DataError(
            f"{file}: no examples" + (f" ({skipped} bad records skipped)" if skipped else "")
        )
    return examples, skipped


def _example_of(fmt, record, tokenizer, limit: int, max_seq_len: int | None, mask_prompt: bool):
    """(tokens, trained, length before the cut or 0) of one record; _Bad when it is bad."""
    if isinstance(record, _Bad):
        raise record
    tokens, trained = _tokens_of(fmt, record, tokenizer)
    if not mask_prompt:  # every token after the first is a target
        trained = np.arange(len(tokens)) > 0
    if tokens.size < 2:
        raise _Bad(f"empty example: {tokens.size} tokens, nothing to predict")
    bad = np.flatnonzero((tokens >= limit) | (tokens < 0))
    if bad.size:
        raise _Bad(
            f"token id {tokens[bad[0]]} at position {bad[0]} is beyond the vocabulary "
            f"of {limit} tokens"
        )
    if not trained.any():
        raise _Bad("empty example: no token to train on")
    if max_seq_len is None or tokens.size <= max_seq_len + 1:
        return tokens, trained, 0
    first = int(np.argmax(trained))
    if first > max_seq_len:
        raise _Bad(
            f"nothing to train on within max_seq_len {max_seq_len}: the first "
            f"trained token is token {first} (a prompt of {first} tokens)"
        )
    return tokens[: max_seq_len + 1], trained[: max_seq_len + 1], tokens.size


def cut_note(examples: Sequence[Example], max_seq_len: int | None, flag: str) -> str | None:
    """One line on the examples cut to ``max_seq_len`` (None when none was)."""
    cut = [e.cut_from for e in examples if e.cut_from]
    if not cut:
        return None
    return (f"note: {len(cut):,} of {len(examples):,} examples are longer than {flag} "
            f"{max_seq_len} and were cut to {max_seq_len + 1} tokens (the longest had "
            f"{max(cut):,})")  # fmt: skip
