"""A training run's peak memory, estimated before its first step, and what the run does about
it: ``footprint(model, ...)`` adds up what a step holds (the process itself; the weights as
loaded: quantized integers with their scales and biases, floats; the trained tensors with their
gradients and AdamW's two moments; the forward and backward's activations and the fused head
and loss), ``budget()`` is what the device has for the run, and ``plan(...)`` turns block
checkpointing on where the run would not fit without it, or refuses a run that fits in neither
way, naming the longest ``--max-seq-len`` (or the smaller base) that would fit.

The activations are bytes per token and channel of each kind of block, with and without block
checkpointing, counted from the first block holding a trained tensor (the backward stops
there; a checkpointed RWKV-7 model recomputes a span of tokens at a time, ``checkpoint_span``,
and keeps the states between spans), and of the attention blocks' scores, fitted to MLX's peak
counter on measured steps: RWKV-7 (widths 512 and 1024, 2 and 4 blocks, T 256 and 512, LoRA,
state tuning and full, bf16 and INT8 bases), RWKV-X (width 512) and RFA (widths 512 and 1024),
LoRA; on a CPU, the float32 tiles of the quantized products beside them (``tile_bytes``). The
tests check it against runs it was not fitted to."""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from typing import NamedTuple

from mlx_rwkvx.errors import TrainError
from mlx_rwkvx.models.model import checkpoint_span, split_in_spans, state_bytes
from mlx_rwkvx.models.quantize import QUANTIZE_BITS, quantizable
from mlx_rwkvx.ops.quantized import TILE_BYTES

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten


class Kind(NamedTuple):
    """Bytes per token and channel of one block of a kind, in a training step."""

    plain: int  # without checkpointing: what the block keeps for the backward, its transients
    plain_frozen: int  # the same for a block training no weights (frozen, or its state alone)
    kept: int  # checkpointed: what the block keeps until the backward reaches it
    recomputed: int  # checkpointed: its recomputation and backward (one block at a time)
    frozen: int  # the same for a block holding no trained tensor (no gradients of its own)
    quantized: int  # checkpointed, more for the recomputation where the weights are quantized


ACTIVATIONS = {
    "rwkv7": Kind(225, 175, 6, 320, 260, 4),
    "moba": Kind(66, 66, 4, 48, 48, 45),
    "qwen2": Kind(45, 45, 8, 35, 35, 58),
}
FIXED = 115  # bytes per token and channel beside the blocks: the embedding's output, the norms
# A checkpointed model of RWKV-7 blocks alone, recomputed in spans (``checkpoint_span``): bytes
# per token and channel beside the blocks, and per token of a span (not of the text) of the
# recomputed block: training weights (LoRA), a state alone, or nothing (its input's gradient
# only), fitted to MLX's peak over LoRA and state-tuning steps on the CPU (the gradient
# uncompiled: ``trainer.Step``; widths 512 to 2048, T 256 to 1024, 2 to 4 blocks, bf16, INT8
# and int4 bases: 10, 380 and 325; the frozen block's as the unsplit fit's ratio)
SPLIT_FIXED = 10


class Split(NamedTuple):
    weights: int
    state: int
    frozen: int


SPLIT = Split(weights=380, state=325, frozen=310)
HEAD = 0.6  # bytes per token and vocabulary entry: the fused head and loss (chunked logits)
# bytes per head, query and key of an attention block's scores (and their gradient); MoBA's
# queries see their top-k chunks only
SCORES = {"qwen2": 8, "moba": 16}
ADAM_MOMENTS = 2  # AdamW's state: two tensors the shape of each trained one
GB = 1e9
QUANTIZED = (nn.QuantizedLinear, nn.QuantizedEmbedding)


@dataclass(frozen=True)
class Footprint:
    """The parts of a run's estimated peak, in bytes."""

    process: int  # Python, MLX and the imports, the model aside
    weights: int  # every parameter of the model as loaded (the trained ones too)
    trained: int  # the trained tensors' gradients and optimizer state
    activations: int  # the forward and backward above the rest, head and loss included

    @property
    def total(self) -> int:
        return self.process + self.weights + self.trained + self.activations

    def parts(self) -> str:
        named = [
            ("weights", self.weights),
            ("gradients and optimizer state", self.trained),
            ("activations", self.activations),
            ("the process", self.process),
        ]
        return ", ".join(f"{name} {gb(n)}" for name, n in named)


def gb(n: float) -> str:
    """Bytes as GB (below 1 GB: MB)."""
    return f"{n / GB:.2f} GB" if n >= GB else f"{n / 1e6:.0f} MB"


def _proc_kib(path: str, field: str) -> int:
    """A ``Name:  N kB`` field of a Linux /proc file, in bytes (OSError, KeyError, ValueError
    where there is none)."""
    with open(path) as f:
        fields = dict(line.split(":", 1) for line in f if ":" in line)
    return int(fields[field].split()[0]) * 1024


