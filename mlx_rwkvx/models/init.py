"""Seeded initialisations. ``foundry`` (the default, what tests use): Foundry's C engine's
small, non-degenerate init, no zero matrix anywhere, so no gradient test is vacuous (``seeds``
is its older name). ``pretrain``: RWKV-7's published pretraining init (BlinkDL's RWKV-LM
x070), for ``pretrain`` runs.
"""

from __future__ import annotations

import math
import zlib

from mlx_rwkvx.models.rwkv7 import ChannelMix, HeadNorm, TimeMix

import mlx.core as mx
import mlx.nn as nn

INIT_SCHEMES = ("foundry", "pretrain")
INIT_ALIASES = {"seeds": "foundry"}  # the name the README documented first


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


def foundry_scale(module: nn.Module, name: str) -> tuple[float, float]:
    """(scale, offset) of ``offset + scale * uniform(-0.5, 0.5)`` for one parameter."""
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
        return (0.2, 1.0) if name == "weight" else (0.2, 0.0)
    if isinstance(module, nn.Embedding):
        return 0.5, 0.0
    if isinstance(module, nn.Linear) and name == "weight":
        return 0.3, 0.0
    # biases (w0, a0, v0, Qwen2's q/k/v), token-shift lerps, k_k, k_a, r_k, state0
    return 0.5, 0.0


def init_foundry(model: nn.Module, seed: int = 0) -> nn.Module:
    """Foundry's init, in place: projections U(-.5,.5)*0.3, lerps/biases/k_k/k_a/r_k *0.5,
    norm gains 1 + 0.2 U, norm biases 0.2 U, embedding *0.5, head *0.3. Returns the model."""
    for path, module in model.named_modules():
        for name, value in list(module.items()):
            if isinstance(value, mx.array):
                full = f"{path}.{name}" if path else name
                scale, offset = foundry_scale(module, name)
                module[name] = _uniform(seed, full, value.shape, scale, offset).astype(value.dtype)
    return model


def _orthogonal(seed: int, name: str, shape, gain: float) -> mx.array:
    """A (semi-)orthogonal matrix times ``gain``, seeded by name (QR of a Gaussian)."""
    rows, cols = shape
    a = mx.random.normal((max(rows, cols), min(rows, cols)), key=_key(seed, name))
    q, r = mx.linalg.qr(a, stream=mx.cpu)
    q = q * mx.sign(mx.diagonal(r))  # a unique, uniformly distributed Q
    return gain * (q if rows >= cols else q.T)


# RWKV-7's published pretraining init (BlinkDL's RWKV-LM, x070), by name
LERP_EXPONENTS = {"x_r": 0.2, "x_w": 0.9, "x_k": 0.7, "x_v": 0.7, "x_a": 0.9, "x_g": 0.2}
DECAY_FLOOR = -6.0  # w0 runs from here up to DECAY_FLOOR + DECAY_SPAN across channels
DECAY_SPAN = 6.0
DECAY_OFFSET, DECAY_ZIGZAG = 0.5, 2.5  # added to w0, and the zigzag over each head's channels
ICLR_BIAS, ICLR_ZIGZAG, ICLR_LINEAR = -0.19, 0.3, 0.4  # a0
VALUE_MIX_BIAS, VALUE_MIX_LINEAR = 0.73, -0.4  # v0
K_K_BIAS, K_K_LINEAR = 0.71, -0.1
K_A = 1.02
R_K = -0.04
LOW_RANK_UP_GAIN = 0.1  # the low-rank ``up`` matrices: orthogonal times this; ``down``: zero
PROJECTION_BOUND = 0.5  # projections U(+-PROJECTION_BOUND / sqrt(fan in))
KEY_BOUND = 0.05  # the time-mix key: U(+-KEY_BOUND / sqrt(C))
EMBED_BOUND = 1e-4
HEAD_GAIN = 0.5  # orthogonal times HEAD_GAIN * sqrt(vocab / C) (or HEAD_GAIN if vocab <= C)
# residual branches end in zero projections: every block starts as the identity
ZERO_OUTPUTS = ("o_proj", "down_proj", "ffn.value")


def _channels(C: int, N: int) -> dict[str, mx.array]:
    """Per-channel ramps of the init: position p = c / C, a centred linear ramp, and a zigzag
    over each head's channels (squared, sign kept)."""
    c = mx.arange(C, dtype=mx.float32)
    zigzag = ((c % N) - (N - 1) / 2) / ((N - 1) / 2)
    return {
        "c": c,
        "p": c / C,
        "linear": c / (C - 1) - 0.5,
        "zigzag": zigzag * mx.abs(zigzag),
    }


def _pretrain_generic(model: nn.Module, seed: int) -> None:
    """Norms at 1 and 0; projections U(+-0.5/sqrt(fan in)), biases zero; the projections that
    end a residual branch zero."""
    for path, module in model.named_modules():
        if isinstance(module, (nn.LayerNorm, nn.RMSNorm, HeadNorm)):
            module["weight"] = mx.ones_like(module.weight)
            if "bias" in module:
                module["bias"] = mx.zeros_like(module.bias)
        elif isinstance(module, nn.Linear):
            bound = PROJECTION_BOUND / math.sqrt(module.weight.shape[1])
            module["weight"] = _uniform(seed, path, module.weight.shape, 2 * bound)
            if "bias" in module:
                module["bias"] = mx.zeros_like(module.bias)
            if path.endswith(ZERO_OUTPUTS):
                module["weight"] = mx.zeros_like(module.weight)


