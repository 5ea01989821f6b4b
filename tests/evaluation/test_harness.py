"""lm-evaluation-harness with our models, offline: task YAMLs over local JSONL data sets this
test writes, loaded through ``TaskManager(include_path=..., include_defaults=False)`` (so no
test indexes lm-eval's thousands of tasks, but one command run). ``loglikelihood`` equals its
float64 definition and ``evaluate``'s loss on the same text; the tasks' metrics equal what the
requests' scores say. Without the ``eval`` extra the module is skipped, except under CI
(``MLX_RWKVX_CI=1``)."""

from __future__ import annotations

import json
import re
import sys

import mlx_rwkvx
from mlx_rwkvx.data.examples import Example
from mlx_rwkvx.data.loss import dataset_loss
from mlx_rwkvx.errors import UsageError
from mlx_rwkvx.evaluation.harness import make_lm, run_tasks, task_manager
from mlx_rwkvx.io.tokenizers import ByteTokenizer

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_module, tiny_model
from helpers.parity import import_parity_extra

(lm_eval,) = import_parity_extra(("lm_eval",), extra="eval")
pytestmark = pytest.mark.extra("eval")

CHOICE = [
    {"question": "The sky is", "choices": [" blue", " green", " loud"], "answer": 0},
    {"question": "Two plus two is", "choices": [" four", " five"], "answer": 0},
    {"question": "Cats say", "choices": [" moo", " meow"], "answer": 1},
    {"question": "Fire is", "choices": [" cold", " hot", " wet", " slow"], "answer": 1},
]
TEXTS = [{"text": "the quick brown fox jumps over the lazy dog. " * 3}, {"text": "hello world"}]
QA = [{"q": "Say yes:", "a": " yes"}, {"q": "Say no:", "a": " no"}]