def resident_now() -> int:
    """This process's resident memory (Linux: now; elsewhere its peak so far)."""
    try:
        return _proc_kib("/proc/self/status", "VmRSS")
    except (OSError, KeyError, ValueError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak if sys.platform == "darwin" else peak * 1024


def process_bytes() -> int:
    """What the process holds beside MLX's arrays and cache (its interpreter, the imports):
    its resident memory less theirs (on Apple silicon MLX's buffers are mapped into the process
    and counted in its resident memory as on a CPU)."""
    held = mx.get_active_memory() + mx.get_cache_memory()
    return max(0, resident_now() - held)


def budget(gigabytes: float | None = None) -> tuple[int, str]:
    """The bytes a run may use and where that number comes from: ``gigabytes`` where given
    (--memory-budget); on a GPU its recommended working set; on a CPU the memory the system
    has available, with what this process holds already."""
    if gigabytes is not None:
        return int(gigabytes * GB), "--memory-budget"
    if mx.default_device() != mx.cpu:
        info = mx.device_info()
        if "max_recommended_working_set_size" in info:
            return int(info["max_recommended_working_set_size"]), "the GPU's working set"
    try:
        return _proc_kib("/proc/meminfo", "MemAvailable") + resident_now(), "the memory available"
    except (OSError, KeyError, ValueError):
        pages = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return pages, "the machine's memory"


def nbytes(tree) -> int:
    """Bytes of the arrays in ``tree`` (parameters, gradients, optimizer state)."""
    return sum(x.nbytes for _, x in tree_flatten(tree) if isinstance(x, mx.array))


def backward_blocks(model) -> list[str]:
    """The kinds of the blocks the backward goes through: from the first that holds a trained
    tensor on (all of them where the embedding is trained; the blocks before it need none)."""
    trained = [name for name, _ in tree_flatten(model.trainable_parameters())]
    kinds = [layer.kind for layer in model.layers]
    if any(n.startswith(("embed.", "ln0.")) for n in trained):
        return kinds
    firsts = [int(n.split(".")[1]) for n in trained if n.startswith("layers.")]
    return kinds[min(firsts) :] if firsts else []


def activation_bytes(model, T: int, batch: int, checkpoint: bool) -> int:
    """The forward and backward's activations of ``batch`` rows of ``T`` tokens (see the
    module's docstring)."""
    cfg = model.config
    rows = batch * T
    kinds = backward_blocks(model)
    per_channel = FIXED
    names = [n.split(".") for n, _ in tree_flatten(model.trainable_parameters())]
    trained = {n[1] for n in names if n[0] == "layers"}  # blocks training any tensor
    weights = {n[1] for n in names if n[0] == "layers" and n[-1] != "state0"}  # a weight
    blocks = list(enumerate(kinds, len(model.layers) - len(kinds)))
    boundaries = 0  # the states kept between spans of a checkpointed model
    if checkpoint and kinds and split_in_spans(cfg):
        span = checkpoint_span(cfg, T)
        per_channel = SPLIT_FIXED + ACTIVATIONS["rwkv7"].kept * len(kinds)
        per_channel += (span / T) * max(
            SPLIT.weights
            if str(i) in weights
            else SPLIT.state
            if str(i) in trained
            else SPLIT.frozen
            for i, _ in blocks
        )
        boundaries = (-(-T // span) - 1) * batch * state_bytes(cfg)
    elif checkpoint and kinds:  # each block's input kept; one block recomputed at a time
        quantized = any(isinstance(m, QUANTIZED) for _, m in model.named_modules())
        per_channel += sum(ACTIVATIONS[k].kept for k in kinds)
        per_channel += max(
            (ACTIVATIONS[k].recomputed if str(i) in trained else ACTIVATIONS[k].frozen)
            + (ACTIVATIONS[k].quantized if quantized else 0)
            for i, k in blocks
        )
    else:
        per_channel += sum(
            ACTIVATIONS[k].plain if str(i) in weights else ACTIVATIONS[k].plain_frozen
            for i, k in blocks
        )
    total = rows * cfg.hidden_size * per_channel + rows * cfg.vocab_size * HEAD + boundaries
    total += tile_bytes(model) if kinds else 0
    keys = {"qwen2": T, "moba": min(T, cfg.moba_top_k * cfg.moba_chunk_size)}
    scores = [batch * (cfg.n_q_heads or 0) * T * keys[k] * SCORES[k] for k in kinds if k in SCORES]
    if scores:  # every block's kept, or one block's at a time
        total += max(scores) if checkpoint else sum(scores)
    return int(total)


def tile_bytes(model) -> int:
    """What the CPU's quantized products (``ops/quantized.py``) hold in float32 tiles of their
    weights at once, fitted: ``3 + n / 4`` tiles, n those of the largest weight (MLX's peak
    over LoRA steps of RWKV-7 blocks, T = 256 and 512 in spans of 128: 54 and 70 MB more than
    a bf16 base at widths 1024 and 2048, for 3.2 and 4.2 tiles of 16.8 MB); the blocks'
    alone (the head's come before the backward, in the loss); none on a GPU, whose quantized
    products are MLX's own."""
    sizes = [
        4 * m.weight.shape[0] * m.weight.shape[1] * 32 // m.bits
        for layer in model.layers
        for _, m in layer.named_modules()
        if isinstance(m, nn.QuantizedLinear)
    ]
    if not sizes or mx.default_device() != mx.cpu:
        return 0
    largest = max(sizes)
    tile = min(TILE_BYTES, largest)
    return int((3 + -(-largest // tile) / 4) * tile)


def footprint(
    model,
    T: int,
    batch: int = 1,
    *,
    checkpoint: bool = False,
    grad_accum: int = 1,
    process: int | None = None,
) -> Footprint:
    """The estimated peak of a training step of ``model`` (with what it trains set up) on
    ``batch`` rows of ``T`` tokens; ``process``: the process's own bytes (default: measured
    now, ``process_bytes``)."""
    trained = nbytes(model.trainable_parameters())
    kept = 1 + ADAM_MOMENTS + (1 if grad_accum > 1 else 0)  # a step's sum of micro-batches
    return Footprint(
        process=process_bytes() if process is None else process,
        weights=nbytes(model.parameters()),
        trained=kept * trained,
        activations=activation_bytes(model, T, batch, checkpoint),
    )


def weights_at(model, bits: int) -> int:
    """The bytes of ``model``'s parameters were its quantizable layers ``bits``-bit (the rest as
    they are)."""
    predicate = quantizable()
    total = 0
    for path, module in model.named_modules():
        if not isinstance(module, (nn.Linear, nn.Embedding, *QUANTIZED)):
            continue
        own = {k: v for k, v in module.parameters().items() if isinstance(v, mx.array)}
        if isinstance(module, QUANTIZED):
            rows, packed = module.weight.shape
            n = rows * packed * 32 // module.bits
        elif predicate(path, module):
            n = module.weight.size
        else:
            continue
        rest = sum(v.nbytes for k, v in own.items() if k not in ("weight", "scales", "biases"))
        total += n * bits // 8 + (n // 64) * 4 + rest - nbytes(own)
    return nbytes(model.parameters()) + total


def plan(
    model,
    T: int,
    batch: int,
    *,
    checkpoint: bool,
    grad_accum: int = 1,
    memory_budget: float | None = None,
    may_checkpoint: bool = True,
) -> tuple[bool, list[str]]:
    """Whether the run checkpoints its blocks (``checkpoint``: asked for; else where it would
    not fit otherwise, if it ``may_checkpoint``), and the lines that say its memory; TrainError
    (one line) when it does not fit: the longest T that would fit, or the smaller base."""
    limit, where = budget(memory_budget)
    estimate = footprint(model, T, batch, checkpoint=checkpoint, grad_accum=grad_accum)
    lines = []
    if estimate.total > limit and not checkpoint and may_checkpoint:
        plain = estimate
        estimate = footprint(model, T, batch, checkpoint=True, grad_accum=grad_accum)
        if estimate.total <= limit:
            checkpoint = True
            lines.append(
                f"block checkpointing on (--grad-checkpoint): without it the peak would be about "
                f"{gb(plain.total)}, over {gb(limit)}"
            )
    lines.insert(
        0,
        f"memory: about {gb(estimate.total)} at the peak (estimated: {estimate.parts()}); "
        f"{gb(limit)} available ({where})",
    )
    if estimate.total <= limit:
        return checkpoint, lines
    recompute = checkpoint or may_checkpoint
    fixed = estimate.total - estimate.activations
    longest = _longest(model, batch, limit - fixed, recompute)
    if longest >= 2:
        shorter = f"--max-seq-len {longest}" + (f" with --batch-size {batch}" if batch > 1 else "")
        hint = f"{shorter} would fit"
    else:
        room = limit - estimate.process - estimate.trained
        hint = _smaller_base(model, batch, room, recompute)
    how = "with block checkpointing" if recompute else "(--lora-dropout: no checkpointing)"
    raise TrainError(
        f"the run needs about {gb(estimate.total)} at its peak {how} ({estimate.parts()}) and "
        f"{gb(limit)} is available ({where}): {hint}"
    )


def _longest(model, batch: int, room: int, checkpoint: bool) -> int:
    """The longest T (a multiple of 64, or below 64 any) whose activations fit in ``room``
    bytes; 0 if none."""
    low, high = 0, 1 << 20
    while low < high:
        mid = (low + high + 1) // 2
        if activation_bytes(model, mid, batch, checkpoint) <= room:
            low = mid
        else:
            high = mid - 1
    return low if low < 64 else low // 64 * 64


def _smaller_base(model, batch: int, room: int, checkpoint: bool) -> str:
    """What would fit at a smaller base: ``room`` is the budget less the process and the trained
    tensors."""
    bits = (model.quantization or {"bits": 16})["bits"]
    if model.trainable_parameters().get("embed"):  # full training: no quantized base
        bits = 0
    for name, smaller in sorted(QUANTIZE_BITS.items(), key=lambda kv: -kv[1]):
        longest = _longest(model, batch, room - weights_at(model, smaller), checkpoint)
        if smaller < bits and longest >= 2:
            return f"--quantize {name} with --max-seq-len {longest} would fit"
    return "not even the process and the weights fit: a smaller model, or more memory"
