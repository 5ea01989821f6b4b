"""The README runs. Its Python snippets run in order, in a fresh process (each may use what an
earlier one defined, as a reader would), in an empty working folder. Every command of its
```bash blocks runs too, a block at a time in a folder of its own, on tiny models and data
standing in for the real ones: ``RECIPES`` says, per block, what stands in for which name and
which settings are substituted (fewer steps, mostly), and what the block must leave or print;
``EXEMPT`` lists the commands that do not run (set-up and benchmarks), with the reason. A
command in neither fails the suite.

Two rewrites apply to every command: ``python`` is this interpreter (``sys.executable``), and
``mlx.launch`` the launcher installed beside it, given a random ``--starting-port`` (tests may
run side by side). A host ``"ssh": "127.0.0.1"`` in a hostfile runs locally (mlx.launch runs
no ssh for it), so a two-Mac hostfile becomes two local ranks."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from helpers.hub import StandInHub, folder_files
from helpers.parity import import_parity_extra

README = Path(__file__).resolve().parent.parent / "README.md"
DATA = Path(__file__).resolve().parent / "data"


def snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_snippets():
    assert len(snippets()) >= 3


def test_readme_snippets_run(tmp_path):
    program = "\n\n".join(snippets())
    out = subprocess.run(
        [sys.executable, "-c", program], cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"stdout:\n{out.stdout}\nstderr:\n{out.stderr}"


def test_readme_promises_only_commands_that_exist():
    import importlib.util

    for name in set(re.findall(r"python -m (mlx_rwkvx\.\w+)", README.read_text())):
        assert importlib.util.find_spec(name) is not None, f"README promises {name}"
    for path in re.findall(r"`(tests/[^`\s]*)`", README.read_text()):
        assert (README.parent / path).exists(), f"README names missing {path}"


def broken_links(doc: Path) -> list[str]:
    """The relative links (and images) of a markdown file whose target file does not exist."""
    broken = []
    for link in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
        target = link.split("#", 1)[0]
        if target and not re.match(r"[a-z]+:", target) and not (doc.parent / target).exists():
            broken.append(link)
    return broken


def test_markdown_links_resolve():
    """The README and the recorded benchmark reports beside the benchmarks' code link only files
    that exist: each other, the plot, the tests."""
    docs = [README, *sorted((README.parent / "benchmarks").glob("*.md"))]
    assert len(docs) >= 3
    broken = {doc.name: links for doc in docs if (links := broken_links(doc))}
    assert not broken, f"links to missing files: {broken}"


def _design_entries() -> list[str]:
    """The Design section's tree, one entry per top-level item (with its continuation lines)."""
    section = README.read_text().split("\n## Design\n", 1)[1]
    tree = re.search(r"```\nmlx_rwkvx/\n(.*?)```", section, flags=re.S).group(1)
    return re.split(r"\n(?=  \S)", tree)


def test_readme_design_draws_every_module():
    # "the layers as they now are": every public module and subpackage of the package is named
    # in the Design section's tree, a subpackage's modules in its own entry
    package = README.parent / "mlx_rwkvx"
    entries = _design_entries()
    missing = []

    def named(name: str, text: str) -> bool:
        return re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", text) is not None

    for sub in sorted(p for p in package.iterdir() if (p / "__init__.py").exists()):
        entry = next((e for e in entries if e.startswith(f"  {sub.name}/")), None)
        if entry is None:
            missing.append(f"{sub.name}/")
            continue
        for child in sorted(sub.iterdir()):
            if child.name.startswith("_"):
                continue
            if child.suffix == ".py" and not named(child.name, entry):
                missing.append(f"{sub.name}/{child.name}")
            if (child / "__init__.py").exists() and not named(f"{child.name}/", entry):
                missing.append(f"{sub.name}/{child.name}/")
    top = "\n".join(e for e in entries if not re.match(r"  \w+/", e))
    for module in sorted(package.glob("*.py")):
        if not module.name.startswith("_") and not named(module.name, top):
            missing.append(module.name)
    assert not missing, f"README's Design section does not draw {missing}"


