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

A fence that is there but cannot be read fails closed: every reader raises FenceUnreadable,
so the loop stops, the committer commits nothing and the catalogue picks nothing, until
the control plane writes a new fence when it launches the next attempt.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from elastrain.checkpoints._fs import atomic_write_bytes
from elastrain.checkpoints.confined import ConfinedFileError, read_bounded

FENCE_NAME = "fence.json"
#: An attempt's start is ~30 bytes of the fence: 1 MiB is 30,000 attempts.
MAX_FENCE_BYTES = 1024 * 1024

log = logging.getLogger("elastrain.checkpoints")


@dataclass(frozen=True, slots=True)
class Fence:
    starts: tuple[tuple[int, float], ...] = ()
    """(attempt, when it was launched), in order."""
    owner: str = ""
    """The database whose job this folder holds (`elastrain.contracts.runtime.JobRef`; "" in a fence
    written before fences had owners). Job ids restart at 1 in every database: an attempt
    of another database's job 1 is superseded here whatever its number."""

    @property
    def current(self) -> int:
        return max((a for a, _ in self.starts), default=0)

    def superseded(self, attempt: int, owner: str = "") -> bool:
        """Is `attempt` (of `owner`'s job; "": not said) no longer the current one?"""
        if owner and self.owner and owner != self.owner:
            return True
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


class FenceUnreadable(RuntimeError):
    """The fence is there but cannot be read (torn, garbage, not ours to read): nobody can
    tell which attempt is current, so no writer may write. Only the control plane, which
    knows, writes a new one (`advance_fence`)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"cannot read the attempt fence {path} ({why}): writing nothing")
        self.path = path


def read_fence(job_root: Path) -> Fence:
    """The job's fence; no file is no fence (no attempt was ever launched with one).
    Raises FenceUnreadable for a file that cannot be read or parsed: an unreadable fence
    must never read as no fence, which would let a superseded attempt write."""
    path = fence_path(job_root)
    try:
        data = read_bounded(str(path), MAX_FENCE_BYTES)
    except FileNotFoundError:
        return Fence()
    except ConfinedFileError as exc:
        raise FenceUnreadable(path, str(exc)) from None
    except OSError as exc:
        raise FenceUnreadable(path, exc.strerror or repr(exc)) from exc
    try:
        raw = json.loads(data.decode())  # written as UTF-8 (advance_fence)
        starts = tuple((int(a), float(t)) for a, t in raw["starts"])
        return Fence(starts=starts, owner=str(raw.get("owner", "")))
    except (ValueError, KeyError, TypeError) as exc:
        raise FenceUnreadable(path, f"not a fence: {exc}") from exc


def advance_fence(job_root: Path, attempt: int, at: float, *, owner: str = "") -> Fence:
    """Record that `attempt` of `owner`'s job starts now (the control plane, before
    launching it). A folder another database owns is moved aside first
    (`elastrain.checkpoints.owner.claim_job_folder`): call that before this.

    An unreadable fence is replaced by one that starts at `attempt`: the control plane
    knows which attempt is current, and every older one stays fenced out. What is lost is
    when the older attempts were replaced, so the catalogue dates their replacement from
    now (`Fence.committed_by_zombie`); while the fence was unreadable no attempt could
    commit, since every commit reads it first."""
    try:
        fence = read_fence(job_root)
    except FenceUnreadable as exc:
        log.warning("%s; writing a new fence from attempt %d", exc, attempt)
        fence = Fence()
    if attempt <= fence.current and fence.owner == owner:
        return fence  # never move backwards (a relaunch of the same attempt number)
    starts = fence.starts if attempt <= fence.current else (*fence.starts, (attempt, at))
    fence = Fence(starts=starts, owner=owner)
    job_root.mkdir(parents=True, exist_ok=True)
    payload = {"owner": fence.owner, "starts": [list(s) for s in fence.starts]}
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

    def __init__(self, job_root: Path, attempt: int, owner: str = "") -> None:
        self.path = fence_path(job_root)
        self.job_root = job_root
        self.attempt = attempt
        self.owner = owner
        self._seen: int | None = None
        self._fence = Fence()

    def check(self) -> None:
        """Raises Superseded once a newer attempt has started, FenceUnreadable when the
        fence cannot be read (this attempt cannot tell whether it is still current)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            return
        except OSError as exc:
            raise FenceUnreadable(self.path, exc.strerror or repr(exc)) from exc
        if mtime != self._seen:
            self._fence = read_fence(self.job_root)
            self._seen = mtime  # only once read: an unreadable fence is read again
        if self._fence.superseded(self.attempt, self.owner):
            raise Superseded(self.attempt, self._fence.current)
