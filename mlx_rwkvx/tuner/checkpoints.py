"""A run's checkpoints, which never lose work: every ``save_every`` steps, at the end and on
Ctrl-C or SIGTERM, ``checkpoint_<step>.safetensors`` (the trained tensors, what ``load`` and
merging read, the adapter config in its metadata), ``checkpoint_<step>.state.safetensors``
(optimizer state, step, data position, the ops' implementations the run chose -- a resumed run
uses them, ``ops/tuning.py``; each step's randomness comes from the seed and the step) and last
``checkpoint_<step>.json``, the manifest that marks the checkpoint complete, each written
atomically. Entry points: ``save_checkpoint``, ``scan_checkpoints`` (the newest complete
one and the newer ones cut short), ``load_checkpoint``."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from mlx_rwkvx._crash import crash_point
from mlx_rwkvx.adapters.files import save_adapter
from mlx_rwkvx.adapters.tensors import adapter_tensors, load_adapter_tensors
from mlx_rwkvx.errors import CheckpointError, TrainError
from mlx_rwkvx.io.atomic import atomic_target, save_safetensors, save_text
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.models import Model
from mlx_rwkvx.models.init import INIT_ALIASES
from mlx_rwkvx.ops import tuning

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten


def checkpoint_names(step: int) -> dict[str, str]:
    base = f"checkpoint_{step}"
    return {
        "weights": f"{base}.safetensors",
        "state": f"{base}.state.safetensors",
        "manifest": f"{base}.json",
    }


def newest_checkpoint(out: Path) -> int | None:
    """The step of the newest complete checkpoint in ``out`` (its manifest written last, every
    file it names present), or None."""
    return scan_checkpoints(out)[0]


_CHECKPOINT_FILE = re.compile(r"checkpoint_(\d+)\.(json|safetensors|state\.safetensors)\Z")


def scan_checkpoints(out: Path) -> tuple[int | None, dict[int, str]]:
    """(the newest complete checkpoint's step or None, {step: why it is not complete} for the
    newer ones whose files are there: a run stopped while saving, a damaged manifest)."""
    steps = set()
    for path in out.glob("checkpoint_*"):
        found = _CHECKPOINT_FILE.match(path.name)
        if found:
            steps.add(int(found.group(1)))
    broken = {}
    for step in sorted(steps, reverse=True):
        manifest_path = out / checkpoint_names(step)["manifest"]
        if not manifest_path.exists():
            broken[step] = "no manifest: the run stopped while saving it"
            continue
        try:
            manifest = json.loads(manifest_path.read_text())
            files = manifest["files"] if manifest.get("complete") else None
        except (ValueError, OSError, AttributeError, KeyError, TypeError):
            broken[step] = "its manifest cannot be read"
            continue
        if not isinstance(files, list):
            broken[step] = "its manifest lists no files"
            continue
        missing = [str(f) for f in files if not (out / str(f)).exists()]
        if missing:
            broken[step] = f"{missing[0]} is missing"
            continue
        return step, broken
    return None, broken


def trained_tensors(model: Model, mode: str) -> dict[str, mx.array]:
    """What a run trains, under the model's paths: the adapter's tensors, or for full
    fine-tuning and pretraining (``mode`` "full" or "pretrain") every trainable weight."""
    if mode in ("full", "pretrain"):
        return dict(tree_flatten(model.trainable_parameters()))
    return adapter_tensors(model)


# settings that decide what the trained tensors are and which batches come next: a run
# resumes only with the ones it was started with
RESUME_FIXED = (
    "mode",
    "train_mode",
    "beta",
    "dpo_loss",
    "lora_rank",
    "lora_alpha",
    "lora_targets",
    "num_layers",
    "quantize",
    "dtype",
    "init",
    "sql",
    "skip_bad",
    "mask_prompt",
    "max_seq_len",
    "batch_size",
    "grad_accum",
    "seed",
    "carry_state",
    "max_cache",
    "parallel",
)


def save_checkpoint(
    out: Path,
    state,
    model: Model,
    optimizer,
    *,
    config: dict,
    settings: dict,
    base: str,
    full: bool,
) -> None:
    """The three files of the checkpoint of ``state`` (a ``TrainState``), the manifest last;
    each atomically. ``config``: the adapter config its metadata holds; ``settings``: the
    run's, which ``--resume`` compares; ``base``: the base's fingerprint; ``full``: every
    trainable weight is saved (full fine-tuning, pretraining), else the adapter. A checkpoint is
    whole or absent: if a write fails (a full disk) or is interrupted, the files of this one
    already written are removed again, and the older checkpoints stay as they were."""
    names = checkpoint_names(state.step)
    try:
        _save_checkpoint(out, state, model, optimizer, names, config, settings, base, full)
    except BaseException:
        for key in ("manifest", "state", "weights"):  # the manifest first: never complete
            (out / names[key]).unlink(missing_ok=True)
        raise


def _save_checkpoint(
    out: Path,
    state,
    model,
    optimizer,
    names: dict[str, str],
    config: dict,
    settings: dict,
    base: str,
    full: bool,
) -> None:
    if full:
        with atomic_target(str(out / names["weights"]), folder=False) as tmp:
            metadata = {"adapter_config": json.dumps(config)}
            save_safetensors(tmp, trained_tensors(model, "full"), metadata)
    else:
        save_adapter(out / names["weights"], model, config)
    meta = {
        "step": str(state.step),
        "position": json.dumps(state.position),
        "tokens": str(state.tokens),
        "train": json.dumps(settings),
        "base": base,
        "ranks": str(state.ranks),
        "shard_tokens": json.dumps(state.stack_tokens),  # the file's old name
        "tuning": json.dumps(tuning.choices()),  # a resumed run computes as this one did
    }
    with atomic_target(str(out / names["state"]), folder=False) as tmp:
        save_safetensors(tmp, dict(tree_flatten(optimizer.state)), meta)
    crash_point("save", state.step)  # weights and state written, the manifest not yet
    manifest = {"complete": True, "step": state.step, "files": [names["weights"], names["state"]]}
    with atomic_target(str(out / names["manifest"]), folder=False) as tmp:
        save_text(tmp, json.dumps(manifest))


def _read_checkpoint_file(path: Path, step: int):
    """(tensors, metadata) of one file of checkpoint ``step``; TrainError when it cannot be
    read (cut short after its manifest was written: a partial copy, a failing disk)."""
    try:
        return read_safetensors(str(path))
    except CheckpointError as e:
        hint = f"remove checkpoint_{step}.* to resume from an older one"
        raise TrainError(f"--resume: {e}; {hint}") from None


def load_checkpoint(
    out: Path, step: int, state, model: Model, optimizer, *, settings: dict, base: str, full: bool
) -> None:
    """Restore ``state`` (a ``TrainState``), the model's trained tensors and the optimizer from
    checkpoint ``step``: TrainError when it was made by a run with other ``settings`` (see
    RESUME_FIXED) or on another ``base``, its tensors do not fit, or a file of it cannot be
    read."""
    names = checkpoint_names(step)
    optimizer_state, meta = _read_checkpoint_file(out / names["state"], step)
    then = json.loads(meta.get("train", "{}"))
    if "init" in then:  # a run of before init "seeds" was called "foundry"
        then["init"] = INIT_ALIASES.get(then["init"], then["init"])
    changed = [k for k in RESUME_FIXED if k in then and then[k] != settings.get(k)]
    if changed:
        was = ", ".join(
            f"{k.replace('_', '-')} {then[k]!r} (now {settings.get(k)!r})" for k in changed
        )
        raise TrainError(
            f"--resume: checkpoint_{step} was trained with {was}; resume with the "
            "run's settings or start a new --output"
        )
    if meta.get("base", base) != base:
        raise TrainError(f"--resume: checkpoint_{step} was trained on another base model")
    if int(meta.get("ranks", 1)) != state.ranks:  # each rank's share of the data depends on it
        raise TrainError(
            f"--resume: checkpoint_{step} was trained on {meta.get('ranks', 1)} "
            f"ranks, this run has {state.ranks}; resume with as many"
        )
    others = [
        k
        for k in ("lr", "warmup", "weight_decay", "grad_clip", "iters", "epochs", "data")
        if k in then and then[k] != settings.get(k)
    ]
    if others:
        print(
            f"note: resuming with other {', '.join(others)} than checkpoint_{step}'s run",
            file=sys.stderr,
        )
    weights, _ = _read_checkpoint_file(out / names["weights"], step)
    trained = trained_tensors(model, "full" if full else "adapter")
    expected = {n: tuple(x.shape) for n, x in trained.items()}
    wrong = sorted(set(weights) ^ set(expected)) + sorted(
        n for n in weights if n in expected and tuple(weights[n].shape) != expected[n]
    )
    if wrong:
        raise TrainError(f"--resume: checkpoint_{step}'s tensors do not fit this run: {wrong[:4]}")
    load_adapter_tensors(model, weights)
    optimizer.state = tree_unflatten(list(optimizer_state.items()))
    state.step, state.tokens = int(meta["step"]), int(meta["tokens"])
    state.stack_tokens = json.loads(meta.get("shard_tokens", "[]")) or state.stack_tokens
    state.position = json.loads(meta["position"])
    tuning.use_choices(json.loads(meta.get("tuning", "{}")))  # before the step is compiled
    mx.eval(model.parameters(), optimizer.state)
