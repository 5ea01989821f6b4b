"""What a run trains: the model (a checkpoint, quantized or cast as asked; for pretraining a
fresh one from a preset or a config file), its tokenizer, the base's fingerprint, and the
adapters, the trainable state or the unfrozen weights. Entry points: ``build``,
``block_kinds_of`` (the model's family before it is loaded, for the settings' defaults)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.state import enable_state_tuning
from mlx_rwkvx.adapters.targets import check_rank, default_targets, target_paths
from mlx_rwkvx.adapters.variants import VARIANTS
from mlx_rwkvx.errors import AdapterError, CheckpointError, TrainError
from mlx_rwkvx.io.formats import block_kinds
from mlx_rwkvx.io.hub import resolve_model
from mlx_rwkvx.io.load import load_model, model_as_loaded
from mlx_rwkvx.io.tokenizers import builtin_tokenizer, load_tokenizer, tokenizer_files_beside
from mlx_rwkvx.models import Model, ModelConfig, preset
from mlx_rwkvx.models.config import PRESETS
from mlx_rwkvx.tuner import parallel
from mlx_rwkvx.tuner.config import LORA_MODES, TrainConfig

import yaml
from mlx.utils import tree_flatten


@dataclass
class Built:
    model: Model  # with what it trains set up: adapters, a trainable state, unfrozen weights
    tokenizer: object | None  # None: pre-tokenized data needs none
    base: str  # the base model's fingerprint (adapters and resuming check it)
    paths: list[str]  # what is trained: adapted layers, state tensors or weights


def model_config(spec: str) -> ModelConfig:
    """A preset name or a JSON/YAML file of ModelConfig fields (--mode pretrain)."""
    if spec in PRESETS:
        return preset(spec)
    if not os.path.isfile(spec):
        raise TrainError(
            f"--model {spec}: for --mode pretrain, a preset ({', '.join(sorted(PRESETS))}) or "
            "a JSON/YAML model config file"
        )
    try:
        with open(spec) as f:
            fields = yaml.safe_load(f) if spec.endswith((".yaml", ".yml")) else json.load(f)
        return ModelConfig(**fields)
    except (OSError, ValueError, TypeError, yaml.YAMLError) as e:
        raise TrainError(f"--model {spec}: not a model config ({e})") from e


def _not_a_checkpoint(cfg: TrainConfig, e: CheckpointError) -> TrainError:
    if cfg.model in PRESETS and not os.path.exists(cfg.model):
        how = "only --mode pretrain trains one (from its init); else give a checkpoint"
        return TrainError(f"--model {cfg.model}: a preset: {how}")
    return TrainError(str(e))


def block_kinds_of(cfg: TrainConfig) -> set[str]:
    """The kinds of block of the model ``cfg`` trains, before it is loaded."""
    if cfg.mode == "pretrain":
        return set(model_config(cfg.model).block_types)
    try:
        return block_kinds(resolve_model(cfg.model))
    except CheckpointError as e:
        raise _not_a_checkpoint(cfg, e) from e


def build(cfg: TrainConfig) -> Built:
    """The model of a run with what it trains set up (see the module docstring)."""
    if cfg.mode == "pretrain":
        model_cfg = model_config(cfg.model)
        model = Model(model_cfg, init=cfg.init, seed=cfg.seed)
        tokenizer = builtin_tokenizer(model_cfg.vocab_size)
        if tokenizer is None:
            raise TrainError(
                f"--model {cfg.model}: vocabulary {model_cfg.vocab_size} has no built-in "
                "tokenizer (65536: World, <= 256: bytes)"
            )
    else:
        try:
            path = resolve_model(cfg.model)  # a Hugging Face name: its snapshot in the cache
            model = load_model(path, quantize=cfg.quantize, dtype=cfg.dtype)
        except CheckpointError as e:
            raise _not_a_checkpoint(cfg, e) from e
        try:  # pre-tokenized data needs none: a text data set says so if it lacks one
            tokenizer = load_tokenizer(path, model.config.vocab_size)
        except ValueError as e:
            if tokenizer_files_beside(path):  # there is one, and it is broken or foreign
                raise TrainError(str(e)) from e
            tokenizer = None
    base = fingerprint(model)
    return Built(model, tokenizer, base, set_up(model, cfg))


def twin(cfg: TrainConfig) -> Model | None:
    """The model ``build(cfg)`` makes, with what it trains set up, its arrays lazy and never
    computed (their shapes and dtypes: what the memory estimate reads; a ``.pth``'s from its
    pickle); None where the set-up needs the weights' values (PiSSA's SVD, whose residual base
    is float32). Nothing is loaded; errors are ``build``'s."""
    if cfg.mode == "pissa":
        return None
    if cfg.mode == "pretrain":
        model = Model(model_config(cfg.model), init=None)
    else:
        try:
            model = model_as_loaded(cfg.model, quantize=cfg.quantize, dtype=cfg.dtype)
        except CheckpointError as e:
            raise _not_a_checkpoint(cfg, e) from e
    set_up(model, cfg)
    return model


def set_up(model: Model, cfg: TrainConfig) -> list[str]:
    """What ``cfg`` trains set up on ``model`` (adapters, a trainable state, unfrozen weights);
    returns the paths trained."""
    try:
        if cfg.mode in LORA_MODES:
            targets = cfg.lora_targets or default_targets(model)
            paths = target_paths(model, targets, cfg.num_layers)
            check_rank(model, paths, cfg.lora_rank)
            apply_lora(
                model,
                paths,
                rank=cfg.lora_rank,
                alpha=cfg.lora_alpha,
                dropout=cfg.lora_dropout,
                dora=cfg.mode == "dora",
                variant=cfg.mode if cfg.mode in VARIANTS else None,
            )
            if cfg.parallel > 1:
                parallel.stack_adapters(model, cfg.parallel)
        elif cfg.mode == "state":
            paths = enable_state_tuning(model)
        else:
            if model.quantization is not None:
                raise TrainError(f"--mode {cfg.mode} trains every weight: not a quantized base")
            model.unfreeze()
            paths = [n for n, _ in tree_flatten(model.trainable_parameters())]
    except AdapterError as e:
        raise TrainError(str(e)) from e
    return paths
