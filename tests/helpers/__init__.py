"""What the tests share, in one place: the repository's paths, tiny model configs and models, an
adapter maker, tiny Hugging Face tokenizers, and commands run in this process or as
``python -m``. Beside it, ``helpers.model_params`` (our parameter names against the float64
oracle's) and ``helpers.mlx_kernel_emulation`` (MLX's kernel builders emulated on the CPU); the
oracle itself, ``rel_err`` (the one error measure) among it, is the package ``oracle``.

A test imports shared code from these, never from another test file. tests/conftest.py puts
tests/ on ``sys.path`` (pytest's default "prepend" import mode), so ``import helpers`` works
from every folder."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

from mlx_rwkvx.adapters.files import adapter_config, save_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.io.tokenizers import HFTokenizer
from mlx_rwkvx.models import Model, ModelConfig, preset, rfa_config, rwkv_x_block_types

import mlx.core as mx

TESTS = Path(__file__).resolve().parent.parent
ROOT = TESTS.parent  # the repository: scripts/, README.md, the package
DATA = TESTS / "data"  # the committed fixtures

# Low ranks below BlinkDL's smallest size (32): at width 32 the projections stay low-rank, and
# the oracle's work small.
LOW_RANK = dict(decay_low_rank=8, a_low_rank=8, v_low_rank=8, gate_low_rank=16)


def rwkv7_cfg(blocks: int = 2, hidden_size: int = 32, vocab_size: int = 256, **kw) -> ModelConfig:
    """``blocks`` RWKV-7 blocks with heads of 16, on the byte vocabulary unless told. The
    default, two blocks of width 32, is the smallest model the commands run on."""
    return ModelConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        head_size=16,
        block_types=["rwkv7"] * blocks,
        **kw,
    )


def rfa_cfg(
    block_types: list[str], hidden_size: int = 32, vocab_size: int = 256, **kw
) -> ModelConfig:
    """An RFA config of ``block_types`` ("rwkv7" and "qwen2"): RWKV heads of 16, 4 query and 2
    KV heads, an FFN 1.5 times the width."""
    return rfa_config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        head_size=16,
        block_types=list(block_types),
        n_q_heads=4,
        n_kv_heads=2,
        intermediate_size=hidden_size * 3 // 2,
        **kw,
    )


def tiny_model(family: str, seed: int = 0, **kw) -> Model:
    """A seeded model of width 64 of each family: "rwkv7" (two blocks), "rwkv-x" (RWKV-7, RWKV-7,
    MoBA; chunks of 8, top 1) or "rfa" (RWKV-7, Qwen2, RWKV-7)."""
    if family == "rwkv7":
        cfg = rwkv7_cfg(hidden_size=64, **kw)
    elif family == "rwkv-x":
        cfg = ModelConfig(
            vocab_size=kw.pop("vocab_size", 256),
            hidden_size=64,
            head_size=16,
            block_types=rwkv_x_block_types(2, 1),
            moba_chunk_size=8,
            moba_top_k=1,
            **kw,
        )
    else:
        cfg = rfa_cfg(
            ["rwkv7", "qwen2", "rwkv7"], hidden_size=64, attn_head_dim=16, rope_theta=10000.0, **kw
        )
    return Model(cfg, seed=seed)


def constant(model: Model, token: int) -> Model:
    """``model`` made to predict ``token`` after anything: the final norm's output is its bias
    (ones), and only the head's row of ``token`` sees it."""
    model.norm.weight = mx.zeros_like(model.norm.weight)
    model.norm.bias = mx.ones_like(model.norm.bias)
    model.lm_head.weight = mx.zeros_like(model.lm_head.weight).at[token].add(1.0)
    return model


def adapter_base(seed: int = 0) -> Model:
    """The model ``make_adapter``'s adapters belong to: the rwkv-x-tiny preset."""
    return Model(preset("rwkv-x-tiny"), seed=seed)


