"""Preference training's data and losses: DPO (sigmoid, IPO, hinge) and ORPO.

A preference record is a JSONL line ``{"prompt", "chosen", "rejected"}`` as TRL and
mlx-lm-lora read them: strings (the prompt a user turn, the answers assistant turns), or
conversational (``"prompt"`` a list of messages, ``"chosen"`` / ``"rejected"`` the assistant
turns as lists of messages); a ``"system"`` field becomes the first message. The chat template
renders them as SFT's ``messages`` are rendered (``data.chat.chat_tokens``): a ``Pair`` holds
the prompt's tokens through the generation prompt, shared by both answers, and each answer's
tokens with the ones the loss counts (its assistant turns; the prompt's own assistant turns are
context).

``pair_logprobs``: the summed log-probabilities of the chosen and the rejected answers of a
batch of pairs, the prompt prefilled once and its state branched (RWKV's state is the whole
past: both answers continue from it). ``preference_loss``: DPO's losses against a reference
and ORPO's, with the rewards, margins and accuracy the trainer logs. Each loss takes the
log-probabilities its paper defines it on: DPO's sigmoid and hinge the answers' summed ones,
IPO the ones averaged over each answer's trained tokens, ORPO the mean token probability.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_rwkvx.data.chat import chat_tokens, check_messages
from mlx_rwkvx.data.examples import IGNORE_INDEX
from mlx_rwkvx.data.loss import token_loss
from mlx_rwkvx.data.records import BadRecord, jsonl_records
from mlx_rwkvx.errors import DataError
from mlx_rwkvx.models import Model

import mlx.core as mx
import mlx.nn as nn
import numpy as np

LOSSES = ("sigmoid", "ipo", "hinge")  # DPO's variants


@dataclass(eq=False)
class Pair:
    """One preference: ``prompt`` int32 [p] (through the generation prompt), each answer's
    tokens int32 and the ones trained (bool, its assistant turns)."""

    prompt: np.ndarray
    chosen: np.ndarray
    chosen_trained: np.ndarray
    rejected: np.ndarray
    rejected_trained: np.ndarray
    source: str = ""


def _turns(value, name: str) -> list[dict]:
    if isinstance(value, str):
        return [{"role": "assistant", "content": value}]
    if isinstance(value, list) and value and all(isinstance(m, dict) for m in value):
        if value[-1].get("role") != "assistant":
            raise BadRecord(f"'{name}' must end with an assistant message")
        return value
    raise BadRecord(f"'{name}' must be a string or a list of messages, got {type(value).__name__}")


def pair_of(tokenizer, record: dict, source: str = "") -> Pair:
    """The ``Pair`` of one preference record (``BadRecord`` for a record that is not one)."""
    if not isinstance(record, dict) or not all(
        k in record for k in ("prompt", "chosen", "rejected")
    ):
        raise BadRecord("expected 'prompt', 'chosen' and 'rejected' fields")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    else:
        if not isinstance(prompt, list) or not prompt:
            raise BadRecord("'prompt' must be a string or a non-empty list of messages")
        check_messages(prompt)
        messages = list(prompt)
    system = record.get("system")
    if system is not None:
        if not isinstance(system, str):
            raise BadRecord(f"'system' must be a string, got {type(system).__name__}")
        if messages[0].get("role") == "system":
            raise BadRecord("a 'system' field and a system message in the prompt: give one")
        messages = [{"role": "system", "content": system}, *messages]
    sides = []
    for name in ("chosen", "rejected"):
        # the prompt's own assistant turns are context: only the answer's are scored
        tokens, trained = chat_tokens(
            tokenizer, messages + _turns(record[name], name), None, first=len(messages)
        )
        start = int(np.argmax(trained))
        end = len(trained) - int(np.argmax(trained[::-1]))  # after the last trained token
        sides.append((tokens, start, end, trained))
    (tc, sc, ec, mc), (tr, sr, er, mr) = sides
    if sc != sr or not np.array_equal(tc[:sc], tr[:sr]):
        raise BadRecord("the chosen and rejected conversations do not share the prompt's tokens")
    return Pair(
        tc[:sc].astype(np.int32),
        tc[sc:ec].astype(np.int32),
        mc[sc:ec],
        tr[sr:er].astype(np.int32),
        mr[sr:er],
        source,
    )


def load_pairs(
    path: str, tokenizer, *, max_seq_len: int | None = None, vocab_size: int | None = None
) -> list[Pair]:
    """The pairs of a preference ``.jsonl`` (one DataError naming the line for a bad one);
    ``max_seq_len``: the prompt and the longer answer together, at most."""
    vocab = vocab_size or getattr(tokenizer, "vocab_size", None)
    pairs = []
    for where, fmt, record, _ in jsonl_records(path):
        try:
            if isinstance(record, BadRecord):
                raise record
            if fmt != "preference":
                raise BadRecord("not a preference record ('prompt', 'chosen', 'rejected')")
            pair = pair_of(tokenizer, record, where)
        except BadRecord as e:
            raise DataError(f"{where}: {e.args[0]}") from None
        longest = len(pair.prompt) + max(len(pair.chosen), len(pair.rejected))
        if max_seq_len is not None and longest > max_seq_len + 1:
            raise DataError(f"{where}: {longest} tokens, over max_seq_len {max_seq_len} (+1)")
        ids = np.concatenate([pair.prompt, pair.chosen, pair.rejected])
        if vocab is not None and (ids.max() >= vocab or ids.min() < 0):
            raise DataError(f"{where}: a token id beyond the vocabulary of {vocab}")
        pairs.append(pair)
    if not pairs:
        raise DataError(f"{path}: no preference pairs")
    return pairs


# ----- log-probabilities -----------------------------------------------------------------------


def _left_padded(rows: list[np.ndarray]) -> tuple[mx.array, mx.array]:
    T = max(len(r) for r in rows)
    tokens = np.zeros((len(rows), T), dtype=np.int32)
    valid = np.zeros((len(rows), T), dtype=bool)
    for i, r in enumerate(rows):
        tokens[i, T - len(r) :] = r
        valid[i, T - len(r) :] = True
    return mx.array(tokens), mx.array(valid)


def _answers(pairs: list[Pair]) -> tuple[mx.array, mx.array]:
    """The answers right-padded, chosen rows then rejected rows: (inputs, targets) where the
    target of position t is the answer's token t (predicted from the prompt's end for t = 0,
    from the answer's token t - 1 after), IGNORE_INDEX where untrained or padding."""
    answers = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    trained = [p.chosen_trained for p in pairs] + [p.rejected_trained for p in pairs]
    T = max(len(a) for a in answers)
    inputs = np.zeros((len(answers), T), dtype=np.int32)
    targets = np.full((len(answers), T), IGNORE_INDEX, dtype=np.int32)
    for i, (a, m) in enumerate(zip(answers, trained, strict=True)):
        inputs[i, : len(a)] = a
        targets[i, : len(a)] = np.where(m, a, IGNORE_INDEX)
    return mx.array(inputs), mx.array(targets)


