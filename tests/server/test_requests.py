"""What one request may cost the others, against ``python -m mlx_rwkvx.server`` on a free
localhost port (one server for the module): a client that goes (a raw socket closed mid-request)
stops its work, whatever flows meanwhile; an embeddings request shares the engine's turns and
stops when its client goes; a body over ``--max-body-bytes`` is refused before it is read or
its key checked; a sampler that fails leaves the random state usable for every other answer
and fails its answer alone, not its batch; a stream whose client goes is cancelled while
nothing is sent; a second SIGTERM stops the server at once. Overlap and order are checked by
the server's own counts (``/health``), never by durations; the deadlines are safety nets."""

from __future__ import annotations

import json
import select
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import mlx.core as mx
import pytest
from helpers.serving import Server, chat_model

pytest.importorskip("fastapi", reason="the server extra")
pytest.importorskip("uvicorn", reason="the server extra")

KEY = "sesame"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "Hello, world!"}]
MAX_BODY = 1 << 20
WAIT = 60.0  # seconds: a safety net for what the server's counts show long before


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("requests"), seed=20, name="rwkv7")


@pytest.fixture(scope="module")
def server(model):
    server = Server(
        [
            "--model",
            model,
            "--api-key",
            KEY,
            "--max-request-tokens",
            "1000000",
            "--max-prompt-tokens",
            "1000000",
            "--max-inputs",
            "8",
            "--max-body-bytes",
            MAX_BODY,
        ]
    )
    yield server
    server.stop()


def _open(server: Server, route: str, body: dict, headers: dict | None = None) -> socket.socket:
    """A request sent on a raw socket, its answer not read (closing the socket hangs up)."""
    data = json.dumps(body).encode()
    head = {
        "Host": "127.0.0.1",
        "Content-Type": "application/json",
        "Connection": "close",
        "Content-Length": str(len(data)),
        **AUTH,
        **(headers or {}),
    }
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    lines = [f"POST {route} HTTP/1.1", *(f"{k}: {v}" for k, v in head.items()), "", ""]
    sock.sendall("\r\n".join(lines).encode() + data)
    return sock


