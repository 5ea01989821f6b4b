"""What a training run does beside stepping, a duty a callback: the loop (``trainer.train``)
tells each of the start, every step (its record), a stop request and the end, in the order
given. ``StopRequests`` (Ctrl-C and SIGTERM: the step finishes, then the run stops),
``Progress`` (the bar and a log line every N steps), ``Validation`` (every N steps and at the
end), ``TestLoss`` (at the end), ``MetricsFile`` (``metrics.jsonl``), ``Records`` (a function
given every step's record), ``Checkpoints`` (every N steps, at the last, on a stop; resuming),
``FinalFiles`` (the run's result). ``tuner/from_config.py`` puts them together for a run."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mlx_rwkvx.errors import EXIT_CODES, TrainError
from mlx_rwkvx.tuner import outputs
from mlx_rwkvx.tuner.checkpoints import (
    load_checkpoint,
    newest_checkpoint,
    save_checkpoint,
    scan_checkpoints,
)
from mlx_rwkvx.tuner.steps import TrainState

import mlx.core as mx
from tqdm import tqdm


class Callback:
    """The hooks of the loop, each a no-op here; ``close`` comes last, whatever happened."""

    def on_train_begin(self, state: TrainState) -> None:
        """Before the first step (of this process: a resumed state has made some)."""

    def on_step_end(self, state: TrainState, record: dict) -> None:
        """After each step; ``record`` (step, loss, grad_norm, lr, tokens, ...) may be added to:
        the callbacks after this one see what it added."""

    def on_stop(self, state: TrainState) -> None:
        """The run stops on a request (``state.signal`` or another rank's), after its last
        step, or between two windows of a step that is dropped."""

    def on_train_end(self, state: TrainState, final: dict) -> None:
        """After the last step; ``final``: the end's metrics, which this one may add to."""

    def close(self) -> None:
        """At the end, or when the run stopped or failed: let go of what it holds."""


class StopRequests(Callback):
    """Ctrl-C or SIGTERM during the steps sets ``state.signal``: the loop finishes the step (or
    drops a --carry-state step between two of its windows), tells the callbacks (a checkpoint
    is saved) and raises ``Interrupted``. A second signal stops at once (Ctrl-C's
    KeyboardInterrupt, or whatever SIGTERM did before): the handlers go back at the first one,
    and at the end of the steps (the final evaluation and files stop at once). Signals are only
    caught in the main thread."""

    def __init__(self, signals=tuple(EXIT_CODES)):
        self.signals, self._old, self._state = signals, {}, None

    def on_train_begin(self, state: TrainState) -> None:
        self._state = state
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.signals}

    def _handle(self, signum, frame) -> None:
        self._state.signal = signum
        self.close()

    def on_train_end(self, state: TrainState, final: dict) -> None:
        self.close()

    def close(self) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old = {}


class Progress(Callback):
    """A progress bar and, every ``every`` steps and at the last, a line with the loss, the
    rate, tokens per second and peak memory (the step's record gets the last two too).
    ``show=False`` (a rank other than 0): none of it."""

    def __init__(self, every: int, show: bool = True):
        self.every, self.show, self._bar = every, show, None

    def on_train_begin(self, state: TrainState) -> None:
        self._bar = tqdm(
            total=state.total,
            initial=state.step,
            unit="step",
            dynamic_ncols=True,
            leave=False,
            disable=not self.show,
        )
        self._started, self._fed = time.perf_counter(), state.fed

    def on_step_end(self, state: TrainState, record: dict) -> None:
        self._bar.update(1)
        if not self.show or (state.step % self.every and state.step != state.total):
            return
        seconds = max(time.perf_counter() - self._started, 1e-9)
        record["tokens_per_s"] = (state.fed - self._fed) / seconds
        record["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        self._bar.write(
            f"step {state.step}/{state.total}: loss {record['loss']:.4f}, lr "
            f"{record['lr']:.2e}, {record['tokens_per_s']:.0f} tok/s, peak "
            f"{record['peak_memory_gb']:.2f} GB"
        )

    def on_train_end(self, state: TrainState, final: dict) -> None:
        self.close()

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


class Validation(Callback):
    """``validate(max_batches)`` (metrics by name, ``val_loss`` among them) every ``every``
    steps (0: at the end only) and at the end, where the last step's, taken then, is not taken
    again."""

    def __init__(
        self, validate: Callable[[int | None], dict], every: int = 0, max_batches: int | None = None
    ):
        self.validate, self.every, self.max_batches = validate, every, max_batches
        self.last: tuple[int, dict] | None = None  # (step, its metrics)

    def on_step_end(self, state: TrainState, record: dict) -> None:
        if self.every and state.step % self.every == 0:
            metrics = self.validate(self.max_batches)
            record.update(metrics)
            self.last = (state.step, metrics)
            tqdm.write(f"step {state.step}: validation loss {metrics['val_loss']:.4f}")

    def on_train_end(self, state: TrainState, final: dict) -> None:
        if self.last is not None and self.last[0] == state.step:
            final.update(self.last[1])  # taken (and shown) at the last step
            return
        metrics = self.validate(self.max_batches)
        final.update(metrics)
        print(f"validation loss {metrics['val_loss']:.4f}")


