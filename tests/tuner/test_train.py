"""``python -m mlx_rwkvx.train`` on tiny models made here: every mode runs and writes what it
should, LoRA learns a memorisable set, LoRA gradients equal the float64 oracle's, a run killed
(also during a save) resumes to the same losses, Ctrl-C saves, a non-finite loss stops with its
step, and mistakes are one line with exit 2 and nothing written."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx_rwkvx
from mlx_rwkvx import train as train_cli
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.models import Model, preset, rfa_config
from mlx_rwkvx.tuner.build import build
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.trainer import TrainError, batch_loss

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from helpers import LOW_RANK, rfa_cfg, run_module, rwkv7_cfg
from helpers.model_params import from_oracle, oracle_params
from mlx.utils import tree_flatten, tree_unflatten
from oracle.common import rel_err
from oracle.lm import cross_entropy_bwd_np, cross_entropy_fwd_np
from oracle.model import model_bwd_np, model_fwd_np, spec_of

FACTS = [f"{a}+{b}={a + b}" for a, b in [(1, 2), (3, 4), (5, 6), (7, 1), (2, 9), (4, 4)]]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny RWKV-X base and a memorisable data set (the byte tokenizer)."""
    root = tmp_path_factory.mktemp("train")
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")
    lines = [
        json.dumps({"prompt": f[: f.index("=") + 1], "completion": f[f.index("=") + 1 :]})
        for f in FACTS
    ]
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("\n".join(lines) + "\n")
    (root / "data" / "valid.jsonl").write_text("\n".join(lines[:2]) + "\n")
    (root / "data" / "test.jsonl").write_text("\n".join(lines[2:4]) + "\n")
    return root


def _cfg(ws, out, **kw):
    fields = dict(
        model=str(ws / "base"),
        data=str(ws / "data"),
        output=str(out),
        batch_size=3,
        lr=2e-2,
        warmup=2,
        iters=8,
        log_every=4,
        save_every=2,
    )
    if kw.get("mode", "lora") in ("lora", "dora"):  # the adapter's settings: LoRA's alone
        fields.update(lora_rank=4, lora_alpha=8)
    fields.update(kw)
    return TrainConfig(**fields)


def _losses(out: Path) -> dict[int, float]:
    """Training loss by step (the last record of a step: a resumed run repeats some)."""
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_lora_learns_a_memorisable_set(workspace, tmp_path):
    out = train_from_config(_cfg(workspace, tmp_path / "run", iters=40, save_every=100, test=True))
    losses = _losses(out)
    assert losses[40] <= 0.5 * losses[1], losses
    final = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert final["step"] == 40 and final["val_loss"] > 0 and final["test_loss"] > 0
    files = sorted(p.name for p in out.iterdir())
    assert {"adapter_final.safetensors", "adapter_config.json", "metrics.jsonl"} <= set(files)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["fine_tune_type"] == "lora" and config["lora_parameters"]["scale"] == 2.0
    assert config["tokens_trained"] > 0 and len(config["lora_parameters"]["keys"]) == 12
    # the adapter loads onto the base and gives the trained model's logits
    model, _ = mlx_rwkvx.load(workspace / "base", adapter=out / "adapter_final.safetensors")
    tokens = mx.array([list(b"3+4=")])
    trained = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(trained, target_paths(trained, "attn"), rank=4, alpha=8)
    trained.load_weights(str(out / "adapter_final.safetensors"), strict=False)
    assert rel_err(np.array(model(tokens)), np.array(trained(tokens))) <= 1e-6


