"""Training data: every format and its mask, every kind of bad data, batches, and pre-tokenizing.

Masks are checked with the byte tokenizer, where a token is a character, so the trained tokens
must spell exactly the assistant replies (or completions); the World and a Hugging Face
tokenizer with a chat template are checked on top.
"""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

from mlx_rwkvx import pretokenize
from mlx_rwkvx.data.batches import batches, count_batches, split_parts
from mlx_rwkvx.data.chat import chat_example
from mlx_rwkvx.data.examples import IGNORE_INDEX, Example, load_examples
from mlx_rwkvx.data.records import find_split, read_bin, write_bin
from mlx_rwkvx.errors import DataError
from mlx_rwkvx.io.tokenizers import ByteTokenizer, WorldTokenizer

import numpy as np
import pytest
from helpers import CHAT, CHATML, ROOT, CliError, chatml_tokenizer, cli


@pytest.fixture(scope="module")
def byte_tok():
    return ByteTokenizer()


@pytest.fixture(scope="module")
def world():
    return WorldTokenizer()


def write_jsonl(path: Path, records) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def trained_text(tok, example: Example) -> str:
    return tok.decode(example.tokens[example.trained])


# ----- formats and masks -----------------------------------------------------------------------


def test_text(tmp_path, byte_tok, world):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "Hello"}, {"text": "héllo wörld"}])
    (a, b), skipped = load_examples(str(path), byte_tok)
    assert skipped == 0 and a.source == f"{path}:1" and b.source == f"{path}:2"
    assert a.tokens.dtype == np.int32 and a.trained.dtype == bool
    assert a.tokens.tolist() == [*b"Hello", 0]  # the end of text appended
    assert a.trained.tolist() == [False] + [True] * 5  # the first token is never a target
    (w, _), _ = load_examples(str(path), world)
    assert w.tokens.tolist() == world.encode("Hello") + [0]


def test_chat_rwkv_convention(tmp_path, byte_tok, world):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    (ex,), _ = load_examples(str(path), byte_tok)
    assert byte_tok.decode(ex.tokens) == (
        "System: Be brief.\n\nUser: Hello, world!\n\nAssistant: How can I help you today?\n\n"
        "User: The fox?\n\nAssistant: Lazy dog.\n\n"
    )
    # the replies after "Assistant:", their "\n\n" included: exactly the assistant tokens
    assert trained_text(byte_tok, ex) == " How can I help you today?\n\n Lazy dog.\n\n"
    (ex,), _ = load_examples(str(path), world)
    assert trained_text(world, ex) == " How can I help you today?\n\n Lazy dog.\n\n"


def test_chat_hf_template(tmp_path):
    tok = chatml_tokenizer(tmp_path / "tok")
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    (ex,), _ = load_examples(str(path), tok)
    assert tok.decode(ex.tokens).startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert trained_text(tok, ex) == "How can I help you today?<|im_end|>\nLazy dog.<|im_end|>\n"
    im_end = tok._tok.token_to_id("<|im_end|>")
    assert ex.tokens[ex.trained].tolist().count(im_end) == 2  # the stop token is learned


def test_chat_hf_tokenizer_without_template_uses_rwkv_convention(tmp_path):
    tok = chatml_tokenizer(tmp_path / "tok", template=None)
    chat = [{"role": "user", "content": "The fox?"}, {"role": "assistant", "content": "Lazy dog."}]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": chat}])
    (ex,), _ = load_examples(str(path), tok)
    assert tok.decode(ex.tokens) == "User: The fox?\n\nAssistant: Lazy dog.\n\n"
    assert trained_text(tok, ex) == " Lazy dog.\n\n"


def test_template_that_rewrites_earlier_turns_is_an_error(tmp_path):
    # the count of messages heads the conversation: every prefix renders a different header
    tok = chatml_tokenizer(tmp_path / "tok", template="{{ messages | length }} messages\n" + CHATML)
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: the chat template rewrites earlier turns"):
        load_examples(str(path), tok)


class MergingTokenizer(ByteTokenizer):
    """Bytes, except ": " which is one token (256): it crosses the edge between RWKV's
    generation prompt "Assistant:" and the reply " ..."."""

    def __init__(self):
        super().__init__()
        self.vocab_size = 257

    def encode(self, text, add_special_tokens=False):
        ids = []
        for i, part in enumerate(text.split(": ")):
            ids += ([256] if i else []) + list(part.encode())
        return ids


