"""Preference data and losses (``tuner/preference.py``): records as TRL reads them become
pairs sharing the prompt's tokens; ``pair_logprobs`` (the prompt prefilled once, its state
branched) equals each answer's log-probability computed alone through the trainer's one
definition of the loss, in value and gradient, for each family; the losses equal a NumPy
reference from the same log-probabilities, IPO's against the paper's loss on per-token
log-probabilities (``tests/oracle/preference.py``)."""

from __future__ import annotations

import json

from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.data.examples import IGNORE_INDEX, load_examples
from mlx_rwkvx.data.loss import batch_loss
from mlx_rwkvx.errors import DataError
from mlx_rwkvx.io.tokenizers import ByteTokenizer
from mlx_rwkvx.tuner.preference import (
    dpo_loss,
    load_pairs,
    pair_logprobs,
    pair_of,
    preference_loss,
)

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import chatml_tokenizer, tiny_model
from mlx.utils import tree_flatten
from oracle.lm import log_softmax_np
from oracle.preference import ipo_loss_np

RECORDS = [
    {"prompt": "2+2=", "chosen": "4", "rejected": "5"},
    {"prompt": "Name a colour.", "chosen": "Blue, like the sky.", "rejected": "Seven"},
    {
        "prompt": [{"role": "user", "content": "Hi"}],
        "system": "Be brief.",
        "chosen": [{"role": "assistant", "content": "Hello."}],
        "rejected": [{"role": "assistant", "content": "What do you want from me now?"}],
    },
]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return chatml_tokenizer(tmp_path_factory.mktemp("tok"))


def _alone(model, pair, side: str) -> mx.array:
    """The answer's summed log-probability through the trainer's loss on the whole text."""
    answer, trained = getattr(pair, side), getattr(pair, f"{side}_trained")
    tokens = np.concatenate([pair.prompt, answer])
    targets = np.concatenate(
        [np.full(len(pair.prompt), IGNORE_INDEX), np.where(trained, answer, IGNORE_INDEX)]
    )
    loss, _ = batch_loss(model, mx.array(tokens[None, :-1]), mx.array(targets[None, 1:]))
    return -loss


def test_records_become_pairs_sharing_the_prompt(tok, tmp_path):
    pairs = [pair_of(tok, r) for r in RECORDS]
    for pair, record in zip(pairs, RECORDS, strict=True):
        text = tok.decode(pair.prompt.tolist())
        assert text.endswith("assistant\n")  # through the generation prompt
        chosen = record["chosen"] if isinstance(record["chosen"], str) else "Hello."
        assert tok.decode(pair.chosen[pair.chosen_trained].tolist()).startswith(chosen)
    assert "Be brief." in tok.decode(pairs[2].prompt.tolist())
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    assert len(load_pairs(str(path), tok)) == 3
    # an SFT run on it says what it holds; a bad record is one error naming its line
    with pytest.raises(DataError, match="preference record"):
        load_examples(str(path), tok)
    path.write_text(json.dumps(RECORDS[0]) + "\n" + json.dumps({**RECORDS[0], "chosen": 3}))
    with pytest.raises(DataError, match=r"train.jsonl:2: 'chosen' must be a string"):
        load_pairs(str(path), tok)


@pytest.mark.parametrize("family", ["rwkv7", "rwkv-x", "rfa"])
def test_pair_logprobs_equal_each_answer_alone(tok, family):
    model = tiny_model(family, seed=3, vocab_size=512)
    apply_lora(model, target_paths(model, "all"), rank=2, alpha=4.0)
    for _, m in model.named_modules():  # a LoRA that counts
        if "lora_b" in m:
            m["lora_b"] = 0.1 * mx.random.normal(m["lora_b"].shape, key=mx.random.key(1))
    pairs = [pair_of(tok, r) for r in RECORDS]  # prompts of different lengths: left padding
    chosen, rejected, nc, nr = pair_logprobs(model, pairs)
    want_c = mx.stack([_alone(model, p, "chosen") for p in pairs])
    want_r = mx.stack([_alone(model, p, "rejected") for p in pairs])
    assert np.allclose(np.array(chosen), np.array(want_c), rtol=1e-5, atol=1e-5)
    assert np.allclose(np.array(rejected), np.array(want_r), rtol=1e-5, atol=1e-5)
    assert np.array_equal(np.array(nc), [p.chosen_trained.sum() for p in pairs])
    # the gradient through the shared prompt's branched state is the sum of the alone ones'

    def shared(_):
        c, r, _, _ = pair_logprobs(model, pairs)
        return (c - 0.5 * r).sum()

    def alone(_):
        return sum(_alone(model, p, "chosen") - 0.5 * _alone(model, p, "rejected") for p in pairs)

    params = model.trainable_parameters()
    got = dict(tree_flatten(nn.value_and_grad(model, shared)(params)[1]))
    want = dict(tree_flatten(nn.value_and_grad(model, alone)(params)[1]))
    for name, g in want.items():
        assert np.allclose(np.array(got[name]), np.array(g), rtol=1e-4, atol=1e-5), name


