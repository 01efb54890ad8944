"""Training state kept in worker processes' host memory across attempts: live replicas,
and snapshots of every rank's shard plus a buddy's copy on another node, from which a
new group re-shards with DCP's own planner (`elastrain.workers.memory.in_memory`).

`in_memory` (DCP's storage writer into host memory) and `peer_reader` (its reader, fetching
each piece from the peer that holds it), `replica` (what a process holds), `snapshots`
(the refresh), `handover` (the restore), `sources` (the choice), `buddy` and `pacing` (pure
rules), `transfer` (bucketed streams).
"""

from elastrain.workers.memory.replica import ReplicaMemory
from elastrain.workers.memory.sources import NOTHING

__all__ = ["NOTHING", "ReplicaMemory"]
