"""Names between our modules' parameters and the float64 oracle's parameter dicts.

Our names are ``tree_flatten(module.parameters())`` paths; the oracle's are those of
``tests/oracle/{rwkv7,blocks_attn,model}.py``. Linear weights are ``[out, in]`` on both sides;
the oracle's low-rank matrices ``w1``/``w2`` (and ``a``, ``v``, ``g``) are ``[in, out]``, the
transposes of our ``LowRank`` ``down.weight`` / ``up.weight``, and ``w0`` is ``up.bias``.
The same map serves parameters (ours -> oracle) and gradients (oracle -> ours). Also the
comparison helpers the model tests share.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from oracle.common import rel_err

# ours -> (oracle, transposed), within one block
_RWKV_LOW_RANK = {"decay": "w", "iclr": "a", "value_mix": "v", "gate": "g"}
RWKV7_NAMES = {
    "ln1.weight": ("ln1_w", False),
    "ln1.bias": ("ln1_b", False),
    "ln2.weight": ("ln2_w", False),
    "ln2.bias": ("ln2_b", False),
    **{f"tmix.x_{n}": (f"att.x_{n}", False) for n in "rwkvag"},
    "tmix.receptance.weight": ("att.W_r", False),
    "tmix.key.weight": ("att.W_k", False),
    "tmix.value.weight": ("att.W_v", False),
    "tmix.output.weight": ("att.W_o", False),
    **{f"tmix.{m}.down.weight": (f"att.{n}1", True) for m, n in _RWKV_LOW_RANK.items()},
    **{f"tmix.{m}.up.weight": (f"att.{n}2", True) for m, n in _RWKV_LOW_RANK.items()},
    **{f"tmix.{m}.up.bias": (f"att.{n}0", False) for m, n in _RWKV_LOW_RANK.items()},
    "tmix.k_k": ("att.k_k", False),
    "tmix.k_a": ("att.k_a", False),
    "tmix.r_k": ("att.r_k", False),
    "tmix.ln_x.weight": ("att.ln_x_w", False),
    "tmix.ln_x.bias": ("att.ln_x_b", False),
    "ffn.x_k": ("ffn.x_k", False),
    "ffn.key.weight": ("ffn.W_key", False),
    "ffn.value.weight": ("ffn.W_value", False),
    "ffn.gate_proj.weight": ("ffn.W_gate", False),
    "ffn.up_proj.weight": ("ffn.W_up", False),
    "ffn.down_proj.weight": ("ffn.W_down", False),
}
MOBA_NAMES = {
    "ln1.weight": ("ln1_w", False),
    "ln1.bias": ("ln1_b", False),
    "ln2.weight": ("ln2_w", False),
    "ln2.bias": ("ln2_b", False),
    **{f"attn.{n}_proj.weight": (f"attn.W_{n}", False) for n in "qkvo"},
    "ffn.x_k": ("ffn.x_k", False),
    "ffn.key.weight": ("ffn.W_key", False),
    "ffn.value.weight": ("ffn.W_value", False),
}
QWEN2_NAMES = {
    "input_layernorm.weight": ("ln1_w", False),
    "post_attention_layernorm.weight": ("ln2_w", False),
    **{f"self_attn.{n}_proj.weight": (f"attn.W_{n}", False) for n in "qkvo"},
    **{f"self_attn.{n}_proj.bias": (f"attn.b_{n}", False) for n in "qkv"},
    "mlp.gate_proj.weight": ("mlp.W_gate", False),
    "mlp.up_proj.weight": ("mlp.W_up", False),
    "mlp.down_proj.weight": ("mlp.W_down", False),
}
BLOCK_NAMES = {"rwkv7": RWKV7_NAMES, "moba": MOBA_NAMES, "qwen2": QWEN2_NAMES}
TOP_NAMES = {
    "embed.weight": ("emb", False),
    "ln0.weight": ("ln0_w", False),
    "ln0.bias": ("ln0_b", False),
    "norm.weight": ("norm_w", False),
    "norm.bias": ("norm_b", False),
    "lm_head.weight": ("W_head", False),
}
# ours with no oracle parameter: the trainable initial WKV state is the oracle's 'state' input
STATE0 = "tmix.state0"


def oracle_name(name: str, *, kind: str | None = None, block_types=None) -> tuple[str, bool]:
    """(oracle name, transposed) of our parameter ``name``: of a block of ``kind``, or of a
    model whose layers are ``block_types``. KeyError for a name with no oracle twin."""
    if kind is not None:
        return BLOCK_NAMES[kind][name]
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        oname, transposed = BLOCK_NAMES[block_types[int(i)]][rest]
        return f"layers.{i}.{oname}", transposed
    return TOP_NAMES[name]


def flat_params(module) -> dict[str, mx.array]:
    """Our parameters as ``{path: array}``."""
    return dict(tree_flatten(module.parameters()))


def _np64(x) -> np.ndarray:
    return np.array(x.astype(mx.float32) if isinstance(x, mx.array) else x, dtype=np.float64)


def to_oracle(params: dict, *, kind=None, block_types=None, skip=(STATE0,)) -> dict:
    """Our ``{path: array}`` -> the oracle's float64 dict (names ending in ``skip`` left out)."""
    out = {}
    for name, value in params.items():
        if name.endswith(skip):
            continue
        oname, transposed = oracle_name(name, kind=kind, block_types=block_types)
        v = _np64(value)
        out[oname] = v.T if transposed else v
    return out


