"""The training run's settings: one dataclass is the single source of truth for the defaults,
the command line's flags and help (``python -m mlx_rwkvx.train``) and a YAML ``--config``
(ours, or mlx-lm's LoRA config as it is). The seeds' flag names are primary; mlx-lm's names
for the same things are aliases.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field, fields

MODES = ("lora", "dora", "full", "state", "pretrain")

# Learning rates where the seeds are silent, from the published RWKV trainers:
# - LoRA/DoRA/full: the seeds' 2e-5 (rx_train.h, rfa_train); RWKV's wiki advises at most 1e-4
#   for fine-tuning other than state tuning;
# - state tuning: 1.0, decaying to 0.01, 10 warmup steps (RWKV wiki, "State Tuning": "state
#   tuning requires a very high learning rate");
# - pretraining: 6e-4, the start of RWKV-LM's x070 MiniPile demo run (its train_log).
DEFAULT_LR = {"lora": 2e-5, "dora": 2e-5, "full": 2e-5, "state": 1.0, "pretrain": 6e-4}
# where the cosine decay ends, as a fraction of the learning rate: the seeds' cosine annealing
# to zero; RWKV-PEFT's 1 -> 0.01 for states; a tenth for pretraining (our choice)
FINAL_LR_RATIO = {"lora": 0.0, "dora": 0.0, "full": 0.0, "state": 0.01, "pretrain": 0.1}
DEFAULT_WARMUP = {"state": 10}  # else the seeds' 100


def _opt(help: str, *aliases: str, default=None, **kw):
    return field(default=default, metadata={"help": help, "aliases": aliases, **kw})


@dataclass
class TrainConfig:
    model: str = _opt("a checkpoint (any format mlx_rwkvx.load reads); for --mode pretrain a "
                      "preset name or a JSON/YAML model config")  # fmt: skip
    data: str = _opt("training data: a .jsonl, .bin, .sqlite/.db file or an mlx-lm style folder")
    output: str = _opt("output folder (checkpoints, adapter, metrics)", "adapter_path")
    mode: str = _opt(f"what is trained: one of {MODES}", "fine_tune_type", default="lora",
                     choices=MODES)  # fmt: skip
    lora_rank: int = _opt("LoRA rank", "rank", default=32)
    lora_alpha: float = _opt("LoRA alpha (scale = alpha / rank)", default=64.0)
    lora_dropout: float = _opt("dropout on the LoRA input", default=0.0)
    lora_targets: str = _opt(
        "adapter targets: attn, qwen, rwkv, all, or comma-separated module globs (default: "
        "the family's: RWKV-X attn, RFA qwen, RWKV-7 rwkv)"
    )
    num_layers: int = _opt("adapt only the last N blocks (default: all)")
    lr: float = _opt("peak learning rate (default per mode: lora/dora/full 2e-5, state 1.0, "
                     "pretrain 6e-4)", "learning_rate")  # fmt: skip
    weight_decay: float = _opt("AdamW weight decay", default=0.01)
    epochs: int = _opt("passes over the training data", default=3)
    iters: int = _opt("training steps (overrides --epochs)")
    max_seq_len: int = _opt("tokens per example (default: 512 RWKV-X/RWKV-7, 256 RFA)",
                            "max_seq_length")  # fmt: skip
    batch_size: int = _opt("examples per step", default=1)
    grad_accum: int = _opt("micro-batches per step", "grad_accumulation_steps", default=1)
    warmup: int = _opt("linear warm-up steps (default: 100; state tuning 10)")
    save_every: int = _opt("checkpoint every N steps", default=1000)
    log_every: int = _opt("a log line every N steps", "steps_per_report", default=10)
    val_data: str = _opt("validation data (default: the data folder's valid.jsonl, if any)")
    val_every: int = _opt("validation loss every N steps (0: at the end only)", "steps_per_eval",
                          default=0)  # fmt: skip
    test: bool = _opt("evaluate on the test split at the end", default=False)
    grad_clip: float = _opt("global gradient-norm clip (0: none)", default=1.0)
    quantize: str = _opt("train on INT8 (or int4) base weights", choices=("int8", "int4"))
    dtype: str = _opt("base weights' dtype: float32, bfloat16, float16 (default: as stored)",
                      choices=("float32", "bfloat16", "float16"))  # fmt: skip
    init: str = _opt("--mode pretrain: pretrain (RWKV-7's published init) or seeds",
                     default="pretrain", choices=("pretrain", "seeds"))  # fmt: skip
    seed: int = _opt("random seed (adapter init, data order, dropout)", default=0)
    resume: bool = _opt("continue the run in --output from its newest complete checkpoint",
                        default=False)  # fmt: skip
    grad_checkpoint: bool = _opt("recompute each block in the backward (less memory)",
                                 default=False)  # fmt: skip
    sql: str = _opt("with an SQLite --data: a query returning (conversation, role, content)")
    skip_bad: bool = _opt("skip bad examples (counted and reported) instead of stopping",
                          default=False)  # fmt: skip
    plot: bool = _opt("write loss.png (needs matplotlib: the plot extra)", default=False)

    def resolved(self) -> TrainConfig:
        """A copy with the per-mode defaults filled in."""
        return dataclasses.replace(
            self,
            lr=self.lr if self.lr is not None else DEFAULT_LR[self.mode],
            warmup=self.warmup if self.warmup is not None else DEFAULT_WARMUP.get(self.mode, 100),
        )


# mlx-lm's YAML keys that map to ours with a change of meaning or shape
_MLX_LM_IGNORED = {"train"}  # mlx-lm's "train: true": training is what this command does


def from_yaml(data: dict, source: str) -> dict:
    """Our fields from a YAML config (ours, or mlx-lm's LoRA config). ValueError naming an
    unknown key."""
    names = {f.name: f.name for f in fields(TrainConfig)}
    for f in fields(TrainConfig):
        for alias in f.metadata["aliases"]:
            names[alias] = f.name
    out = {}
    for key, value in data.items():
        key = key.replace("-", "_")
        if key in _MLX_LM_IGNORED:
            continue
        if key == "lora_parameters" and isinstance(value, dict):  # mlx-lm's block
            if "rank" in value:
                out["lora_rank"] = value["rank"]
            if "scale" in value:
                out["lora_alpha"] = value["scale"] * value.get("rank", TrainConfig.lora_rank)
            if "dropout" in value:
                out["lora_dropout"] = value["dropout"]
            if value.get("keys"):
                out["lora_targets"] = ",".join(value["keys"])
            continue
        if key not in names:
            raise ValueError(f"{source}: unknown setting {key!r}")
        out[names[key]] = _typed(names[key], value, source)
    return out


def _typed(name: str, value, source: str):
    """``value`` as the field's type: YAML 1.1 reads ``1e-5`` (no dot) as a string, and
    mlx-lm's configs write learning rates so."""
    kind = {f.name: f.type for f in fields(TrainConfig)}[name]
    convert = {"int": int, "float": float, "bool": bool}.get(kind)
    if value is None or convert is None or isinstance(value, convert):
        return value
    if kind == "bool" or (kind == "int" and isinstance(value, float)):
        raise ValueError(f"{source}: {name} must be {kind}, got {value!r}")
    try:
        return convert(value)
    except (TypeError, ValueError):
        raise ValueError(f"{source}: {name} must be {kind}, got {value!r}") from None


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mlx_rwkvx.train``, generated from TrainConfig."""
    p = argparse.ArgumentParser(
        prog="python -m mlx_rwkvx.train",
        description="Train an RWKV-7, RWKV-X or RFA model: LoRA, DoRA, state tuning, full "
        "fine-tuning or pretraining. Flags beat a --config file; the file beats the defaults.",
    )
    p.add_argument("--config", help="a YAML file of these settings (mlx-lm's LoRA config too)")
    for f in fields(TrainConfig):
        flags = [f"--{f.name.replace('_', '-')}"]
        flags += [f"--{a.replace('_', '-')}" for a in f.metadata["aliases"]]
        kwargs = {"dest": f.name, "help": f.metadata["help"], "default": argparse.SUPPRESS}
        if f.type == "bool":
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = {"int": int, "float": float}.get(f.type, str)
            if "choices" in f.metadata:
                kwargs["choices"] = f.metadata["choices"]
            if f.name == "quantize":  # a bare --quantize means int8, as in convert and generate
                kwargs.update(nargs="?", const="int8")
        if f.default is not None and f.type != "bool":
            kwargs["help"] += f" (default: {f.default})"
        p.add_argument(*flags, **kwargs)
    return p
