"""The storage reader of an in-memory DCP checkpoint (`elastrain.workers.memory.in_memory`) that the
ranks of a NEW group hold between them: DCP's load planner decides which piece of which
saved chunk each rank needs (the same resharding as a load from disk), and `read_data`
fetches each piece from the rank that holds it, streaming raw tensor bytes over the
group (elastrain.workers.memory.transfer)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from elastrain.workers.memory.in_memory import Blob, as_bytes
from elastrain.workers.memory.transfer import stream


class PeerReader(StorageReader):
    """Loads an in-memory checkpoint whose items the ranks of the new group hold:
    `holder[r]` is the rank of `group` (None: the default group, or a process without
    torch.distributed) that holds what rank r of the saving group held, and `local[r]`
    those items where this rank is that holder."""

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

    def _all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small metadata only), by rank."""
        if not dist.is_initialized():
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out

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
        storage = self.metadata.storage_data
        return self.holder[storage[index].rank]

    def _piece(self, want: ReadItem) -> torch.Tensor:
        """The bytes of the tensor piece a rank's planner wants (`want`), from this
        rank's memory."""
        index = want.storage_index
        chunk = self.local[self.metadata.storage_data[index].rank][index]
        return as_bytes(narrow_tensor_by_index(chunk, want.storage_offsets, want.lengths))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank of the group calls it at once (DCP's load does): each rank says
        which tensor pieces it wants and hands round the pickled items it holds (a few
        hyperparameters), then each holder streams the pieces to the ranks that want
        them, and each rank puts them where its planner says."""
        me = dist.get_rank(self.group) if dist.is_initialized() else 0
        wants = [item for item in plan.items if item.type != LoadItemType.BYTE_IO]
        pickled = {
            index: raw.numpy().tobytes()
            for blob in self.local.values()
            for index, raw in blob.items()
            if isinstance(self.metadata.state_dict_metadata[index.fqn], BytesStorageMetadata)
        }
        everyone: list[tuple[list[ReadItem], dict[MetadataIndex, bytes]]] = self._all_gather(
            (wants, pickled)
        )
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
    """Copy a tensor piece (flat bytes) into its tensor, unless it was received there."""
    flat = as_bytes(into) if into.device.type == "cpu" and into.is_contiguous() else None
    if flat is None or flat.data_ptr() != data.data_ptr():
        into.copy_(data.view(into.dtype).view(into.shape))
    planner.commit_tensor(item, into)
