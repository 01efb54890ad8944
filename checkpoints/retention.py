"""Which checkpoints to delete, and deleting them safely. Pure Python.

The decision (`plan_retention`, `retention_plan` on a folder) is separate from the act
(`delete_checkpoints`): the control plane drops the catalogue rows of what a plan names
between the two (`elastrain.service.executor`).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

from elastrain.checkpoints.catalog import CheckpointInfo, scan
from elastrain.checkpoints.confined import (
    ConfinedFileError,
    open_dir,
    plain_name,
    remove_tree_at,
)
from elastrain.checkpoints.layout import MANIFEST_NAME, StepDir

MIN_KEEP_LAST = 2

log = logging.getLogger("elastrain.retention")


def plan_retention(
    infos: Sequence[CheckpointInfo],
    keep_last: int,
    *,
    uncommitted: Sequence[StepDir] = (),
) -> list[Path]:
    """Paths to delete, oldest first.

    Keeps the newest `keep_last` committed checkpoints (at least 2, so one corrupt newest
    checkpoint never leaves nothing to fall back to) and always the newest one. Uncommitted
    folders older than the newest committed checkpoint are garbage (crashed saves, half-done
    deletions); newer ones may be saves in progress and are kept.
    """
    if keep_last < MIN_KEEP_LAST:
        raise ValueError(f"keep_last must be >= {MIN_KEEP_LAST}, got {keep_last}")
    committed = sorted(infos, key=lambda i: i.sort_key, reverse=True)
    doomed: list[tuple[tuple[int, int], Path]] = [
        (info.sort_key, info.path) for info in committed[keep_last:]
    ]
    if committed:
        newest = committed[0].sort_key
        doomed += [(d.sort_key, d.path) for d in uncommitted if d.sort_key < newest]
    doomed.sort(key=lambda item: item[0])
    return [path for _key, path in doomed]


def delete_checkpoint(path: str | os.PathLike[str]) -> None:
    """Crash-safe deletion: the manifest goes first (and durably), so a folder whose
    deletion was interrupted is an uncommitted folder, never a committed checkpoint with
    missing shards. Already-missing files or folders are not errors. Nothing is deleted
    through a link (`delete_checkpoints`)."""
    root = Path(path)
    delete_checkpoints(root.parent, [root])


def retention_plan(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Scan root and say what `plan_retention` would delete (reads only).

    Unreadable manifests count as uncommitted garbage when older than the newest committed
    checkpoint.
    """
    found = scan(root)
    garbage = [*found.uncommitted, *(d for d, _reason in found.unreadable)]
    return plan_retention(found.committed, keep_last, uncommitted=garbage)


def delete_checkpoints(root: str | os.PathLike[str], paths: Sequence[Path]) -> None:
    """Delete the step folders `paths`, each directly in `root` (a job's checkpoints
    folder), never through a link: `root` and its job folder are entered without
    following one, and below them `confined.remove_tree_at` removes a link itself, never
    what it points to. A path elsewhere than directly in `root` is refused."""
    if not paths:
        return
    root = Path(root)
    for path in paths:
        if Path(path).parent != root or not plain_name(Path(path).name):
            raise ValueError(f"{Path(path).name}: not a step folder of this job")
    try:
        fd = open_dir(root.parent.parent, root)
    except FileNotFoundError:
        return
    except ConfinedFileError as exc:
        log.warning("retention of %s: %s; nothing deleted", root.parent.name, exc)
        return
    try:
        for path in paths:
            _delete_step(fd, Path(path).name)
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _delete_step(root_fd: int, name: str) -> None:
    try:
        step_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
    except FileNotFoundError:
        return
    except OSError:  # a link or a file under a step folder's name: only the entry goes
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=root_fd)
        return
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(MANIFEST_NAME, dir_fd=step_fd)
            with contextlib.suppress(OSError):
                os.fsync(step_fd)
    finally:
        os.close(step_fd)
    remove_tree_at(root_fd, name)
