"""What every command does around its work (``python -m mlx_rwkvx.<cmd>``): an error the
user can cause is one line ``mlx_rwkvx.<cmd>: error: ...`` and exit code 2; Ctrl-C and
SIGTERM stop it cleanly (temporary files removed, one line saying what was kept) with exit code
130 or 143; a bug keeps its traceback.

User errors are ``mlx_rwkvx.errors.UserError`` and the ``OSError`` numbers in
``errors.USER_ERRNOS`` (a full disk, a file-size limit, no permission, a read-only disk, a path
that cannot resolve).
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

from mlx_rwkvx.errors import (
    EXIT_CODES,
    USER_ERRNOS,
    Interrupted,
    UserError,
    os_error_text,
    signal_of,
)
from mlx_rwkvx.settings import help_text

T = TypeVar("T")
__all__ = [
    "EXIT_CODES",
    "USER_ERRNOS",
    "Interrupted",
    "fail",
    "help_text",
    "os_error_text",
    "run",
    "sigterm_as_interrupt",
    "signal_of",
]


def _raise_terminated(signum, frame) -> None:
    raise Interrupted(signum)


@contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Interrupted(SIGTERM)`` (a KeyboardInterrupt) while the block runs, so
    that every ``finally`` and temporary-file cleanup runs as it does for Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def fail(prog: str, message: str) -> NoReturn:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr)
    sys.exit(2)


def run(prog: str, body: Callable[[], T], *, kept: str = "nothing written") -> T:
    """``body()``, with the command's errors and signals handled as the module docstring says.
    ``kept``: what an interruption leaves, unless the interruption says."""
    try:
        with sigterm_as_interrupt():
            return body()
    except UserError as e:
        fail(prog, str(e))
    except OSError as e:
        if e.errno not in USER_ERRNOS:
            raise
        fail(prog, os_error_text(e))
    except KeyboardInterrupt as e:
        print(f"{prog}: interrupted ({getattr(e, 'kept', '') or kept})", file=sys.stderr)
        sys.exit(EXIT_CODES.get(signal_of(e), 130))
