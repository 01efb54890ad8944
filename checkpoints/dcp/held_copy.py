"""A save whose data is a copy of the state made by someone else at the same step.

Peer memory copies every rank's shard to host memory after the steps it refreshes at
(`elastrain.workers.memory.snapshots`). A checkpoint of such a step needs no copy of its
own: `ShardedCheckpointer.save(copy=...)` plans the save on the live state as usual (the
plan is metadata: names, shapes, which rank writes which item) and the save planner
(`save_plans.KeptPlanSavePlanner.write_from`) gives the writer each item's data from the
copy. The copy's arena is page-aligned, so
the shard writer sends its large items to the disk without copying them again
(`shard_file`). The live state may change as soon as `save` returns.

The copy must hold every item this rank's plan writes: it was planned by DCP's own save
planner over the same state and a group of the same ranks, whose deduplication is
deterministic, so it does; a save it does not cover fails, naming the item, rather than
write live data that may have moved on.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from elastrain.checkpoints.dcp.in_memory import Blob


@dataclass
class HeldCopy:
    """This rank's items of a save plan (tensor items as host tensors, pickled items as
    uint8 tensors of their bytes), copied at the step being saved. Lent to a save: the
    owner must not write into the items until `released` is set."""

    items: Blob
    step: int
    released: threading.Event = field(default_factory=threading.Event)

    def release(self) -> None:
        self.released.set()

    @property
    def in_use(self) -> bool:
        return not self.released.is_set()
