"""Adapter targets (presets, globs, last N blocks), LoRA/DoRA on them through mlx-lm's layers,
state tuning, trainable counts, and the base model's fingerprint."""

import mlx_rwkvx
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import default_targets, target_paths
from mlx_rwkvx.adapters.tensors import adapter_tensors, trainable_count
from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.models import Model, preset, rfa_config

import mlx.core as mx
import numpy as np
import pytest
from helpers import rfa_cfg, rwkv7_cfg
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.tuner.lora import LoRALinear
from oracle.common import rel_err


def test_presets_by_family():
    rwkv_x = Model(preset("rwkv-x-tiny"))  # rwkv7, rwkv7, moba, rwkv7, rwkv7, moba
    assert default_targets(rwkv_x) == "attn"
    paths = target_paths(rwkv_x, "attn")
    assert len(paths) == 12 and all(p.split(".")[1] in ("2", "5") for p in paths)
    assert "layers.2.ffn.key" in paths and "layers.0.ffn.key" not in paths
    rfa = Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64))
    assert default_targets(rfa) == "qwen"
    assert len(target_paths(rfa, "qwen")) == 14  # 7 a Qwen2 block
    assert len(target_paths(rfa, "rwkv")) == 14  # ARWKV: 4 time-mix + SwiGLU's 3
    rwkv7 = Model(rwkv7_cfg(3, hidden_size=64))
    assert default_targets(rwkv7) == "rwkv"
    assert len(target_paths(rwkv7, "rwkv")) == 18  # 4 time-mix + 2 channel-mix, 3 blocks
    # all: no low-rank projection, no embedding, no head
    every = target_paths(rwkv7, "all")
    assert len(every) == 18 and not any(".decay." in p or ".gate." in p for p in every)


def test_globs_and_last_layers():
    model = Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64))
    assert target_paths(model, "layers.*.self_attn.q_proj, layers.0.tmix.key") == [
        "layers.0.tmix.key",
        "layers.1.self_attn.q_proj",
        "layers.3.self_attn.q_proj",
    ]
    assert target_paths(model, "qwen", num_layers=1) == sorted(
        f"layers.3.{p}"
        for p in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    )
    with pytest.raises(AdapterError, match="match no projection in the last 1 blocks"):
        target_paths(model, "layers.0.*", num_layers=1)
    with pytest.raises(AdapterError, match="match no projection"):
        target_paths(model, "layers.*.nothing")
    with pytest.raises(AdapterError, match="num_layers must be an int >= 1"):
        target_paths(model, "qwen", num_layers=0)
    # more blocks than the model has: all of them, as mlx-lm's 16 on a smaller model
    assert target_paths(model, "qwen", num_layers=9) == target_paths(model, "qwen")


def test_rfa_preset_trainable_count_matches_foundrys():
    # rfa_train's manual: ~9.2M LoRA parameters at rank 32 on the 1.5B RFA model's 49 Qwen2
    # projections (7 blocks x Q, K, V, O, gate, up, down); nothing is computed here
    model = Model(preset("rfa-1.5b"), init=None)
    paths = target_paths(model, "qwen")
    assert len(paths) == 49
    apply_lora(model, paths, rank=32, alpha=64)
    # per block: (1536+1536) + 2 (1536+256) + (1536+1536) + 3 (1536+8960), times rank 32
    assert trainable_count(model) == 7 * 32 * (2 * 3072 + 2 * 1792 + 3 * 10496) == 9_232_384


def test_lora_starts_as_the_base_and_fuses_to_its_update():
    model = Model(rwkv7_cfg(3, hidden_size=64), seed=1)
    tokens = mx.array([[1, 2, 3, 4, 5, 6, 7]])
    base = model(tokens)
    paths = target_paths(model, "rwkv")
    apply_lora(model, paths, rank=4, alpha=8)
    modules = dict(model.named_modules())
    assert all(isinstance(modules[p], LoRALinear) for p in paths)
    assert mx.array_equal(model(tokens), base)  # lora_b starts at zero
    assert trainable_count(model) == sum(x.size for x in adapter_tensors(model).values())
    for p in paths:  # a non-zero update, then fuse: the same logits
        modules[p].lora_b = 0.1 * mx.random.normal(modules[p].lora_b.shape)
    adapted = model(tokens)
    assert not mx.allclose(adapted, base)
    model.update_modules(tree_unflatten([(p, modules[p].fuse()) for p in paths]))
    assert rel_err(np.array(model(tokens)), np.array(adapted)) <= 1e-5


