"""The training loop's duties, each alone (``tuner/callbacks.py``): told of a start, steps, a
stop and an end by hand, as the loop tells them, with no run around them; and the loop's own
stop protocol (a stop request, a non-finite loss, a step dropped between its windows) on a
step that stands in for a model's."""

from __future__ import annotations

import json
import os
import signal

from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.errors import Interrupted, NonFinite, TrainError
from mlx_rwkvx.models import Model
from mlx_rwkvx.tuner import callbacks
from mlx_rwkvx.tuner.checkpoints import newest_checkpoint
from mlx_rwkvx.tuner.optimizer import make_optimizer
from mlx_rwkvx.tuner.steps import StepResult, Task, TrainState
from mlx_rwkvx.tuner.trainer import WindowStop, train

import mlx.core as mx
import numpy as np
import pytest
from helpers import rwkv7_cfg
from mlx.utils import tree_flatten


def _steps(callback, state: TrainState, last: int) -> list[dict]:
    """Steps ``state.step + 1 .. last`` told to ``callback`` as the loop tells them."""
    records = []
    while state.step < last:
        state.step += 1
        record = {"step": state.step, "loss": 1.0 / state.step, "lr": 1e-3, "tokens": state.step}
        callback.on_step_end(state, record)
        records.append(record)
    return records


def test_stop_requests_set_the_states_signal_and_hand_the_next_one_back():
    before = signal.getsignal(signal.SIGTERM)
    stop, state = callbacks.StopRequests(), TrainState()
    stop.on_train_begin(state)
    assert signal.getsignal(signal.SIGTERM) is not before
    os.kill(os.getpid(), signal.SIGTERM)  # handled at once: the main thread is running Python
    assert state.signal == signal.SIGTERM and state.stopping
    assert signal.getsignal(signal.SIGTERM) is before  # a second one does what it did before
    state.ranks = 2  # several ranks: they stop together, when told in a step's collective
    assert not state.stopping
    state.told = True
    assert state.stopping


def test_stop_requests_let_go_of_the_signals_at_the_end():
    before = signal.getsignal(signal.SIGINT)
    stop, state = callbacks.StopRequests(), TrainState()
    stop.on_train_begin(state)
    stop.on_train_end(state, {})  # the final evaluation and files: Ctrl-C stops them at once
    assert signal.getsignal(signal.SIGINT) is before and state.signal is None
    stop.close()
    assert signal.getsignal(signal.SIGINT) is before


def test_progress_logs_every_n_steps_and_the_last(capsys):
    progress, state = callbacks.Progress(every=2), TrainState(total=5, fed=100)
    progress.on_train_begin(state)
    state.fed += 400  # tokens fed by this process: the rate counts those
    records = _steps(progress, state, 5)
    progress.on_train_end(state, {})
    logged = [r["step"] for r in records if "tokens_per_s" in r]
    assert logged == [2, 4, 5]
    assert all(r["tokens_per_s"] > 0 and r["peak_memory_gb"] >= 0 for r in records[1::2])
    out = capsys.readouterr().out
    assert "step 2/5: loss 0.5000, lr 1.00e-03" in out and "step 5/5" in out
    quiet, state = callbacks.Progress(every=1, show=False), TrainState(total=2)
    quiet.on_train_begin(state)
    assert not any("tokens_per_s" in r for r in _steps(quiet, state, 2))  # a rank but 0's
    quiet.close()


def test_validation_every_n_steps_and_once_at_the_end(capsys):
    calls = []

    def validate(max_batches):
        calls.append(max_batches)
        return {"val_loss": 0.25 * len(calls)}

    validation, state = callbacks.Validation(validate, every=2, max_batches=3), TrainState()
    records = _steps(validation, state, 4)
    assert calls == [3, 3] and [r.get("val_loss") for r in records] == [None, 0.25, None, 0.5]
    final = {}
    validation.on_train_end(state, final)  # the last step's is the end's: not taken again
    assert final == {"val_loss": 0.5} and len(calls) == 2
    _steps(validation, state, 5)
    validation.on_train_end(state, final := {})
    assert final == {"val_loss": 0.75} and len(calls) == 3
    assert "step 2: validation loss 0.2500" in capsys.readouterr().out
    at_end_only, state = callbacks.Validation(validate), TrainState()
    assert all("val_loss" not in r for r in _steps(at_end_only, state, 4))


def test_test_loss_at_the_end(capsys):
    final = {"val_loss": 1.0}
    callbacks.TestLoss(lambda: {"test_loss": 2.0}).on_train_end(TrainState(step=3), final)
    assert final == {"val_loss": 1.0, "test_loss": 2.0}
    assert "test loss 2.0000" in capsys.readouterr().out