def _reply(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on ``sock`` (``Connection: close``)."""
    raw = b""
    while chunk := sock.recv(1 << 16):
        raw += chunk
    sock.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


def _health(server: Server) -> dict:
    request = urllib.request.Request(f"http://127.0.0.1:{server.port}/health", headers=AUTH)
    with urllib.request.urlopen(request, timeout=WAIT) as r:
        return json.loads(r.read())


def _wait_for(server: Server, what: str, test) -> None:
    deadline = time.monotonic() + WAIT
    while not test(health := _health(server)):
        assert time.monotonic() < deadline, f"still {what}: {health}"
        time.sleep(0.05)


def _chat(server: Server, model: str, **kw) -> tuple[int, dict]:
    return _reply(
        _open(
            server,
            "/v1/chat/completions",
            {"model": model, "messages": CHAT, "max_tokens": 4, **kw},
        )
    )


def test_a_client_that_goes_stops_its_answers_while_tokens_flow(server, model):
    """Answers of a million tokens, not streamed: their clients hang up while every step
    sends a token; the server stops them (its count of answers decoding falls to 0)."""
    socks = [
        _open(
            server,
            "/v1/chat/completions",
            {"model": model, "messages": CHAT, "max_tokens": 1_000_000},
        )
        for _ in range(4)
    ]
    _wait_for(server, "not decoding", lambda h: h["decoding"] == 4)
    for sock in socks:
        sock.close()
    _wait_for(server, "decoding", lambda h: h["decoding"] == 0)
    status, body = _chat(server, model)
    assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


def test_embeddings_take_turns_with_answers_and_stop_when_their_client_goes(server, model):
    """A long embeddings request (eight inputs of 20,000 tokens) is running when a short chat
    arrives: the chat is answered while the embeddings still run; their client then hangs up
    and they stop."""
    sock = _open(server, "/v1/embeddings", {"model": model, "input": [[7] * 20_000] * 8})
    _wait_for(server, "not embedding", lambda h: h["embedding"] == 1)
    status, _ = _chat(server, model)
    assert status == 200
    # the chat did not wait for the embeddings: they run on, their answer not yet sent
    assert _health(server)["embedding"] == 1 and not select.select([sock], [], [], 0)[0]
    sock.close()
    _wait_for(server, "embedding", lambda h: h["embedding"] == 0)
    status, body = _reply(_open(server, "/v1/embeddings", {"model": model, "input": ["hi"]}))
    assert status == 200 and len(body["data"]) == 1


def _raw_head(server: Server, head: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT)
    sock.sendall(head.replace("\n", "\r\n").encode())
    return sock


def test_a_body_over_the_limit_is_refused_before_it_is_read(server, model):
    """413 with OpenAI's error JSON, before the key is checked (none is sent): by its
    Content-Length, the body never sent; sent in chunks, once they pass the limit."""
    sock = _raw_head(
        server,
        f"POST /v1/chat/completions HTTP/1.1\nHost: 127.0.0.1\n"
        f"Content-Length: {10**12}\nConnection: close\n\n",
    )
    status, body = _reply(sock)
    assert status == 413 and "--max-body-bytes" in body["error"]["message"]
    sock = _raw_head(
        server,
        "POST /v1/embeddings HTTP/1.1\nHost: 127.0.0.1\n"
        "Transfer-Encoding: chunked\nConnection: close\n\n",
    )
    chunk = b"x" * (64 << 10)
    for _ in range(MAX_BODY // len(chunk)):
        sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
    sock.sendall(b"1\r\nx\r\n")  # one byte past the limit: all it was sent is read, then 413
    status, body = _reply(sock)
    assert status == 413 and body["error"]["code"] == "request_too_large"
    # within the limit, in chunks: read and answered
    data = json.dumps({"model": model, "input": "hi"}).encode()
    sock = _raw_head(
        server,
        f"POST /v1/embeddings HTTP/1.1\nHost: 127.0.0.1\n"
        f"Authorization: Bearer {KEY}\nContent-Type: application/json\n"
        "Transfer-Encoding: chunked\n"
        "Connection: close\n\n",
    )
    sock.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data))
    status, body = _reply(sock)
    assert status == 200 and len(body["data"][0]["embedding"]) > 0


def test_a_failed_sampler_leaves_the_random_state_to_the_others():
    """mlx-lm's compiled top-k takes ``mx.random.state`` as an input and leaves it unusable
    when it raises (a top_k over the vocabulary): every later draw failed. The server's
    sampler draws from its own key and resets the state when a filter fails."""
    from mlx_rwkvx.server.answers import Params, sampler

    logprobs = mx.random.normal((1, 512))
    logprobs = logprobs - mx.logsumexp(logprobs, axis=-1, keepdims=True)
    with pytest.raises(ValueError, match="top_k"):
        mx.eval(sampler(Params(max_tokens=1, temp=1.0, top_k=600))(logprobs))
    for params in (Params(max_tokens=1, temp=1.0), Params(max_tokens=1, temp=0.7, top_k=5)):
        token = sampler(params)(logprobs)
        assert 0 <= token.item() < 512
    assert mx.random.uniform().item() < 1  # mx.random.state itself is usable


def test_a_seeded_draw_depends_on_its_position_not_on_how_often_it_was_drawn():
    """A batch does not call a row's sampler exactly once per token of its answer (the soak
    of ``scripts/bench.py serve`` found seeded answers unlike theirs alone when a sampler
    counted its calls): a draw is keyed by the seed and the tokens before it, which the
    sampler's own logits processor notes."""
    import types

    from mlx_rwkvx.server.answers import Params, sampling

    logprobs = mx.zeros((1, 4096)) - 4096**0.5  # flat: any other key draws another token
    served = types.SimpleNamespace(model=None)
    sample, procs = sampling(Params(max_tokens=4, temp=1.0, seed=7), served)
    other, other_procs = sampling(Params(max_tokens=4, temp=1.0, seed=7), served)

    def draw(sample, procs, n):
        for p in procs:
            p(mx.zeros((n,), dtype=mx.int32), logprobs)
        return sample(logprobs).item()

    draws = [draw(sample, procs, n) for n in (5, 5, 5, 6)]
    assert draws[0] == draws[1] == draws[2] != draws[3]  # called again: the same token
    assert [draw(other, other_procs, n) for n in (5, 6)] == [draws[0], draws[3]]
    greedy, greedy_procs = sampling(Params(max_tokens=4), served)
    assert greedy_procs == [] and greedy(logprobs).item() == 0


