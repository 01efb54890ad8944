"""Committing a checkpoint, and which ones exist under a job's root and which to resume
from. Pure Python. Only committed ones (manifest readable) count; junk (saves in
progress, crashed or half-deleted, stray files) never makes the listing raise.

The commit protocol, in one step folder per (step, attempt):
1. every rank writes `rank_{r}.extra.pt` (its RNG states) atomically;
2. every rank writes its DCP shard, fsynced and digested as written; DCP's coordinator
   gathers every rank's results and digests, then writes `.metadata`;
3. rank 0 checks the fence and writes `manifest.json` atomically (`commit`).
A crash before 3 leaves a folder without a manifest, which the listing ignores.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastrain.checkpoints.fence import Superseded, read_fence
from elastrain.checkpoints.integrity import CorruptCheckpoint, describe_files, verify
from elastrain.checkpoints.layout import StepDir, iter_step_dirs
from elastrain.checkpoints.manifest import (
    DEFAULT_ALGORITHM,
    FileEntry,
    Manifest,
    ManifestError,
    ManifestMissing,
    read_manifest,
    write_manifest,
)
from elastrain.contracts.messages import CheckpointCommitted

# What a caller may put in a manifest; anything else is a mistake, reported at once.
MANIFEST_FIELDS = frozenset({"strategy", "layout", "data_position", "extra", "world_size"})


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


@dataclass(kw_only=True, slots=True)
class LoadOutcome:
    """What `ShardedCheckpointer.load_latest` restored."""

    info: CheckpointInfo
    skipped: list[tuple[str, str]] = field(default_factory=list)
    """(path, reason) of newer folders passed over: corrupt, torn or uncommitted."""
    rank_extra: dict[str, Any] | None = None
    """This rank's extras, only at the saving world size (RNG states mean nothing after
    resharding)."""


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
    """Committed checkpoints, newest (step, attempt) first; not verified."""
    return scan(root).committed


def find_latest_good(
    root: str | os.PathLike[str],
    *,
    digest_here: Callable[[str], bool] | None = None,
    refused: Mapping[str, str] | None = None,
) -> tuple[CheckpointInfo | None, list[tuple[str, str]]]:
    """The newest committed checkpoint that verifies, and (path, reason) for every newer
    step folder passed over. `digest_here`: which files' digests to check here (default
    all; the loader checks the others as it reads them); `refused`: path -> reason of
    those already found bad that way."""
    refused = refused or {}
    found = scan(root)
    candidates: list[tuple[StepDir | CheckpointInfo, str | None]] = [
        (info, refused.get(str(info.path))) for info in found.committed
    ]
    candidates += [(d, "uncommitted: no manifest.json") for d in found.uncommitted]
    candidates += found.unreadable
    skipped: list[tuple[str, str]] = []
    for item, why in sorted(candidates, key=lambda c: c[0].sort_key, reverse=True):
        if why is None:
            assert isinstance(item, CheckpointInfo)
            names = [n for n in item.manifest.files if digest_here is None or digest_here(n)]
            try:
                verify(item.path, item.manifest, digests_of=names)
                return item, skipped
            except CorruptCheckpoint as e:
                why = e.reason
        skipped.append((str(item.path), why))
    return None, skipped


def manifest_for(step: int, attempt: int, fields: dict[str, Any], *, world_size: int) -> Manifest:
    """The manifest a save will commit. ValueError for unknown fields or ones JSON cannot
    hold, in the caller rather than in a background commit."""
    unknown = set(fields) - MANIFEST_FIELDS
    if unknown:
        raise ValueError(f"unknown manifest_fields {sorted(unknown)}")
    manifest = Manifest(
        step=step,
        attempt=attempt,
        world_size=int(fields.get("world_size", world_size)),
        strategy=str(fields.get("strategy", "")),
        layout=dict(fields.get("layout") or {}),
        data_position=dict(fields.get("data_position") or {}),
        extra=dict(fields.get("extra") or {}),
    )
    json.dumps(manifest.to_dict())
    return manifest


def commit(
    root: Path,
    path: Path,
    manifest: Manifest,
    *,
    streamed: Mapping[str, FileEntry] | None = None,
    owner: str = "",
    algorithm: str = DEFAULT_ALGORITHM,
) -> CheckpointCommitted:
    """Step 3, on rank 0 once every file in `path` is durable: digests (`streamed`: the
    shards', taken while writing), then the manifest. Raises Superseded, writing nothing,
    when the fence says a newer attempt or another database (`owner`) holds the job."""
    fence = read_fence(root.parent)  # the job's folder (elastrain.contracts.storage)
    if fence.superseded(manifest.attempt, owner):
        raise Superseded(manifest.attempt, fence.current)
    manifest.files = describe_files(path, known=streamed, algorithm=algorithm)
    manifest.total_bytes = sum(f["size"] for f in manifest.files.values())
    manifest.created_at = time.time()
    write_manifest(path, manifest)
    return CheckpointCommitted(
        step=manifest.step,
        attempt=manifest.attempt,
        world_size=manifest.world_size,
        path=str(path),
        bytes=manifest.total_bytes,
        manifest=manifest.to_dict(),
    )