def _branched(state: list[dict]) -> list[dict]:
    """The prompt's state for each answer: the rows twice (chosen, then rejected)."""
    out = []
    for s in state:
        t = {k: mx.concatenate([v, v], axis=0) for k, v in s.items() if k != "lengths"}
        if "lengths" in s:
            t["lengths"] = s["lengths"] * 2
        out.append(t)
    return out


def pair_logprobs(model: Model, pairs: list[Pair], checkpoint: bool = False):
    """(chosen ``[B]``, rejected ``[B]``: each answer's summed log-probability of its trained
    tokens; their counts ``[B]`` each) for a batch of pairs. The prompts (left-padded: the
    padding leaves the state as it was) are prefilled once; each answer continues from its
    prompt's state and last hidden state."""
    B = len(pairs)
    prompts, valid = _left_padded([p.prompt for p in pairs])
    if len({len(p.prompt) for p in pairs}) == 1:
        valid = None  # no padding: the attention blocks take the rows at once
    h_prompt, state = model.hidden(prompts, None, checkpoint=checkpoint, valid=valid)
    inputs, targets = _answers(pairs)
    h, _ = model.hidden(inputs, _branched(state), checkpoint=checkpoint)
    last = mx.concatenate([h_prompt[:, -1:], h_prompt[:, -1:]], axis=0)  # [2B, 1, C]
    h = mx.concatenate([last, h[:, :-1]], axis=1)  # position t predicts answer token t
    sums, counts = [], []
    for i in range(2 * B):  # one row at a time: the fused head + loss sums over its tokens
        loss, n = token_loss(model, h[i], targets[i])
        sums.append(-loss)
        counts.append(n)
    logps, counts = mx.stack(sums), mx.stack(counts).astype(mx.float32)
    return logps[:B], logps[B:], counts[:B], counts[B:]


