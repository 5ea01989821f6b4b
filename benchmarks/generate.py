"""The generate section: time to first token, decode and the second chat turn against mlx-lm
and the bounds (the timing itself: ``generation_timing``)."""

from __future__ import annotations

import tempfile

from benchmarks.common import Goal, Rendered, Section, sizes, with_goals
from benchmarks.generation_timing import (
    AnyIdTokenizer,
    decode_tps,
    first_token_time,
    generate_step_ttft,
    matvec_tps,
    second_turn,
    verify_generation,
)
from benchmarks.workloads import (
    chunked_flops,
    linear_params,
    mlx_lm_twin,
    model_configs,
    model_facts,
    rwkv_x_chat_config,
)
from mlx_rwkvx.generation import Session
from mlx_rwkvx.models.build import build
from mlx_rwkvx.perf import matmul_gflops, read_bandwidth_gbs

import mlx.core as mx
import numpy as np

GENERATE = {
    "full": dict(
        prompt_T=2000,
        first_turn=1500,
        new_turn=100,
        decode_steps=48,
        matmul_n=2048,
        stream_bytes=1 << 30,
    ),
    "quick": dict(
        prompt_T=64, first_turn=48, new_turn=8, decode_steps=8, matmul_n=256, stream_bytes=1 << 26
    ),
}


def _compiled_step_session(model) -> Session:
    """A Session whose one-token step runs under mx.compile."""
    return Session(model, compile_step=True)


def measure(quick: bool = False) -> dict:
    """Time to first token, decode and the second chat turn, against mlx-lm and the bounds."""
    cfg_sizes = sizes(GENERATE, quick)
    cfg, _ = model_configs(quick)
    T = cfg_sizes["prompt_T"]
    ids = np.random.default_rng(0).integers(1, cfg.vocab_size, T).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        ours = build(cfg)
        theirs = mlx_lm_twin(ours, tmp + "/hf")
        err = verify_generation(ours, theirs, ids[:64])
        rate = matmul_gflops(cfg_sizes["matmul_n"])
        bandwidth = read_bandwidth_gbs(cfg_sizes["stream_bytes"])
        ttft = {
            "mlx_rwkvx": first_token_time(lambda: Session(ours), ids, repeats=2),
            "generate_step, our model": generate_step_ttft(ours, ids, repeats=2),
            "mlx-lm": generate_step_ttft(theirs, ids, repeats=2),
        }
        del theirs
        turn = ids[: cfg_sizes["new_turn"]]  # a chat turn's size: where the one-token step shows
        short_ttft = {
            "tokens": len(turn),
            "mlx_rwkvx": first_token_time(lambda: Session(ours), turn, repeats=5),
            "generate_step, our model": generate_step_ttft(ours, turn, repeats=5),
        }
        steps = cfg_sizes["decode_steps"]
        decode = {"fp32": decode_tps(ours, steps)}
        # the same loop with the one-token step under mx.compile
        decode["fp32, step compiled"] = decode_tps(
            ours, steps, lambda: _compiled_step_session(ours)
        )
        matvec = matvec_tps(ours, steps)
        lin = linear_params(ours)
        head = ours.lm_head.weight.size
        bf16 = build(cfg)
        bf16.set_dtype(mx.bfloat16)
        decode["bf16"] = decode_tps(bf16, steps)
        del bf16
        decode["int8"] = decode_tps(build(cfg, quantize="int8"), steps)
        turns = cfg_sizes["first_turn"], cfg_sizes["new_turn"], 2
        chat = {"rwkv7": second_turn(ours, AnyIdTokenizer(cfg.vocab_size), *turns)}
        x_cfg = rwkv_x_chat_config(quick)
        x_model = build(x_cfg)
        chat["rwkv-x"] = second_turn(x_model, AnyIdTokenizer(x_cfg.vocab_size), *turns)
    wkv = chunked_flops(T, cfg.n_heads, cfg.head_size) * len(cfg.block_types)
    return {
        "matmul_n": cfg_sizes["matmul_n"],
        "matmul_gflops": rate,
        "bandwidth_gbs": bandwidth,
        "model": model_facts(cfg, T, err),
        "linear_params": lin,
        "head_params": head,
        "wkv_flops": wkv,
        "ttft_s": ttft,
        "short_ttft_s": short_ttft,
        "decode_tok_s": decode,
        "matvec_tok_s": matvec,
        "chat": chat,
        "x_model": {
            "layers": len(x_cfg.block_types),
            "hidden": x_cfg.hidden_size,
            "block_types": x_cfg.block_types,
        },
    }


