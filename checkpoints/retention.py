"""Which checkpoints to delete, and deleting them safely. Pure Python. The decision is
separate from the act: the control plane drops the catalogue rows in between.
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
    """Paths to delete, oldest first: all but the newest `keep_last` committed (at least
    2, so a corrupt newest one leaves a fallback), and uncommitted folders older than the
    newest committed (newer ones may be saves in progress)."""
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


def retention_plan(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """What `plan_retention` would delete under root (unreadable manifests count as
    uncommitted)."""
    found = scan(root)
    garbage = [*found.uncommitted, *(d for d, _reason in found.unreadable)]
    return plan_retention(found.committed, keep_last, uncommitted=garbage)


def delete_checkpoints(root: str | os.PathLike[str], paths: Sequence[Path]) -> None:
    """Delete the step folders `paths`, each directly in `root` (else refused), crash-safely
    and never through a link: `root` and its job folder are entered through none, and a
    link below is removed itself, not its target. One already gone is not an error."""
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
    """The manifest first, durably: a folder whose deletion is interrupted is then an
    uncommitted folder, never a committed checkpoint with missing shards."""
    with contextlib.suppress(OSError):  # not a folder (a link, a file): only the entry goes
        step_fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=root_fd)
        try:
            os.unlink(MANIFEST_NAME, dir_fd=step_fd)
            os.fsync(step_fd)
        finally:
            os.close(step_fd)
    remove_tree_at(root_fd, name)
