"""What the parity tests share: importing the ``parity`` extra (a skip, or under CI a failure)
and random checkpoints laid out as the references' own training scripts save them."""

from __future__ import annotations

import importlib
import os
import warnings

import numpy as np
import pytest

CI_FLAG = "MLX_RWKVX_CI"
# the rwkv package is written with torch.jit.script, which torch now calls deprecated
JIT_DEPRECATED = "`torch.jit.script"
# BlinkDL's low ranks of w, a, v, g: they differ from one another so that a swapped projection
# cannot load
RANKS = {"w": 16, "a": 8, "v": 12, "g": 24}


def import_parity_extra(names: tuple[str, ...], extra: str = "parity") -> list:
    """The modules of an extra (``parity``, ``eval``). Without them: one skip line, or under
    CI a failure."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", JIT_DEPRECATED, DeprecationWarning)
            return [importlib.import_module(name) for name in names]
    except ImportError as e:
        missing = f"the {extra} extra is not installed ({e})"
    if os.environ.get(CI_FLAG) == "1":
        pytest.fail(f"{CI_FLAG}=1 but {missing}: .ci/run installs it first", pytrace=False)
    pytest.skip(f"{missing}: pip install -e '.[{extra}]'", allow_module_level=True)


def blinkdl_state(
    seed: int,
    layer0_v: bool,
    *,
    vocab: int = 256,
    width: int = 64,
    head: int = 16,
    layers: int = 3,
) -> dict[str, np.ndarray]:
    """A random RWKV-7 in BlinkDL's names and shapes, as its x070 train script saves it. Every
    tensor is non-zero; lerps lie in (0, 1); w0 in (-4, 2) spreads the per-step decays
    exp(-e^-0.5 sigmoid(w0 + ...)) from about 0.59 to 0.99. ``layer0_v``: layer 0 also has
    v0/v1/v2 (never used there)."""
    rng = np.random.default_rng(seed)
    C = width

    def normal(*shape, std=1.0, mean=0.0):
        return (mean + std * rng.standard_normal(shape)).astype(np.float32)

    def uniform(*shape, low=0.0, high=1.0):
        return rng.uniform(low, high, shape).astype(np.float32)

    def proj(rows, cols):  # a Linear weight [out, in]
        return normal(rows, cols, std=cols**-0.5)

    def layer_norm(prefix, low=0.9, high=1.1):
        s[prefix + ".weight"] = uniform(C, low=low, high=high)
        s[prefix + ".bias"] = normal(C, std=0.1)

    s = {"emb.weight": normal(vocab, C)}
    layer_norm("blocks.0.ln0")
    for i in range(layers):
        block, att = f"blocks.{i}", f"blocks.{i}.att."
        layer_norm(f"{block}.ln1")
        layer_norm(f"{block}.ln2")
        for x in ("x_r", "x_w", "x_k", "x_v", "x_a", "x_g"):
            s[att + x] = uniform(1, 1, C)
        s[att + "w0"] = uniform(1, 1, C, low=-4.0, high=2.0)
        s[att + "a0"] = uniform(1, 1, C, low=-1.0, high=1.0)
        for p, rank in RANKS.items():
            if p == "v" and i == 0 and not layer0_v:
                continue
            if p == "v":
                s[att + "v0"] = normal(1, 1, C, mean=1.0, std=0.2)
            s[f"{att}{p}1"] = normal(C, rank, std=C**-0.5)  # [C, D]: x @ w1
            s[f"{att}{p}2"] = normal(rank, C, std=rank**-0.5 * (0.5 if p == "w" else 1.0))
        s[att + "k_k"] = normal(1, 1, C, mean=0.85, std=0.1)
        s[att + "k_a"] = normal(1, 1, C, mean=1.0, std=0.2)
        s[att + "r_k"] = normal(C // head, head, std=0.3)
        for name in ("receptance", "key", "value", "output"):
            s[f"{att}{name}.weight"] = proj(C, C)
        layer_norm(att + "ln_x", low=0.5, high=1.5)
        s[f"{block}.ffn.x_k"] = uniform(1, 1, C)
        s[f"{block}.ffn.key.weight"] = proj(4 * C, C)
        s[f"{block}.ffn.value.weight"] = proj(C, 4 * C)
    layer_norm("ln_out")
    s["head.weight"] = proj(vocab, C)
    return s


def logprob_errors(model, tokens: list[int], reference_logits) -> tuple[float, float]:
    """(relative error of our per-token log-probabilities of ``tokens[1:]`` against the
    log-softmax of a reference's logits ``[T, vocab]`` of the same tokens, relative error of
    the perplexity): ours through evaluate's two paths, the continuation scores (LAMBADA,
    lm-eval) and the fused loss on a data set (``dataset_loss``)."""
    from mlx_rwkvx.data.examples import Example
    from mlx_rwkvx.data.loss import dataset_loss
    from mlx_rwkvx.evaluation.likelihood import continuation_scores

    ref = np.asarray(reference_logits, dtype=np.float64)[: len(tokens) - 1]
    top = ref.max(-1, keepdims=True)
    ref_logp = ref - top - np.log(np.exp(ref - top).sum(-1, keepdims=True))
    expected = ref_logp[np.arange(len(tokens) - 1), tokens[1:]]
    (score,) = continuation_scores(model, [(tokens[:1], tokens[1:])])
    ours = np.array(score.token_logprobs)
    trained = np.ones(len(tokens), dtype=bool)
    trained[0] = False
    loss = dataset_loss(model, [Example(np.array(tokens, np.int32), trained)], batch_size=1)
    logp_err = float(np.linalg.norm(ours - expected) / np.linalg.norm(expected))
    ppl = np.exp(-expected.mean())
    return logp_err, abs(loss.perplexity - ppl) / ppl
