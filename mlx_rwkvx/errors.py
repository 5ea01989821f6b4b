"""The project's error classes. A ``UserError`` (and the ``OSError`` numbers a user causes: a
full disk, a read-only folder, no permission) becomes one line ``mlx_rwkvx.<cmd>: error: ...``
and exit code 2 in a command (``mlx_rwkvx.cli.run``); anything else is a bug and keeps its
traceback. Each is a ``ValueError``, as the Python API has always raised them."""

from __future__ import annotations


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


class TrainError(UserError):
    """A run that cannot start or go on because of what it was given (exit 2)."""


class NonFinite(RuntimeError):
    """The loss or a gradient stopped being finite (exit 1; the last checkpoint stays)."""
