"""The storage reader of an in-memory DCP checkpoint (`elastrain.workers.memory.in_memory`) that the
ranks of a NEW group hold between them: DCP's load planner decides which piece of which
saved chunk each rank needs (the same resharding as a load from disk), and `read_data`
fetches each piece from the rank that holds it, over a `Transport` that streams raw
tensor bytes (elastrain.workers.memory.transfer)."""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from elastrain.workers.memory.in_memory import Blob, as_bytes


class Transport(Protocol):
    """How the ranks of the loading group talk (elastrain.workers.memory.handover)."""

    rank: int

    def all_gather(self, obj: Any) -> list[Any]:
        """Every rank's `obj` (small metadata only), by rank."""
        ...

    def stream(
        self,
        sends: Mapping[int, Sequence[torch.Tensor]],
        recvs: Mapping[int, Sequence[torch.Tensor]],
    ) -> int:
        """Send flat uint8 tensors to peers and receive into flat uint8 tensors from peers."""
        ...


@dataclasses.dataclass(frozen=True, slots=True)
class Want:
    """A piece of a saved item a rank needs: the box (`offsets`, `lengths`) of the chunk
    `index` (whole, for a pickled item)."""

    index: MetadataIndex
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    pickled: bool


class PeerReader(StorageReader):
    """Loads an in-memory checkpoint whose items the ranks of the new group hold:
    `holder[r]` is the rank of the new group that holds what rank r of the saving group
    held, and `local[r]` those items where this rank is that holder."""

    def __init__(
        self,
        metadata: Metadata,
        *,
        holder: Mapping[int, int],
        local: Mapping[int, Blob],
        transport: Transport,
    ) -> None:
        super().__init__()
        self.metadata = metadata
        self.holder = dict(holder)
        self.local = local
        self.transport = transport
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
        storage = self.metadata.storage_data
        return self.holder[storage[index].rank]

    def _piece(self, want: Want) -> torch.Tensor:
        """The bytes of `want`, from this rank's memory."""
        storage = self.metadata.storage_data
        chunk = self.local[storage[want.index].rank][want.index]
        if want.pickled:
            return chunk
        return as_bytes(narrow_tensor_by_index(chunk, want.offsets, want.lengths))

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Every rank of the group calls it at once (DCP's load does): the wants are
        exchanged (metadata), then each holder streams the pieces to the ranks that want
        them, and each rank puts them where its planner says."""
        me = self.transport.rank
        wants = [_want(item) for item in plan.items]
        everyone: list[list[Want]] = self.transport.all_gather(wants)
        # Pickled items' sizes are known only to their holder: tell the ranks that want them.
        served: dict[int, list[torch.Tensor]] = {}
        sizes: dict[tuple[int, int], int] = {}
        for rank, theirs in enumerate(everyone):
            for i, want in enumerate(theirs):
                if self._holder_of(want.index) != me or rank == me:
                    continue
                piece = self._piece(want)
                served.setdefault(rank, []).append(piece)
                if want.pickled:
                    sizes[(rank, i)] = piece.numel()
        known: dict[tuple[int, int], int] = {}
        for told in self.transport.all_gather(sizes):
            known.update(told)

        recvs: dict[int, list[torch.Tensor]] = {}
        landing: list[tuple[ReadItem, torch.Tensor, torch.Tensor | None]] = []
        for i, (item, want) in enumerate(zip(plan.items, wants, strict=True)):
            holder = self._holder_of(want.index)
            if holder == me:
                _land(planner, item, self._piece(want), None)
                continue
            if want.pickled:
                buffer = torch.empty(known[(me, i)], dtype=torch.uint8)
                landing.append((item, buffer, None))
            else:
                into = planner.resolve_tensor(item).detach()
                direct = into.device.type == "cpu" and into.is_contiguous()
                buffer = (
                    as_bytes(into)
                    if direct
                    else torch.empty(into.numel() * into.element_size(), dtype=torch.uint8)
                )
                landing.append((item, buffer, into))
            recvs.setdefault(holder, []).append(buffer)
        self.bytes_moved += self.transport.stream(served, recvs)
        for item, buffer, target in landing:
            _land(planner, item, buffer, target)
        done: Future[None] = Future()
        done.set_result(None)
        return done


def _want(item: ReadItem) -> Want:
    return Want(
        index=item.storage_index,
        offsets=tuple(item.storage_offsets),
        lengths=tuple(item.lengths),
        pickled=item.type == LoadItemType.BYTE_IO,
    )


def _land(
    planner: LoadPlanner, item: ReadItem, data: torch.Tensor, target: torch.Tensor | None
) -> None:
    """Hand a piece (flat bytes) to the planner: unpickled, or copied into its tensor
    (`target`: the tensor it was received into or is to be copied into)."""
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, io.BytesIO(data.numpy().tobytes()))
        return
    if target is None:
        target = planner.resolve_tensor(item).detach()
    flat = as_bytes(target) if target.device.type == "cpu" and target.is_contiguous() else None
    if flat is None or flat.data_ptr() != data.data_ptr():
        source = data.view(target.dtype).view(target.shape)
        target.copy_(source)
    planner.commit_tensor(item, target)
