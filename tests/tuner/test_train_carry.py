"""``--carry-state``: long texts trained as segments with the state carried and the gradient
stopped at each boundary, attention caches cut to a sliding window (``trim_state``), memory
flat in the text's length, the compiled step traced a bounded number of times."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx_rwkvx
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.data.loss import batch_loss, segment_loss
from mlx_rwkvx.models import Model, ModelConfig, preset
from mlx_rwkvx.models.attention import MobaBlock, Qwen2Block
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.optimizer import optimizer_for
from mlx_rwkvx.tuner.trainer import Step

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import LOW_RANK, rfa_cfg, rwkv7_cfg
from mlx.utils import tree_flatten, tree_map
from oracle.common import rel_err

# the three families at width 32, on a vocabulary of 64
FAMILIES = {
    "rwkv7": rwkv7_cfg(vocab_size=64),
    "rwkv-x": ModelConfig(
        vocab_size=64,
        hidden_size=32,
        head_size=16,
        n_q_heads=2,
        n_kv_heads=2,
        attn_head_dim=16,
        moba_chunk_size=8,
        moba_top_k=2,
        block_types=["rwkv7", "moba", "rwkv7"],
    ),
    "rfa": rfa_cfg(["rwkv7", "qwen2", "rwkv7"], vocab_size=64, attn_head_dim=8, **LOW_RANK),
}


def _batch(vocab, B, T, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (B, T + 1))
    targets = tokens[:, 1:].copy()
    targets[1:, T - 5 :] = -100  # a shorter second row: padding at its end
    return mx.array(tokens[:, :-1]), mx.array(targets)


def _block_run(block, x, state):
    y, _, state = block(x, None, state)
    return y, state


@pytest.mark.parametrize("kind", ["moba", "qwen2"])
@pytest.mark.parametrize("window", [16, 21, 40])
@pytest.mark.parametrize(("S", "T"), [(48, 12), (45, 12), (45, 1)])
def test_trimmed_cache_attends_as_a_fresh_run_on_the_window(kind, window, S, T):
    """A block continued after its cache of ``S`` tokens was cut to ``window`` gives what the
    block gives run fresh on the kept tokens (a block's keys depend on its input alone: MoBA
    keeps whole chunks, a partial last one included; Qwen2's kept keys are turned back to
    positions from 0), for a segment of ``T`` tokens and for one token (the decode path)."""
    cfg = FAMILIES["rwkv-x" if kind == "moba" else "rfa"]
    mx.random.seed(0)  # the block's weights: whatever ran before, the same sparse selection
    block = (MobaBlock if kind == "moba" else Qwen2Block)(cfg)
    mx.eval(block.parameters())
    x = mx.random.normal((2, S + T, cfg.hidden_size), key=mx.random.key(1))
    _, state = _block_run(block, x[:, :S], block.init_state(2))
    trimmed = block.trim_state(state, window)
    kept = trimmed["keys"].shape[2]
    assert kept <= window and trimmed["values"].shape[2] == kept
    assert not block.state_problem(trimmed, 2)
    if kind == "moba":  # whole chunks of 8 dropped from the front: the most that fits
        assert kept == S - -(-(S - window) // 8) * 8
        assert trimmed["key_sums"].shape[2] == -(-kept // 8)
    else:
        assert kept == min(window, S)
    y, _ = _block_run(block, x[:, S:], trimmed)
    fresh, _ = _block_run(block, x[:, S - kept :], block.init_state(2))
    assert rel_err(np.array(y), np.array(fresh[:, kept:])) <= 1e-5
    # not a vacuous check: the untrimmed cache attends to more and gives other outputs (with
    # MoBA dense: its top-k selection may leave the dropped chunks out whatever the cache)
    if kind == "moba":
        block.attn.top_k = 0
        y, _ = _block_run(block, x[:, S:], trimmed)
    full, _ = _block_run(block, x[:, S:], state)
    assert rel_err(np.array(full), np.array(y)) > 1e-3


def test_trim_state_keeps_rwkv_states_and_checks_its_arguments():
    model = Model(FAMILIES["rwkv-x"], seed=0)
    _, state = model.hidden(mx.array([[1, 2, 3] * 10]))
    trimmed = model.trim_state(state, 8)
    # 30 tokens in chunks of 8, at most 8 kept: three whole chunks go, 6 tokens stay
    assert trimmed[0] is state[0] and trimmed[1]["keys"].shape[2] == 6
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="max_tokens"):
            model.trim_state(state, bad)
    with pytest.raises(ValueError, match="state"):
        model.trim_state(state[:2], 8)


def _step(model, **kw):
    cfg = TrainConfig(model="m", data="d", output="o", carry_state=True, lr=1e-3, **kw).resolved()
    optimizer = optimizer_for(cfg, 10)
    return Step(
        model,
        optimizer,
        grad_clip=cfg.grad_clip,
        grad_checkpoint=cfg.grad_checkpoint,
        segment=cfg.max_seq_len,
        max_cache=cfg.max_cache,
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_carried_segments_give_the_whole_texts_loss(family):
    """With a window that holds the whole text, the segments' losses add up to the loss of the
    text in one piece: the carried state is exact."""
    model = Model(FAMILIES[family], seed=1)
    inputs, targets = _batch(64, 2, 50)
    whole, count = batch_loss(model, inputs, targets)
    loss, n, _ = _step(model, max_seq_len=16, max_cache=64).loss_and_grad(inputs, targets)
    assert int(n) == int(count) == 2 * 50 - 5
    assert rel_err(np.array(loss), np.array(whole)) <= 1e-5


@pytest.mark.parametrize("trained", ["lora", "state", "state-checkpointed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_gradient_stops_at_each_segment_boundary(family, trained):
    """The step's gradients (LoRA; or the trained initial state, which only the first segment
    starts from) equal those of one function over all the segments with ``stop_gradient`` on
    the state between them (another formulation of truncated backpropagation), and differ
    from full backpropagation through the whole text."""
    model = Model(FAMILIES[family], seed=2)
    rng = np.random.default_rng(0)
    if trained == "lora":
        apply_lora(model, target_paths(model, "all"), rank=2, alpha=4)
        for _, layer in model.named_modules():  # B non-zero: every adapter tensor has a gradient
            if hasattr(layer, "lora_b"):
                layer.lora_b = mx.array(0.3 * rng.standard_normal(layer.lora_b.shape), mx.float32)
    else:
        model.freeze()
        for layer in model.layers:
            if layer.kind == "rwkv7":
                layer.tmix.enable_state_tuning()
                layer.tmix.state0 = mx.array(
                    0.2 * rng.standard_normal(layer.tmix.state0.shape), mx.float32
                )
    checkpoint = trained == "state-checkpointed"
    inputs, targets = _batch(64, 2, 40, seed=3)
    L, window = 16, 20

    def stopped(model):
        total, state = 0.0, None
        for a in range(0, 40, L):
            if state is not None:
                state = tree_map(mx.stop_gradient, model.trim_state(state, window))
            loss, _, state = segment_loss(model, inputs[:, a : a + L], targets[:, a : a + L], state)
            total = total + loss
        return total

    def through(model):
        return batch_loss(model, inputs, targets)[0]

    step = _step(model, max_seq_len=L, max_cache=window, grad_checkpoint=checkpoint)
    *_, grads = step.loss_and_grad(inputs, targets)
    ref = nn.value_and_grad(model, stopped)(model)[1]
    full = nn.value_and_grad(model, through)(model)[1]
    got, ref, full = (dict(tree_flatten(g)) for g in (grads, ref, full))
    assert set(got) == set(ref) and len(got) > 0
    flat = lambda g: np.concatenate([np.array(g[k]).ravel() for k in sorted(g)])  # noqa: E731
    assert rel_err(flat(got), flat(ref)) <= 1e-5
    assert rel_err(flat(full), flat(ref)) > 1e-3


def test_memory_stays_flat_in_the_texts_length():
    """A step's peak memory with --carry-state hardly grows from 4 to 32 segments (the window
    bounds the KV caches), while the same text in one piece needs several times more."""
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=128,
        head_size=32,
        n_q_heads=4,
        n_kv_heads=4,
        attn_head_dim=32,
        moba_chunk_size=16,
        moba_top_k=2,
        block_types=["rwkv7", "moba"],
    )
    model = Model(cfg, seed=0)
    apply_lora(model, target_paths(model, "all"), rank=4, alpha=8)

    def peak(T, carry):
        inputs, targets = _batch(256, 1, T)
        step = _step(model, max_seq_len=64, max_cache=128)
        if not carry:
            step.segment = None  # the text in one piece
        mx.eval(step.loss_and_grad(inputs, targets))  # traced and compiled
        mx.clear_cache()
        mx.reset_peak_memory()
        mx.eval(step.loss_and_grad(inputs, targets))
        return mx.get_peak_memory()

    short, long, whole = peak(256, True), peak(2048, True), peak(2048, False)
    assert long <= 1.25 * short, (short, long)
    assert whole >= 3 * long, (long, whole)
    # micro-batches (--grad-accum) are evaluated one at a time: four cost what one does
    step = _step(model, max_seq_len=64, max_cache=128)
    batch = [tuple(np.array(a) for a in _batch(256, 1, 256, seed=i)) for i in range(4)]
    peaks = []
    for n in (1, 4, 1, 4):  # each measured after a first, compiling call
        step(batch[:n])
        mx.clear_cache()
        mx.reset_peak_memory()
        step(batch[:n])
        peaks.append(mx.get_peak_memory())
    assert peaks[3] <= 1.25 * peaks[2], peaks


@pytest.fixture(scope="module")
def long_texts(tmp_path_factory):
    root = tmp_path_factory.mktemp("carry")
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "kappa"]
    texts = [" ".join(rng.choice(words, n)) for n in rng.integers(20, 90, 12)]  # 100-550 bytes
    (root / "data").mkdir()
    for split, part in (("train", texts), ("valid", texts[:3])):
        (root / "data" / f"{split}.jsonl").write_text(
            "".join(json.dumps({"text": t}) + "\n" for t in part)
        )
    return root


def test_carry_state_trains_long_texts_with_a_bounded_number_of_traces(
    long_texts, tmp_path, monkeypatch
):
    traces = []
    original = Step._loss_sum

    def counted(self, *args):
        traces.append(args[1].shape)  # called only while mx.compile traces
        return original(self, *args)

    monkeypatch.setattr(Step, "_loss_sum", counted)
    segments = []
    original_segments = mlx_rwkvx.tuner.trainer.segments

    def counted_segments(*args):
        parts = original_segments(*args)
        segments.extend(p[0].shape for p in parts)
        return parts

    monkeypatch.setattr(mlx_rwkvx.tuner.trainer, "segments", counted_segments)
    out = train_from_config(
        TrainConfig(
            model=str(long_texts / "base"),
            data=str(long_texts / "data"),
            output=str(tmp_path / "run"),
            carry_state=True,
            max_seq_len=64,
            max_cache=96,
            batch_size=2,
            iters=12,
            lr=1e-2,
            warmup=1,
            log_every=4,
            val_every=6,
        )
    )
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 12 and all(np.isfinite(losses))
    assert np.mean(losses[-3:]) < np.mean(losses[:3])
    assert any("val_loss" in r for r in rows)
    # texts of 100-550 tokens in segments of 64 (every one 64 long; validation included), window
    # 96 (MoBA: whole
    # chunks of 8): the step was traced for the first segment and for caches of 64 and 96
    # tokens (value_and_grad traces twice), however many segments it ran
    assert {shape[1] for shape in segments} == {64}, set(segments)
    assert len(traces) <= 6 and len(segments) >= 60, (traces, len(segments))


def test_settings_resolve_once_and_again():
    plain = TrainConfig(model="m", data="d", output="o").resolved()
    assert plain.max_cache is None and plain.resolved() == plain
    carry = TrainConfig(model="m", data="d", output="o", carry_state=True).resolved()
    assert carry.max_cache == 2048 and carry.resolved() == carry


def test_carry_state_flags_from_the_command_line(long_texts, tmp_path):
    run = [
        sys.executable,
        "-m",
        "mlx_rwkvx.train",
        "--model",
        str(long_texts / "base"),
        "--data",
        str(long_texts / "data"),
    ]
    bad = subprocess.run(
        run + ["--output", str(tmp_path / "a"), "--max-cache", "64"], capture_output=True, text=True
    )
    assert bad.returncode == 2 and "--max-cache" in bad.stderr and "--carry-state" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
    small = subprocess.run(
        run + ["--output", str(tmp_path / "a"), "--carry-state", "--max-cache", "4"],
        capture_output=True,
        text=True,
    )
    assert small.returncode == 2 and "whole chunks of 8" in small.stderr, small.stderr
    assert len(small.stderr.strip().splitlines()) == 1 and not (tmp_path / "a").exists()
    good = subprocess.run(
        run
        + [
            "--output",
            str(tmp_path / "b"),
            "--carry-state",
            "--max-seq-len",
            "128",
            "--max-cache",
            "64",
            "--iters",
            "2",
            "--batch-size",
            "2",
        ],
        capture_output=True,
        text=True,
    )
    assert good.returncode == 0, good.stderr
    assert "carry-state: texts of up to" in good.stdout and "window 64 tokens" in good.stdout
    # a resumed run keeps the segmenting it was started with
    again = subprocess.run(
        run
        + [
            "--output",
            str(tmp_path / "b"),
            "--resume",
            "--iters",
            "3",
            "--batch-size",
            "2",
            "--max-seq-len",
            "128",
        ],
        capture_output=True,
        text=True,
    )
    assert again.returncode == 2 and "carry-state" in again.stderr
