"""Generation and chat (mlx_rwkvx/generation.py, on mlx-lm's generate_step): every generated
step's logits equal the full forward's over the same tokens, a chat's state equals a prefill of
its transcript (also after an answer cut short), saved conversations continue in another
process, adapters equal their fused model, stop strings, the detokenizers, the KV-cache window,
logits processors that see the prompt, user errors as UserErrors, and the name
``mlx_rwkvx.generate`` as function and command."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx_rwkvx
from mlx_rwkvx.errors import UserError
from mlx_rwkvx.generation import Chat, GenerationError, Session, stream_generate
from mlx_rwkvx.generation.stream import StopStrings, _TextOnly, detokenizer
from mlx_rwkvx.io.tokenizers import ByteTokenizer

import mlx.core as mx
import numpy as np
import pytest
from helpers import chatml_tokenizer, constant, tiny_model

TOL = 1e-5  # DESIGN.md: a whole tiny model, float32


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def full_logits(model, ids) -> mx.array:
    out = model(mx.array([ids], dtype=mx.int32))[0, -1].astype(mx.float32)
    return out - mx.logsumexp(out)


FAMILIES = ["rwkv7", "rwkv-x", "rfa"]


@pytest.mark.parametrize("family", FAMILIES)
def test_each_step_equals_full_forward(family):
    from mlx_lm.generate import GenerationResponse

    model, tok = tiny_model(family), ByteTokenizer()
    prompt = list(b"The quick brown fox, jumps over.")  # 32 tokens: MoBA chunks of 8 fill up
    steps = list(stream_generate(model, tok, prompt, max_tokens=24))
    assert len(steps) == 24 and steps[-1].finish_reason == "length"
    assert all(isinstance(r, GenerationResponse) for r in steps)  # mlx-lm's own
    ids = list(prompt)
    for r in steps:
        ref = full_logits(model, ids)
        assert rel(r.logprobs, ref) <= TOL, (family, len(ids))
        top2 = np.sort(np.array(ref))[-2:]
        if top2[1] - top2[0] > TOL * 10:  # greedy agrees wherever the margin is clear
            assert r.token == int(mx.argmax(ref))
        ids.append(r.token)


def test_int8_steps_equal_its_own_full_forward():
    model = tiny_model("rwkv-x", seed=3)
    model.quantize(8)
    tok = ByteTokenizer()
    prompt = list(b"INT8 generation, step by step.")
    ids = list(prompt)
    for r in stream_generate(model, tok, prompt, max_tokens=12):
        # the quantized matmuls of one row and of many round alike: float32 accumulation
        assert rel(r.logprobs, full_logits(model, ids)) <= 1e-4
        ids.append(r.token)


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_in_pieces_and_session_continue(family):
    model = tiny_model(family, seed=1)
    ids = list(range(40, 90))
    s = Session(model, prefill_step=7)  # pieces of 7: MoBA and Qwen2 attend to their caches
    logits = s.feed(ids[:30])
    logits = s.feed(ids[30:])
    assert s.tokens == ids
    ref = full_logits(model, ids)
    got = logits[0] - mx.logsumexp(logits[0])
    assert rel(got, ref) <= TOL


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_state_equals_prefill_of_transcript(family):
    model, tok = tiny_model(family, seed=2), ByteTokenizer()
    chat = Chat(model, tok, system="Be brief.", max_tokens=12)
    for user in ("Hello there", "And a second question?", "Third."):
        list(chat.ask(user))
    assert [m["role"] for m in chat.messages] == ["user", "assistant"] * 3
    # the state after three turns: that of one prefill of every token fed
    tokens = chat.session.tokens
    fresh = Session(model)
    fresh.feed(tokens)
    for a, b in zip(chat.session.state, fresh.state, strict=True):
        for name in a:
            assert a[name].shape == b[name].shape, name
            if a[name].size:
                assert rel(a[name], b[name]) <= TOL, name


@pytest.mark.parametrize("family", ["rwkv-x", "rfa"])
def test_an_answer_cut_short_leaves_a_consistent_session(family):
    # generate_step feeds a token before its caller sees it: closing the stream at any point
    # (Ctrl-C) leaves the session holding every token shown but the last, and the state of a
    # prefill of them, the window included
    model, tok = tiny_model(family, seed=13), ByteTokenizer()
    for cut in (1, 2, 7):
        session = Session(model, max_cache=24)
        responses = stream_generate(model, tok, list(range(40, 60)), max_tokens=50, session=session)
        shown = [next(responses).token for _ in range(cut)]
        responses.close()
        assert session.tokens == list(range(40, 60)) + shown[:-1]
        fresh = Session(model, max_cache=24, prefill_step=1)  # trimmed after every token
        fresh.feed(session.tokens)
        for a, b in zip(session.state, fresh.state, strict=True):
            for name in a:
                assert a[name].shape == b[name].shape, (cut, name)
                if a[name].size:
                    assert rel(a[name], b[name]) <= TOL, (cut, name)


def test_logits_processors_see_the_prompt():
    # mlx-lm's repetition penalty, whose context reaches back into the prompt: every step's
    # log-probabilities are those of the full forward with the penalty over all tokens so far
    from mlx_lm.sample_utils import make_repetition_penalty

    model, tok = tiny_model("rwkv7", seed=14), ByteTokenizer()
    prompt = list(b"abcabcabc")
    penalty = make_repetition_penalty(1.5, context_size=20)
    ids = list(prompt)
    for r in stream_generate(model, tok, prompt, max_tokens=8, repetition_penalty=1.5):
        raw = model(mx.array([ids], dtype=mx.int32))[:, -1].astype(mx.float32)
        want = penalty(mx.array(ids), raw)[0]
        assert rel(r.logprobs, want - mx.logsumexp(want)) <= TOL
        ids.append(r.token)


def test_detokenizers_stream_whole_characters():
    # ours for byte vocabularies, mlx-lm's naive one for any other: the same text, and never
    # half a character (each piece is valid text; one that ends inside a character waits)
    tok = ByteTokenizer()
    text = "héllo wörld, 1 € and 🙂\nnext line ∑"
    ids = tok.encode(text) + [0xFF, ord("a")]  # and a byte that is no character at all

    class TextOnly:  # a tokenizer with encode(text) and decode(ids), nothing else
        encode, decode = tok.encode, tok.decode

    for t in (tok, TextOnly()):
        detok = detokenizer(t)
        pieces = []
        for i in ids:
            detok.add_token(i)
            pieces.append(detok.last_segment)
        detok.finalize()
        pieces.append(detok.last_segment)
        assert "".join(pieces) == text + "\ufffda", type(t).__name__
        assert all("\ufffd" not in p for p in pieces[:-3]), pieces
    assert type(detokenizer(TextOnly())._tokenizer) is _TextOnly


def test_user_errors_are_user_errors(tmp_path):
    # what a user can get wrong is a UserError (one line in the command), still a ValueError
    model, tok = tiny_model("rwkv-x", seed=15), ByteTokenizer(vocab_size=200)
    template = tmp_path / "refuses.jinja"
    template.write_text("{{ raise_exception('no system prompts here') }}{{ messages }}")
    cases = [
        (
            lambda: list(stream_generate(model, tok, list(range(20)), max_cache=8, window=False)),
            "do not fit in the KV cache",
        ),
        (lambda: list(stream_generate(model, tok, "caf\u00e9 \u20ac")), "cannot encode"),
        (lambda: list(stream_generate(model, tok, [200, 300])), "outside the vocabulary"),
        (lambda: list(stream_generate(model, tok, "x", top_p=2)), "top_p must be in 0 .. 1"),
        (lambda: list(stream_generate(model, tok, "x", max_tokens=0)), "max_tokens"),
        (lambda: Session(model, max_cache=0), "max_cache"),
        (lambda: Chat(model, tok, template="nope"), "chat template 'nope'"),
        (
            lambda: list(Chat(model, tok, template=str(template)).ask("hi")),
            "no system prompts here",
        ),
    ]
    for act, match in cases:
        with pytest.raises(GenerationError, match=match) as info:
            act()
        assert isinstance(info.value, UserError) and isinstance(info.value, ValueError)


def test_chat_feeds_only_the_new_turn(tmp_path):
    tok = ByteTokenizer()
    template = tmp_path / "t.jinja"  # an answer as the model spells it: no space after ':'
    template.write_text(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    model = constant(tiny_model("rwkv-x", seed=4), ord("a"))
    chat = Chat(model, tok, template=str(template), max_tokens=6)
    first = "first turn, a longer one than the second"
    list(chat.ask(first))
    assert chat.messages[-1]["content"] == "aaaaaa"
    held = len(chat.session.tokens)  # the prompt and 5 of the 6 answer tokens
    n = len(list(chat.ask("second")))
    # continued from the state after the answer: fed only the answer's last token and the turn
    assert chat.reused == held
    new_turn = "a\n\nuser:second\n\nassistant:"
    assert chat.prefilled == len(tok.encode(new_turn))
    assert len(chat.session.tokens) == held + chat.prefilled + n - 1
    # an answer the rendering spells differently (RWKV's format puts a space after
    # "Assistant:" that this answer lacks): from the state before it
    chat = Chat(model, tok, max_tokens=4)
    list(chat.ask(first))
    before = len(tok.encode(chat.format.render([{"role": "user", "content": first}], True)))
    list(chat.ask("second"))
    assert chat.reused == before and chat.messages[1]["content"] == "aaaa"
    # an answer that starts with a space continues: the rendering puts the space back
    chat = Chat(constant(tiny_model("rwkv-x", seed=4), ord(" ")), tok, max_tokens=4)
    list(chat.ask(first))
    held = len(chat.session.tokens)
    list(chat.ask("second"))
    assert chat.reused == held and chat.messages[1]["content"] == "   "


def test_save_load_in_another_process(tmp_path):
    model = tiny_model("rfa", seed=5)
    mlx_rwkvx.save(model, tmp_path / "m")
    script = """
