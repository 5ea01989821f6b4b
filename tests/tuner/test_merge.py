"""Merging adapters (mlx_rwkvx/tuner/merge.py, python -m mlx_rwkvx.merge): each method against a
NumPy computation of its definition, the refusals (nothing written), weights by tokens, fusing
into a model (float logits = the adapter model's; INT8 re-quantized with its error reported),
and two adapters trained on halves that teach different facts merging into one that knows both.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx.adapters.files import adapter_config, read_adapter, save_adapter
from mlx_rwkvx.adapters.fingerprint import fingerprint
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.data.examples import load_examples
from mlx_rwkvx.io.targets import is_temp
from mlx_rwkvx.tuner import merge as merging
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.trainer import evaluate

import mlx.core as mx
import numpy as np
import pytest
from helpers import ROOT, adapter_base, make_adapter, run_module


def np_tensors(path) -> dict[str, np.ndarray]:
    _, tensors = read_adapter(path)
    return {n: np.array(x, dtype=np.float64) for n, x in tensors.items()}


def update(t: dict, module: str, scale: float) -> np.ndarray:
    return scale * t[f"{module}.lora_a"] @ t[f"{module}.lora_b"]


def run_cli(*args):
    return run_module("merge", *args)


@pytest.fixture()
def pair(tmp_path):
    a = make_adapter(tmp_path / "a.safetensors", noise=1, tokens=300)
    b = make_adapter(tmp_path / "b.safetensors", noise=2, tokens=100)
    return a, b


def test_fedavg_is_the_elementwise_average(pair, tmp_path):
    a, b = pair
    out = run_cli("--output", tmp_path / "m.safetensors", a, b, "--weights", "6,2")
    assert out.returncode == 0, out.stderr
    ta, tb, tm = np_tensors(a), np_tensors(b), np_tensors(tmp_path / "m.safetensors")
    assert sorted(tm) == sorted(ta)
    for name in ta:
        assert np.allclose(tm[name], 0.75 * ta[name] + 0.25 * tb[name], atol=1e-6), name
    config, _ = read_adapter(tmp_path / "m.safetensors")
    assert config["merge_method"] == "fedavg" and config["tokens_trained"] == 400
    assert [m["weight"] for m in config["merged_from"]] == [0.75, 0.25]


@pytest.mark.parametrize("method", ["delta", "concat"])
def test_exact_merges_average_the_updates(pair, tmp_path, method):
    a, b = pair
    ta, tb = np_tensors(a), np_tensors(b)
    args = ["--output", tmp_path / "m", a, b, "--method", method, "--weights", "auto"]
    if method == "delta":
        args += ["--rank", "8"]  # the sum of the ranks: no truncation
    out = run_cli(*args)
    assert out.returncode == 0, out.stderr
    tm = np_tensors(tmp_path / "m")
    config = json.loads((tmp_path / "m" / "adapter_config.json").read_text())
    scale = config["lora_parameters"]["scale"]
    assert config["lora_parameters"]["rank"] == 8
    for module in merging.read(a).modules():
        want = 0.75 * update(ta, module, 2.0) + 0.25 * update(tb, module, 2.0)
        got = update(tm, module, scale)
        assert np.linalg.norm(got - want) <= 1e-5 * np.linalg.norm(want), module
    if method == "delta":
        assert config["merge_relative_error"] < 1e-6


def test_delta_truncation_is_the_best_rank_r(pair, tmp_path):
    a, b = pair
    ta, tb = np_tensors(a), np_tensors(b)
    out = run_cli("--output", tmp_path / "m.safetensors", a, b, "--method", "delta", "--rank", 3)
    assert out.returncode == 0, out.stderr
    tm = np_tensors(tmp_path / "m.safetensors")
    config, _ = read_adapter(tmp_path / "m.safetensors")
    lost = total = 0.0
    for module in merging.read(a).modules():
        want = 0.5 * update(ta, module, 2.0) + 0.5 * update(tb, module, 2.0)
        U, S, Vt = np.linalg.svd(want)
        best = (U[:, :3] * S[:3]) @ Vt[:3]
        got = update(tm, module, config["lora_parameters"]["scale"])
        assert np.linalg.norm(got - best) <= 1e-5 * np.linalg.norm(want), module
        lost, total = lost + np.sum(S[3:] ** 2), total + np.sum(S**2)
    assert abs(config["merge_relative_error"] - (lost / total) ** 0.5) < 1e-6
    assert f"{config['merge_relative_error']:.2%}" in out.stdout


def test_concat_and_delta_take_different_ranks(tmp_path):
    a = make_adapter(tmp_path / "a.safetensors", rank=2, alpha=4.0, noise=3)
    b = make_adapter(tmp_path / "b.safetensors", rank=4, alpha=16.0, noise=4)  # scale 4
    ta, tb = np_tensors(a), np_tensors(b)
    out = run_cli("--output", tmp_path / "m.safetensors", a, b, "--method", "concat")
    assert out.returncode == 0, out.stderr
    tm = np_tensors(tmp_path / "m.safetensors")
    config, _ = read_adapter(tmp_path / "m.safetensors")
    module = merging.read(a).modules()[0]
    want = 0.5 * update(ta, module, 2.0) + 0.5 * update(tb, module, 4.0)
    got = update(tm, module, config["lora_parameters"]["scale"])
    assert np.allclose(got, want, atol=1e-6) and config["lora_parameters"]["rank"] == 6
    out = run_cli("--output", tmp_path / "f.safetensors", a, b)  # fedavg: ranks must agree
    assert out.returncode == 2 and "ranks or shapes differ" in out.stderr


def test_state_tuning_adapters_average(tmp_path):
    a = make_adapter(tmp_path / "a.safetensors", kind="state", noise=5)
    b = make_adapter(tmp_path / "b.safetensors", kind="state", noise=6)
    for method in merging.METHODS:
        out = run_cli("--output", tmp_path / f"{method}.safetensors", a, b, "--method", method)
        assert out.returncode == 0, out.stderr
        ta, tb = np_tensors(a), np_tensors(b)
        tm = np_tensors(tmp_path / f"{method}.safetensors")
        assert all(np.allclose(tm[n], (ta[n] + tb[n]) / 2, atol=1e-7) for n in ta)


@pytest.mark.parametrize(
    "case, message",
    [
        ("other_base", "trained on another base model"),
        ("other_seed", "different init seeds"),
        ("other_targets", "adapt other layers"),
        ("dora_delta", "DoRA adapters merge by fedavg only"),
        ("one", "at least two adapters"),
        ("weights", "2 weights for 3 adapters"),
        ("bad_weights", "give numbers like 6,2"),
        ("missing", "no such adapter file"),
        ("no_tokens", "does not say how many tokens"),
        ("quantize", "--quantize goes with --fuse-into"),
        ("nan", "holds NaN or infinite values"),
    ],
)
def test_refusals_write_nothing(tmp_path, pair, case, message):
    a, b = pair
    args = [a, b]
    if case == "other_base":
        args = [a, make_adapter(tmp_path / "c.safetensors", base_seed=1)]
    elif case == "other_seed":
        args = [a, make_adapter(tmp_path / "c.safetensors", seed=7)]
    elif case == "other_targets":
        model = adapter_base()
        paths = target_paths(model, "attn")[:3]
        apply_lora(model, paths, rank=4, alpha=8.0)
        c = tmp_path / "c.safetensors"
        config = adapter_config(
            model,
            fine_tune_type="lora",
            paths=paths,
            rank=4,
            alpha=8.0,
            base_fingerprint=fingerprint(adapter_base()),
            seed=0,
        )
        save_adapter(c, model, config)
        args = [a, c]
    elif case == "dora_delta":
        args = [
            make_adapter(tmp_path / f"d{i}.safetensors", kind="dora", noise=i) for i in (1, 2)
        ] + ["--method", "delta"]
    elif case == "one":
        args = [a]
    elif case == "weights":
        args = [a, b, a, "--weights", "1,2"]
    elif case == "bad_weights":
        args = [a, b, "--weights", "six,two"]
    elif case == "missing":
        args = [a, tmp_path / "nope.safetensors"]
    elif case == "no_tokens":
        args = [a, make_adapter(tmp_path / "c.safetensors", tokens=0), "--weights", "auto"]
    elif case == "quantize":
        args = [a, b, "--quantize"]
    elif case == "nan":
        config, tensors = read_adapter(b)
        name = next(iter(tensors))
        tensors[name] = tensors[name] * float("nan")
        c = tmp_path / "c.safetensors"
        mx.save_safetensors(str(c), tensors, {"adapter_config": json.dumps(config)})
        args = [a, c]
    out = run_cli("--output", tmp_path / "out.safetensors", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert not (tmp_path / "out.safetensors").exists()
    assert not [p for p in tmp_path.iterdir() if is_temp(p.name)]


def test_existing_output_kept_unless_overwrite(pair, tmp_path):
    a, b = pair
    target = tmp_path / "m.safetensors"
    target.write_bytes(b"precious")
    out = run_cli("--output", target, a, b)
    assert out.returncode == 2 and "already exists" in out.stderr
    assert target.read_bytes() == b"precious"
    out = run_cli("--output", target, a, b, "--overwrite")  # replaces only an adapter
    assert out.returncode == 2 and "is not an adapter file" in out.stderr
    assert target.read_bytes() == b"precious"
    target.unlink()
    assert run_cli("--output", target, a, b, "--method", "concat").returncode == 0
    assert run_cli("--output", target, a, b, "--overwrite").returncode == 0
    assert read_adapter(target)[0]["merge_method"] == "fedavg"


def test_fuse_into_gives_the_adapter_models_logits(pair, tmp_path):
    a, b = pair
    mlx_rwkvx.save(adapter_base(), tmp_path / "base")
    merged = tmp_path / "merged.safetensors"
    assert run_cli("--output", merged, a, b, "--method", "concat").returncode == 0
    out = run_cli(
        "--output", tmp_path / "fused", a, b, "--method", "concat", "--fuse-into", tmp_path / "base"
    )
    assert out.returncode == 0, out.stderr
    tokens = mx.array([list(b"fused or not")])
    with_adapter, _ = mlx_rwkvx.load(tmp_path / "base", adapter=merged)
    fused, tok = mlx_rwkvx.load(tmp_path / "fused")
    ref = np.array(with_adapter(tokens))
    assert np.linalg.norm(np.array(fused(tokens)) - ref) <= 1e-5 * np.linalg.norm(ref)
    assert tok is not None and fused.quantization is None
    # an INT8 base: dequantized to fuse; --quantize re-quantizes and says what it costs
    mlx_rwkvx.save(adapter_base().quantize(8), tmp_path / "base8")
    out = run_cli(
        "--output", tmp_path / "fused8", a, "--fuse-into", tmp_path / "base8", "--quantize"
    )
    assert out.returncode == 0, out.stderr
    assert "8-bit weights dequantized" in out.stdout and "re-quantized to 8 bits" in out.stdout
    assert mlx_rwkvx.load(tmp_path / "fused8")[0].quantization["bits"] == 8


def test_scripts_wrapper_takes_foundrys_command(pair, tmp_path):
    a, b = pair
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts" / "merge_adapters.py"),
            "--output",
            str(tmp_path / "merged.safetensors"),
            str(a),
            str(b),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "merged.safetensors").exists()


def _pairs_data(folder: Path, pairs: list[str]) -> Path:
    folder.mkdir(parents=True)
    lines = [json.dumps({"prompt": p[:5], "completion": p[5:]}) for p in pairs]
    (folder / "train.jsonl").write_text("\n".join(lines) + "\n")
    return folder


def test_merged_halves_know_both(tmp_path):
    # a tiny base pretrained on random "abc: defg" pairs, so that it can be made sure of an
    # answer; two "Macs" teach it one fact each from one init; the merge knows both
    rng = np.random.default_rng(0)
    words = lambda n: "".join(chr(c) for c in rng.integers(97, 123, n))  # noqa: E731
    pairs = _pairs_data(tmp_path / "pairs", [f"{words(3)}: {words(4)}" for _ in range(64)])
    pre = train_from_config(
        TrainConfig(
            model="rwkv-x-tiny",
            mode="pretrain",
            data=str(pairs),
            output=str(tmp_path / "pre"),
            iters=150,
            lr=3e-3,
            batch_size=8,
        )
    )
    halves = (["cat: meow"] * 3, ["dog: woof"] * 3)
    runs = [
        train_from_config(
            TrainConfig(
                model=str(pre / "model"),
                data=str(_pairs_data(tmp_path / f"h{i}", h)),
                output=str(tmp_path / f"run{i}"),
                lora_rank=8,
                lora_alpha=16,
                lr=5e-3,
                warmup=2,
                iters=40,
                batch_size=3,
                lora_targets="all",
            )
        )
        for i, h in enumerate(halves)
    ]
    union = _pairs_data(tmp_path / "union", [*halves[0], *halves[1]])

    def loss(adapter) -> float:
        model, tok = mlx_rwkvx.load(pre / "model", adapter=adapter)
        examples, _ = load_examples(str(union / "train.jsonl"), tok)
        return evaluate(model, examples, batch_size=6)

    alone = [loss(r) for r in runs]
    for method in ("fedavg", "concat"):
        merged = tmp_path / f"{method}.safetensors"
        out = run_cli("--output", merged, runs[0], runs[1], "--method", method)
        assert out.returncode == 0, out.stderr
        assert loss(merged) < 0.5 * min(alone), (method, loss(merged), alone)
