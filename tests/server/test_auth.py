"""Who may use a server, and what one client can learn of another's: API keys (``--api-key``
repeatable, ``--api-key-file``, ``$MLX_RWKVX_API_KEY``; an empty one refused; ``Bearer`` in
any case or ``x-api-key``; every key compared in constant time), the ``Host`` check of a
server on a loopback address (DNS rebinding), what ``/health`` tells a client without a key,
and the cache's trust scopes: one key's conversations are never resumed for, nor counted in
``cached_tokens`` of, another key (``--cache-scope shared`` shares them on purpose). Each
through raw HTTP to a server on a free localhost port."""

from __future__ import annotations

import http.client
import json
import subprocess

import pytest
from helpers import run_module
from helpers.parity import import_parity_extra
from helpers.serving import Server, chat_model

import_parity_extra(("fastapi", "uvicorn"), extra="server")

KEY_A, KEY_B = "alpha-0123456789", "bravo-9876543210"
SECRET = [{"role": "user", "content": "My PIN is 4821"}]
GUESS = [{"role": "user", "content": "My PIN is 1234"}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return chat_model(tmp_path_factory.mktemp("auth"), seed=5)


@pytest.fixture(scope="module")
def keyed(model, tmp_path_factory):
    """A server of two keys from a file (one scope each), answering the Host rwkv.test too."""
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text(f"# the team's keys\n\n{KEY_A}\n  {KEY_B}  \n")
    server = Server(["--model", model, "--api-key-file", keys, "--allowed-hosts", "rwkv.test"])
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shared(model):
    """A server of two keys given as flags, sharing one cache scope, answering any Host."""
    server = Server(
        [
            "--model",
            model,
            "--api-key",
            KEY_A,
            "--api-key",
            KEY_B,
            "--cache-scope",
            "shared",
            "--allowed-hosts",
            "*",
        ]
    )
    yield server
    server.stop()


def call(server: Server, method: str, route: str, *, body=None, headers=None):
    """(status, JSON body) of a request as it comes (its Host header may be forged)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(
            method,
            route,
            body=data,
            headers={"Content-Type": "application/json", **(headers or {})},
        )
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"null")
    finally:
        conn.close()


def bearer(key: str, scheme: str = "Bearer") -> dict:
    return {"Authorization": f"{scheme} {key}"}


def cached(server: Server, messages, headers) -> int:
    """``cached_tokens`` of a chat answer to ``messages`` (asserted to be answered)."""
    model = server.proc.args[server.proc.args.index("--model") + 1]
    status, body = call(
        server,
        "POST",
        "/v1/chat/completions",
        headers=headers,
        body={"model": model, "messages": messages, "max_tokens": 3},
    )
    assert status == 200, body
    usage = body["usage"]
    assert usage["prompt_tokens"] > 0
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_an_empty_key_is_refused_in_one_line(model, tmp_path):
    from mlx_rwkvx.errors import UsageError
    from mlx_rwkvx.server.main import PROG, ServerConfig, api_keys
    from mlx_rwkvx.settings import load

    def settings_of(argv):
        return load(ServerConfig, argv, PROG)

    r = run_module("server", "--model", model, "--api-key", "", timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "--api-key" in lines[0] and "empty key" in lines[0]

    empty = tmp_path / "empty.txt"
    empty.write_text("# no keys yet\n\n")
    with pytest.raises(UsageError, match="no key in it"):
        api_keys(settings_of(["--model", model, "--api-key-file", str(empty)]))
    with pytest.raises(UsageError, match="no such file|No such file"):
        api_keys(settings_of(["--model", model, "--api-key-file", str(tmp_path / "nope")]))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MLX_RWKVX_API_KEY", "")
        with pytest.raises(UsageError, match="MLX_RWKVX_API_KEY.*empty key"):
            api_keys(settings_of(["--model", model]))
        mp.setenv("MLX_RWKVX_API_KEY", "from-env")
        assert api_keys(settings_of(["--model", model])) == ["from-env"]
    with pytest.raises(UsageError, match="printable ASCII"):
        api_keys(settings_of(["--model", model, "--api-key", "two words"]))


def test_keys_by_bearer_in_any_case_or_x_api_key(keyed):
    assert call(keyed, "GET", "/v1/models")[0] == 401
    status, body = call(keyed, "GET", "/v1/models", headers=bearer("wrong"))
    assert status == 401 and body["error"]["code"] == "invalid_api_key"
    assert call(keyed, "GET", "/v1/models", headers=bearer(KEY_A[:-1]))[0] == 401
    assert call(keyed, "GET", "/v1/models", headers={"x-api-key": "wrong"})[0] == 401
    for headers in (
        bearer(KEY_A),
        bearer(KEY_B, "bearer"),
        bearer(KEY_A, "BEARER"),
        {"x-api-key": KEY_B},
        {"X-Api-Key": KEY_A},
    ):
        status, body = call(keyed, "GET", "/v1/models", headers=headers)
        assert status == 200 and body["data"], headers


def test_a_key_from_a_file_is_not_in_the_process_list(keyed):
    args = subprocess.run(
        ["ps", "-ww", "-o", "args=", "-p", str(keyed.proc.pid)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "--api-key-file" in args
    assert KEY_A not in args and KEY_B not in args


def test_every_key_is_compared(monkeypatch):
    """Constant time: every key is compared with ``hmac.compare_digest``, the first matching
    one too (stopping there would tell by the time which key it was)."""
    from mlx_rwkvx.server import guards

    compared = []

    def compare(a, b):
        compared.append(b)
        return a == b

    monkeypatch.setattr(guards.hmac, "compare_digest", compare)
    names = ["key-one", "key-two", "key-three"]  # not hex: a scope never holds them by chance
    keys = guards.ApiKeys(names)
    assert keys.scope({"authorization": "Bearer key-one"}) == keys.scopes[0]
    assert compared == [b"key-one", b"key-two", b"key-three"]
    assert keys.scope({"authorization": "Bearer key-four"}) is None
    assert len(set(keys.scopes)) == 3
    for name, scope in zip(names, keys.scopes, strict=True):  # a hash, never the key
        assert name not in scope and not scope.startswith(name.encode().hex()[:8]), scope
    assert guards.ApiKeys(["k1", "k2"], shared=True).scopes == ["", ""]
    assert guards.ApiKeys([]).scope({}) == ""  # no key configured: every request, one scope
    with pytest.raises(ValueError):
        guards.ApiKeys([""])


def test_a_forged_host_is_refused_on_a_loopback_server(keyed, shared):
    port = keyed.port
    for host in (
        "evil.test",
        f"evil.test:{port}",
        "127.0.0.1.evil.test",
        "localhost.evil.test",
        "10.0.0.1",
        "",
    ):
        status, body = call(keyed, "GET", "/v1/models", headers={"Host": host, **bearer(KEY_A)})
        assert status == 403 and body["error"]["code"] == "host_not_allowed", host
        assert call(keyed, "GET", "/health", headers={"Host": host})[0] == 403
    for host in (
        f"localhost:{port}",
        "LOCALHOST",
        f"127.0.0.1:{port}",
        "127.8.9.10",
        f"[::1]:{port}",
        "rwkv.test",
        f"RWKV.test:{port}",
    ):
        status, _ = call(keyed, "GET", "/v1/models", headers={"Host": host, **bearer(KEY_A)})
        assert status == 200, host
    # --allowed-hosts '*': any
    assert (
        call(shared, "GET", "/v1/models", headers={"Host": "evil.test", **bearer(KEY_A)})[0] == 200
    )


def test_health_without_a_key_names_no_model(keyed, model):
    status, body = call(keyed, "GET", "/health")
    assert status == 200 and body == {"status": "ok"}
    assert call(keyed, "GET", "/health", headers=bearer("wrong"))[1] == {"status": "ok"}
    status, body = call(keyed, "GET", "/health", headers=bearer(KEY_B))
    assert status == 200 and body["models"] == [model] and body["decoding"] == 0


def test_one_key_never_learns_of_anothers_conversation(keyed):
    a, b = bearer(KEY_A), {"x-api-key": KEY_B}
    assert cached(keyed, SECRET, a) == 0
    assert cached(keyed, SECRET, a) > 0  # A's own conversation resumes
    assert cached(keyed, SECRET, bearer(KEY_A, "bearer")) > 0  # the same key, however sent
    # B: the exact text and a wrong guess look the same (nothing stored for B yet)
    assert cached(keyed, GUESS, b) == 0
    assert cached(keyed, SECRET, b) == 0
    assert cached(keyed, SECRET, bearer(KEY_B)) > 0  # B's own copy, now
    assert cached(keyed, GUESS, a) == 0  # and A never saw B's guess


def test_a_shared_cache_scope_shares_on_purpose(shared):
    assert cached(shared, SECRET, bearer(KEY_A)) == 0
    assert cached(shared, SECRET, bearer(KEY_B)) > 0


def test_a_keys_states_stay_its_own_after_a_restart(model, tmp_path):
    """The scope is saved with each state in ``--cache-dir``: after a restart A resumes its
    conversation and B still learns nothing of it."""
    args = [
        "--model",
        model,
        "--api-key",
        KEY_A,
        "--api-key",
        KEY_B,
        "--cache-dir",
        tmp_path / "states",
    ]
    server = Server(args)
    try:
        assert cached(server, SECRET, bearer(KEY_A)) == 0
    finally:
        server.stop()
    server = Server(args)
    try:
        assert cached(server, SECRET, bearer(KEY_B)) == 0
        assert cached(server, SECRET, bearer(KEY_A)) > 0
    finally:
        server.stop()


def test_the_command_and_the_guard_agree_on_loopback():
    """``main``'s warning (a non-loopback --host without a key) and the Host guard use one
    test: names in any case, with a trailing dot, every 127.x.x.x and ::1."""
    from mlx_rwkvx.server import guards, main

    assert main.loopback is guards.loopback
    for host in ("localhost", "LOCALHOST", "localhost.", "127.0.0.1", "127.8.9.10", "::1"):
        assert guards.loopback(host), host
    for host in ("evil.test", "10.0.0.1", "0.0.0.0", "localhost.evil.test", ""):
        assert not guards.loopback(host), host
