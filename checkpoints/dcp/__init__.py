"""Sharded checkpoints with torch.distributed.checkpoint (DCP): the one part of
`checkpoints` that imports torch. Workers import it; the control plane never does.

`checkpointer` saves (DCP's `save`/`async_save`, its stager and plan cache) and loads,
committing through `elastrain.checkpoints.commit`; `writer` is DCP's file system writer with
each shard digested as it is written; `reader` verifies every shard a load reads before
DCP decodes it; `untrusted` and `export` read a job's checkpoint as hostile input. A
checkpoint held in peers' host memory is `elastrain.workers.memory`'s.
"""

from elastrain.checkpoints.dcp.checkpointer import CheckpointSaveError, ShardedCheckpointer

__all__ = ["CheckpointSaveError", "ShardedCheckpointer"]
