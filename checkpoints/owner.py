"""Whose a job's folder is: the job's own, made by the control plane at its first launch,
and of one database, the one its fence names (`Fence.owner`).

Anything at a job's path before its first attempt is launched was not made for it: a
folder planted by another job's code under the next job id (shared storage is writable by
every job's workers), a link, a file, a folder left by another database. It is moved
aside (`<id>.set-aside-<ns>`, not deleted: it may be someone's data) and a fresh folder
made, so a new job never resumes from weights it did not train.

Job ids start at 1 in every database, and the storage root outlives databases: a control
plane started on a fresh database over the same storage would otherwise resume its job 1
from another database's job 1 (its checkpoints, its fence). Before a job's attempt is
launched, a folder whose fence names another database is moved aside, not deleted (it is
that database's data); that database's workers, still running somewhere, then find the
new fence naming another owner and write nothing more (`Fence.superseded`).
"""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

from elastrain.checkpoints.fence import FenceUnreadable, read_fence


def claim_job_folder(job_root: Path, owner: str, *, first_attempt: bool = False) -> Path | None:
    """Make `job_root` free for `owner`'s job: returns where what was there was moved, if
    anything was. At the job's `first_attempt` anything there is moved aside and an empty
    folder made; later, a folder whose fence names another database is (one whose fence
    names no owner, written before fences had owners, or cannot be read, is left where
    it is), and so is a link or a file where the folder should be."""
    try:
        found = os.lstat(job_root)
    except FileNotFoundError:
        found = None
    if found is not None and (first_attempt or not stat.S_ISDIR(found.st_mode)):
        moved = _move_aside(job_root, "set-aside")
        _make(job_root)
        return moved
    if found is None:
        _make(job_root)
        return None
    try:
        fence = read_fence(job_root)
    except FenceUnreadable:
        return None  # the fence is rewritten by the control plane (`advance_fence`)
    if not fence.owner or fence.owner == owner:
        return None
    return _move_aside(job_root, f"database-{fence.owner}")


def _move_aside(job_root: Path, why: str) -> Path:
    moved = job_root.with_name(f"{job_root.name}.{why}")
    if os.path.lexists(moved):
        moved = moved.with_name(f"{moved.name}-{time.time_ns()}")
    job_root.rename(moved)
    return moved


def _make(job_root: Path) -> None:
    job_root.parent.mkdir(parents=True, exist_ok=True)
    job_root.mkdir(exist_ok=True)
