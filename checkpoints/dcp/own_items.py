"""The async save's staging copy of a replicated state: only the items this rank writes.

Every rank of a DDP job holds the whole state, and DCP's save planner gives each item to
one rank (its deduplication balances the bytes), so each rank writes about 1/N of it.
DCP's stager copies the whole state on every rank all the same: N times the copy, and
N times the host memory, that the save needs. Here each rank works out which items it
will write, with no collective: every rank's local plan of a replicated state is the
same, so the planner's own deduplication of N such plans is the global plan's, and the
save then writes them from the copy (`held_copy`). The copy's buffers are page-aligned
(direct I/O writes them as they lie) and reused from save to save.
"""

from __future__ import annotations

from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_save_plan,
)
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import WriteItem

from elastrain.checkpoints.dcp.held_copy import HeldCopy
from elastrain.checkpoints.dcp.in_memory import (
    Arena,
    Blob,
    arena_buffer,
    arena_of_items,
    keep_items,
)
from elastrain.checkpoints.dcp.save_plans import plan_key


def own_items(planner: DefaultSavePlanner, rank: int, world_size: int) -> list[WriteItem]:
    """The items rank `rank` of `world_size` ranks holding the same state will write:
    `planner` set up on that state, deduplicating as in its global plan."""
    state = planner.state_dict
    plans = [create_default_local_save_plan(state, r == 0) for r in range(world_size)]
    return list(planner._dedup_save_plans(plans)[rank].items)


class OwnItemsStager:
    """Makes, in a thread of its own, the copy an async save of a replicated state
    writes. One copy at a time: the caller does not stage again until the save that
    wrote the last copy is done (`ShardedCheckpointer` waits for it first)."""

    def __init__(self, rank: int, world_size: int, *, pin: bool) -> None:
        self.rank, self.world_size, self.pin = rank, world_size, pin
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage")
        self._arena: Arena | None = None
        # The items this rank writes, kept while the state's layout holds: finding them
        # plans the state once per rank (`own_items`), Python that holds the GIL.
        self._items_key: Hashable | None = None
        self._items: list[WriteItem] = []
        self._views: Blob = {}
        self._pickled: dict[MetadataIndex, tuple[Any, torch.Tensor]] = {}

    def stage(self, state: dict[str, Any], step: int) -> Future[HeldCopy]:
        return self._executor.submit(self._copy, state, step)

    def _copy(self, state: dict[str, Any], step: int) -> HeldCopy:
        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=self.rank == 0)
        key = plan_key(state, is_coordinator=self.rank == 0)
        if key is None or key != self._items_key:
            self._items = own_items(planner, self.rank, self.world_size)
            self._items_key = key
        items = self._items
        arena = arena_of_items(items)
        if arena != self._arena:  # the first save, or the state changed shape
            self._arena, self._pickled = arena, {}
            self._views = arena.views(arena_buffer(arena.nbytes, pin=self.pin))
        copied = keep_items(items, planner, into=self._views, pickled=self._pickled)
        return HeldCopy(items=copied, step=step)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._arena, self._views, self._pickled = None, {}, {}
        self._items_key, self._items = None, []