def test_tokens_merged_across_a_turn_edge_are_an_error(tmp_path):
    tok = MergingTokenizer()
    assert tok.encode("a: b") == [97, 256, 98]
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    with pytest.raises(DataError, match=r"c\.jsonl:1: the tokens of messages 1-2 and the gen"):
        load_examples(str(path), tok)
    with pytest.raises(ValueError, match="merges text across the edge"):
        chat_example(tok, CHAT)


class GenericWorld(WorldTokenizer):
    """World seen as any tokenizer: each prefix encoded again, no greedy shortcut."""


class GenericBytes(ByteTokenizer):
    """Bytes seen as any tokenizer."""


@pytest.mark.parametrize("name", ["world", "bytes"])
def test_greedy_shortcut_agrees_with_encoding_prefixes(world, byte_tok, name):
    fast = world if name == "world" else byte_tok
    generic = object.__new__(GenericWorld if name == "world" else GenericBytes)
    generic.__dict__.update(fast.__dict__)  # the same vocabulary, without the shortcut
    rng = np.random.default_rng(0)
    pieces = ["a", " ", "\n", "\n\n", ":", ": ", "User", "Assistant", "你好", "é", "!", " the"]
    outcomes = set()
    for _ in range(300):
        roles = rng.choice(["system", "user", "assistant"], size=rng.integers(1, 6)).tolist()
        chat = [
            {"role": r, "content": "".join(rng.choice(pieces, rng.integers(0, 6)))} for r in roles
        ]
        results = []
        for tok in (fast, generic):
            try:
                tokens, trained = chat_example(tok, chat)
                results.append((tokens.tolist(), trained.tolist()))
            except ValueError as e:
                results.append(str(e))
        assert results[0] == results[1], chat
        outcomes.add(type(results[0]))
    assert outcomes == {tuple, str}  # masks, and conversations without an assistant turn


def test_prompt_completion(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2=", "completion": "4"}])
    (ex,), _ = load_examples(str(path), byte_tok)
    assert byte_tok.decode(ex.tokens) == "User: 2+2=\n\nAssistant: 4\n\n"
    assert trained_text(byte_tok, ex) == " 4\n\n"


def make_db(path: Path) -> Path:
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE messages (id INTEGER, conv TEXT, role TEXT, content TEXT)")
    rows = [  # two conversations, their rows interleaved
        (1, "b", "user", "Hi"),
        (2, "a", "user", "Yo"),
        (3, "b", "assistant", "Hello"),
        (4, "a", "assistant", "Hey"),
        (5, "b", "user", "Bye"),
        (6, "b", "assistant", "Ciao"),
    ]
    con.executemany("INSERT INTO messages VALUES (?, ?, ?, ?)", rows)
    con.commit()
    con.close()
    return path


def test_sqlite(tmp_path, byte_tok):
    db = str(make_db(tmp_path / "chat.db"))
    sql = "SELECT conv, role, content FROM messages ORDER BY id"
    (b, a), _ = load_examples(db, byte_tok, sql=sql)  # in the order they first appear
    assert byte_tok.decode(b.tokens) == (
        "User: Hi\n\nAssistant: Hello\n\nUser: Bye\n\nAssistant: Ciao\n\n"
    )
    assert trained_text(byte_tok, b) == " Hello\n\n Ciao\n\n"
    assert trained_text(byte_tok, a) == " Hey\n\n"
    assert b.source == f"{db}: conversation 'b' (row 1)"
    (a, b), _ = load_examples(db, byte_tok, sql=sql.replace("ORDER BY id", "ORDER BY conv, id"))
    assert trained_text(byte_tok, a) == " Hey\n\n"


def test_bin_round_trip(tmp_path):
    seqs = [np.arange(5), [7, 8], np.array([2**32 - 1], dtype=np.uint32), []]
    path = str(tmp_path / "t.bin")
    write_bin(path, seqs)
    raw = (tmp_path / "t.bin").read_bytes()
    assert raw[:8] == (4).to_bytes(4, "little") + (5).to_bytes(4, "little")
    assert len(raw) == 4 * (1 + 4 + 5 + 2 + 1)
    back = read_bin(path)
    assert [b.tolist() for b in back] == [list(range(5)), [7, 8], [2**32 - 1], []]
    write_bin(path, [np.arange(10), [3, 4, 5]])
    (a, b), _ = load_examples(path, max_seq_len=4)  # no tokenizer needed, every token trained
    assert a.tokens.tolist() == [0, 1, 2, 3, 4] and a.trained.tolist() == [False] + [True] * 4
    assert b.tokens.tolist() == [3, 4, 5] and b.source == f"{path}: record 2"


def test_truncation(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "abcdefghij"}])
    (ex,), _ = load_examples(str(path), byte_tok, max_seq_len=4)
    assert byte_tok.decode(ex.tokens) == "abcde"  # max_seq_len inputs, one more target
    long_prompt = {"prompt": "x" * 50, "completion": "y"}
    path = write_jsonl(tmp_path / "p.jsonl", [long_prompt])
    with pytest.raises(DataError, match=r"p\.jsonl:1: nothing to train on within max_seq_len 20"):
        load_examples(str(path), byte_tok, max_seq_len=20)
    (ex,), _ = load_examples(str(path), byte_tok, max_seq_len=200)
    assert trained_text(byte_tok, ex) == " y\n\n"


