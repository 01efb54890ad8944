"""A DCP checkpoint held in host memory, spread over the ranks that saved it.

`MemoryWriter` is a `torch.distributed.checkpoint` storage writer that keeps every item of
a rank's shard in that rank's memory (tensors as host tensors of their chunks, the few
pickled items as bytes) and records, in DCP's `Metadata`, which rank holds which item
(`HeldBy`). Peer memory's snapshots (`elastrain.workers.memory.snapshots`) plan once with
it and then resolve the same items against the CPU state dict DCP's staging makes
(`held_blob`). `elastrain.workers.memory.peer_reader.PeerReader` loads such a checkpoint
into a group of any size and layout with DCP's own load planner.

Workers keep these "checkpoints" in peers' RAM (`elastrain.workers.memory`); the disk
checkpoints stay the durable copy.
"""

from __future__ import annotations

import dataclasses
import io
import pickle
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

#: One rank's items: tensors as host tensors shaped like their chunk, pickled items as
#: 1-D uint8 tensors.
Blob = dict[MetadataIndex, torch.Tensor]
#: A pickled item's bytes as last made, by item, with `pickle.dumps` of its value.
PickleCache = dict[MetadataIndex, tuple[bytes, torch.Tensor]]
#: A tensor item's (dtype, chunk shape); None for a pickled item.
Layout = tuple[torch.dtype, torch.Size] | None


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


class MemoryWriter(StorageWriter):
    """Keeps this rank's items (`blob`, host tensors by reference: a device tensor is
    copied to the host); after the save, every rank's `dcp.save` returns the global
    `Metadata` (DCP broadcasts it), whose `storage_data` says which rank holds each item."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[WriteItem] = []
        self.blob: Blob = {}
        self._rank = 0

    def reset(self, checkpoint_id: Any = None) -> None:
        self.items, self.blob = [], {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Plans come in group-rank order: say in each which rank's memory its items stay in.
        return [dataclasses.replace(p, storage_data=HeldBy(i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        held = plan.storage_data if isinstance(plan.storage_data, HeldBy) else HeldBy(self._rank)
        assert isinstance(planner, DefaultSavePlanner)  # dcp.save's own, or a subclass
        self.items = list(plan.items)
        self.blob = {i: t.cpu() for i, t in held_blob(self.items, planner).items()}
        results = [
            WriteResult(
                index=index,
                size_in_bytes=tensor.numel() * tensor.element_size(),
                storage_data=held,
            )
            for index, tensor in self.blob.items()
        ]
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}

    def storage_meta(self) -> StorageMeta | None:
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def held_blob(
    items: Iterable[WriteItem], planner: DefaultSavePlanner, pickled: PickleCache | None = None
) -> Blob:
    """This rank's items of a save plan, resolved by `planner` (set up on the state to
    keep): tensors by reference, pickled items as bytes. `pickled`: the bytes of an
    earlier call, reused for an item whose value pickles the same (most hyperparameters,
    every refresh: torch.save's ~60 µs an item, measured here, would be a tenth of a small
    model's refresh)."""
    blob: Blob = {}
    for item in items:
        if item.type != WriteItemType.BYTE_IO:
            tensor = planner.resolve_data(item)
            assert isinstance(tensor, torch.Tensor)
            blob[item.index] = tensor.detach()
            continue
        key = pickle.dumps(planner.lookup_object(item.index))
        cached = (pickled or {}).get(item.index)
        if cached is not None and cached[0] == key:
            blob[item.index] = cached[1]
            continue
        data = planner.resolve_data(item)
        assert isinstance(data, io.BytesIO)
        blob[item.index] = torch.frombuffer(bytearray(data.getvalue()), dtype=torch.uint8)
        if pickled is not None:
            pickled[item.index] = (key, blob[item.index])
    return blob


def held_items(metadata: Metadata, rank: int) -> list[tuple[MetadataIndex, Layout]]:
    """The items rank `rank` of the saving group holds, in an order every rank agrees on,
    each with (dtype, chunk shape), or None for a pickled one."""
    storage = metadata.storage_data or {}
    mine = sorted(
        (index for index, held in storage.items() if held.rank == rank),
        key=lambda i: (i.fqn, tuple(i.offset or ())),
    )
    return [(index, tensor_layout(metadata, index)) for index in mine]


def tensor_layout(metadata: Metadata, index: MetadataIndex) -> Layout:
    """(dtype, chunk shape) of a tensor item; None for a pickled one."""
    md = metadata.state_dict_metadata[index.fqn]
    if isinstance(md, BytesStorageMetadata):
        return None
    assert isinstance(md, TensorStorageMetadata)
    offset = torch.Size(index.offset or ())
    for chunk in md.chunks:
        if chunk.offsets == offset:
            return md.properties.dtype, chunk.sizes
    raise KeyError(f"no chunk of {index.fqn} at offset {list(offset)} in the metadata")
