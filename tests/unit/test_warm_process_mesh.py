"""A warm process's next attempt under another rank: its FSDP state must sit at its new
rank's offsets (`elastrain.workers.strategies.mesh.leave_group`).

Two gloo processes train an FSDP2 model (uneven shards) as ranks 0 and 1, leave the
group the way a worker process does after an attempt, then form a new group with their
ranks swapped, as the runtime may hand a warm process another rank of the next attempt.
Without the cache clearing in `leave_group`, every parameter and optimizer-state DTensor
of the second attempt kept the mesh of the first (a `DeviceMesh` equals any other of the
same layout, and DTensor's sharding caches hand back the first), so each rank claimed the
other's offsets and a checkpoint saved its shards swapped.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tests.unit.dist_utils import run_distributed


def _attempt(folder: str) -> dict[str, Any]:
    """Build, train two steps, save a checkpoint into `folder`; what rank 0 can check."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 7), nn.Linear(7, 5))  # 7 and 5 rows: uneven shards
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        torch.manual_seed(1 + step)
        model(torch.randn(4, 8)).sum().backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    tensors = [*model.parameters()]
    tensors += [v for state in optimizer.state.values() for v in state.values() if v.dim() > 0]
    me = (dist.get_rank(),)
    stale = sum(isinstance(t, DTensor) and t.device_mesh.get_coordinate() != me for t in tensors)
    model_state, _ = get_state_dict(model, optimizer)
    dcp.save({"model": model_state}, checkpoint_id=folder)
    full = {k: v.full_tensor() for k, v in model_state.items() if isinstance(v, DTensor)}
    return {"stale": stale, "full": full}


def two_attempts(rank: int, world_size: int, root: str) -> dict[str, Any]:
    from elastrain.workers.strategies.mesh import leave_group

    first = _attempt(f"{root}/first")
    leave_group()
    store = dist.FileStore(f"{root}/store", world_size)
    dist.init_process_group("gloo", store=store, rank=world_size - 1 - rank, world_size=world_size)
    second = _attempt(f"{root}/second")
    return {"first": first, "second": second, "rank_then": dist.get_rank()}


def saved(folder: Path) -> dict[str, torch.Tensor]:
    """A DCP checkpoint's model tensors, whole, read in this (non-distributed) process."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = folder.parent / f"{folder.name}.pt"
    dcp_to_torch_save(folder, out)
    loaded: dict[str, Any] = torch.load(out, weights_only=True)
    return dict(loaded["model"])


def test_a_warm_process_under_another_rank_saves_its_own_shards(tmp_path: Path) -> None:
    ranks = run_distributed(two_attempts, 2, str(tmp_path), timeout_s=180)
    assert sorted(r["rank_then"] for r in ranks) == [0, 1]
    for r in ranks:
        assert r["first"]["stale"] == 0
        assert r["second"]["stale"] == 0, "DTensors kept the first attempt's mesh"
    for attempt in ("first", "second"):
        on_disk = saved(tmp_path / attempt)
        live = ranks[0][attempt]["full"]
        assert set(on_disk) == set(live)
        for key, tensor in live.items():
            assert torch.equal(on_disk[key], tensor), f"{attempt}: {key} saved with shards swapped"
