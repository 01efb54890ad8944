"""A group that lost a rank resumes from the survivors' memory: no checkpoint read, no step
lost, the same curve. Real processes and gloo groups: three ranks train, the group breaks
up, two of the same processes form a new group and go on (as the runtime does after a
node loss), with the checkpoint folder deleted so that memory is the only source."""

from __future__ import annotations

import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastrain.contracts.messages import Phase, RestoreSource, TimelineMark
from elastrain.workers.api import Control, TrainContext
from elastrain.workers.rendezvous import host_store
from tests.unit.dist_utils import run_distributed
from tests.unit.hooks import RecordingHooks
from tests.unit.test_workers_train import STEPS, make_spec

_STORE_TIMEOUT = timedelta(seconds=60)


def _host_stores(rank: int, sizes: list[int]) -> tuple[list[dist.TCPStore | None], list[int]]:
    """The stores of the groups to come, hosted by rank 0 and listening from now on
    (`elastrain.workers.rendezvous`); their ports sent to every rank over the current group."""
    stores = [host_store("127.0.0.1", n, _STORE_TIMEOUT) if rank == 0 else None for n in sizes]
    ports: list[Any] = [s.port if s is not None else None for s in stores]
    dist.broadcast_object_list(ports, src=0)
    return stores, [int(p) for p in ports]


def _regroup(rank: int, world_size: int, port: int, hosted: dist.TCPStore | None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    store = hosted
    if store is None:
        store = dist.TCPStore(
            "127.0.0.1", port, world_size, is_master=False, timeout=_STORE_TIMEOUT
        )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)


def survive(rank: int, world_size: int, root: str) -> Any:
    from elastrain.workers.loop import train
    from elastrain.workers.memory.replica import ReplicaMemory

    spec = make_spec("ddp", every=100)

    def ctx(job_id: int, attempt: int, ws: int) -> TrainContext:
        return TrainContext(rank=rank, world_size=ws, local_rank=rank, device=torch.device("cpu"),
                            job_id=job_id, attempt=attempt,
                            checkpoint_root=Path(root) / f"job{job_id}")  # fmt: skip

    steady = RecordingHooks()
    train(ctx(2, 1, world_size), spec, steady)  # the reference: never interrupted

    memory = ReplicaMemory()
    first = RecordingHooks(controls=[Control.NONE, Control.NONE, Control.STOP])
    train(ctx(1, 1, world_size), spec, first, memory)  # stops after step 3
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(root) / "job1")  # no checkpoint left: only memory can resume it
    held = memory.describe()
    stores, ports = _host_stores(rank, [2, world_size])
    after = None
    if rank < 2:  # rank 2's node is "lost"; 0 and 1 go on in a new group, same processes
        _regroup(rank, 2, ports[0], stores[0])
        after = RecordingHooks()
        train(ctx(1, 2, 2), spec, after, memory)
    # dist_utils ends with a barrier of all three
    _regroup(rank, world_size, ports[1], stores[1])
    return {"held": held, "steady": steady, "first": first, "after": after}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("memory")
    results = run_distributed(survive, 3, str(root), timeout_s=600)
    return {"rank0": results[0], "rank1": results[1], "root": root}


def test_survivors_hold_the_step_they_stopped_at(run: dict[str, Any]) -> None:
    for rank in ("rank0", "rank1"):
        held = run[rank]["held"]
        assert (held.job_id, held.step, held.world_size, held.full_replica) == (1, 3, 3, True)


def test_the_new_group_resumes_from_memory_without_a_checkpoint(run: dict[str, Any]) -> None:
    after = run["rank0"]["after"]
    resumed = after.resumed
    assert resumed is not None
    assert (resumed.source, resumed.step, resumed.path) == (RestoreSource.PEER, 3, "")
    assert (resumed.saved_world_size, resumed.world_size) == (3, 2)
    # Rank 0's metric points travel with the state, like those saved with a checkpoint.
    assert [m.step for m in resumed.metrics] == [1, 2, 3]
    assert not any(e.event.value == "checkpoint_fallback" for e in after.events)
    # The timeline says where the state came from as a type, not in its text.
    assert _restored_from(after) == RestoreSource.PEER
    assert _restored_from(run["rank0"]["first"]) is None  # a fresh start


def _restored_from(hooks: RecordingHooks) -> RestoreSource | None:
    (mark,) = [
        m for m in hooks.messages if isinstance(m, TimelineMark) and m.phase == Phase.STATE_RESTORED
    ]
    return mark.source


def test_no_step_is_lost_and_the_curve_is_the_same(run: dict[str, Any]) -> None:
    steady = {m.step: m.to_values() for m in run["rank0"]["steady"].metrics}
    first = {m.step: m.to_values() for m in run["rank0"]["first"].metrics}
    after = {m.step: m.to_values() for m in run["rank0"]["after"].metrics}
    assert sorted(first) == [1, 2, 3] and sorted(after) == list(range(4, STEPS + 1))
    for step, values in {**first, **after}.items():
        assert values["batch_crc"] == steady[step]["batch_crc"]
        assert values["loss"] == pytest.approx(steady[step]["loss"], rel=2e-4)
    assert {v["world_size"] for v in after.values()} == {2}
