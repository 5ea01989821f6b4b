"""The models section: prefill and decode of the RWKV-7 0.1B shape against mlx-lm and the
matmul / weight-read bounds; the 1.5B RFA preset in INT8.

``python -m benchmarks.models --worker [--quick]`` builds, saves and loads the RFA model in
INT8 in a fresh process, so that nothing else is in its memory."""

from __future__ import annotations

import argparse
import tempfile

from benchmarks.common import (
    Goal,
    Rendered,
    Section,
    VerificationFailed,
    rel_err,
    run_worker,
    sizes,
    with_goals,
    worker_main,
)
from benchmarks.workloads import (
    decode_rate,
    linear_params,
    mlx_lm_twin,
    model_configs,
    model_facts,
    rfa_model_config,
)
from mlx_rwkvx.models.build import build
from mlx_rwkvx.perf import best_time, matmul_gflops, read_bandwidth_gbs

import mlx.core as mx
import numpy as np

MODELS = {
    "full": dict(prefill_T=1024, small_T=4096, matmul_n=2048, stream_bytes=1 << 30),
    "quick": dict(prefill_T=64, small_T=256, matmul_n=256, stream_bytes=1 << 26),
}
# The 1.5B RFA INT8 model is to fit in 2.3 GB while it is built and loaded.
RFA_INT8_PEAK_GOAL_GB = 2.3


def _verified_twin(ours, tmp: str, T: int, seed: int):
    """mlx-lm's twin of ``ours``, the tokens of a T-long prefill and the logits' relative error."""
    theirs = mlx_lm_twin(ours, tmp)
    tokens = mx.array(np.random.default_rng(seed).integers(0, ours.config.vocab_size, (1, T)))
    err = rel_err(ours(tokens), theirs(tokens))
    if not err <= 1e-4:
        raise VerificationFailed(f"logits vs mlx-lm {err:.1e}")
    return theirs, tokens, err


def measure(quick: bool = False) -> dict:
    """Prefill and decode against mlx-lm and the physical bounds; the RFA preset in INT8."""
    cfg_sizes = sizes(MODELS, quick)
    cfg, small_cfg = model_configs(quick)
    with tempfile.TemporaryDirectory() as tmp:
        # random weights (Foundry's init), ours and mlx-lm's, both checked before any timing
        ours = build(cfg)
        theirs, tokens, err = _verified_twin(ours, tmp + "/hf", cfg_sizes["prefill_T"], seed=0)
        ours_s = build(small_cfg)
        theirs_s, tokens_s, err_s = _verified_twin(
            ours_s, tmp + "/hf_small", cfg_sizes["small_T"], 1
        )
        rate = matmul_gflops(cfg_sizes["matmul_n"])
        bandwidth = read_bandwidth_gbs(cfg_sizes["stream_bytes"])
        t_ours = best_time(lambda: mx.eval(ours(tokens)), repeats=3)
        t_lm = best_time(lambda: mx.eval(theirs(tokens)), repeats=2)
        decode = {"fp32": decode_rate(ours), "mlx-lm fp32": decode_rate(theirs)}
        bf16 = build(cfg)
        bf16.set_dtype(mx.bfloat16)
        decode["bf16"] = decode_rate(bf16)
        del bf16
        decode["int8"] = decode_rate(build(cfg, quantize="int8"))
        t_s = best_time(lambda: mx.eval(ours_s(tokens_s)), repeats=3)
        t_s_lm = best_time(lambda: mx.eval(theirs_s(tokens_s)), repeats=1)
        n_lin = linear_params(ours)
    rfa = run_worker("models", quick=quick)
    rfa["name"], rfa["label"] = (
        ("tiny RFA config", "tiny RFA") if quick else ("1.5B RFA preset", "1.5B")
    )
    return {
        "matmul_n": cfg_sizes["matmul_n"],
        "matmul_gflops": rate,
        "bandwidth_gbs": bandwidth,
        "model": {**model_facts(cfg, cfg_sizes["prefill_T"], err), "linear_params": n_lin},
        "prefill_s": {"mlx_rwkvx": t_ours, "mlx-lm": t_lm},
        "decode_tok_s": decode,
        "small": {
            **model_facts(small_cfg, cfg_sizes["small_T"], err_s),
            "prefill_s": {"mlx_rwkvx": t_s, "mlx-lm": t_s_lm},
        },
        "rfa": rfa,
        "rfa_peak_goal_gb": RFA_INT8_PEAK_GOAL_GB,
    }


