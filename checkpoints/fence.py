"""The attempt fence on shared storage: which attempt of a job is the current one.

A worker cut off from the control plane (its node declared dead, its processes alive) can
still reach storage, and would commit checkpoints a later attempt might resume. So before
launching attempt N the control plane writes `<job>/fence.json` (attempts and when each
started; it only grows), and writers check it:

- the training loop, every step: a superseded attempt stops;
- the committer, right before writing a manifest: a superseded attempt commits nothing;
- the catalogue: a checkpoint committed after a newer attempt started is skipped (closing
  the race between the committer's check and write; a clock skew can only make it skip a
  good checkpoint, not accept a bad one, when the skew is behind).

An unreadable fence fails closed (FenceUnreadable everywhere) until the control plane
writes a new one. A job's folder is also one database's (`Fence.owner`): job ids restart
at 1 in every database and storage outlives databases, so the control plane claims the
folder first (`claim_job_folder`), never resuming from weights another job trained.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from elastrain.checkpoints.confined import atomic_write_bytes
from elastrain.contracts.files import ConfinedFileError, read_bounded

FENCE_NAME = "fence.json"
#: An attempt's start is ~30 bytes of the fence: 1 MiB is 30,000 attempts.
MAX_FENCE_BYTES = 1024 * 1024

log = logging.getLogger("elastrain.checkpoints")


@dataclass(frozen=True, slots=True)
class Fence:
    starts: tuple[tuple[int, float], ...] = ()
    """(attempt, when it was launched), in order."""
    owner: str = ""
    """The database whose job this folder holds ("": an older, ownerless fence); another
    database's attempt is superseded whatever its number."""

    @property
    def current(self) -> int:
        return max((a for a, _ in self.starts), default=0)

    def superseded(self, attempt: int, owner: str = "") -> bool:
        """Is `attempt` (of `owner`'s job; "": not said) no longer the current one?"""
        if owner and self.owner and owner != self.owner:
            return True
        return self.current > attempt

    def replaced_at(self, attempt: int) -> float | None:
        """When an attempt newer than `attempt` was launched, if one was."""
        later = [at for a, at in self.starts if a > attempt]
        return min(later) if later else None

    def committed_by_zombie(self, attempt: int, committed_at: float) -> bool:
        """Was a checkpoint of `attempt` committed after a newer attempt had started?"""
        replaced = self.replaced_at(attempt)
        return replaced is not None and committed_at > replaced


def fence_path(job_root: Path) -> Path:
    return job_root / FENCE_NAME


class FenceUnreadable(RuntimeError):
    """The fence is there but unreadable: no writer may write until the control plane,
    which knows the current attempt, writes a new one (`advance_fence`)."""

    def __init__(self, path: Path, why: str) -> None:
        super().__init__(f"cannot read the attempt fence {path} ({why}): writing nothing")
        self.path = path


def read_fence(job_root: Path) -> Fence:
    """The job's fence (no file: no fence). FenceUnreadable for a file that cannot be
    read or parsed: never read as no fence, which would let a superseded attempt write."""
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
    """Record that `attempt` of `owner`'s job starts now (before launching it, after
    `claim_job_folder`). An unreadable fence is replaced by one starting at `attempt`:
    older attempts stay fenced out, their replacement dated now (while it was unreadable
    no attempt could commit)."""
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
    """Checks the fence every step: the file is read again only when its mtime changes."""

    def __init__(self, job_root: Path, attempt: int, owner: str = "") -> None:
        self.path = fence_path(job_root)
        self.job_root = job_root
        self.attempt = attempt
        self.owner = owner
        self._seen: int | None = None
        self._fence = Fence()

    def check(self) -> None:
        """Raises Superseded once a newer attempt has started, FenceUnreadable when the
        fence cannot be read."""
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


def claim_job_folder(job_root: Path, owner: str, *, first_attempt: bool = False) -> Path | None:
    """Make `job_root` free for `owner`'s job; returns where what was there was moved
    aside (`<id>.<why>`, never deleted: it may be someone's data). At `first_attempt`
    anything there was not made for this job (planted by another job's code, a link,
    another database's) is moved. Later, a folder whose fence names another database is
    moved (its workers then find a foreign owner and write nothing); one with no owner or
    an unreadable fence stays; a link or a file is moved."""
    try:
        found = os.lstat(job_root)
    except FileNotFoundError:
        found = None
    if found is not None and (first_attempt or not stat.S_ISDIR(found.st_mode)):
        moved = _move_aside(job_root, "set-aside")
        job_root.mkdir(parents=True, exist_ok=True)
        return moved
    if found is None:
        job_root.mkdir(parents=True, exist_ok=True)
        return None
    try:
        fence = read_fence(job_root)
    except FenceUnreadable:
        return None
    if not fence.owner or fence.owner == owner:
        return None
    return _move_aside(job_root, f"database-{fence.owner}")


def _move_aside(job_root: Path, why: str) -> Path:
    moved = job_root.with_name(f"{job_root.name}.{why}")
    if os.path.lexists(moved):
        moved = moved.with_name(f"{moved.name}-{time.time_ns()}")
    job_root.rename(moved)
    return moved
