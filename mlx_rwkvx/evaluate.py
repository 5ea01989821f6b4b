"""``python -m mlx_rwkvx.evaluate``: how good a model is on a data set.

``--model M [--model M2 ...] [--adapter A ...] --data D`` reports, for each model and each
adapter (on the model it was trained on, found by its base fingerprint), side by side: the mean
loss, perplexity and bits per byte of D, the tokens evaluated and tokens/s. D is any data set
the trainer reads, or a plain text file. Settings: ``EvaluateConfig`` below (flags, a YAML
``--config``). The work is ``mlx_rwkvx.evaluation``'s.

Exit codes: 0 done; 2 a problem with what was given (one line); 130 or 143 Ctrl-C or SIGTERM,
after printing the result so far; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass

import mlx_rwkvx
from mlx_rwkvx import cli, settings
from mlx_rwkvx.errors import AdapterError, Interrupted, UsageError
from mlx_rwkvx.evaluation import Row, default_seq_len, eval_examples, evaluate_loss
from mlx_rwkvx.generation.stream import default_max_cache
from mlx_rwkvx.io.load import load
from mlx_rwkvx.ops import prepare
from mlx_rwkvx.settings import opt
from mlx_rwkvx.tuner.adapters import apply_adapter, fingerprint, read_adapter

import mlx.core as mx
from tqdm import tqdm

PROG = "mlx_rwkvx.evaluate"


@dataclass
class EvaluateConfig:
    model: list = opt("a checkpoint or Hugging Face name (give several to compare them)")
    adapter: list = opt("an adapter to evaluate on the model it was trained on (repeatable)",
                        "adapter_path")  # fmt: skip
    data: str = opt("the data set: a file or folder the trainer reads, or a plain text file")
    split: str = opt("a data folder's split (default: test, else valid)")
    quantize: str = opt("quantize the weights as they load (bare: int8)",
                        choices=("int8", "int4"), const="int8")  # fmt: skip
    dtype: str = opt("cast the float weights: float32, bfloat16, float16 (default: as stored)",
                     choices=("float32", "bfloat16", "float16"))  # fmt: skip
    max_seq_len: int = opt("tokens per window (default: the trainer's, 512, 256 with Qwen2 "
                           "blocks)", "max_seq_length")  # fmt: skip
    carry_state: bool = opt("long texts in windows, the state carried between them; "
                            "--no-carry-state cuts them to --max-seq-len as the trainer's "
                            "validation does without --carry-state", default=True)  # fmt: skip
    max_cache: int = opt("tokens the attention blocks' KV caches keep across windows "
                         "(default: the model's own, else 2048)")  # fmt: skip
    batch_size: int = opt("texts per batch", default=1)
    max_batches: int = opt("evaluate only the first N batches (default: all)")
    json: bool = opt("print one JSON record instead of the table", default=False)


def parser():
    return settings.make_parser(
        EvaluateConfig, PROG,
        "Evaluate models and adapters on a data set: loss, perplexity, bits per byte.",
    )  # fmt: skip


def config_from(argv) -> EvaluateConfig:
    args, found = settings.parse(parser(), argv, settings.plain_yaml(EvaluateConfig))
    found.update(args)
    cfg = EvaluateConfig(**found)
    if not cfg.model:
        parser().error("--model is required (on the command line or in --config)")
    if not cfg.data:
        parser().error("--data is required (on the command line or in --config)")
    return cfg


def _check(cfg: EvaluateConfig) -> None:
    try:
        settings.check_types(cfg)
    except ValueError as e:
        raise UsageError(str(e)) from None
    for name in ("max_seq_len", "max_cache", "batch_size", "max_batches"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1, got {value}")


def main(argv: list[str] | None = None) -> None:
    cfg = config_from(argv)
    cli.run(PROG, lambda: _main(cfg))


def _main(cfg: EvaluateConfig) -> None:
    _check(cfg)
    mlx_rwkvx.configure()
    prepare(dtypes=(mx.float32, mx.bfloat16))
    jobs = _jobs(cfg)  # every adapter matched to its model before any work
    rows: list[Row] = []
    examples = {}  # per model's tokenizer and window: read once
    file = cfg.data
    try:
        for path, adapter in jobs:
            model, tokenizer = load(path, quantize=cfg.quantize, dtype=cfg.dtype)
            if adapter is not None:
                model = apply_adapter(model, adapter)
            seq_len = cfg.max_seq_len or default_seq_len(model)
            key = (path, model.config.vocab_size, seq_len)
            if key not in examples:
                examples[key] = eval_examples(
                    cfg.data, tokenizer, model.config.vocab_size, max_seq_len=seq_len,
                    carry_state=cfg.carry_state, split=cfg.split,
                )  # fmt: skip
            found, file = examples[key]
            total = sum(int(e.trained.sum()) for e in found)
            name = f"{path}" + (f" + {adapter}" if adapter else "")
            with tqdm(total=total, unit="tok", desc=name, delay=2, leave=False,
                      disable=None, file=sys.stderr) as bar:  # fmt: skip
                result, seconds = evaluate_loss(
                    model, tokenizer, found, batch_size=cfg.batch_size, max_seq_len=seq_len,
                    carry_state=cfg.carry_state,
                    max_cache=cfg.max_cache or default_max_cache(model),
                    max_batches=cfg.max_batches, on_batch=lambda _, n: bar.update(n),
                )  # fmt: skip
            rows.append(Row(path, adapter, result, seconds))
            if not result.complete:
                raise Interrupted(kept="the result so far is above")
    except KeyboardInterrupt:
        if rows:  # what was measured before Ctrl-C, marked
            _report(cfg, rows, file)
        raise
    _report(cfg, rows, file)


def _jobs(cfg: EvaluateConfig) -> list[tuple[str, str | None]]:
    """(model, adapter or None) in the order of the table: each model, then each adapter on
    the model whose base fingerprint it carries; an adapter of none of them is refused."""
    jobs = [(m, None) for m in cfg.model]
    if not cfg.adapter:
        return jobs
    prints = {}
    for m in cfg.model:
        model, _ = load(m, quantize=cfg.quantize, dtype=cfg.dtype, tokenizer=False)
        prints.setdefault(fingerprint(model), m)
        del model
    for a in cfg.adapter:
        want = read_adapter(a)[0].get("base_fingerprint")
        if want is None:  # mlx-lm's adapters carry none: the first model, checked as it loads
            jobs.append((cfg.model[0], a))
        elif want in prints:
            jobs.append((prints[want], a))
        else:
            given = "the model given" if len(cfg.model) == 1 else "any of the models given"
            raise AdapterError(f"{a}: the adapter was trained on another base model than "
                               f"{given} (its base's fingerprint {want})")  # fmt: skip
    return jobs


def _report(cfg: EvaluateConfig, rows: list[Row], file: str) -> None:
    records = [r.record() for r in rows]
    if cfg.json:
        print(json.dumps({"data": file, "results": records}))
        return
    print(f"{file}:")
    head = ("model", "loss", "ppl", "bits/byte", "tokens", "tok/s")
    table = [head]
    for r in records:
        name = r["model"] + (f" + {r['adapter']}" if r["adapter"] else "")
        if not r["complete"]:
            name += " (interrupted: so far)"
        bpb = r["bits_per_byte"]
        table.append((name, f"{r['loss']:.4f}", _ppl(r["perplexity"]),
                      "-" if math.isnan(bpb) else f"{bpb:.4f}", str(r["tokens"]),
                      f"{r['tokens_per_s']:.0f}"))  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        cells = [row[0].ljust(widths[0])] + [
            c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)
        ]
        print("  ".join(cells))


def _ppl(p: float) -> str:
    return "inf" if math.isinf(p) else f"{p:.3f}" if p < 1e4 else f"{p:.3e}"


if __name__ == "__main__":
    main()
