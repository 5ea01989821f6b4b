"""Models by Hugging Face name, through the real huggingface_hub and a stand-in hub on
127.0.0.1 (``helpers/hub.py``): every format we read downloads (only the files we read), then
loads offline from the cache, by the API and by the commands; each refusal is one line, exit 2.

The processes that download get ``HF_HUB_OFFLINE=0`` and ``HF_ENDPOINT`` pointing at the stand-in
hub (read when huggingface_hub is imported, hence new processes); every other test runs with
the hub offline (``conftest.py``)."""

from __future__ import annotations

import json
import os
import shutil
import sys

import mlx_rwkvx
from mlx_rwkvx.io.convert import convert
from mlx_rwkvx.io.formats import write_hf, write_rwkvx
from mlx_rwkvx.io.hub import allow_patterns, hub_name
from mlx_rwkvx.models import Model, ModelConfig, preset, rwkv_x_block_types

import mlx.core as mx
import numpy as np
import pytest
from helpers import DATA, rfa_cfg, run_module, rwkv7_cfg
from helpers.hub import StandInHub, folder_files
from helpers.model_params import flat_params

TOKENS = [[1, 5, 9, 200, 3]]
# name -> the local file or folder the stand-in hub serves it from (see ``repos``)
NAMES = {
    "fla-hub/rwkv7-tiny": "hf-rwkv7",
    "fla-hub/rwkv7-tiny@main": "hf-rwkv7",
    "BlinkDL/rwkv7-tiny/rwkv7-a.pth": "rwkv7-a.pth",
    "howard-hou/RWKV-X-tiny/RWKV-X-tiny.pth": "RWKV-X-tiny.pth",
    "Qwen/Qwen2-tiny": "hf-qwen2",
    "ours/native-tiny": "native",
    "ours/single": "rfa.safetensors",
}
# what the driver process prints for each name: the logits of TOKENS
DRIVER = f"""
import json, sys
import mlx_rwkvx
import mlx.core as mx
out = {{}}
for name in sys.argv[1:]:
    model, tokenizer = mlx_rwkvx.load(name)
    out[name] = [model(mx.array({TOKENS!r}))[0].tolist(), tokenizer.encode("hi")]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def local(tmp_path_factory):
    """The checkpoints the stand-in hub serves, written here (name -> path)."""
    root = tmp_path_factory.mktemp("local")
    native_rwkv7 = root / "rwkv7"
    mlx_rwkvx.save(Model(rwkv7_cfg(hidden_size=64), seed=1), native_rwkv7)
    convert(native_rwkv7, root / "hf-rwkv7", to="hf")  # with the byte tokenizer's files
    qwen = Model(rfa_cfg(["qwen2"] * 2, hidden_size=64, ln0=False, final_norm="rms"), seed=2)
    write_hf(root / "hf-qwen2", qwen.config, flat_params(qwen))
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=3), root / "native")
    mlx_rwkvx.save(Model(rfa_cfg(["rwkv7", "qwen2"]), seed=4), root / "rfa.safetensors")
    shutil.copy(DATA / "tiny_rwkv7.pth", root / "rwkv7-a.pth")
    shutil.copy(DATA / "tiny_rwkv7_bf16.pth", root / "rwkv7-b.pth")
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=128,
        head_size=64,
        n_q_heads=2,
        block_types=rwkv_x_block_types(2, 1),
    )
    write_rwkvx(root / "RWKV-X-tiny.pth", cfg, flat_params(Model(cfg, seed=5)))
    return root


@pytest.fixture(scope="module")
def repos(local) -> dict[str, dict[str, bytes]]:
    readme = {"README.md": b"# a model card\n"}
    hf_rwkv7 = folder_files(local / "hf-rwkv7")
    return {
        # what must not be fetched beside what we read: a card, another framework's weights
        "fla-hub/rwkv7-tiny": {**hf_rwkv7, **readme, "pytorch_model.bin": b"not ours"},
        "BlinkDL/rwkv7-tiny": {
            "rwkv7-a.pth": (local / "rwkv7-a.pth").read_bytes(),
            "rwkv7-b.pth": (local / "rwkv7-b.pth").read_bytes(),
            **readme,
        },
        "howard-hou/RWKV-X-tiny": {
            "RWKV-X-tiny.pth": (local / "RWKV-X-tiny.pth").read_bytes(),
            **readme,
        },
        "Qwen/Qwen2-tiny": folder_files(local / "hf-qwen2"),
        "ours/native-tiny": folder_files(local / "native"),
        "ours/single": {"rfa.safetensors": (local / "rfa.safetensors").read_bytes(), **readme},
        "old/bin-only": {
            "config.json": hf_rwkv7["config.json"],
            "pytorch_model.bin": b"a pickle",
            **readme,
        },
        "empty/card": readme,
        "meta/gated": hf_rwkv7,
    }


def online(hub: StandInHub, home) -> dict:
    return {
        "HF_HUB_OFFLINE": "0",
        "HF_ENDPOINT": hub.url,
        "HF_HOME": str(home),
        "HF_HUB_DISABLE_TELEMETRY": "1",
    }


def offline(home) -> dict:
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(home), "HF_ENDPOINT": "http://127.0.0.1:9"}


def load_all(names, env) -> dict:
    out = run_module_code(DRIVER, *names, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def run_module_code(code, *args, env):
    import subprocess

    return subprocess.run(
        [sys.executable, "-c", code, *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_names_are_read_as_the_hub_reads_them():
    assert str(hub_name("fla-hub/rwkv7-1.5B-world")) == "fla-hub/rwkv7-1.5B-world"
    name = hub_name("BlinkDL/rwkv7-g1@v2/rwkv7-g1a-0.1b.pth")
    assert (name.repo, name.revision, name.file) == ("BlinkDL/rwkv7-g1", "v2", "rwkv7-g1a-0.1b.pth")
    for path in ("./org/name", "/abs/name", "name", "a/b/c", "../x/y", "org/name/dir/sub"):
        assert hub_name(path) is None, path
    assert "*.pth" not in allow_patterns(hub_name("org/name"))  # a folder's files only
    assert allow_patterns(hub_name("org/name/x.pth"))[0] == "x.pth"


def test_every_format_downloads_then_loads_offline(tmp_path, local, repos):
    """Online: each name downloads only the files we read, into HF_HOME, and loads as the local
    checkpoint does. Offline, with the hub gone: the same names load from the cache alone."""
    home = tmp_path / "hf"
    with StandInHub(repos) as hub:
        first = load_all(NAMES, online(hub, home))
    fetched = set(hub.downloads)
    assert not [f for f in fetched if f.endswith(("README.md", "pytorch_model.bin"))], fetched
    assert "BlinkDL/rwkv7-tiny/rwkv7-b.pth" not in fetched  # the one file named, no other
    assert max(hub.downloads.values()) == 1  # each file once, the second name from the cache
    again = load_all(NAMES, offline(home))
    for name, source in NAMES.items():
        model, tokenizer = mlx_rwkvx.load(local / source)
        expected = np.array(model(mx.array(TOKENS))[0])
        assert np.array_equal(np.array(first[name][0], dtype=np.float32), expected), name
        assert first[name] == again[name], name
        assert first[name][1] == tokenizer.encode("hi"), name
    assert (home / "hub" / "models--fla-hub--rwkv7-tiny").is_dir()


def test_hf_hub_cache_is_honoured(tmp_path, repos):
    cache = tmp_path / "elsewhere"
    env = {"HF_HUB_CACHE": str(cache), "HF_HOME": str(tmp_path / "home")}
    with StandInHub(repos) as hub:
        load_all(["ours/single"], {**online(hub, tmp_path / "home"), **env})
    assert (cache / "models--ours--single").is_dir()
    assert not (tmp_path / "home" / "hub").exists()


def test_the_commands_take_hub_names(tmp_path, repos):
    """generate, convert, train and merge --fuse-into, each given a name, offline from the
    cache once it was downloaded."""
    home = tmp_path / "hf"
    with StandInHub(repos) as hub:
        load_all(["fla-hub/rwkv7-tiny", "BlinkDL/rwkv7-tiny/rwkv7-a.pth"], online(hub, home))
    env = offline(home)
    name = "fla-hub/rwkv7-tiny"

    def run(module, *args):
        out = run_module(module, *args, env=env)
        assert out.returncode == 0, f"{module} {args}: {out.stderr}"
        return out

    run("generate", "--model", name, "--prompt", "hi", "--max-tokens", "3")
    run("convert", "BlinkDL/rwkv7-tiny/rwkv7-a.pth", tmp_path / "converted")
    assert (tmp_path / "converted" / "config.json").exists()
    data = tmp_path / "data"
    data.mkdir()
    lines = [json.dumps({"text": f"hi {i}"}) for i in range(4)]
    (data / "train.jsonl").write_text("\n".join(lines) + "\n")
    run(
        "train",
        "--model",
        name,
        "--data",
        data,
        "--output",
        tmp_path / "lora",
        "--iters",
        "1",
        "--batch-size",
        "2",
    )
    config = json.loads((tmp_path / "lora" / "adapter_config.json").read_text())
    assert config["train"]["model"] == name  # the name, which another Mac resolves again
    run("merge", "--output", tmp_path / "fused", tmp_path / "lora", "--fuse-into", name)
    assert (tmp_path / "fused" / "model.safetensors").exists()


def test_a_tokenizer_by_name_fetches_no_weights(tmp_path, repos):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"hi {i}"}) + "\n" for i in range(3)))
    flags = ["--tokenizer", "fla-hub/rwkv7-tiny", "--data", data, "--output", tmp_path / "d.bin"]
    with StandInHub(repos) as hub:
        out = run_module("pretokenize", *flags, env=online(hub, tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert set(hub.downloads) == {
        f"fla-hub/rwkv7-tiny/{n}"
        for n in ("config.json", "tokenizer.json", "tokenizer_config.json")
    }
    assert (tmp_path / "d.bin").stat().st_size > 0


# name, where the stand-in hub is (None: offline, nothing cached), the message's pattern
REFUSALS = [
    (
        "pre-smal/model",
        None,
        r"pre-smal/model: not a file or folder here, and pre-smal/model is "
        r"not \(completely\) in the Hugging Face cache; HF_HUB_OFFLINE is set",
    ),
    (
        "nope/missing",
        "online",
        r"no such file or folder, and no Hugging Face repository "
        r"'nope/missing'",
    ),
    ("meta/gated", "online", r"meta/gated: a gated repository: accept its terms"),
    (
        "BlinkDL/rwkv7-tiny",
        "online",
        r"holds checkpoint files \(rwkv7-a.pth, rwkv7-b.pth\) and "
        r"no config.json: name one as BlinkDL/rwkv7-tiny/FILE",
    ),
    ("BlinkDL/rwkv7-tiny/rwkv7-c.pth", "online", r"the repository has no file 'rwkv7-c.pth'"),
    (
        "old/bin-only",
        "online",
        r"old/bin-only: holds pytorch_model.bin weights only; PyTorch "
        r"pickles",
    ),
    ("empty/card", "online", r"no checkpoint we read: .* \(it holds README.md\)"),
    ("fla-hub/rwkv7-tiny@v9", "online", r"no revision 'v9' in the repository"),
]


# each refusal in one process: the message of CheckpointError (a UserError: one line, exit 2)
REFUSING = """
import json, sys
import mlx_rwkvx
from mlx_rwkvx.errors import UserError
out = {}
for name in sys.argv[1:]:
    try:
        mlx_rwkvx.load(name)
        out[name] = None
    except UserError as e:
        out[name] = str(e)