def test_bad_adapter_requests():
    model = Model(rwkv7_cfg(3, hidden_size=64))
    paths = target_paths(model, "rwkv")
    with pytest.raises(AdapterError, match="rank must be an int >= 1, got 0"):
        apply_lora(model, paths, rank=0, alpha=8)
    with pytest.raises(AdapterError, match="dropout must be in"):
        apply_lora(model, paths, rank=4, alpha=8, dropout=1.5)
    quantized = Model(rwkv7_cfg(3, hidden_size=64)).quantize(8)
    with pytest.raises(AdapterError, match="DoRA on a quantized base"):
        apply_lora(quantized, target_paths(quantized, "rwkv"), rank=4, alpha=8, dora=True)
    with pytest.raises(AdapterError, match="needs RWKV blocks"):
        enable_state_tuning(
            Model(rfa_config(vocab_size=64, hidden_size=32, block_types=["qwen2"], n_q_heads=4))
        )


def test_state_tuning_trains_the_states_only():
    model = Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64))
    names = enable_state_tuning(model)
    assert names == ["layers.0.tmix.state0", "layers.2.tmix.state0"]
    assert sorted(adapter_tensors(model)) == names
    assert trainable_count(model) == 2 * 4 * 16 * 16  # two blocks of 4 heads of 16 x 16


def test_fingerprint_same_base_any_format_different_bases(tmp_path):
    model = Model(rwkv7_cfg(hidden_size=64), seed=3)
    mlx_rwkvx.save(model, tmp_path / "fp32")
    mlx_rwkvx.save(model, tmp_path / "one.safetensors")
    want = fingerprint(model)
    assert fingerprint(mlx_rwkvx.load(tmp_path / "fp32", dtype="bfloat16")[0]) == want
    assert fingerprint(mlx_rwkvx.load(tmp_path / "one.safetensors", quantize="int8")[0]) == want
    from mlx_rwkvx.io.formats import write_hf

    write_hf(tmp_path / "hf", model.config, dict(tree_flatten(model.parameters())))
    assert fingerprint(mlx_rwkvx.load(tmp_path / "hf")[0]) == want
    other = Model(model.config, seed=4)
    assert fingerprint(other) != want


def _trained_lora(model, kind="lora"):
    paths = target_paths(model, default_targets(model))
    apply_lora(model, paths, rank=4, alpha=8, dora=kind == "dora")
    for name, x in adapter_tensors(model).items():  # as if trained: every tensor non-zero
        model.load_weights([(name, x + 0.05 * mx.random.normal(x.shape))], strict=False)
    return paths


@pytest.mark.parametrize("kind", ["lora", "dora", "state"])
def test_adapter_file_round_trip_through_load(tmp_path, kind):
    from mlx_rwkvx.adapters.files import adapter_config, save_adapter

    base = Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64), seed=5)
    mlx_rwkvx.save(base, tmp_path / "base")
    fp = fingerprint(base)
    tokens = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    if kind == "state":
        paths = enable_state_tuning(base)
        for name in paths:
            base.load_weights([(name, 0.1 * mx.random.normal((4, 16, 16)))], strict=False)
        config = adapter_config(base, fine_tune_type="state", paths=paths, base_fingerprint=fp)
    else:
        paths = _trained_lora(base, kind)
        config = adapter_config(
            base, fine_tune_type=kind, paths=paths, rank=4, alpha=8, base_fingerprint=fp
        )
    want = base(tokens)
    save_adapter(tmp_path / "adapter_final.safetensors", base, config)
    # the bare file describes itself; a folder holding it too
    for where in (tmp_path / "adapter_final.safetensors", tmp_path):
        model, _ = mlx_rwkvx.load(tmp_path / "base", adapter=where)
        assert rel_err(np.array(model(tokens)), np.array(want)) <= 1e-6


def test_adapter_for_another_base_is_refused(tmp_path):
    from mlx_rwkvx.adapters.files import adapter_config, save_adapter

    base = Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64), seed=5)
    paths = _trained_lora(base)
    config = adapter_config(
        base, fine_tune_type="lora", paths=paths, rank=4, alpha=8, base_fingerprint="0" * 16
    )
    save_adapter(tmp_path / "a.safetensors", base, config)
    mlx_rwkvx.save(
        Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64), seed=5), tmp_path / "base"
    )
    with pytest.raises(AdapterError, match="trained on another base model"):
        mlx_rwkvx.load(tmp_path / "base", adapter=tmp_path / "a.safetensors")
    with pytest.raises(AdapterError, match="no such adapter"):
        mlx_rwkvx.load(tmp_path / "base", adapter=tmp_path / "nope")


def test_saving_an_adapter_wrapped_model_is_one_clear_error(tmp_path):
    from mlx_rwkvx.adapters.fuse import fuse_adapters
    from mlx_rwkvx.io.formats import CheckpointError

    model = Model(rwkv7_cfg(3, hidden_size=64), seed=2)
    _trained_lora(model)
    tokens = mx.array([[1, 2, 3, 4]])
    want = model(tokens)
    with pytest.raises(CheckpointError, match="holds LoRA/DoRA adapters; fuse them first"):
        mlx_rwkvx.save(model, tmp_path / "m")
    fuse_adapters(model)
    mlx_rwkvx.save(model, tmp_path / "m")
    assert rel_err(np.array(mlx_rwkvx.load(tmp_path / "m")[0](tokens)), np.array(want)) <= 1e-5


