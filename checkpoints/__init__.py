"""Sharded checkpoints with a commit protocol.

Everything importable from here is pure Python (the control plane uses it and must not load
torch), the commit protocol (`elastrain.checkpoints.commit`) included. The torch part, DCP's save and
load (`ShardedCheckpointer`) and its storage writer, lives in the `elastrain.checkpoints.dcp` package
and is imported only by workers.
"""

from elastrain.checkpoints.catalog import (
    CheckpointInfo,
    LoadOutcome,
    find_latest_good,
    list_committed,
    scan,
)
from elastrain.checkpoints.integrity import CorruptCheckpoint, digest_file, verify
from elastrain.checkpoints.layout import parse_step_dir_name, step_dir, step_dir_name
from elastrain.checkpoints.manifest import (
    Manifest,
    ManifestError,
    ManifestMissing,
    read_manifest,
    write_manifest,
)
from elastrain.checkpoints.retention import (
    delete_checkpoint,
    delete_checkpoints,
    plan_retention,
    retention_plan,
)

__all__ = [
    "CheckpointInfo",
    "CorruptCheckpoint",
    "LoadOutcome",
    "Manifest",
    "ManifestError",
    "ManifestMissing",
    "delete_checkpoint",
    "delete_checkpoints",
    "digest_file",
    "find_latest_good",
    "list_committed",
    "parse_step_dir_name",
    "plan_retention",
    "read_manifest",
    "retention_plan",
    "scan",
    "step_dir",
    "step_dir_name",
    "verify",
    "write_manifest",
]
