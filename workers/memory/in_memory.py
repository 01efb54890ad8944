"""A DCP checkpoint held in host memory, spread over the ranks that saved it.

`MemoryWriter` is a `torch.distributed.checkpoint` storage writer that keeps every item of
a rank's shard in that rank's memory (tensors as host copies of their chunks, the few
pickled items as bytes) and records, in DCP's `Metadata`, which rank holds which item
(`HeldBy`); `Arena` lays a rank's tensor items side by side in one buffer.
`elastrain.workers.memory.peer_reader.PeerReader` is the storage reader that loads such a checkpoint into a group
of any size and layout: DCP's own load planner decides which piece of which saved chunk
each rank needs (exactly as when it loads from disk: the same resharding for FSDP, tensor
parallel, pipeline stages and 2-D), and `read_data` fetches each piece from whichever
rank of the new group holds that item now (`holder`), over a `Transport` that streams raw
tensor bytes (elastrain.workers.memory.transfer): never a pickled state.

Workers keep these "checkpoints" in peers' RAM (`elastrain.workers.memory`); the disk checkpoints
stay the durable copy.
"""

from __future__ import annotations

import copy
import dataclasses
import io
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
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
    pickled: dict[MetadataIndex, tuple[Any, torch.Tensor]] | None = None,
) -> Blob:
    """This rank's items of a save plan, resolved by `planner` (set up on the state to
    keep) and kept on the host: what one refresh of peer memory copies. Local: no
    collective, so a plan made once (collectively) serves every later refresh.

    `reuse`: buffers to copy into where shape and dtype match; `into`: buffers every
    tensor item must be copied into (an arena's views: a mismatch is an error);
    `pickled`: the pickled items of an earlier call, by item, with the value each was
    made from: an item whose value is unchanged (most hyperparameters, every step) is not
    pickled again (its bytes are shared, never written to)."""
    reuse = reuse or {}
    blob: Blob = {}
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    for item in items:
        if item.type == WriteItemType.BYTE_IO:
            blob[item.index] = _pickled(item, planner, pickled)
            continue
        data = planner.resolve_data(item)
        assert isinstance(data, torch.Tensor)
        tensor = data.detach()
        if into is not None:
            target = into[item.index]
            if (target.shape, target.dtype) != (tensor.shape, tensor.dtype):
                raise ValueError(
                    f"{item.index.fqn}: {tuple(tensor.shape)} {tensor.dtype} does not fit the "
                    f"planned {tuple(target.shape)} {target.dtype}"
                )
            targets.append(target)
            sources.append(tensor)
            blob[item.index] = target
            continue
        if not copy and tensor.device.type == "cpu":
            blob[item.index] = tensor
            continue
        buffer = reuse.get(item.index)
        if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
            buffer = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
        targets.append(buffer)
        sources.append(tensor)
        blob[item.index] = buffer
    copy_all(targets, sources)
    return blob


def _pickled(
    item: WriteItem,
    planner: SavePlanner,
    cache: dict[MetadataIndex, tuple[Any, torch.Tensor]] | None,
) -> torch.Tensor:
    """A pickled item's bytes: from `cache` when its value is the one they were made of."""
    lookup = getattr(planner, "lookup_object", None)
    value = lookup(item.index) if cache is not None and lookup is not None else None
    if cache is not None and item.index in cache:
        before, raw = cache[item.index]
        if _same(before, value):
            return raw
    data = planner.resolve_data(item)
    assert isinstance(data, io.BytesIO)
    raw = torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8)
    if cache is not None and lookup is not None:
        cache[item.index] = (copy.deepcopy(value), raw)
    return raw


def _same(a: Any, b: Any) -> bool:
    """Equal values of the same types (1 == 1.0 == True, but they pickle apart)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor):
        return False  # never cached by value
    try:
        return bool(a == b)
    except Exception:
        return False


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
        """The tensor items as views of `buffer` (flat uint8 of `nbytes`). Each view has
        a storage of its own bytes alone (an alias of the buffer's): torch.save writes a
        tensor's whole storage, so a checkpoint written from these views writes each
        item's bytes, and needs no copy of them to do so."""
        storage = buffer.untyped_storage()
        base = buffer.storage_offset()
        out: Blob = {}
        for index, offset, dtype, shape in self.tensors:
            size = shape.numel() * _element_size(dtype)
            piece = storage[base + offset : base + offset + size]
            out[index] = torch.empty(0, dtype=dtype).set_(piece).view(shape)
        return out


def arena_of(metadata: Metadata, rank: int) -> Arena:
    """The arena of the items rank `rank` of the saving group holds."""
    return _arena((index, tensor_layout(metadata, index)) for index in held_items(metadata, rank))


def arena_of_items(items: Iterable[WriteItem]) -> Arena:
    """The arena of a save plan's items, in their order."""
    return _arena(
        (
            item.index,
            (item.tensor_data.properties.dtype, item.tensor_data.chunk.sizes)
            if item.tensor_data is not None
            else None,
        )
        for item in items
    )


def _arena(
    layouts: Iterable[tuple[MetadataIndex, tuple[torch.dtype, torch.Size] | None]],
) -> Arena:
    tensors: list[tuple[MetadataIndex, int, torch.dtype, torch.Size]] = []
    pickled: list[MetadataIndex] = []
    offset = 0
    for index, layout in layouts:
        if layout is None:
            pickled.append(index)
            continue
        dtype, shape = layout
        size = shape.numel() * _element_size(dtype)
        offset = -(-offset // ARENA_ALIGN) * ARENA_ALIGN
        tensors.append((index, offset, dtype, shape))
        offset += size
    return Arena(tuple(tensors), tuple(pickled), -(-offset // ARENA_ALIGN) * ARENA_ALIGN)


def arena_buffer(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A buffer for an arena of `nbytes`; `pin` for device copies into it."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def copy_all(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """Copy each source into its host target, all at once: host tensors in one
    `torch._foreach_copy_` (one call, the GIL released while it copies, where a loop
    takes it back between tensors); device tensors with non-blocking copies queued on the
    current stream, after the work already queued there, and one wait for the last (a
    blocking copy per tensor waits for the device once per tensor)."""
    on_host = [i for i, s in enumerate(sources) if s.device.type == "cpu"]
    if len(on_host) == len(sources):
        if targets:
            torch._foreach_copy_(targets, sources)
        return
    for i in on_host:
        targets[i].copy_(sources[i])
    devices = set()
    for target, source in zip(targets, sources, strict=True):
        if source.device.type != "cpu":
            target.copy_(source, non_blocking=True)
            devices.add(source.device)
    for device in devices:
        copied = torch.Event(device=device)
        copied.record(torch.accelerator.current_stream(device))
        copied.synchronize()
