"""Fault injection into the kernels' self-checks: a kernel that raises at build, one that raises
only in its backward, one that returns NaN and one that returns wrong values. Each time
``wkv7``, ``moba_attention`` and a LoRA training step finish with the results of a run without
the kernel, and one warning names the kernel and the reason. This CPU has no kernels: each test
makes the dispatcher believe it has one (its ``kernels`` and ``impls[KERNEL]``)."""

from __future__ import annotations

import importlib
import re
import warnings

from mlx_rwkvx import info
from mlx_rwkvx.adapters.lora import apply_lora
from mlx_rwkvx.adapters.targets import target_paths
from mlx_rwkvx.models import Model, preset
from mlx_rwkvx.ops import mlx_kernels
from mlx_rwkvx.ops.dispatch import KERNEL

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import pytest
from mlx.utils import tree_flatten

W = importlib.import_module("mlx_rwkvx.ops.wkv7")
M = importlib.import_module("mlx_rwkvx.ops.moba")
DISPATCH = {"wkv7": W.DISPATCH, "moba": M.DISPATCH}
ARRAY_ARGS = {"wkv7": 7, "moba": 3}  # the leading arguments of an implementation that are arrays
FAULTS = ["build", "backward", "nan", "wrong"]
# What a Metal compiler says: long, and only its head belongs in a warning
COMPILER_MESSAGE = "\n".join(
    ["metal::Compiler: Unable to build metal library from source"]
    + [f"program_source:{12 + i}:5: error: use of undeclared identifier 'x{i}'" for i in range(9)]
)
REASONS = {
    "build": "raised RuntimeError: metal::Compiler: Unable to build",
    "backward": "raised RuntimeError: .*threadgroup memory",
    "nan": "returned non-finite values in",
    "wrong": "disagrees with the .* path: relative error",
}


def faulty_kernel(fault: str, exact, n_arrays: int):
    """A stand-in kernel with ``fault``, otherwise ``exact``."""

    def kernel(*args, **kwargs):
        if fault == "build":  # MLX builds a kernel when it is first evaluated: it raises there
            raise RuntimeError(COMPILER_MESSAGE)
        arrays, rest = args[:n_arrays], args[n_arrays:]
        if fault == "backward":
            forward = mx.custom_function(lambda *xs: exact(*xs, *rest, **kwargs))

            @forward.vjp
            def backward(primals, cotangents, outputs):
                raise RuntimeError("[metal::Device] threadgroup memory 40960 exceeds 32768")

            return forward(*arrays)
        scale = float("nan") if fault == "nan" else 1.01
        out = exact(*args, **kwargs)
        return (out[0] * scale, *out[1:]) if isinstance(out, tuple) else out * scale

    return kernel


@pytest.fixture
def no_kernel(monkeypatch):
    """The dispatchers as on this CPU (no kernel; no implementation forced)."""
    for dispatcher in DISPATCH.values():
        monkeypatch.delenv(dispatcher.env_var, raising=False)
        monkeypatch.setattr(dispatcher, "kernels", lambda key=None: ())


def inject(monkeypatch, op: str, fault: str) -> None:
    """``op``'s dispatcher as on a device whose kernel has ``fault``, nothing checked yet."""
    dispatcher = DISPATCH[op]
    kernel = faulty_kernel(fault, dispatcher.impls[dispatcher.fallback], ARRAY_ARGS[op])
    monkeypatch.setattr(dispatcher, "kernels", lambda key=None: (KERNEL,))
    monkeypatch.setattr(dispatcher, "impls", {**dispatcher.impls, KERNEL: kernel})
    monkeypatch.setattr(dispatcher, "results", {})
    monkeypatch.setattr(dispatcher, "reasons", {})


def ours(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("mlx_rwkvx:")]