@pytest.mark.parametrize("mode", ["dora", "state", "full"])
def test_each_mode_trains_exactly_what_it_trains_and_lowers_the_loss(workspace, tmp_path, mode):
    lr = {"state": 0.5, "dora": 1e-2, "full": 1e-3}[mode]
    cfg = _cfg(workspace, tmp_path / mode, mode=mode, iters=12, lr=lr, save_every=100)
    mx.random.seed(cfg.seed)  # what train starts from: the same build of the same settings
    start = dict(tree_flatten(build(cfg.resolved({"rwkv7", "moba"})).model.trainable_parameters()))
    out = train_from_config(cfg)
    losses = list(_losses(out).values())
    assert len(losses) == 12 and np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    # the checkpoint holds exactly the trained tensors, every one of them moved
    trained, _ = read_safetensors(str(out / "checkpoint_12.safetensors"))
    assert sorted(trained) == sorted(start), sorted(set(trained) ^ set(start))[:4]
    leaves = {"dora": {"lora_a", "lora_b", "m"}, "state": {"state0"}}.get(mode)
    if leaves is not None:  # adapters: their own tensors only, never a base weight
        assert {name.rsplit(".", 1)[1] for name in trained} == leaves
    else:  # full: every weight of the model
        assert len(trained) == len(tree_flatten(Model(preset("rwkv-x-tiny")).parameters()))
    unmoved = [n for n, x in trained.items() if np.array_equal(np.array(x), np.array(start[n]))]
    assert not unmoved, unmoved[:4]
    if mode == "full":
        model, _ = mlx_rwkvx.load(out / "model")
        assert model.config.block_types == preset("rwkv-x-tiny").block_types
    else:
        config = json.loads((out / "adapter_config.json").read_text())
        assert config["fine_tune_type"] == mode
        model, _ = mlx_rwkvx.load(workspace / "base", adapter=out)
        base, _ = mlx_rwkvx.load(workspace / "base")
        tokens = mx.array([list(b"3+4=")])
        assert rel_err(np.array(model(tokens)), np.array(base(tokens))) > 1e-4  # it counts


def test_pretrain_from_a_preset(tmp_path, workspace):
    out = train_from_config(
        TrainConfig(
            model="rwkv-x-tiny",
            mode="pretrain",
            data=str(workspace / "data"),
            output=str(tmp_path / "pre"),
            iters=3,
            batch_size=2,
            log_every=1,
        )
    )
    assert len(_losses(out)) == 3
    model, _ = mlx_rwkvx.load(out / "model")
    assert model.config.vocab_size == 256


@pytest.mark.parametrize("dora", [False, True], ids=["lora", "dora"])
def test_adapter_gradients_equal_the_oracles(dora):
    # The oracle runs the model with every adapted weight folded in: W' = W + s (A B)^T for
    # LoRA; W' = (m / n) V with V = W + s (A B)^T, n its row norms (held fixed, as mlx-lm's
    # DoRALinear does) for DoRA. From the oracle's gradient G of W': dL/dV = G (LoRA) or
    # (m / n) G (DoRA), dL/dm = sum_i G V / n, dL/dA = s dV^T B^T, dL/dB = s A^T dV^T.
    cfg = rfa_cfg(["rwkv7", "qwen2"], vocab_size=40, **LOW_RANK)
    model = Model(cfg, seed=3)
    paths = target_paths(model, "all")
    apply_lora(model, paths, rank=2, alpha=6, dora=dora)
    s = 3.0
    modules = dict(model.named_modules())
    rng = np.random.default_rng(0)
    for p in paths:  # a trained-looking adapter: B non-zero, m off the base's norms
        layer = modules[p]
        layer.lora_b = mx.array(0.2 * rng.standard_normal(layer.lora_b.shape), mx.float32)
        if dora:
            layer.m = layer.m * mx.array(1 + 0.1 * rng.standard_normal(layer.m.shape), mx.float32)
    tokens = mx.array(rng.integers(0, 40, (2, 9)))
    targets = mx.array(rng.integers(0, 40, (2, 9)))

    def loss(m):
        total, count = batch_loss(m, tokens, targets)
        return total / count

    _, grads = nn.value_and_grad(model, loss)(model)
    grads = dict(tree_flatten(grads))
    fused = Model(cfg, seed=3)
    folded = {}
    for p in paths:
        layer = modules[p]
        a, b = np.array(layer.lora_a, np.float64), np.array(layer.lora_b, np.float64)
        V = np.array(layer.linear.weight, np.float64) + s * (a @ b).T
        factor = np.array(layer.m, np.float64) / np.linalg.norm(V, axis=1) if dora else None
        folded[p] = (a, b, V, factor)
        W = V * factor[:, None] if dora else V
        dict(fused.named_modules())[p].weight = mx.array(W, mx.float32)
    params = oracle_params(fused, block_types=cfg.block_types)
    logits, cache = model_fwd_np(np.array(tokens), params, spec_of(cfg))
    _, ce = cross_entropy_fwd_np(logits, np.array(targets))
    g_ref = model_bwd_np(cache, cross_entropy_bwd_np(ce))
    weights = from_oracle(g_ref, [f"{p}.weight" for p in paths], block_types=cfg.block_types)
    for p in paths:
        a, b, V, factor = folded[p]
        G = weights[f"{p}.weight"]
        dV = G * factor[:, None] if dora else G
        assert rel_err(np.array(grads[f"{p}.lora_a"]), s * dV.T @ b.T) <= 1e-4, p
        assert rel_err(np.array(grads[f"{p}.lora_b"]), s * a.T @ dV.T) <= 1e-4, p
        if dora:
            dm = (G * V).sum(axis=1) / np.linalg.norm(V, axis=1)
            assert rel_err(np.array(grads[f"{p}.m"]), dm) <= 1e-4, p


