"""Parity with the reference implementations, on tiny random models in float32:

- transformers' ``Qwen2ForCausalLM`` on checkpoints transformers itself saved, in its current
  config layout (``rope_parameters``) and the 4.x one (top-level ``rope_theta``);
- BlinkDL's ``rwkv`` package (RWKV-7, "x070") on ``.pth`` files laid out as BlinkDL's training
  scripts save them;
- mlx-lm's ``rwkv7`` on the Hugging Face folder ``python -m mlx_rwkvx.convert --to hf`` writes
  from the same ``.pth``;
- the ``rwkv`` package's ``TRIE_TOKENIZER`` against our World tokenizer.

Logits agree to ``||ours - ref|| / ||ref|| <= 1e-5`` at lengths 1, 17 and 100 (one token; a
length past one WKV chunk of 16 and not a multiple of it). The references come from the
``parity`` extra (torch, transformers, rwkv): without it the module is skipped, except under CI
(``MLX_RWKVX_CI=1``, set by ``.ci/run``), where a missing extra is a failure.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import mlx_rwkvx
from mlx_rwkvx.io.tokenizers import WorldTokenizer

import mlx.core as mx
import numpy as np
import pytest
from helpers.parity import JIT_DEPRECATED, blinkdl_state, import_parity_extra, logprob_errors
from oracle.common import rel_err

TOL = 1e-5
LENGTHS = [1, 17, 100]
PARITY_EXTRA = ("torch", "transformers", "rwkv.model", "rwkv.rwkv_tokenizer")
pytestmark = [
    pytest.mark.extra("parity"),
    pytest.mark.filterwarnings(f"ignore:{JIT_DEPRECATED}:DeprecationWarning"),
]


# read when rwkv.model is imported: its RWKV-7 ("x070") classes instead of RWKV-4..6
os.environ["RWKV_V7_ON"] = "1"
torch, transformers, rwkv_model, rwkv_tokenizer = import_parity_extra(PARITY_EXTRA)


def _tokens(vocab: int, length: int) -> list[int]:
    return np.random.default_rng(length).integers(0, vocab, length).tolist()


def _ours(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0])  # [T, vocab]


def _check(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape}, reference {ref.shape}"
    err = rel_err(ours, ref)
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL:.0e}"


V = 256  # the vocabulary of every random checkpoint below


class BlinkDLReference:
    """A ``.pth`` and BlinkDL's ``rwkv`` package running it (strategy 'cpu fp32')."""

    def __init__(self, pth: str):
        self.pth = pth
        x070 = getattr(rwkv_model, "RWKV_x070", None)  # defined only under RWKV_V7_ON=1
        assert x070 is not None, "rwkv.model was imported before RWKV_V7_ON=1 was set"
        # it loads `name + ".pth"`, and prints a line or two while loading
        self.model = x070(model=pth.removesuffix(".pth"), strategy="cpu fp32")
        self._logits: dict[tuple, np.ndarray] = {}

    def logits(self, tokens: list[int]) -> np.ndarray:
        """``[T, vocab]``: every position's logits of one sequence from the zero state."""
        key = tuple(tokens)
        if key not in self._logits:
            with torch.no_grad():
                out, _ = self.model.forward(list(tokens), None, full_output=True)
            # a single token takes its one-token path, which returns [vocab]
            self._logits[key] = out.float().numpy().reshape(len(tokens), -1)
        return self._logits[key]


@pytest.fixture(scope="module", params=[False, True], ids=["blinkdl", "blinkdl-layer0-v"])
def blinkdl(request, tmp_path_factory) -> BlinkDLReference:
    state = blinkdl_state(seed=3, layer0_v=request.param)
    pth = str(tmp_path_factory.mktemp("pth") / "rwkv7-tiny.pth")
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, pth)
    return BlinkDLReference(pth)


@pytest.mark.parametrize("length", LENGTHS)
def test_rwkv7_pth_matches_blinkdl_rwkv(blinkdl, length):
    model, _ = mlx_rwkvx.load(blinkdl.pth)
    tokens = _tokens(V, length)
    _check(_ours(model, tokens), blinkdl.logits(tokens), f"{blinkdl.pth}, T={length}")


def test_rwkv7_logprobs_match_blinkdl_rwkv(blinkdl):
    """evaluate's per-token log-probabilities and perplexity (both its paths) against the
    log-softmax of the rwkv package's logits on the same tokens."""
    model, _ = mlx_rwkvx.load(blinkdl.pth)
    tokens = _tokens(V, 100)
    logp_err, ppl_err = logprob_errors(model, tokens, blinkdl.logits(tokens))
    assert logp_err <= TOL and ppl_err <= TOL, (logp_err, ppl_err)


