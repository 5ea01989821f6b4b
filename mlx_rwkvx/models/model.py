"""The model: embedding, the blocks ``block_types`` lists, final norm, head.

``hidden(tokens, state) -> (h, state)`` carries an explicit state (a list with one dict of
arrays per block, from ``init_state``): training carries it across segments inside a compiled
step, generation snapshots it. Beside it, mlx-lm's model protocol (``model(tokens, cache) ->
logits``, ``model.make_cache()``, ``model.layers``) with mlx-lm cache objects that hold that
state, so mlx-lm's generation utilities take the model as is; ``head`` is separate so that
training can fuse head and loss and generation can run the head on the last position only.
"""

from __future__ import annotations

import copy
import functools

from mlx_rwkvx.models.attention import MobaBlock, Qwen2Block
from mlx_rwkvx.models.cache import Rows, make_caches, read_caches, spans_of, write_caches
from mlx_rwkvx.models.config import ModelConfig
from mlx_rwkvx.models.init import initialise
from mlx_rwkvx.models.quantize import GROUP_SIZE, quantize_bits, quantize_model
from mlx_rwkvx.models.rwkv7 import RWKV7Block, make_norm
from mlx_rwkvx.ops.dispatch import in_transformation

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_map

# A checkpointed RWKV-7 block's recomputation and backward, bytes per token and channel (MLX's
# peak, width 2048, int4 base with LoRA, float32 input: 369; the channel-mix alone 192, the
# time-mix 272), and the shortest span it may be recomputed in (``checkpoint_span``): 128 tokens,
# where the CPU's per-span costs (a quantized weight dequantized once per span) stay
# small (one block's forward and backward at width 2048 in spans of 128 and 256 tokens: 1.55
# and 1.17 times its time in one span of 512)
RECOMPUTED = 370
MIN_SPAN = 128

# Every block kind: its constructor from the config and the block's index among RWKV blocks
BLOCKS = {
    "rwkv7": lambda cfg, rwkv_index: RWKV7Block(cfg, rwkv_index),
    "moba": lambda cfg, rwkv_index: MobaBlock(cfg),
    "qwen2": lambda cfg, rwkv_index: Qwen2Block(cfg),
}


def _run_block(block, params, h, v_first, state):
    # the trainable parameters come in as arguments so that the checkpoint differentiates them
    block.update(params)
    return block(h, v_first, state)


def _leaves(tree) -> list:
    found = []
    tree_map(lambda x: found.append(x) if isinstance(x, mx.array) else None, tree)
    return found


def _replaced(tree, arrays):
    """``tree`` with its arrays, in ``_leaves``' order, replaced by ``arrays``."""
    it = iter(arrays)
    return tree_map(lambda x: next(it) if isinstance(x, mx.array) else x, tree)


def _recomputed(fn, span: int | None = None):
    """``fn`` (arrays, dicts, lists and None in; the same out) whose activations are computed
    again in the backward instead of kept. Unlike ``mx.checkpoint``, the recomputation waits
    for the cotangents of ``fn``'s outputs (``mx.depends``): MLX may otherwise evaluate every
    block's recomputation before the backward reaches it, and keep them all at once (measured
    on 6 RWKV-7 blocks of the 1.5B's width at T = 512: 58 MB kept per block with
    ``mx.checkpoint``, 21 MB with this). And every gradient of ``fn``'s inputs is computed
    before any of them is used: MLX evaluates a graph depth first from its outputs in their
    order, so the gradients of a later block's trained tensors were otherwise computed at the
    end, each block's inputs and cotangents kept until then (width 512, T = 512: 20 bytes per
    token and channel kept per block, 3.8 with this; the block's bf16 input is 2).

    ``span`` (a block ``fn(params, h, v_first, state)`` of RWKV-7): its tokens ``span`` at a
    time, each span starting from the state the last one left, the states between spans
    kept; the backward recomputes one span at a time, last first, and adds each span's
    gradients of ``params`` to the sum before the next (``_in_spans``)."""

    def call(*args):
        T = args[1].shape[1]
        if span is not None and span < T:
            return _in_spans(fn, span, T, args)
        out_tree = None  # fn's outputs as it returns them (their arrays go through MLX flat)

        def run(arrays):
            return _leaves(fn(*_replaced(args, arrays)))

        @mx.custom_function
        def forward(*arrays):
            nonlocal out_tree
            out_tree = fn(*_replaced(args, arrays))
            return _leaves(out_tree)

        @forward.vjp
        def backward(primals, cotangents, outputs):
            waiting = mx.depends(list(primals), list(cotangents))
            grads = mx.vjp(lambda *a: run(a), waiting, list(cotangents))[1]
            return mx.depends(grads, grads)

        outs = forward(*_leaves(args))
        return _replaced(out_tree, outs)

    return call


