"""Small durable-filesystem helpers shared by the checkpoint modules. Pure Python."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a folder's entries (a rename or unlink is durable only once its parent
    folder is synced). Some filesystems (and Windows) cannot open a folder: best effort."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a reader sees either the old file, no file, or the
    complete new one, never a prefix: tmp file, fsync, rename over, fsync the folder."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    fsync_dir(path.parent)


def remove_tree(path: Path) -> None:
    """Delete a folder tree; entries that are already gone (a concurrent deleter, a crash
    half-way through an earlier attempt) are not errors."""
    try:
        entries = list(os.scandir(path))
    except FileNotFoundError:
        return
    except NotADirectoryError:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    for entry in entries:
        if entry.is_dir(follow_symlinks=False):
            remove_tree(Path(entry.path))
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(entry.path)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(path)
