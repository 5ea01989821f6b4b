"""Bad input, as a table: every case gets one clear error (its type, and a one-line message
naming the problem), leaves no file behind and changes no existing file.

Each case is (area, name, setup, act, error, message): ``setup(tmp)`` makes what the case needs
(a checkpoint, a damaged file) and returns it; ``act`` is the bad call. The files under ``tmp``
(and the committed fixtures) are compared before and after ``act``. CLI cases run ``main`` in
this process and turn its exit code 2 and one-line stderr (warnings counted, as a user's process
prints them) into ``CliError``.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import hashlib
import json
import os
import shutil
import zipfile
from collections import Counter

import mlx_rwkvx
import mlx_rwkvx.generate as gen_cli  # the command; ``from mlx_rwkvx import`` gives the function
from mlx_rwkvx import _runtime
from mlx_rwkvx import convert as convert_cli
from mlx_rwkvx import merge as merge_cli
from mlx_rwkvx import pretokenize as pretok_cli
from mlx_rwkvx import train as train_cli
from mlx_rwkvx.adapters.files import adapter_config, save_adapter_tensors
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.adapters.tensors import adapter_tensors
from mlx_rwkvx.errors import TargetError
from mlx_rwkvx.generation import Chat
from mlx_rwkvx.io import stream
from mlx_rwkvx.io.formats import CheckpointError, to_blinkdl, write_hf
from mlx_rwkvx.io.names import RwkvXNaming
from mlx_rwkvx.io.pth import Tensor, write_pth
from mlx_rwkvx.io.tokenizers import ByteTokenizer, HFTokenizer, WorldTokenizer, load_tokenizer
from mlx_rwkvx.models import Model, ModelConfig, preset, rwkv_x_block_types
from mlx_rwkvx.ops import empty_kv, moba_attention, moba_decode, wkv7
from mlx_rwkvx.ops.dispatch import DISPATCHERS
from mlx_rwkvx.tuner import merge as merging

import mlx.core as mx
import numpy as np
import pytest
from helpers import DATA, CliError, bpe_tokenizer, cli, rfa_cfg, rwkv7_cfg
from helpers.model_params import flat_params

# ----- what the cases start from -----------------------------------------------------------


def native(tmp, model=None):
    path = tmp / "ck"
    mlx_rwkvx.save(model or Model(rwkv7_cfg()), path)
    return path


def native_file(tmp):
    path = tmp / "ck.safetensors"
    mlx_rwkvx.save(Model(rwkv7_cfg()), path)
    return path


def hf_rwkv7(tmp):
    model = Model(rwkv7_cfg())
    write_hf(tmp / "hf", model.config, flat_params(model))
    return tmp / "hf"


def qwen2(tmp, **rewrite):
    """A Qwen2 folder with transformers 5's config layout (rope_parameters)."""
    model = Model(rfa_cfg(["qwen2"] * 2))
    write_hf(tmp / "qwen", model.config, flat_params(model))
    cfg = json.loads((tmp / "qwen" / "config.json").read_text())
    cfg.pop("rope_theta")
    cfg.update(
        rope_parameters={"rope_theta": 1e6, "rope_type": "default"},
        layer_types=["full_attention"] * 2,
        use_sliding_window=False,
        sliding_window=None,
        hidden_act="silu",
    )
    for key, value in rewrite.items():
        if value is DROP:
            cfg.pop(key)
        else:
            cfg[key] = value
    (tmp / "qwen" / "config.json").write_text(json.dumps(cfg))
    return tmp / "qwen"


DROP = object()


def pth(tmp):
    shutil.copy(DATA / "tiny_rwkv7.pth", tmp / "m.pth")
    return tmp / "m.pth"


def blinkdl_st(tmp, edit=None):
    model = Model(rwkv7_cfg())
    tensors = to_blinkdl(model.config, flat_params(model))
    if edit:
        edit(tensors)
    mx.save_safetensors(str(tmp / "b.safetensors"), tensors)
    return tmp / "b.safetensors"


def rwkvx_file(tmp, edit=None, *, width=64, suffix=".pth"):
    """A 4 + 2 block RWKV-X in its authors' names (``.pth`` as torch writes it, or
    ``.safetensors``), after ``edit(tensors)``."""
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=width,
        head_size=width // 2,
        block_types=rwkv_x_block_types(4, 2),
        n_q_heads=1,
    )
    tensors = RwkvXNaming(cfg.block_types).write(flat_params(Model(cfg)))
    if edit:
        edit(tensors)
    path = tmp / f"x{suffix}"
    if suffix == ".pth":
        write_pth(path, {n: Tensor(np.array(x), False) for n, x in tensors.items()})
    else:
        mx.save_safetensors(str(path), tensors)
    return path


def drop_prefix(tensors, prefix):
    for name in [n for n in tensors if n.startswith(prefix)]:
        del tensors[name]


def edit_config(path, **changes):
    """A checkpoint folder whose config.json has ``changes`` (DROP removes a field)."""
    cfg = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is DROP:
            cfg.pop(key)
        else:
            cfg[key] = value
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def edit_tensors(path, edit):
    """A checkpoint's weights file, rewritten after ``edit(tensors)``."""
    file = path / "model.safetensors" if path.is_dir() else path
    tensors, metadata = mx.load(str(file), return_metadata=True)
    edit(tensors)
    mx.save_safetensors(str(file), tensors, metadata=metadata)
    return path


def file_with(tmp, name, data: bytes):
    (tmp / name).write_bytes(data)
    return tmp / name


