"""The benchmarks (the ``benchmarks`` package, run as ``scripts/bench.py``): every section
measures and renders in ``--quick`` mode, its verification comes before any timing, the
rendered markdown has its tables and goal lines, and each renderer returns the goals it lists.

The quick sizes say nothing about speed: only the shape of what is written is checked.
"""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

from benchmarks import cli, common, plot, report, run, wkv7
from benchmarks import moba as moba_section
from benchmarks.common import Goal, Rendered, Section, with_goals
from benchmarks.sections import SECTIONS

import pytest
from helpers import ROOT

BENCH_PATH = ROOT / "scripts" / "bench.py"
PACKAGE = Path(common.__file__).resolve().parent

GOAL = r"[\d.]+ \(goal (>=|<=) [\d.]+\): (met|MISSED)$"
# Lines each section must write (exactly, or as a regular expression when it starts with ^).
EXPECTED = {
    "blas": [
        "Physical limits for later benchmarks:",
        r"^\| fp32 matmul n x n x n \| MLX \+ OpenBLAS \| .*\| MLX\+OpenBLAS / NumPy \|$",
        r"^- memory read bandwidth: [\d.]+ GB/s with \d+ threads .*streaming 64 MiB of fp32$",
        r"^- MLX\+OpenBLAS / bundled BLAS, fp32 n=256: [\d.]+ \(goal >= 10\): (met|MISSED)$",
        r"^- MLX\+OpenBLAS / NumPy, fp32 n=256: [\d.]+ \(goal >= 0.8\): (met|MISSED)$",
    ],
    "wkv7": [
        "Peak memory of fwd+bwd (above the inputs):",
        r"^Verified first \(T=100, H=2\): wkv7 vs wkv7_ref y ",
        r"^\| T \| H \| wkv7 fwd \| mlx-lm fwd \| ref fwd \|",
        r"^\| T \| H \| chunked fwd matmul work \| achieved \| of 256\^3 rate \|",
        r"^- fwd\+bwd T=64 H=2 vs ref autograd: [\d.]+ \(goal >= 100\)",
        r"^- fwd T=256 H=2 vs mlx-lm: [\d.]+ \(goal >= 20\)",
        r"^- fwd\+bwd peak memory ref / ours at T=128: [\d.]+ \(goal >= 10\)",
        r"^- T=256 / T=64 fwd time: [\d.]+ \(goal <= 4.5\)",
        r"^- T=256 / T=64 fwd\+bwd time: [\d.]+ \(goal <= 4.5\)",
    ],
    "moba": [
        r"^Verified first \(T=256\): moba_attention vs the dense masked reference: output ",
        r"^B=1, 2 heads, D=32, chunk_size 32, top_k 3, float32\.",
        r"^\| T \| moba fwd \| dense fwd \| fwd speed-up \|",
        r"^\| T \| moba fwd matmul work \| achieved \| of the matmul rate \|$",
        r"^- fwd\+bwd T=1024 vs dense: [\d.]+ \(goal >= 3\)",
        r"^- fwd\+bwd peak memory T=1024, dense / moba: [\d.]+ \(goal >= 4\)",
        r"^- fwd time T=1024 / T=256: [\d.]+ \(goal <= 5\)",
        r"^- fwd\+bwd time T=1024 / T=256: [\d.]+ \(goal <= 5\)",
    ],
    "models": [
        "| decode | tok/s | of the fp32 bound |",
        "The tiny RFA config (random weights) in INT8:",
        r"^Verified first: logits of the 2-layer C=128 vocab-1024 model vs mlx-lm's, T=64: ",
        r"^\| prefill T=64, 2 x C=128, vocab 1024 \(all logits\) \| time \| vs matmul bound \|$",
        r"^\| (fp32|mlx-lm fp32|bf16|int8) \| [\d.]+ \| \d+% \|$",
        r"^Prefill T=256 of a 2-layer C=64 vocab-512 model \(logits vs mlx-lm ",
        r"^- prefill T=64 / matmul bound: [\d.]+ \(goal <= 1.3\)",
        r"^- prefill T=256 small model vs mlx-lm: [\d.]+ \(goal >= 10\)",
        r"^- fp32 decode / weight-read bound: [\d.]+ \(goal >= 0.85\)",
        r"^- tiny RFA INT8 peak while building, GB: [\d.]+ \(goal <= 2.3\)",
        r"^- tiny RFA INT8 peak while loading, GB: [\d.]+ \(goal <= 2.3\)",
    ],
    "train": [
        r"^Verified first: the first LoRA step's loss, ours vs mlx-lm's on the same weights ",
        r"^\| recurrent: 2 x C=64, vocab 512, T=128, batch 1 \| \d+ \| \d+ \(1, 128\) \|",
    ],
    "train-int8": [
        r"^INT8 LoRA \(the default targets, rank 32\) on the tiny RFA config",
        r"^\| --grad-checkpoint \| 32 \| [\d.]+ GB \| [\d.]+ GB \| \d+ s \|$",
        r"^- INT8 RFA LoRA \(default\) peak resident memory, GB: [\d.]+ \(goal <= 3\)",
        r"^- INT8 RFA LoRA \(--grad-checkpoint\) peak resident memory, GB: [\d.]+ \(goal <= 3\)",
    ],
    "generate": [
        r"^Verified first: each generated step's log-probabilities against the full forward",
        r"^\| mlx_rwkvx \(head on the last position\) \| [\d.]+ s \| [\d.]+ \|$",
        r"^\| fp32 \| [\d.]+ \| \d+% \| \d+% \|$",
        r"^\| x @ W.T, compiled \| [\d.]+ \| [\d.]+ \| \d+% \|$",
        r"^\| RWKV-X 4 blocks C=64 \| \d+ tokens held \| \d+ \|",
        r"^- fp32 decode / MLX one-row matmuls: [\d.]+ \(goal >= 0.9\)",
    ],
    "parallel": [
        r"^Verified first: after one step, shard 0's adapter of `--parallel 4`",
        r"^\| --parallel 4 \(one batched step\) \| [\d.]+ s \| \d+ \| [\d.]+ \|$",
        r"^\| 1 \| [\d.]+ s \| \d+ \| [\d.]+ ms \| [\d.]+% \| [\d.]+ MB \|$",
        r"^- --parallel 4 tokens/s vs one shard: [\d.]+ \(goal >= 2.5\)",
    ],
    "evaluate": [
        r"^Verified first: the evaluation's summed loss equals the bare forward's to [\d.e+-]+\.$",
        r"^\| bare forward \+ fused loss \| \d+ \| \d+% \|$",
        r"^\| evaluate \| \d+ \| \d+% \|$",
        r"^- evaluate tokens/s, of the bare forward with the fused loss: [\d.]+ \(goal >= 0.9\)",
        r"^- evaluation peak memory, 10x the data / 1x: [\d.]+ \(goal <= 1.1\)",
    ],
    "serve": [
        r"^Verified first: each served first answer's log-probabilities against the generation ",
        r"^\| model \| where \| prompt \| cached \| first token \| prefill here \| ratio \|",
        r"^\| RWKV-X \| after a restart \| \d+ \| \d+ \| \d+ ms \| \d+ ms \| [\d.]+ \|",
        r"^\| 2 \| \d+ \| [\d.]+ s \| [\d.]+ \| [\d.]+ \|$",
        r"^Decode holding the answer to a JSON schema ",
        r"^Load test: \d+ requests from \d+ clients in \d+ s .*: 0 answered 5xx",
        r"^- second turn's first token / its new tokens on the restored state, RFA, after a "
        r"restart: [\d.]+ \(goal <= 1.1\)",
        r"^- decode tokens/s with a JSON schema / without: [\d.]+ \(goal >= 0.7\)",
        r"^- load test 5xx answers: 0.00 \(goal <= 0\): met$",
        r"^Soak: \d+ clients x \d+ requests in \d+ s, .* \d+ good requests: 0 5xx, ",
        r"^- soak: 5xx answers, late or wrong good answers, bad requests not a 4xx, answers "
        r"still running or a server not answering at the end: 0.00 \(goal <= 0\): met$",
    ],
    "preference": [
        r"^Verified first: DPO's first loss is ln 2 to [\d.e+-]+; a pair's log-probability ",
        r"^\| LoRA SFT \| \d+ \| [\d.]+ s \| \d+ \| [\d.]+ s \| \d+% \| \d+ MiB \|$",
        r"^\| DPO \| \d+ \| [\d.]+ s \| \d+ \| [\d.]+ s \| \d+% \| \d+ MiB \|$",
        r"^- DPO step time / LoRA SFT step on the same sequences: [\d.]+ \(goal <= 1.2\)",
    ],
    "memory": [
        r"^\| LoRA parameters \(trained\) \| [\d.]+ \| [\d.]+ \|$",
        r"^\| \*\*peak resident, whole process\*\* \| [\d.]+ \| [\d.]+ \|$",
        r"^What importing costs, each in a fresh interpreter",
    ],
    "memory-fit": [
        r"^\| model \| train flags \| peak, checkpointed \(GB\) \| goal \| defaults' peak \|",
        r"^\| tiny \| `--quantize int8 --max-seq-len 32` \| [\d.]+ \| <= 3.0 \| [\d.]+ \| "
        r"[\d.]+ \| [\d.]+ \| \d+ GB \|$",
        r"^- extrapolated / measured whole, % off: [\d.]+ \(goal <= 5\)",
    ],
    "loss": [
        r"^Verified first: fused vs dense loss [\d.e+-]+, dh [\d.e+-]+, dW [\d.e+-]+\.$",
        r"^\| fused \| [\d.]+ s \| \d+ MiB \|$",
        r"^- loss\+backward peak memory, dense / fused: [\d.]+ \(goal >= 8\)",
    ],
}
GOAL_COUNTS = {
    "blas": 2,
    "wkv7": 5,
    "moba": 4,
    "models": 5,
    "loss": 1,
    "train": 2,
    "preference": 2,
    "train-int8": 2,
    "generate": 4,
    "evaluate": 2,
    "serve": 16,
    "parallel": 1,
    "memory": 2,
    "memory-fit": 3,
}


