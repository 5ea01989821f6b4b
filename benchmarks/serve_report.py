"""The serve section's report: the second turns' table, the concurrent streams, the JSON
schema's cost, the load test and the soak, each with its goals, from the measured data alone."""

from __future__ import annotations

from benchmarks.common import Goal, Rendered, with_goals
from benchmarks.serve_soak import BAD, KINDS, TIE


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


def soak_lines(s: dict) -> list[str]:
    grew = (s["after"]["rss"] - s["before"]["rss"]) / 2**20
    idle = "never" if s["idle_after"] is None else f"{s['idle_after']:.1f} s after the last"
    return [
        f"Soak: {s['clients']} clients x {s['requests']} requests in {s['wall']:.0f} s, each "
        f"client cycling through {', '.join(KINDS)} (walk-away: the longest answer allowed, "
        f"the client gone before it ends; bad: {len(BAD)} kinds of malformed or over-limit "
        f"requests), a {s['cache_bytes'] / 2**20:.0f} MiB state cache kept on disk. "
        f"{s['good']} good requests: {s['5xx']} 5xx, {s['late']} past their "
        f"{s['deadline']:.0f} s deadline, {s['wrong']} unlike their answer alone"
        f"{_which(s)}, {s.get('tie', 0)} parting from it at a near-tie of the answer alone "
        f"(two tokens within {TIE:g} in log-probability: float32 rounding's choice, which "
        f"differs in a batch); {s['bad']} bad ones: {s['not_4xx']} not a 4xx. Nothing "
        f"decoding: {idle}. From the first half of the requests to the end: resident memory "
        f"{s['before']['rss'] / 2**20:.0f} -> {s['after']['rss'] / 2**20:.0f} "
        f"MiB ({grew:+.0f}), open descriptors {s['before']['fds']} -> {s['after']['fds']}, "
        f"state folder {s['before']['folder'] / 2**20:.1f} -> "
        f"{s['after']['folder'] / 2**20:.1f} MiB; the server "
        f"{'answering' if s['alive'] else 'NOT answering'} after."
    ]


def _which(s: dict) -> str:
    kinds = s.get("wrong_kinds") or []
    return f" ({', '.join(f'{k} of prompt {p}' for k, p in kinds)})" if kinds else ""


def soak_goals(s: dict) -> list[Goal]:
    idle = 0 if s["idle_after"] is not None and s["alive"] else 1
    return [
        Goal(
            "soak: 5xx answers, late or wrong good answers, bad requests not a 4xx, "
            "answers still running or a server not answering at the end",
            s["5xx"] + s["late"] + s["wrong"] + s["not_4xx"] + idle,
            0,
            False,
        ),
        Goal("soak: open descriptors grown", s["after"]["fds"] - s["before"]["fds"], 4, False),
        Goal(
            "soak: resident memory growth over the second half / --cache-bytes",
            (s["after"]["rss"] - s["before"]["rss"]) / s["cache_bytes"],
            1.5,
            False,
        ),
        Goal(
            "soak: state folder on disk / --cache-bytes",
            s["after"]["folder"] / s["cache_bytes"],
            1.0,
            False,
        ),
    ]