def _cli_args(ws, out, iters=8, lora=True):
    return [
        "--model",
        ws / "base",
        "--data",
        ws / "data",
        "--output",
        out,
        "--batch-size",
        3,
        "--lr",
        2e-2,
        "--warmup",
        2,
        "--iters",
        iters,
        "--save-every",
        2,
        "--log-every",
        4,
        *(["--lora-rank", 4, "--lora-alpha", 8] if lora else []),
    ]


@pytest.mark.parametrize(
    ("crash", "mode"), [("step:5", "lora"), ("save:4", "lora"), ("step:5", "full")]
)
def test_resume_after_sigkill_gives_the_same_losses(workspace, tmp_path, crash, mode):
    extra = ["--mode", "full", "--lr", "1e-3"] if mode == "full" else []
    lora = mode != "full"
    whole = run_module("train", *_cli_args(workspace, tmp_path / "whole", lora=lora), *extra)
    assert whole.returncode == 0, whole.stderr
    killed = run_module(
        "train",
        *_cli_args(workspace, tmp_path / "run", lora=lora),
        *extra,
        env={"MLX_RWKVX_CRASH_AT": crash},
    )
    assert killed.returncode == -signal.SIGKILL
    if crash == "save:4":  # killed inside the save: checkpoint_4 has no manifest
        assert not (tmp_path / "run" / "checkpoint_4.json").exists()
    again = run_module(
        "train", *_cli_args(workspace, tmp_path / "run", lora=lora), *extra, "--resume"
    )
    assert again.returncode == 0, again.stderr
    want, got = _losses(tmp_path / "whole"), _losses(tmp_path / "run")
    assert sorted(got) == sorted(want)
    for step in want:
        assert abs(got[step] - want[step]) <= 1e-6 * abs(want[step]), (step, got, want)


def test_ctrl_c_saves_and_exits(workspace, tmp_path):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_rwkvx.train", *map(str, _cli_args(workspace, out, 10_000))],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.time() + 120
    while not (out / "checkpoint_2.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert (
        err.strip().splitlines()[-1].startswith("mlx_rwkvx.train: interrupted (saved checkpoint_")
    )
    step = max(int(p.stem.split("_")[1]) for p in out.glob("checkpoint_*.json"))
    assert (out / f"checkpoint_{step}.safetensors").exists() and step >= 2