def truncated(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    return path


def malicious_pth(tmp):
    """A .pth whose pickle calls os.system: refused, never run."""
    payload = b"cos\nsystem\n(S'touch " + str(tmp / "pwned").encode() + b"'\ntR."
    with zipfile.ZipFile(tmp / "evil.pth", "w") as z:
        z.writestr("evil/data.pkl", payload)
    return tmp / "evil.pth"


def pth_with(tmp, edit):
    """The committed .pth fixture, re-zipped after ``edit(names)`` (drops entries)."""
    src = zipfile.ZipFile(DATA / "tiny_rwkv7.pth")
    with zipfile.ZipFile(tmp / "m.pth", "w") as z:
        for item in src.infolist():
            if edit(item.filename):
                z.writestr(item, src.read(item.filename))
    return tmp / "m.pth"


def tokenizer_beside(tmp, text: str):
    path = native(tmp)
    (path / "tokenizer.json").write_text(text)
    return path


def int8_native(tmp):
    model = Model(rwkv7_cfg(1, hidden_size=64)).quantize(bits=8)
    return native(tmp, model)


def failing_save(exc):
    """A save whose write fails part-way (a full disk, a read-only folder)."""

    def run(ctx):
        tmp, model = ctx

        def write(x):  # the header is written, the first tensor fails
            raise exc

        real = stream.raw_bytes
        stream.raw_bytes = write
        try:
            mlx_rwkvx.save(model, tmp / "ck", overwrite=True)
        finally:
            stream.raw_bytes = real

    return run


def saved_model(tmp):
    model = Model(rwkv7_cfg())
    native(tmp, model)
    return tmp, model


def readonly_parent(tmp):
    (tmp / "file").write_text("not a folder")
    return tmp / "file" / "ck"


# ----- ops and models ------------------------------------------------------------------------


def wkv_args(**change):
    shape = (1, 4, 1, 16)
    args = {n: mx.zeros(shape) for n in ("r", "log_w", "k", "v", "a", "b")}
    args["state"] = None
    args.update(change)
    return args


def run_wkv(args):
    state = args.pop("state")
    return wkv7(*args.values(), state)


def moba(q=(1, 8, 4, 8), k=(1, 8, 2, 8), v=None, chunk_size=4, top_k=2, dtype=None, kind=None):
    v = v or k
    arrays = [mx.zeros(s) for s in (q, k, v)]
    if dtype:
        arrays[1] = arrays[1].astype(dtype)
    if kind == "list":
        arrays[0] = np.zeros(q).tolist()
    if kind == "q_int":
        arrays = [a.astype(mx.int32) for a in arrays]
    return moba_attention(*arrays, chunk_size=chunk_size, top_k=top_k)


TINY = Model(rwkv7_cfg())
RWKV_X = Model(preset("rwkv-x-tiny"))
RFA = Model(rfa_cfg(["rwkv7", "qwen2"]))


def call_with_cache(model, cache, batch=1):
    return model(mx.zeros((batch, 3), dtype=mx.int32), cache)


def used_cache(model, batch):
    cache = model.make_cache()
    model(mx.zeros((batch, 3), dtype=mx.int32), cache)
    return cache


def other_chunk_cache():
    """The cache of an RWKV-X model with chunks of 3 (this one has 8), after 10 tokens."""
    cfg = preset("rwkv-x-tiny")
    cfg.moba_chunk_size = 3
    other = Model(cfg)
    cache = other.make_cache()
    other(mx.zeros((1, 10), dtype=mx.int32), cache)
    return cache


# ----- the table ------------------------------------------------------------------------------

E, T, C = CheckpointError, TypeError, CliError
V = ValueError
none = None  # a case without setup


def _cases():
    c = []

    def add(area, name, setup, act, error, match):
        c.append((area, name, setup, act, error, match))

    # load: paths and files
    load = mlx_rwkvx.load
    add("load", "missing path", None, lambda t: load(t / "nope"), E, "no such file or folder")
    add(
        "load",
        "a hub name offline, not cached",
        None,
        lambda t: load("pre-smal/model"),
        E,
        r"pre-smal/model: not a file or folder here, and pre-smal/model is not \(completely\) "
        "in the Hugging Face cache; HF_HUB_OFFLINE is set",
    )
    for value, quantize in ((float("nan"), None), (float("inf"), "int8")):
        add(  # as an adapter holding them is: the tensor named, before any answer is junk
            "load",
            f"a base model holding {value}" + (f", quantize={quantize}" if quantize else ""),
            lambda t, v=value: native(t, poisoned_model(v)),
            lambda p, q=quantize: load(p, quantize=q),
            E,
            r"layers\.0\.ffn\.value\.weight holds NaN or infinite values",
        )
    add("load", "int path", None, lambda t: load(123), T, "must be a str or a pathlib.Path")
    add("load", "bytes path", None, lambda t: load(b"x"), T, "must be a str or a pathlib.Path")
    add(
        "load",
        "folder without config",
        lambda t: (t / "d").mkdir() or t / "d",
        load,
        E,
        "needs config.json",
    )
    add(
        "load",
        "config not JSON",
        lambda t: edit_raw(native(t), "{oops"),
        load,
        E,
        "cannot read JSON",
    )
    add(
        "load",
        "config a JSON list",
        lambda t: edit_raw(native(t), "[1, 2]"),
        load,
        E,
        "unknown checkpoint|expected a JSON object",
    )
    add(
        "load",
        "unknown model_type",
        lambda t: edit_config(native(t), format=DROP, model_type="llama"),
        load,
        E,
        "model_type 'llama'",
    )
    add(
        "load",
        "unknown extension",
        lambda t: file_with(t, "m.bin", b"\0" * 64),
        load,
        E,
        "unknown checkpoint format",
    )
    add(
        "load",
        "safetensors of garbage",
        lambda t: file_with(t, "m.safetensors", b"x" * 99),
        load,
        E,
        "cannot read safetensors",
    )
    add(
        "load",
        "foreign safetensors",
        lambda t: save_st(t / "m.safetensors", {"w": mx.ones(3)}),
        load,
        E,
        "unknown safetensors checkpoint",
    )
    # native config: every field required, each value checked
    for field, value, match in (
        ("norm_eps", DROP, r"missing fields \['norm_eps'\]"),
        ("rope_theta", DROP, r"missing fields \['rope_theta'\]"),
        ("hidden_size", "32", "hidden_size must be an int >= 1, got '32'"),
        ("intermediate_size", 0, "intermediate_size must be an int >= 1, got 0"),
        ("rope_theta", -1, "rope_theta must be a finite number > 0, got -1"),
        ("norm_eps", 0, "norm_eps must be a finite number > 0"),
        ("block_types", ["rwkv7", "mamba"], r"block_types must be a non-empty list.*mamba"),
        ("vocab_size", 0, "vocab_size must be an int >= 1"),
        ("use_gate", "yes", "use_gate must be true or false"),
        ("surprise", 1, r"unknown fields \['surprise'\]"),
        ("quantization", {"bits": 1, "group_size": 64}, "quantization must be null"),
        ("head_size", 24, "head_size must be one of"),
    ):
        add(
            "load",
            f"native config {field}={value if value is not DROP else 'missing'}",
            lambda t, f=field, v=value: edit_config(native(t), **{f: v}),
            load,
            E,
            match,
        )
    add(
        "load",
        "native file config missing a field",
        lambda t: edit_meta(native_file(t), "norm_eps"),
        load,
        E,
        r"missing fields \['norm_eps'\]",
    )
    add(
        "load",
        "native file config not JSON",
        lambda t: edit_meta(native_file(t), None),
        load,
        E,
        "bad or missing 'config'",
    )
    add(
        "load",
        "weights missing",
        lambda t: rm(native(t) / "model.safetensors"),
        load,
        E,
        "missing model.safetensors",
    )
    add(
        "load",
        "weights truncated",
        lambda t: truncated(native(t) / "model.safetensors").parent,
        load,
        E,
        "cannot read safetensors",
    )
    add(
        "load",
        "a tensor missing",
        lambda t: edit_tensors(native(t), lambda d: d.pop("norm.weight")),
        load,
        E,
        r"missing tensors \['norm.weight'\]",
    )
    add(
        "load",
        "an extra tensor",
        lambda t: edit_tensors(native(t), lambda d: d.update(extra=mx.ones(2))),
        load,
        E,
        r"unexpected tensors \['extra'\]",
    )
    add(
        "load",
        "a wrong shape",
        lambda t: edit_tensors(native(t), lambda d: d.update({"norm.weight": mx.ones(31)})),
        load,
        E,
        r"norm.weight has shape \(31,\), expected \(32,\)",
    )
    add(
        "load",
        "an int32 weight",
        lambda t: edit_tensors(
            native(t), lambda d: d.update({"norm.weight": mx.ones(32, dtype=mx.int32)})
        ),
        load,
        E,
        "norm.weight has dtype mlx.core.int32, expected floating",
    )
    add(
        "load",
        "a bool weight",
        lambda t: edit_tensors(
            native(t), lambda d: d.update({"embed.weight": mx.ones((256, 32), dtype=mx.bool_)})
        ),
        load,
        E,
        "embed.weight has dtype mlx.core.bool, expected floating",
    )
    add(
        "load",
        "a float quantized weight",
        lambda t: edit_tensors(
            int8_native(t), lambda d: d.update({"lm_head.weight": mx.ones((256, 16))})
        ),
        load,
        E,
        "lm_head.weight has dtype mlx.core.float32, expected mlx.core.uint32",
    )
    # BlinkDL .pth and safetensors
    add(
        "load",
        ".pth not a zip",
        lambda t: file_with(t, "m.pth", b"not a zip"),
        load,
        E,
        "not a readable PyTorch zip",
    )
    add(
        "load",
        ".pth truncated",
        lambda t: truncated(pth(t)),
        load,
        E,
        "not a readable PyTorch zip|truncated",
    )
    add(
        "load",
        ".pth running code",
        malicious_pth,
        load,
        E,
        "refuses to load posix.system|refuses to load os.system",
    )
    add(
        "load",
        ".pth storage missing",
        lambda t: pth_with(t, lambda n: "/data/0" not in n or n.endswith("/data/0/")),
        load,
        E,
        "storage 0 is missing|truncated",
    )
    add(
        "load",
        "RWKV-X with RWKV blocks left over",
        lambda t: rwkvx_file(t, lambda d: drop_prefix(d, "rwkv.blocks.3.")),
        load,
        E,
        r"2 attention blocks for 3 RWKV blocks: .* never runs the last 1",
    )
    add(
        "load",
        "RWKV-X with a MoBA block missing",
        lambda t: rwkvx_file(t, lambda d: drop_prefix(d, "moba.0."), suffix=".safetensors"),
        load,
        E,
        r"moba\.0 is missing \(found \[1\]\)",
    )
    add(
        "load",
        "RWKV-X with a tensor of another model",
        lambda t: rwkvx_file(
            t, lambda d: d.update({"moba.0.att.rotary.inv_freq": d["rwkv.ln_out.bias"]})
        ),
        load,
        E,
        "unexpected tensor 'moba.0.att.rotary.inv_freq'",
    )
    add(
        "load",
        "RWKV-X of width 32",
        lambda t: rwkvx_file(t, width=32),
        load,
        E,
        "hidden size 32 is not a multiple of 64",
    )
    add(
        "load",
        ".pth without head",
        lambda t: blinkdl_st(t, lambda d: d.pop("head.weight")),
        load,
        E,
        r"missing tensors \['lm_head.weight'\]",
    )
    add(
        "load",
        "BlinkDL without ln0",
        lambda t: blinkdl_st(t, lambda d: d.pop("blocks.0.ln0.weight")),
        load,
        E,
        r"missing tensors \['ln0.weight'\]",
    )
    add(
        "load",
        "BlinkDL without a gate",
        lambda t: blinkdl_st(
            t, lambda d: [d.pop(f"blocks.{i}.att.g{j}") for i in (0, 1) for j in (1, 2)]
        ),
        load,
        E,
        r"missing tensors \['layers.0.tmix.gate",
    )
    add(
        "load",
        "BlinkDL unknown tensor",
        lambda t: blinkdl_st(t, lambda d: d.update({"blocks.0.att.zz": mx.ones(2)})),
        load,
        E,
        "unexpected tensor 'blocks.0.att.zz'",
    )
    add(
        "load",
        "BlinkDL int64 tensor",
        lambda t: blinkdl_st(t, lambda d: d.update({"ln_out.weight": mx.ones(32, dtype=mx.int64)})),
        load,
        E,
        "norm.weight has dtype mlx.core.int64, expected floating",
    )
    # Hugging Face RWKV-7
    for field, value, match in (
        ("norm_eps", DROP, "missing field 'norm_eps'"),
        ("hidden_size", 64, "hidden_size = 64, but the tensors say 32"),
        ("num_hidden_layers", 3, "num_hidden_layers = 3, but the tensors say 2"),
        ("head_dim", 32, "head_dim = 32, but the tensors say 16"),
        ("attn", {"layers": [1]}, "hybrid attention layers"),
        ("hidden_act", "relu", "squared ReLU"),
        ("norm_bias", False, "without bias"),
        ("value_dim", 64, "value_dim == hidden_size"),
        ("use_magic", True, r"fields \['use_magic'\] are not understood"),
        ("tie_word_embeddings", True, r"unexpected tensors \['lm_head.weight'\]"),
    ):
        add(
            "load",
            f"HF RWKV-7 {field}",
            lambda t, f=field, v=value: edit_config(hf_rwkv7(t), **{f: v}),
            load,
            E,
            match,
        )
    add(
        "load",
        "HF index names a missing shard",
        lambda t: write_index(hf_rwkv7(t), "model-00002.safetensors"),
        load,
        E,
        "lists shards that are missing",
    )
    add(
        "load",
        "HF stale shard repeats tensors",
        lambda t: copy_shard(hf_rwkv7(t)),
        load,
        E,
        "are in more than one shard",
    )
    add(
        "load",
        "HF folder without weights",
        lambda t: rm(hf_rwkv7(t) / "model.safetensors"),
        load,
        E,
        "no .safetensors weights",
    )
    # Hugging Face Qwen2
    for name, rewrite, match in (
        (
            "yarn RoPE",
            dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}),
            "RoPE type 'yarn' is not supported",
        ),
        (
            "4.x linear rope_scaling",
            dict(
                rope_parameters=DROP, rope_theta=1e6, rope_scaling={"type": "linear", "factor": 2.0}
            ),
            "RoPE type 'linear'",
        ),
        ("two RoPE bases", dict(rope_theta=10000.0), "disagrees with the top-level"),
        (
            "sliding window",
            dict(use_sliding_window=True, sliding_window=4),
            "sliding-window attention",
        ),
        (
            "sliding layer",
            dict(layer_types=["full_attention", "sliding_attention"]),
            "only full attention",
        ),
        ("gelu", dict(hidden_act="gelu"), "SwiGLU"),
        ("no hidden_size", dict(hidden_size=DROP), "missing field 'hidden_size'"),
        ("no num_hidden_layers", dict(num_hidden_layers=DROP), "missing field 'num_hidden_layers'"),
        ("quantized", dict(quantization_config={"bits": 4}), "quantized Hugging Face"),
        ("unknown field", dict(attention_sinks=4), r"fields \['attention_sinks'\]"),
        (
            "tied but a different head",
            dict(tie_word_embeddings=True),
            "lm_head.weight differs from the embedding",
        ),
        (
            "vocab size off",
            dict(vocab_size=200),
            r"embed.weight has shape \(256, 32\), "
            r"expected \(200, 32\)",
        ),
        (
            "rope_theta 0",
            dict(rope_parameters={"rope_theta": 0, "rope_type": "default"}),
            "rope_theta must be a finite number > 0",
        ),
    ):
        add("load", f"Qwen2 {name}", lambda t, r=rewrite: qwen2(t, **r), load, E, match)
    add(
        "load",
        "Qwen2 untied without a head",
        lambda t: edit_tensors(qwen2(t), lambda d: d.pop("lm_head.weight")),
        load,
        E,
        r"missing tensors \['lm_head.weight'\]",
    )
    add(
        "load",
        "Qwen2 o_proj bias",
        lambda t: edit_tensors(
            qwen2(t), lambda d: d.update({"model.layers.0.self_attn.o_proj.bias": mx.ones(32)})
        ),
        load,
        E,
        r"unexpected tensors \['layers.0.self_attn.o_proj.bias'\]",
    )
    # load arguments
    for arg, match in (
        (dict(quantize=True), "quantize must be one of"),
        (dict(quantize="int3"), "quantize must be one of"),
        (dict(quantize=8.0), "quantize must be one of"),
        (dict(dtype="float64"), "dtype must be one of"),
        (dict(dtype=mx.int32), "dtype must be one of"),
        (dict(dtype="bf16"), "dtype must be one of"),
    ):
        add("load", f"load({arg})", native, lambda p, a=arg: load(p, **a), V, match)
    add(
        "load",
        "int4 of an INT8 checkpoint",
        int8_native,
        lambda p: load(p, quantize="int4"),
        E,
        "stored in 8-bit; it cannot be loaded as 'int4'",
    )
    add(
        "load",
        "broken tokenizer.json",
        lambda t: tokenizer_beside(t, "{"),
        load,
        E,
        "cannot load tokenizer",
    )
    add("load", "malformed World vocabulary", lambda t: world_beside(t), load, E, "malformed entry")
    add(
        "load",
        "no tokenizer fits",
        lambda t: native(
            t,
            Model(rwkv7_cfg(1, vocab_size=1000)),
        ),
        load,
        E,
        "no tokenizer.json beside the checkpoint",
    )

    # save
    save = mlx_rwkvx.save
    add(
        "save",
        "onto a checkpoint",
        native,
        lambda p: save(Model(rwkv7_cfg()), p),
        E,
        "already exists and is not empty",
    )
    add(
        "save",
        "onto a single file",
        native_file,
        lambda p: save(Model(rwkv7_cfg()), p),
        E,
        "already exists",
    )
    add(
        "save",
        "overwrite a folder of other files",
        lambda t: file_with(t, "notes.txt", b"mine").parent,
        lambda p: save(Model(rwkv7_cfg()), p, overwrite=True),
        E,
        "not a checkpoint; refusing to replace",
    )
    add(
        "save",
        "folder name that is a file",
        lambda t: file_with(t, "ck", b"x"),
        lambda p: save(Model(rwkv7_cfg()), p, overwrite=True),
        E,
        "is a file; expected a folder",
    )
    add(
        "save",
        "file name that is a folder",
        lambda t: (t / "d.safetensors").mkdir() or t / "d.safetensors",
        lambda p: save(Model(rwkv7_cfg()), p, overwrite=True),
        E,
        "is a folder; expected a file name",
    )
    add(
        "save",
        "under a file",
        readonly_parent,
        lambda p: save(Model(rwkv7_cfg()), p),
        E,
        "is a file, not a folder",
    )
    add(
        "save",
        "full disk",
        saved_model,
        failing_save(RuntimeError("[write] Unable to write 4096 bytes to file.")),
        E,
        "cannot write .*disk full",
    )
    add(
        "save",
        "read-only folder",
        saved_model,
        failing_save(PermissionError(13, "Permission denied")),
        E,
        "cannot write \\(Permission denied\\)",
    )
    add(
        "save",
        "no space",
        saved_model,
        failing_save(OSError(28, "No space left on device")),
        E,
        "No space left on device",
    )
    add(
        "save",
        "not a model",
        None,
        lambda t: save({"w": mx.ones(2)}, t / "x"),
        T,
        "expected an mlx_rwkvx Model, got dict",
    )
    add(
        "save",
        "different tokenizer beside a file",
        lambda t: tokenizer_clash(t),
        lambda a: save(a[0], a[1], tokenizer=a[2]),
        E,
        "a different tokenizer.json is already",
    )
    add(
        "save",
        "int path",
        None,
        lambda t: save(Model(rwkv7_cfg()), 5),
        T,
        "must be a str or a pathlib.Path",
    )

    # convert (the CLI: exit 2, one line)
    main = convert_cli.main
    add(
        "convert",
        "missing source",
        None,
        lambda t: cli(main, t / "nope", t / "out"),
        C,
        "no such file or folder",
    )
    add(
        "convert",
        "existing destination",
        lambda t: (native(t), hf_rwkv7(t)),
        lambda p: cli(main, p[0], p[1]),
        C,
        "already exists and is not empty",
    )
    add(
        "convert",
        "hybrid to hf",
        lambda t: native(t, Model(preset("rwkv-x-tiny"))),
        lambda p: cli(main, p, p.parent / "o", "--to", "hf"),
        C,
        "only plain RWKV-7 models",
    )
    add(
        "convert",
        "blinkdl to a folder",
        native,
        lambda p: cli(main, p, p.parent / "o", "--to", "blinkdl"),
        C,
        r"the BlinkDL format is one \.pth or \.safetensors file",
    )
    add(
        "convert",
        "RFA in the RWKV-X authors' layout",
        lambda t: native(t, Model(rfa_cfg(["rwkv7", "qwen2"]))),
        lambda p: cli(main, p, p.parent / "o.pth", "--to", "rwkvx"),
        C,
        r"cannot write the RWKV-X authors' layout: blocks \['qwen2', 'rwkv7'\]",
    )
    add(
        "convert",
        "RWKV-X heads the authors' code cannot run",
        rwkv_x,
        lambda p: cli(main, p, p.parent / "o.pth", "--to", "rwkvx"),
        C,
        "head_size 16: their code fixes 64",
    )
    add(
        "convert",
        "quantized hf",
        native,
        lambda p: cli(main, p, p.parent / "o", "--to", "hf", "--quantize", "int8"),
        C,
        "only the native format holds",
    )
    add(
        "convert",
        "quantized source to blinkdl",
        int8_native,
        lambda p: cli(main, p, p.parent / "o.safetensors", "--to", "blinkdl"),
        C,
        "this model is quantized",
    )
    add(
        "convert",
        "state-tuned to hf",
        lambda t: native(t, tuned_model()),
        lambda p: cli(main, p, p.parent / "o", "--to", "hf"),
        C,
        "no place for trained initial states",
    )
    add(
        "convert",
        "to-rfa of RWKV-7",
        native,
        lambda p: cli(main, p, p.parent / "o", "--to-rfa"),
        C,
        "needs a Qwen2 checkpoint",
    )
    add(
        "convert",
        "to-rfa layer 99",
        qwen2,
        lambda p: cli(
            main, p, p.parent / "o", "--to-rfa", "--qwen-layers", "1,99", "--head-size", "16"
        ),
        C,
        r"--qwen-layers \[99\] outside",
    )
    add(
        "convert",
        "to-rfa head size 7",
        qwen2,
        lambda p: cli(main, p, p.parent / "o", "--to-rfa", "--head-size", "7"),
        C,
        "head_size must be one of",
    )
    add(
        "convert",
        "qwen-layers not numbers",
        qwen2,
        lambda p: cli(main, p, p.parent / "o", "--to-rfa", "--qwen-layers", "a,b"),
        C,
        "expected comma-separated integers",
    )
    add(
        "convert",
        "unknown --to",
        native,
        lambda p: cli(main, p, p.parent / "o", "--to", "gguf"),
        C,
        "invalid choice: 'gguf'",
    )
    add(
        "convert",
        "unknown --dtype",
        native,
        lambda p: cli(main, p, p.parent / "o", "--dtype", "float64"),
        C,
        "invalid choice: 'float64'",
    )
    add(
        "convert",
        "damaged source",
        lambda t: truncated(native(t) / "model.safetensors").parent,
        lambda p: cli(main, p, p.parent / "o"),
        C,
        "cannot read safetensors",
    )
    add(
        "convert",
        "full disk",
        native,
        lambda p: full_disk_cli(main, p),
        C,
        "cannot write .*disk full",
    )

    # the ops
    add(
        "ops",
        "wkv7 lists",
        None,
        lambda t: wkv7(*[[[[0.0]]]] * 6),
        T,
        "wkv7: r must be an mx.array, got list",
    )
    add(
        "ops",
        "wkv7 NumPy",
        None,
        lambda t: wkv7(*[np.zeros((1, 4, 1, 16))] * 6),
        T,
        "wkv7: r must be an mx.array, got ndarray",
    )
    add(
        "ops",
        "wkv7 NumPy state",
        None,
        lambda t: run_wkv(wkv_args(state=np.zeros((1, 1, 16, 16)))),
        T,
        "wkv7: state must be an mx.array",
    )
    add(
        "ops",
        "wkv7 int32 r",
        None,
        lambda t: run_wkv(wkv_args(r=mx.zeros((1, 4, 1, 16), dtype=mx.int32))),
        V,
        "wkv7: r has dtype mlx.core.int32, expected one of float32",
    )
    add(
        "ops",
        "wkv7 bf16 log_w",
        None,
        lambda t: run_wkv(wkv_args(log_w=mx.zeros((1, 4, 1, 16), dtype=mx.bfloat16))),
        V,
        "log_w has dtype mlx.core.bfloat16, expected float32",
    )
    add(
        "ops",
        "wkv7 k in another dtype",
        None,
        lambda t: run_wkv(wkv_args(k=mx.zeros((1, 4, 1, 16), dtype=mx.float16))),
        V,
        "k has dtype mlx.core.float16, expected mlx.core.float32 "
        r"\(that of r\)",
    )
    add(
        "ops",
        "wkv7 v shape",
        None,
        lambda t: run_wkv(wkv_args(v=mx.zeros((1, 4, 2, 16)))),
        V,
        r"v has shape \(1, 4, 2, 16\), expected \(1, 4, 1, 16\)",
    )
    add(
        "ops",
        "wkv7 N=24",
        None,
        lambda t: run_wkv(
            {n: mx.zeros((1, 4, 1, 24)) for n in "r log_w k v a b".split()} | {"state": None}
        ),
        V,
        "N in",
    )
    add(
        "ops",
        "wkv7 T=0",
        None,
        lambda t: run_wkv(
            {n: mx.zeros((1, 0, 1, 16)) for n in "r log_w k v a b".split()} | {"state": None}
        ),
        V,
        "T>=1",
    )
    add(
        "ops",
        "wkv7 r 3-D",
        None,
        lambda t: run_wkv(
            {n: mx.zeros((4, 1, 16)) for n in "r log_w k v a b".split()} | {"state": None}
        ),
        V,
        r"r must be \[B, T, H, N\]",
    )
    add(
        "ops",
        "wkv7 state shape",
        None,
        lambda t: run_wkv(wkv_args(state=mx.zeros((1, 2, 16, 16)))),
        V,
        r"state has shape \(1, 2, 16, 16\), expected \(1, 1, 16, 16\)",
    )
    add(
        "ops",
        "wkv7 bf16 state",
        None,
        lambda t: run_wkv(wkv_args(state=mx.zeros((1, 1, 16, 16), dtype=mx.bfloat16))),
        V,
        "state has dtype mlx.core.bfloat16, expected float32",
    )
    add("ops", "moba list", None, lambda t: moba(kind="list"), T, "q must be an mx.array")
    add("ops", "moba chunk 0", None, lambda t: moba(chunk_size=0), V, "chunk_size must be an int")
    add("ops", "moba chunk 2.5", None, lambda t: moba(chunk_size=2.5), V, "chunk_size must be")
    add("ops", "moba chunk True", None, lambda t: moba(chunk_size=True), V, "chunk_size must be")
    add("ops", "moba top_k str", None, lambda t: moba(top_k="2"), V, "top_k must be an int")
    add("ops", "moba zero KV heads", None, lambda t: moba(k=(1, 8, 0, 8)), V, "Hkv >= 1")
    add(
        "ops",
        "moba heads not a multiple",
        None,
        lambda t: moba(q=(1, 8, 3, 8)),
        V,
        "q has 3 heads, not a multiple of the 2 heads",
    )
    add("ops", "moba keys shorter", None, lambda t: moba(k=(1, 5, 2, 8)), V, "S >= 8")
    add(
        "ops",
        "moba dtypes differ",
        None,
        lambda t: moba(dtype=mx.float16),
        V,
        "k has dtype mlx.core.float16, expected mlx.core.float32",
    )
    add("ops", "moba int inputs", None, lambda t: moba(kind="q_int"), V, "q has dtype")
    add("ops", "moba q 3-D", None, lambda t: moba(q=(8, 4, 8)), V, r"q must be \[B, T, Hq, D\]")
    add("ops", "moba zero queries", None, lambda t: moba(q=(1, 0, 4, 8)), V, "none of them 0")
    add(
        "ops",
        "moba_decode of two tokens",
        None,
        lambda t: moba_decode(
            mx.zeros((1, 2, 2, 8)), *empty_kv(1, 2, 8, mx.float32), chunk_size=4, top_k=1
        ),
        V,
        r"q must be \[B, 1, Hq, D\] matching a non-empty cache",
    )

    # the model call
    tokens = mx.array([[1, 2, 3]])
    add("model", "tokens a list", None, lambda t: TINY([[1, 2]]), T, "must be an mx.array")
    add("model", "tokens NumPy", None, lambda t: TINY(np.array([[1, 2]])), T, "mx.array")
    add(
        "model",
        "float tokens",
        None,
        lambda t: TINY(mx.array([[1.0, 2.0]])),
        V,
        "tokens must be integer ids, got dtype mlx.core.float32",
    )
    add("model", "1-D tokens", None, lambda t: TINY(mx.array([1, 2])), V, r"\[B, T\]")
    add(
        "model",
        "no tokens",
        None,
        lambda t: TINY(mx.zeros((1, 0), dtype=mx.int32)),
        V,
        r"\[B, T\] with B, T >= 1",
    )
    add(
        "model",
        "id 1,000,000 (a segfault before)",
        None,
        lambda t: TINY(mx.array([[1, 1000000]])),
        V,
        r"token id 1000000 is outside the vocabulary \(0 .. 255\)",
    )
    add("model", "id = vocab size", None, lambda t: TINY(mx.array([[256]])), V, "token id 256")
    add("model", "negative id", None, lambda t: TINY(mx.array([[-1, 5]])), V, "token id -1")
    add(
        "model",
        "hidden() bad id",
        None,
        lambda t: TINY.hidden(mx.array([[999]])),
        V,
        "token id 999",
    )
    add(
        "model",
        "cache of another model",
        None,
        lambda t: call_with_cache(TINY, RWKV_X.make_cache()),
        V,
        "the cache has 6 entries for 2 layers",
    )
    add(
        "model",
        "cache of another kind",
        None,
        lambda t: call_with_cache(RFA, used_cache(TINY, 1)),
        V,
        r"state of layer 0 \(rwkv7 block\): expected a state with \['tmix_shift', 'wkv'\], got",
    )
    add(
        "model",
        "cache of another batch",
        None,
        lambda t: call_with_cache(TINY, used_cache(TINY, 2)),
        V,
        r"state of layer 0 \(rwkv7 block\): tmix_shift has shape \(2, 1, 32\) where \(1, 1, 32\)",
    )
    add(
        "model",
        "KV cache of another batch",
        None,
        lambda t: call_with_cache(RFA, [RFA.make_cache()[0], used_cache(RFA, 2)[1]]),
        V,
        r"state of layer 1 \(qwen2 block\): keys has shape \(2, 2, 3, 8\) where \(1, 2, 3, 8\)",
    )
    add(
        "model",
        "MoBA cache of another chunk size",
        None,
        lambda t: call_with_cache(RWKV_X, other_chunk_cache()),
        V,
        r"state of layer 2 \(moba block\): key_sums has shape \(1, 4, 4, 16\) where "
        r"\(1, 4, 2, 16\)",
    )
    add(
        "model",
        "cache not a list",
        None,
        lambda t: call_with_cache(TINY, "cache"),
        V,
        "the cache has str entries",
    )
    add(
        "model",
        "cache of a wider model",
        None,
        lambda t: call_with_cache(
            TINY,
            used_cache(
                Model(rwkv7_cfg(hidden_size=64)),
                1,
            ),
        ),
        V,
        r"shape \(1, 1, 64\) where \(1, 1, 32\)",
    )
    del tokens

    # ModelConfig
    for kw, match in (
        (dict(vocab_size=0), "vocab_size must be an int >= 1, got 0"),
        (dict(hidden_size=-64), "hidden_size must be an int >= 1, got -64"),
        (dict(hidden_size="64"), "hidden_size must be an int >= 1, got '64'"),
        (dict(hidden_size=64.0), "hidden_size must be an int"),
        (dict(head_size=24), "head_size must be one of"),
        (dict(hidden_size=40), "not a multiple of head_size"),
        (dict(intermediate_size=0), "intermediate_size must be an int >= 1, got 0"),
        (dict(decay_low_rank=-1), "decay_low_rank must be an int >= 1"),
        (dict(rope_theta=-1), "rope_theta must be a finite number > 0"),
        (dict(norm_eps=0), "norm_eps must be a finite number > 0"),
        (dict(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
        (dict(block_types="rwkv7"), "block_types must be a list of strings"),
        (dict(block_types=[]), "block_types must be a non-empty list"),
        (dict(block_types=["mamba"]), r"non-empty list .* got \['mamba'\]"),
        (dict(n_q_heads=4, n_kv_heads=3), "not a multiple of n_kv_heads 3"),
        (dict(n_kv_heads=0), "n_kv_heads must be an int >= 1"),
        (dict(moba_chunk_size=0), "moba_chunk_size must be an int >= 1"),
        (dict(moba_top_k=1.5), "moba_top_k must be an int"),
        (dict(use_gate="yes"), "use_gate must be true or false"),
        (dict(tie_embeddings=None), "tie_embeddings must be true or false"),
        (dict(rwkv_norm="batch"), "rwkv_norm must be one of"),
        (dict(n_q_heads=0), "n_q_heads must be an int >= 1"),
        (dict(attn_head_dim=-8), "attn_head_dim must be an int >= 1"),
    ):
        args = dict(vocab_size=256, hidden_size=64, head_size=16) | kw
        add("config", f"ModelConfig({kw})", None, lambda t, a=args: ModelConfig(**a), V, match)
    add("config", "unknown preset", None, lambda t: preset("gpt-2"), V, "unknown preset 'gpt-2'")
    add(
        "config",
        "RWKV-X with no RWKV block",
        None,
        lambda t: rwkv_x_block_types(0, 1),
        V,
        "need n_rwkv >= 1",
    )
    add(
        "config",
        "from_dict unknown field",
        None,
        lambda t: ModelConfig.from_dict({"size": 1}),
        V,
        r"unknown fields \['size'\]",
    )

    # malformed fields, stray tensors, exports, quantizing twice
    add(
        "load",
        "Qwen2 heads as a string",
        lambda t: qwen2(t, num_attention_heads="4"),
        load,
        E,
        "num_attention_heads = '4': expected an integer >= 1",
    )
    add(
        "load",
        "HF RWKV-7 hidden_ratio not a number",
        lambda t: edit_config(hf_rwkv7(t), intermediate_size=DROP, hidden_ratio="four"),
        load,
        E,
        "hidden_ratio = 'four': expected a number",
    )
    add(
        "load",
        "a 1-D embedding in a BlinkDL file",
        lambda t: blinkdl_st(t, lambda d: d.update({"emb.weight": mx.ones(32)})),
        load,
        E,
        r"embed.weight has shape \(32,\), expected a matrix",
    )
    add(
        "load",
        "a state0 for a layer that is not there",
        lambda t: edit_tensors(
            native(t), lambda d: d.update({"layers.7.tmix.state0": mx.zeros((2, 16, 16))})
        ),
        load,
        E,
        r"unexpected tensors \['layers.7.tmix.state0'\]",
    )
    add(
        "save",
        "overwrite dropping another tokenizer",
        lambda t: file_with(native(t), "tokenizer.json", b"{}").parent,
        lambda p: save(Model(rwkv7_cfg()), p, overwrite=True),
        E,
        r"replacing it would drop \['tokenizer.json'\]",
    )
    add(
        "convert",
        "Qwen2 with ln0 to hf",
        lambda t: native(
            t,
            Model(
                ModelConfig(
                    vocab_size=256,
                    hidden_size=32,
                    head_size=16,
                    block_types=["qwen2"],
                    n_q_heads=4,
                    n_kv_heads=2,
                    intermediate_size=48,
                )
            ),
        ),
        lambda p: cli(main, p, p.parent / "o", "--to", "hf"),
        C,
        "a Qwen2 model for Hugging Face has no ln0",
    )
    add(
        "ops",
        "moba_decode chunk 0",
        None,
        lambda t: moba_decode(
            mx.zeros((1, 1, 2, 8)), *empty_kv(1, 2, 8, mx.float32), chunk_size=0, top_k=1
        ),
        V,
        "moba_decode: chunk_size must be an int >= 1",
    )
    add(
        "model",
        "quantize twice",
        None,
        lambda t: Model(rwkv7_cfg(1, hidden_size=64)).quantize(8).quantize(4),
        V,
        "already quantized",
    )
    add(
        "model",
        "quantize to 3 bits",
        None,
        lambda t: Model(rwkv7_cfg()).quantize(3),
        V,
        "quantize must be one of",
    )
    add(
        "config",
        "MoBA with grouped KV heads",
        None,
        lambda t: ModelConfig(
            vocab_size=256,
            hidden_size=64,
            head_size=16,
            block_types=["rwkv7", "moba"],
            n_q_heads=4,
            n_kv_heads=2,
        ),
        V,
        "only qwen2 blocks have grouped KV heads",
    )

    # tokenizers
    world = WORLD
    add("tokenizer", "World encode bytes", None, lambda t: world.encode(b"hi"), T, "expected a str")
    add(
        "tokenizer",
        "World decode unknown id",
        None,
        lambda t: world.decode([99999]),
        V,
        "unknown token id 99999",
    )
    add(
        "tokenizer",
        "World lone surrogate",
        None,
        lambda t: world.encode("a\ud800b"),
        V,
        "not valid Unicode",
    )
    add(
        "tokenizer",
        "World vocab missing",
        None,
        lambda t: WorldTokenizer(str(t / "no.txt")),
        V,
        "cannot read the World vocabulary",
    )
    add(
        "tokenizer",
        "World vocab malformed",
        lambda t: file_with(t, "v.txt", b"1 'a' 2\n"),
        lambda p: WorldTokenizer(str(p)),
        V,
        "malformed entry",
    )
    add(
        "tokenizer",
        "World vocab empty",
        lambda t: file_with(t, "v.txt", b"\n"),
        lambda p: WorldTokenizer(str(p)),
        V,
        "is empty",
    )
    add(
        "tokenizer",
        "bytes decode 256",
        None,
        lambda t: ByteTokenizer().decode([256]),
        V,
        "outside 0..255",
    )
    add(
        "tokenizer",
        "bytes past a small vocabulary",
        None,
        lambda t: ByteTokenizer(100).encode("~"),
        V,
        "not in this model's vocabulary of 100 tokens",
    )
    add(
        "tokenizer",
        "HF tokenizer.json garbage",
        lambda t: file_with(t, "tokenizer.json", b"{").parent,
        lambda p: HFTokenizer(str(p)),
        V,
        "cannot load tokenizer",
    )
    add(
        "tokenizer",
        "HF decode out of range",
        bpe_tokenizer,
        lambda tok: tok.decode([10**6]),
        V,
        "outside 0..",
    )
    add(
        "tokenizer",
        "no tokenizer for 1000 tokens",
        None,
        lambda t: load_tokenizer(str(t), 1000),
        V,
        "neither RWKV World's",
    )

    # the commands' and the Python API's bad inputs (each refused before any work)
    _command_cases(add)
    return c


def _command_cases(add):
    nan = float("nan")

    # train: settings out of range or not for the --mode, outputs over inputs
    for flags, match in (
        (["--lr", "nan"], "lr must be a finite number, got nan"),
        (["--lr", "inf"], "lr must be a finite number, got inf"),
        (["--lora-alpha", "nan"], "lora-alpha must be a finite number"),
        (["--grad-clip", "nan"], "grad-clip must be a finite number"),
        (["--seed", "-1"], r"seed must be in 0 .. 2\^64 - 1"),
        (["--seed", str(2**64)], r"seed must be in 0 .. 2\^64 - 1"),
        (["--init", "seeds"], "--init applies to --mode pretrain, not --mode lora"),
        (
            ["--mode", "state", "--lora-rank", "8"],
            "--lora-rank applies to --mode lora, dora, pissa or miss, not --mode state",
        ),
        (
            ["--mode", "full", "--lora-dropout", "0.1"],
            "--lora-dropout applies to --mode lora, dora, pissa or miss, not --mode full",
        ),
        (["--lora-rank", "100000"], "--lora-rank 100000 is above the size of .* at most 32"),
    ):
        add("train", " ".join(flags), run_inputs, train_run(*flags), C, match)
    add(
        "train",
        "--output the --data folder",
        run_inputs,
        lambda p: train_run()((p[0], p[1], p[1])),
        C,
        "is the --data",
    )
    add(
        "train",
        "--mode full writing over its --model",
        lambda t: run_inputs(t, model_at="run/model", output="run"),
        train_run("--mode", "full"),
        C,
        "would write over the --model",
    )

    # the environment: a run stops at its start
    add(
        "env",
        "MLX_RWKVX_CACHE_LIMIT=2**70",
        run_inputs,
        lambda p: inside(environ(MLX_RWKVX_CACHE_LIMIT=str(2**70)), on_cpu(), train_run(), p),
        C,
        "MLX_RWKVX_CACHE_LIMIT=.*expected a number of bytes",
    )
    for name, act in (("train", train_run()), ("generate", lambda p: generate_run()(p[0]))):
        add(
            "env",
            f"MLX_RWKVX_WKV7=kernel without a kernel ({name})",
            run_inputs,
            lambda p, act=act: inside(environ(MLX_RWKVX_WKV7="kernel"), no_kernel(), act, p),
            C,
            r"wkv7: MLX_RWKVX_WKV7='kernel', but this device has no wkv7 kernel",
        )

    # data, as training reads it (the byte tokenizer: RWKV's User:/Assistant: chat format)
    wizard = {
        "messages": [{"role": "wizard", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    }
    for name, records, match in (
        (
            "a chat role RWKV has no name for",
            [wizard],
            "role 'wizard': RWKV's chat format has system, user, assistant turns only",
        ),
        (
            "text and messages in one record",
            [{"text": "hi", "messages": wizard["messages"]}],
            "holds the fields of several formats",
        ),
        (
            "a NUL in a text",
            [{"text": "ab\x00cd"}],
            r"a NUL character at token \d+ encodes to the end-of-text token \(id 0\)",
        ),
        (
            "JSON nested 100,000 deep",
            ["[" * 100_000 + "]" * 100_000],
            "JSON nested too deeply to read",
        ),
    ):
        add("data", name, lambda t, r=records: run_inputs(t, r), train_run(), C, match)
    add(
        "data",
        "train.jsonl a symbolic link to itself",
        lambda t: run_inputs(t, link="train.jsonl"),
        train_run(),
        C,
        "a broken symbolic link, or one that loops",
    )
    add(
        "data",
        "an unreadable data folder",
        run_inputs,
        lambda p: inside(permission_denied(os, "listdir", p[1]), train_run(), p),
        C,
        r"cannot read the folder \(Permission denied\)",
    )
    add(
        "data",
        "an unreadable data file",
        run_inputs,
        lambda p: inside(permission_denied(builtins, "open", p[1] / "train.jsonl"), train_run(), p),
        C,
        r"cannot read it \(Permission denied\)",
    )
    for name, records, match in (
        ("pretokenize a NUL in a text", [{"text": "ab\x00cd"}], "a NUL character at token"),
        ("pretokenize a wizard", [wizard], "role 'wizard': RWKV's chat format has"),
    ):
        add(
            "data",
            name,
            lambda t, r=records: jsonl(t, r),
            pretok_run("--tokenizer", "bytes"),
            C,
            match,
        )
    add(
        "data",
        "pretokenize text without --tokenizer",
        jsonl,
        pretok_run(),
        C,
        "'bytes' for a byte-level model",
    )

    # generate
    for flags, match in (
        (["--temp", "nan"], "--temp must be a finite number, got nan"),
        (["--top-p", "nan"], "--top-p must be a finite number, got nan"),
        (["--repetition-penalty", "nan"], "--repetition-penalty must be a finite number"),
        (["--seed", "-1"], r"--seed must be in 0 .. 2\^64 - 1"),
        (["--chat"], "--prompt answers once, --chat is a conversation"),
        (["--system", "s", "--ignore-chat-template"], "--system with --ignore-chat-template"),
        (
            ["--chat-template", "chatml", "--ignore-chat-template"],
            "--chat-template with --ignore-chat-template",
        ),
        (
            ["--no-window", "--max-cache", "4", "--ignore-chat-template"],
            "9 tokens do not fit in the KV cache of 4",
        ),  # a prompt longer than the cache, which --no-window does not slide
    ):
        setup = rwkv_x if "--no-window" in flags else native
        add("generate", " ".join(flags), setup, generate_run(*flags, prompt="hi, there"), C, match)
    add(
        "generate",
        "--chat-template a data file",
        lambda t: (native(t), jsonl(t, [{"text": "hi"}])),
        lambda p: generate_run("--chat-template", p[1])(p[0]),
        C,
        "does not render the messages",
    )
    add(
        "generate",
        "--model a base model holding NaN",
        lambda t: native(t, poisoned_model(nan)),
        generate_run(),
        C,
        "holds NaN or infinite values",
    )
    for name, kind, leaf, value in (
        ("LoRA", "lora", "lora_b", nan),
        ("state", "state", "state0", float("inf")),
    ):
        add(
            "generate",
            f"--adapter a {name} adapter holding {value}",
            lambda t, k=kind, f=leaf, v=value: adapter(t, k, poison(f, v)),
            lambda p: generate_run("--adapter", p[1])(p[0]),
            C,
            "holds NaN or infinite values",
        )

    # merge
    for weights in ("1e308,1e308", "nan,1"):
        add(
            "merge",
            f"--weights {weights}",
            two_adapters,
            merge_run("--weights", weights),
            C,
            "the weights must be finite and non-negative with a positive, finite sum",
        )
    add(
        "merge",
        "--fuse-into with a state adapter",
        lambda t: adapter(t, "state"),
        lambda p: cli(merge_cli.main, p[1], "--fuse-into", p[0], "--output", p[0].parent / "f"),
        C,
        "a state-tuning adapter has no weights to fuse",
    )

    # convert: the --to-rfa settings without --to-rfa
    for flags in (["--head-size", "32"], ["--qwen-layers", "1"]):
        add(
            "convert",
            f"{flags[0]} without --to-rfa",
            native,
            lambda p, f=flags: cli(convert_cli.main, p, p.parent / "o", *f),
            C,
            f"{flags[0]} sets up --to-rfa: it needs --to-rfa",
        )

    # the Python API
    tok = ByteTokenizer()
    for name, model, tokenizer, kw, error, match in (
        ("a model of None", None, tok, {}, T, "model must be an mlx_rwkvx Model"),
        ("a tokenizer of None", TINY, None, {}, T, "tokenizer must have encode"),
        ("sampler=42", TINY, tok, dict(sampler=42), T, "sampler must be a function"),
        ("temp=nan", TINY, tok, dict(temp=nan), V, "temp must be a finite number"),
        ("seed=-1", TINY, tok, dict(seed=-1), V, r"seed must be in 0 .. 2\^64 - 1, got -1"),
    ):
        add(
            "api",
            f"generate with {name}",
            None,
            lambda t, m=model, k=tokenizer, a=kw: mlx_rwkvx.generate(m, k, "x", **a),
            error,
            match,
        )
    add(
        "api",
        "load with a NaN adapter",
        lambda t: adapter(t, "lora", poison("lora_b", nan)),
        lambda p: mlx_rwkvx.load(p[0], adapter=p[1]),
        V,
        "holds NaN or infinite values",
    )
    add(
        "api",
        "Chat.load of a NaN state",
        saved_chat,
        lambda p: Chat(p[0], p[1]).load(p[2]),
        V,
        "holds NaN or infinite values",
    )
    add(
        "api",
        "Model(None)",
        None,
        lambda t: Model(None),
        T,
        "Model: expected a ModelConfig, got NoneType",
    )
    add(
        "api",
        "init_state(-1)",
        None,
        lambda t: TINY.init_state(-1),
        V,
        "init_state: batch must be a positive int",
    )
    add(
        "api",
        "merge by an unknown method",
        two_adapters,
        lambda p: merging.merge(read_all(p[1:]), "bogus", np.array([0.5, 0.5])),
        merging.MergeError,
        "unknown method 'bogus'",
    )
    add(
        "api",
        "merge with one weight for two adapters",
        two_adapters,
        lambda p: merging.merge(read_all(p[1:]), "fedavg", np.array([1.0])),
        merging.MergeError,
        "one weight per adapter summing to 1",
    )
    add(
        "api",
        "save to an empty path",
        None,
        lambda t: mlx_rwkvx.save(Model(rwkv7_cfg()), ""),
        TargetError,
        "the path is empty",
    )


WORLD = WorldTokenizer()


def edit_raw(path, text):
    (path / "config.json").write_text(text)
    return path


def edit_meta(path, drop):
    tensors, meta = mx.load(str(path), return_metadata=True)
    if drop is None:
        meta["config"] = "{not json"
    else:
        cfg = json.loads(meta["config"])
        cfg.pop(drop)
        meta["config"] = json.dumps(cfg)
    mx.save_safetensors(str(path), tensors, metadata=meta)
    return path


def save_st(path, tensors):
    mx.save_safetensors(str(path), tensors)
    return path


def rm(path):
    os.remove(path)
    return path.parent


def write_index(folder, extra_shard):
    tensors = mx.load(str(folder / "model.safetensors"))
    weight_map = dict.fromkeys(tensors, "model.safetensors")
    weight_map["lm_head.weight"] = extra_shard
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return folder


def copy_shard(folder):
    shutil.copy(folder / "model.safetensors", folder / "model-old.safetensors")
    return folder


def world_beside(tmp):
    path = native(
        tmp,
        Model(rwkv7_cfg(1, vocab_size=65536)),
    )
    (path / "rwkv_vocab_v20230424.txt").write_text("1 'a' 5\n")
    return path


def tuned_model():
    model = Model(rwkv7_cfg())
    model.layers[0].tmix.enable_state_tuning()
    return model


def tokenizer_clash(tmp):
    tokenizer = bpe_tokenizer(tmp / "a")
    (tmp / "tokenizer.json").write_text("{}")  # another model's, beside where we save
    return Model(rwkv7_cfg(1, vocab_size=512)), tmp / "m.safetensors", tokenizer


def full_disk_cli(main, src):
    def write(x):  # the header is written, the first tensor fails
        raise RuntimeError("[write] Unable to write 4096 bytes to file.")

    real = stream.raw_bytes
    stream.raw_bytes = write
    try:
        cli(main, src, src.parent / "out")
    finally:
        stream.raw_bytes = real


# The commands' inputs.

TEXTS = [{"text": "hello world"}, {"text": "a small text"}]


def jsonl(tmp, records=None, name="d.jsonl"):
    """A JSONL file of ``records`` (a str is a raw line)."""
    records = TEXTS if records is None else records
    lines = (r if isinstance(r, str) else json.dumps(r) for r in records)
    (tmp / name).write_text("".join(line + "\n" for line in lines))
    return tmp / name


def run_inputs(tmp, records=None, *, model_at="ck", output="out", link=None):
    """What a training run reads and writes: (a tiny native model with the byte tokenizer, an
    mlx-lm data folder whose train.jsonl holds ``records`` or is a symbolic link to ``link``,
    the output folder)."""
    model = tmp / model_at
    model.parent.mkdir(parents=True, exist_ok=True)
    mlx_rwkvx.save(Model(rwkv7_cfg()), model)
    (tmp / "data").mkdir()
    if link:
        os.symlink(link, tmp / "data" / "train.jsonl")
    else:
        jsonl(tmp / "data", records, "train.jsonl")
    return model, tmp / "data", tmp / output


def train_run(*flags):
    """The train command on (model, data, output)."""
    return lambda p: cli(
        train_cli.main, "--model", p[0], "--data", p[1], "--output", p[2], "--iters", 1, *flags
    )


def generate_run(*flags, prompt="hi"):
    return lambda model: cli(gen_cli.main, "--model", model, "--prompt", prompt, *flags)


def merge_run(*flags):
    """The merge command on (base, adapter, ...): the adapters merged into m.safetensors."""
    return lambda p: cli(merge_cli.main, *p[1:], "--output", p[0].parent / "m.safetensors", *flags)


def pretok_run(*flags):
    return lambda data: cli(
        pretok_cli.main, "--data", data, "--output", data.parent / "o.bin", *flags
    )


def inside(*managers_call_arg):
    """``call(arg)`` inside the context managers given before them."""
    *managers, call, arg = managers_call_arg
    with contextlib.ExitStack() as stack:
        for manager in managers:
            stack.enter_context(manager)
        return call(arg)


def rwkv_x(tmp):
    return native(tmp, Model(preset("rwkv-x-tiny")))


@contextlib.contextmanager
def environ(**values):
    """``os.environ`` with ``values``, read afresh by ``mlx_rwkvx.configure``; both put back."""
    old, done = {k: os.environ.get(k) for k in values}, _runtime._done
    os.environ.update(values)
    _runtime._done = False
    try:
        yield
    finally:
        _runtime._done = done
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def on_cpu():
    """MLX's default device the CPU, whose buffer cache MLX_RWKVX_CACHE_LIMIT sets."""
    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        yield
    finally:
        mx.set_default_device(device)


@contextlib.contextmanager
def no_kernel():
    """No wkv7 kernel, as on a CPU, whatever this machine has."""
    dispatcher = DISPATCHERS["wkv7"]
    real = dispatcher.kernels
    dispatcher.kernels = lambda key=None: ()
    try:
        yield
    finally:
        dispatcher.kernels = real


@contextlib.contextmanager
def permission_denied(module, name, path):
    """``module.name(path)`` (``os.listdir``, ``open``) fails as it does without permission:
    the tests may run as root, who may read anything."""
    real = getattr(module, name)

    def refuse(file=".", *args, **kwargs):
        if isinstance(file, (str, os.PathLike)) and os.path.abspath(file) == str(path):
            raise PermissionError(errno.EACCES, "Permission denied", os.fspath(file))
        return real(file, *args, **kwargs)

    setattr(module, name, refuse)
    try:
        yield
    finally:
        setattr(module, name, real)


def poisoned_model(value) -> Model:
    """The tiny model with one element of ``layers.0.ffn.value.weight`` set to ``value``."""
    model = Model(rwkv7_cfg())
    w = model.layers[0].ffn.value.weight
    model.layers[0].ffn.value.weight = mx.where(mx.arange(w.size).reshape(w.shape) == 5, value, w)
    return model


def poison(leaf, value):
    """An edit of adapter tensors: the first ``*.leaf`` filled with ``value``."""

    def edit(tensors):
        name = next(n for n in sorted(tensors) if n.endswith("." + leaf))
        tensors[name] = mx.full(tensors[name].shape, value)

    return edit


def adapter(tmp, kind="lora", edit=None, name="a.safetensors"):
    """(the tiny native model, an adapter of it: LoRA of rank 4 or state tuning), the adapter's
    tensors passed through ``edit``."""
    base = tmp / "ck"
    if not base.exists():
        native(tmp)
    model, _ = mlx_rwkvx.load(base)
    if kind == "state":
        paths = enable_state_tuning(model)
    else:
        paths = target_paths(model, "rwkv")
        apply_lora(model, paths, rank=4, alpha=8.0)
    config = adapter_config(
        model,
        fine_tune_type=kind,
        paths=paths,
        rank=4,
        alpha=8.0,
        base_fingerprint=fingerprint(model),
        seed=0,
    )
    tensors = adapter_tensors(model)
    if edit:
        edit(tensors)
    save_adapter_tensors(tmp / name, tensors, config)
    return base, tmp / name


def two_adapters(tmp):
    """(the tiny native model, two LoRA adapters of it from one init seed)."""
    base, a = adapter(tmp, name="a.safetensors")
    return base, a, adapter(tmp, name="b.safetensors")[1]


def read_all(paths):
    return [merging.read(p) for p in paths]


def saved_chat(tmp):
    """(model, tokenizer, a conversation saved after one short answer whose state was then
    edited to hold NaN)."""
    model, tok = Model(rwkv7_cfg()), ByteTokenizer()
    chat = Chat(model, tok)
    for _ in chat.ask("hi", max_tokens=2):
        pass
    chat.save(tmp / "chat.safetensors")
    tensors, meta = mx.load(str(tmp / "chat.safetensors"), return_metadata=True)
    for name, x in tensors.items():
        if name.startswith("state.") and mx.issubdtype(x.dtype, mx.floating):
            tensors[name] = mx.full(x.shape, float("nan"))
    mx.save_safetensors(str(tmp / "chat.safetensors"), tensors, metadata=meta)
    return model, tok, tmp / "chat.safetensors"


CASES = _cases()


def _snapshot(*roots) -> dict:
    out = {}
    for root in roots:
        for dirpath, dirnames, files in os.walk(root):
            for name in dirnames:
                out[os.path.join(dirpath, name)] = "dir"
            for name in files:
                path = os.path.join(dirpath, name)
                if os.path.islink(path):  # by its target: a link that loops cannot be read
                    out[path] = "link to " + os.readlink(path)
                    continue
                with open(path, "rb") as f:
                    out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}: {c[1]}" for c in CASES])
def test_bad_input(tmp_path, case):
    _, _, setup, act, error, match = case
    arg = setup(tmp_path) if setup else tmp_path
    before = _snapshot(tmp_path, DATA)
    with pytest.raises(error, match=match) as info:
        act(arg)
    assert "\n" not in str(info.value), "the message must be one line"
    assert _snapshot(tmp_path, DATA) == before, "files were left behind or changed"


def test_table_size():
    # every area's bad inputs stay in the table: the library's (load to tokenizer), the
    # commands' (train, generate, merge, data), the environment's and the Python API's
    by_area = Counter(c[0] for c in CASES)
    assert len(CASES) >= 257 and set(by_area) == {
        "load",
        "save",
        "convert",
        "ops",
        "model",
        "config",
        "tokenizer",
        "train",
        "generate",
        "merge",
        "data",
        "api",
        "env",
    }, by_area
