"""Applying an adapter file (ours or mlx-lm's) to a model: checked against the base's
fingerprint, the model's layers, the tensors' shapes and their finiteness first."""

from __future__ import annotations

import os

from mlx_rwkvx.adapters.files import read_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import native_path
from mlx_rwkvx.adapters.tensors import ADAPTER_LEAVES, adapter_tensors
from mlx_rwkvx.errors import AdapterError
from mlx_rwkvx.models.model import Model

import mlx.core as mx


def _native_tensors(model: Model, tensors: dict) -> tuple[list[str], dict[str, mx.array]]:
    """(the wrapped module paths, the tensors under our paths) of an adapter file: ours name
    our paths; mlx-lm's name its model's (``model.layers.3.attn.k_proj.lora_a``). The file's
    tensors say which layers it adapts, whatever its config's ``keys`` and ``num_layers``."""
    renamed = {}
    for name, x in tensors.items():
        module, leaf = name.rsplit(".", 1) if "." in name else ("", name)
        if leaf not in (*ADAPTER_LEAVES, "state0"):
            raise AdapterError(f"{name!r} is not an adapter tensor (lora_a, lora_b, m, state0)")
        renamed[f"{native_path(model, module)}.{leaf}"] = x
    paths = sorted({n.rsplit(".", 1)[0] for n in renamed if not n.endswith(".state0")})
    return paths, renamed


def apply_adapter(model: Model, path) -> Model:
    """Wrap ``model`` in the adapter at ``path`` (see ``read_adapter``) and load its tensors;
    refused (AdapterError) when it was trained on another base or does not fit."""
    config, tensors = read_adapter(path)
    return apply_adapter_tensors(model, config, tensors, os.fspath(path))


def apply_adapter_tensors(model: Model, config: dict, tensors: dict, path: str = "adapter"):
    """``apply_adapter`` of an adapter in memory (``config`` and tensors as an adapter file
    holds them; ``path`` names it in errors)."""
    want = config.get("base_fingerprint")
    if want and want != fingerprint(model):
        raise AdapterError(
            f"{os.fspath(path)}: the adapter was trained on another base model (fingerprint "
            f"{want}, this model's {fingerprint(model)})"
        )
    kind = config.get("fine_tune_type", "lora")
    paths, tensors = _native_tensors(model, tensors)
    for name, x in tensors.items():  # a diverged run's NaNs would give empty answers
        if mx.issubdtype(x.dtype, mx.floating) and not mx.all(mx.isfinite(x)).item():
            raise AdapterError(f"{os.fspath(path)}: {name} holds NaN or infinite values")
    if kind in ("lora", "dora"):
        lora = config.get("lora_parameters") or {}
        try:
            rank, scale = int(lora["rank"]), float(lora["scale"])
        except (KeyError, TypeError, ValueError) as e:
            raise AdapterError(f"{os.fspath(path)}: bad lora_parameters ({e})") from e
        modules = dict(model.named_modules())
        missing = [p for p in paths if p not in modules]
        if missing or not paths:
            raise AdapterError(
                f"{os.fspath(path)}: the adapter's layers {missing[:4]} are not in this model"
                if missing
                else f"{os.fspath(path)}: the adapter holds no LoRA tensors"
            )
        apply_lora(
            model,
            paths,
            rank=rank,
            alpha=scale * rank,
            dropout=float(lora.get("dropout", 0.0)),
            dora=kind == "dora",
        )
    elif kind == "state":
        enable_state_tuning(model)
    else:
        raise AdapterError(f"{os.fspath(path)}: fine_tune_type {kind!r} is not an adapter")
    expected = {n: x.shape for n, x in adapter_tensors(model).items()}
    wrong = sorted(set(tensors) ^ set(expected)) + [
        n for n in tensors if n in expected and tuple(tensors[n].shape) != tuple(expected[n])
    ]
    if wrong:
        raise AdapterError(f"{os.fspath(path)}: tensors that do not fit this model: {wrong[:6]}")
    model.load_weights(list(tensors.items()), strict=False)
    model.eval()  # LoRA dropout is for training
    mx.eval(model.parameters())
    return model
