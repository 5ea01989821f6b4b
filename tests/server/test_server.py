"""``python -m mlx_rwkvx.server`` through the official ``openai`` client, on a free localhost
port, for RWKV-7, RWKV-X and RFA: chat and text completions (streamed and not) equal to the
generation layer's own greedy answer, log-probabilities equal to the model's, embeddings equal
to the pooled ``model.hidden``, the state cache (``cached_tokens``, a restart with
``--cache-dir``, another adapter never served a stale state), adapters as models, every bad
request a 4xx with OpenAI's error JSON, a full queue, a client that hangs up, SIGTERM, and a
short load test (the long one is the benchmarks')."""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
import urllib.error
import urllib.request

import mlx_rwkvx
from mlx_rwkvx.adapters.apply import apply_adapter
from mlx_rwkvx.adapters.files import adapter_config, save_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import default_targets, target_paths
from mlx_rwkvx.generation import chat_format, stream_generate

import mlx.core as mx
import numpy as np
import pytest
from helpers import CHAT, chatml_tokenizer, tiny_model
from helpers.parity import import_parity_extra
from helpers.serving import Server, serving

import_parity_extra(("fastapi", "uvicorn"), extra="server")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

FAMILIES = ["rwkv7", "rwkv-x", "rfa"]
USER = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello, world!"}]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    tok = chatml_tokenizer(root / "tok")
    for i, family in enumerate(FAMILIES):
        mlx_rwkvx.save(
            tiny_model(family, seed=20 + i, vocab_size=512), root / family, tokenizer=tok
        )
    base = tiny_model("rwkv7", seed=20, vocab_size=512)
    paths = target_paths(base, default_targets(base))
    apply_lora(base, paths, rank=2, alpha=4.0)
    for _, m in base.named_modules():
        if "lora_b" in m:
            m["lora_b"] = 0.5 * mx.random.normal(m["lora_b"].shape, key=mx.random.key(3))
    config = adapter_config(
        base,
        fine_tune_type="lora",
        paths=paths,
        rank=2,
        alpha=4.0,
        base_fingerprint=fingerprint(tiny_model("rwkv7", seed=20, vocab_size=512)),
    )
    save_adapter(root / "lora.safetensors", base, config)
    state = tiny_model("rwkv7", seed=20, vocab_size=512)  # a state-tuned initial state
    paths = enable_state_tuning(state)
    for _, m in state.named_modules():
        if "state0" in m:
            m["state0"] = mx.random.normal(m["state0"].shape, key=mx.random.key(4))
    config = adapter_config(
        state, fine_tune_type="state", paths=paths, base_fingerprint=config["base_fingerprint"]
    )
    save_adapter(root / "state.safetensors", state, config)
    return root


def client(server: Server, **kw) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url, api_key=kw.pop("api_key", "none"), max_retries=0, timeout=60, **kw
    )


