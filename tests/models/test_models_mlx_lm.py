"""mlx-lm as an independent implementation: our RWKV-7 and all-Qwen2 models, weights copied into
``mlx_lm.models.rwkv7.Model`` / ``mlx_lm.models.qwen2.Model``, give the same logits for a whole
sequence and token by token through both caches; mlx-lm's ``generate_step`` runs our models and
their caches unchanged; the caches are mlx-lm's own ``ArraysCache``, whose prompt-cache files
load with mlx-lm alone, nothing of ours written into its modules."""

from __future__ import annotations

from mlx_rwkvx.models import Model, ModelConfig, preset

import mlx.core as mx
import numpy as np
import pytest
from helpers import rfa_cfg
from helpers.model_params import flat_params
from mlx.utils import tree_flatten
from mlx_lm.generate import generate_step
from mlx_lm.models import qwen2 as lm_qwen2
from mlx_lm.models import rwkv7 as lm_rwkv7
from mlx_lm.models.cache import make_prompt_cache
from oracle.common import rel_err

# Independent float32 implementations. mlx-lm writes the decay scale as -0.606531 (ours is
# exp(-0.5) = 0.60653066: 5e-7 apart, relative) and keeps its step-loop WKV state in float32.
TOL = 1e-5
B, T = 2, 13


# this file's own RWKV-7: the FFN width and each low rank set, not derived from the width (the
# derived ranks would all be 32), as mlx-lm's ModelArgs takes each of them
def _rwkv7_cfg() -> ModelConfig:
    return ModelConfig(
        vocab_size=50,
        hidden_size=64,
        head_size=16,
        block_types=["rwkv7"] * 3,
        intermediate_size=128,
        decay_low_rank=16,
        a_low_rank=16,
        v_low_rank=8,
        gate_low_rank=32,
    )


def _qwen2_cfg() -> ModelConfig:
    return rfa_cfg(["qwen2"] * 3, hidden_size=64, vocab_size=50, rope_theta=1e4)


def _rwkv7_weights(model: Model) -> dict[str, mx.array]:
    """Our RWKV-7 parameters under mlx-lm's rwkv7 names and shapes."""
    cfg = model.config
    H, N, C = cfg.n_heads, cfg.head_size, cfg.hidden_size
    low = {"decay": "w_lora", "iclr": "a_lora", "value_mix": "v_lora", "gate": "g_lora"}
    proj = {"receptance": "r_proj", "key": "k_proj", "value": "v_proj", "output": "o_proj"}
    out = {}
    for name, v in flat_params(model).items():
        parts = name.split(".")
        if parts[0] == "embed":
            out["model.embeddings.weight"] = v
        elif parts[0] == "ln0":
            out[f"model.layers.0.pre_norm.{parts[1]}"] = v
        elif parts[0] == "norm":
            out[name.replace("norm", "model.norm", 1)] = v
        elif parts[0] == "lm_head":
            out[name] = v
        else:
            i, sub, rest = parts[1], parts[2], parts[3:]
            pre = f"model.layers.{i}"
            if sub in ("ln1", "ln2"):
                out[f"{pre}.{'attn_norm' if sub == 'ln1' else 'ffn_norm'}.{rest[0]}"] = v
            elif sub == "ffn":
                out[f"{pre}.ffn.{'.'.join(rest)}"] = v
            elif rest[0] in proj:
                out[f"{pre}.attn.{proj[rest[0]]}.weight"] = v
            elif rest[0] in low:
                idx = 0 if rest[1] == "down" else 2
                out[f"{pre}.attn.{low[rest[0]]}.lora.{idx}.{rest[2]}"] = v
            elif rest[0] == "ln_x":
                out[f"{pre}.attn.g_norm.{rest[1]}"] = v.reshape(H, N)
            elif rest[0] in ("k_k", "k_a", "r_k"):
                out[f"{pre}.attn.{rest[0]}"] = v.reshape(H, N)
            else:  # the lerps x_r ... x_g
                out[f"{pre}.attn.{rest[0]}"] = v.reshape(1, 1, C)
    return out


