"""The serve section's soak: many clients, each sending a mix of what a shared server meets —
plain and streamed answers, clients that hang up mid-stream, clients that ask for the longest
answer the server allows and go away, embeddings, seeded sampling and malformed requests —
against a small state cache kept on disk. What must hold: no 5xx; every good request answered
within its deadline and equal to its answer alone (asked one at a time, before the soak, on
the same server); every bad one a 4xx; nothing left decoding once the clients are gone; the
server's resident memory, open descriptors and state folder flat."""

from __future__ import annotations

import http.client
import json
import os
import threading
import time

from benchmarks.serve_client import Server, concurrently, words

import numpy as np

KINDS = ("chat", "stream", "hang-up", "walk-away", "embed", "bad", "seeded", "text")
# Malformed or over-limit requests: each must be refused with a 4xx, none may hurt the others.
BAD = (
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 1, "top_k": 10**9},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "10"},
    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**9},
    {"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0},
    {"messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "f"}]}]},
    {"messages": []},
    {"prompt": []},
    {"prompt": "hi", "n": 10**6},
)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _folder_bytes(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # removed while counted
                pass
    return total


def _walk_away(server: Server, body: dict, after: float) -> None:
    """A request whose client closes its connection ``after`` seconds, answered or not."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=after)
    try:
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        conn.getresponse().read()
    except OSError:  # the timeout too: the client goes
        pass
    finally:
        conn.close()


class _Reference:
    """Each good request's answer alone, asked one at a time before the soak."""

    def __init__(self, server: Server, path: str, prompts: list[str]):
        self.server, self.path, self.prompts = server, path, prompts
        self.answers: dict = {}

    def body(self, kind: str, p: int, max_tokens: int) -> tuple[str, dict]:
        user = [{"role": "user", "content": self.prompts[p]}]
        if kind == "embed":
            return "/v1/embeddings", {"model": self.path, "input": [self.prompts[p], "and more"]}
        if kind == "text":
            return "/v1/completions", {
                "model": self.path,
                "prompt": self.prompts[p],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logprobs": 2,
            }
        seeded = {"temperature": 0.8, "seed": p} if kind == "seeded" else {"temperature": 0}
        return "/v1/chat/completions", {
            "model": self.path,
            "messages": user,
            "max_tokens": max_tokens,
            "logprobs": True,
            "top_logprobs": 2,
            **seeded,
        }

    @staticmethod
    def answer_of(kind: str, r: dict):
        """An embedding's vectors; an answer's text and, per token, its own and the top two
        (token, log-probability) pairs."""
        if kind == "embed":
            return [np.array(d["embedding"]) for d in r["data"]]
        choice = r["choices"][0]
        if kind == "text":
            lp = choice["logprobs"]
            steps = [
                (t, [*top.items()]) for t, top in zip(lp["tokens"], lp["top_logprobs"], strict=True)
            ]
            return choice["text"], steps
        return choice["message"]["content"], _chat_steps(choice["logprobs"]["content"])

    def get(self, kind: str, p: int, max_tokens: int):
        key = ("chat" if kind == "stream" else kind, p)
        if key not in self.answers:
            route, body = self.body(key[0], p, max_tokens)
            status, r = self.server.post(route, body)
            if status != 200:
                raise RuntimeError(f"the reference {key}: {status} {r}")
            self.answers[key] = self.answer_of(key[0], r)
        return self.answers[key]


def _chat_steps(content: list[dict]) -> list:
    return [(e["token"], [(t["token"], t["logprob"]) for t in e["top_logprobs"]]) for e in content]


# Two tokens whose log-probabilities, alone, lie this close are a tie that float32 rounding
# decides: a batch sums its products in another order than one row alone, so such a tie may
# go the other way in a batch (random weights make near-ties common).
TIE = 1e-3


def _verdict(got, ref) -> str:
    """same, tie (the answers part where the answer alone had a near-tie between the two
    tokens: rounding's choice, and the rest follows from it) or wrong."""
    if isinstance(ref, list):  # embeddings
        same = len(got) == len(ref) and all(
            np.allclose(x, y, rtol=1e-4, atol=1e-5) for x, y in zip(got, ref, strict=True)
        )
        return "same" if same else "wrong"
    (text, steps), (ref_text, ref_steps) = got, ref
    if text == ref_text:
        return "same"
    for (token, _), (ref_token, ref_top) in zip(steps, ref_steps, strict=False):
        if token != ref_token:
            top = dict(ref_top)
            near = token in top and ref_token in top and top[ref_token] - top[token] < TIE
            return "tie" if near else "wrong"
    return "wrong"  # the same tokens, another text (or fewer of them)


def soak(path: str, folder: str, spec: dict) -> dict:
    """``spec``: clients, requests (a client), answer (tokens of a good answer), prompts
    (distinct ones), cache_bytes, deadline (seconds a good request may take), walk_away
    (seconds before such a client hangs up)."""
    server = Server(
        "--model",
        path,
        "--cache-dir",
        folder,
        "--cache-bytes",
        str(spec["cache_bytes"]),
        "--max-queue",
        str(spec["clients"] * 4),
    )
    try:
        rng = np.random.default_rng(7)
        prompts = [words(rng, 6 + 5 * i) for i in range(spec["prompts"])]
        ref = _Reference(server, path, prompts)
        for kind in ("chat", "embed", "seeded", "text"):  # answers alone, and a warm server
            for p in range(spec["prompts"]):
                ref.get(kind, p, spec["answer"])
        pid = server.proc.pid
        counts = {k: 0 for k in ("good", "bad", "5xx", "late", "wrong", "tie", "not_4xx")}
        wrong: list = []  # (kind, prompt) of each answer unlike its answer alone
        lock = threading.Lock()

        def note(**inc):
            with lock:
                for k, v in inc.items():
                    counts[k] += v

        def client(k: int, rounds: range) -> None:
            for j in rounds:
                i = k * spec["requests"] + j
                kind, p = KINDS[i % len(KINDS)], (i // len(KINDS)) % spec["prompts"]
                if kind == "walk-away":
                    _walk_away(
                        server,
                        {
                            "model": path,
                            "max_tokens": 8192,
                            "messages": [{"role": "user", "content": prompts[p]}],
                        },
                        spec["walk_away"],
                    )
                    continue
                if kind == "bad":
                    body = {"model": path, **BAD[i // len(KINDS) % len(BAD)]}
                    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
                    status = server.post(route, body)[0]
                    note(
                        bad=1,
                        **{"5xx": int(status >= 500), "not_4xx": int(not 400 <= status < 500)},
                    )
                    continue
                tic = time.monotonic()
                if kind in ("stream", "hang-up"):
                    _, body = ref.body("chat", p, spec["answer"])
                    s = server.stream(
                        "/v1/chat/completions", body, hang_up_after=2 if kind == "hang-up" else None
                    )
                    status = s["status"]
                    answer = (s.get("text"), _chat_steps(s.get("logprobs") or []))
                else:
                    route, body = ref.body(kind, p, spec["answer"])
                    status, r = server.post(route, body)
                    answer = ref.answer_of(kind, r) if status == 200 else None
                late = time.monotonic() - tic > spec["deadline"]
                verdict = "same"
                if status == 200 and kind != "hang-up":
                    verdict = _verdict(answer, ref.get(kind, p, spec["answer"]))
                if verdict == "wrong":
                    with lock:
                        wrong.append((kind, p))
                note(
                    good=1,
                    late=int(late),
                    wrong=int(verdict == "wrong"),
                    tie=int(verdict == "tie"),
                    **{"5xx": int(status is None or status >= 500)},
                )

        # two rounds: the first brings the server to its working size (batches of every
        # client, the cache full), the second must leave it there (memory, descriptors)
        half = spec["requests"] // 2
        wall = concurrently(lambda k: client(k, range(half)), spec["clients"])
        before = {"rss": server.rss(), "fds": _fds(pid), "folder": _folder_bytes(folder)}
        wall += concurrently(lambda k: client(k, range(half, spec["requests"])), spec["clients"])
        idle_after = None
        settle = time.monotonic()
        while time.monotonic() - settle < 60:  # the walked-away answers are cancelled
            health = server.get("/health")
            if not health.get("decoding") and not health.get("waiting"):
                idle_after = time.monotonic() - settle
                break
            time.sleep(0.2)
        after = {"rss": server.rss(), "fds": _fds(pid), "folder": _folder_bytes(folder)}
        alive = server.post(*ref.body("chat", 0, spec["answer"]))[0] == 200
    finally:
        server.stop()
    return {
        **counts,
        "wrong_kinds": sorted(set(wrong)),
        "clients": spec["clients"],
        "requests": spec["requests"],
        "wall": wall,
        "idle_after": idle_after,
        "alive": alive,
        "before": before,
        "after": after,
        "cache_bytes": spec["cache_bytes"],
        "deadline": spec["deadline"],
    }
