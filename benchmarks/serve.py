"""The serve section: ``python -m mlx_rwkvx.server`` as a client sees it, over HTTP on
localhost. The second turn of a long conversation (time to its first streamed token) against
prefilling its new tokens on the restored state in this process (the server's overhead), in
one process and after a restart with ``--cache-dir``, for RWKV-7, RWKV-X and RFA; aggregate
tokens/s of 1, 2, 4 and 8 concurrent streams; decode with a JSON schema against without; the
long load test (16 clients, streamed, not, and hanging up): no 5xx, memory; and the soak
(``serve_soak``: every kind of request a shared server meets, good and bad, at once)."""

from __future__ import annotations

import json
import os
import tempfile
import time

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    sizes,
    with_goals,
)
from benchmarks.serve_client import Server, load_test, streams, words
from benchmarks.serve_soak import soak, soak_goals, soak_lines
from mlx_rwkvx.generation import Session, chat_format, stream_generate
from mlx_rwkvx.io.load import load
from mlx_rwkvx.models import Model, ModelConfig, preset, rfa_config, rwkv_x_block_types

import mlx.core as mx
import numpy as np

SERVE = {
    "full": dict(
        width=768,
        layers=12,
        history=1500,
        new=48,
        answer=8,
        variants=6,
        stream_tokens=48,
        streams=(1, 2, 4, 8),
        schema_tokens=96,
        load=dict(requests=320, clients=16, cache_bytes=256 << 20),
        soak=dict(
            clients=16,
            requests=50,
            answer=12,
            prompts=12,
            cache_bytes=16 << 20,
            deadline=120.0,
            walk_away=1.0,
        ),
    ),
    "quick": dict(
        width=64,
        layers=2,
        history=40,
        new=8,
        answer=4,
        variants=1,
        stream_tokens=4,
        streams=(1, 2),
        schema_tokens=8,
        load=dict(requests=12, clients=4, cache_bytes=16 << 20),
        soak=dict(
            clients=4,
            requests=8,
            answer=4,
            prompts=3,
            cache_bytes=1 << 20,
            deadline=60.0,
            walk_away=0.5,
        ),
    ),
}
VOCAB = 65536  # RWKV World's: the tokenizer the models load with, and the schema's vocabulary
# at least 40 items: an answer of a hundred tokens or more, whatever the model
SCHEMA = {"type": "array", "items": {"enum": ["alpha", "beta", "gamma"]}, "minItems": 40}