def _span_args(args, state, a: int, b: int):
    """A block's arguments ``(params, h, v_first, state)`` for its tokens ``a:b``."""
    params, h, v_first, _ = args
    return params, h[:, a:b], None if v_first is None else v_first[:, a:b], state


def _run_span(fn, piece, *arrays):
    return _leaves(fn(*_replaced(piece, arrays)))


def _in_spans(fn, span: int, T: int, args):
    """``_recomputed``'s block over its tokens in spans (see there)."""
    starts = list(range(0, T, span))
    trees = {}  # the output tree of fn (h, v_first, state) and the states between spans

    def spans_forward(arrays):
        state = arrays[3]
        outs, between = [], []
        for a in starts:
            h, v_first, state = fn(*_span_args(arrays, state, a, a + span))
            outs.append((h, v_first))
            if a + span < T:
                between.append(state)
        joined = [mx.concatenate(x, axis=1) for x in zip(*outs, strict=True)]
        return (joined[0], joined[1], state), between

    @mx.custom_function
    def forward(*arrays):
        out, between = spans_forward(_replaced(args, arrays))
        trees.update(out=out, between=between)
        return _leaves(out) + _leaves(between)

    @forward.vjp
    def backward(primals, cotangents, outputs):
        arrays = _replaced(args, primals)
        n_out = len(_leaves(trees["out"]))
        d_h, d_v_first, d_state = _replaced(trees["out"], cotangents[:n_out])
        states = [arrays[3], *_replaced(trees["between"], outputs[n_out:])]
        d_params, d_hs, d_v_firsts = None, [], []
        for k in reversed(range(len(starts))):
            a, b = starts[k], starts[k] + span
            piece = _span_args(arrays, states[k], a, b)
            cots = _leaves((d_h[:, a:b], d_v_first[:, a:b], d_state))
            waiting = mx.depends(_leaves(piece), cots + _leaves(d_params))
            run = functools.partial(_run_span, fn, piece)
            grads = mx.vjp(run, waiting, cots)[1]
            grads = mx.depends(grads, grads)
            g_params, g_h, g_v_first, d_state = _replaced(piece, grads)
            d_params = g_params if d_params is None else tree_map(mx.add, d_params, g_params)
            d_hs.insert(0, g_h)
            d_v_firsts.insert(0, g_v_first)
        d_v_first = None if arrays[2] is None else mx.concatenate(d_v_firsts, axis=1)
        return _leaves((d_params, mx.concatenate(d_hs, axis=1), d_v_first, d_state))

    outs = forward(*_leaves(args))
    return _replaced(trees["out"], outs[: len(_leaves(trees["out"]))])


def state_bytes(cfg: ModelConfig) -> int:
    """Bytes of one row's state in every RWKV-7 block (float32 WKV state and token shifts)."""
    per_block = 4 * (cfg.n_heads * cfg.head_size**2 + 2 * cfg.hidden_size)
    return per_block * cfg.block_types.count("rwkv7")


def split_in_spans(cfg: ModelConfig) -> bool:
    """Whether a checkpointed model of this config may recompute its blocks in spans of
    tokens: RWKV-7 blocks alone (an attention block would keep its keys and values for every
    span)."""
    return all(kind == "rwkv7" for kind in cfg.block_types)


