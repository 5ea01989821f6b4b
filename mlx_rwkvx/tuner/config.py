"""The training run's settings: one dataclass is the single source of truth for the defaults,
the command line's flags and help (``python -m mlx_rwkvx.train``) and a YAML ``--config``
(ours, or mlx-lm's LoRA config as it is). Foundry's flag names are primary; mlx-lm's names
for the same things are aliases.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from dataclasses import dataclass, fields

from mlx_rwkvx import settings
from mlx_rwkvx.errors import TrainError, UsageError, in_words
from mlx_rwkvx.models.init import INIT_ALIASES
from mlx_rwkvx.settings import Settings, opt

MODES = ("lora", "dora", "pissa", "miss", "full", "state", "pretrain")
TRAIN_MODES = ("sft", "dpo", "orpo")

# Learning rates where Foundry's C engine is silent, from the published RWKV trainers:
# - LoRA/DoRA/full: Foundry's 2e-5 (rx_train.h, rfa_train); RWKV's wiki advises at most 1e-4
#   for fine-tuning other than state tuning;
# - state tuning: 1.0, decaying to 0.01, 10 warmup steps (RWKV wiki, "State Tuning": "state
#   tuning requires a very high learning rate");
# - pretraining: 6e-4, the start of RWKV-LM's x070 MiniPile demo run (its train_log).
# - PiSSA and MiSS: LoRA's (RWKV-PEFT trains them as it trains LoRA);
DEFAULT_LR = {
    "lora": 2e-5,
    "dora": 2e-5,
    "pissa": 2e-5,
    "miss": 2e-5,
    "full": 2e-5,
    "state": 1.0,
    "pretrain": 6e-4,
}
# where the cosine decay ends, as a fraction of the learning rate: Foundry's cosine annealing
# to zero; RWKV-PEFT's 1 -> 0.01 for states; a tenth for pretraining (our choice)
FINAL_LR_RATIO = {
    "lora": 0.0,
    "dora": 0.0,
    "pissa": 0.0,
    "miss": 0.0,
    "full": 0.0,
    "state": 0.01,
    "pretrain": 0.1,
}
DEFAULT_WARMUP = {"state": 10}  # else Foundry's 100
DEFAULT_MAX_CACHE = 2048  # Foundry's KV cache length
SEED_MAX = 2**64 - 1  # MLX's generator takes a seed in [0, 2^64)


@dataclass
class TrainConfig(Settings):
    """Train an RWKV-7, RWKV-X or RFA model: LoRA, DoRA, state tuning, full fine-tuning or
    pretraining. Flags beat a --config file (ours, or mlx-lm's LoRA config); the file beats
    the defaults."""

    model: str | None = opt(
        "a checkpoint (any format mlx_rwkvx.load reads); for --mode pretrain a preset name or a "
        "JSON/YAML model config"
    )
    data: str | None = opt(
        "training data: a .jsonl, .bin, .sqlite/.db file or an mlx-lm style folder"
    )
    output: str | None = opt("output folder (checkpoints, adapter, metrics)", "adapter_path")
    mode: str = opt(
        f"what is trained: one of {MODES}", "fine_tune_type", default="lora", choices=MODES
    )
    train_mode: str = opt(
        "how: sft (the token loss of the data's answers), or preference "
        "training on prompt/chosen/rejected pairs: dpo (against the model as "
        "it starts) or orpo (no reference)",
        "training_mode",
        default="sft",
        choices=TRAIN_MODES,
    )
    beta: float = opt(
        "dpo: beta, the strength of the pull from the reference; orpo: lambda, "
        "the weight of the odds-ratio term (TRL calls both beta)",
        default=0.1,
        gt=0,
    )
    dpo_loss: str = opt(
        "dpo's loss: sigmoid (the paper's), ipo or hinge",
        default="sigmoid",
        choices=("sigmoid", "ipo", "hinge"),
    )
    lora_rank: int = opt("LoRA rank", "rank", default=32, ge=1)
    lora_alpha: float = opt("LoRA alpha (scale = alpha / rank)", default=64.0, gt=0)
    lora_scale: float | None = opt(
        "LoRA scale, mlx-lm's way of giving alpha (alpha = scale * rank); --lora-alpha on the "
        "command line beats it",
        gt=0,
    )
    lora_dropout: float = opt("dropout on the LoRA input", default=0.0, ge=0, lt=1)
    lora_targets: str | None = opt(
        "adapter targets: attn, qwen, rwkv, all, or comma-separated module globs (default: "
        "the family's: RWKV-X attn, RFA qwen, RWKV-7 rwkv)"
    )
    num_layers: int | None = opt(
        "adapt only the last N blocks (default: all; -1: all, as mlx-lm)", ge=1, also=(-1,)
    )
    lr: float | None = opt(
        "peak learning rate (default per mode: lora/dora/full 2e-5, state 1.0, pretrain 6e-4)",
        "learning_rate",
        gt=0,
    )
    weight_decay: float | None = opt(
        "AdamW weight decay of the trained matrices (default: 0.01; state tuning 0)", ge=0
    )
    epochs: int = opt("passes over the training data", default=3, ge=1)
    iters: int | None = opt("training steps (overrides --epochs)", ge=1)
    max_seq_len: int | None = opt(
        "tokens per example, or per segment with --carry-state (default: 512 RWKV-X/RWKV-7, "
        "256 RFA)",
        "max_seq_length",
        ge=2,
    )
    carry_state: bool = opt(
        "train a document longer than --max-seq-len as consecutive segments of that length, "
        "the state carried from one to the next with the gradient stopped at the boundary "
        "(RWKV's infctx); one optimizer step per batch of whole documents",
        default=False,
    )
    max_cache: int | None = opt(
        "with --carry-state: the attention blocks' KV cache keeps the last N tokens (a sliding "
        "window; default: 2048, Foundry's)",
        ge=1,
    )
    batch_size: int = opt("examples per step (with --parallel: per adapter)", default=1, ge=1)
    parallel: int = opt(
        "LoRA only: split the data into N equal parts and train N adapters at "
        "once from one init (one batched forward), saved as thread_<i> and "
        "averaged (FedAvg) into adapter_final (rfa_train's --parallel)",
        default=1,
        ge=1,
    )
    grad_accum: int = opt("micro-batches per step", "grad_accumulation_steps", default=1, ge=1)
    warmup: int | None = opt("linear warm-up steps (default: 100; state tuning 10)", ge=0)
    save_every: int = opt("checkpoint every N steps", default=1000, ge=1)
    log_every: int = opt("a log line every N steps", "steps_per_report", default=10, ge=1)
    val_data: str | None = opt("validation data (default: the data folder's valid.jsonl, if any)")
    val_every: int = opt(
        "validation loss every N steps (0: at the end only)", "steps_per_eval", default=0, ge=0
    )
    val_batches: int | None = opt(
        "batches of each validation (default: all; -1: all)", ge=1, also=(-1,)
    )
    test: bool = opt("evaluate on the test split at the end", default=False)
    test_batches: int | None = opt(
        "batches of the test evaluation (default: all; -1: all)", ge=1, also=(-1,)
    )
    grad_clip: float = opt("global gradient-norm clip (0: none)", default=1.0, ge=0)
    quantize: str | None = opt(
        "train on INT8 (or int4) base weights (bare: int8)", choices=("int8", "int4"), const="int8"
    )
    dtype: str | None = opt(
        "base weights' dtype: float32, bfloat16, float16 (default: as stored)",
        choices=("float32", "bfloat16", "float16"),
    )
    init: str = opt(
        "--mode pretrain: pretrain (RWKV-7's published init) or foundry (Foundry's; "
        "seeds is its older name)",
        default="pretrain",
        choices=("pretrain", "foundry", "seeds"),
    )
    seed: int = opt("random seed (adapter init, data order, dropout)", default=0, ge=0, le=SEED_MAX)
    resume: bool = opt(
        "continue the run in --output from its newest complete checkpoint", default=False
    )
    grad_checkpoint: bool = opt(
        "recompute each block in the backward, a model of RWKV-7 blocks alone a span of tokens "
        "at a time (less memory; turned on by itself where the run would not fit without it)",
        default=False,
    )
    memory_budget: float | None = opt(
        "GB the run may use at its peak (default: on a GPU its recommended working set, on a "
        "CPU the memory available): the estimate turns checkpointing on, or refuses the run",
        gt=0,
    )
    mask_prompt: bool = opt(
        "the loss on answers only: chat assistant turns, completions "
        "(--no-mask-prompt: on every token)",
        default=True,
    )
    sql: str | None = opt("with an SQLite --data: a query returning (conversation, role, content)")
    skip_bad: bool = opt(
        "skip bad examples (counted and reported) instead of stopping", default=False
    )
    plot: bool = opt("write loss.png (needs matplotlib: the plot extra)", default=False)

    def check_together(self) -> None:
        """Settings that do not go together (``check()``, inherited, checks each within its
        own limits first: a ``UsageError``, a ValueError, naming the flag)."""
        if self.grad_checkpoint and self.lora_dropout:
            raise UsageError(
                "--grad-checkpoint with --lora-dropout: the recomputed blocks would draw other "
                "dropout masks than the forward did (wrong gradients); use one of them"
            )
        defaults = {f.name: f.default for f in fields(TrainConfig)}
        for name in MODE_ONLY:
            problem = mode_only_problem(name, self.mode)
            if problem and getattr(self, name) != defaults[name]:
                raise UsageError(problem)
        if self.parallel > 1 and self.mode != "lora":
            raise UsageError(f"--parallel trains LoRA adapters: not --mode {self.mode}")
        if self.parallel > 1 and self.carry_state:
            raise UsageError("--parallel and --carry-state do not go together")
        if self.max_cache is not None and not self.carry_state:
            raise UsageError(
                "--max-cache sets the KV window of --carry-state: it needs --carry-state"
            )
        if self.mode == "pretrain" and self.dtype:
            raise UsageError("--mode pretrain trains a new model in float32: no --dtype")
        if self.mode == "pretrain" and self.quantize:
            raise UsageError("--mode pretrain trains every weight: no --quantize")
        if self.train_mode == "sft" and (self.beta != 0.1 or self.dpo_loss != "sigmoid"):
            raise UsageError("--beta and --dpo-loss apply to --train-mode dpo or orpo")
        if self.train_mode == "orpo" and self.dpo_loss != "sigmoid":
            raise UsageError("--dpo-loss applies to --train-mode dpo (orpo has one loss)")
        if self.train_mode != "sft":
            refused = (
                ("--mode pretrain", self.mode == "pretrain"),
                ("--parallel", self.parallel > 1),
                ("--carry-state", self.carry_state),
                ("--sql", self.sql is not None),
                ("--no-mask-prompt", not self.mask_prompt),
            )
            for flag, on in refused:
                if on:
                    raise UsageError(
                        f"--train-mode {self.train_mode} trains on preference pairs: not with "
                        f"{flag}"
                    )
        if self.mode == "pissa" and self.quantize:
            raise UsageError(
                "--mode pissa needs a float base: its residual would be quantized anew, and the "
                "saved adapter, applied to the original quantized base, would not be the trained "
                "model (use --mode lora or miss on a quantized base)"
            )

    @classmethod
    def from_yaml(cls, data: dict) -> dict:
        """Ours, or mlx-lm's LoRA config as it is: its ``lora_parameters`` block, its
        ``optimizer`` and ``optimizer_config``, its other keys where they ask for what this
        trainer does."""
        return _read_yaml(data)

    @classmethod
    def combine(cls, flags: dict, found: dict) -> dict:
        """The flags beat the file, and the command line's ``--lora-alpha`` its scale too;
        mlx-lm's ``--train`` and ``--optimizer`` read as its config's keys. A setting that does
        not apply to the run's ``--mode`` is refused on the command line, and noted and dropped
        from the file (an mlx-lm config carries lora_parameters whatever its fine_tune_type)."""
        if "lora_alpha" in flags:
            found.pop("lora_scale", None)
        found.update(_read_yaml({k: flags.pop(k) for k in MLX_LM_FLAGS if k in flags}))
        mode = flags.get("mode", found.get("mode", "lora"))
        for name in MODE_ONLY:
            problem = mode_only_problem(name, mode)
            if problem and name in flags:
                raise TrainError(problem)
        unused = [name for name in MODE_ONLY if mode_only_problem(name, mode) and name in found]
        if unused:
            verb = "does" if len(unused) == 1 else "do"
            print(
                f"note: --config: {', '.join(unused)} {verb} not apply to --mode {mode}: ignored",
                file=sys.stderr,
            )
            for name in unused:
                found.pop(name)
        return {**found, **flags}

    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """mlx-lm's ``--train`` and ``--optimizer`` (MLX_LM_FLAGS), so that its command pasted
        as it is works."""
        parser.add_argument(
            "--train",
            action="store_true",
            default=argparse.SUPPRESS,
            help="mlx-lm's flag, accepted: training is what this command does",
        )
        parser.add_argument(
            "--optimizer",
            choices=_MLX_LM_KEYS["optimizer"],
            default=argparse.SUPPRESS,
            help="mlx-lm's: adamw (AdamW, the default) or adam (no weight decay, unless "
            "--weight-decay gives one)",
        )

    def resolved(self, block_kinds: set[str] | None = None) -> TrainConfig:
        """A copy with the defaults filled in (per mode; ``max_seq_len`` per model family:
        Foundry's 256 for a model with Qwen2 blocks, else 512, when ``block_kinds`` is given).
        ValueError naming a setting out of its range."""
        self.check()
        all_ = lambda n: None if n == -1 else n  # noqa: E731 (mlx-lm's -1: all)
        seq_len = self.max_seq_len
        if seq_len is None and block_kinds is not None:  # rfa_train / rx_train
            seq_len = 256 if "qwen2" in block_kinds else 512
        return dataclasses.replace(
            self,
            max_seq_len=seq_len,
            init=INIT_ALIASES.get(self.init, self.init),
            lr=self.lr if self.lr is not None else DEFAULT_LR[self.mode],
            warmup=self.warmup if self.warmup is not None else DEFAULT_WARMUP.get(self.mode, 100),
            # the trained state is a vector per head, not a matrix: RWKV's trainers never
            # decay those
            weight_decay=self.weight_decay
            if self.weight_decay is not None
            else (0.0 if self.mode == "state" else 0.01),
            lora_alpha=self.lora_scale * self.lora_rank
            if self.lora_scale is not None
            else self.lora_alpha,
            lora_scale=None,
            num_layers=all_(self.num_layers),
            max_cache=(self.max_cache or DEFAULT_MAX_CACHE) if self.carry_state else None,
            val_batches=all_(self.val_batches),
            test_batches=all_(self.test_batches),
        )


# settings that apply to some modes only: given for another mode they are refused (on the
# command line and through the API: a value other than the default), or, from a --config file
# (an mlx-lm config carries lora_parameters whatever its fine_tune_type), noted and dropped
LORA_MODES = ("lora", "dora", "pissa", "miss")
SCALED_MODES = ("lora", "dora", "pissa")  # MiSS has no scale
MODE_ONLY = {
    "lora_rank": LORA_MODES,
    "lora_alpha": SCALED_MODES,
    "lora_scale": SCALED_MODES,
    "lora_dropout": LORA_MODES,
    "lora_targets": LORA_MODES,
    "num_layers": LORA_MODES,
    "init": ("pretrain",),
}


def mode_only_problem(name: str, mode: str) -> str | None:
    """Why setting ``name`` does not go with ``mode`` (None: it does)."""
    modes = MODE_ONLY.get(name)
    if modes is None or mode in modes:
        return None
    flag = name.replace("_", "-")
    return f"--{flag} applies to --mode {in_words(modes, 'or')}, not --mode {mode}"


# mlx-lm's LoRA config keys with no flag of ours: accepted as mlx-lm writes them by default,
# refused (with what to do instead) when they ask for something this trainer does not do
_MLX_LM_KEYS = {
    "train": (True, False, None),  # training is what this command does
    "optimizer": ("adam", "adamw"),  # AdamW (a weight decay of 0 is Adam)
    "optimizer_config": None,  # checked below
    "resume_adapter_file": (None,),
    "lr_schedule": (None,),
    "clear_cache_threshold": None,
    "report_to": (None, ""),
    "project_name": None,
    "trust_remote_code": (False,),
    "wandb": (None,),
    "config": (None,),  # mlx-lm dumps its --config path among the settings
}
_MLX_LM_INSTEAD = {
    "optimizer": "this trainer uses AdamW (optimizer: adamw or adam)",
    "resume_adapter_file": "to continue a run, pass --resume with its --output folder",
    "lr_schedule": "the schedule is linear warm-up then cosine decay: set --warmup and --lr",
    "report_to": "metrics go to metrics.jsonl in the output folder",
    "trust_remote_code": "no code from a checkpoint is ever run",
    "wandb": "metrics go to metrics.jsonl in the output folder",
    "config": "a config file cannot name another one",
}


def _read_yaml(data: dict) -> dict:
    """Our fields from a YAML config (ours, or mlx-lm's LoRA config). ValueError naming an
    unknown key or a value of the wrong type."""
    names = settings.names(TrainConfig)
    out = {}
    for key, value in data.items():
        key = str(key).replace("-", "_")
        if key in _MLX_LM_KEYS:
            allowed = _MLX_LM_KEYS[key]
            if allowed is not None and value not in allowed:
                raise ValueError(f"{key}: {value!r} is not supported; {_MLX_LM_INSTEAD[key]}")
            if key == "optimizer_config" and isinstance(value, dict):
                out.update(_optimizer_config(value, data.get("optimizer", "adam")))
            if key == "optimizer" and value == "adam" and "optimizer_config" not in data:
                out.setdefault("weight_decay", 0.0)  # Adam (a setting of its own may follow)
            continue
        if key == "lora_parameters" and isinstance(value, dict):  # mlx-lm's block
            for inner, ours in (
                ("rank", "lora_rank"),
                ("scale", "lora_scale"),
                ("alpha", "lora_alpha"),
                ("dropout", "lora_dropout"),
            ):
                if inner in value:
                    out[ours] = _typed(ours, value[inner])
            if value.get("keys"):
                out["lora_targets"] = ",".join(map(str, value["keys"]))
            unknown = set(value) - {"rank", "scale", "alpha", "dropout", "keys"}
            if unknown:
                raise ValueError(f"lora_parameters: unknown setting {sorted(unknown)[0]!r}")
            continue
        if key not in names:
            raise ValueError(f"unknown setting {key!r}")
        out[names[key]] = _typed(names[key], value)
    return out


def _optimizer_config(config: dict, optimizer: str) -> dict:
    """mlx-lm's ``optimizer_config``: only the chosen optimizer's block counts; of AdamW's
    settings this trainer takes the weight decay (betas and eps are RWKV's)."""
    chosen = config.get(optimizer) or {}
    if not isinstance(chosen, dict):
        raise ValueError(f"optimizer_config.{optimizer}: expected a mapping")
    other = set(chosen) - {"weight_decay"}
    if other:
        raise ValueError(
            f"optimizer_config.{optimizer}: {sorted(other)} not supported (only weight_decay; "
            "betas and eps are RWKV's trainers' 0.9, 0.99 and 1e-8)"
        )
    if "weight_decay" in chosen:
        return {"weight_decay": _typed("weight_decay", chosen["weight_decay"])}
    return {"weight_decay": 0.0} if optimizer == "adam" else {}


def _typed(name: str, value):
    return settings.typed(TrainConfig, name, value)


# mlx_lm.lora's flags with no field of ours, accepted on the command line as in its config
# (the keys of _MLX_LM_KEYS, read by from_yaml): its command pasted as it is works
MLX_LM_FLAGS = ("train", "optimizer")
