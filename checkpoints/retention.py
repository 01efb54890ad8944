"""Which checkpoints to delete, and deleting them safely. Pure Python.

The decision (`plan_retention`, `retention_plan` on a folder) is separate from the act
(`delete_checkpoints`): the control plane drops the catalogue rows of what a plan names
between the two (`elastrain.service.executor`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from pathlib import Path

from elastrain.checkpoints._fs import fsync_dir, remove_tree
from elastrain.checkpoints.catalog import CheckpointInfo, scan
from elastrain.checkpoints.layout import MANIFEST_NAME, StepDir

MIN_KEEP_LAST = 2


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
    missing shards. Already-missing files or folders are not errors."""
    root = Path(path)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(root / MANIFEST_NAME)
        fsync_dir(root)
    remove_tree(root)


def retention_plan(root: str | os.PathLike[str], keep_last: int) -> list[Path]:
    """Scan root and say what `plan_retention` would delete (reads only).

    Unreadable manifests count as uncommitted garbage when older than the newest committed
    checkpoint.
    """
    found = scan(root)
    garbage = [*found.uncommitted, *(d for d, _reason in found.unreadable)]
    return plan_retention(found.committed, keep_last, uncommitted=garbage)


def delete_checkpoints(root: str | os.PathLike[str], paths: Sequence[Path]) -> None:
    for path in paths:
        delete_checkpoint(path)
    if paths:
        fsync_dir(root)
