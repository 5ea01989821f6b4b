"""The MoBA kernel body (metal/moba.h): its CPU flavour against the float64 oracle on pinned
selections, the CUDA flavour through nvcc, the Metal and CUDA sources exactly as the MLX builders
assemble them, and the MLX wrapper (moba_kernel_fn and its VJP) driven through the CPU flavour."""

import re

from mlx_rwkvx.metal import sources
from mlx_rwkvx.ops import moba as M
from mlx_rwkvx.ops.moba import blockwise, selection
from mlx_rwkvx.ops.moba import kernel as MK

import mlx.core as mx
import numpy as np
import pytest
from helpers.mlx_kernel_emulation import (
    MX_DTYPES,
    check_cuda_compiles,
    check_imports_without_mlx,
    check_metal_assembly,
    kernels_through_cpu,
)
from kernel_harness import cpu
from kernel_harness import moba as harness
from oracle.common import rel_err

HEAD_SIZES = MK.HEAD_SIZES


@pytest.fixture(scope="module")
def launch(request, tmp_path_factory):
    return cpu.fixture_launch(request, tmp_path_factory, harness.ENTRIES, HEAD_SIZES)


# (B, T, Hq, Hkv, D, chunk_size, top_k, key prefix, shuffled slots)
FLOAT32_CASES = [
    (1, 1, 1, 1, 16, 4, 2, 0, False),  # one token
    (1, 10, 2, 2, 16, 16, 2, 0, False),  # T < chunk_size: the own chunk only
    (2, 37, 2, 1, 16, 8, 2, 0, True),  # T not a multiple of chunk_size, B > 1, slots in any order
    (1, 12, 2, 2, 16, 1, 3, 0, False),  # chunk_size 1
    (1, 40, 2, 2, 16, 8, 0, 0, False),  # top_k 0: every earlier chunk, empty slots early on
    (1, 30, 2, 1, 32, 8, 9, 0, False),  # top_k >= the chunks: full causal too
    (2, 50, 4, 2, 32, 8, 2, 0, True),  # GQA 4 / 2
    (1, 50, 4, 1, 16, 8, 3, 0, False),  # GQA 4 / 1
    (1, 70, 2, 1, 64, 16, 2, 0, False),  # chunks shorter than a tile of D keys
    (1, 100, 2, 1, 16, 40, 1, 0, True),  # chunks of 2.5 tiles: partial tiles in all three kernels
    (1, 45, 2, 2, 128, 8, 2, 0, False),
    (2, 20, 4, 2, 32, 8, 2, 27, True),  # queries after a cached key prefix
    (1, 1, 4, 1, 16, 8, 2, 50, False),  # one decode step
]


@pytest.mark.parametrize("B, T, Hq, Hkv, D, cs, top_k, prefix, shuffle", FLOAT32_CASES)
def test_cpu_flavour_float32_matches_oracle(launch, B, T, Hq, Hkv, D, cs, top_k, prefix, shuffle):
    rng = np.random.default_rng(T * 131 + D)
    x = harness.random_inputs(rng, B, T, Hq, Hkv, D, cs, top_k, prefix=prefix, shuffle=shuffle)
    harness.compare(launch, x, cs, "float32")


def test_cpu_flavour_without_lse_cotangent_and_other_scale(launch):
    x = harness.random_inputs(np.random.default_rng(3), 2, 33, 2, 1, 32, 8, 1, with_dlse=False)
    harness.compare(launch, x, 8, "float32", scale=0.3)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize(
    "B, T, Hq, Hkv, D, cs, top_k", [(2, 37, 4, 2, 32, 8, 2), (1, 60, 2, 1, 64, 16, 1)]
)
def test_cpu_flavour_low_precision_matches_oracle(launch, dtype, B, T, Hq, Hkv, D, cs, top_k):
    x = harness.random_inputs(np.random.default_rng(T), B, T, Hq, Hkv, D, cs, top_k, shuffle=True)
    harness.compare(launch, x, cs, dtype)


@pytest.mark.slow
@pytest.mark.parametrize("D", HEAD_SIZES)
def test_cpu_flavour_long_sequence_every_head_size(launch, D):
    x = harness.random_inputs(np.random.default_rng(D), 1, 1000, 4, 2, D, 64, 3)
    harness.compare(launch, x, 64, "float32")


def test_selection_as_slots_is_the_oracles():
    from oracle.attention import moba_selection_np

    x = harness.random_inputs(np.random.default_rng(1), 2, 45, 4, 2, 16, 8, 2, shuffle=True)
    mask = harness.mask_np(x["chunk"], x["limit"], 8, 45)
    assert np.array_equal(mask, moba_selection_np(x["q"], x["k"], chunk_size=8, top_k=2))