print(json.dumps(out))
"""


def test_refusals_name_the_repository_and_what_to_do(tmp_path, repos):
    """Each refusal is a UserError (one line, exit 2 in a command) whose message names the
    repository and what to do; a later try is not in the way of anything left behind."""
    import re

    home = tmp_path / "hf"
    with StandInHub(repos, gated=["meta/gated"]) as hub:
        names = [name for name, where, _ in REFUSALS if where]
        out = run_module_code(REFUSING, *names, env=online(hub, home))
    assert out.returncode == 0, out.stderr
    said = json.loads(out.stdout.splitlines()[-1])
    cached = run_module_code(REFUSING, "pre-smal/model", env=offline(home))
    offline_said = json.loads(cached.stdout.splitlines()[-1])
    for name, _, message in REFUSALS:
        text = {**said, **offline_said}[name]
        assert text is not None and "\n" not in text and re.search(message, text), (name, text)
        assert text.startswith(name.split("@")[0].split("/")[0]), (name, text)


@pytest.mark.parametrize("name", ["pre-smal/model", "meta/gated"])
def test_a_command_shows_a_refusal_as_one_line(tmp_path, repos, name):
    with StandInHub(repos, gated=["meta/gated"]) as hub:
        env = online(hub, tmp_path / "hf") if name == "meta/gated" else offline(tmp_path / "hf")
        out = run_module("generate", "--model", name, "--prompt", "hi", env=env)
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert out.returncode == 2 and len(errors) == 1 and "Traceback" not in out.stderr
    assert errors[0].startswith(f"mlx_rwkvx.generate: error: {name.split('/')[0]}")


def test_an_interrupted_download_is_not_in_the_way(tmp_path, repos):
    """The connection keeps dropping in the middle of the weights (huggingface_hub resumes a
    dropped download, then gives up): one line, exit 2; the next try completes the download
    and loads, and offline the same name loads from the cache."""
    home = tmp_path / "hf"
    file = "ours/single/rfa.safetensors"
    with StandInHub(repos, broken={file: 20}) as hub:
        out = run_module(
            "generate", "--model", "ours/single", "--prompt", "hi", env=online(hub, home)
        )
        errors = [line for line in out.stderr.splitlines() if "error:" in line]
        assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
        assert errors[-1].startswith("mlx_rwkvx.generate: error: ours/single"), errors
        assert hub.downloads[file] > 1  # it resumed before giving up
        hub.broken.clear()
        load_all(["ours/single"], online(hub, home))
    load_all(["ours/single"], offline(home))
