"""Which exact implementation of an op is fastest here, measured on the user's device once and
remembered.

The first call of an op for a shape class and length bucket (T rounded up to a power of two)
times every exact candidate the op names (its MLX paths; each kernel the device has that
passed its self-check) for a few milliseconds each on synthetic inputs of that shape,
after one warm-up call, and the fastest is kept: in memory and in ``tuning.json`` under the
cache folder (``$MLX_RWKVX_CACHE``, else ``$XDG_CACHE_HOME/mlx_rwkvx``, else
``~/.cache/mlx_rwkvx``), stamped with the device name, the MLX version and this package's
version, so a machine tunes once and an upgrade tunes again. A file that cannot be read or was
written for another device or version is ignored with one warning; one that cannot be written
leaves the choice in memory with one warning. Nothing is measured inside ``mx.compile``: a
traced call with no remembered choice takes the op's fixed rule, as does every call with
``MLX_RWKVX_TUNE=0``.

``choices()`` and ``use_choices()`` carry a run's choices to another process (a resumed run, a
data-parallel rank), so every one uses the same implementations.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

ENV_TUNE = "MLX_RWKVX_TUNE"
ENV_CACHE = "MLX_RWKVX_CACHE"
FILE_NAME = "tuning.json"
FORMAT = 1
# Each candidate runs until this much time has passed (after its warm-up call): enough to
# average out a timer's resolution, little enough that a first call tunes in well under a second
BUDGET_S = 0.005
MAX_RUNS = 100


def enabled() -> bool:
    """Tuning is on unless ``MLX_RWKVX_TUNE=0``."""
    return os.environ.get(ENV_TUNE, "").strip() != "0"


def cache_dir() -> Path:
    """``$MLX_RWKVX_CACHE``, else ``$XDG_CACHE_HOME/mlx_rwkvx``, else ``~/.cache/mlx_rwkvx``."""
    if os.environ.get(ENV_CACHE):
        return Path(os.environ[ENV_CACHE]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "mlx_rwkvx"


def length_bucket(n: int) -> int:
    """``n`` rounded up to a power of two: lengths that cost alike share one choice."""
    return 1 << max(n - 1, 0).bit_length()


def device_name() -> str:
    """The default device as a person would name it, e.g. ``gpu Apple M4 Max (applegpu_g16s)``
    or ``cpu AMD EPYC (x86_64)``."""
    device = mx.default_device()
    try:
        info = mx.device_info(device)
    except Exception:  # a backend without device_info: its type alone still tells cpu from gpu
        info = {}
    name = f"{device.type.name} {info.get('device_name', 'unknown')}"
    return f"{name} ({info['architecture']})" if info.get("architecture") else name


def identity() -> dict[str, str]:
    """What a tuning file must match to be used here."""
    from mlx_rwkvx import __version__

    return {"device": device_name(), "mlx": mx.__version__, "mlx_rwkvx": __version__}


@dataclass(frozen=True)
class Workload:
    """One op's call, as the tuner sees it. ``key``: what the choice is remembered under (the
    shape class and the length bucket; strings and numbers); ``candidates``: the exact MLX
    implementations that compete (the dispatcher adds each kernel that passed);
    ``make(fn)``: a function that runs implementation ``fn`` once on synthetic inputs of this
    shape (forward, or forward and backward, as the op says) and returns what to evaluate."""

    key: tuple
    candidates: tuple[str, ...]
    make: Callable[[Callable], Callable[[], object]]


def forward_backward(fn: Callable, args: Sequence[mx.array]) -> Callable[[], object]:
    """A function running ``fn(*args)`` and its gradient w.r.t. every argument: what one
    training step asks of an op."""

    def loss(*xs):
        out = fn(*xs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return sum(y.astype(mx.float32).sum() for y in outs)

    grad = mx.grad(loss, argnums=list(range(len(args))))
    return lambda: grad(*args)


def evaluate(thunk: Callable[[], object]) -> None:
    """The default runner: run one call and wait for its results."""
    mx.eval(thunk())


def dtype_name(dtype: mx.Dtype) -> str:
    """``float32`` for ``mx.float32``: a dtype as a tuning file spells it."""
    return str(dtype).rsplit(".", 1)[-1]


def entry_name(op: str, key: tuple) -> str:
    """A workload's name in the table and the file, e.g. ``wkv7 N=64 float32 T<=1024``."""
    return " ".join([op, *(str(part) for part in key)])


