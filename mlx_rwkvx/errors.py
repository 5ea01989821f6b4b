"""The project's error classes. Only a ``UserError`` (and the few ``OSError`` numbers a user
causes: a full disk, a read-only folder, no permission) becomes a one-line CLI error with exit
code 2; anything else is a bug and keeps its traceback."""

from __future__ import annotations


class UserError(ValueError):
    """Something the user gave or can change (a path, a flag, a file, the disk): one line that
    names the thing and what was expected."""


class TargetError(UserError):
    """An output path that must not be written: empty, a folder that holds the current one, an
    input of the command, a file of another kind, or one another process is writing."""
