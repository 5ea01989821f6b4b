"""Where training and evaluation data come from, record by record: a ``.jsonl`` file in one of
mlx-lm's formats (``text``, ``messages``, ``prompt``/``completion``, and ``prompt``/``chosen``/
``rejected`` pairs), an mlx-lm data folder's split, a SQLite database with a query of
``(conversation, role, content)`` rows, or Foundry's pre-tokenized binary (``read_bin``,
``write_bin``; it carries no mask). A bad record is a ``BadRecord`` in the stream, so that the
reader decides whether to stop or to skip it."""

from __future__ import annotations

import json
import os
import sqlite3
import urllib.parse
from collections.abc import Callable, Iterator, Sequence

from mlx_rwkvx.errors import DataError, in_words
from mlx_rwkvx.io.atomic import CheckpointError, atomic_target, check_target

import numpy as np

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


# (where, format, the record or a BadRecord, bytes read so far)
Record = tuple[str, str, object, int]


class BadRecord(Exception):
    """A problem with one record; ``load_examples`` puts where it is in front (``BadRecord(None)``:
    the record's ``where`` is the whole message)."""


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
        check_target(
            path,
            overwrite=overwrite,
            folder=False,
            recognise=is_bin,
            kind="a pre-tokenized .bin (its counts do not fit its size)",
        )
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


def source_kind(path: str, sql: str | None) -> str:
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
        raise BadRecord(f"expected a JSON object, got {type(record).__name__}")
    found = [name for name, keys in FORMATS if all(k in record for k in keys)]
    if len(found) > 1:
        fields_ = " and ".join("/".join(repr(k) for k in dict(FORMATS)[f]) for f in found)
        raise BadRecord(
            f"holds the fields of several formats ({fields_}): keep the one to train on"
        )
    if fmt is None:
        if not found:
            kinds = "; ".join(in_words(map(repr, keys)) for _, keys in FORMATS)
            raise BadRecord(
                f"expected the fields of one format ({kinds}); the keys are {sorted(record)[:8]}"
            )
        return found[0]
    missing = [k for k in dict(FORMATS)[fmt] if k not in record]
    if missing:
        raise BadRecord(
            f"no '{missing[0]}' field (this file holds {fmt} records, as on line {fmt_line}); "
            f"the keys are {sorted(record)[:8]}"
        )
    return fmt


def jsonl_records(path: str) -> Iterator[Record]:
    """Each non-blank line; a bad line's record is a BadRecord."""
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
                yield where, "", BadRecord(f"not valid JSON ({e})"), done
                continue
            except RecursionError:
                yield where, "", BadRecord("JSON nested too deeply to read"), done
                continue
            except BadRecord as e:
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


def sqlite_records(path: str, sql: str) -> Iterator[Record]:
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
            yield problem, "", BadRecord(None), done
        else:
            where = f"{path}: conversation {conv!r} (row {first_row})"
            yield where, "messages", {"messages": messages}, done


def bin_records(path: str, skip_bad: bool) -> Iterator[Record]:
    records, problem, lost = _parse_bin(path)
    if problem and not skip_bad:
        raise DataError(problem)
    done = 4
    for i, tokens in enumerate(records, 1):
        done += 4 * (1 + len(tokens))
        yield f"{path}: record {i}", "bin", tokens, done
    for _ in range(lost):
        yield problem, "", BadRecord(None), done