# ----- the README's bash blocks --------------------------------------------------------------


def slug(title: str) -> str:
    """GitHub's anchor of a heading: "Two Macs with mlx.launch" -> "two-macs-with-mlxlaunch"."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def blocks(lang: str) -> list[tuple[str, str]]:
    """(id, text) of every ```lang block: the id is the slug of the heading above it ("set-up"
    before the first), with -2, -3, ... for a second, third block under one heading."""
    found, heading, count = [], "set-up", {}
    lines = README.read_text().split("\n")
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].startswith("```"))
            if lines[i][3:].strip() == lang:
                count[heading] = count.get(heading, 0) + 1
                n = count[heading]
                found.append(
                    (heading if n == 1 else f"{heading}-{n}", "\n".join(lines[i + 1 : end]))
                )
            i = end + 1
            continue
        if m := re.match(r"#+ (.+)", lines[i]):
            heading = slug(m.group(1))
        i += 1
    return found


def headings() -> list[str]:
    """The slug of every heading outside code blocks."""
    found, fenced = [], False
    for line in README.read_text().split("\n"):
        fenced ^= line.startswith("```")
        if not fenced and (m := re.match(r"#+ (.+)", line)):
            found.append(slug(m.group(1)))
    return found


def test_readme_anchors_exist():
    missing = set(re.findall(r"\]\([^)#]*#([^)]+)\)", README.read_text())) - set(headings())
    assert not missing, f"README links to missing headings {sorted(missing)}"


def commands(text: str) -> list[str]:
    """A block's commands: continuation lines joined, comment lines and trailing comments (a
    ``#`` after a space, none of the README's commands quotes one) dropped."""
    out = []
    for line in re.sub(r"\\\n\s*", "", text).split("\n"):
        line = re.sub(r"\s+#\s.*$", "", line).strip()
        if line and not line.startswith("#"):
            out.append(line)
    return out


EXEMPT = {
    "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/python -m mlx_rwkvx.demo": (
        "installs from the package index, which the tests cannot reach; the demo has a test of "
        "its own"
    ),
    'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest': (
        "installs from the package index, and runs this very suite (.ci/run runs the command)"
    ),
    'pip install -e ".[eval]"': (
        "installs from the package index; .ci/run installs the eval extra after the README's "
        "test command and runs the tests it unlocks (-m extra)"
    ),
    'pip install -e ".[server]"': (
        "installs from the package index; the test extra includes the server extra"
    ),
    "python -m mlx_rwkvx.server --model fla-hub/rwkv7-1.5B-world --adapter tuned=lora/ --port "
    "8080": (
        "serves until it is stopped; tests/server/ start the server as this command does and "
        "talk to it over HTTP, also as the curl below does"
    ),
    'curl -s localhost:8080/v1/chat/completions -H "Content-Type: application/json" -d '
    '\'{"model": "tuned", "messages": [{"role": "user", "content": "Hello"}], '
    '"max_tokens": 64}\'': ("needs the server above running; tests/server/ send the same request"),
    "python scripts/bench.py all": (
        "the benchmarks: minutes to an hour on 2 cores, and it rewrites benchmarks/BENCHMARKS.md; "
        "tests/cli/test_bench.py runs its sections at --quick sizes"
    ),
}


@dataclass(frozen=True)
class Recipe:
    """How a bash block runs: ``files`` puts a stand-in (a kind ``Fixtures`` builds) under each
    name the README gives a model, data or hosts file; ``replace`` swaps a setting for a small
    one (matched as whole words: ``--iters 2000`` leaves ``--iters 20000`` alone), each with
    its reason; ``expect`` names files the block must leave (``mlx.launch`` exits 0 even when
    a rank fails); ``stdin`` feeds every command, and with ``chat`` every ``--chat`` command
    must answer each of its lines with some text. ``hub`` serves a stand-in under each
    Hugging Face name the block gives (``helpers/hub.py``: the real huggingface_hub downloads
    it from 127.0.0.1 into a cache of the block's own)."""

    files: dict[str, str]
    hub: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()  # modules of an extra (skipped without them, except under CI)
    replace: dict[str, str] = field(default_factory=dict)
    expect: tuple[str, ...] = ()
    stdin: str = ""
    chat: bool = False
    slow: bool = False


