"""The restore from peers' memory: DCP's load, reading an in-memory checkpoint that the
survivors hold (`elastrain.workers.memory.peer_reader.PeerReader`), so the new group re-shards it to
its own size and layout by the same rules as a checkpoint on disk.

Either a generation of snapshots (`sources.Source.SNAPSHOT`: each survivor serves the
items of the old ranks it holds, own or buddy copies), or one survivor's live whole
replica (`Source.REPLICA`, ddp): that rank turns its live state into a one-rank
in-memory checkpoint (by reference, no copy) and serves all of it. The metadata and the
newest metric points come from one holder (a small broadcast); the tensors are streamed
in buckets, never pickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import state_dict_saver

from elastrain.contracts.messages import StepMetrics
from elastrain.workers.memory.in_memory import Blob, MemoryWriter
from elastrain.workers.memory.peer_reader import PeerReader
from elastrain.workers.memory.replica import ReplicaMemory
from elastrain.workers.memory.sources import RestorePlan, Source
from elastrain.workers.strategies import Strategy


@dataclass(frozen=True, slots=True)
class HandedOver:
    """What the new group learns with the state."""

    saved_world_size: int
    saved_attempt: int
    metrics: tuple[StepMetrics, ...]
    bytes_moved: int


def load_from_peers(
    plan: RestorePlan,
    memory: ReplicaMemory,
    strategy: Strategy,
    group: dist.ProcessGroup | None,
) -> HandedOver:
    """Every rank of the new group calls it: load `plan`'s state into `strategy` (set up
    for the new group) from the survivors' memory."""
    me = dist.get_rank(group)
    donor = min(plan.holder.values())  # it holds the generation: metadata from there
    local: dict[int, Blob] = {}
    box: list[Any] = [None]
    if plan.source == Source.REPLICA:
        if me == donor:
            assert memory.strategy is not None
            writer = MemoryWriter()
            metadata = state_dict_saver.save(
                memory.strategy.state_dict_for_checkpoint(), storage_writer=writer, no_dist=True
            )
            local = {0: writer.blob}
            box[0] = (metadata, memory.world_size, memory.attempt)
    else:
        assert plan.generation is not None
        snapshot = next((c for c in memory.copies if c.generation == plan.generation), None)
        if snapshot is not None:
            local = {old: snapshot.blobs[old] for old, new in plan.holder.items() if new == me}
            if me == donor:
                box[0] = (snapshot.metadata, plan.generation.world_size, plan.generation.attempt)
    if me == donor:
        recent = tuple(m for m in memory.recent if m.step <= plan.step)
        box[0] = (*box[0], [m.to_point() for m in recent])
    dist.broadcast_object_list(box, group=group, group_src=donor)
    metadata, saved_world_size, saved_attempt, points = box[0]

    state = strategy.state_dict_for_checkpoint()
    reader = PeerReader(metadata, holder=plan.holder, local=local, group=group)
    dcp.load(state, storage_reader=reader, process_group=group)
    strategy.load_checkpoint_state(state)
    return HandedOver(
        saved_world_size=int(saved_world_size),
        saved_attempt=int(saved_attempt),
        metrics=tuple(StepMetrics.from_point(p) for p in points),
        bytes_moved=reader.bytes_moved,
    )