@pytest.mark.parametrize("which, caught", [("swap", "dk"), ("no_dlse", "dq")])
def test_compare_catches_a_wrong_kernel(launch, which, caught):
    def wrong(name, groups, threads, arrays):
        if which == "no_dlse" and name.startswith("moba_bwd_dq"):
            arrays[harness.DQ.input_names.index("dlse")][...] = 0  # lse's cotangent forgotten
        launch(name, groups, threads, arrays)
        if which == "swap" and name.startswith("moba_bwd_dkv"):
            dk, dv = arrays[len(harness.DKV.inputs) :]
            dk[...], dv[...] = dv.copy(), dk.copy()

    x = harness.random_inputs(np.random.default_rng(0), 1, 20, 2, 1, 16, 4, 2)
    with pytest.raises(AssertionError, match=rf"off the oracle.*'{caught}'"):
        harness.compare(wrong, x, 4, "float32")


DIMS = ("T", "Tk", "Hq", "Hkv", "S", "cs")  # the dims input, as the wrapper and harness write it


def test_entries_pass_each_argument_to_the_parameter_of_its_name():
    body = sources.kernel_source("moba.h")
    renamed = {"scale[0]": "scale", "moba_smem": "smem", "moba_ismem": "ismem"}
    renamed |= {f"dims[{i}]": name for i, name in enumerate(DIMS)}
    for e in harness.ENTRIES:
        fn, call = re.search(r"(moba_\w+)<InT, N>\((.*?)\);", e.text, re.S).groups()
        args = [renamed.get(a.strip(), a.strip()) for a in call.split(",")]
        signature = re.search(rf"KFN void {fn}\((.*?)\) {{", body, re.S).group(1)
        params = [p.split()[-1] for p in signature.split(",")]
        thread_ids = ("TID_X", "GID_X")
        assert [a for a in args if a not in thread_ids] == [
            p for a, p in zip(args, params, strict=True) if a not in thread_ids
        ], fn
        assert set(e.input_names) | set(e.output_names) <= set(args) | {"dims"}, fn


def test_dims_order():
    q, k = mx.zeros((2, 5, 4, 16)), mx.zeros((2, 9, 2, 16))
    scale, dims = MK._consts(q, k, mx.zeros((2, 5, 4, 3), dtype=mx.int32), 7, 0.5)
    assert dims.tolist() == [5, 9, 4, 2, 3, 7] and scale.tolist() == [0.5]  # see DIMS


# Metal gives a threadgroup 32 KiB; the static_asserts check every entry's request at N = 128.
SHARED_LIMITS = """
static_assert(MOBA_FWD_SHARED(128) * 4 <= 32768, "forward");
static_assert(MOBA_DQ_SHARED(128) * 4 <= 32768, "dq");
static_assert((MOBA_DKV_SHARED(128) + MOBA_DKV_INT_SHARED) * 4 <= 32768, "dk/dv");
"""


def test_metal_assembly_names_its_thread_ids_and_compiles_as_cpp(tmp_path):
    instances = [("float32", 64), ("bfloat16", 16), ("float16", 128)]
    small = ("scale", "dims")
    check_metal_assembly(tmp_path, "moba", harness.ENTRIES, instances, small, SHARED_LIMITS)


def test_cuda_flavour_compiles_with_nvcc(tmp_path):
    instances = [("float32", 16), ("float32", 64), ("float32", 128)]
    instances += [("bfloat16", 64), ("float16", 32)]
    as_mlx = [("bfloat16", 64), ("float16", 64)]
    check_cuda_compiles(tmp_path, "moba", harness.ENTRIES, instances, as_mlx)


def _mx(x: np.ndarray, dtype: str) -> mx.array:
    return mx.array(x.astype(np.float32)).astype(MX_DTYPES[dtype])


def test_builders_return_none_without_a_backend():
    if MK.kernel_backend() is not None:
        pytest.skip("this MLX has a GPU backend")
    assert MK._kernels() is None
    with pytest.raises(RuntimeError, match="moba_kernel_fn needs MLX with a Metal or CUDA"):
        MK.moba_kernel_fn(8, 0.25)


def test_shape_checks_name_the_argument():
    x = harness.random_inputs(np.random.default_rng(0), 1, 9, 2, 1, 16, 4, 1)
    q, k, v = (_mx(x[n], "float32") for n in ("q", "k", "v"))
    chunk, limit = mx.array(x["chunk"]), mx.array(x["limit"])
    MK.check_slots(q, k, v, chunk, limit)
    with pytest.raises(ValueError, match="q must be"):
        MK.check_slots(q[..., :8], k[..., :8], v[..., :8], chunk, limit)
    with pytest.raises(ValueError, match="k has shape"):
        MK.check_slots(q, k[:, :5], v, chunk, limit)
    with pytest.raises(ValueError, match="v has dtype"):
        MK.check_slots(q, k, v.astype(mx.float16), chunk, limit)
    with pytest.raises(ValueError, match="limit has shape"):
        MK.check_slots(q, k, v, chunk, limit[..., :1])
    with pytest.raises(ValueError, match="chunk has shape"):
        MK.check_slots(q, k, v, chunk.astype(mx.int64), limit)


