"""The CPU's quantized matmul through float32 tiles (``ops/quantized.py``) against the float64
product of the dequantized weight: both orientations, the input's gradient, several tiles with
a short last one, 3-D inputs, under mx.compile; MLX's own kernel below ``TILED_ROWS`` rows;
the backward keeps no float copy of the weight; a quantized model's layers take the path; the
tiles are MLX's dequantized values exactly."""

import mlx_rwkvx.ops.quantized as quantized
from mlx_rwkvx.models.quantize import QuantizedLinear

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from oracle.common import rel_err

TOL = 2e-6  # float32 products over widths of a few hundred


def _weight(rows, cols, bits, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((rows, cols)).astype(np.float32)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, 64, bits)
    dense = mx.dequantize(wq, scales.astype(mx.float32), biases.astype(mx.float32), 64, bits)
    return (wq, scales, biases), np.array(dense).astype(np.float64)


@pytest.fixture
def small_tiles(monkeypatch):
    monkeypatch.setattr(quantized, "TILE_BYTES", 37 * 256 * 4)  # 37 rows of 256: 300 = 8x37 + 4


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", [(40, 256), (3, 7, 256)])
def test_tiled_product_and_gradient_against_float64(small_tiles, bits, shape):
    (wq, s, b), W = _weight(300, 256, bits)
    rng = np.random.default_rng(1)
    x = rng.standard_normal(shape)
    g = rng.standard_normal((*shape[:-1], 300))

    def loss(x_):
        return (quantized.quantized_matmul(x_, wq, s, b, True, 64, bits) * mx.array(g)).sum()

    y = quantized.quantized_matmul(mx.array(x, mx.float32), wq, s, b, True, 64, bits)
    dx = mx.grad(loss)(mx.array(x, mx.float32))
    assert y.dtype == mx.float32 and y.shape == (*shape[:-1], 300)
    assert rel_err(np.array(y), x @ W.T) < TOL
    assert rel_err(np.array(dx), g @ W) < TOL
    # the other orientation: x @ W, its rows reduced tile by tile
    z = quantized.quantized_matmul(mx.array(g, mx.float32), wq, s, b, False, 64, bits)
    assert rel_err(np.array(z), g @ W) < TOL
    compiled = mx.compile(mx.grad(loss))(mx.array(x, mx.float32))
    assert rel_err(np.array(compiled), g @ W) < TOL


def test_below_the_threshold_it_is_mlx_kernel():
    (wq, s, b), _ = _weight(128, 256, 4)
    x = mx.random.normal((quantized.TILED_ROWS - 1, 256))
    ours = quantized.quantized_matmul(x, wq, s, b, True, 64, 4)
    assert mx.array_equal(ours, mx.quantized_matmul(x, wq, s, b, True, 64, 4))


def test_the_backward_keeps_no_float_copy_of_the_weight(monkeypatch):
    # four 2048 x 2048 int4 layers in 2 MB tiles: each a 16 MB float32 matrix dequantized; a
    # backward that kept them would hold 64 MB more (measured: 12 MB above the inputs; MLX's
    # own kernel 9)
    monkeypatch.setattr(quantized, "TILE_BYTES", 2 << 20)
    layers = [_weight(2048, 2048, 4, seed)[0] for seed in range(4)]
    x = mx.random.normal((64, 2048))
    mx.eval(x, layers)

    def loss(x_):
        for wq, s, b in layers:
            x_ = mx.tanh(quantized.quantized_matmul(x_, wq, s, b, True, 64, 4))
        return x_.sum()

    mx.synchronize()
    start = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(mx.grad(loss)(x))
    assert mx.get_peak_memory() - start < 20 << 20


def test_quantized_layers_take_the_tiled_path(monkeypatch):
    model = nn.Sequential(nn.Linear(256, 512), nn.Linear(512, 64, bias=False))
    nn.quantize(model, 64, 4)
    for layer in model.layers:
        layer.__class__ = QuantizedLinear
    calls = []
    tiled = quantized._tiled

    def counted(*key):
        calls.append(key)
        return tiled(*key)

    monkeypatch.setattr(quantized, "_tiled", counted)
    x = mx.random.normal((2, 20, 256)).astype(mx.bfloat16)
    y = model(x)
    assert y.dtype == mx.bfloat16 and len(calls) == 2
    dense = x.astype(mx.float32)
    for layer in model.layers:
        W = mx.dequantize(layer.weight, layer.scales, layer.biases, 64, 4).astype(mx.float32)
        dense = dense @ W.T + (layer.bias if "bias" in layer else 0)
    assert rel_err(np.array(y.astype(mx.float32)), np.array(dense)) < 1e-2  # bf16 output


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("shape", [(300, 512), (4, 7, 128)])
def test_the_dequantized_tiles_are_mlx_dequantize_exactly(bits, dtype, shape):
    """The compiled unpacking (2, 4, 8 bits) and MLX's kernel (3 bits) give MLX's values."""
    rng = np.random.default_rng(bits)
    w = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(w, 64, bits)
    scales, biases = scales.astype(dtype), biases.astype(dtype)
    want = mx.dequantize(wq, scales, biases, 64, bits)
    got = quantized.dequantized(wq, scales, biases, 64, bits)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert mx.array_equal(got, want)
