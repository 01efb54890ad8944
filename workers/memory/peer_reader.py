"""The restore from peers' memory: DCP's load of an in-memory checkpoint (`in_memory`)
that the ranks of a NEW group hold between them. DCP's load planner reshards as from
disk; `PeerReader.read_data` fetches each piece from its holder as raw bytes, never
pickled (`transfer`). The source is a snapshot generation (each survivor serves the old
ranks it holds) or one survivor's live whole replica (ddp), made a one-rank in-memory
checkpoint by reference.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from elastrain.contracts.messages import StepMetrics
from elastrain.workers.memory.in_memory import Blob, MemoryWriter, as_bytes
from elastrain.workers.memory.replica import ReplicaMemory
from elastrain.workers.memory.rules import RestorePlan, Source
from elastrain.workers.memory.transfer import stream
from elastrain.workers.strategies import Strategy


class PeerReader(StorageReader):
    """`holder[r]`: the rank of `group` (None: the default one) holding what saving rank r
    held; `local[r]`: those items, where this rank is that holder."""

    def __init__(
        self,
        metadata: Metadata,
        *,
        holder: Mapping[int, int],
        local: Mapping[int, Blob],
        group: dist.ProcessGroup | None,
    ) -> None:
        super().__init__()
        self.metadata = metadata
        self.holder = dict(holder)
        self.local = local
        self.group = group
        self.bytes_moved = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        pass

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        pass

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False

    def _holder_of(self, index: MetadataIndex) -> int:
        return self.holder[self.metadata.storage_data[index]]

    def _piece(self, want: ReadItem) -> torch.Tensor:
        """The bytes of the piece `want`, from this rank's memory."""
        index = want.storage_index
        chunk = self.local[self.metadata.storage_data[index]][index]
        return as_bytes(narrow_tensor_by_index(chunk, want.storage_offsets, want.lengths))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Collective: each rank says which pieces it wants and hands round the pickled
        items it holds, then holders stream pieces to those who want them."""
        distributed = dist.is_initialized()
        me = dist.get_rank(self.group) if distributed else 0
        wants = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        pickled = {
            index: raw.numpy().tobytes()
            for blob in self.local.values()
            for index, raw in blob.items()
            if isinstance(self.metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
        }
        everyone: list[Any] = [(wants, pickled)]  # (wants, pickled items) by rank
        if distributed:
            everyone = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(everyone, (wants, pickled), group=self.group)
        for _, theirs in everyone:
            pickled.update(theirs)
        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(pickled[item.storage_index]))
        served = {
            rank: [self._piece(w) for w in theirs if self._holder_of(w.storage_index) == me]
            for rank, (theirs, _) in enumerate(everyone)
            if rank != me
        }
        recvs: dict[int, list[torch.Tensor]] = {}
        landing: list[tuple[ReadItem, torch.Tensor, torch.Tensor]] = []
        for item in wants:
            holder = self._holder_of(item.storage_index)
            into = planner.resolve_tensor(item).detach()
            if holder == me:
                _land(planner, item, self._piece(item), into)
                continue
            direct = into.device.type == "cpu" and into.is_contiguous()
            buffer = (
                as_bytes(into)
                if direct
                else torch.empty(into.numel() * into.element_size(), dtype=torch.uint8)
            )
            landing.append((item, buffer, into))
            recvs.setdefault(holder, []).append(buffer)
        self.bytes_moved += stream(served, recvs, self.group)
        for item, buffer, into in landing:
            _land(planner, item, buffer, into)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _land(planner: LoadPlanner, item: ReadItem, data: torch.Tensor, into: torch.Tensor) -> None:
    """Copy a piece (flat bytes) into its tensor, unless it was received there."""
    flat = as_bytes(into) if into.device.type == "cpu" and into.is_contiguous() else None
    if flat is None or flat.data_ptr() != data.data_ptr():
        into.copy_(data.view(into.dtype).view(into.shape))
    planner.commit_tensor(item, into)


@dataclass(frozen=True, slots=True)
class HandedOver:
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
    """Collective: load `plan`'s state into `strategy` from the survivors' memory."""
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
