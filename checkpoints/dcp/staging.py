"""The async save's staging copy: page-aligned buffers, and bytes-only copies per layout.

DCP's `StateDictStager` copies each storage of the state into a host buffer it keeps for
the next saves. Its buffers come from torch's CPU allocator (64-byte aligned), which
direct I/O cannot write from. `AlignedStateDictStager` makes the large ones page-aligned
(an anonymous mapping each), so the shard writer hands the staged bytes to the disk as
they are, with no copy into the page cache (`shard_file`).

DCP's stager deep-copies the state tree in Python on every save: per tensor a dispatch
table lookup, a weak-dictionary lookup of its storage, a new tensor (and DTensor) object.
That is ~0.1 ms of GIL per tensor, beside a training thread that needs the GIL for every
op it launches (docs/bench-checkpoint.md, "GIL wait"). `LayoutStager` lets DCP stage the
first save of a state, and any save whose layout differs from the last (other tensors,
shapes, strides, dtypes, devices or containers); later saves of the same layout copy
bytes only, every storage into the one it was staged into (`host_memory.copy_all`: one
`torch._foreach_copy_` on the host, which holds no GIL while it copies), and hand the
writer fresh containers around the same staged tensors.
"""

from __future__ import annotations

import copy
from collections import OrderedDict
from collections.abc import Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from torch.distributed.checkpoint._state_dict_stager import StateDictStager
from torch.distributed.tensor import DTensor

from elastrain.checkpoints.dcp.host_memory import copy_all, page_aligned_storage

# Storages at least this big get a page-aligned buffer; smaller ones are written from the
# bounce buffer anyway (they end up in records below `shard_file.ALIGN_RECORD_MIN_BYTES`).
ALIGNED_STAGING_MIN_BYTES = 64 * 1024

# Values a state holds beside its tensors that are never changed in place: the staged
# tree shares them with the live one.
_IMMUTABLE = (int, float, bool, complex, str, bytes, type(None), torch.dtype, torch.device)


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


class LayoutStager:
    """Makes async saves' staging copies in a thread of its own, into buffers reused from
    save to save. One copy at a time: the caller stages again only once the save that
    wrote the last copy is done (`ShardedCheckpointer` waits for it first).

    `device_copies`: the state may live on an accelerator; its copies go to pinned
    buffers, non-blocking on a stream of their own, waited for before the copy is handed
    on (as DCP's `DefaultStager` does). Create it, and stage, on the thread that trains:
    the stream must not be the compute stream, and the copies start only once the work
    queued on the compute stream when `stage` was called is done (DCP's stager does not
    wait for it, so a copy could read a tensor the last update had yet to write)."""

    def __init__(self, *, device_copies: bool) -> None:
        self._non_blocking = device_copies
        self._stream = torch.Stream() if device_copies else None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckpt-stage")
        self._dcp = AlignedStateDictStager(pin_memory=device_copies, share_memory=False)
        self._layout: tuple[Hashable, ...] | None = None
        self._staged: list[torch.Tensor] = []  # the staged leaf of each tensor leaf
        self._targets: list[torch.Tensor] = []  # the staged storages, one per live storage

    def stage(self, state: dict[str, Any]) -> Future[dict[str, Any]]:
        computed = None
        if self._stream is not None:
            computed = torch.Event()
            computed.record()  # on this (the training) thread's current stream
        return self._executor.submit(self._copy, state, computed)

    def close(self) -> None:
        self._executor.shutdown(wait=True)
        self._dcp.close()
        self._layout, self._staged, self._targets = None, [], []

    def _copy(self, state: dict[str, Any], computed: torch.Event | None = None) -> dict[str, Any]:
        if self._stream is None:
            return self._copy_bytes(state)
        if computed is not None:
            self._stream.wait_event(computed)
        with self._stream:
            staged = self._copy_bytes(state)
        self._stream.synchronize()
        return staged

    def _copy_bytes(self, state: dict[str, Any]) -> dict[str, Any]:
        leaves: list[torch.Tensor] = []
        layout = layout_of(state, leaves)
        if layout is not None and layout == self._layout:
            copy_all(self._targets, _distinct_storages(leaves))
            return rebuilt(state, iter(self._staged))
        staged: dict[str, Any] = self._dcp.stage(state, non_blocking=self._non_blocking)
        self._layout, self._staged, self._targets = None, [], []
        if layout is not None:
            staged_leaves: list[torch.Tensor] = []
            if layout_of(staged, staged_leaves) is not None and _copies_storages(
                leaves, staged_leaves
            ):
                self._layout, self._staged = layout, staged_leaves
                self._targets = _distinct_storages(staged_leaves, like=leaves)
        return staged