class Tuner:
    """The measurements and the memory of them. ``path`` (default: ``tuning.json`` in
    ``cache_dir()``, read when first needed), ``clock`` and ``runner`` (how one call is run and
    waited for) may be replaced: the tests time a fake device with a fake clock."""

    def __init__(
        self,
        path: Path | None = None,
        *,
        clock: Callable[[], float] = time.perf_counter,
        runner: Callable[[Callable[[], object]], None] = evaluate,
        budget_s: float = BUDGET_S,
    ):
        self._path, self.clock, self.runner, self.budget_s = path, clock, runner, budget_s
        self.table: dict[str, str] = {}  # entry name -> implementation
        self.timings: dict[str, dict[str, float]] = {}  # entry name -> seconds per call
        self.pinned: dict[str, str] = {}  # use_choices(): another process's, never measured
        self.measured = 0  # workloads measured in this process
        self._loaded = self._warned_write = False
        self._lock = threading.Lock()

    @property
    def path(self) -> Path:
        return self._path if self._path is not None else cache_dir() / FILE_NAME

    def choose(
        self,
        op: str,
        workload: Workload,
        impls: dict[str, Callable],
        extra: Sequence[str],
        traced: Callable[[], bool],
        rule: str,
    ) -> str:
        """The implementation for one call: ``rule`` (the op's fixed choice) when tuning is
        off, else the pinned or remembered choice (remembered: measured against every
        candidate there is now), else (outside a trace) the fastest of the workload's
        candidates and ``extra`` (the kernels that passed), measured now."""
        if not enabled():
            return rule
        candidates = [*workload.candidates, *(n for n in extra if n not in workload.candidates)]
        if len(candidates) == 1:  # nothing to choose between
            return candidates[0]
        name = entry_name(op, workload.key)
        with self._lock:
            self._load()
            if self.pinned.get(name) in candidates:  # a kernel that failed here is no choice
                return self.pinned[name]
            remembered = self.table.get(name) if self.table.get(name) in candidates else None
            # a choice made before a candidate existed here (a kernel new in this version) is
            # measured again, with the newcomer; until then (in a trace) it still stands
            measured = self.timings.get(name) or candidates
            if remembered is not None and set(candidates) <= set(measured):
                return remembered
            if traced():
                return remembered or rule
            timings = self.measure({c: workload.make(impls[c]) for c in candidates})
            best = min(timings, key=timings.__getitem__)
            self.table[name], self.timings[name] = best, timings
            self.measured += 1
            self._save()
            return best

    def measure(self, thunks: dict[str, Callable[[], object]]) -> dict[str, float]:
        """Seconds per call of each: one warm-up call (builds, caches), then calls until
        ``budget_s`` has passed (at most MAX_RUNS)."""
        timings = {}
        for name, thunk in thunks.items():
            self.runner(thunk)
            runs, start = 0, self.clock()
            while True:
                self.runner(thunk)
                runs += 1
                elapsed = self.clock() - start
                if elapsed >= self.budget_s or runs >= MAX_RUNS:
                    break
            timings[name] = elapsed / runs
        return timings

    def choices(self) -> dict[str, str]:
        """Every choice this process uses (entry name -> implementation): what a checkpoint
        records."""
        with self._lock:
            return {**self.table, **self.pinned}

    def use_choices(self, choices: dict[str, str]) -> None:
        """Use these choices (``choices()`` of another process) wherever they name a candidate
        available here; they are not written to the tuning file."""
        with self._lock:
            self.pinned.update({str(k): str(v) for k, v in choices.items()})

    def entries(self) -> list[tuple[str, str, dict[str, float]]]:
        """``(entry name, implementation, seconds per call of each candidate)`` of every choice
        known here (the file's, this process's; a pinned one has no timings), sorted by name:
        what ``info --selfcheck`` prints."""
        with self._lock:
            self._load()
            chosen = {**self.table, **self.pinned}
            return [
                (name, chosen[name], dict(self.timings.get(name, {}))) for name in sorted(chosen)
            ]

    def _read(self) -> tuple[dict[str, str], dict[str, dict[str, float]]] | None:
        """The file's choices and timings if it is this device's and versions', else None (one
        warning when it exists but is unreadable or foreign)."""
        path = self.path
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (FileNotFoundError, NotADirectoryError):  # nothing measured yet
            return None
        except (OSError, ValueError) as e:
            warnings.warn(
                f"mlx_rwkvx: ignoring the tuning file {path} ({e}); measuring again",
                RuntimeWarning,
                stacklevel=2,
            )
            return None
        mine = identity()
        table = data.get("choices") if isinstance(data, dict) else None
        if not isinstance(table, dict) or data.get("format") != FORMAT:
            reason = "not a tuning file of this format"
        elif any(data.get(k) != v for k, v in mine.items()):
            theirs = ", ".join(f"{k} {data.get(k)!r}" for k in mine)
            here = ", ".join(f"{k} {v!r}" for k, v in mine.items())
            reason = f"written for {theirs}; this is {here}"
        else:
            timings = data.get("seconds_per_call")
            timings = {
                str(name): {str(c): float(t) for c, t in per.items() if isinstance(t, (int, float))}
                for name, per in (timings.items() if isinstance(timings, dict) else ())
                if isinstance(per, dict)
            }
            return {str(k): str(v) for k, v in table.items()}, timings
        warnings.warn(
            f"mlx_rwkvx: ignoring the tuning file {path} ({reason}); measuring again",
            RuntimeWarning,
            stacklevel=2,
        )
        return None

    def _load(self) -> None:
        if not self._loaded:
            self._loaded = True
            table, timings = self._read() or ({}, {})
            for name, impl in table.items():
                self.table.setdefault(name, impl)
                if name in timings:  # kept when the file is written again
                    self.timings.setdefault(name, timings[name])

    def _save(self) -> None:
        """Write the table atomically (a temporary file, then a rename), so a reader never
        sees half a file; an unwritable folder keeps the choices in memory, with one
        warning."""
        path = self.path
        data = {"format": FORMAT, **identity(), "choices": self.table}
        data["seconds_per_call"] = self.timings
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tuning.", suffix=".tmp", dir=path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(tmp, path)
            except BaseException:
                os.unlink(tmp)
                raise
        except OSError as e:
            if not self._warned_write:
                self._warned_write = True
                warnings.warn(
                    f"mlx_rwkvx: cannot write the tuning file {path} ({e}); the choices "
                    "are kept for this process only",
                    RuntimeWarning,
                    stacklevel=2,
                )


TUNER = Tuner()


def choices() -> dict[str, str]:
    """This process's choices, entry name -> implementation (``Tuner.choices``)."""
    return TUNER.choices()


def use_choices(recorded: dict[str, str]) -> None:
    """Use another process's choices (``Tuner.use_choices``)."""
    TUNER.use_choices(recorded)
