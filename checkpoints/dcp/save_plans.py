"""DCP's save planner, its plans kept from save to save while the state's layout holds.

DCP plans every save from scratch: each rank walks its state into a local plan (a write
item per tensor: name, chunk, dtype, sizes), and the coordinator merges every rank's
plan into the global plan and the checkpoint's metadata (two `dataclasses.replace` per
item, then a validation pass). For the ~600 tensors of a 12-layer GPT with AdamW that is
~11 ms of local and ~10 ms of global planning a save, measured on this machine's CPU, all
of it Python holding the GIL beside a training thread that needs the GIL for every op it
launches (docs/bench-checkpoint.md, "GIL wait"); the coordinator's share grows with the
number of ranks. Nothing in a plan depends on the tensors' values, only on the state's
layout (`staging.layout_of`: containers and keys, each tensor's dtype, shape, strides,
storage and sharding), each tensor's `requires_grad`, and whether the rank coordinates.

`KeptPlanSavePlanner`, one per checkpointer, keeps

- its local plan, reused while the layout it was made from holds. Each local plan it
  makes carries a new token (the planner's nonce and a count);
- on the coordinator, the global plan and metadata, reused while every rank's plan
  carries the token it carried when they were made.

Every rank still sends its plan through DCP's gather, as before, so whatever a rank
holds, the coordinator re-plans as soon as any rank's plan is new. A failed save forgets
both (`forget`).
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from elastrain.checkpoints.dcp.held_copy import HeldCopy
from elastrain.checkpoints.dcp.in_memory import Blob
from elastrain.checkpoints.dcp.staging import layout_of


def plan_key(state: dict[str, Any], is_coordinator: bool) -> Hashable | None:
    """What a DCP save plan of `state` depends on; None where `layout_of` cannot tell
    (a state holding other objects than containers, immutable values and tensors)."""
    leaves: list[torch.Tensor] = []
    layout = layout_of(state, leaves)
    if layout is None:
        return None
    return layout, tuple(leaf.requires_grad for leaf in leaves), is_coordinator


@dataclass(frozen=True)
class FinishedSave:
    """A save that went through, as a later save of the same plans can repeat it without
    DCP's exchanges (`kept_save`): this rank's final plan (its file named), where its
    items went, and on the coordinator where every rank's went."""

    token: tuple[str, int]
    plan: SavePlan
    written: list[WriteResult]
    every_rank: list[list[WriteResult]] | None


@dataclass(frozen=True)
class TokenedSavePlan(SavePlan):
    """A local save plan and the token it was made under: the same token, the same plan."""

    token: tuple[str, int] | None = None


class KeptPlanSavePlanner(DefaultSavePlanner):
    """DCP's save planner (the same plans, files and metadata), keeping its plans while
    the state's layout holds (see the module docstring). One save at a time: a
    checkpointer's saves never overlap.

    `write_from(copy)` before a save writes the data of every item from `copy` (a
    `HeldCopy`: peer memory's or the DDP staging copy of the same step) instead of the
    state's, which may change meanwhile; `write_from(None)` writes the state's."""

    def __init__(self) -> None:
        super().__init__()
        self._nonce = os.urandom(8).hex()  # tokens of another planner never match
        self._key: Hashable | None = None
        self._local: TokenedSavePlan | None = None
        self._global_tokens: tuple[tuple[str, int] | None, ...] | None = None
        self._global: tuple[list[SavePlan], Metadata] | None = None
        self._copy: Blob | None = None
        self._finished: FinishedSave | None = None
        self.local_plans_made = 0
        self.global_plans_made = 0

    def write_from(self, copy: HeldCopy | None) -> None:
        self._copy = copy.items if copy is not None else None

    def forget(self) -> None:
        """Plan the next save from scratch (after a failed one: whatever it left)."""
        self._key = self._local = self._global_tokens = self._global = None
        self._finished = None

    def saved(
        self, written: list[WriteResult] | None, every_rank: list[list[WriteResult]] | None
    ) -> None:
        """The save just planned went through: `written`, where this rank's items went;
        `every_rank` (the coordinator's), where every rank's did."""
        if self._local is None or self._local.token is None or written is None:
            self._finished = None
            return
        self._finished = FinishedSave(self._local.token, self.plan, written, every_rank)

    def finished_save(self) -> FinishedSave | None:
        """The last save's, where this save (set up since) has the same local plan."""
        finished, local = self._finished, self._local
        if finished is None or local is None or finished.token != local.token:
            return None
        return finished

    @property
    def kept_metadata(self) -> Metadata | None:
        """The coordinator's metadata of the last global plan."""
        return self._global[1] if self._global is not None else None

    def set_up_planner(
        self,
        state_dict: dict[str, Any],
        storage_meta: StorageMeta | None = None,
        is_coordinator: bool = False,
    ) -> None:
        key = plan_key(state_dict, is_coordinator)
        super().set_up_planner(state_dict, storage_meta, is_coordinator)
        if key is None or key != self._key:
            self._key, self._local = key, None

    def create_local_plan(self) -> SavePlan:
        if self._local is None:
            plan = super().create_local_plan()
            self.local_plans_made += 1
            fields = {field.name: getattr(plan, field.name) for field in dataclasses.fields(plan)}
            self._local = TokenedSavePlan(**fields, token=(self._nonce, self.local_plans_made))
        self.plan = self._local
        return self._local

    def create_global_plan(self, all_plans: list[SavePlan]) -> tuple[list[SavePlan], Metadata]:
        tokens = tuple(getattr(plan, "token", None) for plan in all_plans)
        if self._global is None or None in tokens or tokens != self._global_tokens:
            self._global_tokens, self._global = None, None
            # DCP's own (its plan caching is off: the plans themselves come back); raises
            # on an invalid plan.
            plans, metadata = super().create_global_plan(all_plans)
            self._global, self._global_tokens = (list(plans), metadata), tokens
            self.global_plans_made += 1
        plans, metadata = self._global
        self.global_plan, self.metadata = plans, metadata
        return list(plans), metadata

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if self._copy is None:
            return super().resolve_data(write_item)
        data = self._copy.get(write_item.index)
        if data is None:
            raise KeyError(
                f"{write_item.index.fqn} (offset {list(write_item.index.offset or ())}) is in "
                "this rank's checkpoint plan but not in the copy the save was given"
            )
        if write_item.type == WriteItemType.BYTE_IO:
            return io.BytesIO(data.numpy().tobytes())
        return data