def test_metrics_file_keeps_the_checkpoints_steps_and_adds_the_ends(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "lo')
    metrics, state = callbacks.MetricsFile(tmp_path), TrainState(step=2)  # resumed at step 2
    metrics.on_train_begin(state)
    state.step = 3
    metrics.on_step_end(state, {"step": 3, "loss": float("nan")})  # strict JSON: null
    metrics.on_train_end(state, {"val_loss": 0.5})
    metrics.close()  # closing twice is harmless
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows == [
        {"step": 1, "loss": 1.0},
        {"step": 2, "loss": 1.0},
        {"step": 3, "loss": None},
        {"step": 3, "val_loss": 0.5},
    ]


def test_records_see_every_steps_record():
    seen = []
    _steps(callbacks.Records(seen.append), TrainState(), 3)
    assert [r["step"] for r in seen] == [1, 2, 3]


def test_final_files_are_written_at_the_end():
    written = []
    final = callbacks.FinalFiles(lambda state: written.append(state.step))
    final.on_train_end(TrainState(step=7), {})
    assert written == [7]


def _adapted(seed: int = 0):
    model = Model(rwkv7_cfg(), seed=seed)
    apply_lora(model, target_paths(model, "rwkv"), rank=2, alpha=4)
    optimizer = make_optimizer(10, lr=1e-2)
    optimizer.init(model.trainable_parameters())
    return model, optimizer


def _checkpoints(out, model, optimizer, **kw):
    options = dict(
        every=2, describe=lambda state: {"steps": state.step}, settings={"seed": 0}, base="base-a"
    )
    return callbacks.Checkpoints(out, model, optimizer, **{**options, **kw})


def test_checkpoints_every_n_steps_at_the_last_and_on_a_stop(tmp_path):
    model, optimizer = _adapted()
    checkpoints, state = _checkpoints(tmp_path, model, optimizer), TrainState(total=5)
    checkpoints.on_train_begin(state)
    assert state.saved is None
    _steps(checkpoints, state, 3)
    assert newest_checkpoint(tmp_path) == 2 and state.saved == 2
    state.signal = signal.SIGTERM  # asked to stop: the step that ends now is saved
    _steps(checkpoints, state, 4)
    assert state.saved == 4 and state.kept() == "saved checkpoint_4"
    state.signal = None
    _steps(checkpoints, state, 5)  # the last step
    assert newest_checkpoint(tmp_path) == 5
    # a stop the step's callbacks had not seen (a signal during them): on_stop saves it
    state.total = 9
    _steps(checkpoints, state, 7)
    assert newest_checkpoint(tmp_path) == 6
    checkpoints.on_stop(state)
    assert newest_checkpoint(tmp_path) == 7 and state.kept() == "saved checkpoint_7"
    other_rank = TrainState(rank=1, ranks=2, step=8)
    _checkpoints(tmp_path, model, optimizer, write=False).on_stop(other_rank)
    assert newest_checkpoint(tmp_path) == 7 and other_rank.kept() == "rank 0 saved its checkpoint"


def test_checkpoints_resume_what_was_saved_and_refuse_another_run(tmp_path, capsys):
    model, optimizer = _adapted()
    state = TrainState(step=4, tokens=123, position={"epoch": 1, "batch": 2}, total=4)
    _checkpoints(tmp_path, model, optimizer).save(state)
    (tmp_path / "checkpoint_6.safetensors").write_bytes(b"cut short")  # no manifest
    fresh, fresh_optimizer = _adapted(seed=1)
    resumed = TrainState()
    _checkpoints(tmp_path, fresh, fresh_optimizer).resume(resumed)
    assert (resumed.step, resumed.tokens, resumed.position) == (4, 123, {"epoch": 1, "batch": 2})
    saved = dict(tree_flatten(model.trainable_parameters()))
    for name, x in tree_flatten(fresh.trainable_parameters()):
        assert np.array_equal(np.array(x), np.array(saved[name])), name
    assert "skipped checkpoint_6 (no manifest" in capsys.readouterr().err
    with pytest.raises(TrainError, match="another base model"):
        _checkpoints(tmp_path, fresh, fresh_optimizer, base="base-b").resume(TrainState())
    with pytest.raises(TrainError, match=r"seed 0 \(now 1\)"):
        _checkpoints(tmp_path, fresh, fresh_optimizer, settings={"seed": 1}).resume(TrainState())
    with pytest.raises(TrainError, match="no complete checkpoint"):
        _checkpoints(tmp_path / "none", fresh, fresh_optimizer).resume(TrainState())


class _Scripted:
    """A step that stands in for a model's: losses as scripted, a NonFinite on NaN; where the
    script says "window", a signal comes during the step's windows, and the loop answers that
    the step stops between two of them."""

    def __init__(self, script, state):
        self.script, self.state, self.between_windows = list(script), state, None

    def __call__(self, micro_batches, stop=False):
        what = self.script.pop(0)
        if what == "window":
            self.state.signal = signal.SIGTERM
            assert self.between_windows(1)
            raise WindowStop
        if what != what:  # NaN
            raise NonFinite(f"the loss is {what}")
        return StepResult(what, 1, 0.5, [], stop, fed=8)


def _loop(script, steps, duties, state=None):
    optimizer = type("Rate", (), {"learning_rate": mx.array(1e-3)})()
    state = TrainState() if state is None else state
    task = Task(step=lambda model, optimizer, group: _Scripted(script, state))
    return train(None, task, optimizer, [0], steps=steps, callbacks=duties, state=state)


class _SignalAt(callbacks.Callback):
    """A signal to this process at step ``at``, during the step's callbacks."""

    def __init__(self, at):
        self.at = at

    def on_step_end(self, state, record):
        if state.step == self.at:
            state.signal = signal.SIGTERM


def test_a_stop_request_ends_the_run_after_its_step_with_a_checkpoint(tmp_path):
    model, optimizer = _adapted()
    checkpoints = _checkpoints(tmp_path, model, optimizer, every=100)
    seen = []
    with pytest.raises(Interrupted) as stopped:
        _loop([1.0] * 9, 9, [callbacks.Records(seen.append), checkpoints, _SignalAt(3)])
    assert stopped.value.signum == signal.SIGTERM and stopped.value.kept == "saved checkpoint_3"
    assert [r["step"] for r in seen] == [1, 2, 3] and newest_checkpoint(tmp_path) == 3


def test_a_step_dropped_between_its_windows_keeps_the_steps_before(tmp_path):
    model, optimizer = _adapted()
    checkpoints = _checkpoints(tmp_path, model, optimizer, every=100)
    with pytest.raises(Interrupted, match="no step had finished: nothing saved"):
        _loop(["window"], 3, [checkpoints])
    assert newest_checkpoint(tmp_path) is None
    with pytest.raises(Interrupted) as stopped:
        _loop([1.0, 1.0, "window"], 3, [checkpoints])
    assert newest_checkpoint(tmp_path) == 2
    assert stopped.value.kept == (
        "saved checkpoint_2; step 3 was cut short between its windows (--resume redoes it)"
    )


def test_a_non_finite_loss_stops_with_its_step_and_what_was_kept(tmp_path):
    with pytest.raises(NonFinite, match=r"step 3: the loss is nan; stopped \(kept: no checkpoint"):
        _loop([1.0, 1.0, float("nan")], 5, [])
    model, optimizer = _adapted()
    checkpoints = _checkpoints(tmp_path, model, optimizer, every=2)
    seen = []
    with pytest.raises(NonFinite, match=r"step 3: the loss is nan; stopped \(kept: checkpoint_2\)"):
        _loop([1.0, 1.0, float("nan")], 5, [checkpoints, callbacks.Records(seen.append)])
    assert [r["step"] for r in seen] == [1, 2]  # nothing of step 3 was recorded


def test_the_loop_tells_its_callbacks_in_order_and_closes_them():
    told = []

    class Told(callbacks.Callback):
        def __init__(self, name):
            self.name = name

        def on_train_begin(self, state):
            told.append((self.name, "begin", state.step))

        def on_step_end(self, state, record):
            told.append((self.name, "step", record["step"], record.get("seen")))
            record["seen"] = self.name

        def on_train_end(self, state, final):
            told.append((self.name, "end", state.step))

        def close(self):
            told.append((self.name, "close"))

    state = _loop([3.0, 2.0], 2, [Told("a"), Told("b")])
    assert state.step == 2 and state.tokens == 2 and state.fed == 16
    assert told == [
        ("a", "begin", 0),
        ("b", "begin", 0),
        ("a", "step", 1, None),
        ("b", "step", 1, "a"),
        ("a", "step", 2, None),
        ("b", "step", 2, "a"),
        ("a", "end", 2),
        ("b", "end", 2),
        ("a", "close"),
        ("b", "close"),
    ]
