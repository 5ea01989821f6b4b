"""Parity with the RWKV-X authors' own inference code (``rwkv-x`` on PyPI, ``rwkv_x.model.RWKV_X``
on the CPU in float32), on random checkpoints laid out as their training code saves them:
BlinkDL's RWKV-7 tensors under ``rwkv.`` (heads of 64, as their code fixes it) and the
attention blocks as their own ``MemoryAttentionBlock`` names and shapes them, under ``moba.<j>.``.

Their prefill (a prompt of two or more tokens, given as a list) attends densely over the prompt;
ours runs MoBA, which covers these prompts densely with the settings their checkpoints get
(chunks of 2048). Logits agree to ``||ours - ref|| / ||ref|| <= 1e-5`` in two layouts.
Their decode differs by design (it attends to a kept memory of prompt tokens only; README,
"Checkpoints"): it is not compared. Without the ``parity`` extra the module is skipped, except
under CI (``MLX_RWKVX_CI=1``).
"""

from __future__ import annotations

import json
import os

import mlx_rwkvx

import mlx.core as mx
import numpy as np
import pytest
from helpers import run_module
from helpers.parity import blinkdl_state, import_parity_extra, logprob_errors
from oracle.common import rel_err

os.environ["RWKV_CUDA_ON"] = "0"  # read when rwkv_x.model is imported: its CPU path
torch, rwkv_x_model = import_parity_extra(("torch", "rwkv_x.model"))
pytestmark = pytest.mark.extra("parity")

TOL = 1e-5
V, C = 256, 128  # two heads of 64
LAYOUTS = [(4, 2), (3, 1)]  # RWKV-7 blocks, attention blocks
LENGTHS = [2, 17, 100]


def authors_state(n_rwkv: int, n_attn: int, seed: int) -> dict[str, np.ndarray]:
    """A random RWKV-X: BlinkDL's RWKV-7 under ``rwkv.`` (layer 0 with the v0/v1/v2 their
    training code creates), and attention blocks with the names and shapes of their own class."""
    state = {
        "rwkv." + k: v
        for k, v in blinkdl_state(seed, True, vocab=V, width=C, head=64, layers=n_rwkv).items()
    }
    rng = np.random.default_rng(seed + 1)
    config = rwkv_x_model.RWKV_X_Config(n_attn_layer=n_attn, n_head=C // 64, n_embd=C)
    for j in range(n_attn):
        for name, p in rwkv_x_model.MemoryAttentionBlock(config).state_dict().items():
            shape = tuple(p.shape)
            if name.startswith(("ln1.", "ln2.")):
                x = (
                    1 + 0.1 * rng.standard_normal(shape)
                    if name.endswith("weight")
                    else 0.1 * (rng.standard_normal(shape))
                )
            elif name == "ffn.x_k":
                x = rng.uniform(0, 1, shape)
            else:  # a Linear weight [out, in]
                x = rng.standard_normal(shape) * shape[1] ** -0.5
            state[f"moba.{j}.{name}"] = x.astype(np.float32)
    return state


class Reference:
    """A ``.pth`` saved by torch and their ``RWKV_X`` running it (strategy 'cpu fp32')."""

    def __init__(self, pth: str):
        self.pth = pth
        self.model = rwkv_x_model.RWKV_X(pth, "cpu fp32")  # prints a line while loading

    def logits(self, tokens: list[int]) -> np.ndarray:
        """``[T, vocab]`` of a prompt of two or more tokens from the zero state (their prefill)."""
        out, _ = self.model.forward(list(tokens), None, full_output=True)
        return out.float().numpy()


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}+{p[1]}")
def reference(request, tmp_path_factory) -> Reference:
    state = authors_state(*request.param, seed=7)
    pth = str(tmp_path_factory.mktemp("rwkvx") / "RWKV-X-tiny.pth")
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, pth)
    return Reference(pth)


def tokens(length: int) -> list[int]:
    return np.random.default_rng(length).integers(0, V, length).tolist()


def check(ours: np.ndarray, ref: np.ndarray, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape}, reference {ref.shape}"
    err = rel_err(ours, ref)
    assert err <= TOL, f"{what}: relative error {err:.2e} > {TOL:.0e}"


