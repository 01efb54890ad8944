"""Small durable-filesystem helpers shared by the checkpoint modules. Pure Python."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from elastrain.checkpoints.confined import remove_tree_at


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
    """Delete a folder tree, never through a link (a link is removed itself, not what it
    points to); entries that are already gone (a concurrent deleter, a crash half-way
    through an earlier attempt) are not errors."""
    try:
        parent = os.open(Path(path).parent, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        remove_tree_at(parent, Path(path).name)
    finally:
        os.close(parent)
