"""PiSSA and MiSS (``adapters/variants.py``): before the first step the model is the base;
what is saved is an ordinary LoRA update that, on the original base, gives the trained model
(loading, fusing and merging take it unchanged); each lowers the trainer's loss and resumes
from its checkpoint."""

from __future__ import annotations

import json

import mlx_rwkvx
from mlx_rwkvx.adapters.apply import apply_adapter
from mlx_rwkvx.adapters.files import adapter_config, save_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.fuse import fuse_adapters
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.adapters.tensors import adapter_tensors, load_adapter_tensors
from mlx_rwkvx.adapters.variants import MissLinear, PissaLinear, saved_lora_parameters
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.merge import merge_adapters, read

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from oracle.common import rel_err
from tuner.test_train import _cfg, _losses, workspace  # noqa: F401 (the fixture)

TOKENS = mx.array([list(b"3+4=7, 5+6=11")])


def _adapted(variant: str, rank: int = 4, alpha: float = 8.0) -> tuple[Model, list[str]]:
    model = Model(preset("rwkv-x-tiny"), seed=0)
    paths = target_paths(model, "attn")
    apply_lora(model, paths, rank=rank, alpha=alpha, variant=variant)
    return model, paths


def _nudge(model: Model, seed: int) -> None:
    """Training's effect: every trainable tensor moved."""
    for i, (_, module) in enumerate(model.named_modules()):
        if isinstance(module, (PissaLinear, MissLinear)):
            key = mx.random.key(seed + i)
            if isinstance(module, PissaLinear):
                module.lora_a = module.lora_a + 0.05 * mx.random.normal(
                    module.lora_a.shape, key=key
                )
            module.lora_b = module.lora_b + 0.05 * mx.random.normal(module.lora_b.shape, key=key)


@pytest.mark.parametrize("variant", ["pissa", "miss"])
def test_before_the_first_step_the_model_is_the_base(variant):
    base = Model(preset("rwkv-x-tiny"), seed=0)
    model, _ = _adapted(variant)
    assert rel_err(np.array(model(TOKENS)), np.array(base(TOKENS))) <= 1e-6
    trainable = {n.rsplit(".", 1)[1] for n in adapter_tensors(model)}
    assert trainable == {"lora_a", "lora_b"}


@pytest.mark.parametrize("variant", ["pissa", "miss"])
def test_the_saved_update_on_the_original_base_is_the_trained_model(variant, tmp_path):
    model, paths = _adapted(variant)
    _nudge(model, 1)
    want = np.array(model(TOKENS))
    rank, alpha = saved_lora_parameters(variant, 4, 8.0)
    config = adapter_config(
        model,
        fine_tune_type="lora",
        paths=paths,
        rank=rank,
        alpha=alpha,
        base_fingerprint=fingerprint(Model(preset("rwkv-x-tiny"), seed=0)),
        method=variant,
    )
    save_adapter(tmp_path / "a.safetensors", model, config)
    loaded = apply_adapter(Model(preset("rwkv-x-tiny"), seed=0), tmp_path / "a.safetensors")
    assert rel_err(np.array(loaded(TOKENS)), want) <= 1e-5
    assert rel_err(np.array(fuse_adapters(loaded)(TOKENS)), want) <= 1e-5
    # the saved tensors hold the start too: a model built anew takes them back (resume)
    again, _ = _adapted(variant)
    load_adapter_tensors(again, adapter_tensors(model))
    assert rel_err(np.array(again(TOKENS)), want) <= 1e-5
    if variant == "pissa":  # [A | A0], [B ; -B0]: twice the rank
        tensors = adapter_tensors(model)
        assert tensors[f"{paths[0]}.lora_a"].shape[1] == 8


@pytest.mark.parametrize("variant", ["pissa", "miss"])
def test_each_variant_lowers_the_loss_and_saves_lora(workspace, tmp_path, variant):  # noqa: F811
    kw = dict(lora_rank=4) if variant == "miss" else dict(lora_rank=4, lora_alpha=8)
    cfg = _cfg(workspace, tmp_path / variant, mode=variant, iters=12, lr=1e-2, save_every=6, **kw)
    out = train_from_config(cfg)
    losses = list(_losses(out).values())
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["method"] == variant
    # the final adapter, on the original base, through load (as generate --adapter does)
    model, _ = mlx_rwkvx.load(workspace / "base", adapter=out)
    base, _ = mlx_rwkvx.load(workspace / "base")
    assert rel_err(np.array(model(TOKENS)), np.array(base(TOKENS))) > 1e-4  # it counts
    # resumed from checkpoint_6, the run ends where the whole run did
    for name in (
        "checkpoint_12.safetensors",
        "checkpoint_12.state.safetensors",
        "checkpoint_12.json",
    ):
        (out / name).unlink()
    (out / "adapter_final.safetensors").unlink()
    again = train_from_config(
        _cfg(workspace, out, mode=variant, iters=12, lr=1e-2, save_every=6, resume=True, **kw)
    )
    resumed = _losses(again)
    assert abs(resumed[12] - dict(zip(range(1, 13), losses, strict=True))[12]) <= 1e-5


def test_pissa_on_a_quantized_base_is_refused(workspace, tmp_path):  # noqa: F811
    with pytest.raises(Exception, match="--mode pissa needs a float base"):
        cfg = _cfg(
            workspace, tmp_path / "q", mode="pissa", quantize="int8", lora_rank=4, lora_alpha=8
        )
        train_from_config(cfg)


def _fused_weights(model: Model) -> dict[str, np.ndarray]:
    return {k: np.array(v) for k, v in tree_flatten(fuse_adapters(model).parameters())}


@pytest.mark.parametrize("variant", ["pissa", "miss"])
def test_merging_two_adapters_takes_them_unchanged(variant, tmp_path):
    """Two adapters of a variant merge as LoRA adapters do: concat, and delta at the two ranks'
    sum, give the mean of the two updates exactly; fedavg (a common start: PiSSA's A0, B0 and
    MiSS's S are the same in both) averages their tensors element-wise."""
    rank, alpha = saved_lora_parameters(variant, 4, 8.0)
    base = fingerprint(Model(preset("rwkv-x-tiny"), seed=0))
    fused, files = [], []
    for seed in (1, 2):
        model, paths = _adapted(variant)
        _nudge(model, seed)
        config = adapter_config(
            model,
            fine_tune_type="lora",
            paths=paths,
            rank=rank,
            alpha=alpha,
            base_fingerprint=base,
            method=variant,
        )
        files.append(tmp_path / f"{seed}.safetensors")
        save_adapter(files[-1], model, config)
        fused.append(_fused_weights(model))
    want = {k: (fused[0][k] + fused[1][k]) / 2 for k in fused[0]}
    for method in ("delta", "concat"):
        out = tmp_path / f"{method}.safetensors"
        merge_adapters(files, out, method=method, rank=2 * rank if method == "delta" else None)
        got = _fused_weights(apply_adapter(Model(preset("rwkv-x-tiny"), seed=0), out))
        for k, w in want.items():
            assert np.abs(got[k] - w).max() <= 1e-5 * max(np.abs(w).max(), 1), (method, k)
    merge_adapters(files, tmp_path / "avg.safetensors", method="fedavg")
    merged, one, two = (read(f) for f in (tmp_path / "avg.safetensors", *files))
    assert sorted(merged.tensors) == sorted(one.tensors)
    for k, x in merged.tensors.items():  # PiSSA: [mean A | A0], [mean B ; -B0]
        np.testing.assert_allclose(x, (one.tensors[k] + two.tensors[k]) / 2, rtol=1e-6, atol=1e-7)
