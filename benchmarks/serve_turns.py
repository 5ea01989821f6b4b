"""The serve section's comparisons with this process: a conversation's second turns, their time
to the first streamed token against prefilling the same new tokens here on the restored state
(in one server, then after a restart with ``--cache-dir``), each served first answer verified
against the generation layer first; and decode holding the answer to a JSON schema against
without, in process."""

from __future__ import annotations

import json
import time

from benchmarks.common import VerificationFailed, rel_err
from benchmarks.serve_client import Server, words
from mlx_rwkvx.generation import Session, chat_format, stream_generate
from mlx_rwkvx.io.load import load

import numpy as np

# at least 40 items: an answer of a hundred tokens or more, whatever the model
SCHEMA = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 40}


def second_turns(path: str, cache_dir: str, c: dict, rng, args=(), then=None) -> dict:
    """Turn 1 of ``history`` words, then ``variants`` second turns of ``new`` words each, in
    one server, then as many again after a restart: each second turn's time to its first
    token, its cached tokens, and the same tokens prefilled here on the restored state.
    ``then(server)``: more measurements on the restarted server (its results kept)."""
    model, tok = load(path)
    fmt = chat_format(tok)
    first = [{"role": "user", "content": words(rng, c["history"])}]
    body = dict(model=path, max_tokens=c["answer"], temperature=0)
    out = {"server": [], "restart": []}
    server = Server("--model", path, "--cache-dir", cache_dir, *args)
    try:
        status, r = server.post(
            "/v1/chat/completions", {**body, "messages": first, "logprobs": True}
        )
        if status != 200:
            raise VerificationFailed(f"turn 1: {status} {r}")
        # verified first: the served answer's log-probabilities are the generation layer's
        theirs = [e["logprob"] for e in r["choices"][0]["logprobs"]["content"]]
        ours = [
            x.logprobs[x.token].item()
            for x in stream_generate(
                model, tok, fmt.apply(first), max_tokens=c["answer"], stop=fmt.stops
            )
        ]
        err = rel_err(np.array(theirs), np.array(ours)) if len(ours) == len(theirs) else 1.0
        out["verify"] = err
        if not err <= 1e-4:
            raise VerificationFailed(
                f"the served answer's log-probabilities vs the generation layer's: {err:.1e}"
            )
        history = first + [{"role": "assistant", "content": r["choices"][0]["message"]["content"]}]
        for phase in ("server", "restart"):
            if phase == "restart":
                server.stop()
                server = Server("--model", path, "--cache-dir", cache_dir, *args)
                server.post("/v1/completions", dict(model=path, prompt="warm up", max_tokens=1))
            for _ in range(c["variants"]):
                messages = history + [{"role": "user", "content": words(rng, c["new"])}]
                s = server.stream("/v1/chat/completions", {**body, "messages": messages})
                cached = s["usage"]["prompt_tokens_details"]["cached_tokens"]
                out[phase].append(
                    {
                        "first": s["first"],
                        "cached": cached,
                        "prompt": s["usage"]["prompt_tokens"],
                        "here": _prefill_here(model, tok, fmt, messages, cached),
                        "alone": _prefill_here(model, tok, fmt, messages, cached, alone=True),
                    }
                )
        if then is not None:
            out["then"] = then(server)
    finally:
        server.stop()
    return out


_HELD: dict = {}  # (model, the tokens held) -> the session after them: each prefilled once


def _prefill_here(model, tok, fmt, messages, cached: int, alone: bool = False) -> float:
    """Seconds to the first token of ``messages``' prompt past its first ``cached`` tokens,
    on the state after them (``alone``: on a fresh state), through the generation layer."""
    ids = tok.encode(fmt.apply(messages))
    session = Session(model)
    if cached and not alone:
        key = (id(model), tuple(ids[:cached]))
        if key not in _HELD:
            session.feed(ids[:cached])
            _HELD.clear()  # one at a time: a state of the 0.1B shape is megabytes
            _HELD[key] = session.snapshot()
        session.restore(_HELD[key])
    tic = time.perf_counter()
    next(stream_generate(model, tok, ids[cached:], max_tokens=1, session=session, stop=fmt.stops))
    return time.perf_counter() - tic


def schema_overhead(path: str, c: dict) -> dict:
    """Decode tokens/s holding the answer to a JSON schema against without, in process."""
    from mlx_rwkvx.server.protocol import ResponseFormat
    from mlx_rwkvx.server.schema import GrammarProcessor, grammar_of, token_table

    model, tok = load(path)
    table = token_table(tok, model.config.vocab_size)
    fmt = ResponseFormat(type="json_schema", json_schema={"name": "s", "schema": SCHEMA})
    grammar = grammar_of(fmt, table)
    n = c["schema_tokens"]
    rates = {}
    for name in ("free", "schema", "free", "schema"):  # each twice: the second counts
        procs = (
            [GrammarProcessor(table, grammar, model.config.vocab_size)]
            if (name == "schema")
            else []
        )
        last, text = None, []
        for last in stream_generate(
            model, tok, "A list:", max_tokens=n, temp=1.0, seed=0, logits_processors=procs
        ):
            text.append(last.text)
        if name == "schema" and last.finish_reason == "stop":
            json.loads("".join(text))  # it closed: it parses
        rates[name] = {"tokens": last.generation_tokens, "tps": last.generation_tps}
    return rates
