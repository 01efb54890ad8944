"""Training state kept in worker processes' host memory across attempts: live replicas,
and snapshots of every rank's shard plus a buddy's copy on another node, from which a
new group re-shards with DCP's own planner (`elastrain.checkpoints.dcp.in_memory`).

`replica` (what a process holds), `snapshots` (the refresh), `handover` (the restore),
`sources` (the choice), `buddy` and `pacing` (pure rules), `transfer` (bucketed streams).
"""

from elastrain.workers.memory.replica import ReplicaMemory
from elastrain.workers.memory.sources import NOTHING

__all__ = ["NOTHING", "ReplicaMemory"]
