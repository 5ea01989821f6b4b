"""``python -m mlx_rwkvx.server``: serve a model, and its adapters, over OpenAI's API.

``--model M`` is served under its own name (as given), each ``--adapter NAME=PATH`` as NAME
(a bare path: its file or folder name). Settings: ``ServerConfig`` below (flags, a YAML
``--config``). ``build(cfg)`` makes the engine and the application without serving them (the
tests serve them in-process); ``main(argv)`` serves until Ctrl-C or SIGTERM, which stop taking
requests, let those in flight finish for ``--shutdown-timeout`` seconds, cancel the rest and
leave ``--cache-dir`` complete (each state is written, atomically, as it is stored).

Exit codes: 0 after Ctrl-C or SIGTERM; 2 a problem with what was given (one line).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, replace

from mlx_rwkvx import cli, settings
from mlx_rwkvx.adapters.apply import apply_adapter
from mlx_rwkvx.errors import TargetError, UsageError
from mlx_rwkvx.generation import chat_format
from mlx_rwkvx.generation.prefix_cache import PrefixCache, folder_for, trim_cache_dir
from mlx_rwkvx.generation.stream import DEFAULT_PREFILL_STEP, SAMPLING_LIMITS, default_max_cache
from mlx_rwkvx.io.hub import resolve_model
from mlx_rwkvx.io.load import load
from mlx_rwkvx.io.targets import check_not_unsafe, resolve_target
from mlx_rwkvx.ops import configure_and_prepare
from mlx_rwkvx.server.engine import Engine
from mlx_rwkvx.server.guards import loopback
from mlx_rwkvx.server.served import Served, share_weights, state_key
from mlx_rwkvx.server.tools import ToolCalls
from mlx_rwkvx.settings import Settings, opt

PROG = "mlx_rwkvx.server"
DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_CACHE_BYTES = 1 << 30


@dataclass
class ServerConfig(Settings):
    """Serve an RWKV-7, RWKV-X or RFA model, and its adapters, over OpenAI's API
    (/v1/chat/completions, /v1/completions, /v1/embeddings, /v1/models). Flags beat a --config
    file; the file beats the defaults."""

    model: str | None = opt(
        "a checkpoint or Hugging Face name (any format mlx_rwkvx.load reads)", required=True
    )
    adapter: list[str] | None = opt(
        "NAME=PATH: serve the model with this adapter as the model NAME "
        "(repeatable; a bare PATH is named after its file)",
        "adapter_path",
    )
    host: str = opt(
        "the address to listen on (others than 127.0.0.1 reach it only if it is "
        "not a loopback address)",
        default="127.0.0.1",
    )
    port: int = opt("the port to listen on", default=8080, ge=0, le=65535)
    api_key: list[str] | None = opt(
        "answer only requests that carry this key ('Authorization: Bearer "
        "KEY' or 'x-api-key: KEY'; repeatable, each key its own --cache-scope; "
        "default: $MLX_RWKVX_API_KEY, else none)"
    )
    api_key_file: str | None = opt(
        "a file of keys as --api-key takes, one a line (blank lines and "
        "# comments skipped): kept out of the process list"
    )
    cache_scope: str = opt(
        "who shares saved states: each key its own (a client never resumes, "
        "nor learns of, another key's conversation), or every client",
        default="key",
        choices=("key", "shared"),
    )
    allowed_hosts: list[str] | None = opt(
        "on a loopback --host, also answer requests whose Host header names "
        "this (repeatable; '*': any). Without it only localhost, 127.x.x.x "
        "and [::1]: a web page cannot reach the server by DNS "
        "rebinding"
    )
    quantize: str | None = opt(
        "quantize the weights as they load (bare: int8)", choices=("int8", "int4"), const="int8"
    )
    dtype: str | None = opt(
        "cast the float weights: float32, bfloat16, float16 (default: as stored)",
        choices=("float32", "bfloat16", "float16"),
    )
    chat_template: str | None = opt(
        "rwkv, chatml, or a Jinja template file (default: the tokenizer's own, else rwkv)"
    )
    max_tokens: int = opt("the most tokens of an answer that does not say", default=512, ge=1)
    max_request_tokens: int = opt(
        "refuse (400) a request whose answers ask for more tokens "
        "than this in all (max_tokens, or max_completion_tokens, "
        "times n times its prompts)",
        default=8192,
        ge=1,
    )
    temp: float = opt(
        "sampling temperature of a request that does not say (0: greedy)",
        "temperature",
        default=0.0,
        **SAMPLING_LIMITS["temp"],
    )
    top_p: float = opt(
        "nucleus sampling of a request that does not say (0 or 1: off)",
        default=0.0,
        **SAMPLING_LIMITS["top_p"],
    )
    top_k: int = opt(
        "top-k sampling of a request that does not say (0: off)",
        default=0,
        **SAMPLING_LIMITS["top_k"],
    )
    min_p: float = opt(
        "min-p sampling of a request that does not say (0: off)",
        default=0.0,
        **SAMPLING_LIMITS["min_p"],
    )
    max_prompt_tokens: int = opt(
        "refuse (400) a request whose prompts (or embeddings inputs) "
        "hold more tokens than this in all",
        default=DEFAULT_MAX_PROMPT_TOKENS,
        ge=1,
    )
    max_n: int = opt("the most answers one request may ask for (n)", default=8, ge=1)
    max_inputs: int = opt(
        "refuse (400) a request of more prompts than this (text completions: "
        "prompts times n) or more inputs (embeddings)",
        default=256,
        ge=1,
    )
    max_body_bytes: int = opt(
        "refuse (413) a request body of more bytes than this, before it is read",
        default=16 << 20,
        ge=1,
    )
    decode_concurrency: int = opt(
        "the most answers decoded together, in one batch (more wait their turn)", default=32, ge=1
    )
    max_queue: int = opt(
        "requests that may wait while one runs; more are refused (429)", default=64, ge=1
    )
    cache_bytes: int = opt(
        "bytes of saved conversation states per served model (base and "
        "each adapter; least recently used go first; 0: none)",
        default=DEFAULT_CACHE_BYTES,
        ge=0,
    )
    cache_dir: str | None = opt(
        "also keep the saved states in this folder, so that a restart "
        "resumes every conversation (private: 0700; several servers may "
        "share it; at start, the states of configurations no server serves "
        "are removed, so that it holds at most --cache-bytes per served "
        "model)"
    )
    max_cache: int | None = opt(
        "tokens the attention blocks' KV caches hold (default: the model's own, else 2048)",
        "max_kv_size",
        ge=1,
    )
    embedding_pooling: str = opt(
        "how /v1/embeddings pools the final hidden states: mean of "
        "every token's, or the last token's",
        default="mean",
        choices=("mean", "last"),
    )
    shutdown_timeout: float = opt(
        "seconds requests in flight may take to finish after Ctrl-C or SIGTERM", default=10.0, ge=0
    )
    log_level: str = opt(
        "the server's log level", default="info", choices=("debug", "info", "warning", "error")
    )

    def check_together(self) -> None:
        if self.max_tokens > self.max_request_tokens:
            raise UsageError(
                f"--max-tokens {self.max_tokens} is more than --max-request-tokens "
                f"{self.max_request_tokens} (the most a request may ask for)"
            )


def _refuse_unsafe_cache_dir(cfg: ServerConfig) -> None:
    """--cache-dir passes the one check of every command's outputs, and is a folder if it is
    there."""
    if cfg.cache_dir is None:
        return
    try:
        check_not_unsafe(cfg.cache_dir, "--cache-dir")
    except TargetError as e:
        raise UsageError(str(e)) from None
    if os.path.exists(cfg.cache_dir) and not os.path.isdir(cfg.cache_dir):
        raise UsageError(
            f"--cache-dir {cfg.cache_dir}: not a folder (the states go in folders "
            "of their own inside it; nothing else there is touched)"
        )


def api_keys(cfg: ServerConfig) -> list[str]:
    """The keys a request may carry: each ``--api-key``, each key of ``--api-key-file``, else
    ``$MLX_RWKVX_API_KEY``; none: every request is answered. An empty key (``--api-key ""``,
    the variable set but empty, a file with no key) would switch the check off unseen, and a
    key with a space or a character outside printable ASCII could never be sent as it was
    written: each a ``UsageError``."""
    given = [("--api-key", k) for k in cfg.api_key or []]
    if cfg.api_key_file is not None:
        where = f"--api-key-file {cfg.api_key_file}"
        try:
            with open(cfg.api_key_file, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"{where}: {getattr(e, 'strerror', None) or e}") from None
        found = [
            (f"{where} line {n}", line.strip())
            for n, line in enumerate(lines, 1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
        if not found:
            raise UsageError(
                f"{where}: no key in it (one a line; blank lines and # comments are skipped)"
            )
        given += found
    if not given and "MLX_RWKVX_API_KEY" in os.environ:
        given = [("$MLX_RWKVX_API_KEY", os.environ["MLX_RWKVX_API_KEY"])]
    for where, key in given:
        if not key:
            raise UsageError(
                f"{where}: an empty key (it would answer every request; give a "
                "key, or none to serve without one)"
            )
        if not (key.isascii() and key.isprintable()) or any(c.isspace() for c in key):
            raise UsageError(f"{where}: a key is printable ASCII without spaces")
    return list(dict.fromkeys(key for _, key in given))


def adapters(cfg: ServerConfig) -> list[tuple[str, str]]:
    """(name, path) of each ``--adapter``, checked: the path exists, the names are unique and
    none is the base's."""
    out: list[tuple[str, str]] = []
    for spec in cfg.adapter or []:
        name, sep, path = spec.partition("=")
        if not sep:
            path = spec
            name = os.path.splitext(os.path.basename(os.path.normpath(spec)))[0]
        if not name or not path:
            raise UsageError(f"--adapter {spec!r}: give NAME=PATH (or a PATH)")
        if not os.path.exists(path):
            raise UsageError(f"--adapter {spec}: {path}: no such file or folder")
        if name == cfg.model or name in (n for n, _ in out):
            raise UsageError(f"--adapter {spec}: the name {name!r} is taken")
        out.append((name, path))
    return out