def from_oracle(oracle: dict, names, *, kind=None, block_types=None) -> dict[str, np.ndarray]:
    """The oracle's dict (parameters or their gradients) under our ``names``."""
    out = {}
    for name in names:
        oname, transposed = oracle_name(name, kind=kind, block_types=block_types)
        v = oracle[oname]
        out[name] = v.T if transposed else v
    return out


def oracle_params(module, *, kind=None, block_types=None) -> dict:
    """A block's (``kind``) or a model's (``block_types``) parameters as the oracle's dict."""
    return to_oracle(flat_params(module), kind=kind, block_types=block_types)


WORST: dict[str, tuple[float, str]] = {}


def to_mx(x: np.ndarray, dtype=mx.float32) -> mx.array:
    return mx.array(np.asarray(x, dtype=np.float32)).astype(dtype)


def errors(ours: dict, ref: dict) -> dict[str, float]:
    """Norm-wise relative error of every tensor of ``ref``, by name (``ours`` has them all)."""
    return {k: rel_err(_np64(ours[k]), ref[k]) for k in ref}


def assert_close(ours: dict, ref: dict, tol: float, what: str, may_be_zero=()) -> dict:
    """Fail naming every tensor whose norm-wise relative error exceeds ``tol``; refuse a vacuous
    check (a reference that is all zero, unless named in ``may_be_zero``: then ours must be within
    ``tol`` of zero in absolute terms). Returns the errors."""
    missing = sorted(set(ref) - set(ours))
    assert not missing, f"{what}: no value for {missing}"
    vacuous = sorted(k for k, v in ref.items() if not np.any(v) and k not in may_be_zero)
    assert not vacuous, f"{what}: vacuous check, the reference is all zero for {vacuous}"
    errs = errors(ours, ref)
    for k, e in errs.items():  # the worst error of each check, for reports
        if e >= WORST.get(what, (-1.0, ""))[0]:
            WORST[what] = (e, k)
    bad = {k: f"{e:.2e}" for k, e in errs.items() if not e <= tol}
    assert not bad, f"{what}: norm-wise relative error > {tol:g}: {bad}"
    return errs


def grads_of(module, loss_fn, acts: dict | None = None) -> tuple[dict, dict]:
    """MLX autograd of ``loss_fn(acts) -> scalar`` (which calls ``module``) w.r.t. every
    parameter of ``module`` and every entry of ``acts``: ({path: grad}, {name: grad})."""
    params = flat_params(module)
    acts = acts or {}

    def loss(p, a):
        module.update(tree_unflatten(list(p.items())))
        return loss_fn(a)

    try:
        g_p, g_a = mx.grad(loss, argnums=(0, 1))(params, acts)
    finally:
        module.update(tree_unflatten(list(params.items())))
    mx.eval(g_p, g_a)
    return g_p, g_a