def layout_of(state: Any, leaves: list[torch.Tensor]) -> tuple[Hashable, ...] | None:
    """What a staged copy of `state` depends on: its containers, its tensors' storages
    (by address), dtypes, devices, shapes and strides, and for a DTensor its sharding.
    Appends the tensors to `leaves`, in the order `rebuilt` takes them. None where the
    state holds anything else than dicts, lists, tuples, immutable values and plain or
    DTensor tensors (such a state is staged by DCP every time)."""
    tokens: list[Hashable] = []
    return tuple(tokens) if _walk(state, tokens, leaves) else None


def _walk(value: Any, tokens: list[Hashable], leaves: list[torch.Tensor]) -> bool:
    kind = type(value)
    if kind is dict or kind is OrderedDict:  # a module's state_dict() is an OrderedDict
        tokens.append((kind, tuple(value)))
        return all(_walk(v, tokens, leaves) for v in value.values())
    if kind is list or kind is tuple:
        tokens.append((kind, len(value)))
        return all(_walk(v, tokens, leaves) for v in value)
    if isinstance(value, _IMMUTABLE):
        tokens.append(kind.__name__)
        return True
    if kind is DTensor:
        local = value._local_tensor
        if type(local) is not torch.Tensor:
            return False
        tokens.append((DTensor, value.placements, tuple(value.shape), value.device_mesh))
    elif kind is torch.Tensor or kind is torch.nn.Parameter:
        local = value
    else:
        return False
    if local.layout != torch.strided or local.is_meta:
        return False
    storage = local.untyped_storage()
    tokens.append((kind, local.dtype, local.device, tuple(local.shape), local.stride(),
                   local.storage_offset(), storage.data_ptr(), storage.nbytes()))  # fmt: skip
    leaves.append(value)
    return True


def rebuilt(state: Any, staged: Any) -> Any:
    """A tree shaped like `state` (already checked by `layout_of`), holding the next of
    `staged` where `state` holds a tensor and `state`'s own immutable values."""
    kind = type(state)
    if kind is dict:
        return {key: rebuilt(value, staged) for key, value in state.items()}
    if kind is OrderedDict:
        return OrderedDict((key, rebuilt(value, staged)) for key, value in state.items())
    if kind is list or kind is tuple:
        return kind(rebuilt(value, staged) for value in state)
    if isinstance(state, _IMMUTABLE):
        return state
    return next(staged)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _distinct_storages(
    leaves: list[torch.Tensor], like: list[torch.Tensor] | None = None
) -> list[torch.Tensor]:
    """The storage of each leaf as a flat byte tensor, once per storage of `like`'s
    (default: `leaves`' own) leaves in order: tensors sharing a storage (views, tied
    weights) are staged into one storage, as DCP's stager does."""
    seen: set[int] = set()
    out = []
    for leaf, twin in zip(leaves, like if like is not None else leaves, strict=True):
        key = _local(twin).untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            storage = _local(leaf).untyped_storage()
            out.append(torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage))
    return out


def _copies_storages(live: list[torch.Tensor], staged: list[torch.Tensor]) -> bool:
    """Whether each staged tensor sits in a storage of its live tensor's size at the same
    offset, one staged storage per live storage: what copying storages whole relies on."""
    pairs: dict[int, int] = {}
    for a, b in zip(live, staged, strict=True):
        la, lb = _local(a), _local(b)
        sa, sb = la.untyped_storage(), lb.untyped_storage()
        if (
            sa.nbytes() != sb.nbytes()
            or la.storage_offset() != lb.storage_offset()
            or la.stride() != lb.stride()
            or pairs.setdefault(sa.data_ptr(), sb.data_ptr()) != sb.data_ptr()
        ):
            return False
    return len(set(pairs.values())) == len(pairs)


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
