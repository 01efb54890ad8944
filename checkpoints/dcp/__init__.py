"""Sharded checkpoints with torch.distributed.checkpoint (DCP): the one part of
`checkpoints` that imports torch. Workers import it; the control plane never does.

`checkpointer` saves and loads (sync or async, committing through `elastrain.checkpoints.commit`);
`writer` is DCP's file system writer with each shard digested as it is written;
`in_memory` and `peer_reader` are a checkpoint held in peers' host memory (`elastrain.workers.memory`);
`held_copy` writes a checkpoint from such a copy of the same step instead of a copy of its own
(`own_items`: the copy of a replicated state's items a rank writes); `live_tensors` lets
an in-place save's update take the tensors not yet written back as copies;
`staging`, `host_memory` and `shard_file` get the bytes to the disk with as few copies as can be;
`save_plans` keeps DCP's save plans from save to save while the state's layout holds.
"""

from elastrain.checkpoints.dcp.checkpointer import CheckpointSaveError, ShardedCheckpointer

__all__ = ["CheckpointSaveError", "ShardedCheckpointer"]