import sys, numpy as np, mlx_rwkvx
from mlx_rwkvx.generation import Chat
from mlx_rwkvx.generation.chat import render_chat
model, tok = mlx_rwkvx.load(sys.argv[1])
chat = Chat(model, tok, max_tokens=8)
if sys.argv[2] == "save":
    for turn in ("one", "two"):
        list(chat.ask(turn))
    chat.save(sys.argv[3])
else:
    chat.load(sys.argv[3])
text = render_chat(tok, chat.format, chat._conversation("three"))
logits = chat.session.feed(chat._continue(text))
np.save(sys.argv[4], np.array(logits))
print(len(chat.session.tokens), len(chat.messages))
"""
    conv = str(tmp_path / "conv.safetensors")
    runs = []
    for mode in ("save", "load"):
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "m"), mode, conv, str(tmp_path / mode)],
            capture_output=True,
            text=True,
            check=True,
        )
        runs.append(out.stdout.split())
    assert runs[0] == runs[1]
    a, b = np.load(tmp_path / "save.npy"), np.load(tmp_path / "load.npy")
    assert rel(a, b) <= 1e-6


def test_load_refuses_other_model_and_bad_files(tmp_path):
    tok = ByteTokenizer()
    chat = Chat(tiny_model("rwkv7"), tok, max_tokens=4)
    list(chat.ask("hi"))
    path = str(tmp_path / "c.safetensors")
    chat.save(path)
    other = Chat(tiny_model("rwkv7", seed=9), tok)
    with pytest.raises(ValueError, match="another model"):
        other.load(path)
    assert other.messages == [] and other.session.tokens == []
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="not a saved conversation"):
        chat.load(str(bad))
    assert len(chat.messages) == 2  # unchanged
    with pytest.raises(ValueError, match=r"\.safetensors"):
        chat.save(str(tmp_path / "c.txt"))


def test_adapter_equals_fused():
    from mlx_rwkvx.adapters.fuse import fuse_adapters
    from mlx_rwkvx.adapters.lora import apply_lora
    from mlx_rwkvx.adapters.targets import target_paths

    model, tok = tiny_model("rfa", seed=6), ByteTokenizer()
    apply_lora(model, target_paths(model, "qwen"), rank=4, alpha=8.0)
    for name, m in model.named_modules():  # a trained-looking adapter: B not zero
        if hasattr(m, "lora_b"):
            m.lora_b = mx.random.normal(m.lora_b.shape, key=mx.random.key(len(name))) * 0.05
    prompt = list(b"adapters fused or not")
    with_adapter = [r.logprobs for r in stream_generate(model, tok, prompt, max_tokens=6)]
    tokens = [r.token for r in stream_generate(model, tok, prompt, max_tokens=6)]
    fuse_adapters(model)
    ids = list(prompt)
    for lp, t in zip(with_adapter, tokens, strict=True):
        assert rel(lp, full_logits(model, ids)) <= TOL
        ids.append(t)


def test_stop_strings_split_across_tokens():
    s = StopStrings(["\n\n", "END"])
    shown = [s.add(piece) for piece in ("Hel", "lo E", "N", "D more")]
    assert "".join(t for t, _ in shown) == "Hello "
    assert [stop for _, stop in shown] == [False, False, False, True]
    s = StopStrings(["\n\n"])
    assert s.add("a\n") == ("a", False) and s.add("b") == ("\nb", False)
    # end to end: a stop string made of two byte tokens the model generates
    model, tok = tiny_model("rwkv7", seed=7), ByteTokenizer()
    text = "".join(r.text for r in stream_generate(model, tok, "abc", max_tokens=30))
    stop = text[10:12]
    cut = text[: text.index(stop)]
    got = list(stream_generate(model, tok, "abc", max_tokens=30, stop=[stop]))
    assert "".join(r.text for r in got) == cut and got[-1].finish_reason == "stop"


def test_eos_ends_and_is_not_shown():
    model, tok = constant(tiny_model("rwkv7", seed=8), 0), ByteTokenizer()  # 0: end of text
    got = list(stream_generate(model, tok, "hello", max_tokens=10))
    assert len(got) == 1 and got[0].text == "" and got[0].finish_reason == "stop"


@pytest.mark.parametrize("family", ["rwkv-x", "rfa"])
def test_cache_window_and_no_window(family):
    model, tok = tiny_model(family, seed=10), ByteTokenizer()
    prompt = list(range(40, 72))
    # the window: the caches never hold more than max_cache tokens, generation goes on
    s = Session(model, max_cache=16)
    got = list(stream_generate(model, tok, prompt, max_tokens=20, session=s))
    assert len(got) == 20
    assert all(st["keys"].shape[2] <= 16 for st in s.state if "keys" in st)
    # without it: a prompt that does not fit is refused; an answer stops when the cache fills
    with pytest.raises(ValueError, match="do not fit in the KV cache"):
        list(stream_generate(model, tok, prompt, max_tokens=5, max_cache=16, window=False))
    got = list(stream_generate(model, tok, prompt, max_tokens=50, max_cache=40, window=False))
    assert got[-1].finish_reason == "cache" and len(got) == 40 - len(prompt) + 1


def test_sampling_is_mlx_lms_and_seeded():
    model, tok = tiny_model("rwkv7", seed=11), ByteTokenizer()
    opts = dict(max_tokens=16, temp=1.0, top_p=0.9, top_k=20, min_p=0.01, seed=3)
    a = [r.token for r in stream_generate(model, tok, "seeded", **opts)]
    b = [r.token for r in stream_generate(model, tok, "seeded", **opts)]
    assert a == b
    with pytest.raises(ValueError, match="temp"):
        list(stream_generate(model, tok, "x", temp=-1))
    with pytest.raises(ValueError, match="max_tokens"):
        list(stream_generate(model, tok, "x", max_tokens=0))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        list(stream_generate(model, tok, [300], max_tokens=2))


def test_name_is_function_and_command(tmp_path):
    mlx_rwkvx.save(tiny_model("rwkv7"), tmp_path / "m")
    script = f"""
