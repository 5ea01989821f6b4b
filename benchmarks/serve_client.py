"""The serve section's client side: ``Server`` (``python -m mlx_rwkvx.server`` on a free
localhost port, and HTTP requests to it, streamed or not, with nothing but the standard
library), ``words`` (text of about a token a word in RWKV World's vocabulary), and the two
measurements that only need a running server: ``streams`` (concurrent streams' aggregate
tokens/s) and ``load_test`` (many clients, streamed, not, hanging up), both ``concurrently``."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import sys
import threading
import time

from benchmarks.common import VerificationFailed

import numpy as np


class Server:
    """A server started with these arguments, until ``stop``."""

    def __init__(self, *args: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlx_rwkvx.server",
                *args,
                "--port",
                str(self.port),
                "--log-level",
                "error",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 300
        while True:
            try:
                self.get("/health")
                return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise VerificationFailed("the server did not start") from None
                time.sleep(0.05)

    def _conn(self) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)

    def get(self, route: str) -> dict:
        conn = self._conn()
        try:
            conn.request("GET", route)
            return json.loads(conn.getresponse().read())
        finally:
            conn.close()

    def post(self, route: str, body: dict) -> tuple[int, dict]:
        conn = self._conn()
        try:
            conn.request("POST", route, json.dumps(body), {"Content-Type": "application/json"})
            r = conn.getresponse()
            return r.status, json.loads(r.read())
        finally:
            conn.close()

    def stream(self, route: str, body: dict, hang_up_after: int | None = None) -> dict:
        """A streamed request: status, seconds to the first token, tokens, usage, text, and a
        chat's log-probabilities where asked (their ``content`` entries)."""
        conn = self._conn()
        tic = time.perf_counter()
        first, chunks, usage, status, text, logprobs = None, 0, None, None, [], []
        try:
            conn.request(
                "POST",
                route,
                json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
                {"Content-Type": "application/json"},
            )
            r = conn.getresponse()
            status = r.status
            if status != 200:
                r.read()
                return {"status": status}
            for line in r:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if event.get("usage"):
                    usage = event["usage"]
                if event.get("choices"):
                    if first is None:
                        first = time.perf_counter() - tic
                    chunks += 1
                    choice = event["choices"][0]
                    text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                    logprobs += (choice.get("logprobs") or {}).get("content") or []
                    if hang_up_after is not None and chunks >= hang_up_after:
                        break
        finally:
            conn.close()
        return {
            "status": status,
            "first": first,
            "chunks": chunks,
            "usage": usage,
            "time": time.perf_counter() - tic,
            "text": "".join(text),
            "logprobs": logprobs,
        }

    def rss(self, field: str = "VmRSS") -> int:
        """The server's resident memory now (``VmHWM``: its peak) in bytes."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def words(rng, n: int) -> str:
    pool = (
        "time year people way day man thing woman life child world school state family "
        "student group country problem hand part place case week company system program "
        "question work government number night point home water room mother area money "
        "story fact month lot right study book eye job word business issue side kind"
    ).split()
    return " ".join(rng.choice(pool, n))  # about a token a word in RWKV World's vocabulary


def concurrently(work, n: int) -> float:
    """``work(0)`` .. ``work(n - 1)`` on threads of their own, together: the seconds they took."""
    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    tic = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - tic


def streams(server: Server, path: str, c: dict) -> dict:
    """Aggregate tokens/s of n concurrent streams of ``stream_tokens`` each."""
    out = {}
    for n in c["streams"]:
        results: list = [None] * n

        def one(i, n=n, results=results):
            results[i] = server.stream(
                "/v1/completions",
                dict(
                    model=path,
                    prompt=f"Stream {i} of {n}:",
                    max_tokens=c["stream_tokens"],
                    temperature=0,
                ),
            )

        wall = concurrently(one, n)
        tokens = sum(r["usage"]["completion_tokens"] for r in results)
        out[str(n)] = {"tokens": tokens, "wall": wall}
    return out


def load_test(server: Server, path: str, c: dict) -> dict:
    """``requests`` requests from ``clients`` threads: a third streamed, a sixth of all
    hanging up after three tokens, the rest not streamed; statuses, and the server's resident
    memory after it against before it (after a warm-up of one request a client)."""
    spec = c["load"]
    statuses, lock = [], threading.Lock()
    rng = np.random.default_rng(99)
    for i in range(spec["clients"]):  # warm: what a first request of each size brings in
        server.post(
            "/v1/chat/completions",
            dict(
                model=path,
                max_tokens=16,
                messages=[{"role": "user", "content": words(rng, 8 + 39 * i // spec["clients"])}],
            ),
        )
    base_rss = server.rss()
    per = spec["requests"] // spec["clients"]

    def client(k):
        rng = np.random.default_rng(k)
        for j in range(per):
            i = k * per + j
            messages = [{"role": "user", "content": words(rng, 8 + i % 40)}]
            body = dict(model=path, messages=messages, max_tokens=16, temperature=0.7)
            if i % 3 == 0:
                s = server.stream("/v1/chat/completions", body, hang_up_after=3 if i % 2 else None)[
                    "status"
                ]
            else:
                s = server.post("/v1/chat/completions", body)[0]
            with lock:
                statuses.append(s)

    wall = concurrently(client, spec["clients"])
    alive = server.get("/health").get("status") == "ok"
    after = server.rss()
    return {
        "requests": len(statuses),
        "clients": spec["clients"],
        "wall": wall,
        "5xx": sum(s >= 500 for s in statuses),
        "4xx": sum(400 <= s < 500 for s in statuses),
        "alive": alive,
        "rss_before": base_rss,
        "rss_after": after,
        "cache_bytes": spec["cache_bytes"],
    }
