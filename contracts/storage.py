"""Where a job's files live under the storage root (shared by every Ray node).

```
<storage>/jobs/<job id>/
    fence.json                            which attempt may write (elastrain.checkpoints.fence)
    checkpoints/step_<step>-a<attempt>/   one folder per checkpoint (elastrain.checkpoints.layout)
    logs/attempt-<NNN>-rank-<R>.log       one file per rank and attempt
    files/                                a command job's own files (ELASTRAIN_JOB_DIR)
```

The API reads logs from here, the scheduler fences attempts and deletes checkpoints here,
and the workers write here: one definition, so they never disagree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

_ATTEMPT_IN_PATH = re.compile(r"attempt[-_]?(\d+)", re.IGNORECASE)


@dataclass(frozen=True, slots=True)
class JobStorage:
    root: Path
    """`<storage>/jobs/<job id>`."""

    @classmethod
    def of(cls, storage_path: str | os.PathLike[str], job_id: int) -> JobStorage:
        return cls(root=Path(storage_path) / "jobs" / str(int(job_id)))

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def files(self) -> Path:
        """A command job's own folder (`ELASTRAIN_JOB_DIR`): its script's checkpoints."""
        return self.root / "files"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    def log_file(self, *, attempt: int, rank: int) -> Path:
        return self.logs / log_file_name(attempt=attempt, rank=rank)


def log_file_name(*, attempt: int, rank: int) -> str:
    return f"attempt-{attempt:03d}-rank-{rank}.log"


def attempt_of_log(rel_path: str) -> int:
    """The attempt a log file belongs to: the number after `attempt` in its relative path
    (also `attempt_3/rank0.log`, from a user's own logging); 0 when there is none."""
    found = _ATTEMPT_IN_PATH.findall(rel_path)
    return int(found[-1]) if found else 0
