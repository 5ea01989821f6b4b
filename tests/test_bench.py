"""scripts/bench.py: every section measures and renders in ``--quick`` mode, its verification
comes before any timing, and the rendered markdown has its tables and goal lines.

The quick sizes say nothing about speed: only the shape of what is written is checked.
"""

import importlib.util
import json
import re
from pathlib import Path

import pytest

BENCH_PATH = Path(__file__).resolve().parent.parent / "scripts" / "bench.py"
_spec = importlib.util.spec_from_file_location("bench", BENCH_PATH)
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

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
    "loss": [
        r"^Verified first: fused vs dense loss [\d.e+-]+, dh [\d.e+-]+, dW [\d.e+-]+\.$",
        r"^\| fused \| [\d.]+ s \| \d+ MiB \|$",
        r"^- loss\+backward peak memory, dense / fused: [\d.]+ \(goal >= 8\)",
    ],
}
GOAL_COUNTS = {"blas": 2, "wkv7": 5, "moba": 4, "models": 5, "loss": 1, "train": 2, "train-int8": 2,
               "generate": 4, "parallel": 1}  # fmt: skip


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """Each section run once in quick mode into its own BENCHMARKS.md: (results, its text)."""
    done = {}

    def run(name: str):
        if name not in done:
            path = tmp_path_factory.mktemp(name) / "BENCHMARKS.md"
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(bench, "RESULTS", path)
                results = bench.run_section(name, quick=True)
            done[name] = (results, path.read_text())
        return done[name]

    return run


def _has_line(lines: list[str], expected: str) -> bool:
    if expected.startswith("^"):
        return any(re.search(expected, line) for line in lines)
    return expected in lines


@pytest.mark.parametrize("name", list(bench.SECTIONS))
def test_quick_section_writes_its_tables_and_goals(quick_run, name):
    results, text = quick_run(name)
    json.dumps(results)  # plain data
    lines = text.splitlines()
    assert lines[0] == "# Benchmarks"
    assert any(re.fullmatch(rf"## {name} \(\d{{4}}-\d\d-\d\d \d\d:\d\d\)", ln) for ln in lines)
    assert f"Command: `python scripts/bench.py {name} --quick`" in lines
    assert any(ln.startswith("Verified first") for ln in lines)
    goals = lines[lines.index("Goals:") + 2 :]
    goals = goals[: goals.index("")] if "" in goals else goals
    assert len(goals) == GOAL_COUNTS[name], goals
    assert all(re.search(GOAL, ln) for ln in goals), goals
    missing = [e for e in EXPECTED[name] if not _has_line(lines, e)]
    assert not missing, f"{name}: no line matches {missing}"


@pytest.mark.parametrize("name", list(bench.SECTIONS))
def test_render_needs_only_the_measured_data(quick_run, name):
    results, text = quick_run(name)
    _, render, _ = bench.SECTIONS[name]
    lines = render(json.loads(json.dumps(results)))
    assert "\n".join(lines) in text


def test_wkv7_renders_step_loops_that_do_not_fit(quick_run):
    results, _ = quick_run("wkv7")
    r = json.loads(json.dumps(results))
    T, H = r["base"]
    rows = {(row["T"], row["H"]): row for row in r["rows"]}
    fitted = rows[(2 * T, H)]["runs"]
    # as in the full run: the longest and the widest step loops are not run
    for shape in ((4 * T, H), max(rows, key=lambda s: s[1])):
        rows[shape]["runs"]["lm_fb"] = rows[shape]["runs"]["ref_fb"] = None
    lines = bench.render_wkv7(r)
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
    lines = bench.render_moba(r)
    row = next(ln for ln in lines if ln.startswith(f"| {longest['T']} | ") and " s |" in ln)
    assert row.count("does not fit") == 3 and row.count("n/a") == 3
    assert any(ln.startswith(f"- fwd+bwd T={r['rows'][-2]['T']} vs dense: ") for ln in lines)


@pytest.mark.parametrize("name", list(bench.SECTIONS))
def test_verification_fails_before_anything_is_timed(monkeypatch, name):
    def timed(*args, **kwargs):
        raise AssertionError("timed before the verification")

    monkeypatch.setattr(bench, "rel_err", lambda x, ref: 1.0)
    for timer in ("best_time", "matmul_gflops", "read_bandwidth_gbs", "_measure"):
        monkeypatch.setattr(bench, timer, timed)
    measure, _, _ = bench.SECTIONS[name]
    with pytest.raises(bench.VerificationFailed):
        measure(quick=True)


def test_cli_turns_a_failed_verification_into_one_line(monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "rel_err", lambda x, ref: 1.0)
    monkeypatch.setattr(bench, "RESULTS", tmp_path / "BENCHMARKS.md")
    with pytest.raises(SystemExit, match=r"^verify failed: MLX fp32 matmul error 1.00e\+00"):
        bench.main(["blas", "--quick"])
    assert not (tmp_path / "BENCHMARKS.md").exists()