def test_non_finite_loss_stops_with_the_step(workspace, tmp_path):
    out = tmp_path / "nan"
    run = run_module("train", *_cli_args(workspace, out), "--lr", "1e30", "--grad-clip", "0")
    assert run.returncode == 1, run.stderr
    line = run.stderr.strip().splitlines()[-1]
    assert "step " in line and ("nan" in line or "inf" in line) and "stopped (kept:" in line


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--model", "nope"], "nope: no such file or folder"),
        (["--lora-rank", "0"], "--lora-rank must be at least 1, got 0"),
        (["--lora-targets", "layers.*.nothing"], "match no projection"),
        (["--mode", "dora", "--quantize"], "DoRA on a quantized base"),
        (["--data", "/nonexistent.jsonl"], "no such file"),
    ],
)
def test_mistakes_are_one_line_and_exit_2(workspace, tmp_path, change, message):
    out = tmp_path / "out"
    run = run_module("train", *_cli_args(workspace, out), *change)
    assert run.returncode == 2, run.stderr
    lines = [x for x in run.stderr.strip().splitlines() if x]
    assert len(lines) == 1 and message in lines[0], run.stderr
    assert not out.exists()


def test_an_output_folder_holding_another_run(workspace, tmp_path):
    out = tmp_path / "out"
    assert run_module("train", *_cli_args(workspace, out, iters=2)).returncode == 0
    before = sorted(p.name for p in out.iterdir())
    run = run_module("train", *_cli_args(workspace, out, iters=2))
    assert run.returncode == 2 and "holds another run; pass --resume" in run.stderr
    assert sorted(p.name for p in out.iterdir()) == before


def test_yaml_config_and_mlx_lm_names(workspace, tmp_path):
    # an mlx-lm LoRA config reads as is; a flag beats the file
    config = tmp_path / "lora.yaml"
    config.write_text(
        f"model: {workspace / 'base'}\ndata: {workspace / 'data'}\ntrain: true\n"
        f"adapter_path: {tmp_path / 'out'}\nfine_tune_type: lora\nbatch_size: 3\niters: 2\n"
        "learning_rate: 1e-3\nlora_parameters: {rank: 4, scale: 2.0, dropout: 0.0}\n"
    )
    cfg = train_cli.read_settings(["--config", str(config), "--iters", "3"])
    assert (cfg.lora_rank, cfg.resolved().lora_alpha, cfg.lr, cfg.iters) == (4, 8.0, 1e-3, 3)
    assert cfg.output == str(tmp_path / "out") and cfg.mode == "lora"
    bad = tmp_path / "bad.yaml"
    bad.write_text("lr: 1e-3\nwarp_speed: 9\n")
    with pytest.raises(SystemExit) as e:
        train_cli.read_settings(["--config", str(bad)])
    assert e.value.code == 2