def render(r: dict) -> Rendered:
    """Prefill and decode against their bounds and mlx-lm, RFA in INT8, the goals."""
    n, rate, bandwidth = r["matmul_n"], r["matmul_gflops"], r["bandwidth_gbs"]
    m, small, rfa = r["model"], r["small"], r["rfa"]
    t_ours, t_lm = r["prefill_s"]["mlx_rwkvx"], r["prefill_s"]["mlx-lm"]
    T, n_lin = m["T"], m["linear_params"]
    bound = 2 * T * n_lin / (rate * 1e9)
    lines = [
        f"Limits measured in this run: fp32 matmul {rate:.0f} GFLOP/s ({n}^3), memory read "
        f"{bandwidth:.1f} GB/s.",
        "",
        f"Verified first: logits of the {m['layers']}-layer C={m['hidden']} vocab-{m['vocab']} "
        f"model vs mlx-lm's, T={T}: relative error {m['logits_error']:.1e}.",
        "",
        f"| prefill T={T}, {m['layers']} x C={m['hidden']}, vocab {m['vocab']} (all logits) "
        "| time | vs matmul bound |",
        "|---|---|---|",
        f"| matmul bound: 2 T x {n_lin / 1e6:.0f}M Linear+head params / {rate:.0f} GFLOP/s "
        f"| {bound:.2f} s | 1.00 |",
        f"| mlx_rwkvx | {t_ours:.2f} s | {t_ours / bound:.2f} |",
        f"| mlx-lm | {t_lm:.2f} s | {t_lm / bound:.2f} |",
        "",
        f"mlx_rwkvx is {t_lm / t_ours:.1f}x faster than mlx-lm here.",
        "",
    ]
    weight_bytes = n_lin * 4
    decode_bound = bandwidth * 1e9 / weight_bytes
    lines += [
        f"Decode (one token, cache) of the same model; weight-read bound "
        f"{weight_bytes / 1e6:.0f} MB fp32 / {bandwidth:.1f} GB/s = {decode_bound:.1f} tok/s.",
        "",
        "| decode | tok/s | of the fp32 bound |",
        "|---|---|---|",
    ]
    for name, rate_tok in r["decode_tok_s"].items():
        lines.append(f"| {name} | {rate_tok:.1f} | {rate_tok / decode_bound:.0%} |")
    t_s, t_s_lm = small["prefill_s"]["mlx_rwkvx"], small["prefill_s"]["mlx-lm"]
    goal_gb = r["rfa_peak_goal_gb"]
    lines += [
        "",
        f"Prefill T={small['T']} of a {small['layers']}-layer C={small['hidden']} "
        f"vocab-{small['vocab']} model (logits vs mlx-lm {small['logits_error']:.1e}): "
        f"mlx_rwkvx {t_s:.2f} s, mlx-lm {t_s_lm:.2f} s: {t_s_lm / t_s:.1f}x faster.",
        "",
        f"The {rfa['name']} (random weights) in INT8:",
        "",
        f"- {rfa['n_params'] / 1e9:.2f}B parameters (projections, head and embedding in INT8 "
        "with group-64 scales and biases; norms and low-rank matrices float32)",
        f"- build: peak {rfa['peak_build'] / 1e9:.2f} GB, at rest {rfa['at_rest'] / 1e9:.2f} GB "
        f"(goal <= {goal_gb:g} GB)",
        f"- load of the saved INT8 checkpoint: peak {rfa['peak_load'] / 1e9:.2f} GB, at rest "
        f"{rfa['rest_load'] / 1e9:.2f} GB",
        f"- decode {rfa['decode']:.2f} tok/s (MLX's CPU quantized matmul; see the INT8 row above)",
    ]
    goals = [
        Goal(f"prefill T={T} / matmul bound", t_ours / bound, 1.3, False),
        Goal(f"prefill T={small['T']} small model vs mlx-lm", t_s_lm / t_s, 10.0, True),
        Goal(
            "fp32 decode / weight-read bound", r["decode_tok_s"]["fp32"] / decode_bound, 0.85, True
        ),
        Goal(
            f"{rfa['label']} INT8 peak while building, GB", rfa["peak_build"] / 1e9, goal_gb, False
        ),
        Goal(f"{rfa['label']} INT8 peak while loading, GB", rfa["peak_load"] / 1e9, goal_gb, False),
    ]
    return with_goals(lines, goals)


SECTION = Section(measure, render, "prefill and decode vs mlx-lm and the physical bounds")


def rfa_int8_worker(quick: bool = False) -> dict:
    """Build the RFA model in INT8, save it, load it back: memory and decode rate."""
    from mlx_rwkvx.io.load import load_model, save
    from mlx_rwkvx.models import Model

    from mlx.utils import tree_flatten

    cfg = rfa_model_config(quick)
    mx.reset_peak_memory()
    big = build(cfg, quantize="int8")
    result = {"peak_build": mx.get_peak_memory(), "at_rest": mx.get_active_memory()}
    lazy = Model(cfg, init=None)  # shapes only: nothing is computed
    result["n_params"] = sum(v.size for _, v in tree_flatten(lazy.parameters()))
    result["decode"] = decode_rate(big, steps=8)
    with tempfile.TemporaryDirectory() as tmp:
        save(big, tmp + "/rfa8")
        del big
        mx.clear_cache()
        mx.reset_peak_memory()
        loaded = load_model(tmp + "/rfa8")
        result["peak_load"], result["rest_load"] = mx.get_peak_memory(), mx.get_active_memory()
        del loaded
    return result


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=rfa_int8_worker.__doc__)
    worker_main(parser, lambda args: rfa_int8_worker(args.quick), argv)


if __name__ == "__main__":
    main()
