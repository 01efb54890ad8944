"""Reading one file a job's code could have written, as hostile input. Pure Python.

Regular files only (a FIFO would block the reader, a device has no end), never through a
link (one planted where a control file is expected would make the control plane read
another tenant's file), never past a stated size (a sparse file of any size). Used by the
control plane's checks of job folders (`elastrain.checkpoints.confined`) and of data areas
(`elastrain.contracts.prepared`). Errors name the file by its name, never by a server path.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO


class ConfinedFileError(ValueError):
    """A file or folder the control plane refuses to read or enter, and why."""


def open_regular(name: str, *, dir_fd: int | None = None) -> BinaryIO:
    """Regular file `name` (in folder `dir_fd`, or a path) open for reading, never through
    a link (nor a FIFO: opened without blocking). FileNotFoundError when there is none."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ConfinedFileError(
            f"cannot read {Path(name).name}: {exc.strerror} (a link is never followed)"
        ) from None
    f = os.fdopen(fd, "rb")
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        f.close()
        raise ConfinedFileError(f"{Path(name).name} is not a regular file")
    return f


def read_bounded(name: str, limit: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of regular file `name` (in folder `dir_fd`, or a path), never through a
    link, never more than `limit` bytes. FileNotFoundError when there is none."""
    with open_regular(name, dir_fd=dir_fd) as f:
        found = os.fstat(f.fileno())
        if found.st_size > limit:
            raise ConfinedFileError(
                f"{Path(name).name} is {found.st_size} bytes, more than the {limit} it may be"
            )
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ConfinedFileError(f"{Path(name).name} grew past {limit} bytes while read")
    return data
