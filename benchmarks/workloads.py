"""The models and work several sections measure: their configurations, their FLOP and weight
counts, mlx-lm's twin of a model and a decode loop."""

from __future__ import annotations

from pathlib import Path

from mlx_rwkvx.models import Model, ModelConfig, preset, rfa_config, rwkv_x_block_types
from mlx_rwkvx.models.config import default_qwen_layers, rfa_block_types
from mlx_rwkvx.ops.wkv7 import chunk
from mlx_rwkvx.ops.wkv7.chunk import SUB
from mlx_rwkvx.perf import best_time

import mlx.core as mx
import mlx.nn as nn
import numpy as np

WKV7_N = 64  # the head size of the WKV7 benchmarks


def wkv7_inputs(T: int, H: int, N: int = WKV7_N, seed: int = 0) -> list:
    """RWKV-7-like WKV7 inputs, B = 1: decays in (0.5, 0.999), a = -kk, b = kk * iclr."""
    rng = np.random.default_rng(seed)
    shape = (1, T, H, N)
    kk = rng.standard_normal(shape)
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    arrays = [
        rng.uniform(-0.5, 0.5, shape),
        np.log(rng.uniform(0.5, 0.999, shape)),
        rng.uniform(-0.5, 0.5, shape),
        rng.uniform(-0.5, 0.5, shape),
        -kk,
        kk * rng.uniform(0, 1, shape),
        rng.uniform(-0.5, 0.5, (1, H, N, N)),
    ]
    out = [mx.array(x.astype(np.float32)) for x in arrays]
    mx.eval(out)
    return out


def fwd(fn, args):
    """A timed run of a WKV7 implementation's forward."""
    return lambda: mx.eval(fn(*args))


def fwd_bwd(fn, args):
    """A timed run of a WKV7 implementation's forward and the gradients of all seven inputs."""

    def loss(*xs):
        y, s = fn(*xs)
        return y.sum() + s.sum()

    grad = mx.grad(loss, argnums=list(range(7)))
    return lambda: mx.eval(grad(*args))


def model_configs(quick: bool) -> tuple[ModelConfig, ModelConfig]:
    """The prefill/decode model (RWKV-7 0.1B's shape) and a recurrence-dominated small one."""
    if quick:
        return (
            ModelConfig(vocab_size=1024, hidden_size=128, block_types=["rwkv7"] * 2),
            ModelConfig(vocab_size=512, hidden_size=64, block_types=["rwkv7"] * 2),
        )
    return (
        preset("rwkv7-0.1b"),
        ModelConfig(vocab_size=4096, hidden_size=256, block_types=["rwkv7"] * 4),
    )


def rfa_model_config(quick: bool) -> ModelConfig:
    """The 1.5B RFA preset, or a tiny RFA config with the same block kinds."""
    if not quick:
        return preset("rfa-1.5b")
    return rfa_config(
        vocab_size=512,
        hidden_size=128,
        block_types=rfa_block_types(4, default_qwen_layers(4)),
        intermediate_size=256,
        n_q_heads=2,
        n_kv_heads=1,
        attn_head_dim=64,
    )


def rwkv_x_chat_config(quick: bool) -> ModelConfig:
    """The 4-block C=256 RWKV-X model of the second-turn goal (3 RWKV-7 blocks, 1 MoBA)."""
    if quick:
        return ModelConfig(
            vocab_size=512,
            hidden_size=64,
            head_size=16,
            block_types=rwkv_x_block_types(3, 1),
            moba_chunk_size=16,
        )
    return ModelConfig(vocab_size=4096, hidden_size=256, block_types=rwkv_x_block_types(3, 1))


def model_facts(cfg: ModelConfig, T: int, err: float) -> dict:
    return {
        "layers": len(cfg.block_types),
        "hidden": cfg.hidden_size,
        "vocab": cfg.vocab_size,
        "T": T,
        "logits_error": err,
    }


def chunked_flops(T: int, H: int, N: int) -> float:
    """Matmul FLOPs of the chunked WKV7 forward (ops/wkv7/chunk.py), B = 1, from its shapes."""
    L, S = chunk.CHUNK, SUB
    nq = L // S
    per_chunk = (
        2 * (nq + (nq - 1) ** 2) * (2 * S) * N * (2 * S)  # scores: diagonal, off-diagonal
        + 2 * nq * 4 * S**3
        + 2 * 2 * (L // 2) ** 3  # (I - A)^-1
        + 2 * L * L * N
        + 2 * L * L * (2 * N)
        + 2 * L * L * N  # A_ak v, the solve, Qm
        + 2 * L * (2 * L) * N  # Y0
        + 2 * N * L * N
        + 2 * N * (2 * L) * N  # P, U
        + 2 * N**3
        + 2 * L * N * N  # the scan, Y from the states
    )
    return H * -(-T // L) * per_chunk


def linear_params(model) -> int:
    """Parameters of every Linear (the head included, the embedding not): one read per token."""
    total = 0
    for _, m in model.named_modules():
        if isinstance(m, nn.Linear):
            total += m.weight.size + (m.bias.size if "bias" in m else 0)
    return total


def lora_step_flops(cfg: ModelConfig, tokens: int) -> float:
    """A LoRA training step's bound: forward plus input-gradient FLOPs of every projection and
    the head (frozen weights need no weight gradient), plus WKV7's forward and backward (3x
    the chunked forward's matmuls), over ``tokens`` fed."""
    linear = linear_params(Model(cfg, init=None))  # shapes only
    wkv = 3 * chunked_flops(tokens, cfg.n_heads, cfg.head_size) * len(cfg.block_types)
    return 2 * 2 * linear * tokens + wkv


def mlx_lm_twin(model, tmp: str):
    """mlx-lm's own model with the same weights (through our Hugging Face export)."""
    from mlx_rwkvx._mlx_lm import load_model
    from mlx_rwkvx.io.formats import write_hf

    from mlx.utils import tree_flatten

    write_hf(tmp, model.config, dict(tree_flatten(model.parameters())))
    theirs, _ = load_model(Path(tmp))
    return theirs


def decode_rate(model, steps: int = 24) -> float:
    """Tokens per second of one-token steps with the cache, after a short prefill."""
    cache = model.make_cache()
    mx.eval(model(mx.array([[1, 2, 3, 4]]), cache))
    token = mx.array([[5]])

    def run():
        nonlocal token
        for _ in range(steps):
            logits = model(token, cache)
            token = mx.argmax(logits[:, -1:], axis=-1)
            mx.eval(token)

    return steps / best_time(run, repeats=2, warmup=1)