def build(cfg: ServerConfig, *, log=print) -> Engine:
    """Load the model and its adapters and make the engine (not started). UsageError for
    settings out of their limits (``cfg.check()``) or files that do not fit."""
    cfg.check()
    _refuse_unsafe_cache_dir(cfg)
    pairs = adapters(cfg)
    path = resolve_model(cfg.model)
    if not os.path.exists(path):
        raise UsageError(f"--model {cfg.model}: no such file or folder")
    if cfg.cache_dir is not None:  # the states never go into what the server reads
        try:
            resolve_target(cfg.cache_dir, what="--cache-dir", inputs=[path, *(p for _, p in pairs)])
        except TargetError as e:
            raise UsageError(str(e)) from None
    model, tokenizer = load(path, quantize=cfg.quantize, dtype=cfg.dtype)
    if tokenizer is None:
        raise UsageError(f"--model {cfg.model}: no tokenizer found beside it")
    fmt = chat_format(tokenizer, cfg.chat_template)
    tools = ToolCalls.of(tokenizer) if fmt.name == "tokenizer" else None
    max_cache = cfg.max_cache or default_max_cache(model)
    served: dict[str, Served] = {}
    for name, adapter in [(cfg.model, None), *pairs]:
        m = model if adapter is None else apply_adapter(share_weights(model), adapter)
        key = state_key(m, dtype=cfg.dtype, quantize=cfg.quantize, max_cache=max_cache)
        folder = None
        if cfg.cache_dir:  # one folder per key: a restart reads only its own states
            folder = folder_for(cfg.cache_dir, key)  # made by the cache, private
        cache = PrefixCache(cfg.cache_bytes, folder, key, model=m)
        loaded = cache.load()
        if loaded:
            log(f"{name}: {loaded} saved states loaded from {folder}")
        served[name] = Served(name, m, tokenizer, fmt, cache, adapter, tools)
    if cfg.cache_dir:  # each served model may fill its budget: other configurations' go
        trim_cache_dir(cfg.cache_dir)
    return Engine(
        served,
        max_queue=cfg.max_queue,
        max_cache=max_cache,
        prefill_step=DEFAULT_PREFILL_STEP,
        pooling=cfg.embedding_pooling,
        decode_concurrency=cfg.decode_concurrency,
    )