def test_mlx_lm_folder(tmp_path, byte_tok):
    write_jsonl(tmp_path / "train.jsonl", [{"text": "a b"}, {"text": "c d"}])
    write_jsonl(tmp_path / "valid.jsonl", [{"text": "e f"}])
    assert len(load_examples(str(tmp_path), byte_tok)[0]) == 2
    (ex,), _ = load_examples(str(tmp_path), byte_tok, split="valid")
    assert byte_tok.decode(ex.tokens[:-1]) == "e f"
    assert find_split(str(tmp_path), "test") is None
    with pytest.raises(DataError, match="no test.jsonl or test.bin"):
        load_examples(str(tmp_path), byte_tok, split="test")
    one = str(tmp_path / "train.jsonl")
    assert find_split(one, "train") == find_split(one, "valid") == one  # a file: itself
    assert len(load_examples(one, byte_tok, split="valid")[0]) == 2


def test_mask_shifts_into_targets(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "ab", "completion": "cd"}])
    (ex,), _ = load_examples(str(path), byte_tok)
    ((inputs, targets),) = list(batches([ex], batch_size=1, seed=0, epoch=0))
    tokens = ex.tokens.tolist()
    assert inputs.dtype == np.int32 and targets.dtype == np.int32
    assert inputs[0].tolist() == tokens[:-1]
    expected = [t if m else IGNORE_INDEX for t, m in zip(tokens[1:], ex.trained[1:], strict=True)]
    assert targets[0].tolist() == expected
    counted = "".join(chr(t) for t in targets[0] if t != IGNORE_INDEX)
    assert counted == " cd\n\n"  # the completion only: no prompt token is a target


# ----- bad data --------------------------------------------------------------------------------

GOOD = {"text": "fine"}
BAD_JSONL = [  # (name, bad line, message)
    ("malformed JSON", '{"text": "unclosed', r"t\.jsonl:2: not valid JSON"),
    ("not an object", "[1, 2]", r"t\.jsonl:2: expected a JSON object, got list"),
    ("missing column", {"txt": "typo"}, r"t\.jsonl:2: no 'text' field .*keys are \['txt'\]"),
    ("empty text", {"text": ""}, r"t\.jsonl:2: empty example"),
    ("text not a string", {"text": 3}, r"t\.jsonl:2: 'text' must be a string, got int"),
    ("bad unicode", '{"text": "\\ud800"}', r"t\.jsonl:2: .*not valid Unicode"),
]
BAD_CHAT = [
    ("no assistant", [{"role": "user", "content": "hi"}], r"c\.jsonl:2: no assistant message"),
    ("no content", [{"role": "user"}], r"c\.jsonl:2: message 1 has no 'content'"),
    ("no role", [{"content": "hi"}], r"c\.jsonl:2: message 1 has no 'role'"),
    ("empty", [], r"c\.jsonl:2: 'messages' must be a non-empty list"),
]


