"""``python -m mlx_rwkvx.server`` on a free localhost port, in a process of its own, for the
tests that talk to it with the ``openai`` client (the server's engine must own its process's
main thread: MLX's work happens there)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def chat_model(root, seed: int, name: str = "m") -> str:
    """A tiny RWKV-7 saved with a ChatML tokenizer under ``root/name`` (its path: the name it
    is served under), for a test module's server."""
    import mlx_rwkvx
    from helpers import chatml_tokenizer, tiny_model

    mlx_rwkvx.save(
        tiny_model("rwkv7", seed=seed, vocab_size=512),
        root / name,
        tokenizer=chatml_tokenizer(root / "tok"),
    )
    return str(root / name)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A running server: ``url`` (its ``/v1``), ``proc``, and, once ``stop`` returned, what it
    printed (``output``)."""

    def __init__(self, args, env=None, timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlx_rwkvx.server",
                *map(str, args),
                "--port",
                str(self.port),
                "--log-level",
                "warning",
            ],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server ended: {self.proc.stdout.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("the server did not start") from None
                time.sleep(0.05)

    def stop(self, sig=signal.SIGTERM, timeout: float = 30.0) -> str:
        """Stop it with ``sig``; what it printed."""
        if getattr(self, "output", None) is not None:
            return self.output
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.output = self.proc.stdout.read()
        return self.output


@contextlib.contextmanager
def serving(*args, env=None):
    """A ``Server`` of these command-line arguments for the block, stopped after it."""
    server = Server(args, env)
    try:
        yield server
    finally:
        server.stop()