def checkpoint_span(cfg: ModelConfig, T: int) -> int:
    """The tokens a checkpointed model recomputes at once: ``T``, or for a model of RWKV-7
    blocks alone spans of fewer (the state carried from one to the next, as in generation), so
    that the backward holds one block's activations of a span, not of the whole text, beside
    each span's states: of ``T`` and the powers of two below it from ``MIN_SPAN``, the span
    that needs least of the two, ``RECOMPUTED`` bytes per token and channel against
    ``state_bytes`` per span after the first (``split_in_spans``: else ``T``)."""
    if not split_in_spans(cfg):
        return T

    def held(span: int) -> float:
        return RECOMPUTED * span * cfg.hidden_size + (-(-T // span) - 1) * state_bytes(cfg)

    spans, span = [T], MIN_SPAN
    while span < T:
        spans.append(span)
        span *= 2
    return min(spans, key=lambda s: (held(s), -s))


def _batched_block(layer, h, v_first, state, rows: Rows):
    """One block over a batch whose rows differ (``mlx_rwkvx.models.cache``): an RWKV block
    masks the padded positions (its state stays as it was there); an attention block runs
    each row on its own span of tokens against its own cache, and the rows' caches are
    stacked again, right-padded, with their lengths."""
    if layer.kind == "rwkv7":
        return layer(h, v_first, state, valid=rows.valid)
    lengths = state.get("lengths") or [layer.state_length(state)] * h.shape[0]
    outs, states, new_lengths = [], [], []
    for b, (start, end) in enumerate(rows.spans):
        row = layer.row_state(state, b, lengths[b])
        if end > start:
            out, _, row = layer(h[b : b + 1, start:end], None, row)
            out = mx.concatenate([h[b : b + 1, :start], out, h[b : b + 1, end:]], axis=1)
        else:
            out = h[b : b + 1]
        outs.append(out)
        states.append(row)
        new_lengths.append(lengths[b] + end - start)
    new = layer.stack_rows(states)
    if len(set(new_lengths)) > 1:
        new["lengths"] = new_lengths
    return mx.concatenate(outs, axis=0), v_first, new


class Model(nn.Module):
    """A model of ``cfg`` (the model keeps its own copy). ``init``: ``"foundry"`` (default:
    Foundry's C engine's, seeded and non-degenerate; ``"seeds"`` is its older name),
    ``"pretrain"`` (RWKV-7's published init) or None (leave MLX's, e.g. before loading
    weights). ``seed``: the draws' seed.
    """

    def __init__(self, cfg: ModelConfig, *, init: str | None = "foundry", seed: int = 0):
        super().__init__()
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"Model: expected a ModelConfig, got {type(cfg).__name__}")
        cfg = copy.deepcopy(cfg)
        cfg.validate()  # a config edited after it was made is checked again here
        self.config = cfg
        self.model_type = "mlx_rwkvx"
        self.check_token_ids = True  # see check_tokens
        C = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, C)
        if cfg.ln0:
            self.ln0 = nn.LayerNorm(C, eps=cfg.norm_eps)
        self.layers = []
        rwkv_index = 0
        for kind in cfg.block_types:
            self.layers.append(BLOCKS[kind](cfg, rwkv_index))
            rwkv_index += kind == "rwkv7"
        self.norm = make_norm(cfg.final_norm, C, cfg)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(C, cfg.vocab_size, bias=False)
        if init is not None:
            initialise(self, init, seed)

    @property
    def quantization(self) -> dict | None:
        """``{"group_size", "bits"}`` of the quantized layers, read from the modules; None for a
        float model."""
        for _, module in self.named_modules():
            if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
                return {"group_size": module.group_size, "bits": module.bits}
        return None

    def quantize(self, bits=8, group_size: int = GROUP_SIZE) -> Model:
        """Quantize the large projections, head and embedding in place (``nn.QuantizedLinear``,
        ``nn.QuantizedEmbedding``); RWKV-7's low-rank projections and the norms stay float.
        ``bits``: 8 or 4 (or ``"int8"``, ``"int4"``)."""
        bits = quantize_bits(bits)
        if self.quantization is not None:
            raise ValueError(f"model: already quantized ({self.quantization})")
        return quantize_model(self, bits, group_size)

    def init_state(self, batch: int) -> list[dict]:
        """The state at the start of a text: one dict of arrays per block."""
        if not isinstance(batch, int) or isinstance(batch, bool) or batch < 1:
            raise ValueError(f"init_state: batch must be a positive int, got {batch!r}")
        return [layer.init_state(batch) for layer in self.layers]

    def trim_state(self, state: list[dict], max_tokens: int) -> list[dict]:
        """``state`` with every attention block's KV cache cut to (at most) its last
        ``max_tokens`` tokens: a sliding window that keeps memory flat over a long text; RWKV
        blocks' states are unchanged (constant-size)."""
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError(f"model: max_tokens must be a positive int, got {max_tokens!r}")
        first = state[0] if isinstance(state, (list, tuple)) and state else None
        arrays = (
            [a for a in first.values() if isinstance(a, mx.array)]
            if isinstance(first, dict)
            else []
        )
        self.check_state(state, arrays[0].shape[0] if arrays and arrays[0].ndim else 1)
        return [
            layer.trim_state(s, max_tokens) for layer, s in zip(self.layers, state, strict=True)
        ]

    def make_cache(self) -> list:
        """mlx-lm's cache: one of its ``ArraysCache`` per block, holding the block's state
        (``mlx_rwkvx.models.cache``); empty until the model first runs with it."""
        return make_caches(self.layers)

    def check_tokens(self, tokens) -> None:
        """Raise a ValueError (TypeError for a non-array) unless ``tokens`` is an integer
        ``[B, T]`` array of ids in ``0 .. vocab_size - 1``. The range check reads the ids back
        from the device (a host sync): ``model.check_token_ids = False`` turns it off where the
        caller checked them already (and inside ``mx.compile``, where nothing can be read back,
        the check is skipped the same way): an id out of range then gives NaN logits, never a
        crash."""
        if not isinstance(tokens, mx.array):
            raise TypeError(
                f"model: tokens must be an mx.array of integer ids [B, T], got "
                f"{type(tokens).__name__}"
            )
        if tokens.ndim != 2 or tokens.size == 0:
            raise ValueError(f"model: tokens must be [B, T] with B, T >= 1, got {tokens.shape}")
        if not mx.issubdtype(tokens.dtype, mx.integer):
            raise ValueError(f"model: tokens must be integer ids, got dtype {tokens.dtype}")
        if self.check_token_ids and not in_transformation(tokens):
            lo, hi = mx.stack([mx.min(tokens), mx.max(tokens)]).tolist()  # one read back
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(
                    f"model: token id {bad} is outside the vocabulary (0 .. "
                    f"{self.config.vocab_size - 1})"
                )

    def check_state(self, state, batch: int) -> None:
        """One ValueError if ``state`` does not belong to this model and batch size (shapes
        only: nothing is read back)."""
        if not isinstance(state, (list, tuple)) or len(state) != len(self.layers):
            n = len(state) if isinstance(state, (list, tuple)) else type(state).__name__
            raise ValueError(
                f"model: the state has {n} entries for {len(self.layers)} layers "
                "(use model.init_state() or model.make_cache())"
            )
        for i, (layer, s) in enumerate(zip(self.layers, state, strict=True)):
            problem = layer.state_problem(s, batch)
            if problem:
                raise ValueError(f"model: state of layer {i} ({layer.kind} block): {problem}")

    def _embed(self, tokens: mx.array) -> mx.array:
        if self.check_token_ids and not in_transformation(tokens):
            return self.embed(tokens)
        # ids not checked: a bad one must not read outside the table (a crash); it gives NaN
        valid = (tokens >= 0) & (tokens < self.config.vocab_size)
        h = self.embed(mx.where(valid, tokens, 0))
        return mx.where(valid[..., None], h, mx.array(mx.nan, h.dtype))

    def hidden(
        self,
        tokens: mx.array,
        state: list | None = None,
        *,
        checkpoint: bool = False,
        check: bool = True,
        valid: mx.array | None = None,
    ) -> tuple[mx.array, list]:
        """``tokens [B, T]`` after ``state`` (None: the start of a text) -> (final normalised
        hidden states ``[B, T, C]``, before the head; the state after these tokens).
        ``checkpoint``: each block's activations are recomputed in the backward instead of
        kept (``_recomputed``), a span of tokens at a time (``checkpoint_span``): less memory
        for training, one more forward of time.
        ``check=False``: the ids are known to be in the vocabulary (sampled, or checked once
        for a whole text): no read back (see ``check_tokens``). ``valid [B, T]`` (bool): each
        row's tokens, the rest padding (left or right, contiguous) that leaves the state as
        it was; the attention blocks keep each row's own tokens (their state then holds each
        row's length, and a later call with it runs them row by row: ``models.cache``)."""
        if check:
            self.check_tokens(tokens)
        rows = None
        ragged = state is not None and any("lengths" in s for s in state)
        if valid is not None or ragged:
            B, T = tokens.shape
            rows = Rows(valid, spans_of(valid) if valid is not None else [(0, T)] * B)
        return self._hidden(tokens, state, checkpoint, rows)

    def _hidden(
        self, tokens: mx.array, state: list | None, checkpoint: bool = False, rows: Rows = None
    ) -> tuple[mx.array, list]:
        B = tokens.shape[0]
        if state is None:
            state = self.init_state(B)
        else:
            self.check_state(state, B)
        h = self._embed(tokens)
        if "ln0" in self:
            h = self.ln0(h)
        span = checkpoint_span(self.config, h.shape[1]) if checkpoint and rows is None else None
        v_first = None
        new_state = []
        for layer, s in zip(self.layers, state, strict=True):
            if rows is not None:
                h, v_first, s = _batched_block(layer, h, v_first, s, rows)
            elif checkpoint:
                run = _recomputed(functools.partial(_run_block, layer), span)
                h, v_first, s = run(layer.trainable_parameters(), h, v_first, s)
            else:
                h, v_first, s = layer(h, v_first, s)
            new_state.append(s)
        return self.norm(h), new_state

    def head(self, h: mx.array) -> mx.array:
        """Hidden states ``[..., C]`` -> logits ``[..., vocab]``."""
        if self.config.tie_embeddings:
            return self.embed.as_linear(h)
        return self.lm_head(h)

    def prefill(self, tokens: mx.array, cache: list, lengths: list[int]) -> mx.array:
        """Rows of different lengths at once: ``tokens [B, T]`` right-padded (row ``b``'s first
        ``lengths[b]`` are its tokens) after the state ``cache`` holds (``make_cache``'s,
        merged: mlx-lm's batching methods), which is updated in place and left unpadded.
        Returns each row's logits after its last token, ``[B, vocab]`` (the head runs on those
        positions only)."""
        self.check_tokens(tokens)
        B, T = tokens.shape
        if len(lengths) != B or not all(1 <= n <= T for n in lengths):
            raise ValueError(f"model: lengths must be {B} row lengths in 1 .. {T}, got {lengths}")
        padding = [T - n for n in lengths]
        if any(padding):
            for c in cache:
                c.prepare(lengths=lengths, right_padding=padding)
        state, rows = read_caches(self.layers, cache, B, T)
        h, state = self._hidden(tokens, state, rows=rows)
        write_caches(self.layers, cache, state, T)
        if any(padding):
            for c in cache:
                c.finalize()
        last = mx.array([n - 1 for n in lengths])[:, None, None]
        return self.head(mx.take_along_axis(h, last, axis=1)[:, 0])

    def __call__(self, tokens: mx.array, cache: list | None = None) -> mx.array:
        """mlx-lm's protocol: logits ``[B, T, vocab]``; ``cache`` (from ``make_cache``) is read
        and updated in place."""
        self.check_tokens(tokens)
        if cache is None:
            return self.head(self._hidden(tokens, None)[0])
        if not isinstance(cache, (list, tuple)) or len(cache) != len(self.layers):
            n = len(cache) if isinstance(cache, (list, tuple)) else type(cache).__name__
            raise ValueError(
                f"model: the cache has {n} entries for {len(self.layers)} layers "
                "(use model.make_cache())"
            )
        B, T = tokens.shape
        state, rows = read_caches(self.layers, cache, B, T)
        h, state = self._hidden(tokens, state, rows=rows)
        write_caches(self.layers, cache, state, T)
        return self.head(h)