def test_a_second_sigterm_stops_at_once(model):
    """The first SIGTERM lets requests in flight finish (here for ten minutes); the second
    cancels them and the process ends, with a long embeddings request in flight."""
    server = Server(
        ["--model", model, "--shutdown-timeout", "600", "--max-prompt-tokens", "1000000"]
    )
    try:
        sock = _open(server, "/v1/embeddings", {"model": model, "input": [[7] * 30_000] * 8})
        reader = threading.Thread(target=lambda: sock.recv(1), daemon=True)
        reader.start()
        _wait_for(server, "not embedding", lambda h: h["embedding"] == 1)
        server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + WAIT  # the first signal taken: no new connections
        while True:
            try:
                socket.create_connection(("127.0.0.1", server.port), timeout=1).close()
            except OSError:
                break
            assert time.monotonic() < deadline
            time.sleep(0.05)
        server.proc.send_signal(signal.SIGTERM)
        try:
            server.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail("the server was still running 30 s after the second SIGTERM")
        assert server.proc.returncode == 0
        sock.close()
    finally:
        out = server.stop()
    assert "stopped" in out and "Traceback" not in out, out


def test_a_stream_is_cancelled_when_its_client_goes_while_nothing_is_sent():
    """A streamed answer whose text is held (a tool call's: nothing is sent) is cancelled when
    its client goes, whether or not the ASGI server's Starlette watches for the disconnect
    itself (from ASGI 2.4 it learns of one only when a send fails, and none is tried)."""
    import asyncio

    from mlx_rwkvx.server.jobs import Job
    from mlx_rwkvx.server.replies import _streamed

    async def go():
        job, gone = Job(), asyncio.Event()

        class Request:  # the client's messages: its body was read, then it goes
            async def receive(self):
                await gone.wait()
                return {"type": "http.disconnect"}

        async def held():
            yield "data: first\n\n"
            await job.events.get()  # nothing more to send until the job ends
            yield "data: never\n\n"

        body = await _streamed(job, held(), Request())
        assert await body.__anext__() == "data: first\n\n"
        waiting = asyncio.create_task(body.__anext__())  # the response waits for a piece
        await asyncio.sleep(0)
        assert not job.cancelled.is_set()
        gone.set()
        cancelled = await asyncio.to_thread(job.cancelled.wait, WAIT)
        waiting.cancel()
        return cancelled

    assert asyncio.run(go()), "the job ran on after its client went"


def test_a_failed_sampler_fails_its_answer_alone(model, monkeypatch):
    """Two answers decode in one batch; the sampler of one raises at its second token: that
    answer is a 500, the other (in the same batch) is answered in full."""
    import asyncio

    from mlx_rwkvx.server import engine as engine_module
    from mlx_rwkvx.server.answers import Params, sampling
    from mlx_rwkvx.server.jobs import Job
    from mlx_rwkvx.server.main import ServerConfig, build

    def failing_at_second(params, served):
        (made, procs), calls = sampling(params, served), []

        def sample(logprobs):
            calls.append(1)
            if params.seed == 13 and len(calls) == 2:
                raise RuntimeError("a sampler's bug")
            return made(logprobs)

        return sample, procs

    monkeypatch.setattr(engine_module, "sampling", failing_at_second)
    engine = build(ServerConfig(model=model), log=lambda line: None)
    served = engine.served[model]
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()

    async def job(seed):
        return Job(answers=[(served, [1, 2, 3], Params(max_tokens=6, seed=seed))])

    async def events(job):
        out = []
        while not job.events.empty():
            out.append(job.events.get_nowait())
        return out

    try:
        bad, good = (asyncio.run_coroutine_threadsafe(job(s), loop).result() for s in (13, 1))
        engine.submit(bad)
        engine.submit(good)
        engine.run(until=lambda: bad.ended and good.ended)
        got = {
            name: asyncio.run_coroutine_threadsafe(events(j), loop).result(timeout=WAIT)
            for name, j in (("bad", bad), ("good", good))
        }
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=WAIT)
    errors = [e[1] for e in got["bad"] if e[0] == "error"]
    assert len(errors) == 1 and errors[0].status == 500
    assert not [e for e in got["good"] if e[0] == "error"]
    assert [e[2] for e in got["good"] if e[0] == "done"] == ["length"]
    assert len([e for e in got["good"] if e[0] == "token"]) == 6