# Sections whose quick run is too slow for the default suite (marked slow): the report's test
# renders their results as BENCHMARKS.md's last full run recorded them in benchmarks.json.
SLOW_SECTIONS = {"serve": "a dozen server processes started and stopped: about 35 s"}


def _sections() -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_SECTIONS else n for n in SECTIONS]


def _recorded(name: str) -> dict:
    """A section's results as the repository's benchmarks/benchmarks.json holds them."""
    recorded = json.loads((cli.DEFAULT_OUTPUT / "benchmarks.json").read_text())
    return recorded["sections"][name]["results"]


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Each section run once in quick mode into its own BENCHMARKS.md: (results, its text)."""
    done = {}

    def run_once(name: str):
        if name not in done:
            path = tmp_path_factory.mktemp(name) / "BENCHMARKS.md"
            results = run.run_section(name, SECTIONS, quick=True, path=path)
            done[name] = (results, path.read_text())
        return done[name]

    return run_once


def _has_line(lines: list[str], expected: str) -> bool:
    if expected.startswith("^"):
        return any(re.search(expected, line) for line in lines)
    return expected in lines


def _goal_list(lines: list[str]) -> list[str]:
    goals = lines[lines.index("Goals:") + 2 :]
    return goals[: goals.index("")] if "" in goals else goals


@pytest.mark.parametrize("name", _sections())
def test_quick_section_writes_its_tables_and_goals(quick_run, name):
    results, text = quick_run(name)
    json.dumps(results)  # plain data
    lines = text.splitlines()
    assert lines[0] == "# Benchmarks"
    assert any(re.fullmatch(rf"## {name} \(\d{{4}}-\d\d-\d\d \d\d:\d\d\)", ln) for ln in lines)
    assert f"Command: `python scripts/bench.py {name} --quick`" in lines
    assert any(ln.startswith("Verified first") for ln in lines)
    goals = _goal_list(lines)
    assert len(goals) == GOAL_COUNTS[name], goals
    assert all(re.search(GOAL, ln) for ln in goals), goals
    missing = [e for e in EXPECTED[name] if not _has_line(lines, e)]
    assert not missing, f"{name}: no line matches {missing}"


@pytest.mark.parametrize("name", _sections())
def test_render_needs_only_the_measured_data_and_returns_its_goals(quick_run, name):
    results, text = quick_run(name)
    rendered = SECTIONS[name].render(json.loads(json.dumps(results)))
    assert "\n".join(rendered.lines) in text
    # the goals it returns (for the summary) are the ones it lists, judged the same
    assert [
        f"- {g.name}: {g.value:.2f} (goal {g.bound_text}): {g.verdict}" for g in rendered.goals
    ] == _goal_list(rendered.lines)
    assert all(isinstance(g, Goal) for g in rendered.goals)


def test_goals_are_judged_by_their_bound():
    assert Goal("more", 2, 1, True).met and not Goal("more", 0.5, 1, True).met
    assert Goal("less", 0.5, 1, False).met and not Goal("less", 2, 1, False).met
    assert Goal("at the bound", 1, 1, True).met and Goal("at the bound", 1, 1, False).met
    lines, goals = with_goals(["before"], [Goal("x", 3, 2.5, False)], after=["after"])
    assert lines == ["before", "", "Goals:", "", "- x: 3.00 (goal <= 2.5): MISSED", "after"]
    assert goals == [Goal("x", 3.0, 2.5, False)] and isinstance(goals[0].value, float)


def test_wkv7_renders_step_loops_that_do_not_fit(quick_run):
    results, _ = quick_run("wkv7")
    r = json.loads(json.dumps(results))
    T, H = r["base"]
    rows = {(row["T"], row["H"]): row for row in r["rows"]}
    fitted = rows[(2 * T, H)]["runs"]
    # as in the full run: the longest and the widest step loops are not run
    for shape in ((4 * T, H), max(rows, key=lambda s: s[1])):
        rows[shape]["runs"]["lm_fb"] = rows[shape]["runs"]["ref_fb"] = None
    lines = wkv7.render(r).lines
    estimate = fitted["ref_fb"]["peak"] * 4 / 1e9  # twice the head-steps: four times the memory
    row = next(ln for ln in lines if ln.startswith(f"| {4 * T} | {H} | ") and "ms" in ln)
    assert f"does not fit ({estimate:.0f} GB)" in row and row.endswith("| n/a | n/a |")
    assert any(
        f"(T={4 * T}: the step loop does not fit; its share only grows with T)" in ln
        for ln in lines
    )


def test_moba_renders_dense_runs_that_do_not_fit(quick_run):
    results, _ = quick_run("moba")
    r = json.loads(json.dumps(results))
    longest = r["rows"][-1]
    longest["runs"]["dense_fwd"] = longest["runs"]["dense_fb"] = None
    lines = moba_section.render(r).lines
    row = next(ln for ln in lines if ln.startswith(f"| {longest['T']} | ") and " s |" in ln)
    assert row.count("does not fit") == 3 and row.count("n/a") == 3
    assert any(ln.startswith(f"- fwd+bwd T={r['rows'][-2]['T']} vs dense: ") for ln in lines)


def _package_modules() -> list:
    return [m for n, m in sys.modules.items() if n == "benchmarks" or n.startswith("benchmarks.")]


@pytest.mark.parametrize("name", _sections())
def test_verification_fails_before_anything_is_timed(monkeypatch, name):
    def timed(*args, **kwargs):
        raise AssertionError("timed before the verification")

    for module in _package_modules():  # wherever a section module took the names from
        if hasattr(module, "rel_err"):
            monkeypatch.setattr(module, "rel_err", lambda x, ref: 1.0)
        for timer in (
            "best_time",
            "matmul_gflops",
            "read_bandwidth_gbs",
            "time_and_peak",
            "time_steps",
        ):
            if hasattr(module, timer):
                monkeypatch.setattr(module, timer, timed)
    with pytest.raises(common.VerificationFailed):
        SECTIONS[name].measure(quick=True)


QUICK_FOLDER = r"^--quick: writing into a new temporary folder, (\S+)$"


def test_cli_turns_a_failed_verification_into_one_line(monkeypatch, capsys):
    from benchmarks import blas

    monkeypatch.setattr(blas, "rel_err", lambda x, ref: 1.0)
    with pytest.raises(SystemExit, match=r"^verify failed: MLX fp32 matmul error 1.00e\+00"):
        cli.main(["blas", "--quick"])
    # the temporary folder of a --quick run is not left behind empty
    assert not Path(re.search(QUICK_FOLDER, capsys.readouterr().out, re.M)[1]).exists()


def test_a_worker_is_an_entry_point_of_its_section():
    """``python -m benchmarks.blas --worker SIZE``: one JSON line; without --worker, a usage
    error (a section module is not run by itself)."""
    env = dict(os.environ, PYTHONPATH=str(PACKAGE.parent))
    cmd = [sys.executable, "-m", "benchmarks.blas"]
    out = subprocess.run([*cmd, "--worker", "32"], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"blas", "core", "core_note", "gflops"} and list(result["gflops"]) == [
        "32"
    ]
    refused = subprocess.run([*cmd, "32"], env=env, capture_output=True, text=True)
    assert refused.returncode == 2 and "--worker" in refused.stderr.splitlines()[-1]


def _is_module(parts: list[str]) -> bool:
    base = ROOT.joinpath(*parts)
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def test_benchmarks_import_only_the_public_api():
    """No module of the package imports a private name (a part starting with ``_`` that is not
    a module) of mlx_rwkvx; and none is longer than about 300 lines."""
    found = set()
    for path in sorted(PACKAGE.glob("*.py")):
        source = path.read_text()
        assert len(source.splitlines()) <= 300, f"{path.name} is over 300 lines"
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for full in names:
                parts = full.split(".")
                # a module whose file name starts with "_" (_mlx_lm, the one door to mlx-lm) is
                # a module, not a private name: test_package_boundaries.py's rule
                private = next(
                    (
                        i
                        for i, p in enumerate(parts)
                        if i and p.startswith("_") and not _is_module(parts[: i + 1])
                    ),
                    None,
                )
                if parts[0] == "mlx_rwkvx" and private is not None:
                    found.add(".".join(parts[: private + 1]))
    assert not found, found


@dataclass
class FakeSections:
    """Stand-ins for the sections: two with goals (one met, one missed each time) and one
    without; each measure records its call. ``main`` runs the command line on them."""

    calls: list
    sections: dict

    def main(self, argv: list[str]) -> None:
        cli.main(argv, sections=self.sections)


def _fake_sections(calls: list) -> dict:
    def measure(name: str, value: float):
        def run_it(quick: bool = False) -> dict:
            calls.append(name)
            return {"value": value, "quick": quick}

        return run_it

    def render(r: dict) -> Rendered:
        goals = [Goal("value", r["value"], 1, True), Goal("value | again", r["value"], 0.1, False)]
        return with_goals([f"Verified first: value {r['value']}."], goals)

    def render_plain(r: dict) -> Rendered:
        return Rendered([f"value {r['value']}, no goals"], [])

    return {
        "alpha": Section(measure("alpha", 2.0), render, "the first stand-in"),
        "beta": Section(measure("beta", 0.5), render, "the second"),
        "gamma": Section(measure("gamma", 3.0), render_plain, "one without goals"),
    }


def _summary_rows(text: str) -> list[list[str]]:
    lines = text.splitlines()
    start = lines.index("| section | goal | value | bound | |") + 2
    rows = lines[start : lines.index("", start)]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows]


def _section_text(text: str, name: str) -> str:
    body = text.split(f"\n## {name}\n", 1)[1]
    return body.split("\n## ", 1)[0]


@pytest.fixture
def fake() -> FakeSections:
    calls = []
    return FakeSections(calls, _fake_sections(calls))


def test_all_rewrites_the_report_with_a_summary_of_every_goal(fake, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "BENCHMARKS.md").write_text("# an old report\n")
    fake.main(["all", "--output", str(out)])
    assert fake.calls == ["alpha", "beta", "gamma"]
    text = (out / "BENCHMARKS.md").read_text()
    lines = text.splitlines()
    assert lines[0] == "# Benchmarks" and report.QUICK_WARNING not in text
    assert f"- Command: `python scripts/bench.py all --output {out}`" in lines
    for field in ("Date", "Machine", "MLX", "MLX's BLAS", "NumPy", "Python"):
        assert any(ln.startswith(f"- {field}: ") for ln in lines), field
    # the summary comes before the sections and holds every goal, judged as in its section
    assert text.index("## Summary") < text.index("## Contents") < text.index("## alpha")
    assert "1 of 4 goals met." in lines
    assert _summary_rows(text) == [
        ["[alpha](#alpha)", "value", "2.00", ">= 1", "met"],
        ["[alpha](#alpha)", "value \\| again", "2.00", "<= 0.1", "MISSED"],
        ["[beta](#beta)", "value", "0.50", ">= 1", "MISSED"],
        ["[beta](#beta)", "value \\| again", "0.50", "<= 0.1", "MISSED"],
    ]
    for name in ("alpha", "beta", "gamma"):
        assert any(ln.startswith(f"- [{name}](#{name}): ") for ln in lines)
        section = _section_text(text, name)
        assert f"Command: `python scripts/bench.py {name}`" in section
        assert "Measured in this run (" in section
    assert "- value: 2.00 (goal >= 1): met" in _section_text(text, "alpha")
    assert "value 3.0, no goals" in _section_text(text, "gamma")
    # the JSON holds the measurements; render writes the same markdown from it alone
    saved = json.loads((out / "benchmarks.json").read_text())
    assert saved["sections"]["alpha"]["results"] == {"value": 2.0, "quick": False}
    (out / "BENCHMARKS.md").unlink()
    fake.main(["render", "--output", str(out)])
    assert (out / "BENCHMARKS.md").read_text() == text
    assert fake.calls == ["alpha", "beta", "gamma"]  # nothing measured again
    assert sorted(p.name for p in out.iterdir()) == ["BENCHMARKS.md", "benchmarks.json"]


def test_all_skip_carries_a_section_over(fake, tmp_path, monkeypatch):
    out = tmp_path / "out"
    fake.main(["all", "--skip", "beta", "--output", str(out)])  # nothing to carry over yet
    first = (out / "BENCHMARKS.md").read_text()
    assert "- [beta](#beta): the second; not run (skipped; no earlier benchmarks.json)" in first
    assert "Not run (skipped; no earlier benchmarks.json)." in _section_text(first, "beta")
    fake.main(["all", "--output", str(out)])
    measured = json.loads((out / "benchmarks.json").read_text())
    fake.calls.clear()
    monkeypatch.setattr(run, "now", lambda: "2100-01-01 00:00")
    fake.main(["all", "--skip", "beta,gamma", "--output", str(out)])
    assert fake.calls == ["alpha"]
    text = (out / "BENCHMARKS.md").read_text()
    written = json.loads((out / "benchmarks.json").read_text())
    assert written["date"] == "2100-01-01 00:00"
    carried = written["sections"]["beta"]
    assert carried["carried_over"] and carried["results"] == {"value": 0.5, "quick": False}
    assert carried["date"] == measured["date"] != written["date"]
    section = _section_text(text, "beta")
    assert f"Carried over from the run of {measured['date']} (`python scripts/bench.py all " in (
        section
    )
    assert "- value: 0.50 (goal >= 1): MISSED" in section
    assert ["[beta](#beta) (carried over)", "value", "0.50", ">= 1", "MISSED"] in (
        _summary_rows(text)
    )
    # carried over again: still the run it was measured in; a --quick run does not take it
    fake.main(["all", "--skip", "beta", "--output", str(out)])
    again = json.loads((out / "benchmarks.json").read_text())["sections"]["beta"]
    assert again["date"] == measured["date"]
    fake.main(["all", "--quick", "--skip", "beta", "--output", str(out)])
    quick = (out / "BENCHMARKS.md").read_text()
    assert report.QUICK_WARNING in quick.splitlines()[:4]
    assert "Not run (skipped; the earlier measurement was a full run's)." in (
        _section_text(quick, "beta")
    )
    assert "Command: `python scripts/bench.py alpha --quick`" in _section_text(quick, "alpha")


@pytest.mark.parametrize(
    "failure, code",
    [
        (
            common.VerificationFailed("gamma vs its reference 1.0e+00"),
            "verify failed: gamma vs its reference 1.0e+00",
        ),
        (KeyboardInterrupt(), 130),
    ],
)
def test_all_failure_leaves_the_old_report_and_keeps_the_measured(
    fake, tmp_path, monkeypatch, capsys, failure, code
):
    out = tmp_path / "out"
    monkeypatch.setattr(run, "now", lambda: "2000-01-01 00:00")
    fake.main(["all", "--output", str(out)])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    gamma = fake.sections["gamma"]

    def fails(quick=False):
        raise failure

    fake.sections["gamma"] = gamma._replace(measure=fails)
    monkeypatch.setattr(run, "now", lambda: "2000-01-02 00:00")
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        fake.main(["all", "--output", str(out)])
    assert e.value.code == code
    assert "`all --skip alpha,beta` carries them over" in capsys.readouterr().err
    # the report as it was, and beside it what this run measured before it failed
    partial = out / "benchmarks.partial.json"
    assert {p.name: p.read_bytes() for p in out.iterdir() if p != partial} == before
    kept = json.loads(partial.read_text())["sections"]
    assert list(kept) == ["alpha", "beta"] and kept["beta"]["date"] == "2000-01-02 00:00"
    # carried over from the newer partial report, which goes once the report is written
    fake.sections["gamma"] = gamma
    fake.calls.clear()
    fake.main(["all", "--skip", "alpha,beta", "--output", str(out)])
    assert fake.calls == ["gamma"] and not partial.exists()
    written = json.loads((out / "benchmarks.json").read_text())["sections"]
    assert written["alpha"]["date"] == "2000-01-02 00:00" and written["alpha"]["carried_over"]


def test_a_section_run_alone_is_appended(fake, tmp_path):
    out = tmp_path / "out"
    fake.main(["all", "--output", str(out)])
    whole = (out / "BENCHMARKS.md").read_text()
    fake.main(["gamma", "--output", str(out)])
    text = (out / "BENCHMARKS.md").read_text()
    assert text.startswith(whole) and "Command: `python scripts/bench.py gamma`" in text
    assert whole.endswith("\n\n")
    assert re.match(r"## gamma \(\d{4}-\d\d-\d\d \d\d:\d\d\)\n", text[len(whole) :])


@pytest.mark.parametrize("argv", [["all", "--quick"], ["gamma", "--quick"]])
def test_quick_writes_outside_the_repository(fake, capsys, argv):
    in_repository = cli.DEFAULT_OUTPUT / "BENCHMARKS.md"
    before = in_repository.read_bytes() if in_repository.exists() else None
    fake.main(argv)
    assert (in_repository.read_bytes() if in_repository.exists() else None) == before
    wrote = Path(re.search(QUICK_FOLDER, capsys.readouterr().out, re.M)[1])
    try:
        text = (wrote / "BENCHMARKS.md").read_text()
        assert not wrote.is_relative_to(cli.ROOT)
        if argv[0] == "all":
            assert text.splitlines()[2] == report.QUICK_WARNING
        else:
            assert "Command: `python scripts/bench.py gamma --quick`" in text
    finally:
        for p in wrote.iterdir():
            p.unlink()
        wrote.rmdir()


def test_recorded_results_live_beside_the_benchmarks_code(fake, monkeypatch):
    """The recorded report, its data and its plot are in benchmarks/, where a run without
    --output writes them; none of them is at the repository's root."""
    for name in (report.REPORT_NAME, report.JSON_NAME, report.PLOT_NAME):
        assert (PACKAGE / name).is_file() and not (ROOT / name).exists(), name
    written = []
    monkeypatch.setattr(cli, "write_report", lambda *args, **kw: written.append(args[2]))
    monkeypatch.setattr(cli, "run_section", lambda *args, path, **kw: written.append(path))
    fake.main(["render"])
    fake.main(["gamma"])
    assert written == [PACKAGE, PACKAGE / report.REPORT_NAME]