def test_int8_base_lora_gradients_are_those_of_its_dequantized_twin(tmp_path):
    # LoRA on QuantizedLinear bases: the adapters' gradients (through the quantized matmuls'
    # input gradients) equal those of a float model holding the dequantized weights
    cfg = rfa_config(
        vocab_size=64,
        hidden_size=64,
        head_size=16,
        intermediate_size=128,
        block_types=["rwkv7", "qwen2"],
        n_q_heads=4,
        n_kv_heads=2,
    )
    mlx_rwkvx.save(Model(cfg, seed=4), tmp_path / "fp")
    q, _ = mlx_rwkvx.load(tmp_path / "fp", quantize="int8")
    twin, _ = mlx_rwkvx.load(tmp_path / "fp")
    for path, module in q.named_modules():  # the twin: each quantized layer, dequantized
        if isinstance(module, (nn.QuantizedLinear, nn.QuantizedEmbedding)):
            w = mx.dequantize(module.weight, module.scales, module.biases, 64, 8)
            dict(twin.named_modules())[path].weight = w
    paths = target_paths(q, "all")
    for m in (q, twin):
        mx.random.seed(1)  # the same adapter init in both
        apply_lora(m, paths, rank=4, alpha=8)
        for name, x in sorted(dict(tree_flatten(m.trainable_parameters())).items()):
            m.load_weights([(name, x + 0.01)], strict=False)
    rng = np.random.default_rng(2)
    tokens, targets = (mx.array(rng.integers(0, 64, (2, 12))) for _ in "tt")

    def grads(m):
        return dict(
            tree_flatten(nn.value_and_grad(m, lambda m: batch_loss(m, tokens, targets)[0])(m)[1])
        )

    gq, gt = grads(q), grads(twin)
    assert gq.keys() == gt.keys() and len(gq) == 2 * len(paths)
    for name in gq:
        assert rel_err(np.array(gq[name]), np.array(gt[name])) <= 1e-5, name


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--save-every", "0"], "--save-every must be at least 1"),
        (["--log-every", "0"], "--log-every must be at least 1"),
        (["--grad-accum", "0"], "--grad-accum must be at least 1"),
        (["--batch-size", "0"], "--batch-size must be at least 1"),
        (["--max-seq-len", "0"], "--max-seq-len must be at least 2"),
        (["--warmup", "-3"], "--warmup must not be negative"),
        (["--iters", "-1"], "--iters must be at least 1"),
        (["--epochs", "0", "--iters", "2"], "--epochs must be at least 1"),
        (["--lr", "0"], "--lr must be positive"),
        (["--num-layers", "-2"], "--num-layers must be at least 1"),
        (["--lora-dropout", "1"], "--lora-dropout must be less than 1"),
        (["--grad-checkpoint", "--lora-dropout", "0.1"], "other dropout masks"),
        (
            ["--mode", "state", "--lora-targets", "attn"],
            "--lora-targets applies to --mode lora, dora, pissa or miss, not --mode state",
        ),
        (["--mode", "pretrain", "--dtype", "bfloat16"], "no --dtype"),
    ],
)
def test_settings_out_of_range_are_one_line(workspace, tmp_path, capsys, change, message):
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as e:
        lora = "--mode" not in change  # another mode takes no LoRA settings
        train_cli.main([str(a) for a in _cli_args(workspace, out, lora=lora)] + change)
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x]
    assert len(lines) == 1 and message in lines[0], lines
    assert not out.exists()


def test_output_that_is_a_file(workspace, tmp_path):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(TrainError, match="is a file"):
        train_from_config(_cfg(workspace, tmp_path / "f"))
    assert (tmp_path / "f").read_text() == "mine"


def test_resume_refuses_other_settings_and_keeps_the_run(workspace, tmp_path):
    out = train_from_config(_cfg(workspace, tmp_path / "run", iters=2))
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(TrainError, match=r"lora-rank 4 \(now 8\)"):
        train_from_config(_cfg(workspace, out, iters=4, lora_rank=8, resume=True))
    with pytest.raises(TrainError, match=r"batch-size 3 \(now 2\)"):
        train_from_config(_cfg(workspace, out, iters=4, batch_size=2, resume=True))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before
    train_from_config(_cfg(workspace, out, iters=4, resume=True))  # the same settings go on
    assert sorted(_losses(out)) == [1, 2, 3, 4]


