"""Tokenizers: World equals greedy longest match; all round-trip ASCII, CJK, emoji, bad UTF-8."""

from mlx_rwkvx.io.tokenizers import ByteTokenizer, HFTokenizer, WorldTokenizer, load_tokenizer

import pytest
from helpers import TEXTS, bpe_tokenizer

BAD_UTF8 = [b"\xff\xfe\x00abc", b"\xc3\x28", b"ok \xe2\x82 cut", b"\xf0\x9f\x98"]


@pytest.fixture(scope="module")
def world():
    return WorldTokenizer()


def greedy_longest_match(tok: WorldTokenizer, data: bytes) -> list[int]:
    """The reference algorithm, written independently: at each position the longest entry."""
    table = {b: i for i, b in tok.id_to_bytes.items()}
    longest = max(len(b) for b in table)
    ids, i = [], 0
    while i < len(data):
        for n in range(min(longest, len(data) - i), 0, -1):
            if data[i : i + n] in table:
                ids.append(table[data[i : i + n]])
                i += n
                break
        else:
            raise AssertionError("no match")
    return ids


@pytest.mark.parametrize("text", TEXTS)
def test_world_round_trip_and_reference(world, text):
    ids = world.encode(text)
    assert world.decode(ids) == text
    assert ids == greedy_longest_match(world, text.encode("utf-8"))


@pytest.mark.parametrize("data", BAD_UTF8)
def test_world_invalid_utf8_bytes_round_trip(world, data):
    ids = world.encode_bytes(data)
    assert world.decode_bytes(ids) == data
    assert ids == greedy_longest_match(world, data)


def test_world_vocabulary(world):
    assert len(world.id_to_bytes) == 65529 and world.vocab_size == 65530
    assert all(bytes([b]) in world.id_to_bytes.values() for b in range(256))
    assert world.encode(" the") == [world.encode(" the")[0]]  # a whole-word token
    with pytest.raises(ValueError, match="unknown token id 70000"):
        world.decode([70000])


def test_byte_tokenizer_round_trips():
    tok = ByteTokenizer()
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    for data in BAD_UTF8:
        assert tok.decode_bytes(tok.encode_bytes(data)) == data
    with pytest.raises(ValueError, match="outside 0..255"):
        tok.decode([256])


def test_hf_tokenizer_json(tmp_path):
    bpe_tokenizer(tmp_path)
    tok = load_tokenizer(str(tmp_path), vocab_size=400)
    assert isinstance(tok, HFTokenizer)
    for text in TEXTS:
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == {tok._tok.token_to_id("<|endoftext|>")}


def test_tokenizer_choice(tmp_path):
    assert isinstance(load_tokenizer(str(tmp_path), 65536), WorldTokenizer)
    assert isinstance(load_tokenizer(str(tmp_path), 256), ByteTokenizer)
    with pytest.raises(ValueError, match="no tokenizer.json beside the checkpoint"):
        load_tokenizer(str(tmp_path), 32000)


def test_mlx_lm_surface(world):
    # what mlx-lm's TokenizerWrapper reads, on our tokenizers themselves (no adapter needed)
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    assert world.eos_token_id == 0
    assert world.encode("hi", add_special_tokens=False) == world.encode("hi")
    chat = world.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat == "User: Hi\n\nAssistant:"
    assert world.get_vocab()[" the"] == world.encode(" the")[0]
    wrapped = TokenizerWrapper(world)
    assert wrapped.eos_token_ids == {0} and wrapped.decode(world.encode("héllo")) == "héllo"


def test_byte_tokenizer_for_a_smaller_vocabulary():
    # a model with fewer than 256 tokens: bytes it does not have are an error, never an id
    tok = ByteTokenizer(120)
    assert tok.vocab_size == 120 and tok.encode("Hi") == [72, 105]
    with pytest.raises(ValueError, match="not in this model's vocabulary of 120 tokens"):
        tok.encode("hi ~")  # '~' is byte 126
    with pytest.raises(ValueError, match="outside 0..119"):
        tok.decode([120])


def test_tokenizer_bigger_than_the_model(tmp_path):
    bpe_tokenizer(tmp_path)  # ~400 tokens
    with pytest.raises(ValueError, match=r"has \d+ tokens, more than the model's 300"):
        load_tokenizer(str(tmp_path), vocab_size=300)