def run_twice(fn):
    """``fn()``'s result, and the warnings of two calls (the verdict is remembered)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        out = fn()
        mx.eval(out)
        fn()
    return out, ours(record)


def check_warning(messages: list[str], op: str, fault: str) -> None:
    assert len(messages) == 1, messages
    (message,) = messages
    fallback = DISPATCH[op].fallback
    assert message.startswith(f"mlx_rwkvx: the {op} kernel for size ")
    assert f"the {fallback} path is used instead: " in message
    assert re.search(REASONS[fault], message), message
    if fault == "build":  # the compiler's first five lines, and how many more there were
        assert "'x3'" in message and "'x4'" not in message and "(5 more lines)" in message


def wkv7_inputs(T: int = 12, H: int = 2, N: int = 16) -> list[mx.array]:
    keys = mx.random.split(mx.random.key(1), 7)
    shape = (1, T, H, N)
    r, k, v = (mx.random.uniform(-0.5, 0.5, shape, key=keys[i]) for i in range(3))
    kk = mx.random.normal(shape, key=keys[3])
    kk = kk / mx.linalg.norm(kk, axis=-1, keepdims=True)
    log_w = mx.log(mx.random.uniform(0.5, 0.999, shape, key=keys[4]))
    b = kk * mx.random.uniform(shape=shape, key=keys[5])
    return [r, log_w, k, v, -kk, b, mx.random.uniform(-0.5, 0.5, (1, H, N, N), key=keys[6])]


def moba_inputs(T: int = 20) -> list[mx.array]:
    keys = mx.random.split(mx.random.key(2), 3)
    q = mx.random.normal((1, T, 4, 16), key=keys[0])
    return [q, *(mx.random.normal((1, T, 2, 16), key=key) for key in keys[1:])]


CALLS = {
    "wkv7": lambda: W.wkv7(*wkv7_inputs()),
    "moba": lambda: M.moba_attention(*moba_inputs(), chunk_size=4, top_k=2),
}


def flat(out) -> list[mx.array]:
    return list(out) if isinstance(out, tuple) else [out]


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", ["wkv7", "moba"])
def test_op_falls_back_with_one_warning(monkeypatch, no_kernel, op, fault):
    expected = CALLS[op]()
    inject(monkeypatch, op, fault)
    out, messages = run_twice(CALLS[op])
    assert all(mx.array_equal(x, y) for x, y in zip(flat(out), flat(expected), strict=True))
    check_warning(messages, op, fault)
    key = next(iter(DISPATCH[op].results))
    assert DISPATCH[op].results == {key: False} and list(DISPATCH[op].reasons) == [key]


def lora_step() -> tuple[mx.array, list]:
    """One LoRA training step of the rwkv-x-tiny preset (RWKV-7 and MoBA blocks): the loss and
    the trained parameters after it."""
    mx.random.seed(0)
    model = Model(preset("rwkv-x-tiny"), seed=0)
    apply_lora(model, target_paths(model, "attn"), rank=4, alpha=8.0)
    tokens = mx.random.randint(0, 256, (2, 17), key=mx.random.key(3))

    def loss_fn(model):
        logits = model(tokens[:, :-1])
        return nn.losses.cross_entropy(logits, tokens[:, 1:], reduction="mean")

    loss, grads = nn.value_and_grad(model, loss_fn)(model)
    optim.Adam(learning_rate=1e-2).update(model, grads)
    trained = tree_flatten(model.trainable_parameters())
    mx.eval(loss, trained)
    return loss, trained


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("op", ["wkv7", "moba"])
def test_lora_step_falls_back_with_one_warning(monkeypatch, no_kernel, op, fault):
    expected_loss, expected = lora_step()
    inject(monkeypatch, op, fault)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        loss, trained = lora_step()
    assert mx.array_equal(loss, expected_loss)
    assert [n for n, _ in trained] == [n for n, _ in expected]
    assert all(mx.array_equal(x, y) for (_, x), (_, y) in zip(trained, expected, strict=True))
    check_warning(ours(record), op, fault)


@pytest.mark.parametrize("op", ["wkv7", "moba"])
def test_a_forced_kernel_that_fails_raises(monkeypatch, no_kernel, op):
    # impl="kernel" is the user's explicit choice: unchecked, its failure is theirs to see
    inject(monkeypatch, op, "build")
    args = wkv7_inputs() if op == "wkv7" else moba_inputs()
    kwargs = {} if op == "wkv7" else dict(chunk_size=4, top_k=2)
    call = W.wkv7 if op == "wkv7" else M.moba_attention
    with pytest.raises(RuntimeError, match="metal::Compiler"):
        call(*args, **kwargs, impl=KERNEL)
    assert DISPATCH[op].results == {}


def test_info_selfcheck_lists_passed_failed_and_why(monkeypatch):
    # a WKV7 kernel that fails to build, a MoBA kernel that is right except in head dim 128,
    # where it returns NaN, and none for head dim 16
    monkeypatch.setattr(mlx_kernels, "kernel_backend", lambda: "metal")
    inject(monkeypatch, "wkv7", "build")
    inject(monkeypatch, "moba", "nan")
    nan_kernel, blockwise = M.DISPATCH.impls[KERNEL], M.DISPATCH.impls["blockwise"]

    def moba_kernel(q, *rest, **kwargs):
        return (nan_kernel if q.shape[-1] == 128 else blockwise)(q, *rest, **kwargs)

    monkeypatch.setattr(M.DISPATCH, "impls", {**M.DISPATCH.impls, KERNEL: moba_kernel})
    monkeypatch.setattr(
        M.DISPATCH, "kernels", lambda key=None: (KERNEL,) if key is None or key[0] > 16 else ()
    )
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        lines = info.selfcheck()
    assert len(ours(record)) == 8 + 2  # per shape class that failed: WKV7's 8, MoBA's 128 in 2
    assert lines[0].startswith("kernels    metal on ")
    text = "\n".join(lines)
    assert "kernels    moba size 16 float32: not available on this device" in lines
    assert "kernels    moba size 32 bfloat16: passed" in lines
    assert (
        "kernels    moba size 128 float32: FAILED, the blockwise path is used: "
        "returned non-finite values in out, dq, dk, dv" in lines
    )
    assert (
        "kernels    wkv7 kernel size 64 bfloat16: FAILED, the chunked path is used: raised "
        "RuntimeError: metal::Compiler: Unable to build metal library from source\n"
        "               program_source:12:5: error: use of undeclared identifier 'x0'\n"
    ) in text
    assert text.count("(5 more lines)") == 8
