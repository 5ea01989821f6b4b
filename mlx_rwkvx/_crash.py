"""Crash points for tests: ``MLX_RWKVX_CRASH_AT=<point>[:<at>][:<SIGNAL>]`` makes the process
send itself a signal (``KILL`` by default, as a power cut would; ``TERM``, ``INT``, ``STOP``)
when it reaches the named point (only at ``<at>`` where given: a step, a file name), so that
tests interrupt real commands at named moments rather than after a sleep.

Points: ``step`` (train: step ``<at>`` done, before its checkpoint), ``save`` (train: the
tensors of checkpoint ``<at>`` written, its manifest not yet), ``commit`` (any atomic write of
a file or folder named ``<at>``: the temporary written, not yet renamed into place: convert,
merge, save, each file of a checkpoint), ``eval`` (the loss on a data set: batch ``<at>``
evaluated, counting from 1: the trainer's validation and ``evaluate``), ``window`` (train
--carry-state: ``<step>.<n>``, the n-th window of that step evaluated).

Under ``mlx.launch``, ``MLX_RWKVX_CRASH_RANK=<r>`` keeps the crash point to rank ``r`` (the
launcher's ``MLX_RANK``): one Mac of several interrupted.
"""

from __future__ import annotations

import os
import signal

SIGNALS = ("KILL", "TERM", "INT", "STOP", "HUP")


def crash_point(name: str, at: int | str | None = None) -> None:
    spec = os.environ.get("MLX_RWKVX_CRASH_AT")
    if not spec:
        return
    parts = spec.split(":")
    sig = parts.pop() if len(parts) > 1 and parts[-1] in SIGNALS else "KILL"
    if parts[0] != name or (len(parts) > 1 and parts[1] != str(at)):
        return
    rank = os.environ.get("MLX_RWKVX_CRASH_RANK")
    if rank is not None and os.environ.get("MLX_RANK") != rank:
        return
    os.kill(os.getpid(), getattr(signal, "SIG" + sig))