def _pretrain_time_mix(tm: TimeMix, i: int, n: int, ch: dict, seed: int) -> None:
    """The time-mix of RWKV block ``i`` of ``n``."""
    C = ch["c"].shape[0]
    r01, r10 = i / max(n - 1, 1), 1.0 - i / n
    for name, exponent in LERP_EXPONENTS.items():
        if name in tm:
            tm[name] = 1.0 - mx.power(ch["p"], exponent * r10)
    decay = DECAY_FLOOR + DECAY_SPAN * mx.power(ch["c"] / (C - 1), 1 + r01**0.3)
    tm.decay.up.bias = decay + DECAY_OFFSET + DECAY_ZIGZAG * ch["zigzag"]
    tm.iclr.up.bias = ICLR_BIAS + ICLR_ZIGZAG * ch["zigzag"] + ICLR_LINEAR * ch["linear"]
    lows = [("decay", tm.decay), ("iclr", tm.iclr)]
    if "value_mix" in tm:
        tm.value_mix.up.bias = VALUE_MIX_BIAS + VALUE_MIX_LINEAR * ch["linear"]
        lows.append(("value_mix", tm.value_mix))
    if "gate" in tm:
        lows.append(("gate", tm.gate))
    for name, low in lows:
        low.down.weight = mx.zeros_like(low.down.weight)
        low.up.weight = _orthogonal(seed, f"{i}.{name}", low.up.weight.shape, LOW_RANK_UP_GAIN)
    tm.k_k = K_K_BIAS + K_K_LINEAR * ch["linear"]
    tm.k_a = mx.full((C,), K_A)
    tm.r_k = mx.full(tm.r_k.shape, R_K)
    tm.key.weight = _uniform(seed, f"{i}.key", tm.key.weight.shape, 2 * KEY_BOUND / math.sqrt(C))
    tm.output.weight = mx.zeros_like(tm.output.weight)


def _pretrain_channel_mix(cm: ChannelMix, i: int, n: int, ch: dict) -> None:
    """The channel-mix of RWKV block ``i`` of ``n``: lerp ``1 - p^(r10^4)``, value zero."""
    r10 = 1.0 - i / n
    cm.x_k = 1.0 - mx.power(ch["p"], r10**4)
    cm.value.weight = mx.zeros_like(cm.value.weight)


def init_pretrain(model: nn.Module, seed: int = 0) -> nn.Module:
    """RWKV-7's published pretraining init (BlinkDL's RWKV-LM x070), in place.

    Per RWKV block i of n (r01 = i / (n - 1), r10 = 1 - i / n, p = channel / C): lerps
    ``1 - p^(s r10)``; decay bias ``w0 = -6 + 6 q^(1 + r01^0.3) + 0.5 + 2.5 zigzag``; ``a0``,
    ``v0``, ``k_k``, ``k_a = 1.02``, ``r_k = -0.04``; low-rank ``down`` zero and ``up`` orthogonal
    x0.1; receptance/value U(+-0.5/sqrt C), key U(+-0.05/sqrt C), output and channel-mix value
    zero; embedding U(+-1e-4); head orthogonal x0.5 sqrt(vocab / C). Norms start at 1 and 0.
    Attention blocks: projections U(+-0.5/sqrt C), their output projections zero. The numbers
    are the named constants above.
    """
    cfg = model.config
    init_foundry(model, seed)  # then every parameter below is set by the published rule
    _pretrain_generic(model, seed)
    model.embed.weight = _uniform(seed, "embed", model.embed.weight.shape, 2 * EMBED_BOUND)
    ch = _channels(cfg.hidden_size, cfg.head_size)
    rwkv = [m for m in model.layers if m.kind == "rwkv7"]
    for i, block in enumerate(rwkv):
        _pretrain_time_mix(block.tmix, i, len(rwkv), ch, seed)
        if isinstance(block.ffn, ChannelMix):
            _pretrain_channel_mix(block.ffn, i, len(rwkv), ch)
    if "lm_head" in model:
        V, C = cfg.vocab_size, cfg.hidden_size
        gain = HEAD_GAIN * math.sqrt(V / C) if V > C else HEAD_GAIN
        model.lm_head.weight = _orthogonal(seed, "lm_head", model.lm_head.weight.shape, gain)
    return model


def init_scheme(scheme: str) -> str:
    """The scheme ``scheme`` names (``seeds`` is ``foundry``); ValueError for another."""
    scheme = INIT_ALIASES.get(scheme, scheme)
    if scheme not in INIT_SCHEMES:
        raise ValueError(f"init scheme must be one of {INIT_SCHEMES}, got {scheme!r}")
    return scheme


def initialise(model: nn.Module, scheme: str = "foundry", seed: int = 0) -> nn.Module:
    """Initialise ``model`` in place by ``scheme`` (``foundry`` or ``pretrain``)."""
    scheme = init_scheme(scheme)
    return (init_foundry if scheme == "foundry" else init_pretrain)(model, seed)
