"""Sharded checkpoints with torch.distributed.checkpoint (DCP): the one part of
`checkpoints` that imports torch (workers only). `untrusted` and `export` read a job's
checkpoint as hostile input.
"""

from elastrain.checkpoints.dcp.checkpointer import CheckpointSaveError, ShardedCheckpointer

__all__ = ["CheckpointSaveError", "ShardedCheckpointer"]