def test_rwkv7_hf_folder_matches_mlx_lm(blinkdl, tmp_path):
    """The .pth converted by our CLI to a Hugging Face folder: mlx-lm's rwkv7 reads it with its
    own code and agrees with us reading the same folder, and with the rwkv package on the .pth."""
    from mlx_lm.utils import load_model

    hf = tmp_path / "hf"
    cli = [sys.executable, "-m", "mlx_rwkvx.convert", blinkdl.pth, str(hf), "--to", "hf"]
    out = subprocess.run(cli, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    theirs, _ = load_model(hf)
    ours, _ = mlx_rwkvx.load(str(hf))
    for length in LENGTHS:
        tokens = _tokens(V, length)
        lm = _ours(theirs, tokens)
        _check(_ours(ours, tokens), lm, f"ours vs mlx-lm on {hf}, T={length}")
        _check(lm, blinkdl.logits(tokens), f"mlx-lm on {hf} vs rwkv on the .pth, T={length}")
    tokens = _tokens(V, 100)  # evaluate's log-probabilities against mlx-lm's logits
    logp_err, ppl_err = logprob_errors(ours, tokens, _ours(theirs, tokens))
    assert logp_err <= TOL and ppl_err <= TOL, (logp_err, ppl_err)


# Qwen2: GQA (4 query heads, 2 KV heads of 16), a RoPE base far from the 10000 default.
ROPE_THETA = 1e6
QWEN2 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _qwen2(tied: bool, rope_theta: float = ROPE_THETA, seed: int = 5):
    """transformers' Qwen2ForCausalLM (eager attention) with weights at scales that make the
    attention far from uniform, so that positions, and so the RoPE base, matter."""
    cfg = transformers.Qwen2Config(
        **QWEN2,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        tie_word_embeddings=tied,
        attn_implementation="eager",
    )
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.3 * torch.randn_like(p))
            elif "embed_tokens" in name:
                p.copy_(torch.randn_like(p))
            else:  # a Linear weight [out, in]
                p.copy_(torch.randn_like(p) / p.shape[1] ** 0.5)
    return model


def _qwen2_logits(model, tokens: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().numpy()


def _as_transformers_4(folder, out) -> None:
    """The same checkpoint with the config.json transformers 4.x wrote: ``rope_theta`` and
    ``rope_scaling`` at the top level, ``torch_dtype``."""
    shutil.copytree(folder, out)
    path = out / "config.json"
    cfg = json.loads(path.read_text())
    rope = cfg.pop("rope_parameters")
    assert rope["rope_type"] == "default"
    cfg["rope_theta"] = rope["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["torch_dtype"] = cfg.pop("dtype", "float32")
    cfg.pop("layer_types", None)
    cfg["transformers_version"] = "4.45.2"
    path.write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def qwen2(request, tmp_path_factory):
    """(transformers' model, {config layout: the folder it saved})."""
    model = _qwen2(tied=request.param)
    root = tmp_path_factory.mktemp("qwen2")
    model.save_pretrained(root / "v5")
    saved = json.loads((root / "v5" / "config.json").read_text())
    assert saved["rope_parameters"]["rope_theta"] == ROPE_THETA and "rope_theta" not in saved
    _as_transformers_4(root / "v5", root / "v4")
    return model, {"v5": root / "v5", "v4": root / "v4"}


@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("layout", ["v5", "v4"], ids=["rope_parameters", "rope_theta"])
def test_qwen2_matches_transformers(qwen2, layout, length):
    hf_model, folders = qwen2
    ours, _ = mlx_rwkvx.load(str(folders[layout]))
    tokens = _tokens(QWEN2["vocab_size"], length)
    what = f"{folders[layout]} ({layout} config), T={length}"
    _check(_ours(ours, tokens), _qwen2_logits(hf_model, tokens), what)


def test_qwen2_logprobs_match_transformers(qwen2):
    hf_model, folders = qwen2
    ours, _ = mlx_rwkvx.load(str(folders["v5"]))
    tokens = _tokens(QWEN2["vocab_size"], 100)
    logp_err, ppl_err = logprob_errors(ours, tokens, _qwen2_logits(hf_model, tokens))
    assert logp_err <= TOL and ppl_err <= TOL, (logp_err, ppl_err)


def test_qwen2_reference_sees_the_rope_base():
    """The Qwen2 comparison catches a wrong RoPE base: 1e6 against the 10000 default moves
    transformers' own logits far past the tolerance at T=100."""
    model = _qwen2(tied=False)
    other = _qwen2(tied=False, rope_theta=10000.0)
    other.load_state_dict(model.state_dict())
    tokens = _tokens(QWEN2["vocab_size"], 100)
    assert rel_err(_qwen2_logits(other, tokens), _qwen2_logits(model, tokens)) > 1e3 * TOL


TEXTS = {
    "ascii": "Hello, world! The quick brown fox jumps over the lazy dog.",
    "cjk": "你好，世界。今天天气很好，我们去公园散步吧。日本語のテキストも。한국어 문장.",
    "emoji": "emoji 😀🎉 👍🏽 family 👨‍👩‍👧‍👦 flags 🇯🇵🇫🇷 keycap 1️⃣",
    "code": 'def f(x: int) -> int:\n    """Doc."""\n    return {"a": [x ** 2, x // 3]}[\'a\'][0]\n',
    "whitespace": "runs    of\t\t\ttabs   \n   \n\n\n                and spaces    ",
    "chat": "User: hi there\n\nAssistant: Hello!\n\nUser: 第二个问题？\n\nAssistant:",
    "blank-line": "\n\n",
    "mixed": "café naïve Ω≈ç√ — “quotes” 12,345.67\r\n<html><b>x</b></html> 🚀 終わり",
}


@pytest.fixture(scope="module")
def world_tokenizers():
    """(ours, the rwkv package's TRIE_TOKENIZER with the vocabulary file it ships)."""
    vocab = os.path.join(os.path.dirname(rwkv_tokenizer.__file__), "rwkv_vocab_v20230424.txt")
    return WorldTokenizer(), rwkv_tokenizer.TRIE_TOKENIZER(vocab)


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_world_tokenizer_matches_rwkv_trie_tokenizer(world_tokenizers, name):
    ours, theirs = world_tokenizers
    ids = theirs.encode(TEXTS[name])
    assert ours.encode(TEXTS[name]) == ids
    assert ours.decode(ids) == theirs.decode(ids) == TEXTS[name]
