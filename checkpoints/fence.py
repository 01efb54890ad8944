"""The attempt fence on shared storage: which attempt of a job is the current one.

The database says which attempt is current, and fences every report by attempt number. But
an attempt's workers also write to shared storage, and a worker cut off from the control
plane (a network partition: its node is declared dead, yet its processes live on) can
still reach the storage. If the whole old worker group sits on such a node it even keeps
training, and would commit checkpoints that a later attempt might resume from.

So before launching attempt N the control plane writes `<job>/fence.json` (attempt numbers
with the time each started; it only ever grows). Writers check it:

- the training loop, every step: an attempt that is no longer current stops;
- the checkpoint committer, right before it writes a manifest: a superseded attempt's
  checkpoint is never committed;
- the catalogue, when picking a checkpoint to resume from: one committed by an attempt after
  a newer attempt had started is skipped (this closes the race between the committer's
  check and its write; it compares the committer's and the control plane's clocks, so a
  skew only makes it skip a good checkpoint, not accept a bad one, when the skew is behind).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from checkpoints._fs import atomic_write_bytes

FENCE_NAME = "fence.json"


@dataclass(frozen=True, slots=True)
class Fence:
    starts: tuple[tuple[int, float], ...] = ()
    """(attempt, when it was launched), in order."""

    @property
    def current(self) -> int:
        return max((a for a, _ in self.starts), default=0)

    def superseded(self, attempt: int) -> bool:
        return self.current > attempt

    def replaced_at(self, attempt: int) -> float | None:
        """When an attempt newer than `attempt` was launched (None: none has been)."""
        later = [at for a, at in self.starts if a > attempt]
        return min(later) if later else None

    def committed_by_zombie(self, attempt: int, committed_at: float) -> bool:
        """Was a checkpoint of `attempt` committed after a newer attempt had started?"""
        replaced = self.replaced_at(attempt)
        return replaced is not None and committed_at > replaced


def fence_path(job_root: Path) -> Path:
    return job_root / FENCE_NAME


def read_fence(job_root: Path) -> Fence:
    try:
        raw = json.loads(fence_path(job_root).read_bytes())
        return Fence(starts=tuple((int(a), float(t)) for a, t in raw["starts"]))
    except FileNotFoundError:
        return Fence()
    except (ValueError, KeyError, TypeError):
        # A torn or hand-edited fence must not unfence: treat it as "nothing is current
        # but the newest attempt we can still see", i.e. no fence at all, and say so.
        return Fence()


def advance_fence(job_root: Path, attempt: int, at: float) -> Fence:
    """Record that `attempt` starts now (the control plane, before launching it)."""
    fence = read_fence(job_root)
    if attempt <= fence.current:
        return fence  # never move backwards (a relaunch of the same attempt number)
    fence = Fence(starts=(*fence.starts, (attempt, at)))
    job_root.mkdir(parents=True, exist_ok=True)
    payload = {"starts": [list(s) for s in fence.starts]}
    atomic_write_bytes(fence_path(job_root), json.dumps(payload).encode())
    return fence


class Superseded(RuntimeError):
    """This attempt is no longer the job's current one: stop, write nothing more."""

    def __init__(self, attempt: int, current: int) -> None:
        super().__init__(f"attempt {attempt} was superseded by attempt {current}")
        self.attempt = attempt
        self.current = current


class FenceWatcher:
    """Checks the fence cheaply enough to do it every step: the file is read again only
    when its modification time changes."""

    def __init__(self, job_root: Path, attempt: int) -> None:
        self.path = fence_path(job_root)
        self.job_root = job_root
        self.attempt = attempt
        self._seen: int | None = None
        self._fence = Fence()

    def check(self) -> None:
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return
        if mtime != self._seen:
            self._seen = mtime
            self._fence = read_fence(self.job_root)
        if self._fence.superseded(self.attempt):
            raise Superseded(self.attempt, self._fence.current)
