"""Which checkpoints exist under a job's root, and which one to resume from. Pure Python.

Only committed checkpoints (manifest present and readable) count. The listing never raises
on junk: a save in progress, a crashed one, a half-deleted one, or a stray file are what
shared storage looks like after node failures.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.checkpoints.fence import read_fence
from elastrain.checkpoints.integrity import CorruptCheckpoint, verify
from elastrain.checkpoints.layout import StepDir, iter_step_dirs
from elastrain.checkpoints.manifest import Manifest, ManifestError, ManifestMissing, read_manifest
from elastrain.contracts.messages import CheckpointCommitted


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckpointInfo:
    path: Path
    step: int
    attempt: int
    world_size: int
    total_bytes: int
    committed_at: float
    manifest: Manifest

    @property
    def sort_key(self) -> tuple[int, int]:
        return (self.step, self.attempt)

    @classmethod
    def from_manifest(cls, path: Path, manifest: Manifest) -> CheckpointInfo:
        return cls(
            path=path,
            step=manifest.step,
            attempt=manifest.attempt,
            world_size=manifest.world_size,
            total_bytes=manifest.total_bytes,
            committed_at=manifest.created_at,
            manifest=manifest,
        )

    def to_commit(self) -> CheckpointCommitted:
        """The message rank 0 sends the driver for this checkpoint."""
        return CheckpointCommitted(
            step=self.step,
            attempt=self.attempt,
            world_size=self.world_size,
            path=str(self.path),
            bytes=self.total_bytes,
            manifest=self.manifest.to_dict(),
        )


@dataclass(kw_only=True, slots=True)
class LoadOutcome:
    """What `ShardedCheckpointer.load_latest` restored."""

    info: CheckpointInfo
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(path, reason) of newer folders passed over: corrupt, torn or uncommitted."""
    rank_extra: dict[str, Any] | None = None
    """This rank's extras, only when the checkpoint was saved at the same world size
    (per-rank RNG states mean nothing after resharding)."""


@dataclass(slots=True)
class Scan:
    committed: list[CheckpointInfo]
    uncommitted: list[StepDir]
    """Step folders with no manifest: a save in progress, crashed or half-deleted."""
    unreadable: list[tuple[StepDir, str]]
    """Step folders whose manifest exists but cannot be parsed."""


def scan(root: str | os.PathLike[str]) -> Scan:
    """Classify every step folder under root; each list newest first."""
    result = Scan(committed=[], uncommitted=[], unreadable=[])
    fence = read_fence(Path(root).parent)  # the job's folder (elastrain.contracts.storage)
    for d in iter_step_dirs(root):
        try:
            manifest = read_manifest(d.path)
        except ManifestMissing:
            result.uncommitted.append(d)
            continue
        except ManifestError as e:
            result.unreadable.append((d, e.reason))
            continue
        if fence.committed_by_zombie(manifest.attempt, manifest.created_at):
            reason = (
                f"committed by attempt {manifest.attempt} after attempt {fence.current} "
                "had replaced it (a partitioned zombie): not resumed from"
            )
            result.unreadable.append((d, reason))
            continue
        result.committed.append(CheckpointInfo.from_manifest(d.path, manifest))
    result.committed.sort(key=lambda i: i.sort_key, reverse=True)
    return result


def list_committed(root: str | os.PathLike[str]) -> list[CheckpointInfo]:
    """Committed checkpoints, newest step first (for one step, the newest attempt first).
    Not verified: use find_latest_good to pick one to load."""
    return scan(root).committed


def find_latest_good(
    root: str | os.PathLike[str],
    *,
    verify_digests: bool = True,
    digest_here: Callable[[str], bool] | None = None,
    refused: Mapping[str, str] | None = None,
) -> tuple[CheckpointInfo | None, list[tuple[str, str]]]:
    """The newest committed checkpoint that verifies, and (path, reason) for every newer
    step folder that was passed over (so the caller can report why it resumed further
    back than expected).

    `digest_here`: which files' digests to check here (by name; default all), when the
    loader checks the others as it reads them (`elastrain.checkpoints.dcp.reader`). `refused`: paths
    already found bad that way (path -> reason), passed over with that reason."""
    refused = refused or {}
    found = scan(root)
    candidates: list[tuple[tuple[int, int], StepDir | CheckpointInfo, str | None]] = []
    for info in found.committed:
        candidates.append((info.sort_key, info, None))
    for d in found.uncommitted:
        candidates.append((d.sort_key, d, "uncommitted: no manifest.json"))
    for d, reason in found.unreadable:
        candidates.append((d.sort_key, d, reason))
    candidates.sort(key=lambda c: c[0], reverse=True)

    skipped: list[tuple[str, str]] = []
    for _key, item, why in candidates:
        if why is not None:
            skipped.append((str(item.path), why))
            continue
        assert isinstance(item, CheckpointInfo)
        if str(item.path) in refused:
            skipped.append((str(item.path), refused[str(item.path)]))
            continue
        digests_of = None
        if digest_here is not None:
            digests_of = [name for name in item.manifest.files if digest_here(name)]
        try:
            verify(item.path, item.manifest, check_digests=verify_digests, digests_of=digests_of)
        except CorruptCheckpoint as e:
            skipped.append((str(item.path), e.reason))
            continue
        return item, skipped
    return None, skipped