import mlx_rwkvx.generate  # the command's module takes the package attribute's name
import mlx_rwkvx
model, tok = mlx_rwkvx.load({str(tmp_path / "m")!r})
text = mlx_rwkvx.generate(model, tok, "hi", max_tokens=5)
assert isinstance(text, str), type(text)
pieces = list(mlx_rwkvx.stream_generate(model, tok, "hi", max_tokens=5))
assert "".join(p.text for p in pieces) == text
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    out = subprocess.run(
        [sys.executable, "-W", "error", "-m", "mlx_rwkvx.generate", "--help"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and "--max-kv-size" in out.stdout, out.stderr
    assert "RuntimeWarning" not in out.stderr


def test_generation_config_yaml(tmp_path):
    from mlx_rwkvx import settings
    from mlx_rwkvx.generate import PROG, GenerateConfig

    (tmp_path / "g.yaml").write_text(
        json.dumps({"model": "m", "temp": 0.5, "max_kv_size": 64, "adapter_path": "a"})
    )
    argv = ["--config", str(tmp_path / "g.yaml"), "--temp", "0.7"]
    cfg = settings.load(GenerateConfig, argv, PROG)
    assert (cfg.model, cfg.temp, cfg.max_cache, cfg.adapter) == ("m", 0.7, 64, "a")
    (tmp_path / "bad.yaml").write_text("tempo: 1\n")
    with pytest.raises(SystemExit) as e:
        settings.load(GenerateConfig, ["--config", str(tmp_path / "bad.yaml")], PROG)
    assert e.value.code == 2


def test_chat_with_the_tokenizers_own_template(tmp_path):
    tok = chatml_tokenizer(tmp_path / "tok")  # byte-level BPE, ChatML template, <|im_end|> ends
    model = tiny_model("rfa", seed=12, vocab_size=512)  # a head wider than the tokenizer's 400-odd
    chat = Chat(model, tok, system="You are terse.", max_tokens=10, temp=1.0, seed=0)
    assert chat.format.name == "tokenizer"
    for user in ("Hello there", "How are you?"):
        responses = list(chat.ask(user))
        assert all(r.token < tok.vocab_size for r in responses)  # ids it can decode only
    assert chat.reused > 0  # the second turn continued a held state
    text = tok.decode(chat.session.tokens)
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert "<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n" in text
    fresh = Session(model)
    fresh.feed(chat.session.tokens)
    for a, b in zip(chat.session.state, fresh.state, strict=True):
        for name in a:
            if a[name].size:
                assert rel(a[name], b[name]) <= TOL, name


def test_chatml_turns_stop_at_im_end_when_it_is_not_the_end_of_text(tmp_path):
    import json as _json

    from mlx_rwkvx.generation import chat_format

    tok = chatml_tokenizer(tmp_path / "own")  # its end of text is <|im_end|>: eos stops the turn
    assert chat_format(tok).stops == []
    (tmp_path / "own" / "tokenizer_config.json").write_text(
        _json.dumps({"eos_token": "<|endoftext|>"})  # a Qwen2 base tokenizer's
    )
    from mlx_rwkvx.io.tokenizers import HFTokenizer

    base = HFTokenizer(str(tmp_path / "own"))
    assert chat_format(base).stops == ["<|im_end|>"]
    assert chat_format(base, "chatml").stops == ["<|im_end|>"]
    assert chat_format(ByteTokenizer()).stops == ["\n\n"]  # RWKV's format


def test_load_refuses_another_chat_format(tmp_path):
    tok = ByteTokenizer()
    chat = Chat(tiny_model("rwkv7"), tok, max_tokens=3)
    list(chat.ask("hi"))
    chat.save(tmp_path / "c.safetensors")
    other = Chat(tiny_model("rwkv7"), tok, template="chatml")
    with pytest.raises(ValueError, match="saved in the 'rwkv' chat format"):
        other.load(tmp_path / "c.safetensors")
    assert Chat(tiny_model("rwkv7"), tok, max_kv_size=7).session.max_cache == 7  # mlx-lm's name
