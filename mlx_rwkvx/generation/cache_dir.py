"""The folder of saved prefix states that several processes share (``PrefixCache``'s
``folder``; the server's ``--cache-dir`` holds one such folder per key): the states' files'
names (the files are ``io/states.py``'s saved states), the two lock files that make the folder
safe to share, and ``trim_cache_dir``, which removes what no running cache uses. Only folders
a cache made (holding its change lock) are ever touched, and in them only our own files."""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import re

from mlx_rwkvx.errors import CheckpointError
from mlx_rwkvx.io.states import read_header
from mlx_rwkvx.io.targets import remove_stale

LOCK_NAME = ".mlx_rwkvx-cache-lock"  # held a moment by each change; holds the change count
LIVE_NAME = ".mlx_rwkvx-cache-live"  # held shared by every cache that uses the folder
STATE_FILE = re.compile(r"[0-9a-f]{32}\.safetensors\Z")
KEY_FOLDER = re.compile(r"[0-9a-f]{16}\Z")
_COUNT_WIDTH = 20  # the change count, written in place at a fixed width


def folder_for(cache_dir: str, key: str) -> str:
    """The folder of a key's states inside a ``--cache-dir`` (one per key: a restart reads
    only its own states)."""
    return os.path.join(cache_dir, hashlib.sha256(key.encode()).hexdigest()[:16])


def open_locks(folder: str):
    """``folder`` made (0700, and its missing parents), and its two lock files: the live one
    held shared (for as long as it stays open) and the change one open. Retried where
    ``trim_cache_dir`` removed the folder meanwhile; an OSError where it cannot be made."""
    for _ in range(10):
        _make_private(folder)
        live = _open_lock(os.path.join(folder, LIVE_NAME))
        try:
            take_flock(live.fileno(), fcntl.LOCK_SH)
        except OSError:
            live.close()
            raise
        if not _still_there(live, os.path.join(folder, LIVE_NAME)):
            live.close()
            continue
        return live, _open_lock(os.path.join(folder, LOCK_NAME))
    raise OSError(errno.EBUSY, "removed again and again while opened", folder)


def trim_cache_dir(cache_dir: str, max_bytes: int = 0) -> int:
    """Remove saved states from the folders of ``cache_dir`` that no running cache uses (other
    configurations, earlier runs: their live lock is free), least recently used first, until
    they hold at most ``max_bytes`` together; also the temporary files of writers that died,
    and folders left holding only our lock files. A folder in use is never touched, nor one
    without our change lock (a cache made it first: a folder without it is not ours). Only our
    own files go (state files of our format inside key folders): nothing else there is.
    Returns how many states were removed.

    A server passes 0: each model it serves may fill its folder up to ``--cache-bytes``, so
    other configurations' states would put the whole folder over its budget."""
    try:
        names = sorted(os.listdir(cache_dir))
    except OSError:
        return 0
    total, unused, held = 0, [], []
    try:
        for name in names:
            folder = os.path.join(cache_dir, name)
            if not KEY_FOLDER.match(name) or os.path.islink(folder) or not os.path.isdir(folder):
                continue
            if not os.path.isfile(os.path.join(folder, LOCK_NAME)):  # not made by a cache
                continue
            live = _try_exclusive(os.path.join(folder, LIVE_NAME))
            if live is None:  # in use
                continue
            held.append((folder, live))
            remove_stale(folder)
            files = _state_files(folder)
            total += sum(s for _, s, _ in files)
            unused.extend(files)
        removed = 0
        for _, size, path in sorted(unused):
            if total <= max_bytes:
                break
            try:
                os.remove(path)
            except OSError:
                continue
            total -= size
            removed += 1
        for folder, _ in held:  # a folder left with only our lock files goes too
            if set(os.listdir(folder)) <= {LIVE_NAME, LOCK_NAME}:
                for name in (LOCK_NAME, LIVE_NAME):
                    try:
                        os.remove(os.path.join(folder, name))
                    except OSError:
                        pass
                try:
                    os.rmdir(folder)
                except OSError:
                    pass
        return removed
    finally:
        for _, live in held:
            live.close()


def _state_files(folder: str) -> list[tuple[int, int, str]]:
    """(mtime, size, path) of the saved states in ``folder`` (by name and header)."""
    out = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return out
    for entry in entries:
        if not STATE_FILE.match(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        try:
            read_header(entry.path)
            st = entry.stat(follow_symlinks=False)
        except (OSError, CheckpointError):
            continue
        out.append((st.st_mtime_ns, st.st_size, entry.path))
    return out


def _make_private(folder: str) -> None:
    """``folder`` and its missing parents made 0700; an existing ``folder`` made 0700 too (it
    is the cache's own); an existing parent is left as it is."""
    missing, path = [], os.path.abspath(folder)
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
    try:
        if os.stat(folder).st_mode & 0o077:
            os.chmod(folder, 0o700)
    except OSError:  # another user's folder we may write to: left as it is
        pass


def _open_lock(path: str, create: bool = True):
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT if create else 0)
    return os.fdopen(os.open(path, flags, 0o600), "r+b", 0)


def _still_there(f, path: str) -> bool:
    """Whether ``path`` is still the file ``f`` locked (not removed meanwhile)."""
    try:
        return os.stat(path).st_ino == os.fstat(f.fileno()).st_ino
    except FileNotFoundError:
        return False


def take_flock(fd: int, how: int) -> bool:
    """``flock(fd, how)``; False where the file system has none."""
    try:
        fcntl.flock(fd, how)
    except OSError as e:
        if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
            return False
        raise
    return True


def _try_exclusive(path: str):
    """The live lock file of a folder, held exclusively, or None when a cache uses the folder
    (or it cannot be locked, or there is none: not ours, or being made: left alone too)."""
    try:
        f = _open_lock(path, create=False)
    except OSError:
        return None
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        return None
    if not _still_there(f, path):
        f.close()
        return None
    return f


def read_change_count(fd: int) -> int:
    """The change count the change lock file holds (0 for a new one)."""
    text = os.pread(fd, _COUNT_WIDTH, 0)
    return int(text) if text.strip().isdigit() else 0


def write_change_count(fd: int, count: int) -> None:
    """``count`` written in place of the change lock file's count."""
    try:  # overwrites its own bytes: no room is taken, but a failing disk may still refuse
        os.pwrite(fd, f"{count % 10**_COUNT_WIDTH:0{_COUNT_WIDTH}d}".encode(), 0)
    except OSError:  # the others see it with the next change that is counted
        pass