def test_a_run_that_died_before_its_first_checkpoint_can_start_again(workspace, tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 1, "loss": NaN}\n{"step": 2, "lo')
    with pytest.raises(TrainError, match="no complete checkpoint"):
        train_from_config(_cfg(workspace, out, iters=2, resume=True))
    train_from_config(_cfg(workspace, out, iters=2))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


def test_dropout_is_off_in_evaluation_and_in_a_loaded_adapter(workspace, tmp_path):
    from mlx_rwkvx.data.examples import Example
    from mlx_rwkvx.tuner.trainer import evaluate

    out = train_from_config(_cfg(workspace, tmp_path / "run", iters=2, lora_dropout=0.5))
    model, _ = mlx_rwkvx.load(workspace / "base", adapter=out)
    tokens = mx.array([list(b"3+4=7")])
    assert not model.training
    assert np.array_equal(np.array(model(tokens)), np.array(model(tokens)))
    model.train()  # as during training: evaluate turns dropout off, then back on
    ids = np.array(list(b"1+2=3"), np.int32)
    example = Example(tokens=ids, trained=np.arange(len(ids)) > 0)
    assert evaluate(model, [example], 1) == evaluate(model, [example], 1)
    assert model.training


def test_bad_test_split_stops_the_start(workspace, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("train.jsonl", "valid.jsonl"):
        (data / name).write_bytes((workspace / "data" / name).read_bytes())
    (data / "test.jsonl").write_text('{"text": "fine"}\n{"text": \n')
    with pytest.raises(TrainError, match="test.jsonl"):
        train_from_config(_cfg(workspace, tmp_path / "out", data=str(data), test=True))
    assert not (tmp_path / "out").exists()


def test_grad_checkpoint_trains_the_same(workspace, tmp_path):
    plain = train_from_config(_cfg(workspace, tmp_path / "plain", iters=3))
    again = train_from_config(_cfg(workspace, tmp_path / "ckpt", iters=3, grad_checkpoint=True))
    a, b = _losses(plain), _losses(again)
    assert a.keys() == b.keys()
    for step in a:
        assert abs(a[step] - b[step]) <= 1e-5 * abs(a[step]), (a, b)


def test_mlx_lm_default_config_reads(workspace, tmp_path, capsys):
    # mlx-lm's own defaults, every key, as its lora command would dump them
    import yaml
    from mlx_lm.lora import CONFIG_DEFAULTS

    settings = dict(
        CONFIG_DEFAULTS,
        model=str(workspace / "base"),
        data=str(workspace / "data"),
        adapter_path=str(tmp_path / "out"),
    )
    config = tmp_path / "mlx_lm.yaml"
    config.write_text(yaml.safe_dump(settings))
    cfg = train_cli.read_settings(["--config", str(config)])
    assert cfg.output == str(tmp_path / "out") and cfg.batch_size == 4 and cfg.iters == 1000
    assert (cfg.lora_rank, cfg.lora_scale, cfg.lora_dropout) == (8, 20.0, 0.0)
    assert cfg.weight_decay == 0.0 and not cfg.mask_prompt  # mlx-lm's "adam", its default
    assert cfg.num_layers == 16  # more than the tiny model's 6 blocks: all of them
    resolved = cfg.resolved()
    assert resolved.lora_alpha == 160.0
    train_cli.main(["--config", str(config), "--iters", "2"])  # it trains as it is
    written = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert written["lora_parameters"]["scale"] == 20.0 and written["steps"] == 2
    config.write_text(yaml.safe_dump(dict(settings, num_layers=-1)))
    assert train_cli.read_settings(["--config", str(config)]).resolved().num_layers is None
    # the command line's rank keeps the file's scale; its alpha beats the file's scale
    cfg = train_cli.read_settings(["--config", str(config), "--rank", "4"])
    assert cfg.resolved().lora_alpha == 80
    cfg = train_cli.read_settings(["--config", str(config), "--lora-alpha", "3"])
    assert cfg.resolved().lora_alpha == 3
    for key, value in [
        ("optimizer", "muon"),
        ("lr_schedule", {"name": "cosine_decay"}),
        ("resume_adapter_file", "a.safetensors"),
    ]:
        config.write_text(yaml.safe_dump(dict(settings, **{key: value})))
        with pytest.raises(SystemExit):
            train_cli.read_settings(["--config", str(config)])
        assert key in capsys.readouterr().err


def test_relative_targets_as_mlx_lm_names_them(workspace):
    model, _ = mlx_rwkvx.load(workspace / "base")
    from mlx_rwkvx.adapters.targets import target_paths as paths_of

    assert paths_of(model, "attn.q_proj", 2) == [
        f"layers.{i}.attn.q_proj"
        for i in range(len(model.layers) - 2, len(model.layers))
        if model.layers[i].kind == "moba"
    ]


def test_no_mask_prompt_trains_on_the_prompts_too(workspace, tmp_path, capsys):
    counts = {}
    for flag in ("--mask-prompt", "--no-mask-prompt"):
        out = tmp_path / flag
        train_cli.main([str(a) for a in _cli_args(workspace, out, iters=2)] + [flag])
        counts[flag] = json.loads((out / "adapter_config.json").read_text())["tokens_trained"]
    # the completions ("3\n\n" after "User: 1+2=\n\nAssistant:") are a few tokens of each
    assert counts["--no-mask-prompt"] > 3 * counts["--mask-prompt"] > 0, counts


def test_mlx_lm_optimizer_adam_alone_means_no_weight_decay(tmp_path):
    # mlx-lm's "adam" is Adam, with or without an optimizer_config block; "adamw" keeps ours
    config = tmp_path / "lora.yaml"
    for text, decay in [
        ("optimizer: adam\n", 0.0),
        ("optimizer: adamw\n", None),
        ("optimizer: adam\noptimizer_config: {adam: {}}\n", 0.0),
        ("optimizer: adamw\noptimizer_config: {adamw: {weight_decay: 0.1}}\n", 0.1),
    ]:
        config.write_text(text)
        assert train_cli.read_settings(["--config", str(config)]).weight_decay == decay, text
    config.write_text("optimizer: adam\n")  # a flag beats the file
    cfg = train_cli.read_settings(["--config", str(config), "--weight-decay", "0.05"])
    assert cfg.weight_decay == 0.05


def test_mlx_lm_command_line_flags(workspace, tmp_path, capsys):
    # mlx_lm.lora's command as its users type it: --train, --optimizer, its other names
    args = [
        "--model",
        str(workspace / "base"),
        "--train",
        "--data",
        str(workspace / "data"),
        "--fine-tune-type",
        "lora",
        "--optimizer",
        "adam",
        "--iters",
        "2",
        "--learning-rate",
        "1e-3",
        "--adapter-path",
        str(tmp_path / "out"),
    ]
    cfg = train_cli.read_settings(args)
    assert (cfg.mode, cfg.weight_decay, cfg.iters, cfg.lr) == ("lora", 0.0, 2, 1e-3)
    assert train_cli.read_settings(args[:-2] + ["--optimizer", "adamw"]).weight_decay is None
    with pytest.raises(SystemExit) as e:
        train_cli.read_settings(args + ["--optimizer", "muon"])
    assert e.value.code == 2 and "--optimizer" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (None, "nope.yaml: No such file or directory"),
        ("lr: [1\n", "nope.yaml: "),
        ("- 1\n", "expected a mapping of settings"),
        ("warp_speed: 9\n", "unknown setting"),
    ],
)
def test_a_bad_config_file_is_one_line(tmp_path, capsys, text, message):
    config = tmp_path / "nope.yaml"
    if text is not None:
        config.write_text(text)
    with pytest.raises(SystemExit) as e:
        train_cli.read_settings(["--config", str(config)])
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x]
    assert len(lines) == 1 and message in lines[0] and "--config" in lines[0], lines


