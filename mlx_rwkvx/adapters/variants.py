"""LoRA's variants from RWKV-PEFT: PiSSA and MiSS. Each trains in a layer of its own and is
saved as an ordinary LoRA update against the original base (``adapter_tensors``), so loading,
``generate --adapter``, merging and ``--fuse-into`` take it unchanged.

- **PiSSA** (``PissaLinear``): A and B start at the weight's top ``r`` singular directions,
  ``scale · A0 B0 = U_r S_r V_rᵀ`` (transposed to mlx-lm's layout), and the base holds the
  residual ``W - scale · (A0 B0)ᵀ``, so the model before the first step is the base. Saved, as
  huggingface/peft converts it: ``lora_a = [A | A0]``, ``lora_b = [B ; -B0]``, rank ``2r``, the
  scale kept; that file also holds A0 and B0, from which a resumed run rebuilds the residual
  (a new SVD could flip signs on another BLAS). Not on a quantized base: the residual would be
  quantized anew, and the saved update, applied to the original quantized base, would not give
  the trained model.
- **MiSS** (``MissLinear``), the variant of peft's MiSS tuner by default (``balance``): one
  trainable ``[r, out]`` block D, zeros at first; the input's ``in / r`` slices of ``r`` are
  summed and multiplied by D. That is ``x @ S @ D`` with S the ``[in, r]`` stack of identity
  blocks: a low-rank update of fixed shape, saved as LoRA with ``lora_a = S`` (never trained),
  ``lora_b = D``, scale 1. It trains ``r · out`` numbers a layer (LoRA: ``r · (in + out)``).
"""

from __future__ import annotations

from mlx_rwkvx._mlx_lm import LoRALinear

import mlx.core as mx
import mlx.nn as nn
import numpy as np

VARIANTS = ("pissa", "miss")


def _dims(linear) -> tuple[int, int]:
    out, inp = linear.weight.shape
    if isinstance(linear, nn.QuantizedLinear):
        inp = inp * 32 // linear.bits
    return inp, out


class PissaLinear(LoRALinear):
    """LoRA started at the principal singular directions of the weight (see the module
    docstring); ``a0``, ``b0``: A and B as they started (frozen)."""

    @staticmethod
    def from_base(linear: nn.Linear, r: int = 8, dropout: float = 0.0, scale: float = 2.0):
        if isinstance(linear, nn.QuantizedLinear):
            raise ValueError("PiSSA needs a float base")
        inp, out = _dims(linear)
        layer = PissaLinear(inp, out, r=r, dropout=dropout, scale=scale)
        weight = np.array(linear.weight.astype(mx.float32), dtype=np.float64)  # [out, in]
        U, S, Vt = np.linalg.svd(weight, full_matrices=False)
        root = np.sqrt(S[:r] / scale)
        a0 = Vt[:r].T * root  # [in, r]
        b0 = (U[:, :r] * root).T  # [r, out]
        linear.weight = mx.array(weight - scale * (a0 @ b0).T, dtype=linear.weight.dtype)
        layer.linear = linear
        layer.start_at(mx.array(a0, dtype=mx.float32), mx.array(b0, dtype=mx.float32))
        return layer

    def start_at(self, a0: mx.array, b0: mx.array) -> None:
        """A and B (and A0, B0) set to ``a0, b0``, the residual moved to match them (resume:
        the start a checkpoint recorded, not a new SVD's)."""
        if "a0" in self:
            weight = self.linear.weight.astype(mx.float32)
            weight = weight + self.scale * ((self.a0 @ self.b0) - (a0 @ b0)).T
            self.linear.weight = weight.astype(self.linear.weight.dtype)
        self.a0, self.b0 = a0, b0
        self.lora_a, self.lora_b = mx.array(a0), mx.array(b0)
        self.freeze(keys=["a0", "b0"], recurse=False)
        self.linear.freeze()

    def saved(self) -> tuple[mx.array, mx.array]:
        """(lora_a, lora_b) of the update against the original base, rank 2r."""
        a = mx.concatenate([self.lora_a, self.a0], axis=1)
        b = mx.concatenate([self.lora_b, -self.b0], axis=0)
        return a, b

    def load_saved(self, a: mx.array, b: mx.array) -> None:
        """The state ``saved`` wrote: A, B and the start A0, B0 (the residual follows)."""
        r = self.lora_a.shape[1]
        self.start_at(a[:, r:], -b[r:])
        self.lora_a, self.lora_b = a[:, :r], b[:r]


def identity_blocks(inp: int, r: int) -> mx.array:
    """S ``[inp, r]``: ``S[j, j mod r] = 1`` (``x @ S`` sums x's slices of ``r``)."""
    return (mx.arange(inp)[:, None] % r == mx.arange(r)[None, :]).astype(mx.float32)


class MissLinear(LoRALinear):
    """MiSS (see the module docstring): ``lora_b`` is the trained block D, ``lora_a`` the fixed
    S, scale 1."""

    @staticmethod
    def from_base(linear, r: int = 8, dropout: float = 0.0, scale: float = 1.0):
        inp, out = _dims(linear)
        layer = MissLinear(inp, out, r=r, dropout=dropout, scale=1.0)
        layer.linear = linear
        layer.lora_a = identity_blocks(inp, r)
        layer.freeze(keys=["lora_a"], recurse=False)
        return layer

    def __call__(self, x):
        y = self.linear(x)
        x = self.dropout(x)
        inp, r = self.lora_a.shape
        pad = -inp % r
        if pad:  # the last slice is short: zeros complete it (S's rows end there)
            x = mx.concatenate([x, mx.zeros((*x.shape[:-1], pad), dtype=x.dtype)], axis=-1)
        sums = x.reshape(*x.shape[:-1], (inp + pad) // r, r).sum(axis=-2)
        return y + (sums @ self.lora_b).astype(y.dtype)

    def saved(self) -> tuple[mx.array, mx.array]:
        return self.lora_a, self.lora_b

    def load_saved(self, a: mx.array, b: mx.array) -> None:
        self.lora_b = b


def saved_tensors(model: nn.Module) -> dict[str, mx.array]:
    """The LoRA tensors of every PiSSA or MiSS layer of ``model``, as saved."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, (PissaLinear, MissLinear)):
            out[f"{path}.lora_a"], out[f"{path}.lora_b"] = module.saved()
    return out


def load_saved_tensors(model: nn.Module, tensors: dict) -> dict:
    """Put the saved tensors of PiSSA and MiSS layers into them; returns the other tensors."""
    rest = dict(tensors)
    for path, module in model.named_modules():
        if isinstance(module, (PissaLinear, MissLinear)) and f"{path}.lora_a" in rest:
            module.load_saved(rest.pop(f"{path}.lora_a"), rest.pop(f"{path}.lora_b"))
    return rest


def saved_lora_parameters(mode: str, rank: int, alpha: float) -> tuple[int, float]:
    """(rank, alpha) of the saved LoRA update of ``mode``'s layers of rank ``rank``."""
    if mode == "pissa":
        return 2 * rank, 2 * alpha  # [A | A0]: twice the rank, the scale kept
    if mode == "miss":
        return rank, float(rank)  # scale 1
    return rank, alpha