def render(r: dict) -> Rendered:
    """First token, decode, second chat turn, each against its bound; the goals."""
    rate, bw, m = r["matmul_gflops"], r["bandwidth_gbs"], r["model"]
    T, lin, head = m["T"], r["linear_params"], r["head_params"]
    flops = 2 * T * (lin - head) + 2 * head + r["wkv_flops"]
    bound = flops / (rate * 1e9)
    ours, theirs = r["ttft_s"]["mlx_rwkvx"], r["ttft_s"]["mlx-lm"]
    lines = [
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s ({r['matmul_n']}^3), "
        f"memory read {bw:.1f} GB/s.",
        "",
        f"Verified first: each generated step's log-probabilities against the full forward "
        f"over the same tokens, and the first token's against mlx-lm's generate_step on the "
        f"same weights (its rwkv7 through our Hugging Face export): largest relative error "
        f"{m['logits_error']:.1e}.",
        "",
        f"Time to first token, a {T}-token prompt, {m['layers']} x C={m['hidden']}, vocab "
        f"{m['vocab']} (random weights, fp32). Bound: the layers' matmul FLOPs for every "
        f"position, the head for the last one, and the chunked WKV7's matmuls, "
        f"{flops / 1e9:.1f} GFLOP at {rate:.0f} GFLOP/s.",
        "",
        "| first token | time | vs bound |",
        "|---|---|---|",
        f"| bound | {bound:.2f} s | 1.00 |",
        f"| mlx_rwkvx (head on the last position) | {ours:.2f} s | {ours / bound:.2f} |",
    ]
    step = r["ttft_s"].get("generate_step, our model")  # absent from runs before it was measured
    if step is not None:
        lines.append(
            f"| mlx-lm generate_step, our model (the last token a step of its own) "
            f"| {step:.2f} s | {step / bound:.2f} |"
        )
    lines += [
        f"| mlx-lm generate_step, its rwkv7 (its WKV a step loop on the CPU) | {theirs:.2f} s "
        f"| {theirs / bound:.2f} |",
        "",
        f"mlx_rwkvx reaches the first token {theirs / ours:.1f}x sooner than mlx-lm on its own "
        "model.",
        "",
    ]
    short = r.get("short_ttft_s")
    if short is not None and step is not None:
        rows = [
            (T, ours, step),
            (short["tokens"], short["mlx_rwkvx"], short["generate_step, our model"]),
        ]
        lines += [
            "Our prefill against mlx-lm's generate_step on the same model (why generation keeps "
            "its own prefill, and decodes with generate_step):",
            "",
            "| prompt | mlx_rwkvx prefill | generate_step's prefill | generate_step / ours |",
            "|---|---|---|---|",
        ]
        for n, a, b in rows:
            lines.append(f"| {n} tokens | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | {b / a:.2f} |")
        lines.append("")
    weight_bytes = lin * 4
    read_bound = bw * 1e9 / weight_bytes
    mv = r["matvec_tok_s"]
    base = mv["x @ W.T"]
    lines += [
        f"Decode of the same model (greedy, our generation: mlx-lm's generate_step over our "
        f"state): tokens/s against MLX's own "
        f"one-row matmuls over the same {lin / 1e6:.0f}M weights "
        f"({weight_bytes / 1e6:.0f} MB fp32, one read per token: {read_bound:.1f} tok/s at "
        f"{bw:.1f} GB/s).",
        "",
        "| decode | tok/s | vs MLX's one-row matmuls | of the read bound |",
        "|---|---|---|---|",
    ]
    for name, tps in r["decode_tok_s"].items():
        lines.append(f"| {name} | {tps:.1f} | {tps / base:.0%} | {tps / read_bound:.0%} |")
    lines += [
        "",
        "What MLX's one-row matmul reaches over those weights, three ways:",
        "",
        "| one-row matmuls of every Linear | tok/s | GB/s streamed | of the read bound |",
        "|---|---|---|---|",
    ]
    for name, tps in mv.items():
        lines.append(
            f"| {name} | {tps:.1f} | {tps * weight_bytes / 1e9:.1f} | {tps / read_bound:.0%} |"
        )
    lines += [
        "",
        "Second chat turn: time to its first token against prefilling its new tokens "
        "alone in a fresh session (the history is not re-read: RWKV blocks carry their "
        "state, attention blocks attend to their caches).",
        "",
        "| model | first turn | new tokens | second turn | new tokens alone | ratio |",
        "|---|---|---|---|---|---|",
    ]
    xm = r["x_model"]
    names = {
        "rwkv7": f"RWKV-7 {m['layers']} x C={m['hidden']}",
        "rwkv-x": f"RWKV-X {xm['layers']} blocks C={xm['hidden']}",
    }
    goals = [
        Goal(f"time to first token T={T} / bound", ours / bound, 1.3, False),
        Goal("fp32 decode / MLX one-row matmuls", r["decode_tok_s"]["fp32"] / base, 0.9, True),
    ]
    for key, c in r["chat"].items():
        ratio = c["second_turn_s"] / c["alone_s"]
        lines.append(
            f"| {names[key]} | {c['held_tokens']} tokens held | {c['new_tokens']} "
            f"| {c['second_turn_s'] * 1e3:.0f} ms | {c['alone_s'] * 1e3:.0f} ms | {ratio:.2f} |"
        )
        goals.append(Goal(f"second turn / new turn alone, {names[key]}", ratio, 1.1, False))
    return with_goals(lines + [""], goals)


SECTION = Section(
    measure,
    render,
    "time to first token, decode and the second chat turn vs mlx-lm and the bounds",
)
