"""Preference training through the trainer (``--train-mode dpo`` / ``orpo``): on a synthetic
set whose chosen answer differs from the rejected one in one property (upper case after
"loud", lower case after "soft"), held-out preference accuracy goes from about half to at
least 90% while the chosen answers' NLL does not rise by more than half a nat; the reference
is each mode's starting model (DPO's first loss is ln 2 in every mode, and on an INT8 base);
the outputs are adapters as SFT's; a run resumes; what does not go with it is one line."""

from __future__ import annotations

import json
import math

import mlx_rwkvx
from mlx_rwkvx.errors import TrainError
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.preference import load_pairs, pair_logprobs

import mlx.core as mx
import numpy as np
import pytest

NLL_RISE = 0.5  # nats: the chosen answers' mean token NLL may rise at most this (DPO's failure)


def _record(rng) -> dict:
    # prompts of one length: the batch needs no padding (the attention blocks' fast path)
    word = "".join(rng.choice(list("abcdefghij"), size=4))
    loud = bool(rng.integers(2))
    up, low = word.upper(), word
    return {
        "prompt": f"{'loud' if loud else 'soft'} {word}",
        "chosen": up if loud else low,
        "rejected": low if loud else up,
    }


@pytest.fixture(scope="module")
def ws(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo")
    # RWKV-X: its attention finds the cue word in a few steps (a 2-block RWKV-7 does not)
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")  # the byte tokenizer
    rng = np.random.default_rng(0)
    for folder, sizes in (("data", (64, 48)), ("few", (8, 0))):  # few: for one-step runs
        (root / folder).mkdir()
        for split, n in zip(("train", "valid"), sizes, strict=True):
            if n:
                lines = [json.dumps(_record(rng)) for _ in range(n)]
                (root / folder / f"{split}.jsonl").write_text("\n".join(lines) + "\n")
    (root / "chat").mkdir()  # multi-turn conversations: the prompt and the answers
    lines = [json.dumps(_conversation(_record(rng))) for _ in range(8)]
    (root / "chat" / "train.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _conversation(record: dict) -> dict:
    """``record`` as TRL's conversational format, several turns on each side: the prompt a
    user, assistant, user exchange; each answer an assistant turn, a user turn, an assistant
    turn (the user turn between them not trained)."""
    word = record["prompt"].split()[1]

    def answer(text):
        return [
            {"role": "assistant", "content": text},
            {"role": "user", "content": "again"},
            {"role": "assistant", "content": text},
        ]

    return {
        "system": "You answer in one word.",
        "prompt": [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": record["prompt"]},
        ],
        "chosen": answer(record["chosen"]),
        "rejected": answer(word[::-1]),
    }


def _cfg(ws, out, **kw) -> TrainConfig:
    fields = dict(
        model=str(ws / "base"),
        data=str(ws / "data"),
        output=str(out),
        train_mode="dpo",
        batch_size=8,
        lr=1e-2,
        warmup=2,
        iters=20,
        log_every=5,
        save_every=10,
        lora_rank=4,
        lora_alpha=8,
    )
    fields.update(kw)
    if fields.get("mode") in ("state", "full", "miss"):
        fields.pop("lora_alpha")
        if fields["mode"] != "miss":
            fields.pop("lora_rank")
    return TrainConfig(**fields)


def _metrics(out) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _held_out(model, tok, ws) -> tuple[float, float]:
    """(the share of held-out pairs whose chosen answer is the likelier, the chosen answers'
    mean token NLL)."""
    pairs = load_pairs(str(ws / "data" / "valid.jsonl"), tok)
    chosen, rejected, count, _ = pair_logprobs(model, pairs)
    return mx.mean(chosen > rejected).item(), (-mx.sum(chosen) / mx.sum(count)).item()


# ORPO has no reference to take the base's own preferences off: it needs more steps and a
# stronger odds-ratio term (lambda 1) on this set than DPO does
RUNS = {"dpo": dict(iters=40), "orpo": dict(iters=100, beta=1.0, save_every=50)}


@pytest.mark.parametrize(
    "train_mode",
    ["dpo", pytest.param("orpo", marks=pytest.mark.slow)],  # orpo: 14 s
)
def test_preference_accuracy_rises_on_held_out_pairs(ws, tmp_path, train_mode):
    base, tok = mlx_rwkvx.load(ws / "base")
    before, nll_before = _held_out(base, tok, ws)
    assert 0.25 <= before <= 0.75, before  # the base has no preference: about half
    out = train_from_config(
        _cfg(ws, tmp_path / train_mode, train_mode=train_mode, val_every=10, **RUNS[train_mode])
    )
    model, _ = mlx_rwkvx.load(ws / "base", adapter=out)
    after, nll_after = _held_out(model, tok, ws)
    assert after >= 0.9, (before, after)
    assert nll_after <= nll_before + NLL_RISE, (nll_before, nll_after)
    rows = _metrics(out)
    assert {"loss", "accuracy", "margin", "chosen_reward", "rejected_reward", "chosen_nll"} <= set(
        rows[0]
    )
    assert rows[-1]["val_accuracy"] >= 0.9 and "val_margin" in rows[-1]
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora"
    last = RUNS[train_mode]["iters"]
    assert (out / "adapter_final.safetensors").exists()
    assert (out / f"checkpoint_{last}.json").exists()


@pytest.mark.parametrize("mode", ["lora", "dora", "pissa", "miss", "state", "full"])
def test_dpo_starts_at_ln_2_in_every_mode(ws, tmp_path, mode):
    """The reference is the model as it starts: the first step's loss is -log sigmoid(0)."""
    cfg = _cfg(ws, tmp_path / mode, mode=mode, iters=1, lr=1e-3, data=str(ws / "few"))
    out = train_from_config(cfg)
    first = _metrics(out)[0]
    assert math.isclose(first["loss"], math.log(2), rel_tol=1e-5), first
    # the policy's batches are not the reference's (another order): their sums agree to float32
    # rounding (~1e-7 of some 30 nats, times beta), not bit for bit, so a tie's side (accuracy)
    # is rounding's, not asserted
    assert abs(first["margin"]) <= 1e-5, first


def test_dpo_on_multi_turn_conversations(ws, tmp_path):
    """Conversational pairs of several turns a side: the trainer's first step is the reference
    (ln 2), and its chosen-answer NLL is the one of the assistant turns alone."""
    base, tok = mlx_rwkvx.load(ws / "base")
    pairs = load_pairs(str(ws / "chat" / "train.jsonl"), tok)
    for p in pairs:  # trained, not trained (the user's "again"), trained
        edges = np.flatnonzero(np.diff(p.chosen_trained.astype(int)))
        assert len(edges) == 2 and p.chosen_trained[0] and p.chosen_trained[-1], p.chosen_trained
    chosen, _, count, _ = pair_logprobs(base, pairs)
    nll = mx.mean(-chosen / count).item()
    out = train_from_config(_cfg(ws, tmp_path / "chat", data=str(ws / "chat"), iters=2))
    first, second = _metrics(out)[:2]
    assert math.isclose(first["loss"], math.log(2), rel_tol=1e-5), first
    assert math.isclose(first["chosen_nll"], nll, rel_tol=1e-5), (first, nll)
    assert second["loss"] < first["loss"]


def test_a_resumed_orpo_run_ends_where_the_whole_run_did(ws, tmp_path):
    kw = dict(train_mode="orpo", iters=8, save_every=4)  # ORPO through the trainer, briefly
    whole = train_from_config(_cfg(ws, tmp_path / "whole", **kw))
    out = train_from_config(_cfg(ws, tmp_path / "cut", **kw))
    for name in (
        "checkpoint_8.safetensors",
        "checkpoint_8.state.safetensors",
        "checkpoint_8.json",
        "adapter_final.safetensors",
    ):
        (out / name).unlink()
    again = train_from_config(_cfg(ws, out, resume=True, **kw))
    want = {r["step"]: r["loss"] for r in _metrics(whole) if "loss" in r}
    got = {r["step"]: r["loss"] for r in _metrics(again) if "loss" in r}
    assert math.isclose(got[8], want[8], rel_tol=1e-5), (got, want)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(parallel=2), "not with --parallel"),
        (dict(carry_state=True), "not with --carry-state"),
        (dict(train_mode="sft", beta=0.5), "--beta and --dpo-loss apply to"),
        (dict(train_mode="orpo", dpo_loss="ipo"), "--dpo-loss applies to --train-mode dpo"),
        (dict(beta=0.0), "--beta must be positive"),
    ],
)
def test_what_does_not_go_with_it_is_one_line(ws, tmp_path, change, message):
    with pytest.raises(TrainError, match=message):
        train_from_config(_cfg(ws, tmp_path / "x", **change))


def test_sft_data_for_dpo_names_the_line(ws, tmp_path):
    (tmp_path / "sft").mkdir()
    (tmp_path / "sft" / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(TrainError, match=r"train.jsonl:1: not a preference record"):
        train_from_config(_cfg(ws, tmp_path / "x", data=str(tmp_path / "sft")))


def test_dpo_on_an_int8_base(ws, tmp_path):
    """--quantize: the reference and the policy on the INT8 base (no float copy)."""
    cfg = _cfg(ws, tmp_path / "q", quantize="int8", iters=2, data=str(ws / "few"))
    out = train_from_config(cfg)
    first = _metrics(out)[0]
    assert math.isclose(first["loss"], math.log(2), rel_tol=1e-5), first
    model, _ = mlx_rwkvx.load(ws / "base", adapter=out, quantize="int8")
    assert model.quantization is not None