BPE_VOCAB = 320  # the 256 bytes, merges, <|endoftext|>: a tokenizer.json of a tiny model
LONG_RUN = "--iters 2"  # a real run's thousand steps: minutes to hours; two show it works

RECIPES = {
    "lora-fine-tune-on-a-chat-jsonl": Recipe(
        files={"chats": "chats"},
        hub={"fla-hub/rwkv7-1.5B-world": "rwkv7-hf"},
        replace={"--iters 1000": LONG_RUN},
        expect=("lora/adapter_final.safetensors", "lora/adapter_config.json", "lora/metrics.jsonl"),
    ),
    "int8-base-on-an-8-gb-mac": Recipe(
        files={"rwkv-qwen-hybrid-1.5B.safetensors": "rfa", "chats": "chats"},
        replace={"--iters 1000": LONG_RUN},
        expect=("rfa-lora/adapter_final.safetensors",),
    ),
    "state-tuning": Recipe(
        files={"chats": "chats"},
        hub={"fla-hub/rwkv7-1.5B-world": "rwkv7-hf"},
        replace={"--iters 500": LONG_RUN},
        expect=("state/adapter_final.safetensors",),
    ),
    "pissa-and-miss": Recipe(
        files={"chats": "chats"},
        hub={"fla-hub/rwkv7-1.5B-world": "rwkv7-hf"},
        replace={"--iters 1000": LONG_RUN},
        expect=("pissa/adapter_final.safetensors", "miss/adapter_final.safetensors"),
    ),
    "preference-training-dpo-and-orpo": Recipe(
        files={"prefs": "prefs"},
        hub={"fla-hub/rwkv7-1.5B-world": "rwkv7-hf"},
        replace={"--iters 500": "--iters 2 --batch-size 2"},
        expect=("dpo/adapter_final.safetensors", "orpo/adapter_final.safetensors"),
    ),
    "pretraining": Recipe(
        # the README's own rwkv-x-small.yaml (World vocabulary: 33M embedding and head)
        files={"rwkv-x-small.yaml": "readme-yaml", "corpus": "corpus"},
        replace={
            "--iters 2000": LONG_RUN,
            "--iters 20000": LONG_RUN,
            "--batch-size 8": "--batch-size 2",  # and shorter texts: a step of the 65536-token
            "--max-seq-len 512": "--max-seq-len 64",  # head costs seconds on 2 cores
        },
        expect=("pre-tiny/model/config.json", "pre-small/model/model.safetensors"),
        slow=True,
    ),
    "chat": Recipe(
        files={"lora": "lora"},
        hub={"fla-hub/rwkv7-1.5B-world": "rwkv7-hf"},
        # a seeded sampler: the answers checked are the same on every run (a random model's
        # first sampled token is its end of text about once in 256)
        replace={"--top-p 0.9": "--top-p 0.9 --seed 0"},
        stdin="What is 2 plus 3?\nAnd 4 plus 4?\n",  # two turns, then end of input: the chat ends
        chat=True,
    ),
    "checkpoints": Recipe(
        files={},
        hub={
            "fla-hub/rwkv7-1.5B-world": "rwkv7-hf",
            "BlinkDL/rwkv7-g1/rwkv7-g1a-0.1b-20250728-ctx4096.pth": "rwkv7-pth",
        },
        replace={'--prompt "Hello"': '--prompt "Hello" --max-tokens 4'},
        expect=("rwkv7-g1a-0.1b/config.json",),
    ),
    "evaluate": Recipe(
        files={
            "lora": "lora",
            "chats": "chats",
            "lambada_test.jsonl": "lambada",
            "tasks": "lm-eval-tasks",
        },
        hub={"fla-hub/rwkv7-1.5B-world": "rwkv7-hf"},
        # lm-eval's own tasks download their data sets: two tasks of the same kinds over
        # local data stand in for them
        replace={
            "--tasks hellaswag,arc_easy --num-shots 0 --limit 200": (
                "--tasks tiny_choice,tiny_qa --include-path tasks --num-shots 0 --limit 3"
            )
        },
        needs=("lm_eval",),
    ),
    "merge-adapters-from-two-macs": Recipe(
        files={
            "rwkv-qwen-hybrid-1.5B.safetensors": "rfa-bpe",
            "tokenizer.json": "tokenizer-json",  # beside the model, as Qwen2's beside Foundry's
            "chats": "chats",
        },
        replace={"--epochs 3": LONG_RUN},
        expect=(
            "chats_0.bin",
            "chats_1.bin",
            "loras_m4/thread_5.safetensors",
            "loras_m3/adapter_final.safetensors",
            "merged.safetensors",
        ),
        slow=True,
    ),
    "two-macs-with-mlxlaunch": Recipe(
        files={"rwkv7-1.5b": "rwkv7", "chats": "chats", "hosts.json": "hosts"},
        replace={"--iters 1000": LONG_RUN},
        expect=("lora-dp/adapter_final.safetensors", "lora-local/adapter_final.safetensors"),
        slow=True,
    ),
    "convert-a-hugging-face-blinkdl-or-rwkv-x-checkpoint": Recipe(
        files={
            "rwkv7-g1-1.5b.pth": "rwkv7-pth",
            "rwkv7-g1-1.5b-hf": "rwkv7-hf",
            "Qwen2.5-1.5B-Instruct": "qwen2-hf",
            "RWKV-X-0.2B-64k-Base.pth": "rwkvx-pth",
        },
        expect=(
            "rwkv7-1.5b/config.json",
            "rwkv7-1.5b-int8/config.json",
            "rwkv7-1.5b-from-hf/config.json",
            "rwkv7-1.5b-hf/config.json",
            "rwkv7-1.5b-blinkdl.pth",
            "rfa-from-qwen/config.json",
            "rwkv-x-0.2b/config.json",
            "RWKV-X-0.2B-again.pth",
        ),
    ),
}


