"""A DCP checkpoint held in host memory, spread over the ranks that saved it.

`MemoryWriter` is a `torch.distributed.checkpoint` storage writer that keeps every item of
a rank's shard in that rank's memory (tensors as host copies of their chunks, the few
pickled items as bytes) and records, in DCP's `Metadata`, which rank holds which item
(`HeldBy`). `PeerReader` is the storage reader that loads such a checkpoint into a group
of any size and layout: DCP's own load planner decides which piece of which saved chunk
each rank needs (exactly as when it loads from disk: the same resharding for FSDP, tensor
parallel, pipeline stages and 2-D), and `read_data` fetches each piece from whichever
rank of the new group holds that item now (`holder`), over a `Transport` that streams raw
tensor bytes (workers.memory.transfer): never a pickled state.

Workers keep these "checkpoints" in peers' RAM (`workers.memory`); the disk checkpoints
stay the durable copy.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

#: One rank's items: tensors as host tensors shaped like their chunk, pickled items as
#: 1-D uint8 tensors.
Blob = dict[MetadataIndex, torch.Tensor]


@dataclasses.dataclass(frozen=True, slots=True)
class HeldBy:
    """`Metadata.storage_data` of an in-memory checkpoint: the rank of the saving group
    whose memory holds the item."""

    rank: int


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a host tensor (copied first only when not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


def blob_bytes(blob: Blob) -> int:
    return sum(t.numel() * t.element_size() for t in blob.values())


# ---------------------------------------------------------------------------------------
# Save
# ---------------------------------------------------------------------------------------


class MemoryWriter(StorageWriter):
    """Keeps this rank's items in memory (`blob`); after the save, every rank's
    `dcp.save` returns the global `Metadata` (DCP broadcasts it), whose `storage_data`
    says which rank holds each item.

    `copy=False` keeps host tensors by reference (a one-off hand-over of state that does
    not change meanwhile); `reuse` offers buffers of an older copy to copy into.
    """

    def __init__(self, *, copy: bool = True, reuse: Blob | None = None) -> None:
        super().__init__()
        self.copy = copy
        self.reuse = reuse or {}
        self.items: list[WriteItem] = []
        self.blob: Blob = {}
        self.metadata: Metadata | None = None
        self._rank = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.items, self.blob, self.metadata = [], {}, None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Plans come in group-rank order: say in each which rank's memory its items stay in.
        return [dataclasses.replace(p, storage_data=HeldBy(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        held = plan.storage_data if isinstance(plan.storage_data, HeldBy) else HeldBy(self._rank)
        self.items = list(plan.items)
        self.blob = keep_items(self.items, planner, copy=self.copy, reuse=self.reuse)
        results = [
            WriteResult(
                index=item.index,
                size_in_bytes=self.blob[item.index].numel() * self.blob[item.index].element_size(),
                storage_data=held,
            )
            for item in self.items
        ]
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}
        self.metadata = metadata

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def keep_items(
    items: Iterable[WriteItem],
    planner: SavePlanner,
    *,
    copy: bool = True,
    reuse: Blob | None = None,
    into: Blob | None = None,
) -> Blob:
    """This rank's items of a save plan, resolved by `planner` (set up on the state to
    keep) and kept on the host: what one refresh of peer memory copies. Local: no
    collective, so a plan made once (collectively) serves every later refresh.

    `reuse`: buffers to copy into where shape and dtype match; `into`: buffers every
    tensor item must be copied into (an arena's views: a mismatch is an error)."""
    reuse = reuse or {}
    blob: Blob = {}
    for item in items:
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            assert isinstance(data, io.BytesIO)
            raw = data.getvalue()
            blob[item.index] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            continue
        assert isinstance(data, torch.Tensor)
        tensor = data.detach()
        if into is not None:
            target = into[item.index]
            if (target.shape, target.dtype) != (tensor.shape, tensor.dtype):
                raise ValueError(
                    f"{item.index.fqn}: {tuple(tensor.shape)} {tensor.dtype} does not fit the "
                    f"planned {tuple(target.shape)} {target.dtype}"
                )
            blob[item.index] = target.copy_(tensor)
            continue
        if not copy and tensor.device.type == "cpu":
            blob[item.index] = tensor
            continue
        buffer = reuse.get(item.index)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        buffer.copy_(tensor)
        blob[item.index] = buffer
    return blob


# ---------------------------------------------------------------------------------------
# What the metadata says about items
# ---------------------------------------------------------------------------------------


def held_items(metadata: Metadata, rank: int) -> list[MetadataIndex]:
    """The items rank `rank` of the saving group holds, in an order every rank agrees on."""
    storage = metadata.storage_data or {}
    mine = [index for index, held in storage.items() if held.rank == rank]
    return sorted(mine, key=lambda i: (i.fqn, tuple(i.offset or ())))


def tensor_layout(
    metadata: Metadata, index: MetadataIndex
) -> tuple[torch.dtype, torch.Size] | None:
    """(dtype, chunk shape) of a tensor item; None for a pickled one."""
    md = metadata.state_dict_metadata[index.fqn]
    if isinstance(md, BytesStorageMetadata):
        return None
    assert isinstance(md, TensorStorageMetadata)
    offset = torch.Size(index.offset or ())
    hint = index.index
    if hint is not None and hint < len(md.chunks) and md.chunks[hint].offsets == offset:
        return md.properties.dtype, md.chunks[hint].sizes
    for chunk in md.chunks:
        if chunk.offsets == offset:
            return md.properties.dtype, chunk.sizes
    raise KeyError(f"no chunk of {index.fqn} at offset {list(offset)} in the metadata")


#: Tensor items start at multiples of this in an arena (any dtype's view is aligned).
ARENA_ALIGN = 64


@dataclasses.dataclass(frozen=True, slots=True)
class Arena:
    """Where the items one rank of the saving group holds lie in host memory: its tensor
    items side by side in one flat byte buffer of `nbytes` (so a copy of them travels as
    one message, with no packing), its pickled items apart (their size changes)."""

    tensors: tuple[tuple[MetadataIndex, int, torch.dtype, torch.Size], ...]
    """(item, byte offset, dtype, chunk shape), in `held_items` order."""
    pickled: tuple[MetadataIndex, ...]
    nbytes: int

    def views(self, buffer: torch.Tensor) -> Blob:
        """The tensor items as views of `buffer` (flat uint8 of `nbytes`)."""
        out: Blob = {}
        for index, offset, dtype, shape in self.tensors:
            size = shape.numel() * _element_size(dtype)
            out[index] = buffer[offset : offset + size].view(dtype).view(shape)
        return out


def arena_of(metadata: Metadata, rank: int) -> Arena:
    """The arena of the items rank `rank` of the saving group holds."""
    tensors: list[tuple[MetadataIndex, int, torch.dtype, torch.Size]] = []
    pickled: list[MetadataIndex] = []
    offset = 0
    for index in held_items(metadata, rank):
        layout = tensor_layout(metadata, index)
        if layout is None:
            pickled.append(index)
            continue
        dtype, shape = layout
        tensors.append((index, offset, dtype, shape))
        size = shape.numel() * _element_size(dtype)
        offset += -(-size // ARENA_ALIGN) * ARENA_ALIGN
    return Arena(tuple(tensors), tuple(pickled), offset)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# ---------------------------------------------------------------------------------------
# Load
# ---------------------------------------------------------------------------------------


class Transport(Protocol):
    """How the ranks of the loading group talk (workers.memory.handover)."""

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
