"""A DCP checkpoint held in host memory, spread over the ranks that saved it (the disk
checkpoints stay the durable copy).

`MemoryWriter`, a DCP storage writer, keeps every item of a rank's shard in that rank's
memory (tensors as host tensors of their chunks, pickled items as bytes) and records in
`Metadata.storage_data` which saving rank holds each. Snapshots plan once with it, then
resolve the same items again (`held_blob`); `peer_reader.PeerReader` loads it into a
group of any size and layout with DCP's own load planner.
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
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

#: One rank's items: tensors as host tensors shaped like their chunk, pickled items as
#: 1-D uint8 tensors.
Blob = dict[MetadataIndex, torch.Tensor]
#: A pickled item's bytes as last made, with `pickle.dumps` of its value.
PickleCache = dict[MetadataIndex, tuple[bytes, torch.Tensor]]
#: A tensor item's (dtype, chunk shape); None for a pickled item.
Layout = tuple[torch.dtype, torch.Size] | None


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a host tensor (copied first only when not contiguous)."""
    flat = tensor.detach().contiguous().reshape(-1)
    return flat if flat.dtype == torch.uint8 else flat.view(torch.uint8)


class MemoryWriter(StorageWriter):
    """Keeps this rank's items (`blob`: host tensors by reference, device ones copied);
    every rank's `dcp.save` returns the `Metadata` saying which rank holds each item."""

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
        return [dataclasses.replace(p, storage_data=i) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        held = plan.storage_data if isinstance(plan.storage_data, int) else self._rank
        assert isinstance(planner, DefaultSavePlanner)  # dcp.save's own, or a subclass
        self.items = list(plan.items)
        self.blob = {i: t.cpu() for i, t in held_blob(self.items, planner).items()}
        results = [
            WriteResult(index, t.numel() * t.element_size(), held) for index, t in self.blob.items()
        ]
        out: Future[list[WriteResult]] = Future()
        out.set_result(results)
        return out

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.storage_data = {r.index: r.storage_data for rs in results for r in rs}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        return False


def held_blob(
    items: Iterable[WriteItem], planner: DefaultSavePlanner, pickled: PickleCache | None = None
) -> Blob:
    """This rank's items of a save plan, resolved by `planner`: tensors by reference,
    pickled items as bytes. `pickled`: an earlier call's bytes, reused for a value that
    pickles the same (torch.save's ~60 µs an item would be a tenth of a small refresh)."""
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
    """The items saving rank `rank` holds, in an order every rank agrees on, with their
    `Layout`."""
    storage = metadata.storage_data or {}
    mine = sorted(
        (index for index, held in storage.items() if held == rank),
        key=lambda i: (i.fqn, tuple(i.offset or ())),
    )
    out: list[tuple[MetadataIndex, Layout]] = []
    for index in mine:
        md = metadata.state_dict_metadata[index.fqn]
        if isinstance(md, BytesStorageMetadata):
            out.append((index, None))
            continue
        assert isinstance(md, TensorStorageMetadata)
        offset = torch.Size(index.offset or ())
        chunk = next(c for c in md.chunks if c.offsets == offset)
        out.append((index, (md.properties.dtype, chunk.sizes)))
    return out