class TestLoss(Callback):
    """``evaluate()`` (metrics by name, ``test_loss`` among them) at the end."""

    __test__ = False  # not a pytest class

    def __init__(self, evaluate: Callable[[], dict]):
        self.evaluate = evaluate

    def on_train_end(self, state: TrainState, final: dict) -> None:
        metrics = self.evaluate()
        final.update(metrics)
        print(f"test loss {metrics['test_loss']:.4f}")


class MetricsFile(Callback):
    """``metrics.jsonl`` in ``out``: a line per step and one of the end's metrics. A resumed
    run first drops the lines of the steps after its checkpoint (the interruption lost them)."""

    def __init__(self, out: Path):
        self.out, self._metrics = Path(out), None

    def on_train_begin(self, state: TrainState) -> None:
        outputs.keep_metrics(self.out / outputs.METRICS, state.step)
        self._metrics = outputs.Metrics(self.out, write=True)

    def on_step_end(self, state: TrainState, record: dict) -> None:
        self._metrics.add(record)

    def on_train_end(self, state: TrainState, final: dict) -> None:
        if final:
            self._metrics.add({"step": state.step, **final})
        self.close()

    def close(self) -> None:
        if self._metrics is not None:
            self._metrics.close()
            self._metrics = None


class Records(Callback):
    """``see(record)`` after every step (what ``metrics.jsonl`` gets for it, when the callbacks
    that add to it come first)."""

    def __init__(self, see: Callable[[dict], None]):
        self.see = see

    def on_step_end(self, state: TrainState, record: dict) -> None:
        self.see(record)


class Checkpoints(Callback):
    """Checkpoints in ``out`` (``tuner/checkpoints.py``) every ``every`` steps, at the last step
    and when the run stops on a request (after its step, or, when a step is dropped between
    its windows, of the steps before it); ``state.saved`` follows them. ``describe(state)``:
    the adapter config a checkpoint holds; ``settings``: the run's (saved, and compared by
    ``resume``); ``base``: the base's fingerprint; ``full``: all the trainable weights are
    saved, else the adapter. ``write=False`` (a rank other than 0): rank 0 writes them."""

    def __init__(
        self,
        out: Path,
        model,
        optimizer,
        *,
        every: int,
        describe: Callable[[TrainState], dict],
        settings: dict,
        base: str,
        full: bool = False,
        write: bool = True,
    ):
        self.out, self.model, self.optimizer, self.every = Path(out), model, optimizer, every
        self.describe, self.settings, self.base = describe, settings, base
        self.full, self.write = full, write

    def resume(self, state: TrainState) -> None:
        """``state``, the model and the optimizer from the newest complete checkpoint (the
        newer ones cut short are said and skipped): TrainError when there is none, or it does
        not fit this run."""
        step, broken = scan_checkpoints(self.out)
        if step is None:
            raise TrainError(f"--output {self.out}: no complete checkpoint to resume from")
        for newer, why in broken.items():
            print(
                f"--resume: skipped checkpoint_{newer} ({why}); resuming from checkpoint_{step}",
                file=sys.stderr,
            )
        load_checkpoint(
            self.out,
            step,
            state,
            self.model,
            self.optimizer,
            settings=self.settings,
            base=self.base,
            full=self.full,
        )

    def save(self, state: TrainState) -> None:
        if self.write:
            save_checkpoint(
                self.out,
                state,
                self.model,
                self.optimizer,
                config=self.describe(state),
                settings=self.settings,
                base=self.base,
                full=self.full,
            )
        state.saved = state.step

    def on_train_begin(self, state: TrainState) -> None:
        state.saved = newest_checkpoint(self.out)

    def on_step_end(self, state: TrainState, record: dict) -> None:
        if state.step % self.every == 0 or state.step == state.total or state.stopping:
            self.save(state)

    def on_stop(self, state: TrainState) -> None:
        if state.step and state.saved != state.step:
            self.save(state)


class FinalFiles(Callback):
    """``write(state)`` at the end: the run's result (``outputs.write_final``, ``loss.png``)."""

    def __init__(self, write: Callable[[TrainState], None]):
        self.write = write

    def on_train_end(self, state: TrainState, final: dict) -> None:
        self.write(state)