def _lm_rwkv7(model: Model):
    cfg = model.config
    args = lm_rwkv7.ModelArgs(
        model_type="rwkv7",
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        norm_eps=cfg.norm_eps,
        head_dim=cfg.head_size,
        num_hidden_layers=len(cfg.block_types),
        a_low_rank_dim=cfg.a_low_rank,
        v_low_rank_dim=cfg.v_low_rank,
        gate_low_rank_dim=cfg.gate_low_rank,
        decay_low_rank_dim=cfg.decay_low_rank,
        tie_word_embeddings=False,
    )
    theirs = lm_rwkv7.Model(args)
    theirs.load_weights(list(_rwkv7_weights(model).items()), strict=True)
    return theirs


def _lm_qwen2(model: Model):
    cfg = model.config
    args = lm_qwen2.ModelArgs(
        model_type="qwen2",
        hidden_size=cfg.hidden_size,
        num_hidden_layers=len(cfg.block_types),
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.n_q_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size,
        num_key_value_heads=cfg.n_kv_heads,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=False,
    )
    theirs = lm_qwen2.Model(args)
    weights = {
        ("model.embed_tokens.weight" if k == "embed.weight" else k): v
        for k, v in flat_params(model).items()
    }
    weights = {
        (f"model.{k}" if k.startswith(("layers", "norm")) else k): v for k, v in weights.items()
    }
    theirs.load_weights(list(weights.items()), strict=True)
    return theirs


FAMILIES = {"rwkv7": (_rwkv7_cfg, _lm_rwkv7), "qwen2": (_qwen2_cfg, _lm_qwen2)}


def _tokens(vocab, seed=0):
    return mx.array(np.random.default_rng(seed).integers(0, vocab, (B, T)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_logits_match_mlx_lm(family):
    """A whole sequence without a cache, a prefill into each side's own cache, and the same
    cache decoding on token by token: all agree with mlx-lm."""
    make_cfg, make_theirs = FAMILIES[family]
    ours = Model(make_cfg(), seed=11)
    theirs = make_theirs(ours)
    tokens = _tokens(ours.config.vocab_size)
    a, b = np.array(ours(tokens)), np.array(theirs(tokens))
    assert rel_err(a, b) <= TOL, f"full sequence: {rel_err(a, b):.2e}"
    # a prefill of 5 tokens, then one token at a time, in both caches
    c_ours, c_theirs = ours.make_cache(), make_prompt_cache(theirs)
    a = [ours(tokens[:, :5], c_ours)] + [ours(tokens[:, t : t + 1], c_ours) for t in range(5, T)]
    b = [theirs(tokens[:, :5], c_theirs)]
    b += [theirs(tokens[:, t : t + 1], c_theirs) for t in range(5, T)]
    a, b = np.array(mx.concatenate(a, axis=1)), np.array(mx.concatenate(b, axis=1))
    assert rel_err(a, b) <= TOL, f"cached: {rel_err(a, b):.2e}"


def test_mlx_lm_rwkv7_names_cover_ours():
    """Every one of our RWKV-7 parameters lands on a distinct mlx-lm parameter and back."""
    ours = Model(_rwkv7_cfg())
    weights = _rwkv7_weights(ours)
    assert len(weights) == len(flat_params(ours))
    theirs = _lm_rwkv7(ours)
    assert set(dict(tree_flatten(theirs.parameters()))) == set(weights)


def _greedy_by_hand(model, prompt: mx.array, n: int) -> list[int]:
    cache = model.make_cache()
    logits = model(prompt[None], cache)
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits[0, -1]))
        out.append(tok)
        logits = model(mx.array([[tok]]), cache)
    return out


GENERATE = {
    "rwkv7": _rwkv7_cfg,
    "rwkv-x-tiny": lambda: preset("rwkv-x-tiny"),
    "rfa": lambda: rfa_cfg(["rwkv7", "qwen2", "rwkv7", "qwen2"], hidden_size=64, vocab_size=50),
}


