"""Which database a job's folder belongs to.

Job ids start at 1 in every database, and the storage root outlives databases: a control
plane started on a fresh database over the same storage would otherwise resume its job 1
from another database's job 1 (its checkpoints, its fence). The first launch of a job
marks the folder with the database's identity (`service.identity`); a folder marked by
another database is moved aside, not deleted (it is that database's data).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

OWNER_FILE = "database"


def claim_job_folder(job_root: Path, database: str) -> Path | None:
    """Make `job_root` this database's. Returns where another database's folder of the
    same job id was moved, if one was there. A folder without a mark (made before marks
    existed) is taken as it is."""
    marker = job_root / OWNER_FILE
    try:
        owner: str | None = marker.read_text().strip()
    except FileNotFoundError:
        owner = None
    if owner == database:
        return None
    moved = None
    if owner is not None:
        moved = job_root.with_name(f"{job_root.name}.database-{owner}")
        if moved.exists():
            moved = moved.with_name(f"{moved.name}-{time.time_ns()}")
        job_root.rename(moved)
    job_root.mkdir(parents=True, exist_ok=True)
    partial = marker.with_name(f".{OWNER_FILE}.tmp")
    partial.write_text(database)
    os.replace(partial, marker)
    return moved
