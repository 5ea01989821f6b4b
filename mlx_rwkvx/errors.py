"""The project's error classes. A ``UserError`` (and the ``OSError`` numbers a user causes: a
full disk, a read-only folder, no permission) becomes one line ``mlx_rwkvx.<cmd>: error: ...``
and exit code 2 in a command (``mlx_rwkvx.cli.run``); anything else is a bug and keeps its
traceback. Each is a ``ValueError``, as the Python API has always raised them."""

from __future__ import annotations

import errno
import signal

# OSError numbers a user causes: a full disk or quota, a file-size limit, no permission, a
# read-only disk, a path that cannot resolve (a loop, too long, a file where a folder belongs)
USER_ERRNOS = frozenset(
    getattr(errno, n)
    for n in (
        "ENOSPC",
        "EDQUOT",
        "EFBIG",
        "EACCES",
        "EPERM",
        "EROFS",
        "ELOOP",
        "ENAMETOOLONG",
        "ENOTDIR",
        "EISDIR",
    )
    if hasattr(errno, n)
)
EXIT_CODES = {signal.SIGINT: 130, signal.SIGTERM: 143}  # 128 + the signal, as shells report


def in_words(items, last: str = "and") -> str:
    """A message's list: ``a``, ``a and b``, ``a, b and c`` (``last``: ``"or"`` for choices)."""
    items = list(items)
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} {last} {items[-1]}"


class UserError(ValueError):
    """Something the user gave or can change (a path, a flag, a file, the disk): one line that
    names the thing and what was expected."""


class UsageError(UserError):
    """Flags or arguments that do not fit together, or do not fit what they name."""


class TargetError(UserError):
    """An output path that must not be written: empty, a folder that holds the current one, an
    input of the command, a file of another kind, or one another process is writing."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read or written: the message names the file and the problem
    (and, for a bad tensor, the tensor)."""


class AdapterError(UserError):
    """An adapter that cannot be built, read, applied or merged as asked."""


class MergeError(AdapterError):
    """Adapters that cannot be merged as asked: the message names the problem."""


class DataError(UserError):
    """Bad training data: one line naming the file, the line, row or record, and the problem."""


class GenerationError(UserError):
    """What generation was given does not fit: a prompt the tokenizer cannot encode, ids outside
    the vocabulary, a prompt the KV cache cannot hold without the window, a chat template that
    does not render, sampling settings out of range. A ValueError, as the API raised before."""


class TrainError(UserError):
    """A run that cannot start or go on because of what it was given (exit 2)."""


class NonFinite(RuntimeError):
    """The loss or a gradient stopped being finite (exit 1; the last checkpoint stays)."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM: ``signum``, and ``kept``, what the command kept (one line:
    ``saved checkpoint_12``)."""

    def __init__(self, signum: int = signal.SIGINT, kept: str = ""):
        super().__init__(kept)
        self.signum, self.kept = signum, kept


def signal_of(e: BaseException) -> int:
    """The signal behind a KeyboardInterrupt (SIGINT unless it says otherwise)."""
    return getattr(e, "signum", signal.SIGINT)


def os_error_text(e: OSError) -> str:
    """``path: reason`` of an OSError (both paths of a rename)."""
    what = e.strerror or str(e)
    paths = [p for p in (e.filename, e.filename2) if p is not None]
    return ": ".join([" -> ".join(map(str, paths)), what] if paths else [what])
