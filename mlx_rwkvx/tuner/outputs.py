"""A run's output folder: what may be written there (a run only adds to its folder, never over
what it reads or what it did not write), ``metrics.jsonl``, the final adapter or model, and
``loss.png``. Entry points: ``check_inputs``, ``check_place``, ``check_output`` (before the
run), ``Metrics`` (during it), ``write_final`` and ``plot`` (at its end)."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

from mlx_rwkvx.adapters.files import ADAPTER_CONFIG, FINAL_ADAPTER, save_adapter
from mlx_rwkvx.errors import TrainError
from mlx_rwkvx.io.atomic import atomic_target, save_text
from mlx_rwkvx.io.load import save
from mlx_rwkvx.io.targets import check_not_unsafe
from mlx_rwkvx.tuner import parallel
from mlx_rwkvx.tuner.checkpoints import newest_checkpoint

METRICS = "metrics.jsonl"
MODEL_DIR = "model"  # full fine-tuning and pretraining write a native model folder here
PLOT = "loss.png"
_WRITTEN = re.compile(
    r"(checkpoint_\d+\.(json|safetensors|state\.safetensors)|thread_\d+\.safetensors)\Z"
)


def check_inputs(out: Path, inputs: dict[str, str | None]) -> str:
    """The real path of --output: TargetError when it is a folder no command may write (the
    home folder, the current folder or one above it, ``/``: the check every writer makes),
    TrainError when it, or a file the run writes into it, is one of the run's ``inputs``
    (``{"model": path, "data": path, ...}``: training only adds files, and never over what it
    reads)."""
    real = check_not_unsafe(out, "--output")
    written = [
        os.path.join(real, name) for name in (MODEL_DIR, FINAL_ADAPTER, ADAPTER_CONFIG, METRICS)
    ]
    for name, given in inputs.items():
        if not given or not os.path.lexists(given):
            continue
        source = os.path.realpath(given)
        if source == real or source in written or source.startswith(written[0] + os.sep):
            what = "is" if source == real else "would write over"
            raise TrainError(
                f"--output {out}: {what} the --{name.replace('_', '-')} {given}; "
                "choose another output folder"
            )
    return real


def check_place(out: Path) -> None:
    """--output must be, or become, a folder."""
    if out.exists() and not out.is_dir():
        raise TrainError(f"--output {out}: is a file")
    above = next((p for p in out.absolute().parents if p.exists()), None)
    if above is not None and not above.is_dir():  # the folder could never be made
        raise TrainError(f"--output {out}: {above} is a file")


def check_output(out: Path, resume: bool) -> None:
    """A new run needs a folder holding none of the files a run writes (a metrics.jsonl of a
    run that stopped before its first checkpoint is replaced); --resume needs a complete
    checkpoint. Neither writes through a symbolic link among those names."""
    if not out.is_dir():
        return
    named = (METRICS, ADAPTER_CONFIG, FINAL_ADAPTER, MODEL_DIR, PLOT)
    ours = [p for p in out.iterdir() if p.name in named or _WRITTEN.match(p.name)]
    links = [p.name for p in ours if p.is_symlink()]
    if links:
        raise TrainError(
            f"--output {out}: {links[0]} is a symbolic link; a run writes its own "
            "files there, never through a link: choose another folder"
        )
    if resume:
        if newest_checkpoint(out) is None:
            raise TrainError(f"--output {out}: --resume, but there is no complete checkpoint there")
        return
    others = [p.name for p in ours if p.name != METRICS or not is_metrics(p)]
    if newest_checkpoint(out) is not None or any(n in (FINAL_ADAPTER, MODEL_DIR) for n in others):
        raise TrainError(f"--output {out}: holds another run; pass --resume or choose a folder")
    if others:
        raise TrainError(
            f"--output {out}: holds {sorted(others)[:4]}, which a run writes; "
            "choose an empty or new folder"
        )


def is_metrics(path: Path) -> bool:
    """Whether ``path`` is a run's metrics.jsonl: every line a JSON object with a step (the
    last one may be cut short: the run died while writing it)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except (OSError, ValueError):
        return False
    records = 0
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            if i == len(lines) - 1:  # no newline after it: cut short
                continue
            return False
        if not isinstance(record, dict) or "step" not in record:
            return False
        records += 1
    return records > 0


def keep_metrics(path: Path, step: int) -> None:
    """The metrics of the steps up to ``step`` (a new run: none; a resumed one: those of the
    checkpoint it continues from, not those of the steps the interruption lost)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (ValueError, AttributeError):  # a line the interruption cut short
            continue
    with atomic_target(str(path), folder=False) as tmp:
        save_text(tmp, "".join(line + "\n" for line in kept))


def metrics_line(record: dict) -> str:
    """One line of metrics.jsonl: strict JSON, a value that is not finite written as null."""
    clean = {
        k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in record.items()
    }
    return json.dumps(clean, allow_nan=False) + "\n"


class Metrics:
    """``metrics.jsonl``, a line per step, appended as the run goes (rank 0 writes; the other
    ranks' lines go nowhere)."""

    def __init__(self, out: Path, write: bool):
        self._file = open(out / METRICS if write else os.devnull, "a")  # noqa: SIM115

    def add(self, record: dict) -> None:
        self._file.write(metrics_line(record))
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def write_final(
    out: Path,
    model,
    *,
    full: bool,
    tokenizer,
    config: dict,
    settings: dict,
    stack_tokens: list[int],
) -> None:
    """The run's result: ``adapter_final.safetensors`` and ``adapter_config.json`` (``config``,
    with the run's ``settings``; with --parallel's ``stack_tokens`` also ``thread_<i>``,
    rfa_train's name), or, ``full`` (full fine-tuning, pretraining), a native model folder
    ``model/`` with the ``tokenizer``'s files."""
    if full:
        save(model, out / MODEL_DIR, tokenizer=tokenizer, overwrite=True)
        print(f"wrote {out / MODEL_DIR}")
        return
    if len(stack_tokens) > 1:
        parallel.write_threads(out, model, config, stack_tokens)
        what = f" (the FedAvg of thread_0..{len(stack_tokens) - 1})"
    else:
        save_adapter(out / FINAL_ADAPTER, model, config)
        what = ""
    with atomic_target(str(out / ADAPTER_CONFIG), folder=False) as tmp:
        save_text(tmp, json.dumps({**config, "train": settings}, indent=2))
    print(f"wrote {out / FINAL_ADAPTER}{what}")


def plot(out: Path) -> None:
    """``loss.png``: the training loss, and the validation loss where there is one."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot: matplotlib is not installed (pip install 'mlx_rwkvx[plot]')")
        return
    rows = [json.loads(line) for line in (out / METRICS).read_text().splitlines()]
    train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(*zip(*train, strict=True), label="train")
    if val:
        ax.plot(*zip(*val, strict=True), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.savefig(out / PLOT, dpi=100)
    print(f"wrote {out / PLOT}")
