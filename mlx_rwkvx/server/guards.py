"""What a request must pass before the application sees it: its size (``BodyLimit``, before
a byte of it is read), its ``Host`` on a loopback server (``LoopbackHosts``, against DNS
rebinding) and its API key (``ApiKeys``, with the cache scope each key stands for). Plain ASGI,
no web framework: ``main`` uses ``loopback`` without the server extra installed."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json

from mlx_rwkvx.server.protocol import error_body

_SCOPE_SALT = b"mlx_rwkvx cache scope"  # a key's scope: PBKDF2 of the key with this salt


class ApiKeys:
    """The keys a request may carry (none: every request is answered) and the cache scope
    each stands for: a short hash of the key (never the key: a scope is written beside the
    states on disk), or "" for every key with ``shared``."""

    def __init__(self, keys: list[str], *, shared: bool = False):
        if any(not k for k in keys):
            raise ValueError("an empty API key")  # the command refuses them: a bug here
        self.keys = [k.encode("latin-1") for k in keys]
        self.scopes = [
            "" if shared else hashlib.pbkdf2_hmac("sha256", k, _SCOPE_SALT, 10_000)[:8].hex()
            for k in self.keys
        ]

    def scope(self, headers) -> str | None:
        """The scope of the key ``headers`` carry (``Authorization: Bearer KEY``, the scheme in
        any case, or ``x-api-key: KEY``); None when they carry none of the keys, "" when no
        key is configured. Each is compared with every key in constant time: how long it
        takes says neither whether nor which key matched (only its length)."""
        if not self.keys:
            return ""
        scheme, _, bearer = headers.get("authorization", "").strip().partition(" ")
        given = [
            bearer.strip() if scheme.lower() == "bearer" else "",
            headers.get("x-api-key", "").strip(),
        ]
        for candidate in (g.encode("latin-1") for g in given if g):
            found = None
            for key, scope in zip(self.keys, self.scopes, strict=True):
                if hmac.compare_digest(candidate, key):
                    found = scope
            if found is not None:
                return found
        return None


def loopback(host: str) -> bool:
    """Whether a host name or address (as ``--host`` or a ``Host`` header's name gives it) is
    this machine's own: localhost, 127.x.x.x, ::1."""
    host = host.lower().rstrip(".")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _host_name(header: str) -> str:
    """A ``Host`` header's name, without its port (``[::1]:8080`` -> ``::1``)."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    return header.partition(":")[0] if header.count(":") == 1 else header


class LoopbackHosts:
    """ASGI middleware for a server on a loopback address: a request whose ``Host`` names
    neither this machine nor one of ``allowed`` ('*': any) is refused (403). A web page the
    user visits could otherwise reach the server through DNS rebinding: its own name, resolved
    to 127.0.0.1 after the page loaded, is then the request's ``Host``."""

    def __init__(self, app, allowed: list[str]):
        self.app = app
        self.allowed = {name.lower().rstrip(".") for name in allowed}

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and "*" not in self.allowed:
            header = dict(scope["headers"]).get(b"host", b"").decode("latin-1")
            name = _host_name(header)
            if not (loopback(name) or name.rstrip(".") in self.allowed):
                body = error_body(
                    f"the Host {header!r} is not this machine's: a server on a "
                    "loopback address answers only localhost, 127.x.x.x and "
                    "[::1] (--allowed-hosts NAME widens it)",
                    "invalid_request_error",
                    code="host_not_allowed",
                )
                await _respond(send, 403, body)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """ASGI middleware: a request body of more than ``most`` bytes is refused (413) before it
    is parsed or its key checked: by its ``Content-Length`` before a byte of it is read, or,
    sent in chunks, as soon as the chunks pass the limit (the body is then read here)."""

    def __init__(self, app, most: int):
        self.app, self.most = app, most

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit() or int(length) > self.most:
                return await self._refuse(scope, receive, send)
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.most:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body, given = b"".join(chunks), False

        async def replay():
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send):
        body = error_body(
            f"the request body is larger than this server takes ({self.most} "
            "bytes, --max-body-bytes)",
            "invalid_request_error",
            code="request_too_large",
        )
        await _respond(send, 413, body, close=True)


async def _respond(send, status: int, body: dict, *, close: bool = False) -> None:
    """A JSON response sent straight through ASGI (as Starlette's ``JSONResponse`` sends it)."""
    data = json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(data))]
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": data})
