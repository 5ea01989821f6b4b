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

from mlx_rwkvx import cli, settings
from mlx_rwkvx.adapters.apply import apply_adapter
from mlx_rwkvx.adapters.files import read_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.errors import AdapterError, Interrupted, UsageError, signal_of
from mlx_rwkvx.evaluation import Row, default_seq_len, eval_examples, evaluate_loss
from mlx_rwkvx.evaluation.harness import make_lm, run_tasks, task_manager
from mlx_rwkvx.evaluation.lambada import TASK as LAMBADA
from mlx_rwkvx.evaluation.lambada import lambada, read_lambada
from mlx_rwkvx.generation.stream import default_max_cache
from mlx_rwkvx.io.load import load
from mlx_rwkvx.io.tokenizers import token_byte_lengths
from mlx_rwkvx.ops import configure_and_prepare
from mlx_rwkvx.settings import Settings, opt

from tqdm import tqdm

PROG = "mlx_rwkvx.evaluate"


@dataclass
class EvaluateConfig(Settings):
    """Evaluate models and adapters on a data set: loss, perplexity, bits per byte."""

    model: list[str] | None = opt(
        "a checkpoint or Hugging Face name (give several to compare them)", required=True
    )
    adapter: list[str] | None = opt(
        "an adapter to evaluate on the model it was trained on (repeatable)", "adapter_path"
    )
    data: str | None = opt("the data set: a file or folder the trainer reads, or a plain text file")
    split: str | None = opt("a data folder's split (default: test, else valid)")
    sql: str | None = opt(
        "--data is a SQLite database: the query returning (conversation, role, content) rows, "
        "as train takes it"
    )
    quantize: str | None = opt(
        "quantize the weights as they load (bare: int8)", choices=("int8", "int4"), const="int8"
    )
    dtype: str | None = opt(
        "cast the float weights: float32, bfloat16, float16 (default: as stored)",
        choices=("float32", "bfloat16", "float16"),
    )
    max_seq_len: int | None = opt(
        "tokens per window (default: the trainer's, 512, 256 with Qwen2 blocks)",
        "max_seq_length",
        ge=1,
    )
    carry_state: bool = opt(
        "long texts in windows, the state carried between them; --no-carry-state cuts them to "
        "--max-seq-len as the trainer's validation does without --carry-state",
        default=True,
    )
    max_cache: int | None = opt(
        "tokens the attention blocks' KV caches keep across windows (default: the model's own, "
        "else 2048)",
        ge=1,
    )
    batch_size: int = opt("texts per batch", default=1, ge=1)
    max_batches: int | None = opt("evaluate only the first N batches (default: all)", ge=1)
    tasks: list[str] | None = opt(
        f"tasks instead of the loss on --data: {LAMBADA} (on --data, a LAMBADA JSONL) or "
        "lm-evaluation-harness's (hellaswag, arc_easy, ...; the eval extra); comma-separated or "
        "repeated"
    )
    num_shots: int | None = opt(
        "lm-eval tasks: examples shown before each question (default: the task's)",
        "num_fewshot",
        ge=0,
    )
    limit: float | None = opt(
        "lm-eval tasks: only the first N documents of each (a fraction if < 1)", gt=0
    )
    apply_chat_template: bool = opt(
        "lm-eval tasks: render prompts with the tokenizer's chat template", default=False
    )
    include_path: str | None = opt("lm-eval tasks: a folder of your own task YAMLs")
    seed: int = opt("lm-eval tasks: the seed of few-shot sampling", default=0)
    json: bool = opt("print one JSON record instead of the table", default=False)

    def check_together(self) -> None:
        _tasks(self)


def main(argv: list[str] | None = None) -> None:
    cli.run(PROG, lambda: _main(settings.load(EvaluateConfig, argv, PROG)))


def _main(cfg: EvaluateConfig) -> None:
    tasks = _tasks(cfg)
    harness = [t for t in tasks if t != LAMBADA]
    manager = task_manager(harness, cfg.include_path) if harness else None  # names checked
    configure_and_prepare()
    jobs = _jobs(cfg)  # every adapter matched to its model before any work
    lambada_docs = read_lambada(cfg.data) if LAMBADA in tasks else None
    rows: list[dict] = []
    read = {}  # the data set's examples per model (its tokenizer) and window: read once
    try:
        for path, adapter in jobs:
            model, tokenizer = load(path, quantize=cfg.quantize, dtype=cfg.dtype)
            if adapter is not None:
                model = apply_adapter(model, adapter)
            head = {"model": path, "adapter": adapter}
            if not tasks:
                row, stopped = _perplexity(cfg, path, model, tokenizer, read)
                rows.append({**row, **head})
                if stopped is not None:  # Ctrl-C or SIGTERM: as it came, after the table
                    raise Interrupted(signal_of(stopped), kept="the result so far is above")
            if LAMBADA in tasks:
                rows.append({**_lambada(cfg, path, model, tokenizer, lambada_docs), **head})
            if harness:
                found = _harness(cfg, path, model, tokenizer, harness, manager)
                rows += [{**r, **head} for r in found]
    except KeyboardInterrupt:
        if rows:  # what was measured before Ctrl-C, marked
            _report(cfg, rows)
        raise
    _report(cfg, rows)


def _tasks(cfg: EvaluateConfig) -> list[str]:
    tasks = [t.strip() for spec in cfg.tasks or [] for t in spec.split(",") if t.strip()]
    harness = [t for t in tasks if t != LAMBADA]
    if LAMBADA in tasks and not cfg.data:
        raise UsageError(
            f'--tasks {LAMBADA} reads --data, a LAMBADA JSONL (lines {{"text": '
            "...}}, e.g. RWKV-LM's lambada_test.jsonl)"
        )
    if not tasks and not cfg.data:
        raise UsageError("--data is required (or --tasks)")
    lm_eval_only = (
        ("--num-shots", cfg.num_shots),
        ("--limit", cfg.limit),
        ("--include-path", cfg.include_path),
        ("--apply-chat-template", cfg.apply_chat_template or None),
    )
    given = [flag for flag, value in lm_eval_only if value is not None]
    if given and not harness:
        raise UsageError(f"{given[0]} goes with lm-evaluation-harness --tasks")
    return list(dict.fromkeys(tasks))


def _harness(
    cfg: EvaluateConfig, path: str, model, tokenizer, tasks: list[str], manager
) -> list[dict]:
    lm = make_lm(
        model,
        tokenizer,
        name=path,
        batch_size=cfg.batch_size,
        chat_template=cfg.apply_chat_template,
    )
    results = run_tasks(
        lm, tasks, num_fewshot=cfg.num_shots, limit=cfg.limit, seed=cfg.seed, manager=manager
    )
    rows = []
    for task, metrics in results.items():
        values = {
            k.removesuffix(",none"): v
            for k, v in metrics.items()
            if isinstance(v, (int, float)) and k not in ("alias", "sample_len")
        }
        rows.append({"task": task, "metrics": values})
    return rows


def _perplexity(cfg: EvaluateConfig, path: str, model, tokenizer, read: dict):
    """(the row of ``model`` on --data, the Ctrl-C or SIGTERM that cut it short or None). The
    data set and its tokens' byte lengths are made once per model file (its tokenizer) and
    window, for the model and each of its adapters."""
    seq_len = cfg.max_seq_len or default_seq_len(model)
    key = (path, model.config.vocab_size, seq_len)
    if key not in read:
        found, file = eval_examples(
            cfg.data,
            tokenizer,
            model.config.vocab_size,
            max_seq_len=seq_len,
            carry_state=cfg.carry_state,
            split=cfg.split,
            sql=cfg.sql,
        )
        lengths = token_byte_lengths(tokenizer, model.config.vocab_size) if tokenizer else None
        read[key] = found, file, lengths
    found, file, lengths = read[key]
    total = sum(int(e.trained.sum()) for e in found)
    with _bar(total, "tok", path) as bar:
        result, seconds = evaluate_loss(
            model,
            tokenizer,
            found,
            batch_size=cfg.batch_size,
            max_seq_len=seq_len,
            carry_state=cfg.carry_state,
            max_cache=cfg.max_cache or default_max_cache(model),
            max_batches=cfg.max_batches,
            on_batch=lambda _, n: bar.update(n),
            byte_lengths=lengths,
        )
    row = {"data": file, **Row(path, None, result, seconds).record(), "task": None}
    return row, result.stopped


def _lambada(cfg: EvaluateConfig, path: str, model, tokenizer, docs) -> dict:
    with _bar(len(docs), "text", f"{path}: {LAMBADA}") as bar:
        result = lambada(model, tokenizer, docs, batch_size=cfg.batch_size, on_done=bar.update)
    return {"data": cfg.data, **result.record()}


def _bar(total: int, unit: str, desc: str):
    """A progress bar on standard error, shown once a run passes 2 seconds."""
    return tqdm(
        total=total, unit=unit, desc=desc, delay=2, leave=False, disable=None, file=sys.stderr
    )


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
            raise AdapterError(
                f"{a}: the adapter was trained on another base model than "
                f"{given} (its base's fingerprint {want})"
            )
    return jobs


def _report(cfg: EvaluateConfig, rows: list[dict]) -> None:
    if cfg.json:
        print(json.dumps({"results": rows}))
        return
    losses = [r for r in rows if r.get("task") is None]
    if losses:
        print(f"{losses[0]['data']}:")
        _table(
            ("model", "loss", "ppl", "bits/byte", "tokens", "tok/s"),
            [
                (
                    _name(r),
                    f"{r['loss']:.4f}",
                    _ppl(r["perplexity"]),
                    "-" if math.isnan(r["bits_per_byte"]) else f"{r['bits_per_byte']:.4f}",
                    str(r["tokens"]),
                    f"{r['tokens_per_s']:.0f}",
                )
                for r in losses
            ],
        )
    lambadas = [r for r in rows if r.get("task") == LAMBADA]
    if lambadas:
        print(f"{LAMBADA} ({lambadas[0]['data']}):")
        _table(
            ("model", "accuracy", "ppl", "texts"),
            [
                (_name(r), f"{100 * r['accuracy']:.2f}%", _ppl(r["perplexity"]), str(r["texts"]))
                for r in lambadas
            ],
        )
    harness = [r for r in rows if "metrics" in r]
    if harness:
        print("lm-evaluation-harness:")
        _table(
            ("model", "task", "metric", "value"),
            [
                (_name(r), r["task"], metric, f"{value:.4f}")
                for r in harness
                for metric, value in sorted(r["metrics"].items())
            ],
        )


def _name(r: dict) -> str:
    name = r["model"] + (f" + {r['adapter']}" if r["adapter"] else "")
    return name + ("" if r.get("complete", True) else " (interrupted: so far)")


def _table(head: tuple, body: list[tuple]) -> None:
    table = [head, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        rest = zip(row[1:], widths[1:], strict=True)
        print("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in rest]))


def _ppl(p: float) -> str:
    return "inf" if math.isinf(p) else f"{p:.3f}" if p < 1e4 else f"{p:.3e}"


if __name__ == "__main__":
    main()