@pytest.mark.parametrize("name, line, message", BAD_JSONL, ids=[c[0] for c in BAD_JSONL])
def test_bad_jsonl(tmp_path, byte_tok, name, line, message):
    path = write_jsonl(tmp_path / "t.jsonl", [GOOD, line, GOOD])
    with pytest.raises(DataError, match=message) as info:
        load_examples(str(path), byte_tok)
    assert "\n" not in str(info.value)
    skipped_errors = []
    examples, skipped = load_examples(
        str(path), byte_tok, skip_bad=True, on_skip=skipped_errors.append
    )
    assert (len(examples), skipped) == (2, 1)
    assert [e.source for e in examples] == [f"{path}:1", f"{path}:3"]
    assert str(skipped_errors[0]) == str(info.value)


@pytest.mark.parametrize("name, messages, message", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat(tmp_path, byte_tok, name, messages, message):
    path = write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}, {"messages": messages}])
    with pytest.raises(DataError, match=message):
        load_examples(str(path), byte_tok)
    assert load_examples(str(path), byte_tok, skip_bad=True)[1] == 1


def test_token_id_beyond_the_vocabulary(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "ABC"}, {"text": "abc"}])
    with pytest.raises(DataError, match=r"t\.jsonl:2: token id 97 at position 0 is beyond the voc"):
        load_examples(str(path), byte_tok, vocab_size=96)  # a model smaller than the tokenizer
    bin_path = str(tmp_path / "t.bin")
    write_bin(bin_path, [[1, 2, 3], [4, 70000, 6], [7, 8]])
    with pytest.raises(DataError, match=r"t\.bin: record 2: token id 70000 at position 1"):
        load_examples(bin_path, vocab_size=65536)
    examples, skipped = load_examples(bin_path, vocab_size=65536, skip_bad=True)
    assert (len(examples), skipped) == (2, 1)


def test_empty_bin_record(tmp_path):
    path = str(tmp_path / "t.bin")
    write_bin(path, [[1, 2], [5], [3, 4]])
    with pytest.raises(DataError, match=r"t\.bin: record 2: empty example: 1 tokens"):
        load_examples(path)


def bin_bytes(*words: int) -> bytes:
    return np.array(words, dtype="<u4").tobytes()


BAD_BIN = [  # (name, file bytes, message, good records, skipped)
    ("empty file", b"", r"truncated: 0 bytes, too short for the record count", 0, 0),
    ("record cut", bin_bytes(2, 2, 5, 6, 3, 7), r"record 2 of 2 is truncated: 3 tokens", 1, 1),
    ("records missing", bin_bytes(3, 2, 5, 6), r"truncated after record 1 of 3", 1, 2),
    ("half a word", bin_bytes(1, 2, 5, 6) + b"\x01\x02", r"2 bytes after its 1 records", 1, 1),
]


@pytest.mark.parametrize("name, data, message, good, lost", BAD_BIN, ids=[c[0] for c in BAD_BIN])
def test_bad_bin(tmp_path, name, data, message, good, lost):
    path = tmp_path / "t.bin"
    path.write_bytes(data)
    with pytest.raises(DataError, match=r"t\.bin: " + message):
        read_bin(str(path))
    with pytest.raises(DataError, match=r"t\.bin: " + message):
        load_examples(str(path))
    if good:
        examples, skipped = load_examples(str(path), skip_bad=True)
        assert (len(examples), skipped) == (good, lost)


