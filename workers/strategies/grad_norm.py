"""Global gradient-norm clipping for models whose parameters are split over ranks
(tensor parallel, FSDP x TP, pipeline stages), with one scalar all-reduce per group.

Each rank adds up the squares of the gradient values it holds, counting a value held by
`r` ranks of its DTensor's mesh (a replicated layer norm under tensor parallelism) as
1/`r` of its square, so the sum over the group is the square of the global norm whatever
the placements. Summing one scalar per group, rather than letting DTensor reduce each
placement in turn, gives every rank the same bits, so replicated parameters stay equal.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from elastrain.workers.agreement import StepAgreement
from elastrain.workers.strategies.collectives import local


def replicas(t: torch.Tensor) -> int:
    """How many ranks of its mesh hold the same values as this rank (1 for a plain
    tensor: the caller's groups say what else holds it)."""
    mesh, placements = getattr(t, "device_mesh", None), getattr(t, "placements", None)
    if mesh is None or placements is None:
        return 1
    n = 1
    for dim, placement in enumerate(placements):
        # Only Replicate repeats values; any kind of shard (FSDP's strided shards of a
        # tensor-parallel shard included) splits them.
        if placement.is_replicate():
            n *= mesh.size(dim)
    return n


def squared_norm_share(grads: Sequence[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global norm (fp32 scalar)."""
    total = torch.zeros((), device=device, dtype=torch.float32)
    if not grads:
        return total
    # Grouped by how many ranks hold each value, a handful of kernels a step whatever the
    # number of parameters (one small add per parameter was hundreds of launches on a GPU).
    groups: dict[int, list[torch.Tensor]] = {}
    for g in grads:
        groups.setdefault(replicas(g), []).append(local(g))
    for held_by, tensors in sorted(groups.items()):
        norms = torch.stack(torch._foreach_norm(tensors, 2.0)).float()
        total += norms.square().sum() / held_by
    return total


def clip_grads_(
    grads: Sequence[torch.Tensor],
    max_norm: float,
    groups: Sequence[dist.ProcessGroup | None],
    device: torch.device,
    carry: StepAgreement | None = None,
) -> torch.Tensor:
    """Scale `grads` in place so their global norm is at most `max_norm`; the squared
    norm is summed over each of `groups` in turn (None: the default group). Returns the
    norm before clipping. Same formula as `torch.nn.utils.clip_grad_norm_`, no host sync.

    `carry`: the step agreement rides in the same all-reduce (two more values). Only
    where the groups together span every rank once (each a dimension of the ranks' grid,
    or the default group alone): summing over each in turn then sums over every rank."""
    sq = squared_norm_share(grads, device).reshape(1)
    packed = sq if carry is None else torch.cat([sq, carry.payload(sq.dtype)])
    for group in groups:
        dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=group)
    if carry is not None:
        carry.carried(packed[1:])
    total = packed[0].sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_([local(g) for g in grads], coef.to(grads[0].dtype))
    return total
