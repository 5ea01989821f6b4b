"""``python -m mlx_rwkvx.generate`` as a person uses it: a prompt, standard input, bad input
(one line, exit 2), a bug (its traceback, not a user error), and the interactive chat driven in
a pseudo-terminal (two turns, /save, quit, /load in a new process, Ctrl-C during an answer,
unknown commands, a corrupt file)."""

from __future__ import annotations

import subprocess
import sys

import mlx_rwkvx
from mlx_rwkvx.adapters.files import adapter_config, save_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths

import pytest
from helpers import constant, run_module, tiny_model

pexpect = pytest.importorskip("pexpect")


def run(*args, stdin=None):
    return run_module("generate", *args, input=stdin, timeout=120)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    mlx_rwkvx.save(tiny_model("rwkv-x", seed=1), root / "m")
    mlx_rwkvx.save(constant(tiny_model("rwkv7", seed=2), ord("a")), root / "aaa")
    other = tiny_model("rwkv-x", seed=7)  # another base: its adapter is refused on m
    paths = target_paths(other, "attn")
    apply_lora(other, paths, rank=2, alpha=4.0)
    config = adapter_config(
        other,
        fine_tune_type="lora",
        paths=paths,
        rank=2,
        alpha=4.0,
        base_fingerprint=fingerprint(tiny_model("rwkv-x", seed=7)),
    )
    save_adapter(root / "other.safetensors", other, config)
    return root


def test_prompt_and_stdin(models):
    out = run("--model", models / "aaa", "--prompt", "hi", "--max-tokens", "7", "--verbose")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "aaaaaaa\n"
    assert "prompt: " in out.stderr and "tokens/s" in out.stderr
    out = run("--model", models / "aaa", "--prompt", "-", "-m", "3", stdin="from stdin")
    assert out.returncode == 0 and out.stdout == "aaa\n", out.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "nowhere", "--prompt", "x"], "--model nowhere: no such file"),
        (["--prompt", "x"], "--model is required"),
        (["--model", "{m}", "--prompt", "x", "--temp", "-1"], "--temp must not be negative"),
        (["--model", "{m}", "--prompt", "x", "--max-tokens", "0"], "--max-tokens must be"),
        (["--model", "{m}", "--prompt", "x", "--chat-template", "nope"], "chat template 'nope'"),
        (["--model", "{m}", "--prompt", "x", "--adapter", "{o}"], "another base model"),
        (["--model", "{m}", "--prompt", "x", "--adapter", "nope"], "--adapter nope: no such"),
        (["--model", "{m}"], "standard input is not a terminal"),
        (["--model", "{m}", "--prompt", "x", "--quantize", "int3"], "invalid choice"),
    ],
)
def test_bad_input_is_one_line(models, args, message):
    args = [a.format(m=models / "m", o=models / "other.safetensors") for a in args]
    out = run(*args, stdin="")
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""
    if "usage:" not in out.stderr:  # argparse prints its usage line before the error
        assert len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("mode", [["--prompt", "hi"], ["--chat"]])
def test_a_bug_keeps_its_traceback(models, mode):
    # an MLX shape error is a ValueError, but a bug, not the user's: its traceback and exit 1,
    # never the one line and exit 2 of a user error (nor, in the chat, "error: ..." and the
    # prompt again)
    script = f"""
import mlx.core as mx
from mlx_rwkvx.models.model import Model
from mlx_rwkvx.generate import main

def head(self, h):  # the bug: a matmul of shapes that do not fit
    return h @ mx.zeros((3, 5))

Model.head = head
main(["--model", {str(models / "aaa")!r}, "--max-tokens", "3", *{mode!r}])
"""
    out = subprocess.run(
        [sys.executable, "-c", script], input="hi\n", capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 1, (out.returncode, out.stderr)
    assert "Traceback" in out.stderr and "ValueError: [matmul]" in out.stderr, out.stderr
    assert "error:" not in out.stderr + out.stdout


def spawn(*args):
    child = pexpect.spawn(
        sys.executable,
        ["-m", "mlx_rwkvx.generate", *map(str, args)],
        encoding="utf-8",
        timeout=120,
    )
    child.expect("Ctrl-D to quit")
    child.expect("> ")
    return child


def test_chat_in_a_terminal(models, tmp_path):
    conv = tmp_path / "conv"
    template = tmp_path / "chat.jinja"  # answers rendered as generated: each turn continues
    template.write_text(
        "{% for m in messages %}{{ m.role }}:{{ m.content }}\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    args = ("--model", models / "aaa", "--chat-template", template, "--max-tokens", "8")
    child = spawn(*args)
    for turn in ("hello there", "a second turn"):
        child.sendline(turn)
        child.expect("aaaaaaaa")
        child.expect(r"\[8 tokens, [\d.]+ tokens/s; prompt \d+ new tokens")
        child.expect("> ")
    child.sendline(f"/save {conv}")
    child.expect(r"saved (\d+) tokens to .*conv\.safetensors")
    saved = int(child.match.group(1))
    child.expect("> ")
    child.sendline("/quit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x00" * 40)
    child = spawn(*args)
    child.sendline(f"/load {bad}")
    child.expect("error: .*bad.safetensors: not a saved conversation")
    child.expect("> ")
    child.sendline("/frobnicate")
    child.expect(r"error: unknown command /frobnicate \(/help lists them\)")
    child.expect("> ")
    child.sendline(f"/load {conv}")
    child.expect(rf"loaded .*conv\.safetensors: 2 turns, {saved} tokens")
    child.expect("> ")
    child.sendline("third")
    child.expect(r"prompt (\d+) new tokens, (\d+) held")
    assert int(child.match.group(2)) == saved  # the loaded state, continued
    child.expect("> ")
    child.sendline("/help")
    child.expect("/system TEXT")
    child.expect("> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    assert "Traceback" not in child.before


def test_ctrl_c_stops_the_answer_not_the_chat(models):
    child = spawn("--model", models / "aaa", "--max-tokens", "1000000")
    child.sendline("go on forever")
    child.expect("aaaaaaaaaa")  # the answer is streaming
    child.sendintr()
    child.expect(r"\[stopped\]")
    child.expect("> ")
    child.sendline("/temp 0.5")
    child.expect("temperature 0.5")
    child.expect("> ")
    child.sendintr()  # at the prompt: a fresh prompt
    child.expect("> ")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