def test_bad_sqlite(tmp_path, byte_tok):
    db = make_db(tmp_path / "chat.db")
    with pytest.raises(DataError, match=r"chat\.db: the query failed: .*syntax error"):
        load_examples(str(db), byte_tok, sql="SELEC conv FROM messages")
    with pytest.raises(DataError, match=r"no such table: nope"):
        load_examples(str(db), byte_tok, sql="SELECT conv, role, content FROM nope")
    with pytest.raises(DataError, match=r"must return \(conversation, role, content\) rows; it re"):
        load_examples(str(db), byte_tok, sql="SELECT conv, content FROM messages")
    with pytest.raises(DataError, match=r"chat\.db: a SQLite database: give a query"):
        load_examples(str(db), byte_tok)
    con = sqlite3.connect(db)
    con.execute("INSERT INTO messages VALUES (7, 'c', 'user', NULL)")
    con.execute("INSERT INTO messages VALUES (8, 'c', 'assistant', 'ok')")
    con.execute("INSERT INTO messages VALUES (9, 'd', 'user', CAST(x'ff41' AS TEXT))")
    con.execute("INSERT INTO messages VALUES (10, 'd', 'assistant', 'ok')")
    con.commit()
    con.close()
    sql = "SELECT conv, role, content FROM messages ORDER BY id"
    with pytest.raises(DataError, match=r"chat\.db: row 7: the content is NULL, expected text"):
        load_examples(str(db), byte_tok, sql=sql)
    errors = []
    examples, skipped = load_examples(
        str(db), byte_tok, sql=sql, skip_bad=True, on_skip=errors.append
    )
    assert (len(examples), skipped) == (2, 2)
    assert str(errors[1]).endswith("chat.db: row 9: the content is not UTF-8 text, expected text")
    user_only = "SELECT conv, role, content FROM messages WHERE role = 'user' ORDER BY id"
    with pytest.raises(DataError, match=r"conversation 'b' \(row 1\): no assistant message"):
        load_examples(str(db), byte_tok, sql=user_only)
    write_jsonl(tmp_path / "t.jsonl", [GOOD])
    with pytest.raises(DataError, match="--sql reads a SQLite database, and this is not one"):
        load_examples(str(tmp_path / "t.jsonl"), byte_tok, sql=sql)
    with pytest.raises(DataError, match=r"nope\.db: no such file"):
        load_examples(str(tmp_path / "nope.db"), byte_tok, sql=sql)


def test_nothing_left(tmp_path, byte_tok):
    path = write_jsonl(tmp_path / "t.jsonl", ["oops"])
    with pytest.raises(DataError, match=r"t\.jsonl: no examples \(1 bad records skipped\)"):
        load_examples(str(path), byte_tok, skip_bad=True)
    (tmp_path / "e.jsonl").write_text("\n")
    with pytest.raises(DataError, match=r"e\.jsonl: no examples$"):
        load_examples(str(tmp_path / "e.jsonl"), byte_tok)
    (tmp_path / "t.txt").write_text("text")
    with pytest.raises(DataError, match=r"t\.txt: expected a \.jsonl file, a \.bin file or"):
        load_examples(str(tmp_path / "t.txt"), byte_tok)


# ----- batches ---------------------------------------------------------------------------------


def examples_of_lengths(lengths, seed=0) -> list[Example]:
    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(1, 1000, n).astype(np.int32)
        tokens[0] = i  # the first token names the example
        out.append(Example(tokens, np.arange(n) > 0, f"example {i}"))
    return out


def as_lists(batch_iter):
    return [(x.tolist(), y.tolist()) for x, y in batch_iter]


def test_batches_deterministic_resumable_and_complete():
    examples = examples_of_lengths(np.random.default_rng(1).integers(2, 60, 103))
    kw = dict(batch_size=8, seed=3, epoch=1)
    first = as_lists(batches(examples, **kw))
    assert first == as_lists(batches(examples, **kw))
    assert len(first) == count_batches(examples, 8) == 13  # the last batch holds 7
    assert as_lists(batches(examples, **kw, start=5)) == first[5:]
    assert as_lists(batches(examples, **kw, start=13)) == []
    assert first != as_lists(batches(examples, batch_size=8, seed=3, epoch=2))
    assert first != as_lists(batches(examples, batch_size=8, seed=4, epoch=1))
    seen = sorted(row[0] for x, _ in first for row in x)
    assert seen == list(range(103))  # every example once an epoch
    for x, y in first:
        for row_x, row_y in zip(x, y, strict=True):
            ex = examples[row_x[0]]
            n = len(ex.tokens) - 1
            assert row_x[:n] == ex.tokens[:-1].tolist() and set(row_x[n:]) <= {0}
            assert row_y[:n] == ex.tokens[1:].tolist() and set(row_y[n:]) <= {IGNORE_INDEX}
        assert max(len(examples[r[0]].tokens) for r in x) - 1 == len(x[0])  # T: longest - 1


