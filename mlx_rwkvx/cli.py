"""What every command does around its work (``python -m mlx_rwkvx.<cmd>``): an error the
user can cause is one line ``mlx_rwkvx.<cmd>: error: ...`` and exit code 2; Ctrl-C and
SIGTERM stop it cleanly (temporary files removed, one line saying what was kept) with exit code
130 or 143; a bug keeps its traceback.

User errors are ``mlx_rwkvx.errors.UserError`` and the ``OSError`` numbers in ``USER_ERRNOS``
(a full disk, a file-size limit, no permission, a read-only disk, a path that cannot resolve).
"""

from __future__ import annotations

import errno
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn, TypeVar

from mlx_rwkvx.errors import UserError

T = TypeVar("T")

_USER_ERRNO_NAMES = ("ENOSPC", "EDQUOT", "EFBIG", "EACCES", "EPERM", "EROFS", "ELOOP",
                     "ENAMETOOLONG", "ENOTDIR", "EISDIR")  # fmt: skip
USER_ERRNOS = frozenset(getattr(errno, n) for n in _USER_ERRNO_NAMES if hasattr(errno, n))
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as shells report


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM: ``signum``, and ``kept``, what the command kept (one line:
    ``saved checkpoint_12``)."""

    def __init__(self, signum: int = signal.SIGINT, kept: str = ""):
        super().__init__(kept)
        self.signum, self.kept = signum, kept


def signal_of(e: BaseException) -> int:
    """The signal behind a KeyboardInterrupt (SIGINT unless it says otherwise)."""
    return getattr(e, "signum", signal.SIGINT)


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


def os_error_text(e: OSError) -> str:
    """``path: reason`` of an OSError (both paths of a rename)."""
    what = e.strerror or str(e)
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    return ": ".join([" -> ".join(map(str, paths)), what] if paths else [what])


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


def help_text(doc: str) -> str:
    """A module docstring as ``--help`` shows it: reStructuredText's double backquotes
    dropped."""
    return doc.replace("``", "")
