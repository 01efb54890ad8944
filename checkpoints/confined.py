"""File operations on folders a job's code can write. Pure Python.

A job's code can put anything there: links to another tenant's data or out of the storage
root, FIFOs, sparse files. So folders are opened one component at a time from a trusted
root with `O_NOFOLLOW`, and what is below is reached through the folder's fd: a link
swapped in between a check and a use is never followed. Errors name files by their name
in the job folder, never by a server path.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from elastrain.contracts.files import ConfinedFileError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def plain_name(name: str) -> bool:
    """A single path component that stays in its folder."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def open_dir(trusted_root: Path, folder: Path) -> int:
    """An fd (the caller closes it) of `folder`, opened from `trusted_root` one component
    at a time, through no link."""
    try:
        parts = Path(folder).relative_to(trusted_root).parts
    except ValueError:
        raise ConfinedFileError(f"{folder.name} is outside its job's folder") from None
    fd = os.open(trusted_root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for part in parts:
            if not plain_name(part):
                raise ConfinedFileError(f"{part!r} in a path")
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise ConfinedFileError(
                    f"{part} is a link or not a folder ({exc.strerror}): not entered"
                ) from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def is_real_dir(path: Path) -> bool:
    """A folder, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_tree_at(parent_fd: int, name: str) -> None:
    """Delete `name` in the folder `parent_fd` and all below it, never through a link (a
    link is removed, its target left alone). Entries already gone are not errors."""
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return
    except OSError:  # a link, a file, a FIFO: the entry itself goes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=parent_fd)
        return
    try:
        with os.scandir(fd) as entries:
            names = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        for child, is_dir in names:
            if is_dir:
                remove_tree_at(fd, child)
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(child, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(name, dir_fd=parent_fd)


def remove_tree(path: Path) -> None:
    """`remove_tree_at` by path: the folder `path` itself is not entered through a link."""
    try:
        parent = os.open(Path(path).parent, os.O_RDONLY | os.O_DIRECTORY)
    except FileNotFoundError:
        return
    try:
        remove_tree_at(parent, Path(path).name)
    finally:
        os.close(parent)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a folder's entries (renames, unlinks); best effort."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write `data` to `path` so a reader sees the old file, none, or the whole new one."""
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