def _entry(results, **fields) -> dict:
    """A measured section of a benchmarks.json."""
    return {
        "date": "2000-01-01 00:00",
        "command": "python scripts/bench.py all",
        "quick": False,
        "machine": "a machine",
        "seconds": 1.0,
        "results": results,
        **fields,
    }


def _report_json(sections: dict) -> str:
    env = {key: "n/a" for key in report.ENVIRONMENT_FIELDS}
    written = {
        "format": report.REPORT_FORMAT,
        "date": "2000-01-01 00:00",
        "quick": False,
        "command": "python scripts/bench.py all",
        "environment": env,
        "sections": sections,
    }
    return json.dumps(written)


NOT_IN_REPO = cli.ROOT / "bench-quick-output"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["all", "alpha"], "all takes no other section"),
        (["alpha", "--skip", "beta"], "--skip goes with all"),
        (["all", "--skip", "alpha,delta"], "no section delta"),
        (["render", "--quick"], "render takes no --quick"),
        (["all", "--quick", "--output", str(cli.ROOT)], "does not write into the repository"),
        (["all", "--quick", "--output", str(NOT_IN_REPO)], "does not write into the repository"),
        (["gamma", "--quick", "--output", str(NOT_IN_REPO)], "does not write into the repository"),
        (["render", "--output", "{tmp}"], "benchmarks.json: cannot be read"),
        (["render", "--output", "{tmp}/bad"], "benchmarks.json: not JSON"),
        (["all", "--skip", "alpha", "--output", "{tmp}/other"], "not a benchmarks.json of"),
        (["render", "--output", "{tmp}/no-env"], "its environment has no machine, mlx"),
        (
            ["render", "--output", "{tmp}/no-seconds"],
            "section alpha has results but no valid seconds (expected date, command",
        ),
        (["all", "--skip", "beta", "--output", "{tmp}/not-a-section"], "section beta is not an"),
        (["render", "--output", "{tmp}/old"], "section alpha does not render (KeyError('value'))"),
        (["all", "--output", "{tmp}/file"], "file: cannot hold the report (File exists)"),
        (["gamma", "--output", "{tmp}/file/sub"], "cannot hold the report (Not a directory)"),
    ],
)
def test_cli_refuses_in_one_line(fake, tmp_path, capsys, argv, message):
    (tmp_path / "file").write_text("")
    contents = {
        "bad": "{",
        "other": '{"format": 1}',
        "no-env": json.dumps({**json.loads(_report_json({})), "environment": {}}),
        "no-seconds": _report_json({"alpha": {**_entry({"value": 1}), "seconds": None}}),
        "not-a-section": _report_json({"beta": [1]}),
        "old": _report_json({"alpha": _entry({"old": 1})}),  # measured by another version
    }
    for name, text in contents.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "benchmarks.json").write_text(text)
    with pytest.raises(SystemExit) as e:
        fake.main([a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err.splitlines()[-1] and "Traceback" not in err
    assert fake.calls == [] and not NOT_IN_REPO.exists()
    assert sorted(p.name for p in (tmp_path / "old").iterdir()) == ["benchmarks.json"]


def test_cli_refuses_an_unwritable_folder_before_measuring(fake, tmp_path, monkeypatch, capsys):
    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", refused)  # root may write anywhere
    with pytest.raises(SystemExit) as e:
        fake.main(["all", "--output", str(tmp_path)])
    assert e.value.code == 2 and fake.calls == []
    assert "cannot hold the report (Permission denied)" in capsys.readouterr().err


def test_a_section_makes_its_missing_output_folder(fake, tmp_path):
    out = tmp_path / "new" / "deeper"
    fake.main(["gamma", "--output", str(out)])
    assert "Command: `python scripts/bench.py gamma`" in (out / "BENCHMARKS.md").read_text()


def test_summary_has_a_row_for_each_section_not_run(fake, tmp_path):
    fake.main(["all", "--skip", "alpha,beta,gamma", "--output", str(tmp_path)])
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert "0 of 0 goals met; 3 sections not run." in text.splitlines()
    assert _summary_rows(text) == [
        [f"[{name}](#{name})", "not run (skipped; no earlier benchmarks.json)", "", "", ""]
        for name in ("alpha", "beta", "gamma")
    ]
    fake.main(["all", "--skip", "gamma", "--output", str(tmp_path)])
    assert "1 of 4 goals met; 1 section not run." in (tmp_path / "BENCHMARKS.md").read_text()


def test_failed_renames_leave_no_temporary_files(fake, tmp_path, monkeypatch, capsys):
    fake.main(["all", "--output", str(tmp_path)])
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def refused(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", refused)
    with pytest.raises(SystemExit) as e:
        fake.main(["all", "--output", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "benchmarks.partial.json: cannot be written (No space left on device); measuring" in err
    assert err.endswith(
        f"error: {tmp_path}: the report cannot be written (No space left on device)\n"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    # a section run alone: its BENCHMARKS.md as it was
    with pytest.raises(SystemExit) as e:
        fake.main(["gamma", "--output", str(tmp_path)])
    assert e.value.code == 2
    assert capsys.readouterr().err.endswith(
        f"error: {tmp_path / 'BENCHMARKS.md'}: cannot be written (No space left on device)\n"
    )
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.fixture
def fake_pyplot(monkeypatch) -> list:
    """A stand-in for matplotlib whose figures save a few bytes, so that the plot is drawn where
    matplotlib is not installed; the axes it hands out, for the test to look at."""
    plt, axes = mock.MagicMock(), []

    def subplots(rows, columns, **kwargs):
        fig = mock.MagicMock()
        fig.savefig.side_effect = lambda f, **kwargs: f.write(b"png")
        axes.extend(mock.MagicMock() for _ in range(columns))
        return fig, [axes[-columns:]]

    plt.subplots.side_effect = subplots
    monkeypatch.setitem(sys.modules, "matplotlib", mock.MagicMock(pyplot=plt))
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", plt)
    return axes


MOBA = {"H": 2, "D": 32, "rows": [{"T": 64, "runs": {"moba_fwd": {"time": 0.1}, "dense_fb": None}}]}


def test_all_leaves_out_carried_over_data_that_no_longer_fits(fake, tmp_path, capsys, fake_pyplot):
    """A section measured by an older version and carried over: its plot panel and its section
    are left out, each with one line, and the rest of the report is written."""
    render = fake.sections["gamma"].render
    fake.sections["wkv7"] = Section(None, render, "plotted, stale")
    stand_in = Section(
        lambda quick=False: MOBA, lambda r: Rendered(["moba stand-in"], []), "plotted"
    )
    fake.sections["moba"] = stand_in
    stale = _entry({"rows": [{"T": 64}]})  # no base, no value: an older layout
    (tmp_path / "benchmarks.json").write_text(_report_json({"wkv7": stale}))
    fake.main(["all", "--skip", "wkv7", "--output", str(tmp_path)])
    left_out = "the wkv7 panel is left out, its data does not fit (KeyError('base'))"
    assert f"benchmarks.png: {left_out}" in capsys.readouterr().out.splitlines()
    text = (tmp_path / "BENCHMARKS.md").read_text()
    why = "carried over, but its data no longer renders (KeyError('value'))"
    assert ["[wkv7](#wkv7)", f"not run ({why})", "", "", ""] in _summary_rows(text)
    assert "1 of 4 goals met; 1 section not run." in text.splitlines()
    assert "moba stand-in" in _section_text(text, "moba")
    assert (tmp_path / "benchmarks.png").read_bytes() == b"png" and "![" in text
    (ax,) = fake_pyplot  # moba's panel alone, with its one run
    assert [c.kwargs["label"] for c in ax.plot.call_args_list] == ["MoBA fwd"]


def test_a_report_without_a_plot_removes_the_old_one(fake, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as where it is not installed
    (tmp_path / "benchmarks.png").write_bytes(b"an older run's")
    fake.main(["all", "--output", str(tmp_path)])
    assert not (tmp_path / "benchmarks.png").exists()
    assert "![" not in (tmp_path / "BENCHMARKS.md").read_text()


def _matplotlib() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def test_all_report_of_the_real_sections(quick_run, tmp_path):
    """Every section's quick measurements (as the tests above ran them) through ``all``: the
    summary has each section's goals, each section its own rendering, the plot its panels."""
    results = {
        name: _recorded(name) if name in SLOW_SECTIONS else quick_run(name)[0] for name in SECTIONS
    }
    stand_ins = {
        name: s._replace(
            measure=lambda quick=False, name=name: json.loads(json.dumps(results[name]))
        )
        for name, s in SECTIONS.items()
    }
    cli.main(["all", "--quick", "--output", str(tmp_path)], sections=stand_ins)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    rows = _summary_rows(text)
    for name in SECTIONS:
        assert sum(row[0] == f"[{name}](#{name})" for row in rows) == GOAL_COUNTS[name], name
        lines = SECTIONS[name].render(json.loads(json.dumps(results[name]))).lines
        assert "\n".join(lines) in _section_text(text, name)
    assert all(re.fullmatch(r"-?[\d.]+|nan|inf", r[2]) and r[4] in ("met", "MISSED") for r in rows)
    assert (tmp_path / "benchmarks.png").exists() == _matplotlib()
    assert ("![" in text) == _matplotlib()
    (tmp_path / "BENCHMARKS.md").unlink()
    cli.main(["render", "--output", str(tmp_path)])  # the real sections' renderers
    assert (tmp_path / "BENCHMARKS.md").read_text() == text


def test_plot_panels_read_the_real_sections(quick_run):
    sections = {name: {"results": quick_run(name)[0]} for name in ("wkv7", "moba", "train")}
    drawers = plot.plot_panels(json.loads(json.dumps({"sections": sections})))
    assert len(drawers) == len(plot.PLOT_PANELS)
    for draw in drawers:
        ax = mock.MagicMock()
        draw(ax)
        assert ax.set.call_args.kwargs["title"]


@pytest.mark.slow
def test_all_quick_end_to_end(tmp_path):
    repo_report = cli.DEFAULT_OUTPUT / "BENCHMARKS.md"
    before = repo_report.read_bytes() if repo_report.exists() else None
    cmd = [sys.executable, str(BENCH_PATH), "all", "--quick", "--output", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800)
    text = (tmp_path / "BENCHMARKS.md").read_text()
    assert report.QUICK_WARNING in text
    assert {row[0].split("]")[0][1:] for row in _summary_rows(text)} == set(GOAL_COUNTS)
    for name in SECTIONS:
        assert f"Command: `python scripts/bench.py {name} --quick`" in _section_text(text, name)
    assert (tmp_path / "benchmarks.png").exists() == _matplotlib()
    assert (repo_report.read_bytes() if repo_report.exists() else None) == before


def test_the_readme_which_mac_table_is_the_recorded_run():
    """README.md's "which Mac" table is the memory-fit section's last full run, as written by
    ``write_report`` (never typed by hand)."""
    from benchmarks import readme_table

    recorded = json.loads((cli.DEFAULT_OUTPUT / "benchmarks.json").read_text())
    readme = (ROOT / "README.md").read_text()
    record = recorded["sections"].get("memory-fit")
    if record is None:  # not measured yet: the table is empty
        assert f"{readme_table.README_BEGIN}\n{readme_table.README_END}" in readme
        return
    assert not record["quick"]
    assert "\n".join(readme_table.readme_lines(record)) in readme


def test_a_full_report_rewrites_the_readme_table_and_a_quick_one_does_not(tmp_path, monkeypatch):
    from benchmarks import readme_table

    readme = tmp_path / "README.md"
    readme.write_text(
        f"intro\n{readme_table.README_BEGIN}\nSTALE\n{readme_table.README_END}\nafter\n"
    )
    monkeypatch.setattr(readme_table, "PACKAGE_ROOT", tmp_path)
    row = {"model": "m", "base": "int4", "mode": "lora", "T": 8, "goal": 1.0}
    part = {"peak": 1e9, "estimate": 1.1e9, "weights": 5e8}
    results = {"rows": [{"row": row, "whole": {"checkpoint": part, "default": part}}]}
    record = {"date": "2026-12-07 06:00", "command": "c", "machine": "x", "results": results}
    readme_table.write_readme_table({"sections": {"memory-fit": dict(record, quick=True)}})
    assert "STALE" in readme.read_text()
    readme_table.write_readme_table({"sections": {"memory-fit": dict(record, quick=False)}})
    text = readme.read_text()
    assert text.startswith("intro\n") and text.endswith("\nafter\n") and "STALE" not in text
    assert (
        "| m | `--quantize int4 --max-seq-len 8` | 1.00 | <= 1.0 | 1.00 | 1.10 | 0.50 | 8 GB |"
        in text
    )
