"""Where a rank sits in the (dp, pp, tp) grid, and the device mesh over it.

Ranks are numbered with tensor parallelism innermost, then pipeline stages, then
data-parallel replicas:

    rank = (dp_rank * pp + pp_rank) * tp + tp_rank

Ray Train (like torchrun) puts consecutive ranks on the same node, so the chattiest
traffic stays inside a node: tensor parallelism's all-reduces (several per block, in the
critical path), then the pipeline's stage-to-stage messages; only the data-parallel
gradient reduction (once per step) crosses nodes, and a lost node takes whole replicas
with it. For pp = tp = 1 this is the plain rank order of ddp/fsdp, and for tp = 1 the
pipeline's replica-major order.
"""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from elastrain.workers.comm_release import group_forming
from elastrain.workers.strategies.base import Layout

MESH_DIMS = ("dp", "pp", "tp")


def grid_layout(rank: int, world_size: int, *, pp: int = 1, tp: int = 1) -> Layout:
    """This rank's place in the grid; `world_size` must be a multiple of `pp * tp`."""
    if pp < 1 or tp < 1:
        raise ValueError(f"pipeline stages and tensor-parallel degree must be >= 1 ({pp}, {tp})")
    group = pp * tp
    if world_size < group or world_size % group != 0:
        parts = " x ".join(
            f"{n} {what}" for n, what in ((pp, "stages"), (tp, "tensor-parallel ranks")) if n > 1
        )
        raise ValueError(
            f"world size {world_size} is not a multiple of {group} ({parts}); the job runs "
            f"whole model replicas of {group} ranks only"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world size {world_size}")
    replica, tp_rank = divmod(rank, tp)
    dp_rank, pp_rank = divmod(replica, pp)
    return Layout(
        dp=world_size // group, pp=pp, tp=tp, dp_rank=dp_rank, pp_rank=pp_rank, tp_rank=tp_rank
    )


def grid_mesh(device_type: str, layout: Layout) -> DeviceMesh:
    """The 3-D mesh (dp, pp, tp) over all ranks; slice it by name (`mesh["tp"]`). Every
    rank must call it, in the same order relative to other group creations."""
    with group_forming():  # a rank blocked on one of its groups is freed by a release
        return init_device_mesh(
            device_type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=MESH_DIMS
        )


def leave_group() -> None:
    """Destroy this process's default group and forget what DTensor cached about its
    meshes, so that the process's next attempt starts from its own.

    A `DeviceMesh` compares and hashes equal to any other with the same ranks' layout,
    device type and dimension names: a new attempt's mesh equals the last one's even when
    this process now holds another rank of it. DTensor's sharding propagation caches
    (Python and C++) are keyed by such meshes and hand back output specs holding the
    mesh they were first computed with, whose coordinate is this process's old rank. In
    a warm process at the same world size under another rank, every FSDP parameter and
    optimizer-state DTensor then claimed the old rank's offsets: checkpoints and peer
    memory wrote shards under another rank's offsets, a chaos run's fsdp job restored a
    wrong state and then failed DCP's plan check on every attempt
    (tests/unit/test_warm_process_mesh.py).
    """
    if dist.is_initialized():
        dist.destroy_process_group()
    _clear_sharding_prop_cache()
