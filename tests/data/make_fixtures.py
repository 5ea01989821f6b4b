"""Writes the committed BlinkDL ``.pth`` fixtures (run once; CI never runs it).

    python tests/data/make_fixtures.py export   # with mlx_rwkvx: writes tiny_rwkv7.npz
    python tests/data/make_fixtures.py pth      # with torch: tiny_rwkv7{,_bf16}.pth from it

The model is ``FIXTURE_CONFIG`` with Foundry's init, seed ``FIXTURE_SEED``, in BlinkDL's names,
with the unused layer-0 ``att.v0/v1/v2`` that several versions of BlinkDL's script write;
tests/io/test_io_formats.py rebuilds the same model and compares.
"""

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
FIXTURE_CONFIG = dict(vocab_size=256, hidden_size=32, head_size=16, block_types=["rwkv7"] * 2)
FIXTURE_SEED = 7


def export() -> None:
    from mlx_rwkvx.io.formats import to_blinkdl
    from mlx_rwkvx.models import Model, ModelConfig

    import numpy as np
    from mlx.utils import tree_flatten

    cfg = ModelConfig(**FIXTURE_CONFIG)
    model = Model(cfg, seed=FIXTURE_SEED)
    tensors = to_blinkdl(cfg, dict(tree_flatten(model.parameters())))
    # as several versions of BlinkDL's x070 train script save them: the value-mix projection
    # also in layer 0, where it is unused
    rng = np.random.default_rng(FIXTURE_SEED)
    for name in ("v0", "v1", "v2"):
        like = tensors[f"blocks.1.att.{name}"]
        tensors[f"blocks.0.att.{name}"] = rng.uniform(-0.1, 0.1, like.shape).astype(np.float32)
    np.savez(HERE / "tiny_rwkv7.npz", **{k: np.array(v) for k, v in tensors.items()})


def pth() -> None:
    import numpy as np
    import torch

    arrays = np.load(HERE / "tiny_rwkv7.npz")
    state = {k: torch.from_numpy(arrays[k].copy()) for k in arrays.files}
    torch.save(state, HERE / "tiny_rwkv7.pth")
    torch.save({k: v.bfloat16() for k, v in state.items()}, HERE / "tiny_rwkv7_bf16.pth")


if __name__ == "__main__":
    {"export": export, "pth": pth}[sys.argv[1]]()