def test_the_last_steps_validation_is_not_taken_twice(workspace, tmp_path, monkeypatch):
    # --val-every dividing the last step: the end reuses that validation loss
    from mlx_rwkvx.tuner import trainer

    calls = []
    real = trainer.evaluate
    monkeypatch.setattr(trainer, "evaluate", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = train_from_config(_cfg(workspace, tmp_path / "run", iters=4, val_every=2))
    assert len(calls) == 2  # steps 2 and 4
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r and r["step"] == 4]
    assert len(val) == 2 and val[0] == val[1]  # the step's record and the end's


def test_val_every_without_validation_data_says_so(workspace, tmp_path, capsys):
    data = str(workspace / "data" / "train.jsonl")  # a file: no valid split beside it
    train_from_config(_cfg(workspace, tmp_path / "run", data=data, iters=2, val_every=1))
    err = capsys.readouterr().err
    assert "--val-every 1: no validation data" in err, err


@pytest.mark.parametrize("damaged", ["checkpoint_2.safetensors", "checkpoint_2.state.safetensors"])
def test_resume_from_a_damaged_checkpoint_is_one_error(workspace, tmp_path, damaged):
    # a checkpoint file cut short after its manifest was written (a copy, a failing disk)
    out = train_from_config(_cfg(workspace, tmp_path / "run", iters=2))
    (out / damaged).write_bytes((out / damaged).read_bytes()[:100])
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    with pytest.raises(TrainError, match=rf"{damaged}: cannot read.*older one"):
        train_from_config(_cfg(workspace, out, iters=4, resume=True))
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == before