def padding_fraction(batch_iter) -> float:
    padded = real = 0
    for _, targets in batch_iter:
        padded += targets.size
        real += int((targets != IGNORE_INDEX).sum())
    return 1 - real / padded


def test_batches_are_length_bucketed():
    lengths = np.random.default_rng(0).integers(2, 1000, 2000)
    examples = examples_of_lengths(lengths)
    bucketed = padding_fraction(batches(examples, batch_size=16, seed=0, epoch=0))
    # the same batches without bucketing: random groups of 16
    order = np.random.default_rng(0).permutation(len(lengths)).reshape(-1, 16)
    unbucketed = 1 - lengths.sum() / sum(16 * lengths[g].max() for g in order)
    assert bucketed < 0.03 and unbucketed > 0.3, (bucketed, unbucketed)


def test_pad_to_multiple_and_bad_arguments():
    examples = examples_of_lengths([5, 9, 30])
    shapes = [x.shape for x, _ in batches(examples, batch_size=3, seed=0, epoch=0)]
    assert shapes == [(3, 29)]
    ((x, y),) = batches(examples, batch_size=3, seed=0, epoch=0, pad_to_multiple=16)
    assert x.shape == y.shape == (3, 32) and (y[:, 29:] == IGNORE_INDEX).all()
    for bad in (dict(batch_size=0), dict(batch_size=2, start=-1), dict(batch_size=2, seed=-1)):
        kw = dict(seed=0, epoch=0) | bad
        with pytest.raises(ValueError, match="must be a"):
            next(batches(examples, **kw))


def test_split_parts():
    examples = examples_of_lengths([3] * 8)
    a, b = split_parts(examples, [3, 1])
    assert [e.tokens[0] for e in a] == list(range(6)) and [e.tokens[0] for e in b] == [6, 7]
    assert [len(s) for s in split_parts(examples_of_lengths([3] * 10), [1, 1, 1])] == [3, 4, 3]
    assert [len(s) for s in split_parts(examples, [6, 2])] == [6, 2]
    with pytest.raises(ValueError, match="part 1 would be empty"):
        split_parts(examples[:1], [1, 1])
    with pytest.raises(ValueError, match="must be positive numbers"):
        split_parts(examples, [1, 0])


# ----- pre-tokenizing --------------------------------------------------------------------------


def run_cli(*argv) -> str:
    # --skip-bad reports each record it skips before an error: notes, not the error
    return cli(pretokenize.main, *argv, notes="skipped")


def test_pretokenize_cli(tmp_path, world):
    texts = [f"document number {i}: " + "words " * i for i in range(10)]
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    expected, _ = load_examples(str(data), world, max_seq_len=8)
    out = tmp_path / "out" / "tokens.bin"
    report = run_cli("--tokenizer", "world", "--data", data, "--output", out, "--max-seq-len", 8)
    assert "10 examples" in report and "MB/s" in report
    assert [r.tolist() for r in read_bin(str(out))] == [e.tokens.tolist() for e in expected]
    run_cli("--tokenizer", "world", "--data", data, "--output", out, "--split", 2, "--overwrite")
    shards = [read_bin(str(tmp_path / "out" / f"tokens_{i}.bin")) for i in range(2)]
    assert [len(s) for s in shards] == [5, 5]
    run_cli(
        "--tokenizer",
        "world",
        "--data",
        data,
        "--output",
        out,
        "--split-weights",
        "6,2",
        "--overwrite",
    )
    assert [len(read_bin(str(tmp_path / "out" / f"tokens_{i}.bin"))) for i in range(2)] == [8, 2]
    assert (tmp_path / "out" / "tokens_1.bin").stat().st_size > 0
    # a .bin re-split needs no tokenizer; the result reads as training data
    run_cli("--data", out, "--output", tmp_path / "re.bin", "--split", 3)
    assert sum(len(load_examples(str(tmp_path / f"re_{i}.bin"))[0]) for i in range(3)) == 10


