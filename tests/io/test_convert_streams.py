"""Converting streams: a model many blocks long passes a tensor at a time, so the converting
process's resident peak grows by about one block, never by the model (measured in a process of
its own: the kernel's high-water mark, reset once the command is imported and warmed up)."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx_rwkvx
from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.convert import convert
from mlx_rwkvx.io.formats import write_blinkdl, write_hf, write_native
from mlx_rwkvx.models import Model

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads the peak from Linux's /proc/self/status"
)

WIDTH, BLOCKS = 512, 16
BLOCK_BYTES = 12 * WIDTH * WIDTH * 2  # one bf16 RWKV-7 block: 4 C x C projections, FFN 8 C^2

# Runs in a process of its own: a one-block conversion first (imports, MLX's first buffers),
# then the high-water mark reset (writing 5 to clear_refs) and the real one measured.
MEASURE = """
import json, sys
from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.convert import convert

def kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

warm, src, dst, to, quantize = sys.argv[1:6]
quantize = None if quantize == "none" else quantize
convert(warm, dst + ".warm" + (".pth" if dst.endswith(".pth") else ""), to=to, quantize=quantize)
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kb("VmRSS")
convert(src, dst, to=to, quantize=quantize)
print(json.dumps({"grew": kb("VmHWM") - base}))
"""


def _model(blocks: int) -> Model:
    cfg = mlx_rwkvx.models.ModelConfig(
        vocab_size=256, hidden_size=WIDTH, head_size=64, block_types=["rwkv7"] * blocks
    )
    model = Model(cfg, seed=1)
    model.set_dtype(mx.bfloat16)
    return model


def _write(model: Model, path, fmt: str) -> None:
    writer = {"native": write_native, "hf": write_hf, "pth": write_blinkdl}[fmt]
    writer(str(path), model.config, dict(tree_flatten(model.parameters())))


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("sources")
    big, small = _model(BLOCKS), _model(1)
    for fmt, name in (("native", "native"), ("hf", "hf"), ("pth", "model.pth")):
        _write(big, root / "big" / name, fmt)
        _write(small, root / "small" / name, fmt)
    return root


@pytest.mark.parametrize(
    "src, quantize, to",
    [
        ("native", None, "native"),
        ("native", "int4", "native"),
        ("native", "int8", "native"),
        ("hf", "int4", "native"),
        ("native", None, "hf"),
        ("native", None, "blinkdl"),
        ("model.pth", "int8", "native"),
        ("model.pth", None, "hf"),
    ],
)
def test_converting_holds_about_one_block(sources, tmp_path, src, quantize, to):
    dst = str(tmp_path / ("out.pth" if to == "blinkdl" else "out"))
    args = [str(sources / "small" / src), str(sources / "big" / src), dst, to, quantize or "none"]
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary
    grew = json.loads(run.stdout.splitlines()[-1])["grew"]
    # the whole model is 16 blocks (96 MB): holding it, as reading it whole did, grows by more
    assert grew < 3 * BLOCK_BYTES, f"grew {grew / 2**20:.1f} MB, a block is {BLOCK_BYTES >> 20} MB"
    # the same model as loading it whole, and quantizing it whole, makes
    want = mlx_rwkvx.load(str(sources / "big" / src))[0]
    if quantize:
        want.quantize(quantize)
    got = mlx_rwkvx.load(dst)[0]
    want, got = dict(tree_flatten(want.parameters())), dict(tree_flatten(got.parameters()))
    assert sorted(got) == sorted(want)
    for name, x in want.items():
        assert got[name].dtype == x.dtype and mx.array_equal(got[name], x).item(), name


# A model built from its config with random weights, nothing computed, then written: each
# tensor is drawn when the writer comes to it.
BUILD = """
import json, sys
from mlx_rwkvx.io.formats import write_native
from mlx_rwkvx.models import Model, ModelConfig
import mlx.core as mx
from mlx.utils import tree_flatten

def kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

def build_and_write(blocks, out):
    model = Model(ModelConfig(vocab_size=256, hidden_size=WIDTH, head_size=64,
                              block_types=["rwkv7"] * blocks), seed=1)
    model.set_dtype(mx.bfloat16)
    cfg, tensors = model.config, dict(tree_flatten(model.parameters()))
    del model  # the tensors' one holder: each is freed once written
    write_native(out, cfg, tensors)

build_and_write(1, sys.argv[1] + "/warm")
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kb("VmRSS")
build_and_write(BLOCKS, sys.argv[1] + "/big")
print(json.dumps({"grew": kb("VmHWM") - base}))
"""

# Loading a quantized checkpoint holds its tensors once: about the file's size, never twice.
LOAD = """
import json, os, sys
import mlx_rwkvx
from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.convert import convert

def kb(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field)) * 1024

mlx_rwkvx.load(sys.argv[1])
with open("/proc/self/clear_refs", "w") as f:
    f.write("5")
base = kb("VmRSS")
model, _ = mlx_rwkvx.load(sys.argv[2])
print(json.dumps({"grew": kb("VmHWM") - base}))
"""


def _grew(code: str, *args) -> int:
    run = subprocess.run(
        [sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    return json.loads(run.stdout.splitlines()[-1])["grew"]


def test_building_a_model_with_random_weights_holds_about_one_block(tmp_path):
    code = BUILD.replace("WIDTH", str(WIDTH)).replace("BLOCKS", str(BLOCKS))
    grew = _grew(code, tmp_path)
    assert grew < 3 * BLOCK_BYTES, f"grew {grew / 2**20:.1f} MB, a block is {BLOCK_BYTES >> 20} MB"
    model, _ = mlx_rwkvx.load(tmp_path / "big")  # what was drawn, whole
    assert model.layers[BLOCKS - 1].tmix.key.weight.dtype == mx.bfloat16


def test_loading_a_quantized_model_holds_it_once(sources, tmp_path):
    for blocks in ("small", "big"):
        convert(str(sources / blocks / "native"), str(tmp_path / blocks), quantize="int4")
    size = (tmp_path / "big" / "model.safetensors").stat().st_size
    grew = _grew(LOAD, tmp_path / "small", tmp_path / "big")
    assert grew < 1.25 * size, f"grew {grew / 2**20:.1f} MB, the file is {size / 2**20:.1f} MB"


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_a_tensor_holding_nan_is_refused_as_it_is_written(tmp_path, quantize):
    model = _model(2)
    model.layers[1].ffn.value.weight[0, 3] = float("nan")
    _write(model, tmp_path / "src", "native")
    with pytest.raises(CheckpointError, match=r"layers\.1\.ffn\.value\.weight holds NaN"):
        convert(str(tmp_path / "src"), str(tmp_path / "dst"), quantize=quantize)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # nothing written, no temporary