def make_adapter(path, *, rank=4, alpha=8.0, seed=0, noise=1, base_seed=0, tokens=100, kind="lora"):
    """An adapter of ``adapter_base(base_seed)`` with random A and B (a trained-looking one)."""
    model = adapter_base(base_seed)
    if kind == "state":
        paths = enable_state_tuning(model)
    else:
        paths = target_paths(model, "attn")
        apply_lora(model, paths, rank=rank, alpha=alpha, dora=kind == "dora")
    key = mx.random.key(noise)
    for _, m in model.named_modules():
        for leaf in ("lora_a", "lora_b", "state0"):
            if leaf in m:
                key, sub = mx.random.split(key)
                m[leaf] = 0.1 * mx.random.normal(m[leaf].shape, key=sub)
    config = adapter_config(
        model,
        fine_tune_type=kind,
        paths=paths,
        rank=rank,
        alpha=alpha,
        base_fingerprint=fingerprint(adapter_base(base_seed)),
        seed=seed,
        tokens_trained=tokens,
    )
    save_adapter(path, model, config)
    return path


# ASCII, CJK, emoji with modifiers and flags, tabs and CRLF, and nothing: what the tokenizers
# round-trip, and what bpe_tokenizer is trained on
TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "你好，世界。今天天气很好。",
    "emoji: 😀🎉👍🏽 and flags 🇯🇵",
    "mixed 日本語 text with\ttabs\nand newlines\r\n  spaces    ",
    "",
]
# a conversation: a system prompt, two user turns, two answers
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello, world!"},
    {"role": "assistant", "content": "How can I help you today?"},
    {"role": "user", "content": "The fox?"},
    {"role": "assistant", "content": "Lazy dog."},
]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _byte_level_bpe(folder: Path, texts: list[str], special_tokens: list[str], eos: str):
    """A byte-level BPE of at most 400 tokens trained on ``texts``, saved in ``folder`` as
    Hugging Face's tokenizer.json and tokenizer_config.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts * 20, trainer)
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))


def bpe_tokenizer(folder: Path) -> HFTokenizer:
    """A tiny byte-level BPE in ``folder`` (about 400 tokens, trained on TEXTS), whose end of
    text is ``<|endoftext|>``; no chat template."""
    _byte_level_bpe(folder, TEXTS, ["<|endoftext|>"], "<|endoftext|>")
    return HFTokenizer(str(folder))


def chatml_tokenizer(folder: Path, template: str | None = CHATML) -> HFTokenizer:
    """A tiny byte-level BPE in ``folder`` (trained on CHAT's messages) with ChatML's special
    tokens, ``<|im_end|>`` its end of text, and ``template`` as its chat_template.jinja."""
    texts = [m["content"] for m in CHAT]
    _byte_level_bpe(folder, texts, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>")
    if template is not None:
        (folder / "chat_template.jinja").write_text(template)
    return HFTokenizer(str(folder))


class CliError(Exception):
    """A command's exit 2 with the one line it printed."""


def cli(main, *argv, notes: str | None = None) -> str:
    """``main(argv)`` of a command, run in this process: what it printed on stdout, or its exit
    2 as ``CliError`` with the one line it printed (warnings counted, as a user's process shows
    them; argparse's usage line left out, and lines starting with ``notes``, reports a command
    prints before its error). Another exit code, or more than one line, fails the test."""
    out, err = io.StringIO(), io.StringIO()
    with (
        contextlib.redirect_stderr(err),
        contextlib.redirect_stdout(out),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("default")  # what a user's process shows, on its stderr
        try:
            main([str(a) for a in argv])
        except SystemExit as e:
            shown = [
                warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
                for w in caught
            ]
            text = "".join(shown) + err.getvalue()
            lines = text.strip().splitlines()
            if notes is not None:
                lines = [line for line in lines if not line.startswith(notes)]
            if e.code != 2 or not lines:
                raise AssertionError(f"exit {e.code}, stderr {text!r}") from e
            if lines[0].startswith("usage:"):  # argparse: the usage, then one error line
                lines = lines[-1:]
            if len(lines) != 1:
                raise AssertionError(f"more than one line: {text!r}") from e
            raise CliError(lines[0]) from None
    return out.getvalue()


def run_module(module: str, *args, env=None, timeout=300, **kw) -> subprocess.CompletedProcess:
    """``python -m mlx_rwkvx.<module> args`` in a new process, its output captured as text;
    ``env`` adds to this process's environment."""
    return subprocess.run(
        [sys.executable, "-m", f"mlx_rwkvx.{module}", *map(str, args)],
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )
