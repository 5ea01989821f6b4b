"""EleutherAI's lm-evaluation-harness with our models: ``make_lm`` gives an ``lm_eval`` model
(registered as ``mlx_rwkvx``) over a loaded model and tokenizer, as ``mlx_lm.evaluate`` does for
mlx-lm's; ``run_tasks`` runs tasks with it. lm-eval lives in the ``eval`` extra and is imported
only here, when tasks run.

- ``loglikelihood``: the continuation's summed log-probability after the context and whether
  it is greedy, by ``likelihood.continuation_scores`` (what LAMBADA uses). The context's
  trailing spaces move to the continuation, and an empty context becomes the document-start
  token, as lm-eval's own Hugging Face model does.
- ``loglikelihood_rolling``: a whole text after the document-start token, in one pass (the
  state carries it: no windows to overlap).
- ``generate_until``: greedy (or ``temperature``-sampled) generation through our
  ``stream_generate``, one request after another, stopping at any ``until`` string.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.evaluation.lambada import document_start
from mlx_rwkvx.evaluation.likelihood import continuation_scores
from mlx_rwkvx.generation import stream_generate
from mlx_rwkvx.models import Model

NAME = "mlx_rwkvx"
_CLASS = None  # the LM subclass, made (and registered) once lm_eval is imported


def require_lm_eval(tasks: Sequence[str]):
    """The ``lm_eval`` module, or one UsageError saying what to install."""
    try:
        import lm_eval
    except ImportError as e:
        raise UsageError(
            f"--tasks {','.join(tasks)}: these are lm-evaluation-harness tasks, and it is not "
            f"installed ({e}): pip install 'mlx_rwkvx[eval]'"
        ) from None
    return lm_eval


def make_lm(
    model: Model,
    tokenizer,
    *,
    name: str = "model",
    batch_size: int = 8,
    chat_template: bool = False,
    max_tokens: int = 256,
):
    """An lm-eval ``LM`` over ``model`` and ``tokenizer``; ``chat_template``: lm-eval renders
    its prompts with the tokenizer's chat template (``--apply-chat-template``)."""
    return _lm_class()(
        model,
        tokenizer,
        name=name,
        batch_size=batch_size,
        chat_template=chat_template,
        max_tokens=max_tokens,
    )


def _lm_class():
    global _CLASS
    if _CLASS is not None:
        return _CLASS
    from lm_eval.api.model import LM
    from lm_eval.api.registry import register_model

    class RwkvxLM(LM):
        def __init__(self, model, tokenizer, *, name, batch_size, chat_template, max_tokens):
            super().__init__()
            self.model, self.tokenizer, self.name = model, tokenizer, name
            self.batch_size, self.max_tokens = batch_size, max_tokens
            self.use_chat_template = chat_template
            start = document_start(tokenizer)
            eos = getattr(tokenizer, "eos_token_id", None)
            self.prefix = start or ([eos] if eos is not None else [])

        @property
        def tokenizer_name(self) -> str:
            return self.name.replace("/", "__")

        def apply_chat_template(self, chat_history, add_generation_prompt=True) -> str:
            return self.tokenizer.apply_chat_template(
                chat_history, add_generation_prompt=add_generation_prompt, tokenize=False
            )

        def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
            spaces = len(context) - len(context.rstrip())
            if spaces:  # as lm-eval's HFLM: the context's trailing spaces go with the answer
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            if not context:
                if not self.prefix:
                    raise UsageError(
                        "an empty context, and the tokenizer has no token that starts a document"
                    )
                return list(self.prefix), self.tokenizer.encode(continuation)
            whole = self.tokenizer.encode(context + continuation)
            head = self.tokenizer.encode(context)
            return head, whole[len(head) :]

        def loglikelihood(self, requests) -> list[tuple[float, bool]]:
            pairs = [self._pair(*req.args) for req in requests]
            scores = continuation_scores(self.model, pairs, batch_size=self.batch_size)
            return [(s.logprob, s.greedy) for s in scores]

        def loglikelihood_rolling(self, requests) -> list[float]:
            pairs = [(list(self.prefix), self.tokenizer.encode(req.args[0])) for req in requests]
            scores = continuation_scores(self.model, pairs, batch_size=1)
            return [s.logprob for s in scores]

        def generate_until(self, requests) -> list[str]:
            out = []
            for req in requests:
                context, kwargs = req.args
                kwargs = dict(kwargs or {})
                until = kwargs.pop("until", None) or []
                until = [until] if isinstance(until, str) else list(until)
                limit = int(kwargs.pop("max_gen_toks", self.max_tokens))
                temp = float(kwargs.pop("temperature", 0.0) or 0.0)
                if not kwargs.pop("do_sample", False):
                    temp = 0.0
                text = "".join(
                    r.text
                    for r in stream_generate(
                        self.model, self.tokenizer, context, max_tokens=limit, temp=temp, stop=until
                    )
                )
                out.append(text)
            return out

    register_model(NAME)(RwkvxLM)
    _CLASS = RwkvxLM
    return _CLASS


def task_manager(
    tasks: Sequence[str], include_path: str | None = None, include_defaults: bool = True
):
    """lm-eval's ``TaskManager`` over its own tasks (unless ``include_defaults=False``) and the
    task YAMLs of ``include_path``, every one of ``tasks`` checked to be among them (one
    UsageError naming the first that is not)."""
    require_lm_eval(tasks)
    from lm_eval.tasks import TaskManager

    if include_path is not None and not os.path.isdir(include_path):
        raise UsageError(f"--include-path {include_path}: no such folder")
    manager = TaskManager(include_path=include_path, include_defaults=include_defaults)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UsageError(
            f"--tasks: unknown task {unknown[0]!r} (not built in, and not among "
            "lm-evaluation-harness's tasks or --include-path's)"
        )
    return manager


def run_tasks(
    lm,
    tasks: Sequence[str],
    *,
    num_fewshot: int | None = None,
    limit: float | None = None,
    include_path: str | None = None,
    include_defaults: bool = True,
    seed: int = 0,
    manager=None,
) -> dict:
    """lm-eval's ``simple_evaluate`` of ``tasks`` with ``lm``: its results by task (each a dict
    of metrics). ``manager``: a ``task_manager`` already made (else one is, from
    ``include_path`` and ``include_defaults``)."""
    lm_eval = require_lm_eval(tasks)
    if manager is None:
        manager = task_manager(tasks, include_path, include_defaults)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=list(tasks),
        num_fewshot=num_fewshot,
        limit=limit,
        apply_chat_template=lm.use_chat_template,
        task_manager=manager,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=None,
        fewshot_random_seed=seed,
        log_samples=False,
        bootstrap_iters=0,
    )
    return results["results"]
