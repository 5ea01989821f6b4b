"""A training run chooses the ops' implementations by measurement (``ops/tuning.py``) before
its step is compiled, steps with those choices, records them in its checkpoints, a resumed
run uses the recorded ones without measuring, and every data-parallel rank uses rank 0's
(``tuning_ranks.py`` under ``mlx.launch``, marked slow). The measurement is faked (a fixed cost per
implementation): nothing here depends on the machine's speed."""

from __future__ import annotations

import importlib
import json
from collections import Counter
from functools import partial

import mlx_rwkvx
from mlx_rwkvx.adapters import apply_lora, target_paths
from mlx_rwkvx.data.batches import batches
from mlx_rwkvx.data.examples import Example
from mlx_rwkvx.errors import TrainError
from mlx_rwkvx.io.tensors import read_safetensors
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.ops import tuning
from mlx_rwkvx.tuner import distributed, preference_run
from mlx_rwkvx.tuner.config import TrainConfig
from mlx_rwkvx.tuner.from_config import train_from_config
from mlx_rwkvx.tuner.preference import Pair, preference_loss
from mlx_rwkvx.tuner.preference_run import PreferenceStep, reference_logprobs
from mlx_rwkvx.tuner.trainer import supervised, train

import mlx.optimizers as optim
import numpy as np
import pytest

OPS = {op: importlib.import_module(f"mlx_rwkvx.ops.{op}") for op in ("wkv7", "moba")}
# the measured winners, each not its op's fixed rule at these lengths (the step loop for
# wkv7 at T <= 64, blockwise for MoBA): a step that took the rule did not use the tuning
FASTEST = {"wkv7": "chunked", "moba": "ref"}
TEXTS = [b"1+2=3", b"3+4=7", b"5+6=11", b"2+2=4"]


def fake_measure(thunks: dict) -> dict[str, float]:
    """What Tuner.measure returns, without running anything: FASTEST's implementation of the
    op whose candidates these are at 1 ms a call, every other at 2 ms."""
    fast = FASTEST["wkv7"] if "chunked" in thunks else FASTEST["moba"]
    return {name: 1e-3 if name == fast else 2e-3 for name in thunks}


@pytest.fixture
def tuned(monkeypatch, tmp_path):
    """Tuning on, a fresh tuner whose file is in tmp_path and whose measurement is faked, and
    every call of an implementation counted by op (``calls``)."""
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    monkeypatch.setenv(tuning.ENV_CACHE, str(tmp_path / "cache"))
    tuner = tuning.Tuner()
    tuner.measure = fake_measure
    monkeypatch.setattr(tuning, "TUNER", tuner)
    calls = {op: Counter() for op in OPS}
    for op, module in OPS.items():
        for name, fn in module.DISPATCH.impls.items():

            def counted(*args, _op=op, _name=name, _fn=fn, **kwargs):
                calls[_op][_name] += 1
                return _fn(*args, **kwargs)

            monkeypatch.setitem(module.DISPATCH.impls, name, counted)
    tuner.calls = calls
    return tuner


def _data():
    examples = [
        Example(np.frombuffer(t, np.uint8).astype(np.int32), np.arange(len(t)) > 0) for t in TEXTS
    ]
    return list(batches(examples, batch_size=2, seed=0, epoch=0))


def _student():
    student = Model(preset("rwkv-x-tiny"), seed=0)  # wkv7 and MoBA layers, head size 16
    apply_lora(student, target_paths(student, "attn"), rank=4, alpha=8)
    return student


def test_a_training_run_tunes_before_compiling_and_steps_with_the_choices(tuned):
    train(_student(), supervised(), optim.AdamW(learning_rate=1e-2), _data(), steps=3)
    wkv7 = [name for name in tuned.table if name.startswith("wkv7 N=16 float32 T<=")]
    moba = [name for name in tuned.table if name.startswith("moba D=16 float32 ")]
    assert wkv7 and moba, tuned.table
    assert {tuned.table[name] for name in wkv7 + moba} == {"chunked", "ref"}
    assert set(tuned.timings) == set(tuned.table) and tuned.measured == len(tuned.table)
    saved = json.loads(tuned.path.read_text())["choices"]
    assert saved == tuned.table
    # the compiled steps (and the uncompiled pass that chose) called only the winners
    for op, fastest in FASTEST.items():
        assert set(tuned.calls[op]) == {fastest}, (op, tuned.calls[op])