def test_mlx_lm_adapter_folder_loads(tmp_path):
    # an adapter as mlx-lm writes it: adapters.safetensors + adapter_config.json whose keys are
    # relative to a block and apply to the last num_layers blocks
    import json

    base = Model(rwkv7_cfg(3, hidden_size=64), seed=6)
    mlx_rwkvx.save(base, tmp_path / "base")
    trained = Model(rwkv7_cfg(3, hidden_size=64), seed=6)
    paths = target_paths(trained, "tmix.key,tmix.value".replace("tmix", "layers.*.tmix"), 2)
    apply_lora(trained, paths, rank=2, alpha=4)
    for name, x in adapter_tensors(trained).items():
        trained.load_weights([(name, x + 0.05)], strict=False)
    (tmp_path / "ad").mkdir()
    mx.save_safetensors(str(tmp_path / "ad" / "adapters.safetensors"), adapter_tensors(trained))
    (tmp_path / "ad" / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": 2,
                "lora_parameters": {
                    "rank": 2,
                    "scale": 2.0,
                    "dropout": 0.0,
                    "keys": ["tmix.key", "tmix.value"],
                },
            }
        )
    )
    model, _ = mlx_rwkvx.load(tmp_path / "base", adapter=tmp_path / "ad")
    tokens = mx.array([[5, 4, 3, 2, 1]])
    assert rel_err(np.array(model(tokens)), np.array(trained(tokens))) <= 1e-6


@pytest.mark.parametrize(
    "lora_parameters, num_layers",
    [
        ({"rank": 4, "scale": 2.0, "dropout": 0.0}, -1),  # mlx-lm's default: every Linear
        ({"rank": 2, "scale": 20.0, "dropout": 0.0, "keys": ["attn.k_proj", "ffn.value"]}, 2),
    ],
)
def test_adapter_trained_by_mlx_lm_on_its_rwkv7_loads(tmp_path, lora_parameters, num_layers):
    # mlx-lm's own machinery: its rwkv7 model reads our Hugging Face export, its
    # linear_to_lora_layers wraps it, and the adapter is saved as its trainer saves one
    import json

    from mlx_rwkvx.io.convert import convert

    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    base = Model(rwkv7_cfg(3, hidden_size=64), seed=7)
    mlx_rwkvx.save(base, tmp_path / "native")
    convert(tmp_path / "native", tmp_path / "hf", to="hf")
    theirs, _ = load_model(tmp_path / "hf")
    theirs.freeze()
    linear_to_lora_layers(theirs, num_layers, lora_parameters)
    trained = tree_flatten(theirs.trainable_parameters())
    assert trained and all(n.startswith("model.layers.") for n, _ in trained)
    theirs.update(tree_unflatten([(n, mx.random.normal(x.shape) * 0.1) for n, x in trained]))
    (tmp_path / "ad").mkdir()
    adapter = dict(tree_flatten(theirs.trainable_parameters()))
    mx.save_safetensors(str(tmp_path / "ad" / "adapters.safetensors"), adapter)
    config = {
        "model": str(tmp_path / "hf"),
        "fine_tune_type": "lora",
        "num_layers": num_layers,
        "lora_parameters": lora_parameters,
        "batch_size": 4,
        "iters": 1000,
    }
    (tmp_path / "ad" / "adapter_config.json").write_text(json.dumps(config))

    ours, _ = mlx_rwkvx.load(tmp_path / "hf", adapter=tmp_path / "ad")
    tokens = mx.array([[5, 4, 3, 2, 1, 9, 200]])
    want = np.array(theirs(tokens))
    assert rel_err(np.array(ours(tokens)), want) <= 1e-5
    assert rel_err(np.array(ours(tokens)), np.array(base(tokens))) > 1e-3  # it did change them


def test_each_target_pattern_must_match():
    # a pattern of a comma list that matches nothing (a typo) is named, not silently dropped
    model = Model(rfa_cfg(["rwkv7", "qwen2"] * 2, hidden_size=64))
    with pytest.raises(AdapterError, match=r"'layers.\*.bogus' \(of 'qwen,layers.\*.bogus'\)"):
        target_paths(model, "qwen,layers.*.bogus")
    with pytest.raises(AdapterError, match=r"'attn' \(of 'attn, qwen'\) matches no projection"):
        target_paths(model, "attn, qwen")
    with pytest.raises(AdapterError, match="'layers.0.tmix.key' .* in the last 1 blocks"):
        target_paths(model, "qwen,layers.0.tmix.key", num_layers=1)
    # patterns that overlap each count: a path the first one took is the second one's too
    assert target_paths(model, "qwen,self_attn.q_proj") == target_paths(model, "qwen")