def _configs(width: int, layers: int) -> dict[str, ModelConfig]:
    heads = dict(head_size=64) if width % 64 == 0 else dict(head_size=width // 2)
    if width == 768 and layers == 12:
        rwkv7 = preset("rwkv7-0.1b")
    else:
        rwkv7 = ModelConfig(
            vocab_size=VOCAB, hidden_size=width, block_types=["rwkv7"] * layers, **heads
        )
    n_attn = max(1, layers // 4)
    rwkv_x = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        moba_chunk_size=64,
        moba_top_k=3,
        block_types=rwkv_x_block_types(layers - n_attn, n_attn),
        **heads,
    )
    kinds = (
        ["qwen2" if (i + 1) % 4 == 0 else "rwkv7" for i in range(layers)]
        if layers >= 4
        else ["rwkv7", "qwen2"]
    )
    rfa = rfa_config(
        vocab_size=VOCAB,
        hidden_size=width,
        block_types=kinds,
        n_q_heads=max(2, width // 64),
        n_kv_heads=max(1, width // 256),
        intermediate_size=width * 3,
        **heads,
    )
    return {"rwkv7": rwkv7, "rwkv-x": rwkv_x, "rfa": rfa}


# ----- the measurements --------------------------------------------------------------------------


def _second_turns(path: str, cache_dir: str, c: dict, rng, args=(), then=None) -> dict:
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


def _schema_overhead(path: str, c: dict) -> dict:
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


def measure(quick: bool = False) -> dict:
    c = sizes(SERVE, quick)
    rng = np.random.default_rng(0)
    out: dict = {
        "sizes": {k: c[k] for k in ("width", "layers", "history", "new", "answer")},
        "turns": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        from mlx_rwkvx.io.load import save

        paths = {}
        for name, cfg in _configs(c["width"], c["layers"]).items():
            model = Model(cfg, seed=1)
            mx.eval(model.parameters())
            paths[name] = os.path.join(tmp, name)
            save(model, paths[name])
            del model
        load = c["load"]
        for name, path in paths.items():
            extra, then = (), None
            if name == "rwkv7":  # its restarted server goes on with the streams and the load
                extra = (
                    "--cache-bytes",
                    str(load["cache_bytes"]),
                    "--max-queue",
                    str(load["clients"] * 2),
                )

                def then(server, path=path):
                    return {"streams": streams(server, path, c), "load": load_test(server, path, c)}

            turns = _second_turns(path, os.path.join(tmp, name + ".states"), c, rng, extra, then)
            out.update(turns.pop("then", {}))
            out["turns"][name] = turns
        out["schema"] = _schema_overhead(paths["rwkv7"], c)
        out["soak"] = soak(paths["rwkv7"], os.path.join(tmp, "soak.states"), c["soak"])
    return out


def render(r: dict) -> Rendered:
    s = r["sizes"]
    names = {"rwkv7": "RWKV-7", "rwkv-x": "RWKV-X", "rfa": "RFA"}
    worst = max(p["verify"] for p in r["turns"].values())
    lines = [
        f"Verified first: each served first answer's log-probabilities against the generation "
        f"layer's own, {worst:.1e}.",
        "",
        f"Models of width {s['width']} and {s['layers']} blocks (RWKV-7: the 0.1B shape at "
        f"full size; RWKV-X: a quarter MoBA blocks; RFA: every fourth block Qwen2), RWKV "
        f"World's vocabulary, random weights, float32, served over HTTP on localhost. A "
        f"conversation's first turn of {s['history']} words (about a token each), an answer "
        f"of {s['answer']} tokens, then second turns of {s['new']} words: the time to the first "
        "streamed token, against prefilling the tokens the server did not hold (its "
        "`cached_tokens`) on the state after those it held, in this process through the "
        "generation layer (the server's overhead), and against prefilling them on a fresh "
        "state (what they cost alone). Best of the second turns.",
        "",
        "| model | where | prompt | cached | first token | prefill here | ratio | new tokens "
        "alone | ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    goals = []
    for key, phases in r["turns"].items():
        for phase, label in (("server", "one process"), ("restart", "after a restart")):
            runs = phases[phase]
            best = min(x["first"] for x in runs)
            here = min(x["here"] for x in runs)
            alone = min(x["alone"] for x in runs)
            x = runs[0]
            lines.append(
                f"| {names[key]} | {label} | {x['prompt']} | {x['cached']} | "
                f"{best * 1e3:.0f} ms | {here * 1e3:.0f} ms | {best / here:.2f} | "
                f"{alone * 1e3:.0f} ms | {best / alone:.2f} |"
            )
            name = "second turn's first token / its new tokens on the restored state, "
            goals.append(Goal(f"{name}{names[key]}, {label}", best / here, 1.1, False))
            if key == "rwkv7":
                goals.append(
                    Goal(
                        f"second turn's first token / its new tokens alone, RWKV-7, {label}",
                        best / alone,
                        1.1,
                        False,
                    )
                )
    one = r["streams"]["1"]["tokens"] / r["streams"]["1"]["wall"]
    lines += [
        "",
        "Concurrent streams (text completions of the same length, RWKV-7):",
        "",
        "| streams | tokens | wall | aggregate tokens/s | vs one stream |",
        "|---|---|---|---|---|",
    ]
    for n, x in r["streams"].items():
        rate = x["tokens"] / x["wall"]
        lines.append(f"| {n} | {x['tokens']} | {x['wall']:.1f} s | {rate:.1f} | {rate / one:.2f} |")
    top = max(r["streams"], key=int)
    goals.append(
        Goal(
            f"{top} concurrent streams' tokens/s / one stream's",
            r["streams"][top]["tokens"] / r["streams"][top]["wall"] / one,
            4.0,
            True,
        )
    )
    sch = r["schema"]
    lines += [
        "",
        f"Decode holding the answer to a JSON schema (an array of enums, through "
        f"llguidance, RWKV World's 65,536 tokens): {sch['schema']['tps']:.1f} tokens/s "
        f"over {sch['schema']['tokens']} tokens, against {sch['free']['tps']:.1f} without "
        f"({sch['free']['tokens']} tokens).",
    ]
    goals.append(
        Goal(
            "decode tokens/s with a JSON schema / without",
            sch["schema"]["tps"] / sch["free"]["tps"],
            0.7,
            True,
        )
    )
    ld = r["load"]
    growth = (ld["rss_after"] - ld["rss_before"]) / 2**20
    lines += [
        "",
        f"Load test: {ld['requests']} requests from {ld['clients']} clients in "
        f"{ld['wall']:.0f} s (a third streamed, a sixth hanging up after three tokens): "
        f"{ld['5xx']} answered 5xx, {ld['4xx']} 4xx (a full queue), the server "
        f"{'still answering' if ld['alive'] else 'NOT answering'} after; its resident "
        f"memory grew {growth:.0f} MiB (from after a warm-up of a request a client) "
        f"under a state cache of "
        f"{ld['cache_bytes'] / 2**20:.0f} MiB.",
    ]
    goals.append(Goal("load test 5xx answers", ld["5xx"] + (0 if ld["alive"] else 1), 0, False))
    goals.append(
        Goal(
            "load test resident memory growth / --cache-bytes",
            growth * 2**20 / ld["cache_bytes"],
            1.5,
            False,
        )
    )
    if "soak" in r:  # results carried over from a run without the soak have none
        lines += ["", *soak_lines(r["soak"])]
        goals += soak_goals(r["soak"])
    return with_goals(lines, goals)


SECTION = Section(
    measure,
    render,
    "the server: a second turn's first token with its state cache, after a restart, "
    "concurrent streams, JSON schema overhead, a load test",
)