def test_with_tuning_off_a_run_measures_nothing(tuned, monkeypatch):
    monkeypatch.setenv(tuning.ENV_TUNE, "0")
    train(_student(), supervised(), optim.AdamW(learning_rate=1e-2), _data(), steps=2)
    assert tuned.table == {} and tuned.measured == 0 and not tuned.path.exists()
    assert set(tuned.calls["wkv7"]) == {"ref"} and set(tuned.calls["moba"]) == {"blockwise"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A tiny RWKV-X base and a few facts to learn (the byte tokenizer)."""
    root = tmp_path_factory.mktemp("tuning")
    mlx_rwkvx.save(Model(preset("rwkv-x-tiny"), seed=0), root / "base")
    rows = [{"prompt": t[: t.index(b"=") + 1].decode(), "completion": "x"} for t in TEXTS]
    (root / "data").mkdir()
    (root / "data" / "train.jsonl").write_text("\n".join(map(json.dumps, rows)) + "\n")
    return root


def _cfg(ws, out, **kw):
    fields = dict(model=str(ws / "base"), data=str(ws / "data"), output=str(out), batch_size=2)
    fields.update(lr=1e-2, warmup=0, iters=2, save_every=2, lora_rank=4, lora_alpha=8)
    return TrainConfig(**{**fields, **kw})


def test_a_checkpoint_records_the_choices_and_resume_uses_them(
    tuned, workspace, tmp_path, monkeypatch
):
    out = train_from_config(_cfg(workspace, tmp_path / "run"))
    chosen = tuned.choices()
    assert sorted(chosen.values()) == ["chunked", "ref"], chosen
    _, meta = read_safetensors(str(out / "checkpoint_2.state.safetensors"))
    assert json.loads(meta["tuning"]) == chosen
    # another process: a tuner of its own, another cache folder (no file to read the choices
    # from), and a measurement that would choose the rules
    monkeypatch.setenv(tuning.ENV_CACHE, str(tmp_path / "elsewhere"))
    fresh = tuning.Tuner()
    fresh.measure = lambda thunks: pytest.fail(f"measured {sorted(thunks)} on resume")
    monkeypatch.setattr(tuning, "TUNER", fresh)
    for counter in tuned.calls.values():
        counter.clear()
    train_from_config(_cfg(workspace, out, iters=4, resume=True))
    assert fresh.pinned == chosen and fresh.measured == 0 and fresh.table == {}
    for op, fastest in FASTEST.items():
        assert set(tuned.calls[op]) == {fastest}, (op, tuned.calls[op])


@pytest.mark.slow  # two processes under mlx.launch
def test_every_data_parallel_rank_uses_rank_0s_choices(tmp_path):
    from test_distributed import HERE, launch

    run = launch(HERE / "tuning_ranks.py", tmp_path / "ranks")
    assert run.returncode == 0, run.stdout + run.stderr
    ranks = [json.loads((tmp_path / f"ranks.{r}.json").read_text()) for r in range(2)]
    wkv7 = [name for name in ranks[0]["choices"] if name.startswith("wkv7 ")]
    assert {ranks[0]["choices"][name] for name in wkv7} == {"chunked"}
    # rank 0 chose for both length buckets, rank 1's T=40 included, which it never stepped on
    assert {"wkv7 N=16 float32 T<=8", "wkv7 N=16 float32 T<=64"} <= set(wkv7), wkv7
    # rank 1 measured nothing (it would have chosen the step loop) and took rank 0's choices
    assert ranks[1]["measured"] == 0 and ranks[0]["measured"] > 0
    assert ranks[1]["choices"] == ranks[0]["choices"] == ranks[1]["pinned"]
    # so both ranks' compiled steps called only the chunked path, at T=40 too
    assert set(ranks[1]["called"]) == set(ranks[0]["called"]) == {"chunked"}


def _pairs() -> list[Pair]:
    def tokens(text: str) -> np.ndarray:
        return np.frombuffer(text.encode(), np.uint8).astype(np.int32)

    rows = [(t[: t.index(b"=") + 1].decode(), t[t.index(b"=") + 1 :].decode()) for t in TEXTS]
    return [
        Pair(tokens(p), tokens(a), np.ones(len(a), bool), tokens("0"), np.ones(1, bool))
        for p, a in rows
    ]


def _dpo_step(model, pairs, group=None) -> PreferenceStep:
    reference = reference_logprobs(model, pairs, 2)
    terms = partial(preference_loss, "dpo", beta=0.1, kind="sigmoid", lam=0.1)
    optimizer = optim.AdamW(learning_rate=1e-2)
    return PreferenceStep(model, optimizer, pairs, reference, terms=terms, group=group)


def test_a_dpo_run_tunes_and_steps_with_the_choices(tuned):
    step, pairs = _dpo_step(_student(), _pairs()), _pairs()
    for _ in range(2):
        step([np.arange(2), np.arange(2, len(pairs))])
    assert any(name.startswith("wkv7 N=16 float32 T<=") for name in tuned.table), tuned.table
    for op, fastest in FASTEST.items():
        assert set(tuned.calls[op]) == {fastest}, (op, tuned.calls[op])


class _Rank:
    """A data-parallel group of 2 as seen from ``rank``."""

    def __init__(self, rank: int):
        self._rank = rank

    def size(self) -> int:
        return 2

    def rank(self) -> int:
        return self._rank


# rank 0's choices as the faked broadcast hands them out: the step loop for wkv7 at every length
# (this process's own measurement would pick the chunked path)
RANK0_WKV7 = {f"wkv7 N=16 float32 T<={2**i}": "ref" for i in range(12)}


def _fake_collectives(monkeypatch, peer):
    """The collectives of ``tuning_on`` and ``tune_on_rank0`` faked for a process whose one
    peer tunes too and whose new classes this step are ``peer(mine)`` (``mine``: this
    process's, as ``all_gather_json`` takes them); the broadcast hands out rank 0's choices:
    this process's own if it is rank 0, else RANK0_WKV7 over them. Returns the choices each
    broadcast handed out."""
    shared = []

    def gather(value, group):
        if isinstance(value, bool):  # the ranks' tuning settings: alike
            return [value, value]
        return [value, peer(value)] if group.rank() == 0 else [peer(value), value]

    def broadcast(choices, group):
        out = dict(choices) if group.rank() == 0 else {**choices, **RANK0_WKV7}
        shared.append(out)
        return out

    # "the peer has something new": the gather, whose lists say what, runs every step
    monkeypatch.setattr(distributed, "all_sum_int", lambda n, group: n + 1)
    monkeypatch.setattr(distributed, "all_gather_json", gather)
    monkeypatch.setattr(distributed, "broadcast_json", broadcast)
    return shared


def _sft_step(group):
    return supervised().step(_student(), optim.AdamW(learning_rate=1e-2), group)


def _tokens(T: int):
    x = np.arange(2 * T, dtype=np.int32).reshape(2, T) % 250 + 1
    return x, x


def test_a_data_parallel_rank_measures_nothing_and_steps_with_rank_0s_choices(tuned, monkeypatch):
    """Rank 1 meets T=6 with rank 0, then T=40 alone: both are chosen for by rank 0 (the step
    loop), which rank 1's compiled steps call, though its own measurement prefers chunked."""
    peer = [[[8, 1], [2, 6]]]
    shared = _fake_collectives(monkeypatch, lambda mine: peer)
    monkeypatch.setattr(distributed, "all_sum", lambda tree, group: tree)
    step = _sft_step(_Rank(1))
    step([_tokens(6)])
    peer.clear()  # rank 0 meets nothing new in the second step
    step([_tokens(40)])
    step([_tokens(40)])  # met before by both: nothing to choose, no broadcast
    assert len(shared) == 2 and tuned.measured == 0, (shared, tuned.table)
    assert not any(name.startswith("wkv7 ") for name in tuned.table), tuned.table
    assert set(tuned.calls["wkv7"]) == {"ref"}, tuned.calls["wkv7"]


def test_rank_0_chooses_for_a_length_only_another_rank_meets(tuned, monkeypatch):
    peer = [[[64, 1], [2, 40]]]  # rank 1's new class in the first step: T=40
    shared = _fake_collectives(monkeypatch, lambda mine: peer)
    monkeypatch.setattr(distributed, "all_sum", lambda tree, group: tree)
    step = _sft_step(_Rank(0))
    step([_tokens(6)])
    # measured on zeros of rank 1's shape, and handed out with rank 0's own
    assert {"wkv7 N=16 float32 T<=8", "wkv7 N=16 float32 T<=64"} <= set(tuned.table)
    assert len(shared) == 1 and shared[0] == tuning.choices()
    assert set(tuned.calls["wkv7"]) == {"chunked"}


def test_a_data_parallel_dpo_step_uses_rank_0s_choices(tuned, monkeypatch):
    """Rank 1 of a DPO run: rank 0 chose the step loop for wkv7 (this rank would have measured
    chunked as faster); this rank measures nothing and its steps call only the step loop."""
    pairs = _pairs()
    shared = _fake_collectives(monkeypatch, lambda mine: mine)  # rank 0 meets the same
    monkeypatch.setattr(preference_run, "all_sum", lambda tree, group: tree)
    step = _dpo_step(_student(), pairs, group=_Rank(1))
    # the reference model's pass before training chose by this rank's own measurement
    measured = tuned.measured
    tuned.calls["wkv7"].clear()
    step([np.arange(2), np.arange(2, 4)])
    step([np.arange(2), np.arange(2, 4)])
    assert set(tuned.calls["wkv7"]) == {"ref"}, tuned.calls["wkv7"]
    assert tuned.measured == measured and len(shared) == 1, shared


def test_ranks_that_disagree_on_tuning_stop_with_one_clear_error(tuned, monkeypatch):
    # a rank that tunes would wait in collectives the others never join
    monkeypatch.setattr(distributed, "all_gather_json", lambda value, group: [value, not value])
    with pytest.raises(TrainError, match="MLX_RWKVX_TUNE differs between the ranks"):
        _sft_step(_Rank(1))
    with pytest.raises(TrainError, match="rank 0: on, rank 1: off"):
        _dpo_step(_student(), _pairs(), group=_Rank(0))