def _np_terms(mode, pc, pr, rc, rr, cc, cr, beta, kind, lam):
    log_sigmoid = lambda x: -np.logaddexp(0, -x)  # noqa: E731
    if mode == "dpo":
        if kind == "ipo":  # IPO on the log-probabilities averaged over each answer's tokens
            pc, rc, pr, rr = pc / cc, rc / cc, pr / cr, rr / cr
        h = (pc - rc) - (pr - rr)
        losses = {
            "sigmoid": -log_sigmoid(beta * h),
            "ipo": (h - 1 / (2 * beta)) ** 2,
            "hinge": np.maximum(0, 1 - beta * h),
        }[kind]
        return losses, beta * (pc - rc), beta * (pr - rr)
    mc, mr = pc / cc, pr / cr
    odds = lambda m: m - np.log1p(-np.exp(m))  # noqa: E731
    losses = -mc - lam * log_sigmoid(odds(mc) - odds(mr))
    return losses, lam * odds(mc), lam * odds(mr)


@pytest.mark.parametrize(
    ("mode", "kind"), [("dpo", "sigmoid"), ("dpo", "ipo"), ("dpo", "hinge"), ("orpo", None)]
)
def test_losses_equal_a_numpy_reference(mode, kind):
    rng = np.random.default_rng(0)
    counts = rng.integers(1, 20, size=(2, 6)).astype(np.float64)
    pc, pr = -rng.uniform(0.5, 3, size=(2, 6)) * counts
    rc, rr = pc + rng.normal(0, 1, 6), pr + rng.normal(0, 1, 6)
    as_mx = [mx.array(x, dtype=mx.float32) for x in (pc, pr, counts[0], counts[1])]
    reference = [mx.array(x, dtype=mx.float32) for x in (rc, rr)]
    terms = preference_loss(mode, as_mx, reference, beta=0.2, kind=kind or "sigmoid", lam=0.3)
    losses, rew_c, rew_r = _np_terms(mode, pc, pr, rc, rr, counts[0], counts[1], 0.2, kind, 0.3)
    assert np.isclose(terms.loss.item(), losses.sum(), rtol=1e-5)
    assert np.isclose(terms.chosen_reward.item(), rew_c.sum(), rtol=1e-5, atol=1e-5)
    assert np.isclose(terms.rejected_reward.item(), rew_r.sum(), rtol=1e-5, atol=1e-5)
    assert terms.correct.item() == int((rew_c > rew_r).sum())
    assert np.isclose(terms.chosen_nll.item(), (-pc / counts[0]).sum(), rtol=1e-5)


def _random_answers(rng, lengths) -> list[np.ndarray]:
    return [-rng.uniform(0.05, 4.0, size=n) for n in lengths]


def _sums_counts(side: list[np.ndarray]) -> tuple[mx.array, mx.array]:
    sums = mx.array([t.sum() for t in side], dtype=mx.float32)
    return sums, mx.array([len(t) for t in side], dtype=mx.float32)


def _ipo(pc, pr, rc, rr, beta: float) -> tuple[np.ndarray, float]:
    """``dpo_loss(kind="ipo")`` of each pair and ``preference_loss``'s total, from each
    answer's per-token log-probabilities as ``pair_logprobs`` gives them: sums and counts."""
    (spc, cc), (spr, cr) = _sums_counts(pc), _sums_counts(pr)
    src, srr = _sums_counts(rc)[0], _sums_counts(rr)[0]
    losses, _, _ = dpo_loss(spc, spr, src, srr, beta=beta, kind="ipo", count_c=cc, count_r=cr)
    terms = preference_loss("dpo", (spc, spr, cc, cr), (src, srr), beta=beta, kind="ipo")
    return np.array(losses), terms.loss.item()


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_ipo_equals_the_papers_loss_on_averaged_logprobs(beta):
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 60, size=(2, 8))  # answers of different lengths, 1 token up
    pc, pr = _random_answers(rng, lengths[0]), _random_answers(rng, lengths[1])
    rc = [t + rng.normal(0, 0.3, len(t)) for t in pc]
    rr = [t + rng.normal(0, 0.3, len(t)) for t in pr]
    want = ipo_loss_np(pc, pr, rc, rr, beta)
    losses, total = _ipo(pc, pr, rc, rr, beta)
    assert np.allclose(losses, want, rtol=1e-5, atol=1e-6)
    assert np.isclose(total, want.sum(), rtol=1e-5)
    # an answer twice as long with the same per-token log-probabilities: the same loss
    twice = [np.tile(t, 2) for t in pc]
    doubled, _ = _ipo(twice, pr, [np.tile(t, 2) for t in rc], rr, beta)
    assert np.allclose(doubled, losses, rtol=1e-5, atol=1e-6)