@pytest.mark.parametrize(
    "manifest", ["[1]", '{"complete": true}', '{"complete": true, "files": 3}']
)
def test_a_damaged_manifest_is_no_checkpoint(tmp_path, manifest):
    from mlx_rwkvx.tuner.checkpoints import newest_checkpoint

    (tmp_path / "checkpoint_3.json").write_text(manifest)
    assert newest_checkpoint(tmp_path) is None


def test_output_below_a_file_is_one_line(workspace, tmp_path, capsys):
    (tmp_path / "f").write_text("mine")
    with pytest.raises(SystemExit) as e:
        train_cli.main([str(a) for a in _cli_args(workspace, tmp_path / "f" / "run", iters=1)])
    assert e.value.code == 2
    lines = [x for x in capsys.readouterr().err.splitlines() if x]
    assert len(lines) == 1 and "is a file" in lines[0] and str(tmp_path / "f") in lines[0], lines
    assert (tmp_path / "f").read_text() == "mine"


def test_a_preset_name_without_pretrain_says_how(workspace, tmp_path):
    with pytest.raises(TrainError, match="rwkv-x-tiny: a preset.*--mode pretrain"):
        train_from_config(_cfg(workspace, tmp_path / "out", model="rwkv-x-tiny"))
    assert not (tmp_path / "out").exists()


def test_pretraining_decays_only_what_rwkvs_trainer_decays():
    # RWKV-LM (x070) decays the 2-D parameters named ".weight": the projections, embedding and
    # head; not norms, biases, token-shift mixes, w0 (the decay's up.bias), k_k/k_a/r_k, nor
    # the low-rank w1/w2, a1/a2, v1/v2, g1/g2 (parameters of their own there: our LowRank's
    # down.weight and up.weight). One AdamW step with zero gradients shows what decays.
    from mlx_rwkvx.tuner.optimizer import optimizer_for

    model = Model(rwkv7_cfg(vocab_size=64), seed=0)
    cfg = TrainConfig(
        mode="pretrain", model="m", data="d", output="o", lr=0.1, warmup=0, weight_decay=0.5
    ).resolved()
    optimizer = optimizer_for(cfg, 10)
    before = {k: v + 1.0 for k, v in tree_flatten(model.trainable_parameters())}  # none zero
    model.load_weights(list(before.items()), strict=False)
    optimizer.update(model, tree_unflatten([(k, mx.zeros_like(v)) for k, v in before.items()]))
    after = dict(tree_flatten(model.trainable_parameters()))
    decayed = {k for k in before if not np.array_equal(np.array(before[k]), np.array(after[k]))}
    low_rank = [
        k for k in before if any(f".{n}." in k for n in ("decay", "iclr", "value_mix", "gate"))
    ]
    assert low_rank and not decayed & set(low_rank), sorted(decayed & set(low_rank))
    want = {
        k for k in before if k.endswith(".weight") and before[k].ndim == 2 and k not in low_rank
    }
    assert decayed == want, sorted(decayed ^ want)
    assert {"embed.weight", "lm_head.weight", "layers.0.tmix.receptance.weight"} <= decayed
