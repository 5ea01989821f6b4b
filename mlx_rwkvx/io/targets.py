"""Where a command may write, so that nothing a user has is ever lost.

- ``resolve_target``: the real path of an output (symlinks and ``..`` resolved) after refusing
  one that must never be written: an empty path, ``/``, the home folder, the current folder or
  a folder above it, or a path that is, holds or lies inside one of the command's inputs.
- ``output_lock``: one writer per output. An OS advisory lock (``fcntl.flock``) on a small file
  beside the target, ``.mlx_rwkvx-lock.<name>``, held while the command runs: the kernel
  releases it when the process dies, however it dies; the file records the holder's pid for
  the message only, and is removed when the lock is let go.
- Temporary files and folders are named ``.mlx_rwkvx-tmp-<pid>.new.<name>`` (what is being
  written), ``.mlx_rwkvx-tmp-<pid>.old.<name>`` (a folder being replaced, for the moment
  between its two renames) and ``.mlx_rwkvx-tmp-<pid>.del.<name>`` (the replaced folder while
  it is deleted). No reader takes them for results (they are hidden, and readers skip the
  prefix); ``remove_stale`` deletes those of processes that are no longer alive (and puts back
  an ``old`` one whose replacement never arrived), called while holding the lock.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from mlx_rwkvx.errors import TargetError

TMP_PREFIX = ".mlx_rwkvx-tmp-"
LOCK_PREFIX = ".mlx_rwkvx-lock."
_TEMP = re.compile(re.escape(TMP_PREFIX) + r"(\d+)\.(new|old|del)\.(.+)\Z", re.DOTALL)
LOCK_IN_FOLDER = LOCK_PREFIX.rstrip(".")  # the lock of a folder kept inside it (train's output)


def temp_path(path: str, role: str = "new") -> str:
    """The temporary name beside ``path`` of this process (``role``: new, old or del)."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f"{TMP_PREFIX}{os.getpid()}.{role}.{name}")


def is_temp(name: str) -> bool:
    """Whether a file name is one of our temporary names (a reader skips it)."""
    return name.startswith(TMP_PREFIX)


def reason(e: OSError) -> str:
    """An OSError's reason in words (``No space left on device``)."""
    return e.strerror or str(e) or type(e).__name__


def _real(path: str) -> str:
    return os.path.realpath(path)


def _same(a: str, b: str) -> bool:
    """Whether two real paths name the same file or folder (by inode where both exist: a
    case-insensitive disk spells one name several ways)."""
    if a == b:
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.normcase(a) == os.path.normcase(b)


def _within(path: str, folder: str) -> bool:
    """Whether the real path ``path`` is ``folder`` or lies below it."""
    while True:
        if _same(path, folder):
            return True
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent


def check_not_unsafe(path, what: str = "output") -> str:
    """The real path of ``path``; TargetError for an empty path, ``/``, the home folder, or the
    current folder or one above it (a writer that replaces its target would delete them)."""
    if not isinstance(path, (str, os.PathLike)) or isinstance(path, bytes):
        raise TypeError(f"{what}: expected a str or a pathlib.Path, got {path!r}")
    shown = os.fspath(path)
    if shown == "":
        raise TargetError(f"{what}: the path is empty; name a file or folder to write")
    real = _real(shown)
    label = f"{what} {shown}" + (f" ({real})" if real != os.path.abspath(shown) else "")
    if real == os.sep:
        raise TargetError(f"{label}: is the root folder; name a file or folder to write")
    home = os.path.expanduser("~")
    if home not in ("~", os.sep) and _same(real, _real(home)):
        raise TargetError(f"{label}: is the home folder; name a file or folder inside it")
    try:
        cwd = _real(os.getcwd())
    except OSError:  # the current folder was removed: nothing to protect there
        cwd = None
    if cwd is not None and _within(cwd, real):
        where = "is the current folder" if _same(cwd, real) else "holds the current folder"
        raise TargetError(f"{label}: {where}; name a new file or folder inside it")
    return real


def resolve_target(path, *, what: str = "output", inputs: Iterable = ()) -> str:
    """Where the output ``path`` is written: its folder's real path and its own name, so that
    a symbolic link there is replaced itself, never what it points to. TargetError when its
    real path is unsafe (see ``check_not_unsafe``), or is, holds or lies inside one of
    ``inputs`` (paths the command reads; None skipped)."""
    real = check_not_unsafe(path, what)
    shown = os.fspath(path)
    for given in inputs:
        if given is None or not os.path.lexists(os.fspath(given)):
            continue
        source = _real(os.fspath(given))
        if _same(real, source):
            relation = "is"
        elif _within(source, real):
            relation = "holds"
        elif _within(real, source) and os.path.isdir(source):
            relation = "lies inside"
        else:
            continue
        raise TargetError(
            f"{what} {shown}: {relation} the input {os.fspath(given)}; write somewhere else "
            "(an output never replaces or goes into what the command reads)"
        )
    folder, name = os.path.split(os.path.abspath(shown))
    return os.path.join(_real(folder), name)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's process, alive
        pass
    return True


