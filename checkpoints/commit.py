"""The commit protocol: a checkpoint counts only once its manifest is written, last. Pure
Python; the DCP save that produces the files is `elastrain.checkpoints.dcp`.

One step folder per (step, attempt) (`layout`):
1. every rank writes `rank_{r}.extra.pt` (its RNG states...) atomically;
2. every rank writes its DCP shard (fsynced), hashing the bytes as they go to the file
   (`elastrain.checkpoints.dcp.writer`); the DCP coordinator (group rank 0) gathers every rank's
   write results and digests, and only then writes `.metadata` (fsynced, renamed into
   place);
3. group rank 0 checks the fence, takes the streamed digests of the shards (hashing from
   disk the small files and any shard whose size on disk is not what was hashed) and
   writes `manifest.json` last, atomically (fsync, rename, fsync of the folder, which
   also makes every other file's name durable): `commit`.
A crash anywhere before 3 leaves a folder without a manifest, which the catalogue ignores.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from elastrain.checkpoints.catalog import CheckpointInfo
from elastrain.checkpoints.digest import DEFAULT_ALGORITHM
from elastrain.checkpoints.fence import Superseded, read_fence
from elastrain.checkpoints.integrity import describe_files
from elastrain.checkpoints.layout import MANIFEST_NAME
from elastrain.checkpoints.manifest import FileEntry, Manifest, write_manifest
from elastrain.contracts.messages import CheckpointCommitted

# What a caller may put in a manifest; anything else is a caller mistake reported at once
# rather than dropped silently.
MANIFEST_FIELDS = frozenset({"strategy", "layout", "data_position", "extra", "world_size"})


def manifest_for(step: int, attempt: int, fields: dict[str, Any], *, world_size: int) -> Manifest:
    """The manifest a save of (step, attempt) will commit; `world_size` unless `fields`
    names another. Raises ValueError for unknown fields or ones JSON cannot hold, in the
    caller, rather than in a background commit."""
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


def uncommit(path: Path) -> None:
    """Before saving again into a folder that was committed (the same attempt restarted in
    its process): a half-overwritten folder must never be taken as good."""
    (path / MANIFEST_NAME).unlink(missing_ok=True)


def commit(
    root: Path,
    path: Path,
    manifest: Manifest,
    *,
    streamed: Mapping[str, FileEntry] | None = None,
    owner: str = "",
    algorithm: str = DEFAULT_ALGORITHM,
) -> CheckpointCommitted:
    """Step 3, on group rank 0 once every shard and DCP's `.metadata` are durable in
    `path` (a step folder under the job's checkpoint `root`): digests (by `algorithm`, a
    `elastrain.checkpoints.digest` name), then the manifest, last. `streamed`: the shard digests
    taken while writing (hashed from disk otherwise).
    Raises Superseded, writing nothing, when a newer attempt of the job has started, or
    the folder is now another database's job's (`owner`: the saving job's database)."""
    # A superseded attempt (its node partitioned away, its replacement running) must
    # never commit: the fence on storage says who is current (checkpoints/fence.py).
    fence = read_fence(root.parent)  # the job's folder (elastrain.contracts.storage)
    if fence.superseded(manifest.attempt, owner):
        raise Superseded(manifest.attempt, fence.current)
    manifest.files = describe_files(path, known=streamed, algorithm=algorithm)
    manifest.total_bytes = sum(f["size"] for f in manifest.files.values())
    manifest.created_at = time.time()
    write_manifest(path, manifest)
    return CheckpointInfo.from_manifest(path, manifest).to_commit()