def test_pretokenize_folder(tmp_path, byte_tok):
    src = tmp_path / "src"
    src.mkdir()
    write_jsonl(src / "train.jsonl", [{"prompt": "a", "completion": "b"}] * 3)
    write_jsonl(src / "valid.jsonl", [{"text": "v"}])
    report = run_cli("--tokenizer", "bytes", "--data", src, "--output", tmp_path / "dst")
    assert "no mask: the prompts of 3 examples" in report
    (valid,), _ = load_examples(str(tmp_path / "dst"), split="valid")
    assert valid.tokens.tolist() == [ord("v"), 0]
    train, _ = load_examples(str(tmp_path / "dst"), byte_tok)
    assert byte_tok.decode(train[0].tokens) == "User: a\n\nAssistant: b\n\n"
    assert train[0].trained[1:].all()  # the binary carries no mask
    # a bad split anywhere: nothing is written, so the rerun after the fix is not refused
    (src / "valid.jsonl").write_text('{"text": "v"}\n{"text": \n')
    with pytest.raises(CliError, match=r"valid\.jsonl:2: not valid JSON"):
        run_cli("--tokenizer", "bytes", "--data", src, "--output", tmp_path / "dst2")
    assert not (tmp_path / "dst2").exists()


def test_pretokenize_cli_errors(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, "{bad", GOOD])
    out = tmp_path / "o.bin"
    base = ("--tokenizer", "bytes", "--data", data, "--output", out)
    with pytest.raises(CliError, match=r"error: .*d\.jsonl:2: not valid JSON"):
        run_cli(*base)
    assert not out.exists()  # nothing written
    report = run_cli(*base, "--skip-bad")
    assert "skipped 1 bad records" in report and len(read_bin(str(out))) == 2
    exists = r"o\.bin: already exists \(overwrite=True or --overwrite replaces it\)"
    with pytest.raises(CliError, match=exists):
        run_cli(*base, "--skip-bad")
    with pytest.raises(CliError, match="cannot split 2 examples into 3 parts"):
        run_cli(*base, "--skip-bad", "--split", 3)
    out = tmp_path / "p.bin"
    base = ("--tokenizer", "bytes", "--data", data, "--output", out)
    cases = [
        (("--data", tmp_path / "nope.jsonl", "--output", out), "nope.jsonl: no such file"),
        (("--data", data, "--output", out), "--tokenizer is needed"),
        ((*base, "--split-weights", "6,x"), "--split-weights: expected positive numbers"),
        ((*base, "--split", 2, "--split-weights", "1,1"), "not allowed with argument"),
        ((*base, "--max-seq-len", 0), "--max-seq-len must be at least 1, got 0"),
        (("--tokenizer", tmp_path, "--data", data, "--output", out), "no tokenizer.json or"),
    ]
    for argv, message in cases:
        with pytest.raises(CliError, match=message):
            run_cli(*argv)
        assert not out.exists()


def test_pretokenize_output_below_a_file(tmp_path):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD])
    (tmp_path / "f").write_text("mine")
    base = ("--tokenizer", "bytes", "--data", data)
    for output in (tmp_path / "f" / "o.bin", tmp_path / "f" / "sub" / "o.bin"):
        with pytest.raises(CliError, match=rf"{tmp_path / 'f'} is a file"):
            run_cli(*base, "--output", output)
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [GOOD, GOOD])
    with pytest.raises(CliError, match=rf"{tmp_path / 'f'} is a file"):
        run_cli("--tokenizer", "bytes", "--data", folder, "--output", tmp_path / "f" / "out")
    assert (tmp_path / "f").read_text() == "mine"


def test_pre_tokenize_script_takes_foundrys_flags(tmp_path):
    tok = chatml_tokenizer(tmp_path / "tok")
    data = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CHAT}] * 4)
    out = tmp_path / "tokens.bin"
    argv = ["--tokenizer", tmp_path / "tok" / "tokenizer.json", "--data", data, "--output", out]
    argv += ["--max-seq-len", "256", "--split-weights", "6,2"]
    script = ROOT / "scripts" / "pre_tokenize.py"
    done = subprocess.run(
        [sys.executable, str(script), *map(str, argv)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    (a, _, _), (d,) = (
        read_bin(str(tmp_path / "tokens_0.bin")),
        read_bin(str(tmp_path / "tokens_1.bin")),
    )
    assert tok.decode(d).startswith("<|im_start|>system\n") and a.tolist() == d.tolist()
    done = subprocess.run(
        [sys.executable, str(script), "--tokenizer", "world", "--data", str(tmp_path / "x.jsonl")],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and "--output" in done.stderr
