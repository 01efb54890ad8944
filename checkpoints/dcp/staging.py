"""The async save's staging copy, made at page-aligned addresses.

DCP's `StateDictStager` copies each storage of the state into a host buffer it keeps for
the next saves. Its buffers come from torch's CPU allocator (64-byte aligned), which
direct I/O cannot write from. `AlignedStateDictStager` makes the large ones page-aligned
(an anonymous mapping each), so the shard writer hands the staged bytes to the disk as
they are, with no copy into the page cache (`shard_file`). The rest of DCP's staging
(the reuse of buffers across saves, pinning for device copies, DTensor and nested
containers) is DCP's own.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from elastrain.checkpoints.dcp.host_memory import page_aligned_storage

# Storages at least this big get a page-aligned buffer; smaller ones are written from the
# bounce buffer anyway (they end up in records below `shard_file.ALIGN_RECORD_MIN_BYTES`).
ALIGNED_STAGING_MIN_BYTES = 64 * 1024


class AlignedStateDictStager(StateDictStager):
    """DCP's stager, with the copies of large storages at page-aligned addresses."""

    def _stage_untyped_storage(
        self, storage: torch.UntypedStorage, non_blocking: bool = False
    ) -> Any:
        if (
            storage in self._cached_storage_mapping
            or self.share_memory
            or storage.nbytes() < ALIGNED_STAGING_MIN_BYTES
        ):
            return super()._stage_untyped_storage(storage, non_blocking=non_blocking)
        staged = page_aligned_storage(storage.nbytes(), pin=self.pin_memory)
        staged.copy_(storage, non_blocking=non_blocking)
        self._cached_storage_mapping[storage] = staged
        return staged


def aligned_default_stager(*, pin_memory: bool, non_blocking: bool) -> DefaultStager:
    """DCP's `DefaultStager` (async staging in its thread, buffers reused across saves)
    over an `AlignedStateDictStager`. Where torch's internals differ from the ones this
    was written against, DCP's own stager stays (the writes then go through the bounce
    buffer: slower, the same bytes)."""
    stager = DefaultStager(
        StagingOptions(
            use_pinned_memory=pin_memory,
            use_shared_memory=False,  # shared memory is for DCP's process mode, unused here
            use_async_staging=True,
            use_non_blocking_copy=non_blocking,
        )
    )
    current = getattr(stager, "_state_dict_stager", None)
    if isinstance(current, StateDictStager):
        stager._state_dict_stager = AlignedStateDictStager(
            pin_memory=current.pin_memory, share_memory=False
        )
    return stager


def copy_non_tensors(state: Any) -> Any:
    """`state` with its containers and non-tensor values copied and its tensors as they
    are: what an in-place save writes (its tensors are not changed before the write is
    over; a learning rate in a param group may be, by the next step)."""
    if isinstance(state, torch.Tensor):
        return state
    if isinstance(state, dict):
        return {key: copy_non_tensors(value) for key, value in state.items()}
    if isinstance(state, list | tuple) and not hasattr(state, "_fields"):
        return type(state)(copy_non_tensors(value) for value in state)
    return copy.deepcopy(state)