def test_pair_index_agrees_with_numpy():
    x = harness.random_inputs(np.random.default_rng(2), 2, 45, 4, 2, 16, 8, 0, prefix=9)
    pairs, offsets = MK._pair_index(mx.array(x["chunk"]), mx.array(x["limit"]), 2, 54, 8)
    want_pairs, want_offsets = harness.pair_index_np(x["chunk"], x["limit"], 2, 8, 54)
    assert np.array_equal(np.array(offsets), want_offsets)
    pairs = np.array(pairs)
    for lo, hi in zip(want_offsets[:-1], want_offsets[1:], strict=True):
        assert sorted(pairs[lo:hi]) == sorted(want_pairs[lo:hi])  # the same slots per chunk


def _run_wrapper(monkeypatch, launch, backend, x, cs, scale, dtype, out_only=False):
    """moba_kernel_fn through fake MLX kernels: (out, lse, (dq, dk, dv), calls). With
    ``out_only`` the gradients are those of ``sum(out * dout)``, as the dispatcher takes them."""
    with kernels_through_cpu(monkeypatch, backend, MK, harness.ENTRIES, launch) as calls:
        fn = MK.moba_kernel_fn(cs, scale)
        q, k, v, d_out = (_mx(x[n], dtype) for n in ("q", "k", "v", "dout"))
        D = q.shape[-1]
        chunk, limit = mx.array(x["chunk"]), mx.array(x["limit"])
        d_lse = mx.array(x["dlse"].astype(np.float32))
        (out, lse), grads = mx.vjp(
            lambda q, k, v: fn(q, k, v, chunk, limit), [q, k, v], [d_out, d_lse]
        )
        if out_only:

            def loss(q, k, v):
                return mx.sum(fn(q, k, v, chunk, limit)[0].astype(mx.float32) * d_out)

            grads = mx.grad(loss, argnums=(0, 1, 2))(q, k, v)
        mx.eval(out, lse, grads)
    assert out.dtype == q.dtype and lse.dtype == mx.float32 and lse.shape == (q.size // D,)
    assert [g.dtype for g in grads] == [q.dtype] * 3
    return out, lse, grads, calls


def _as_np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


@pytest.mark.parametrize("backend", ["metal", "cuda"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mlx_wrapper_and_vjp_through_cpu_flavour(launch, monkeypatch, backend, dtype):
    # the selection as the dispatcher makes it: moba_selection, then _slots; after a key prefix
    B, T, Hq, Hkv, D, cs, top_k, prefix = 2, 29, 4, 2, 32, 8, 2, 8
    rng = np.random.default_rng(7)
    x = harness.random_inputs(rng, B, T, Hq, Hkv, D, cs, top_k, prefix=prefix)
    x = harness.rounded(x, dtype)
    q, k = _mx(x["q"], dtype), _mx(x["k"], dtype)
    sel = M.moba_selection(q, k, chunk_size=cs, top_k=top_k)
    chunk, limit = selection.slots(q, k, sel, cs)
    x["chunk"], x["limit"] = np.array(chunk), np.array(limit)
    mask = harness.mask_np(x["chunk"], x["limit"], cs, T + prefix)
    assert np.array_equal(mask, np.array(M.selection_mask(sel, T, T + prefix, cs)))
    scale = 1.0 / np.sqrt(D)
    out, lse, grads, calls = _run_wrapper(monkeypatch, launch, backend, x, cs, scale, dtype)
    assert [name for name, _ in calls] == ["moba_fwd", "moba_bwd_dq", "moba_bwd_dkv"]

    ref = harness.reference(x, cs, float(np.float32(scale)))
    tol = harness.TOL[dtype]
    assert rel_err(_as_np(out), ref["out"]) <= tol["out"]
    assert rel_err(np.array(lse), ref["lse"]) <= tol["out"]
    for name, g in zip(harness.GRADS, grads, strict=True):
        assert rel_err(_as_np(g), ref[name]) <= tol["grad"], name
    # and it is a drop-in for the blockwise path's custom function
    v = _mx(x["v"], dtype)
    out_b, lse_b = blockwise.sparse_fn(cs, float(scale))(q, k, v, chunk, limit)
    assert rel_err(_as_np(out), _as_np(out_b)) <= tol["out"]
    assert rel_err(np.array(lse), np.array(lse_b)) <= tol["out"]


def test_mlx_wrapper_pads_small_inputs_out_of_metals_constant_space(launch, monkeypatch):
    # T = 3, one head: chunk, limit, lse, pairs and offsets all have fewer than 8 elements;
    # gradients of out alone (lse's cotangent is whatever MLX passes for an unused output)
    x = harness.random_inputs(np.random.default_rng(4), 1, 3, 1, 1, 16, 2, 0, with_dlse=False)
    out, lse, grads, calls = _run_wrapper(
        monkeypatch, launch, "metal", x, 2, 0.25, "float32", out_only=True
    )
    for kernel, sizes in calls:
        small = {name for name, size in sizes.items() if size < 8}
        assert small == {"scale", "dims"}, (kernel, sizes)
    ref = harness.reference(x, 2, 0.25)
    assert rel_err(_as_np(out), ref["out"]) <= 2e-6
    for name, g in zip(harness.GRADS, grads, strict=True):
        assert rel_err(_as_np(g), ref[name]) <= 1e-5, name


def test_gpu_harness_imports_without_mlx():
    check_imports_without_mlx("test_moba_cuda")