def task_folder(tmp_path):
    """Three tasks, one of each kind of request, over JSONL files in ``tmp_path``."""
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for name, docs in (("choice", CHOICE), ("texts", TEXTS), ("qa", QA)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = "dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {}\ntest_split: test\n"
    yamls = {
        "tiny_choice": "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: '{{answer}}'\n"
        "metric_list:\n  - metric: acc\n    higher_is_better: true\n",
        "tiny_texts": "output_type: loglikelihood_rolling\ndoc_to_text: ''\n"
        "doc_to_target: '{{text}}'\nmetric_list:\n  - metric: word_perplexity\n"
        "    higher_is_better: false\n",
        "tiny_qa": "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n"
        "generation_kwargs:\n  until: ['\\n']\n  max_gen_toks: 4\n"
        "metric_list:\n  - metric: exact_match\n    higher_is_better: true\n",
    }
    files = {"tiny_choice": "choice", "tiny_texts": "texts", "tiny_qa": "qa"}
    for task, body in yamls.items():
        data = tmp_path / f"{files[task]}.jsonl"
        (tasks / f"{task}.yaml").write_text(f"task: {task}\n" + common.format(data) + body)
    return tasks


class Request:  # what lm-eval hands an LM: ``args``
    def __init__(self, *args):
        self.args = args


def logprob(model, context, continuation) -> float:
    ids = context + continuation
    logits = np.array(model(mx.array([ids[:-1]]))[0], dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return sum(logp[len(context) - 1 + j, t] for j, t in enumerate(continuation))


@pytest.mark.parametrize("family", ["rwkv7", "rwkv-x", "rfa"])
def test_loglikelihood_is_its_definition_and_evaluates(family):
    model, tokenizer = tiny_model(family, seed=4), ByteTokenizer()
    lm = make_lm(model, tokenizer, batch_size=3)
    pairs = [("The sky is", " blue"), ("Cats say ", "meow"), ("", "hello"), ("x", " y z")]
    got = lm.loglikelihood([Request(c, x) for c, x in pairs])
    for (context, continuation), (score, _) in zip(pairs, got, strict=True):
        spaces = len(context) - len(context.rstrip())  # moved to the continuation
        context, continuation = context.rstrip(), context[len(context) - spaces :] + continuation
        head = tokenizer.encode(context) if context else [0]
        expected = logprob(model, head, tokenizer.encode(continuation))
        assert score == pytest.approx(expected, rel=1e-5, abs=1e-5), (context, continuation)
    # rolling: the whole text after the document start, = minus evaluate's summed loss on it
    text = TEXTS[0]["text"]
    (rolling,) = lm.loglikelihood_rolling([Request(text)])
    ids = np.array([0] + tokenizer.encode(text), dtype=np.int32)
    trained = np.ones(len(ids), dtype=bool)
    trained[0] = False
    loss = dataset_loss(model, [Example(ids, trained)], batch_size=1)
    assert rolling == pytest.approx(-loss.loss, rel=1e-5)


def test_tasks_of_each_kind_run_offline(tmp_path):
    model, tokenizer = tiny_model("rwkv7", seed=6), ByteTokenizer()
    lm = make_lm(model, tokenizer, name="tiny", batch_size=2)
    tasks = str(task_folder(tmp_path))
    results = run_tasks(
        lm, ["tiny_choice", "tiny_texts", "tiny_qa"], include_path=tasks, include_defaults=False
    )
    # multiple choice: right where the answer's log-likelihood is the largest of the choices
    right = 0
    for doc in CHOICE:
        context = tokenizer.encode(doc["question"])
        scores = [logprob(model, context, tokenizer.encode(c)) for c in doc["choices"]]
        right += int(np.argmax(scores)) == doc["answer"]
    assert results["tiny_choice"]["acc,none"] == pytest.approx(right / len(CHOICE))
    # word perplexity: exp(-summed log-likelihood / words), over both texts (lm-eval counts
    # the pieces between runs of whitespace: a trailing space makes one more)
    total = sum(logprob(model, [0], tokenizer.encode(d["text"])) for d in TEXTS)
    words = sum(len(re.split(r"\s+", d["text"])) for d in TEXTS)
    assert results["tiny_texts"]["word_perplexity,none"] == pytest.approx(
        np.exp(-total / words), rel=1e-4
    )
    assert 0.0 <= results["tiny_qa"]["exact_match,none"] <= 1.0


def test_the_command_runs_lm_eval_tasks(tmp_path):
    mlx_rwkvx.save(tiny_model("rwkv7", seed=6), tmp_path / "m")
    tasks = task_folder(tmp_path)
    out = run_module(
        "evaluate",
        "--model",
        tmp_path / "m",
        "--tasks",
        "tiny_choice,tiny_qa",
        "--include-path",
        tasks,
        "--limit",
        3,
        "--json",
    )
    assert out.returncode == 0, out.stderr
    rows = json.loads(out.stdout.splitlines()[-1])["results"]
    assert sorted(r["task"] for r in rows) == ["tiny_choice", "tiny_qa"]
    assert all(r["model"] == str(tmp_path / "m") for r in rows)
    assert "acc" in next(r for r in rows if r["task"] == "tiny_choice")["metrics"]
    with pytest.raises(UsageError) as e:  # the command's check, without indexing lm-eval's own
        task_manager(["tiny_choice", "no_such_task"], str(tasks), include_defaults=False)
    assert str(e.value) == (
        "--tasks: unknown task 'no_such_task' (not built in, and not "
        "among lm-evaluation-harness's tasks or --include-path's)"
    )


def test_without_lm_eval_one_line_says_what_to_install(tmp_path):
    mlx_rwkvx.save(tiny_model("rwkv7", seed=6), tmp_path / "m")
    code = (
        "import sys; sys.modules['lm_eval'] = None\n"
        "from mlx_rwkvx.evaluate import main\n"
        f"main(['--model', {str(tmp_path / 'm')!r}, '--tasks', 'hellaswag'])"
    )
    import subprocess

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 2 and out.stdout == ""
    (line,) = out.stderr.strip().splitlines()
    assert line.startswith(
        "mlx_rwkvx.evaluate: error: --tasks hellaswag: these are "
        "lm-evaluation-harness tasks, and it is not installed"
    )
    assert line.endswith("pip install 'mlx_rwkvx[eval]'")