def remove_path(path: str) -> None:
    """Remove a file, a link or a folder tree; errors ignored."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        try:
            os.remove(path)
        except OSError:
            pass


def remove_stale(folder: str, name: str | None = None) -> list[str]:
    """Delete the temporary files and folders in ``folder`` (for the target ``name``, or all)
    left by processes that are no longer alive; an ``old`` one whose target is missing (a
    replacement cut short between its renames) is renamed back instead. Returns what was
    removed or restored. Call it while holding the target's ``output_lock``, before writing:
    this process's own pid counts as gone (a container's pid 1 was an earlier run's too)."""
    try:
        entries = os.listdir(folder)
    except OSError:
        return []
    done = []
    for entry in sorted(entries):
        found = _TEMP.match(entry)
        if found is None or (name is not None and found.group(3) != name):
            continue
        pid, role, target = int(found.group(1)), found.group(2), found.group(3)
        if pid != os.getpid() and _alive(pid):
            continue
        path, target_path = os.path.join(folder, entry), os.path.join(folder, target)
        if role == "old" and not os.path.lexists(target_path):  # ("del": never put back)
            try:
                os.rename(path, target_path)
                done.append(target_path)
                continue
            except OSError:
                pass
        remove_path(path)
        done.append(path)
    return done


def _lock_holder(fd: int) -> str:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        text = os.read(fd, 64).decode("ascii", "replace").strip()
    except OSError:
        text = ""
    return f"process {text}" if text.isdigit() else "another process"


def make_parents(path: str, what: str = "output") -> list[str]:
    """Create the missing folders above ``path``; return them, innermost first (for
    ``remove_empty``). TargetError when a file stands where a folder must be."""
    made, parent = [], os.path.dirname(path)
    while parent and not os.path.exists(parent):
        made.append(parent)
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise TargetError(f"{what} {path}: {parent} is a file, not a folder")
    try:
        for folder in reversed(made):
            os.mkdir(folder)
    except OSError as e:
        remove_empty(made)
        raise TargetError(f"{what} {path}: cannot create its folder ({reason(e)})") from e
    return made


def remove_empty(folders: list[str]) -> None:
    """Remove the folders ``make_parents`` made (innermost first) while they are empty."""
    for folder in folders:
        try:
            os.rmdir(folder)
        except OSError:
            break


@contextmanager
def output_lock(path: str, what: str = "output", *, inside: bool = False) -> Iterator[None]:
    """Hold the lock of the output ``path`` (a real path: see ``resolve_target``) while the
    block runs: TargetError naming the holder when another process holds it, or when the
    folder cannot take the lock file (no permission, a read-only disk). The lock file lies
    beside ``path``, or, with ``inside`` (a folder that is added to, never replaced: train's
    output), in it, so that a folder of one's own under a read-only parent can be locked.
    Missing folders (``path`` too with ``inside``) are created, and removed again at the end if
    they stayed empty. Where the file system has no locks, one note says so and the block runs
    unlocked."""
    made = make_parents(os.path.join(path, LOCK_IN_FOLDER) if inside else path, what)
    folder, name = (path, None) if inside else os.path.split(path)
    lock = os.path.join(folder, LOCK_IN_FOLDER if inside else LOCK_PREFIX + name)
    fd, held = None, False
    try:
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    print(
                        f"note: {what} {path}: this file system has no locks, so another "
                        "writer would not be noticed",
                        file=sys.stderr,
                    )
                    held = True
                    break
                holder = _lock_holder(fd)
                os.close(fd)
                fd = None
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    raise TargetError(
                        f"{what} {path}: {holder} is writing it now; wait for it to finish, "
                        "or choose another output"
                    ) from None
                raise
            try:  # the previous holder may have removed the file between our open and lock
                same = os.stat(lock).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                held = True
                break
            os.close(fd)
            fd = None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
    except BaseException as e:
        if held:  # ours (a full disk refused the pid): never left behind
            try:
                os.unlink(lock)
            except OSError:
                pass
        if fd is not None:
            os.close(fd)
        remove_empty(made)
        if isinstance(e, OSError):
            raise TargetError(f"{what} {path}: cannot write there ({reason(e)})") from e
        raise
    try:
        yield
    finally:
        try:
            os.unlink(lock)  # still holding it: a process waiting on the old file retries
        except OSError:
            pass
        os.close(fd)
        remove_empty(made)
