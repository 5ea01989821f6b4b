"""The serve section: ``python -m mlx_rwkvx.server`` as a client sees it, over HTTP on
localhost. The second turn of a long conversation (time to its first streamed token) against
prefilling its new tokens on the restored state in this process (the server's overhead), in
one process and after a restart with ``--cache-dir``, for RWKV-7, RWKV-X and RFA; aggregate
tokens/s of 1, 2, 4 and 8 concurrent streams; decode with a JSON schema against without; the
long load test (16 clients, streamed, not, and hanging up): no 5xx, memory; and the soak
(every kind of request a shared server meets, good and bad, at once). Here: the sizes, the
models and the order of the measurements; ``serve_client`` is the client side (the server, the
streams, the load test), ``serve_turns`` the second turns and the schema measured against this
process, ``serve_soak`` the soak and ``serve_report`` the section's report."""

from __future__ import annotations

import os
import tempfile

from benchmarks.common import Section, sizes
from benchmarks.serve_client import load_test, streams
from benchmarks.serve_report import render
from benchmarks.serve_soak import soak
from benchmarks.serve_turns import schema_overhead, second_turns
from mlx_rwkvx.models import Model, ModelConfig, preset, rfa_config, rwkv_x_block_types

import mlx.core as mx
import numpy as np

SERVE = {
    "full": dict(
        width=768,
        layers=12,
        history=1500,
        new=48,
        answer=8,
        variants=6,
        stream_tokens=48,
        streams=(1, 2, 4, 8),
        schema_tokens=96,
        load=dict(requests=320, clients=16, cache_bytes=256 << 20),
        soak=dict(
            clients=16,
            requests=50,
            answer=12,
            prompts=12,
            cache_bytes=16 << 20,
            deadline=120.0,
            walk_away=1.0,
        ),
    ),
    "quick": dict(
        width=64,
        layers=2,
        history=40,
        new=8,
        answer=4,
        variants=1,
        stream_tokens=4,
        streams=(1, 2),
        schema_tokens=8,
        load=dict(requests=12, clients=4, cache_bytes=16 << 20),
        soak=dict(
            clients=4,
            requests=8,
            answer=4,
            prompts=3,
            cache_bytes=1 << 20,
            deadline=60.0,
            walk_away=0.5,
        ),
    ),
}
VOCAB = 65536  # RWKV World's: the tokenizer the models load with, and the schema's vocabulary


def _configs(width: int, layers: int) -> dict[str, ModelConfig]:
    heads = dict(head_size=64) if width % 64 == 0 else dict(head_size=width // 2)
    if width == 768 and layers == 12:
        rwkv7 = preset("rwkv7-0.1b")
    else:
        rwkv7 = ModelConfig(
            vocab_size=VOCAB, hidden_size=width, block_types=["rwkv7"] * layers, **heads
        )
    n_attn = max(1, layers // 4)
    rwkv_x = ModelConfig(
        vocab_size=VOCAB,
        hidden_size=width,
        moba_chunk_size=64,
        moba_top_k=3,
        block_types=rwkv_x_block_types(layers - n_attn, n_attn),
        **heads,
    )
    kinds = (
        ["qwen2" if (i + 1) % 4 == 0 else "rwkv7" for i in range(layers)]
        if layers >= 4
        else ["rwkv7", "qwen2"]
    )
    rfa = rfa_config(
        vocab_size=VOCAB,
        hidden_size=width,
        block_types=kinds,
        n_q_heads=max(2, width // 64),
        n_kv_heads=max(1, width // 256),
        intermediate_size=width * 3,
        **heads,
    )
    return {"rwkv7": rwkv7, "rwkv-x": rwkv_x, "rfa": rfa}


def measure(quick: bool = False) -> dict:
    c = sizes(SERVE, quick)
    rng = np.random.default_rng(0)
    out: dict = {
        "sizes": {k: c[k] for k in ("width", "layers", "history", "new", "answer")},
        "turns": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        from mlx_rwkvx.io.load import save

        paths = {}
        for name, cfg in _configs(c["width"], c["layers"]).items():
            model = Model(cfg, seed=1)
            mx.eval(model.parameters())
            paths[name] = os.path.join(tmp, name)
            save(model, paths[name])
            del model
        load = c["load"]
        for name, path in paths.items():
            extra, then = (), None
            if name == "rwkv7":  # its restarted server goes on with the streams and the load
                extra = (
                    "--cache-bytes",
                    str(load["cache_bytes"]),
                    "--max-queue",
                    str(load["clients"] * 2),
                )

                def then(server, path=path):
                    return {"streams": streams(server, path, c), "load": load_test(server, path, c)}

            turns = second_turns(path, os.path.join(tmp, name + ".states"), c, rng, extra, then)
            out.update(turns.pop("then", {}))
            out["turns"][name] = turns
        out["schema"] = schema_overhead(paths["rwkv7"], c)
        out["soak"] = soak(paths["rwkv7"], os.path.join(tmp, "soak.states"), c["soak"])
    return out


SECTION = Section(
    measure,
    render,
    "the server: a second turn's first token with its state cache, after a restart, "
    "concurrent streams, JSON schema overhead, a load test",
)
