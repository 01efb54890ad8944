"""Bucketed collectives over plain tensors or the local shards of DTensors, for the
strategies that reduce gradients themselves (pipeline, tensor parallel)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

# Large enough to amortise per-call latency, small enough not to double the gradient
# memory of a big stage in one temporary buffer.
BUCKET_BYTES = 32 * 1024 * 1024


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank holds: a DTensor's local shard, else `t`. Callers change it in
    place (gradients, synced values), so it must share the DTensor's storage.

    The shard itself (`_local_tensor`), not `to_local()`: that is an autograd function
    call, ~13 us of host time each on a CPU (measured: bench/step_host_overhead.py's
    notes in docs/bench-gpu.md), and the clipping of an FSDP2 step made two per parameter
    (~300 a step for the 12-layer gpt), on a step bound by the host. `to_local()` stays the
    fallback should torch rename the attribute."""
    shard = getattr(t, "_local_tensor", None)
    if isinstance(shard, torch.Tensor):
        return shard
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def buckets(tensors: Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Consecutive runs of same-dtype, same-device tensors of at most ~BUCKET_BYTES."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        last = out[-1] if out else None
        if (
            last is None
            or size + nbytes > BUCKET_BYTES
            or last[0].dtype != t.dtype
            or last[0].device != t.device
        ):
            out.append([t])
            size = nbytes
        else:
            last.append(t)
            size += nbytes
    return out


def all_reduce_scaled(
    tensors: Sequence[torch.Tensor], factor: float, group: dist.ProcessGroup
) -> None:
    """In place: t <- sum over the group of (factor * t), bucket by bucket."""
    for bucket in buckets([local(t) for t in tensors]):
        flat = torch._utils._flatten_dense_tensors(bucket)
        flat.mul_(factor)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
        for t, synced in zip(
            bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True
        ):
            t.copy_(synced)


def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """In place: every rank of the group takes group rank 0's values."""
    for bucket in buckets([local(t) for t in tensors]):
        flat = torch._utils._flatten_dense_tensors(bucket)
        dist.broadcast(flat, group=group, group_src=0)
        for t, synced in zip(
            bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True
        ):
            t.copy_(synced)