@pytest.mark.parametrize("length", LENGTHS)
def test_prefill_matches_the_authors_rwkv_x(reference, length):
    model, _ = mlx_rwkvx.load(reference.pth)
    ids = tokens(length)
    ours = np.array(model(mx.array([ids]))[0])
    check(ours, reference.logits(ids), f"{reference.pth}, T={length}")


def test_logprobs_match_the_authors_rwkv_x(reference):
    """evaluate's per-token log-probabilities and perplexity against the log-softmax of their
    prefill's logits."""
    model, _ = mlx_rwkvx.load(reference.pth)
    ids = tokens(100)
    logp_err, ppl_err = logprob_errors(model, ids, reference.logits(ids))
    assert logp_err <= TOL and ppl_err <= TOL, (logp_err, ppl_err)


def test_a_file_we_write_loads_in_theirs(reference, tmp_path):
    """Their file read, written again by ``convert --to rwkvx`` (no torch involved), loaded by
    their code: the same logits, and the same tensors as torch wrote them."""
    out = tmp_path / "again.pth"
    result = run_module("convert", reference.pth, out, "--to", "rwkvx")
    assert result.returncode == 0, result.stderr
    theirs, ours = torch.load(reference.pth), torch.load(out, weights_only=True)
    layer0_v = {f"rwkv.blocks.0.att.v{i}" for i in range(3)}  # never used: dropped on reading
    assert set(ours) == set(theirs) - layer0_v
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    ids = tokens(17)
    check(Reference(str(out)).logits(ids), reference.logits(ids), f"{out} in rwkv_x")


def test_the_toolkit_end_to_end(tmp_path):
    """An RWKV-X of theirs through the toolkit: convert, two LoRA steps, generate, merge with
    the adapter fused in, written back in their layout, and loaded by their code again, whose
    logits are the fused model's (and not the base's)."""
    state = authors_state(3, 1, seed=11)
    base = tmp_path / "RWKV-X-tiny.pth"
    torch.save({k: torch.from_numpy(v) for k, v in state.items()}, base)

    def run(module, *args):
        result = run_module(module, *args)
        assert result.returncode == 0, f"{module} {args}: {result.stderr}"
        return result

    native = tmp_path / "native"
    run("convert", base, native)
    assert json.loads((native / "config.json").read_text())["moba_chunk_size"] == 2048
    adapters = []
    for part in (0, 1):  # two Macs' adapters, from one init, on two halves of the data
        data = tmp_path / f"data{part}"
        data.mkdir()
        lines = [json.dumps({"text": f"fact {i}: the cat sat on mat {i}."}) for i in range(8)]
        (data / "train.jsonl").write_text("\n".join(lines[part::2]) + "\n")
        out = tmp_path / f"lora{part}"
        run(
            "train",
            "--model",
            native,
            "--data",
            data,
            "--output",
            out,
            "--iters",
            2,
            "--batch-size",
            2,
            "--learning-rate",
            1e-2,
            "--rank",
            4,
        )
        adapters.append(out / "adapter_final.safetensors")
    run(
        "generate",
        "--model",
        native,
        "--adapter",
        tmp_path / "lora0",
        "--prompt",
        "fact",
        "--max-tokens",
        4,
    )
    merged, fused = tmp_path / "merged.safetensors", tmp_path / "fused"
    run("merge", "--output", merged, *adapters)
    run("merge", "--output", fused, *adapters, "--fuse-into", native)
    back = tmp_path / "RWKV-X-tuned.pth"
    run("convert", fused, back, "--to", "rwkvx")

    ids = tokens(17)
    ours, _ = mlx_rwkvx.load(fused)
    with_adapter, _ = mlx_rwkvx.load(native, adapter=merged)
    expected = np.array(ours(mx.array([ids]))[0])
    check(expected, np.array(with_adapter(mx.array([ids]))[0]), "fused vs base + merged")
    theirs = Reference(str(back)).logits(ids)
    check(expected, theirs, f"{back} in rwkv_x")
    assert rel_err(theirs, Reference(str(base)).logits(ids)) > 10 * TOL  # the update is in it