# ----- losses ----------------------------------------------------------------------------------


@dataclass
class PreferenceTerms:
    """A batch's summed loss and what the trainer logs of it (sums over the pairs: divide by
    the pairs for means)."""

    loss: mx.array
    chosen_reward: mx.array
    rejected_reward: mx.array
    correct: mx.array  # pairs whose chosen reward is above the rejected one's
    chosen_nll: mx.array  # the chosen answers' mean token NLL, summed over pairs


def dpo_loss(
    policy_c,
    policy_r,
    ref_c,
    ref_r,
    *,
    beta: float,
    kind: str = "sigmoid",
    count_c=None,
    count_r=None,
):
    """DPO's loss of each pair and the rewards ``β (π - ρ)``, with
    ``h = (π_c - ρ_c) - (π_r - ρ_r)``: ``sigmoid`` (the DPO paper's ``-log σ(β h)``) and
    ``hinge`` (``max(0, 1 - β h)``) on the answers' summed log-probabilities, ``ipo``
    (``(h - 1/(2β))²``, Azar et al. 2023, eq. 17) on the log-probabilities averaged over each
    answer's trained tokens (``count_c``, ``count_r``, policy and reference alike), as TRL
    does "confirmed with the IPO authors": the summed ones would make the target ``1/(2β)``
    a per-answer one and the loss grow with the answers' length. IPO's rewards come from the
    averaged log-probabilities too: the margin logged is ``β h``, the one the loss pulls to
    one half."""
    if kind == "ipo":
        if count_c is None or count_r is None:
            raise ValueError("the ipo loss needs each answer's count of trained tokens")
        count_c, count_r = mx.maximum(count_c, 1), mx.maximum(count_r, 1)
        policy_c, ref_c = policy_c / count_c, ref_c / count_c
        policy_r, ref_r = policy_r / count_r, ref_r / count_r
    h = (policy_c - ref_c) - (policy_r - ref_r)
    if kind == "sigmoid":
        losses = -nn.log_sigmoid(beta * h)
    elif kind == "ipo":
        losses = mx.square(h - 1 / (2 * beta))
    elif kind == "hinge":
        losses = nn.relu(1 - beta * h)
    else:
        raise ValueError(f"dpo loss must be one of {LOSSES}, got {kind!r}")
    return losses, beta * (policy_c - ref_c), beta * (policy_r - ref_r)


def orpo_loss(policy_c, policy_r, count_c, count_r, *, lam: float):
    """ORPO's loss of each pair: the chosen answer's mean token NLL plus ``λ`` times
    ``-log σ(log odds(chosen) - log odds(rejected))``, odds of the mean token probability
    ``p``: ``log(p / (1 - p))``; the rewards are ``λ`` times each answer's log odds."""
    mean_c = policy_c / mx.maximum(count_c, 1)
    mean_r = policy_r / mx.maximum(count_r, 1)

    def log_odds(mean):  # log p - log(1 - p), p = exp(mean) < 1
        return mean - mx.log(-mx.expm1(mx.minimum(mean, -1e-7)))

    ratio = log_odds(mean_c) - log_odds(mean_r)
    losses = -mean_c - lam * nn.log_sigmoid(ratio)
    return losses, lam * log_odds(mean_c), lam * log_odds(mean_r)


def preference_loss(
    mode: str, policy, reference=None, *, beta: float = 0.1, kind: str = "sigmoid", lam: float = 0.1
) -> PreferenceTerms:
    """``mode`` ``"dpo"`` (with ``reference``: the chosen and rejected of ``pair_logprobs`` of
    the reference model, on the same pairs) or ``"orpo"`` (no reference) of ``policy``
    (``pair_logprobs`` of the trained model, whose token counts IPO and ORPO average by)."""
    pc, pr, cc, cr = policy
    if mode == "dpo":
        if reference is None:
            raise ValueError("dpo needs the reference model's log-probabilities")
        losses, rc, rr = dpo_loss(
            pc, pr, reference[0], reference[1], beta=beta, kind=kind, count_c=cc, count_r=cr
        )  # the reference's counts are the policy's
    elif mode == "orpo":
        losses, rc, rr = orpo_loss(pc, pr, cc, cr, lam=lam)
    else:
        raise ValueError(f"preference mode must be dpo or orpo, got {mode!r}")
    nll = -pc / mx.maximum(cc, 1)
    return PreferenceTerms(losses.sum(), rc.sum(), rr.sum(), (rc > rr).sum(), nll.sum())
