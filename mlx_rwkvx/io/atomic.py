"""Writing checkpoints so that nothing is ever half-written or silently replaced.

Everything is written under a temporary name beside the target (``io/targets.py``: hidden, with
the writer's pid), flushed to disk, then renamed over it in one step: an interrupted or failed
write (a full disk, a read-only folder, SIGTERM) leaves the target as it was and no temporary
file behind, and raises one ``CheckpointError`` naming the path and the reason (SIGKILL leaves
the temporary, which the next run on the target removes). An existing target is replaced only
when asked (``overwrite``), and only when it is what the writer writes (``recognise``: a
model, an adapter, a conversation, a ``.bin``), never a folder or file of anything else; a
target that would delete the current folder, the home folder or ``/`` is refused always.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mlx_rwkvx._crash import crash_point
from mlx_rwkvx.errors import CheckpointError, TargetError
from mlx_rwkvx.io.targets import (
    TMP_PREFIX,
    check_not_unsafe,
    is_temp,
    make_parents,
    reason,
    remove_empty,
    remove_path,
    temp_path,
)

import mlx.core as mx

__all__ = ["TMP_PREFIX", "CheckpointError", "atomic_target", "check_target", "is_temp"]


def _reason(e: BaseException) -> str:
    if isinstance(e, OSError):
        return reason(e)
    text = str(e) or type(e).__name__
    if "Unable to write" in text:  # how MLX's safetensors writer reports a short write
        text += "; is the disk full, or a file-size limit reached?"
    return text


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: str) -> None:
    for root, _, files in os.walk(path):
        for name in files:
            _fsync(os.path.join(root, name))
        _fsync(root)


def check_target(
    path: str,
    *,
    overwrite: bool,
    folder: bool,
    recognise: Callable[[str], bool] | None = None,
    kind: str = "a checkpoint",
) -> None:
    """Raise CheckpointError (TargetError for an unsafe path) unless ``path`` may be written:
    it does not exist, is an empty folder, or (``overwrite``) is a file or folder that
    ``recognise`` accepts as ``kind`` (what this writer writes). Never a path that would delete
    the current folder, the home folder or ``/``, and never a device, a pipe or a socket."""
    check_not_unsafe(path, "output")
    if not os.path.lexists(path):
        return
    if os.path.exists(path) and not (os.path.isdir(path) or os.path.isfile(path)):
        raise CheckpointError(
            f"{path}: not a regular file or folder (a device, a pipe or a socket); never written"
        )
    if os.path.isdir(path):
        if not folder:
            raise CheckpointError(f"{path}: is a folder; expected a file name")
        if not os.listdir(path):
            return
        if not overwrite:
            raise CheckpointError(
                f"{path}: already exists and is not empty (overwrite=True or --overwrite "
                "replaces it)"
            )
        if recognise is None or not recognise(path):
            raise CheckpointError(
                f"{path}: holds files that are not {kind}; refusing to replace the folder"
            )
        return
    if folder:
        raise CheckpointError(f"{path}: is a file; expected a folder")
    if not overwrite:
        raise CheckpointError(f"{path}: already exists (overwrite=True or --overwrite replaces it)")
    if recognise is not None and not recognise(path):
        raise CheckpointError(f"{path}: already exists and is not {kind}; refusing to replace it")


@contextmanager
def atomic_target(path: str, *, folder: bool) -> Iterator[str]:
    """Yield a temporary path beside ``path`` (an empty folder when ``folder``) to write into;
    on success it takes ``path``'s place (fsync, rename); on any failure it is removed, missing
    parent folders created for it are removed too, ``path`` is unchanged, and an I/O error
    becomes one CheckpointError. Call ``check_target`` first. A target that appears while it
    is written (another program's) is not replaced; a symbolic link at ``path`` is replaced
    itself, never what it points to."""
    check_not_unsafe(path, "output")
    path = os.path.abspath(path)
    try:
        made = make_parents(path)
    except TargetError as e:
        raise CheckpointError(str(e)) from e
    tmp = temp_path(path)  # ends in the target's name: MLX's writer insists on .safetensors
    remove_path(tmp)  # an earlier process's with this pid (a container's pid 1), never ours
    existed, old = os.path.lexists(path), None
    try:
        if folder:
            os.mkdir(tmp)
        yield tmp
        if folder:
            _fsync_tree(tmp)
        else:
            _fsync(tmp)
        crash_point("commit", os.path.basename(path))  # written, not yet renamed into place
        if not existed and os.path.lexists(path):
            raise CheckpointError(
                f"{path}: appeared while it was written (by another "
                "program?); left as it is, nothing written"
            )
        if folder and (os.path.isdir(path) or os.path.islink(path)):
            # a folder cannot be renamed over a link: the link goes aside like an old folder
            old = temp_path(path, "old")
            os.rename(path, old)
        os.replace(tmp, path)
    except BaseException as e:
        remove_path(tmp)
        if old is not None and not os.path.exists(path):
            os.rename(old, path)  # put the previous checkpoint back
            old = None
        remove_empty(made)
        if isinstance(e, (OSError, RuntimeError)) and not isinstance(e, CheckpointError):
            # RuntimeError: MLX's safetensors writer reports a failed write so
            raise CheckpointError(f"{path}: cannot write ({_reason(e)})") from e
        raise
    # written: what follows only makes it durable and tidy, and cannot undo it
    try:
        _fsync(os.path.dirname(path))
    except OSError:
        pass
    if old is not None:  # renamed first, so that a kill while deleting never brings it back
        doomed = temp_path(path, "del")
        try:
            os.rename(old, doomed)
        except OSError:
            doomed = old
        remove_path(doomed)


def save_safetensors(path: str, tensors: dict, metadata: dict | None = None) -> None:
    """``mx.save_safetensors`` to exactly ``path`` (which must end in ``.safetensors``)."""
    mx.save_safetensors(path, tensors, metadata=metadata or {})


def save_text(path: str, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def copy_file(src: str, dst: str) -> None:
    shutil.copyfile(src, dst)
