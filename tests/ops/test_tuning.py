"""The dispatcher's measured choice (ops/tuning.py), on a fake device: implementations of known
cost, each call advancing a fake clock by its cost, so nothing here depends on the machine's
speed or load."""

import importlib
import itertools
import json
import warnings

from mlx_rwkvx.ops import dispatch, tuning
from mlx_rwkvx.ops.dispatch import KERNEL, Dispatcher

import mlx.core as mx
import pytest

W = importlib.import_module("mlx_rwkvx.ops.wkv7")
M = importlib.import_module("mlx_rwkvx.ops.moba")
COST = {"slow": 3e-3, "fast": 1e-3, KERNEL: 0.5e-3}
KEY = (64, mx.float32)
ENV_VAR = "MLX_RWKVX_FAKE_OP"


class FakeDevice:
    """A clock and implementations whose every call advances it by their cost."""

    def __init__(self):
        self.now, self.calls = 0.0, []

    def clock(self) -> float:
        return self.now

    def impl(self, name):
        def run(*_):
            self.calls.append(name)
            self.now += COST[name]

        return run


@pytest.fixture
def tune_on(monkeypatch, tmp_path):
    monkeypatch.setenv(tuning.ENV_TUNE, "1")
    monkeypatch.setenv(tuning.ENV_CACHE, str(tmp_path))
    monkeypatch.delenv(ENV_VAR, raising=False)
    # a fake op's dispatcher registers itself: keep it out of the real registry (prepare())
    monkeypatch.setattr(dispatch, "DISPATCHERS", dict(dispatch.DISPATCHERS))
    return tmp_path / tuning.FILE_NAME


def fake_op(device, path, *, kernel=None):
    """A dispatcher for an op with a slow and a fast exact path (and ``kernel``: whether its
    self-check passes, None for no kernel); its rule picks the slow one."""
    names = ["slow", "fast"] + ([KERNEL] if kernel is not None else [])

    def workload(key, T):
        bucket = tuning.length_bucket(T)
        return tuning.Workload((f"N={key[0]}", f"T<={bucket}"), ("slow", "fast"), lambda fn: fn)

    tuner = tuning.Tuner(path, clock=device.clock, runner=lambda thunk: thunk())
    impls = {name: device.impl(name) for name in names}

    def self_check(key, impl):  # the self-check's outputs, without running (or timing) it
        failing = impl is impls.get(KERNEL) and not kernel
        return {"out": mx.array([float("nan") if failing else 0.0])}

    return Dispatcher(
        "fake",
        impls,
        env_var=ENV_VAR,
        fallback="slow",
        kernel_names=(KERNEL,),
        kernels=lambda key=None: (KERNEL,) if kernel is not None else (),
        self_check=self_check,
        workload=workload,
        tuner=tuner,
    )


def pick(op, T=100, impl=None, probe=None):
    return op.pick(impl, KEY, mx.zeros(1) if probe is None else probe, "slow", shape=T)


def test_the_cheaper_implementation_is_picked_and_remembered(tune_on):
    device = FakeDevice()
    op = fake_op(device, tune_on)
    assert pick(op) == "fast"
    measured = len(device.calls)
    assert set(device.calls) == {"slow", "fast"} and op.tuner.measured == 1
    assert op.tuner.timings["fake N=64 T<=128"] == pytest.approx(
        {"slow": COST["slow"], "fast": COST["fast"]}
    )
    assert pick(op, T=65) == "fast"  # the same bucket: remembered, not measured again
    assert len(device.calls) == measured


def test_each_length_bucket_is_measured_on_its_own(tune_on):
    device = FakeDevice()
    op = fake_op(device, tune_on)
    for T in (100, 128, 129, 256, 1):
        pick(op, T=T)
    assert op.tuner.measured == 3
    assert sorted(op.tuner.table) == ["fake N=64 T<=1", "fake N=64 T<=128", "fake N=64 T<=256"]


