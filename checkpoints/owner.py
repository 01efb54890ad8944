"""Which database a job's folder belongs to: the one its fence names (`Fence.owner`).

Job ids start at 1 in every database, and the storage root outlives databases: a control
plane started on a fresh database over the same storage would otherwise resume its job 1
from another database's job 1 (its checkpoints, its fence). Before a job's attempt is
launched, a folder whose fence names another database is moved aside, not deleted (it is
that database's data); that database's workers, still running somewhere, then find the
new fence naming another owner and write nothing more (`Fence.superseded`).
"""

from __future__ import annotations

import time
from pathlib import Path

from elastrain.checkpoints.fence import FenceUnreadable, read_fence


def claim_job_folder(job_root: Path, owner: str) -> Path | None:
    """Make `job_root` free for `owner`'s job: returns where another database's folder of
    the same job id was moved, if one was there. A folder whose fence names no owner
    (written before fences had owners) or cannot be read is left where it is."""
    try:
        fence = read_fence(job_root)
    except FenceUnreadable:
        return None  # the fence is rewritten by the control plane (`advance_fence`)
    if not fence.owner or fence.owner == owner:
        return None
    moved = job_root.with_name(f"{job_root.name}.database-{fence.owner}")
    if moved.exists():
        moved = moved.with_name(f"{moved.name}-{time.time_ns()}")
    job_root.rename(moved)
    return moved