def run_cli(*args: str, cwd: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", *args], cwd=cwd, capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, f"{args}:\n{out.stdout}\n{out.stderr}"


class Fixtures:
    """The stand-ins, each built once per module on first use: ``rwkv7`` (a 2-block C = 64
    RWKV-7 folder, bytes as tokens), ``rfa`` (ARWKV, ARWKV, Qwen2 at C = 64, one .safetensors),
    ``tokenizer-json`` (a byte-level BPE ``tokenizer.json``, Qwen2's kind, trained on ``chats``)
    and ``rfa-bpe`` (``rfa`` with that tokenizer's vocabulary size, to sit beside it),
    ``rwkv7-pth`` (BlinkDL's .pth layout, written by torch), ``rwkvx-pth`` (the RWKV-X
    authors' .pth layout), ``rwkv7-hf`` and ``qwen2-hf``
    (Hugging Face folders written by ``convert --to hf``), ``chats`` (a chat data folder),
    ``corpus`` (a text data folder), ``hosts`` (a hostfile of two local ranks), ``lora`` (an
    adapter of ``rwkv7`` after one step), ``readme-yaml`` (the README's own YAML file)."""

    def __init__(self, root: Path):
        self.root = root
        self.built: dict[str, Path] = {}

    def get(self, kind: str) -> Path:
        if kind not in self.built:
            self.built[kind] = getattr(self, "_" + kind.replace("-", "_"))(self.root / kind)
        return self.built[kind]

    def repos(self, names: dict[str, str]) -> dict[str, dict[str, bytes]]:
        """Hub repositories of stand-ins: ``org/name`` -> a folder's files, ``org/name/FILE``
        -> one file by that name in the repository."""
        repos: dict[str, dict[str, bytes]] = {}
        for name, kind in names.items():
            org, repo, *file = name.split("/", 2)
            src = self.get(kind)
            files = folder_files(src) if src.is_dir() else {src.name: src.read_bytes()}
            if file:
                files = {file[0]: src.read_bytes()}
            repos.setdefault(f"{org}/{repo}", {}).update(files)
        return repos

    def place(self, kind: str, dest: Path) -> None:
        if kind == "readme-yaml":  # the README's ```yaml block that starts "# <dest name>"
            text = [t for _, t in blocks("yaml") if t.startswith(f"# {dest.name}")]
            assert len(text) == 1, f"README: one ```yaml block headed '# {dest.name}'"
            dest.write_text(text[0] + "\n")
            return
        src = self.get(kind)
        (shutil.copytree if src.is_dir() else shutil.copy)(src, dest)

    @staticmethod
    def _save(config, path: Path) -> Path:
        import mlx_rwkvx
        from mlx_rwkvx.models import Model

        mlx_rwkvx.save(Model(config, seed=0), path)
        return path

    def _rwkv7(self, path: Path) -> Path:
        from helpers import rwkv7_cfg

        return self._save(rwkv7_cfg(hidden_size=64), path)

    def _rfa(self, path: Path, vocab_size: int = 256) -> Path:
        """One .safetensors with the config in its metadata, as Foundry's hybrid."""
        from mlx_rwkvx.models import rfa_config

        attention = dict(n_q_heads=4, n_kv_heads=2, attn_head_dim=16, intermediate_size=128)
        cfg = rfa_config(
            vocab_size=vocab_size,
            hidden_size=64,
            head_size=16,
            **attention,
            block_types=["rwkv7", "rwkv7", "qwen2"],
        )
        return self._save(cfg, path.with_suffix(".safetensors"))

    def _rfa_bpe(self, path: Path) -> Path:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(self.get("tokenizer-json"))).get_vocab_size()
        return self._rfa(path, vocab_size=vocab)

    def _tokenizer_json(self, path: Path) -> Path:
        """Byte-level BPE as Qwen2's: every byte a token, then merges, then an end of text."""
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        tokenizer = Tokenizer(models.BPE())
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=BPE_VOCAB,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        lines = (self.get("chats") / "train.jsonl").read_text().splitlines()
        texts = [m["content"] for line in lines for m in json.loads(line)["messages"]]
        tokenizer.train_from_iterator(texts, trainer)
        tokenizer.save(str(path))
        return path

    def _rwkv7_pth(self, path: Path) -> Path:
        return DATA / "tiny_rwkv7.pth"  # written by torch.save, as BlinkDL's scripts do

    def _rwkvx_pth(self, path: Path) -> Path:
        """RWKV-7, RWKV-7, MoBA at C = 128 in the RWKV-X authors' layout (their code's heads
        of 64; tests/io/test_parity_rwkvx.py runs such files in their code)."""
        from mlx_rwkvx.io.formats import write_rwkvx
        from mlx_rwkvx.models import Model, ModelConfig, rwkv_x_block_types

        from helpers.model_params import flat_params

        cfg = ModelConfig(
            vocab_size=256,
            hidden_size=128,
            head_size=64,
            n_q_heads=2,
            block_types=rwkv_x_block_types(2, 1),
        )
        model = Model(cfg, seed=0)
        write_rwkvx(path.with_suffix(".pth"), cfg, flat_params(model))
        return path.with_suffix(".pth")

    def _rwkv7_hf(self, path: Path) -> Path:
        run_cli("mlx_rwkvx.convert", str(self.get("rwkv7")), str(path), "--to", "hf", cwd=self.root)
        return path

    def _qwen2_hf(self, path: Path) -> Path:
        from mlx_rwkvx.models import rfa_config

        cfg = rfa_config(
            vocab_size=256,
            hidden_size=64,
            head_size=16,
            n_q_heads=4,
            n_kv_heads=2,
            intermediate_size=128,
            block_types=["qwen2"] * 4,
        )
        native = self._save(cfg, self.root / "qwen2-native")
        run_cli("mlx_rwkvx.convert", str(native), str(path), "--to", "hf", cwd=self.root)
        return path

    def _prefs(self, path: Path) -> Path:
        """Preference pairs, strings and conversational ones, a system field among them."""
        lines = [
            json.dumps(
                {"prompt": f"What is {a} plus 2?", "chosen": f"{a + 2}.", "rejected": f"{a + 3}."}
            )
            for a in range(6)
        ]
        turn = lambda role, text: [{"role": role, "content": text}]  # noqa: E731
        lines.append(
            json.dumps(
                {
                    "system": "Be brief.",
                    "prompt": turn("user", "Hi"),
                    "chosen": turn("assistant", "Hello."),
                    "rejected": turn("assistant", "Go away."),
                }
            )
        )
        path.mkdir()
        (path / "train.jsonl").write_text("\n".join(lines) + "\n")
        (path / "valid.jsonl").write_text("\n".join(lines[:2]) + "\n")
        return path

    def _chats(self, path: Path) -> Path:
        """The README's example lines and enough sums for --parallel 6 on 75% of them."""
        (example,) = [t for _, t in blocks("jsonl")]
        lines = example.split("\n")
        for a in range(8):
            for b in range(5):
                lines.append(
                    json.dumps(
                        {
                            "messages": [
                                {"role": "user", "content": f"What is {a} plus {b}?"},
                                {"role": "assistant", "content": f"{a + b}."},
                            ]
                        }
                    )
                )
        path.mkdir()
        (path / "train.jsonl").write_text("\n".join(lines) + "\n")
        (path / "valid.jsonl").write_text("\n".join(lines[-4:]) + "\n")
        return path

    def _lambada(self, path: Path) -> Path:
        """A few lines in the format of RWKV-LM's lambada_test.jsonl."""
        texts = ["the cat sat on the mat", "she opened the door and saw her brother"]
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return path

    def _lm_eval_tasks(self, path: Path) -> Path:
        """Two lm-eval tasks (multiple choice, generation) over local JSONL files."""
        path.mkdir()
        choice = [
            {"q": "The sky is", "choices": [" blue", " green"], "a": 0},
            {"q": "Cats say", "choices": [" moo", " meow"], "a": 1},
        ]
        qa = [{"q": "Say yes:", "a": " yes"}, {"q": "Say no:", "a": " no"}]
        for name, docs in (("choice", choice), ("qa", qa)):
            (self.root / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
        head = (
            "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
        )
        (path / "tiny_choice.yaml").write_text(
            "task: tiny_choice\n"
            + head.format(self.root / "choice.jsonl")
            + "output_type: multiple_choice\ndoc_to_text: '{{q}}'\ndoc_to_choice: '{{choices}}'\n"
            "doc_to_target: '{{a}}'\nmetric_list:\n  - metric: acc\n"
        )
        (path / "tiny_qa.yaml").write_text(
            "task: tiny_qa\n"
            + head.format(self.root / "qa.jsonl")
            + "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
            "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n"
            "metric_list:\n  - metric: exact_match\n"
        )
        return path

    def _corpus(self, path: Path) -> Path:
        path.mkdir()
        texts = [f"{a} plus {b} is {a + b}. " * 3 for a in range(8) for b in range(5)]
        (path / "train.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        return path

    def _hosts(self, path: Path) -> Path:
        local = {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}
        path.write_text(json.dumps([local, local]))
        return path

    def _lora(self, path: Path) -> Path:
        run_cli(
            "mlx_rwkvx.train",
            "--model",
            str(self.get("rwkv7")),
            "--data",
            str(self.get("chats")),
            "--output",
            str(path),
            "--iters",
            "1",
            cwd=self.root,
        )
        return path


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return Fixtures(tmp_path_factory.mktemp("readme-fixtures"))


def replace_words(command: str, old: str, new: str) -> str:
    return re.sub(rf"(?<![\w.-]){re.escape(old)}(?![\w.])", lambda _: new, command)


def local(command: str) -> str:
    """``python`` -> this interpreter; ``mlx.launch`` -> the one beside it, on a random port."""
    command = replace_words(command, "python", shlex.quote(sys.executable))
    launcher = Path(sys.executable).parent / "mlx.launch"
    port = random.randint(20000, 60000)
    return replace_words(
        command, "mlx.launch", f"{shlex.quote(str(launcher))} --starting-port {port}"
    )


def chat_answers(stdout: str) -> list[str]:
    """The answers of ``generate --chat`` fed by a pipe: each is what follows its prompt
    ``> `` (at a line's start) up to the statistics line ``[N tokens, ...]`` after it."""
    return re.findall(r"^> (.*?)\n\[\d+ tokens, ", stdout, flags=re.S | re.M)


def test_readme_bash_commands_are_run_or_exempt():
    found = blocks("bash")
    unlisted = [
        (b, c) for b, text in found for c in commands(text) if b not in RECIPES and c not in EXEMPT
    ]
    assert not unlisted, f"README commands neither run (RECIPES) nor EXEMPT: {unlisted}"
    every = {c for _, text in found for c in commands(text)}
    assert set(EXEMPT) <= every, f"EXEMPT lists commands the README lost: {set(EXEMPT) - every}"
    assert set(RECIPES) <= {b for b, _ in found}, "RECIPES names blocks the README lost"
    for block, text in found:
        if block in RECIPES:
            cmds = commands(text)
            assert any(c not in EXEMPT for c in cmds), f"{block}: nothing left to run"
            recipe = RECIPES[block]
            for old in recipe.replace:
                assert any(replace_words(c, old, "") != c for c in cmds), f"{block}: no {old!r}"
            for name in recipe.files:
                assert name in text, f"{block}: the README no longer names {name}"


def _marks(recipe: Recipe) -> list:
    # a block that needs the eval extra runs where .ci/run installed it (-m extra)
    return [pytest.mark.slow] * recipe.slow + [pytest.mark.extra("eval")] * bool(recipe.needs)


@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(r)) for b, r in RECIPES.items()])
def test_readme_bash_block_runs(block, fixtures, tmp_path):
    recipe = RECIPES[block]
    if recipe.needs:
        import_parity_extra(recipe.needs, extra="eval")
    text = dict(blocks("bash"))[block]
    for name, kind in recipe.files.items():
        fixtures.place(kind, tmp_path / name)
    with contextlib.ExitStack() as stack:
        env = None
        if recipe.hub:
            hub = stack.enter_context(StandInHub(fixtures.repos(recipe.hub)))
            env = {
                **os.environ,
                "HF_HUB_OFFLINE": "0",
                "HF_ENDPOINT": hub.url,
                "HF_HOME": str(tmp_path / ".hf"),
                "HF_HUB_DISABLE_TELEMETRY": "1",
            }
        _run_block(recipe, text, tmp_path, env)
    missing = [f for f in recipe.expect if not (tmp_path / f).exists()]
    assert not missing, f"{block}: the commands left no {missing}"


def _run_block(recipe: Recipe, text: str, tmp_path: Path, env: dict | None) -> None:
    for command in commands(text):
        if command in EXEMPT:
            continue
        for old, new in recipe.replace.items():
            command = replace_words(command, old, new)
        command = local(command)
        out = subprocess.run(
            command,
            shell=True,
            executable="/bin/bash",
            cwd=tmp_path,
            input=recipe.stdin,
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert out.returncode == 0, f"{command}\nstdout:\n{out.stdout}\nstderr:\n{out.stderr}"
        if recipe.chat and " --chat" in command:
            answers = chat_answers(out.stdout)
            turns = recipe.stdin.splitlines()
            assert len(answers) == len(turns) and all(a.strip() for a in answers), (
                f"{command}: {len(turns)} turns, answers {answers}\nstdout:\n{out.stdout}"
            )