def test_ipo_of_a_model_equals_the_papers_loss(tok):
    """The preference step's IPO loss, ``pair_logprobs`` of a policy and of a reference model,
    equals the oracle's on per-token log-probabilities read from each model's float64
    log-softmax of the whole text."""
    policy, reference = (
        tiny_model("rwkv7", seed=3, vocab_size=512),
        tiny_model("rwkv7", seed=4, vocab_size=512),
    )
    pairs = [pair_of(tok, r) for r in RECORDS]  # answers of different lengths

    def per_token(model, side):
        out = []
        for p in pairs:
            answer, trained = getattr(p, side), getattr(p, f"{side}_trained")
            tokens = np.concatenate([p.prompt, answer])
            logp = log_softmax_np(np.array(model(mx.array(tokens[None])), dtype=np.float64)[0])
            at = np.arange(len(p.prompt), len(tokens))[trained]  # the trained answer tokens
            out.append(logp[at - 1, tokens[at]])
        return out

    want = ipo_loss_np(
        *(per_token(m, s) for m in (policy, reference) for s in ("chosen", "rejected")), 0.1
    )
    # the reference's log-probabilities travel as the trainer keeps them: summed, float32
    ref_c, ref_r, _, _ = pair_logprobs(reference, pairs)
    terms = preference_loss(
        "dpo", pair_logprobs(policy, pairs), (ref_c, ref_r), beta=0.1, kind="ipo"
    )
    assert np.isclose(terms.loss.item(), want.sum(), rtol=1e-4)


def test_dpo_starts_at_ln_2_where_the_policy_is_the_reference(tok):
    model = tiny_model("rwkv7", seed=3, vocab_size=512)
    apply_lora(model, target_paths(model, "all"), rank=2, alpha=4.0)  # B = 0: the base
    pairs = [pair_of(tok, r) for r in RECORDS]
    policy = pair_logprobs(model, pairs)
    terms = preference_loss("dpo", policy, policy[:2], beta=0.1)
    assert np.isclose(terms.loss.item() / len(pairs), np.log(2), rtol=1e-6)


@pytest.mark.parametrize(
    ("record", "message"),
    [
        (
            {"prompt": "a", "chosen": "b"},
            r"expected the fields of one format \(.*'prompt', "
            r"'chosen' and 'rejected'\); the keys are \['chosen', 'prompt'\]",
        ),
        (
            {"prompt": [], "chosen": "b", "rejected": "c"},
            "'prompt' must be a string or a non-empty list of messages",
        ),
        (
            {"prompt": "a", "chosen": [{"role": "user", "content": "b"}], "rejected": "c"},
            "'chosen' must end with an assistant message",
        ),
        (
            {"prompt": "a", "chosen": "b", "rejected": "c", "system": 1},
            "'system' must be a string, got int",
        ),
    ],
)
def test_a_bad_record_is_one_error_naming_its_line(tok, tmp_path, record, message):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(DataError, match=r"train.jsonl:1: " + message):
        load_pairs(str(path), tok)


def test_a_multi_turn_pair_scores_the_answers_turns_alone(tok):
    """The prompt's own assistant turns are context (not trained); the answers' assistant
    turns are, the user turn between them is not."""
    record = {
        "prompt": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there."},
            {"role": "user", "content": "2+2?"},
        ],
        "chosen": [
            {"role": "assistant", "content": "4"},
            {"role": "user", "content": "Sure?"},
            {"role": "assistant", "content": "Yes, 4."},
        ],
        "rejected": "5",
    }
    pair = pair_of(tok, record)
    assert tok.decode(pair.prompt.tolist()).endswith("2+2?<|im_end|>\n<|im_start|>assistant\n")
    trained = tok.decode(pair.chosen[pair.chosen_trained].tolist())
    assert trained.startswith("4<|im_end|>") and "Yes, 4.<|im_end|>" in trained
    assert "Sure?" not in trained and "Sure?" in tok.decode(pair.chosen.tolist())
    assert tok.decode(pair.rejected[pair.rejected_trained].tolist()).startswith("5")


def test_a_byte_tokenizer_pair():
    pair = pair_of(ByteTokenizer(), {"prompt": "1+1=", "chosen": "2", "rejected": "3"})
    assert pair.chosen_trained.any() and pair.rejected_trained.any()