def main(argv: list[str] | None = None) -> None:
    cli.run(
        PROG,
        lambda: _main(settings.load(ServerConfig, argv, PROG)),
        kept="saved states are in --cache-dir, if given",
    )


def _main(cfg: ServerConfig) -> None:
    cfg = replace(cfg, api_key=api_keys(cfg), api_key_file=None)  # the keys create_app checks
    from mlx_rwkvx.server.app import create_app

    import uvicorn

    configure_and_prepare()
    engine = build(cfg, log=lambda line: print(line, file=sys.stderr))
    if not loopback(cfg.host) and not cfg.api_key:
        print(
            f"{PROG}: warning: listening on {cfg.host} with no --api-key: anyone who reaches "
            "it can use it",
            file=sys.stderr,
        )
    logging.basicConfig(level=cfg.log_level.upper(), format="%(levelname)s: %(message)s")
    config = uvicorn.Config(
        create_app(engine, cfg),
        host=cfg.host,
        port=cfg.port,
        log_level=cfg.log_level,
        lifespan="off",  # no start-up work
        timeout_graceful_shutdown=cfg.shutdown_timeout,
    )
    server = uvicorn.Server(config)
    server.install_signal_handlers = lambda: None  # the main thread's handlers below
    http = threading.Thread(target=server.run, name="http", daemon=True)
    stop = threading.Event()
    deadline = threading.Timer(cfg.shutdown_timeout, engine.cancel_all)

    def on_signal(signum, frame):
        """Ctrl-C or SIGTERM: refuse new requests and let the HTTP server close once those in
        flight finished, which the engine goes on serving for ``--shutdown-timeout`` seconds
        (a second signal: at once); then whatever still runs or waits is cancelled."""
        if stop.is_set():
            engine.cancel_all()
            server.force_exit = True  # uvicorn waits no more for connections to close
            return
        stop.set()
        engine.closing = True
        server.should_exit = True
        deadline.start()

    handlers = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        http.start()
        while not (server.started or not http.is_alive()):
            time.sleep(0.01)
        if not server.started:
            raise UsageError(
                f"cannot listen on {cfg.host}:{cfg.port} (in use, or not an "
                "address of this machine)"
            )
        print(
            f"{PROG}: serving {', '.join(engine.served)} at http://{cfg.host}:{cfg.port}/v1",
            file=sys.stderr,
            flush=True,
        )
        engine.run(until=lambda: not http.is_alive())  # it ends after a signal
    finally:
        deadline.cancel()
        engine.cancel_all()
        for s, old in handlers.items():
            signal.signal(s, old)
        http.join(timeout=5)
    print(f"{PROG}: stopped", file=sys.stderr)
