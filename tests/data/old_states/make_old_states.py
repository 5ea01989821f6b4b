"""Wrote the two state files of the formats before ``mlx_rwkvx.state/1`` (run once, at commit
00d1006, with that commit's ``Chat.save`` and ``PrefixCache``; kept as the record of how they
were made: the code no longer writes these formats, so the script refuses to run on it).
tests/io/test_states.py loads them:

    python tests/data/old_states/make_old_states.py

- ``chat-1.safetensors``: ``"mlx_rwkvx.chat/1"``, a two-turn conversation of
  ``tiny_model("rfa", seed=5)`` (RWKV-7, Qwen2, RWKV-7: a KV cache) with ``ByteTokenizer``;
- ``prefix-state.safetensors``: ``"mlx_rwkvx-prefix-state"``, the server's entry (state and
  logits) after ``PREFIX_TOKENS`` of the same model, under the key ``state_key(model,
  dtype=None, quantize=None, max_cache=2048)``, as ``PrefixCache.put`` wrote it in a
  ``--cache-dir`` (its name there is the hash of key and tokens).
"""

import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

import mlx_rwkvx  # noqa: E402,F401  (before mlx: the system BLAS)
from mlx_rwkvx.generation import Chat  # noqa: E402
from mlx_rwkvx.generation.prefix_cache import PrefixCache  # noqa: E402
from mlx_rwkvx.io.tokenizers import ByteTokenizer  # noqa: E402
from mlx_rwkvx.server.served import state_key  # noqa: E402

import mlx.core as mx  # noqa: E402
from helpers import tiny_model  # noqa: E402

PREFIX_TOKENS = list(b"a prefix of a conversation")


def main() -> None:
    if (HERE.parent.parent.parent / "mlx_rwkvx" / "io" / "states.py").exists():
        sys.exit("this code writes mlx_rwkvx.state/1, not the old formats: run it at 00d1006")
    model = tiny_model("rfa", seed=5)
    chat = Chat(model, ByteTokenizer(), max_tokens=6, system="be brief")
    for turn in ("hello", "and again"):
        list(chat.ask(turn))
    chat.save(HERE / "chat-1.safetensors")

    key = state_key(model, dtype=None, quantize=None, max_cache=2048)
    h, state = model.hidden(mx.array([PREFIX_TOKENS], dtype=mx.int32))
    logits = model.head(h[:, -1]).astype(mx.float32)
    with tempfile.TemporaryDirectory() as folder:
        cache = PrefixCache(10**8, folder=folder, key=key)
        cache.put(PREFIX_TOKENS, {"state": state, "logits": logits})
        cache.close()
        (written,) = Path(folder).glob("*.safetensors")
        shutil.copyfile(written, HERE / "prefix-state.safetensors")


if __name__ == "__main__":
    main()