@pytest.mark.parametrize("passes", [True, False])
def test_a_kernel_competes_only_when_it_passed(tune_on, passes):
    device = FakeDevice()
    op = fake_op(device, tune_on, kernel=passes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the failing kernel's one warning
        assert pick(op) == (KERNEL if passes else "fast")
    assert (KERNEL in device.calls) == passes


def test_the_file_round_trips(tune_on):
    op = fake_op(FakeDevice(), tune_on)
    pick(op)
    saved = json.loads(tune_on.read_text())
    assert saved["choices"] == {"fake N=64 T<=128": "fast"}
    assert saved["device"] == tuning.device_name() and saved["mlx"] == mx.__version__

    # a new process: the choice comes from the file, nothing is run
    device = FakeDevice()
    again = fake_op(device, tune_on)
    assert pick(again) == "fast"
    assert device.calls == [] and again.tuner.measured == 0
    # its timings come along (info --selfcheck prints them) and survive the next write
    timings = op.tuner.timings["fake N=64 T<=128"]
    assert again.tuner.entries() == [("fake N=64 T<=128", "fast", timings)]
    pick(again, T=1000)
    assert json.loads(tune_on.read_text())["seconds_per_call"]["fake N=64 T<=128"] == timings


def _only_warning(record, match):
    runtime = [w for w in record if issubclass(w.category, RuntimeWarning)]
    assert len(runtime) == 1 and match in str(runtime[0].message), [str(w.message) for w in runtime]


@pytest.mark.parametrize(
    "content",
    ["{not json", "[1, 2]", json.dumps({"format": 1, "choices": "fast"}), "\x00\xff"],
)
def test_a_corrupt_file_is_ignored_with_one_warning(tune_on, content):
    tune_on.write_text(content)
    device = FakeDevice()
    op = fake_op(device, tune_on)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert pick(op) == "fast"
        assert pick(op, T=1000) == "fast"  # read once: no second warning
    _only_warning(record, "ignoring the tuning file")
    assert op.tuner.measured == 2
    assert json.loads(tune_on.read_text())["choices"]["fake N=64 T<=128"] == "fast"


@pytest.mark.parametrize("field", ["device", "mlx", "mlx_rwkvx"])
def test_a_foreign_file_is_ignored_with_one_warning(tune_on, field):
    theirs = {"format": tuning.FORMAT, **tuning.identity(), "choices": {"fake N=64 T<=128": "slow"}}
    theirs[field] = "another " + theirs[field]
    tune_on.write_text(json.dumps(theirs))
    device = FakeDevice()
    op = fake_op(device, tune_on)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert pick(op) == "fast"  # measured here, not the other machine's "slow"
    _only_warning(record, "written for")
    assert op.tuner.measured == 1
    assert json.loads(tune_on.read_text())[field] == tuning.identity()[field]


def test_an_unwritable_cache_keeps_the_choice_in_memory(tune_on, tmp_path):
    (tmp_path / "a file").write_text("")
    op = fake_op(FakeDevice(), tmp_path / "a file" / tuning.FILE_NAME)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        assert pick(op) == "fast" and pick(op, T=1000) == "fast"
    _only_warning(record, "cannot write the tuning file")


def test_tune_off_is_the_fixed_rule(tune_on, monkeypatch):
    monkeypatch.setenv(tuning.ENV_TUNE, "0")
    device = FakeDevice()
    op = fake_op(device, tune_on)
    assert pick(op) == "slow"
    assert device.calls == [] and not tune_on.exists()


def test_a_forced_implementation_wins(tune_on, monkeypatch):
    device = FakeDevice()
    op = fake_op(device, tune_on)
    assert pick(op, impl="slow") == "slow"
    monkeypatch.setenv(ENV_VAR, "slow")
    assert pick(op) == "slow"
    assert device.calls == [] and op.tuner.measured == 0


def test_a_traced_call_neither_measures_nor_fails(tune_on):
    device = FakeDevice()
    op = fake_op(device, tune_on)
    chosen = []

    def traced(x):
        chosen.append(pick(op, probe=x))
        return x * 2

    mx.eval(mx.compile(traced)(mx.ones(3)))
    assert chosen == ["slow"] and device.calls == [] and op.tuner.measured == 0
    pick(op)  # measured outside the trace; a new trace then takes the remembered choice
    mx.eval(mx.compile(lambda x: traced(x) + 1)(mx.ones(3)))
    assert chosen == ["slow", "fast"]


def test_recorded_choices_are_used_without_measuring(tune_on):
    first = fake_op(FakeDevice(), tune_on)
    pick(first)
    recorded = first.tuner.choices()
    assert recorded == {"fake N=64 T<=128": "fast"}

    device = FakeDevice()  # another rank: its own file says otherwise
    other = fake_op(device, tune_on.with_name("other.json"))
    other.tuner.table["fake N=64 T<=128"] = "slow"
    other.tuner.use_choices({**recorded, "fake N=64 T<=256": KERNEL})
    assert pick(other) == "fast" and device.calls == []
    assert pick(other, T=200) == "fast"  # the recorded kernel is not here: measured
    assert other.tuner.measured == 1


def _counting_tuner():
    # one run per candidate after its warm-up: the real runner, a clock that only counts
    return tuning.Tuner(clock=itertools.count().__next__)


def test_wkv7_measures_its_candidates(tune_on, monkeypatch):
    monkeypatch.setattr(W.DISPATCH, "tuner", _counting_tuner())
    monkeypatch.setattr(W.DISPATCH, "kernels", lambda key=None: ())
    monkeypatch.delenv(W.ENV_VAR, raising=False)
    shape, keys = (1, 12, 2, 16), mx.random.split(mx.random.key(0), 4)
    args = [mx.random.uniform(-0.3, 0.3, shape, key=keys[i]) for i in range(3)] * 2
    args[1] = mx.log(mx.random.uniform(0.5, 0.99, shape, key=keys[3]))
    args.append(mx.zeros((1, 2, 16, 16)))
    y = mx.compile(lambda *xs: W.wkv7(*xs)[0])(*args)  # traced, nothing remembered: the rule
    assert W.DISPATCH.tuner.measured == 0
    y, _ = W.wkv7(*args)
    timings = W.DISPATCH.tuner.timings["wkv7 N=16 float32 T<=16"]
    assert set(timings) == {"ref", "chunked"}
    best = min(timings, key=timings.__getitem__)
    assert mx.array_equal(y, W.DISPATCH.impls[best](*args)[0])
    assert json.loads(tune_on.read_text())["choices"] == {"wkv7 N=16 float32 T<=16": best}


def test_moba_measures_its_candidates(tune_on, monkeypatch):
    monkeypatch.setattr(M.DISPATCH, "tuner", _counting_tuner())
    monkeypatch.setattr(M.DISPATCH, "kernels", lambda key=None: ())
    monkeypatch.delenv(M.ENV_VAR, raising=False)
    q = mx.random.normal((1, 20, 4, 16), key=mx.random.key(0))
    k, v = (mx.random.normal((1, 20, 2, 16), key=mx.random.key(i)) for i in (1, 2))
    M.moba_attention(q, k, v, chunk_size=8, top_k=1)
    entry = "moba D=16 float32 chunk=8 top_k=1 T<=32 S<=32"
    assert set(M.DISPATCH.tuner.timings[entry]) == {"ref", "blockwise"}


def test_a_choice_made_before_a_kernel_existed_is_measured_again(tune_on):
    # a device that tuned before this version's kernels: its file names the fastest of the MLX
    # paths; the kernel, new here, is timed beside them once, then remembered
    pick(fake_op(FakeDevice(), tune_on))
    device = FakeDevice()
    op = fake_op(device, tune_on, kernel=True)
    assert op.kernel_passes(KEY)
    chosen = []

    def traced(x):
        chosen.append(pick(op, probe=x))
        return x

    mx.eval(mx.compile(traced)(mx.ones(3)))
    assert chosen == ["fast"] and device.calls == []  # in a trace the old choice stands
    assert pick(op) == KERNEL and set(device.calls) == {"slow", "fast", KERNEL}
    assert set(json.loads(tune_on.read_text())["seconds_per_call"]["fake N=64 T<=128"]) == {
        "slow",
        "fast",
        KERNEL,
    }
    calls = len(device.calls)
    assert pick(op) == KERNEL and len(device.calls) == calls
