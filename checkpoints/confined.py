"""File operations of the control plane on folders a job's code can write. Pure Python.

A job's code can put anything in its job folder: links to another tenant's data or out of
the storage root, FIFOs, sparse files of any size. Whatever the control plane (API,
scheduler, and the export task, which reads it as hostile input too) does there goes through these helpers:

- folders are opened one component at a time from a root the caller trusts, each with
  `O_NOFOLLOW`, and what is below is reached through the folder's fd (`dir_fd=`), so a
  link swapped in between a check and a use is never followed (`open_dir`, `walk_dir`);
- control files (manifests, fences) are read only when they are regular files, through
  no link, and never past a stated size (`read_bounded`).

The errors name files by their name in the job folder, never by a server path.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

# Reading one file as hostile input lives with the contracts (data areas need it too).
from elastrain.contracts.files import ConfinedFileError as ConfinedFileError
from elastrain.contracts.files import open_regular as open_regular
from elastrain.contracts.files import read_bounded as read_bounded

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW


def plain_name(name: str) -> bool:
    """A single path component that stays in its folder."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\0" not in name


def open_dir(trusted_root: Path, folder: Path) -> int:
    """An fd of `folder`, opened from `trusted_root` (the caller trusts it: the storage
    root) one component at a time without following a link at any step below it. The
    caller closes it."""
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
    """Delete `name` in the folder `parent_fd` and everything below it, never through a
    link: a link is removed itself, its target left alone. Entries already gone are not
    errors (a concurrent deleter, a crash half-way through an earlier attempt)."""
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