def greedy(path, messages, max_tokens, adapter=None):
    """The generation layer's own greedy answer to ``messages`` (tokens and text)."""
    model, tok = mlx_rwkvx.load(path)
    if adapter is not None:
        apply_adapter(model, adapter)
    fmt = chat_format(tok)
    rs = list(
        stream_generate(model, tok, fmt.apply(messages), max_tokens=max_tokens, stop=fmt.stops)
    )
    return [r.token for r in rs], "".join(r.text for r in rs), rs


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_completions_and_embeddings_of_each_family(models, family):
    path = str(models / family)
    tokens, text, responses = greedy(path, USER, 12)
    with serving("--model", path) as server:
        c = client(server)
        assert [m.id for m in c.models.list().data] == [path]
        r = c.chat.completions.create(
            model=path, messages=USER, max_tokens=12, logprobs=True, top_logprobs=3
        )
        choice = r.choices[0]
        assert choice.message.content == text and choice.message.role == "assistant"
        assert choice.finish_reason == ("length" if len(tokens) == 12 else "stop")
        assert r.usage.completion_tokens == len(tokens)
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        # log-probabilities: the model's own (the generation layer's), top ones sorted
        for entry, resp in zip(choice.logprobs.content, responses, strict=True):
            assert math.isclose(entry.logprob, resp.logprobs[resp.token].item(), abs_tol=1e-4)
            tops = [t.logprob for t in entry.top_logprobs]
            assert len(tops) == 3 and tops == sorted(tops, reverse=True)
            assert math.isclose(tops[0], resp.logprobs.max().item(), abs_tol=1e-4)
        prompt = r.usage.prompt_tokens

        # the same conversation streamed, its usage at the end: the whole prompt was cached
        chunks = list(
            c.chat.completions.create(
                model=path,
                messages=USER,
                max_tokens=12,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == text
        assert chunks[-1].usage.prompt_tokens_details.cached_tokens == prompt

        # n answers: each its own choice, the prompt counted once
        two = c.chat.completions.create(
            model=path, messages=USER, max_tokens=4, n=2, temperature=1.0, seed=3
        )
        assert [x.index for x in two.choices] == [0, 1] and two.usage.prompt_tokens == prompt

        # a second turn resumes from a stored state: at least the first turn's prompt
        turn2 = USER + [{"role": "assistant", "content": text}, CHAT[3]]
        r2 = c.chat.completions.create(model=path, messages=turn2, max_tokens=5)
        assert r2.usage.prompt_tokens > prompt
        assert r2.usage.prompt_tokens_details.cached_tokens >= prompt
        assert r2.choices[0].message.content == greedy(path, turn2, 5)[1]

        # text completions, with log-probabilities in their own layout
        model, tok = mlx_rwkvx.load(path)
        want = list(stream_generate(model, tok, "The quick brown fox", max_tokens=6))
        t = c.completions.create(model=path, prompt="The quick brown fox", max_tokens=6, logprobs=2)
        assert t.choices[0].text == "".join(w.text for w in want)
        assert len(t.choices[0].logprobs.token_logprobs) == 6
        streamed = c.completions.create(
            model=path, prompt="The quick brown fox", max_tokens=6, stream=True
        )
        assert "".join(ch.choices[0].text for ch in streamed) == t.choices[0].text

        # embeddings: the final hidden states' mean, unit length (base64 by default)
        e = c.embeddings.create(model=path, input=["Hello, world!", "The fox?"])
        for item, words in zip(e.data, ["Hello, world!", "The fox?"], strict=True):
            h, _ = model.hidden(mx.array([tok.encode(words)]))
            want = np.array(h[0].mean(axis=0))
            want /= np.linalg.norm(want)
            np.testing.assert_allclose(item.embedding, want, atol=1e-5)
        assert e.usage.prompt_tokens == sum(
            len(tok.encode(w)) for w in ["Hello, world!", "The fox?"]
        )


def test_cache_dir_restart_and_adapters(models, tmp_path):
    path, lora = str(models / "rwkv7"), str(models / "lora.safetensors")
    cache = tmp_path / "states"
    state = str(models / "state.safetensors")
    args = ("--model", path, "--adapter", f"tuned={lora}", "--adapter", state, "--cache-dir", cache)
    with serving(*args) as server:
        c = client(server)
        assert [m.id for m in c.models.list().data] == [path, "tuned", "state"]
        stated = c.chat.completions.create(model="state", messages=USER, max_tokens=8)
        assert stated.choices[0].message.content == greedy(path, USER, 8, adapter=state)[1]
        base = c.chat.completions.create(model=path, messages=USER, max_tokens=8)
        tuned = c.chat.completions.create(model="tuned", messages=USER, max_tokens=8)
        # the adapter's model is the base with the adapter; the base stays the base
        assert tuned.choices[0].message.content == greedy(path, USER, 8, adapter=lora)[1]
        assert base.choices[0].message.content == greedy(path, USER, 8)[1]
        assert base.choices[0].message.content != tuned.choices[0].message.content
        assert tuned.usage.prompt_tokens_details.cached_tokens == 0  # not the base's state
        prompt = base.usage.prompt_tokens
        # the README's curl: plain JSON in, OpenAI's chat.completion out
        reply = _raw(
            server,
            "POST",
            "/v1/chat/completions",
            json={
                "model": "tuned",
                "messages": [{"role": "user", "content": "Hello"}],
                "max_tokens": 64,
            },
        ).json()
        assert reply["object"] == "chat.completion" and reply["model"] == "tuned"
        assert isinstance(reply["choices"][0]["message"]["content"], str)
    files = [f for _, _, fs in os.walk(cache) for f in fs if f.endswith(".safetensors")]
    assert len(files) >= 4  # after each prompt and each answer, for each model
    (cache / "junk.safetensors").write_bytes(b"not a state")
    folder = next(p for p in cache.iterdir() if p.is_dir())
    (folder / "cut.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # cut short
    with serving(*args) as server:  # a restart: every conversation resumes
        c = client(server)
        again = c.chat.completions.create(model=path, messages=USER, max_tokens=8)
        assert again.usage.prompt_tokens_details.cached_tokens == prompt
        assert again.choices[0].message.content == base.choices[0].message.content
        tuned2 = c.chat.completions.create(model="tuned", messages=USER, max_tokens=8)
        assert tuned2.usage.prompt_tokens_details.cached_tokens == prompt
        assert tuned2.choices[0].message.content == tuned.choices[0].message.content
    out = server.stop()
    assert "skipped" in out  # the damaged file: one warning, no crash
    # another adapter on the same folder: no state of the first is served
    with serving(
        "--model", path, "--adapter", f"tuned={lora}", "--cache-dir", cache, "--max-cache", "4096"
    ) as server:
        r = client(server).chat.completions.create(model=path, messages=USER, max_tokens=2)
        assert r.usage.prompt_tokens_details.cached_tokens == 0


class _Reply:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def _raw(server, method, route, *, headers=None, json=None, content=None) -> _Reply:
    """A request as it comes, bad ones too (the openai client would refuse to send some)."""
    data = content if json is None else globals()["json"].dumps(json).encode()
    request = urllib.request.Request(
        server.url.removesuffix("/v1") + route,
        data=data,
        method=method,
        headers={"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            return _Reply(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return _Reply(e.code, e.read().decode())


def test_bad_requests_are_4xx_with_openai_errors(models):
    path = str(models / "rfa")
    with serving("--model", path, "--api-key", "sesame", "--max-prompt-tokens", "40") as server:
        c = client(server, api_key="sesame")
        with pytest.raises(openai.AuthenticationError):
            client(server, api_key="wrong").models.list()
        assert _raw(server, "GET", "/health").status_code == 200  # no key needed
        auth = {"Authorization": "Bearer sesame"}
        cases = [
            (dict(content=b"{not json"), 400, "JSON"),
            (dict(json={"model": path, "messages": "hi"}), 400, "messages"),
            (dict(json={"model": path, "messages": []}), 400, "messages"),
            (dict(json={"model": path, "messages": USER, "max_tokens": "many"}), 400, "max_tokens"),
            (dict(json={"model": path, "messages": USER, "max_tokens": 0}), 400, "max_tokens"),
            (dict(json={"model": path, "messages": USER, "temperature": 3}), 400, "temperature"),
            (dict(json={"model": "nope", "messages": USER}), 404, "does not exist"),
            (dict(json={"model": path, "messages": USER * 10}), 400, "--max-prompt-tokens"),
            (dict(json={"model": path, "messages": USER, "n": 99}), 400, "n must be"),
            (
                dict(json={"model": path, "messages": USER, "logit_bias": {"x": 1}}),
                400,
                "logit_bias",
            ),
            (
                dict(json={"model": path, "messages": USER, "logit_bias": {"9999": 1}}),
                400,
                "logit_bias",
            ),
            (
                dict(
                    json={
                        "model": path,
                        "messages": USER,
                        "tools": [{"type": "function", "function": {"name": "f"}}],
                    }
                ),
                400,
                "takes no tools",
            ),
            (
                dict(json={"model": path, "messages": [{"role": "robot", "content": "x"}]}),
                400,
                "role",
            ),
            (dict(json={"model": path, "messages": USER, "top_logprobs": 2}), 400, "top_logprobs"),
            # sampling fields within the model: a top_k over the vocabulary broke every later
            # sampled answer (mlx-lm's compiled top-k left mx.random.state unusable)
            (
                dict(json={"model": path, "messages": USER, "temperature": 1, "top_k": 10**9}),
                400,
                "top_k",
            ),
            (
                dict(json={"model": path, "messages": USER, "temperature": 1, "top_k": 513}),
                400,
                "vocabulary's 512",
            ),
            (
                dict(json={"model": path, "messages": USER, "max_tokens": 10**9}),
                400,
                "--max-request-tokens",
            ),
            (
                dict(json={"model": path, "messages": USER, "max_completion_tokens": 0}),
                400,
                "max_completion_tokens",
            ),
            (
                dict(json={"model": path, "messages": USER, "max_completion_tokens": 10**6}),
                400,
                "--max-request-tokens",
            ),
            # what one request asks in all: n answers of 5000 tokens, each within the cap
            (
                dict(json={"model": path, "messages": USER, "n": 2, "max_tokens": 5000}),
                400,
                "2 answers = 10000",
            ),
            # OpenAI's types, strictly
            (dict(json={"model": path, "messages": USER, "max_tokens": "10"}), 400, "max_tokens"),
            (dict(json={"model": path, "messages": USER, "max_tokens": True}), 400, "max_tokens"),
            (dict(json={"model": path, "messages": USER, "stream": "yes"}), 400, "stream"),
            (dict(json={"model": path, "messages": USER, "top_p": "0.5"}), 400, "top_p"),
            (
                dict(
                    json={
                        "model": path,
                        "messages": USER
                        + [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}],
                    }
                ),
                400,
                "tool_calls",
            ),
        ]
        for kw, status, words in cases:
            r = _raw(server, "POST", "/v1/chat/completions", headers=auth, **kw)
            assert r.status_code == status, (kw, r.text)
            body = r.json()["error"]
            assert words in body["message"] and "Traceback" not in r.text, (kw, body)
            assert set(body) == {"message", "type", "param", "code"}
        routed = [  # the other routes: how many prompts or inputs one request may give
            ("/v1/completions", {"prompt": []}, "prompt: an empty list"),  # it never answered
            ("/v1/completions", {"prompt": [[1]] * 40, "n": 8}, "--max-inputs"),
            ("/v1/completions", {"prompt": [1, True]}, "prompt"),
            ("/v1/embeddings", {"input": []}, "input: an empty list"),
            ("/v1/embeddings", {"input": ["x"] * 300}, "--max-inputs"),
            # in all, over the request's prompts and answers (each within its own cap)
            ("/v1/completions", {"prompt": [[1] * 30, [2] * 30]}, "60 tokens in all"),
            ("/v1/embeddings", {"input": [[1] * 30, [2] * 30]}, "--max-prompt-tokens"),
            (
                "/v1/completions",
                {"prompt": [[1]] * 4, "n": 2, "max_tokens": 1100},
                "--max-request-tokens",
            ),
        ]
        for route, fields, words in routed:
            r = _raw(server, "POST", route, headers=auth, json={"model": path, **fields})
            assert r.status_code == 400 and words in r.json()["error"]["message"], (fields, r.text)
        r = _raw(
            server,
            "POST",
            "/v1/completions",
            headers=auth,
            json={"model": path, "prompt": [1, 2, 99999]},
        )
        assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
        r = _raw(server, "GET", "/v1/nothing", headers=auth)
        assert r.status_code == 404 and "error" in r.json()
        with pytest.raises(openai.BadRequestError, match="max-prompt-tokens"):
            c.completions.create(model=path, prompt="x " * 100, max_tokens=2)
        within = c.completions.create(model=path, prompt=[[1] * 15, [2] * 15], n=2, max_tokens=2)
        assert len(within.choices) == 4 and within.usage.prompt_tokens == 30
        # still answering, sampled answers too
        assert c.chat.completions.create(model=path, messages=USER, max_tokens=2).choices
        sampled = c.chat.completions.create(
            model=path, messages=USER, max_tokens=2, temperature=1.0, extra_body={"top_k": 5}
        )
        assert sampled.choices


def test_a_full_queue_a_hang_up_and_sigterm(models, tmp_path):
    path = str(models / "rwkv-x")
    server = Server(
        [
            "--model",
            path,
            "--max-queue",
            "1",
            "--cache-dir",
            tmp_path / "s",
            "--max-request-tokens",
            "100000",
            "--shutdown-timeout",
            "5",
        ]
    )
    try:
        c = client(server)
        long = dict(model=path, messages=USER, max_tokens=100000, stream=True)
        first = c.chat.completions.create(**long)
        next(iter(first))  # running
        results = {}

        def waiting():
            try:
                results["w"] = c.chat.completions.create(model=path, messages=USER, max_tokens=3)
            except Exception as e:  # noqa: BLE001
                results["w"] = e

        t = threading.Thread(target=waiting)
        t.start()
        deadline = time.monotonic() + 10
        while _raw(server, "GET", "/health").json()["waiting"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError, match="--max-queue"):
            c.chat.completions.create(model=path, messages=USER, max_tokens=3)
        first.close()  # the client hangs up: its slot is freed, the waiting one runs
        t.join(timeout=30)
        assert not isinstance(results["w"], Exception), results["w"]
        assert results["w"].choices[0].finish_reason in ("stop", "length")

        # SIGTERM during a streamed answer: it is cut off unfinished once --shutdown-timeout
        # passed (the stream breaks off, no finish reason), the states are written
        stream = c.chat.completions.create(**{**long, "max_tokens": 100000})
        next(iter(stream))
        server.proc.send_signal(signal.SIGTERM)
        with pytest.raises(Exception):  # noqa: B017 (the connection ends, however the client says it)
            for _ in stream:
                pass
        server.proc.wait(timeout=60)  # a safety net: 100,000 tokens would take far longer
        assert server.proc.returncode == 0
    finally:
        out = server.stop()
    assert "stopped" in out and "Traceback" not in out, out
    assert any(f.endswith(".safetensors") for _, _, fs in os.walk(tmp_path / "s") for f in fs)


@pytest.mark.parametrize("family", ["rwkv7", "rwkv-x"])
def test_concurrent_answers_are_each_the_answer_alone(models, family):
    """Answers decode in one batch (state-tuned rows beside the base's), a client that hangs
    up leaves the others as they were, and each answer is the one it gets alone. That they
    overlap is shown by events, not durations: a long answer is decoding before the others are
    sent and is still decoding (the server's own count) once they all ended, so each was
    decoded in its batch."""
    path = str(models / family)
    args = ["--model", path, "--max-cache", "16384"]  # the long answer fits RWKV-X's window
    if family == "rwkv7":
        args += ["--adapter", f"tuned={models / 'state.safetensors'}"]
    with serving(*args) as server:
        c = client(server)
        eos = mlx_rwkvx.load(path)[1].eos_token_ids
        never_ends = {str(e): -100 for e in eos}
        long = c.chat.completions.create(
            model=path, messages=USER, max_tokens=8000, stream=True, logit_bias=never_ends
        )
        next(iter(long))  # decoding
        asks = [(f"Question {i}: what is {i} + {i}?", 10 + 3 * i) for i in range(5)]
        names = [path, "tuned", path, "tuned", path] if family == "rwkv7" else [path] * 5
        got = {}

        def one(i):
            messages = [{"role": "user", "content": asks[i][0]}]
            s = c.chat.completions.create(
                model=names[i], messages=messages, stream=True, max_tokens=asks[i][1], logprobs=True
            )
            text, lps = "", []
            for k, chunk in enumerate(s):
                if i == 4 and k == 3:
                    s.close()  # hangs up: the others go on
                    return
                if chunk.choices:
                    text += chunk.choices[0].delta.content or ""
                    if chunk.choices[0].logprobs:
                        lps += [e.logprob for e in chunk.choices[0].logprobs.content]
            got[i] = text, lps

        threads = [threading.Thread(target=one, args=(i,)) for i in range(5)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(got) == [0, 1, 2, 3]
        # the long one, still: the one that hung up may take a step more to stop (its client
        # went in the middle of its answer), so the count falls to 1, not at once
        deadline = time.monotonic() + 60  # a safety net
        while (decoding := _raw(server, "GET", "/health").json()["decoding"]) != 1:
            assert decoding > 1 and time.monotonic() < deadline, decoding
            time.sleep(0.05)
        long.close()
        for i, (text, lps) in got.items():
            adapter = models / "state.safetensors" if names[i] == "tuned" else None
            messages = [{"role": "user", "content": asks[i][0]}]
            _, want, rs = greedy(path, messages, asks[i][1], adapter)
            assert text == want
            ref = [r.logprobs[r.token].item() for r in rs]
            assert len(lps) == len(ref)
            assert max(abs(a - b) for a, b in zip(lps, ref, strict=True)) <= 1e-4
        deadline = time.monotonic() + 60  # a safety net: the long one stops at its next step
        while _raw(server, "GET", "/health").json()["decoding"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)


def test_short_load_test(models):
    """16 clients, 64 requests: streamed, not, and hanging up half way; no 5xx, the server
    still answering, memory within its budget."""
    path = str(models / "rwkv7")
    with serving("--model", path, "--cache-bytes", str(8 << 20)) as server:
        c = client(server)
        statuses, lock = [], threading.Lock()

        def one(i):
            messages = [{"role": "user", "content": f"Hello {i % 5}, world!"}]
            try:
                if i % 3 == 0:
                    s = c.chat.completions.create(
                        model=path, messages=messages, max_tokens=20, stream=True
                    )
                    for k, _ in enumerate(s):
                        if i % 2 and k == 3:
                            s.close()  # hangs up
                            break
                    code = 200
                else:
                    c.chat.completions.create(model=path, messages=messages, max_tokens=10)
                    code = 200
            except openai.APIStatusError as e:
                code = e.status_code
            with lock:
                statuses.append(code)

        threads = [
            threading.Thread(target=lambda k=k: [one(k * 4 + j) for j in range(4)])
            for k in range(16)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert len(statuses) == 64 and all(s < 500 for s in statuses), statuses
        health = _raw(server, "GET", "/health").json()
        assert health["status"] == "ok"
        assert c.chat.completions.create(model=path, messages=USER, max_tokens=2).choices


def test_tool_calls_are_parsed_from_the_templates_format():
    from mlx_rwkvx.server.tools import ToolCalls

    qwen = ToolCalls("json_tools")
    text = (
        'Let me check.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>'
    )
    content, calls = qwen.split(text, None)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["weather", "time"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    # a call cut off by max_tokens stays text; text that may begin a call is held back
    with pytest.warns(UserWarning, match="does not parse"):
        assert qwen.split('<tool_call>\n{"name": "wea', None) == ('<tool_call>\n{"name": "wea', [])
    assert qwen.held("It is <tool") == len("It is ")
    assert qwen.held("It is <tool_call>{") == len("It is ")
    assert qwen.held("a < b") == len("a < b")
    assert qwen.split("no calls", None) == ("no calls", [])


QWEN_TOOLS = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}{{ t | tojson }}"
    '{% endfor %}</tools>\nFor each call, return <tool_call>{"name": ..., "arguments": ...}'
    "</tool_call> (as tool_call.name and tool_call.arguments)<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_tools_go_into_the_template_and_calls_come_out(tmp_path):
    """A Qwen2-style template: the tools are written into the prompt; an answer's calls,
    streamed or not, become ``tool_calls`` (canned answers through the answer assembly)."""
    from mlx_rwkvx.generation import chat_format
    from mlx_rwkvx.server.replies import _Choice
    from mlx_rwkvx.server.served import Served
    from mlx_rwkvx.server.tools import ToolCalls

    tok = chatml_tokenizer(tmp_path / "tok", template=QWEN_TOOLS)
    path = str(tmp_path / "m")
    mlx_rwkvx.save(tiny_model("rfa", seed=44, vocab_size=512), path, tokenizer=tok)
    tools = [
        {
            "type": "function",
            "function": {
                "name": "weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    # bounded arguments: a random tiny model closes them within max_tokens
    bounded = [
        {
            "type": "function",
            "function": {
                "name": name,
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"enum": ["Paris", "Oslo"]},
                        "days": {"type": "integer", "minimum": 1, "maximum": 7},
                    },
                    "required": ["city", "days"],
                    "additionalProperties": False,
                },
            },
        }
        for name in ("weather", "tides")
    ]
    with serving("--model", path) as server:
        c = client(server)
        plain = c.chat.completions.create(model=path, messages=USER, max_tokens=2)
        with_tools = c.chat.completions.create(model=path, messages=USER, max_tokens=2, tools=tools)
        assert with_tools.usage.prompt_tokens > plain.usage.prompt_tokens + 10
        none = c.chat.completions.create(
            model=path, messages=USER, max_tokens=2, tools=tools, tool_choice="none"
        )
        assert none.usage.prompt_tokens == plain.usage.prompt_tokens
        # a forced call: required (any tool) or named; streamed or not, one call that parses
        # and validates, finish_reason tool_calls
        tides = {"type": "function", "function": {"name": "tides"}}
        for choice, names in (("required", {"weather", "tides"}), (tides, {"tides"})):
            r = c.chat.completions.create(
                model=path, messages=USER, max_tokens=150, tools=bounded, tool_choice=choice
            )
            assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
            (call,) = r.choices[0].message.tool_calls
            assert call.function.name in names
            jsonschema.validate(
                json.loads(call.function.arguments), bounded[0]["function"]["parameters"]
            )
        chunks = list(
            c.chat.completions.create(
                model=path,
                messages=USER,
                max_tokens=150,
                tools=bounded,
                stream=True,
                tool_choice={"type": "function", "function": {"name": "weather"}},
            )
        )
        deltas = [d for ch in chunks if ch.choices for d in ch.choices[0].delta.tool_calls or []]
        assert [d.function.name for d in deltas] == ["weather"]
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
        for bad_choice, match in (
            ({"type": "function", "function": {"name": "nope"}}, "nope"),
            ("always", "tool_choice"),
        ):
            with pytest.raises(openai.BadRequestError, match=match):
                c.chat.completions.create(
                    model=path, messages=USER, tools=bounded, tool_choice=bad_choice
                )
        # an assistant turn with calls and a tool's answer render (arguments as JSON text)
        history = USER + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]
        assert c.chat.completions.create(
            model=path, messages=history, max_tokens=2, tools=tools
        ).choices
    model, tok = mlx_rwkvx.load(path)
    fmt = chat_format(tok)
    calls = ToolCalls.of(tok)
    assert calls is not None and calls.kind == "json_tools" and fmt.tools
    served = Served("m", model, tok, fmt, None, tool_calls=calls)
    pieces = [
        "Let me ",
        "check.\n<to",
        'ol_call>\n{"name": "weather", ',
        '"arguments": {"city": "Paris"}}\n</tool_call>',
    ]
    choice, shown = _Choice(served, "chat", tools), []
    for i, piece in enumerate(pieces):
        choice.add(1, piece, None, None)
        shown.append(choice.visible(final=i == len(pieces) - 1))
    assert "".join(shown) == "Let me check.\n"  # the call never shows as text
    content, found, finish = choice.final()
    assert finish == "tool_calls" and content == "Let me check."
    assert found[0]["function"] == {"name": "weather", "arguments": '{"city": "Paris"}'}


def test_command_line_mistakes_are_one_line(models, tmp_path):
    from mlx_rwkvx.server.main import main

    from helpers import CliError, cli

    path = str(models / "rwkv7")
    (tmp_path / "notes.txt").write_text("mine")
    for args, words in [
        (["--model", "nowhere"], "--model nowhere: no such file"),
        (["--model", path, "--adapter", "x=nope"], "nope: no such file"),
        (["--model", path, "--max-queue", "0"], "--max-queue must be at least 1"),
        (["--model", path, "--max-tokens", "9000"], "more than --max-request-tokens 8192"),
        (["--model", path, "--max-body-bytes", "0"], "--max-body-bytes must be at least 1"),
        (["--model", path, "--cache-dir", tmp_path / "notes.txt"], "not a folder"),
        (["--model", path, "--cache-dir", "."], "--cache-dir .*is the current folder"),
        (["--model", path, "--cache-dir", os.path.expanduser("~")], "is the home folder"),
        (["--model", path, "--cache-dir", path], "--cache-dir .*: is the input"),
        (["--model", path, "--cache-dir", os.path.join(path, "states")], "lies inside the input"),
    ]:
        with pytest.raises(CliError, match=words):
            cli(main, *args)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    config = tmp_path / "server.yaml"
    config.write_text(f"model: {path}\ncache_scope: everyone\n")
    with pytest.raises(CliError, match="cache_scope must be one of key, shared"):
        cli(main, "--config", config)
