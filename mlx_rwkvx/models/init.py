"""Seeded initialisations. ``seeds`` (the default, what tests use): the C engine's small,
non-degenerate init, no zero matrix anywhere, so no gradient test is vacuous. ``pretrain``:
RWKV-7's published pretraining init (BlinkDL's RWKV-LM x070), for ``pretrain`` runs.
"""

from __future__ import annotations

import math
import zlib

from mlx_rwkvx.models.rwkv7 import ChannelMix, HeadNorm, TimeMix

import mlx.core as mx
import mlx.nn as nn

INIT_SCHEMES = ("seeds", "pretrain")


# Large matrices are drawn, read and quantized this many bytes (of float32) of rows at a time.
ROW_BLOCK_BYTES = 64 << 20


def _key(seed: int, name: str) -> mx.array:
    # one key per parameter name: the values do not depend on the order of traversal
    return mx.random.key((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)


def uniform_row_blocks(seed: int, name: str, shape, scale: float, offset: float = 0.0):
    """The seeded ``offset + scale * U(-0.5, 0.5)`` of one parameter as blocks of rows (all of
    it for small ones): a big embedding can be quantized block by block, never whole in float."""
    rows = max(1, ROW_BLOCK_BYTES // (4 * shape[-1]))
    if len(shape) != 2 or shape[0] <= rows:
        return [offset + scale * (mx.random.uniform(shape=shape, key=_key(seed, name)) - 0.5)]
    keys = mx.random.split(_key(seed, name), -(-shape[0] // rows))
    return [
        offset + scale * (mx.random.uniform(shape=(min(rows, shape[0] - s), shape[1]), key=k) - 0.5)
        for s, k in zip(range(0, shape[0], rows), keys, strict=True)
    ]


def _uniform(seed: int, name: str, shape, scale: float, offset: float = 0.0) -> mx.array:
    blocks = uniform_row_blocks(seed, name, shape, scale, offset)
    return blocks[0] if len(blocks) == 1 else mx.concatenate(blocks, axis=0)


def seeds_scale(module: nn.Module, name: str) -> tuple[float, float]:
    """(scale, offset) of ``offset + scale * uniform(-0.5, 0.5)`` for one parameter."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
        return (0.2, 1.0) if name == "weight" else (0.2, 0.0)
    if isinstance(module, nn.Embedding):
        return 0.5, 0.0
    if isinstance(module, nn.Linear) and name == "weight":
        return 0.3, 0.0
    # biases (w0, a0, v0, Qwen2's q/k/v), token-shift lerps, k_k, k_a, r_k, state0
    return 0.5, 0.0


def init_seeded(model: nn.Module, seed: int = 0) -> nn.Module:
    """The seeds' init, in place: projections U(-.5,.5)*0.3, lerps/biases/k_k/k_a/r_k *0.5,
    norm gains 1 + 0.2 U, norm biases 0.2 U, embedding *0.5, head *0.3. Returns the model."""
    for path, module in model.named_modules():
        for name, value in list(module.items()):
            if isinstance(value, mx.array):
                full = f"{path}.{name}" if path else name
                scale, offset = seeds_scale(module, name)
                module[name] = _uniform(seed, full, value.shape, scale, offset).astype(value.dtype)
    return model


def _orthogonal(seed: int, name: str, shape, gain: float) -> mx.array:
    """A (semi-)orthogonal matrix times ``gain``, seeded by name (QR of a Gaussian)."""
    rows, cols = shape
    a = mx.random.normal((max(rows, cols), min(rows, cols)), key=_key(seed, name))
    q, r = mx.linalg.qr(a, stream=mx.cpu)
    q = q * mx.sign(mx.diagonal(r))  # a unique, uniformly distributed Q
    return gain * (q if rows >= cols else q.T)


def init_pretrain(model: nn.Module, seed: int = 0) -> nn.Module:
    """RWKV-7's published pretraining init (BlinkDL's RWKV-LM x070), in place.

    Per RWKV block i of n (r01 = i / (n - 1), r10 = 1 - i / n, p = channel / C): lerps
    ``1 - p^(s r10)``; decay bias ``w0 = -6 + 6 q^(1 + r01^0.3) + 0.5 + 2.5 zigzag``; ``a0``,
    ``v0``, ``k_k``, ``k_a = 1.02``, ``r_k = -0.04``; low-rank ``down`` zero and ``up`` orthogonal
    x0.1; receptance/value U(+-0.5/sqrt C), key U(+-0.05/sqrt C), output and channel-mix value
    zero; embedding U(+-1e-4); head orthogonal x0.5 sqrt(vocab / C). Norms start at 1 and 0.
    Attention blocks: projections U(+-0.5/sqrt C), their output projections zero.
    """
    cfg = model.config
    C, N = cfg.hidden_size, cfg.head_size
    init_seeded(model, seed)
    for path, module in model.named_modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
            module["weight"] = mx.ones_like(module.weight)
            if "bias" in module:
                module["bias"] = mx.zeros_like(module.bias)
        elif isinstance(module, nn.Linear):
            bound = 0.5 / math.sqrt(module.weight.shape[1])
            module["weight"] = _uniform(seed, path, module.weight.shape, 2 * bound)
            if "bias" in module:
                module["bias"] = mx.zeros_like(module.bias)
            if path.endswith(("o_proj", "down_proj")) or path.endswith("ffn.value"):
                module["weight"] = mx.zeros_like(module.weight)
    model.embed.weight = _uniform(seed, "embed", model.embed.weight.shape, 2e-4)
    c = mx.arange(C, dtype=mx.float32)
    p = c / C
    linear = c / (C - 1) - 0.5
    zigzag = ((c % N) - (N - 1) / 2) / ((N - 1) / 2)
    zigzag = zigzag * mx.abs(zigzag)
    rwkv = [m for m in model.layers if m.kind == "rwkv7"]
    n = len(rwkv)
    for i, block in enumerate(rwkv):
        tm: TimeMix = block.tmix
        r01, r10 = i / max(n - 1, 1), 1.0 - i / n
        for name, s in (("x_r", 0.2), ("x_w", 0.9), ("x_k", 0.7), ("x_v", 0.7), ("x_a", 0.9)):
            tm[name] = 1.0 - mx.power(p, s * r10)
        if "x_g" in tm:
            tm["x_g"] = 1.0 - mx.power(p, 0.2 * r10)
        decay = -6 + 6 * mx.power(c / (C - 1), 1 + r01**0.3)
        tm.decay.up.bias = decay + 0.5 + 2.5 * zigzag
        tm.iclr.up.bias = -0.19 + 0.3 * zigzag + 0.4 * linear
        lows = [("decay", tm.decay), ("iclr", tm.iclr)]
        if "value_mix" in tm:
            tm.value_mix.up.bias = 0.73 - 0.4 * linear
            lows.append(("value_mix", tm.value_mix))
        if "gate" in tm:
            lows.append(("gate", tm.gate))
        for name, low in lows:
            low.down.weight = mx.zeros_like(low.down.weight)
            shape = low.up.weight.shape
            low.up.weight = _orthogonal(seed, f"{i}.{name}", shape, 0.1)
        tm.k_k = 0.71 - 0.1 * linear
        tm.k_a = mx.full((C,), 1.02)
        tm.r_k = mx.full(tm.r_k.shape, -0.04)
        tm.key.weight = _uniform(seed, f"{i}.key", tm.key.weight.shape, 0.1 / math.sqrt(C))
        tm.output.weight = mx.zeros_like(tm.output.weight)
        if isinstance(block.ffn, ChannelMix):
            block.ffn.x_k = 1.0 - mx.power(p, r10**4)
            block.ffn.value.weight = mx.zeros_like(block.ffn.value.weight)
    if "lm_head" in model:
        V = cfg.vocab_size
        gain = 0.5 * math.sqrt(V / C) if V > C else 0.5
        model.lm_head.weight = _orthogonal(seed, "lm_head", model.lm_head.weight.shape, gain)
    return model


def initialise(model: nn.Module, scheme: str = "seeds", seed: int = 0) -> nn.Module:
    """Initialise ``model`` in place by ``scheme`` (``seeds`` or ``pretrain``)."""
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"init scheme must be one of {INIT_SCHEMES}, got {scheme!r}")
    return (init_seeded if scheme == "seeds" else init_pretrain)(model, seed)
