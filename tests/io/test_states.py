"""Saved states (mlx_rwkvx/io/states.py), the one file format of chat conversations and of the
server's --cache-dir: a round trip keeps every array; files of both formats before it (written
by the code of their time: tests/data/old_states) still load, through ``read_state``,
``Chat.load`` and ``PrefixCache``, and their states equal a prefill of their tokens; a tampered
file of any format (NaN, a wrong shape or dtype, another model, a token outside the
vocabulary, an unknown tensor) is refused with one CheckpointError naming the file and the
problem, and the prefix cache deletes it instead of resuming from it."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from pathlib import Path

from mlx_rwkvx.adapters.fingerprint import model_identity
from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.generation import Chat
from mlx_rwkvx.generation.prefix_cache import PrefixCache, folder_for
from mlx_rwkvx.io.states import (
    OLD_CHAT_FORMAT,
    OLD_PREFIX_FORMAT,
    STATE_FORMAT,
    read_header,
    read_state,
    save_state,
)
from mlx_rwkvx.io.tokenizers import ByteTokenizer
from mlx_rwkvx.server.served import state_key

import mlx.core as mx
import pytest
from helpers import tiny_model
from mlx.utils import tree_flatten

OLD = Path(__file__).resolve().parent.parent / "data" / "old_states"
PREFIX_TOKENS = list(b"a prefix of a conversation")  # make_old_states.py's


@pytest.fixture(scope="module")
def model():
    return tiny_model("rfa", seed=5)  # the model the old files were saved with


def prefill(model, tokens):
    h, state = model.hidden(mx.array([tokens], dtype=mx.int32))
    return state, model.head(h[:, -1]).astype(mx.float32)


def same_state(a, b, atol=1e-5) -> bool:
    fa, fb = dict(tree_flatten(a)), dict(tree_flatten(b))
    return fa.keys() == fb.keys() and all(
        fa[k].shape == fb[k].shape and mx.allclose(fa[k], fb[k], atol=atol).item() for k in fa
    )


def tamper(src, dst, change) -> str:
    """``src`` written again to ``dst`` with ``change(tensors, meta)`` applied."""
    tensors, meta = mx.load(str(src), return_metadata=True)
    mx.eval(tensors)  # read before ``dst`` (maybe ``src``) is written
    change(tensors, meta)
    mx.save_safetensors(str(dst), tensors, metadata=meta)
    return str(dst)


def test_a_saved_state_round_trips_private_and_checked(model, tmp_path):
    tokens = list(range(3, 40))
    state, logits = prefill(model, tokens)
    before, _ = prefill(model, tokens[:30])
    path = tmp_path / "s.safetensors"
    save_state(
        path,
        tokens,
        state,
        "me",
        logits=logits,
        meta={"kind": "test"},
        others={"before": (tokens[:30], before)},
    )
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600  # it holds a text's tokens
    header = read_header(path)
    assert (header.format, header.identity, header.kind) == (STATE_FORMAT, "me", "test")
    assert header.tokens == tuple(tokens)
    saved = read_state(path, model, "me")
    assert saved.tokens == tokens and same_state(saved.state, state, atol=0)
    assert mx.array_equal(saved.logits, logits) and saved.meta == {"kind": "test"}
    assert saved.others["before"][0] == tokens[:30]
    assert same_state(saved.others["before"][1], before, atol=0)
    # no token yet: no state (the model's initial one); an empty KV cache is not written
    save_state(path, [], None, "me")
    empty = read_state(path, model, "me")
    assert (empty.tokens, empty.state, empty.logits) == ([], None, None)
    notes = tmp_path / "notes.safetensors"
    notes.write_bytes(b"the user's own file")
    with pytest.raises(CheckpointError, match="not a saved state; refusing to replace it"):
        save_state(notes, tokens, state, "me")  # never replaces a file that is not a state
    assert notes.read_bytes() == b"the user's own file"


def test_an_old_conversation_file_loads(model):
    """``mlx_rwkvx.chat/1``, as Chat.save wrote it: the chat continues from its states, which
    equal a prefill of its tokens."""
    path = OLD / "chat-1.safetensors"
    assert read_header(path).format == OLD_CHAT_FORMAT
    chat = Chat(model, ByteTokenizer(), max_tokens=4)
    chat.load(path)
    assert chat.system == "be brief" and [m["role"] for m in chat.messages] == [
        "user",
        "assistant",
        "user",
        "assistant",
    ]
    tokens, state = chat.session.snapshot()
    assert len(tokens) == 85 and same_state(state, prefill(model, tokens)[0])
    before_tokens, before = chat._before_answer
    assert len(before_tokens) == 80 and same_state(before, prefill(model, before_tokens)[0])
    assert len(list(chat.ask("and once more"))) >= 1  # it goes on


def test_an_old_cache_dir_state_loads(model, tmp_path):
    """``mlx_rwkvx-prefix-state``, as a server's --cache-dir held it: a server started on the
    folder finds it, and resumes from its state and logits (those of a prefill)."""
    path = OLD / "prefix-state.safetensors"
    key = state_key(model, dtype=None, quantize=None, max_cache=2048)
    header = read_header(path)
    assert (header.format, header.identity, header.tokens) == (
        OLD_PREFIX_FORMAT,
        key,
        tuple(PREFIX_TOKENS),
    )
    folder = Path(folder_for(str(tmp_path), key))
    folder.mkdir(parents=True)
    name = hashlib.sha256(json.dumps([key, PREFIX_TOKENS]).encode()).hexdigest()[:32]
    shutil.copyfile(path, folder / f"{name}.safetensors")  # the name the old cache gave it
    cache = PrefixCache(10**8, folder=str(folder), key=key, model=model)
    assert cache.load() == 1
    n, entry = cache.get(PREFIX_TOKENS + [1, 2])
    state, logits = prefill(model, PREFIX_TOKENS)
    assert n == len(PREFIX_TOKENS) and same_state(entry["state"], state)
    assert mx.allclose(entry["logits"], logits, atol=1e-5).item()


def _nan(name):
    def change(tensors, meta):
        tensors[name] = mx.full(tensors[name].shape, mx.nan, dtype=tensors[name].dtype)

    return change


def _reshape(name):
    def change(tensors, meta):
        x = tensors[name]
        tensors[name] = mx.zeros((*x.shape[:-1], x.shape[-1] + 1), dtype=x.dtype)

    return change


def _set(key, value):
    def change(tensors, meta):
        meta[key] = value

    return change


def _retype(name):
    def change(tensors, meta):
        tensors[name] = tensors[name].astype(mx.int32)

    return change


def _token(name):
    def change(tensors, meta):
        tensors[name] = mx.array([5000] + tensors[name].tolist()[1:], dtype=mx.int32)

    return change


def _extra(tensors, meta):
    tensors["state.9.wkv"] = mx.zeros((1,))


def _new_file(model, tmp_path) -> Path:
    tokens = list(range(3, 20))
    state, logits = prefill(model, tokens)
    path = tmp_path / "new.safetensors"
    save_state(path, tokens, state, "me", logits=logits)
    return path


TAMPERED = {  # format -> (the file's state array prefix, its identity's metadata key)
    "new": ("state.", "model"),
    "chat": ("now.", "model"),
    "prefix": ("state.", "key"),
}
CHANGES = [
    ("nan", lambda p, k: _nan(f"{p}0.wkv"), r"state 0\.wkv holds NaN or infinite values"),
    ("shape", lambda p, k: _reshape(f"{p}1.keys"), r"keys has shape \(1, 2, \d+, 17\)"),
    ("dtype", lambda p, k: _retype(f"{p}2.wkv"), r"2\.wkv is int32, where float32 belongs"),
    ("model", lambda p, k: _set(k, "another-model"), "of another model or adapter"),
    (
        "token",
        lambda p, k: _token(f"{p}tokens" if p != "state." else "tokens"),
        r"token id 5000 is outside the vocabulary",
    ),
]


@pytest.mark.parametrize("fmt", TAMPERED)
@pytest.mark.parametrize("change", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_tampered_state_file_is_refused_naming_file_and_problem(model, tmp_path, fmt, change):
    src = {
        "new": None,
        "chat": OLD / "chat-1.safetensors",
        "prefix": OLD / "prefix-state.safetensors",
    }[fmt] or _new_file(model, tmp_path)
    identity = {
        "new": "me",
        "chat": model_identity(model),
        "prefix": state_key(model, dtype=None, quantize=None, max_cache=2048),
    }[fmt]
    prefix, key = TAMPERED[fmt]
    _, make, problem = change
    bad = tamper(src, tmp_path / "bad.safetensors", make(prefix, key))
    with pytest.raises(CheckpointError, match=problem) as info:
        read_state(bad, model, identity)
    assert str(info.value).startswith(f"{bad}: ")
    read_state(src, model, identity)  # the file as written passes


def test_unknown_tensors_and_damaged_logits_are_refused(model, tmp_path):
    src = _new_file(model, tmp_path)
    bad = tamper(src, tmp_path / "extra.safetensors", _extra)
    with pytest.raises(CheckpointError, match="state array '9.wkv' is none of this model's"):
        read_state(bad, model, "me")
    bad = tamper(src, tmp_path / "logits.safetensors", _reshape("logits"))
    with pytest.raises(CheckpointError, match=r"logits of shape \(1, 257\)"):
        read_state(bad, model, "me")


def test_a_tampered_conversation_leaves_the_chat_unchanged(model, tmp_path):
    chat = Chat(model, ByteTokenizer(), max_tokens=3)
    bad = tamper(OLD / "chat-1.safetensors", tmp_path / "c.safetensors", _nan("before.0.wkv"))
    with pytest.raises(CheckpointError, match=r"snapshot 'before': state 0\.wkv holds NaN"):
        chat.load(bad)
    assert chat.messages == [] and chat.session.tokens == []
    other = Chat(tiny_model("rfa", seed=6), ByteTokenizer())
    with pytest.raises(CheckpointError, match="a saved conversation of another model"):
        other.load(OLD / "chat-1.safetensors")


def test_the_prefix_cache_deletes_a_tampered_state_instead_of_resuming(model, tmp_path):
    """A state file in the folder whose arrays hold NaN (or do not fit the model) is refused
    when a lookup lands on it: deleted, one warning, the lookup misses. (The cache before this
    format resumed from it: NaN logits for the answer.)"""
    key = state_key(model, dtype=None, quantize=None, max_cache=2048)
    cache = PrefixCache(10**8, folder=str(tmp_path), key=key, model=model)
    cache.load()
    for tokens in ([1, 2, 3], [1, 2, 3, 4, 5]):
        state, logits = prefill(model, tokens)
        cache.put(tokens, {"state": state, "logits": logits})
    cache.close()
    files = sorted(tmp_path.glob("*.safetensors"))
    longer = next(p for p in files if read_header(p).tokens == (1, 2, 3, 4, 5))
    tamper(longer, longer, _nan("state.0.wkv"))
    again = PrefixCache(10**8, folder=str(tmp_path), key=key, model=model)
    assert again.load() == 2
    with pytest.warns(UserWarning, match=r"failed its checks and was deleted \(.*NaN"):
        n, entry = again.get([1, 2, 3, 4, 5, 6])
    assert n == 3 and same_state(entry["state"], prefill(model, [1, 2, 3])[0])
    assert not longer.exists() and len(again) == 1