@pytest.mark.parametrize("name", sorted(GENERATE))
def test_generate_step_runs_our_models(name):
    """mlx-lm's generate_step with our model and our caches: the greedy tokens of decoding by
    hand, with its prompt prefilled in steps of 7 (a split the caches must carry)."""
    model = Model(GENERATE[name](), seed=13)
    prompt = mx.array(np.random.default_rng(1).integers(0, model.config.vocab_size, 20))
    n = 6
    got = []
    for tok, logprobs in generate_step(prompt, model, max_tokens=n, prefill_step_size=7):
        got.append(int(tok))
        assert logprobs.shape == (model.config.vocab_size,)
    assert got == _greedy_by_hand(model, prompt, n)
    # and with a cache handed in, as mlx-lm's prompt-cache users do
    cache = model.make_cache()
    again = [int(t) for t, _ in generate_step(prompt, model, max_tokens=n, prompt_cache=cache)]
    assert again == got


@pytest.mark.parametrize("name", ["rwkv-x-tiny", "rfa"])
def test_stream_generate_with_our_tokenizer(name):
    # mlx-lm's stream_generate, unchanged, drives our model, cache and byte tokenizer, and
    # produces exactly what greedy decoding by hand does
    from mlx_rwkvx.io.tokenizers import ByteTokenizer

    from mlx_lm.generate import stream_generate

    if name == "rfa":
        cfg = rfa_cfg(["rwkv7", "qwen2", "rwkv7"], hidden_size=64)
    else:
        cfg = preset(name)
    model = Model(cfg, seed=3)
    tok = ByteTokenizer()
    prompt = tok.encode("Hello")
    pieces = [r.token for r in stream_generate(model, tok, prompt, max_tokens=6)]
    tokens, cache = [], model.make_cache()
    logits = model(mx.array([prompt]), cache)
    for _ in range(len(pieces)):
        tokens.append(int(mx.argmax(logits[0, -1]).item()))
        if tokens[-1] in tok.eos_token_ids:
            break
        logits = model(mx.array([tokens[-1:]]), cache)
    assert pieces == tokens


def test_caches_are_mlx_lms_own(tmp_path):
    """``make_cache`` gives mlx-lm's ``ArraysCache`` (our ``RowsCache`` of it, which batches rows
    of different lengths, saved under mlx-lm's name; one per block, RFA's ARWKV blocks with two
    arrays, Qwen2's with two); making models and caches and running them writes nothing into
    mlx-lm's cache module; a prompt cache saved by mlx-lm loads in a process that imports mlx-lm
    alone, and here it continues as the cache it was saved from."""
    import subprocess
    import sys

    from mlx_lm.models import cache as lm_cache

    before = dict(vars(lm_cache))
    model = Model(GENERATE["rfa"](), seed=2)
    cache = model.make_cache()
    assert all(isinstance(c, lm_cache.ArraysCache) and c.empty() for c in cache)
    assert {type(c).__name__ for c in cache} == {"ArraysCache"}
    model(mx.array([[1, 2, 3, 4]]), cache)
    assert [len(c.cache) for c in cache] == [2, 2, 2, 2]
    assert dict(vars(lm_cache)) == before
    path = str(tmp_path / "prompt.safetensors")
    lm_cache.save_prompt_cache(path, cache)
    code = (
        "import sys\n"
        "from mlx_lm.models.cache import load_prompt_cache\n"
        "cache = load_prompt_cache(sys.argv[1])\n"
        "assert not any(m.startswith('mlx_rwkvx') for m in sys.modules)\n"
        "print(' '.join(type(c).__name__ for c in cache))\n"
    )
    out = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ArraysCache"] * 4
    loaded = lm_cache.load_prompt_cache(path)
    step = mx.array([[5, 6]])
    assert mx.array_equal(model(step, loaded), model(step, cache))
