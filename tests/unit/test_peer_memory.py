"""Every strategy restores from peer memory: a group of 4 ranks on 2 "nodes" loses ranks
mid-run, and the survivors, in a new group of 2 (the same processes, as the runtime
reuses them), re-shard the state from their own and their buddies' copies in memory.

Real processes and gloo groups. The lost ranks let go at a step boundary and leave the
group (their processes close their connections, as a dead node's do), so the survivors
fail their next collective, exactly as after a node loss. Per strategy (ddp, fsdp, tp,
pipeline, fsdp x tp): losing one node (ranks 2, 3) resumes from peers with no step
recomputed and the loss curve of an uninterrupted run; losing ranks 1 and 3 (each the
other's buddy) falls back to the checkpoint, curve still equal.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from elastrain.contracts.messages import Phase, RestoreSource, TimelineMark
from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.rendezvous import host_store
from tests.unit.dist_utils import run_distributed
from tests.unit.hooks import RecordingHooks

STEPS = 7
LOST_AT = 5  # the lost ranks let go before step 6: five steps done
EVERY = 3  # checkpoints at 3 and 6: the newest before the loss is step 3
RTOL = 2e-5
GPT = {"n_layer": 2, "n_embd": 32, "n_head": 4, "seq_len": 16}
STRATEGIES = {
    "ddp": {"kind": "ddp"},
    "fsdp": {"kind": "fsdp"},
    "tp": {"kind": "tp", "tensor_parallel": 2},
    "pipeline": {"kind": "pipeline", "pipeline_stages": 2, "microbatches": 2},
    "fsdp_tp": {"kind": "fsdp", "tensor_parallel": 2},
}
NODES = ["a", "a", "b", "b"]
_STORE_TIMEOUT = timedelta(seconds=60)


def spec_for(strategy: dict[str, Any]) -> JobSpec:
    return JobSpec(
        name="t",
        workload={"name": "gpt", "params": GPT},
        strategy=strategy,
        scaling={"min_workers": 1, "max_workers": 8},
        training={
            "global_batch_size": 8, "micro_batch_size": 2, "max_steps": STEPS,
            "learning_rate": 1e-2, "lr_schedule": "cosine", "warmup_steps": 2, "seed": 3,
            "grad_clip": 0.5,
        },
        checkpoint={"every_steps": EVERY, "async_save": False, "memory_every": 1},
    )  # fmt: skip


class LetGoAt:
    """`TrainContext.abort` that is set once the rank has done `step` steps."""

    def __init__(self, ctx: TrainContext, step: int) -> None:
        self.ctx, self.step = ctx, step

    def is_set(self) -> bool:
        return self.ctx.step >= self.step


def _regroup(rank: int, world_size: int, port: int, hosted: dist.TCPStore | None) -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    store = hosted or dist.TCPStore(
        "127.0.0.1", port, world_size, is_master=False, timeout=_STORE_TIMEOUT
    )
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )


def lose_ranks(rank: int, world_size: int, root: str, label: str, lost: list[int]) -> Any:
    """The uninterrupted run, then the same job losing `lost` after LOST_AT steps: their
    processes end (as a dead node's: connections reset), the survivors go on as a new
    group of the same processes."""
    from elastrain.workers.loop import train
    from elastrain.workers.memory.replica import ReplicaMemory

    def ctx(job: int, attempt: int, r: int, ws: int) -> TrainContext:
        return TrainContext(rank=r, world_size=ws, local_rank=r, device=torch.device("cpu"),
                            job_id=job, attempt=attempt, node=NODES[rank],
                            checkpoint_root=Path(root) / f"job{job}")  # fmt: skip

    spec = spec_for(STRATEGIES[label.split("/")[0]])
    steady = RecordingHooks()
    train(ctx(2, 1, rank, world_size), spec, steady)  # the reference: uninterrupted

    survivors = [r for r in range(world_size) if r not in lost]
    # The next group's store listens from now on (rank 0 survives).
    store = host_store("127.0.0.1", len(survivors), _STORE_TIMEOUT) if rank == 0 else None
    port: list[Any] = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)

    memory = ReplicaMemory()
    first = RecordingHooks()
    c = ctx(1, 1, rank, world_size)
    if rank in lost:
        c.abort = LetGoAt(c, LOST_AT)  # type: ignore[assignment]
    error = None
    try:
        train(c, spec, first, memory)
    except Exception as exc:  # the survivors' collective with the departed fails
        error = type(exc).__name__
    if rank in lost:
        os._exit(0)  # the node is gone: its connections reset
    new_rank = survivors.index(rank)
    _regroup(new_rank, len(survivors), int(port[0]), store)
    after = RecordingHooks()
    train(ctx(1, 2, new_rank, len(survivors)), spec, after, memory)
    return {"steady": steady, "first": first, "after": after, "error": error}


def stop_and_regroup(rank: int, world_size: int, root: str) -> Any:
    """A resize STOP of an FSDP job on ONE node (no buddy possible): the same processes
    form the next group, with the checkpoint folder gone, so only memory can resume it."""
    import shutil

    from elastrain.workers.api import Control
    from elastrain.workers.loop import train
    from elastrain.workers.memory.replica import ReplicaMemory

    spec = spec_for(STRATEGIES["fsdp"]).model_copy(update={"checkpoint": spec_for(
        STRATEGIES["fsdp"]).checkpoint.model_copy(update={"memory_every": None})})  # fmt: skip
    store = host_store("127.0.0.1", world_size, _STORE_TIMEOUT) if rank == 0 else None
    port: list[Any] = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    memory = ReplicaMemory()
    first = RecordingHooks(controls=[Control.NONE, Control.NONE, Control.STOP])
    c = TrainContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                     job_id=1, attempt=1, node="one", checkpoint_root=Path(root) / "job1")  # fmt: skip
    train(c, spec, first, memory)  # stops after step 3, refreshing memory at it
    dist.barrier()
    if rank == 0:
        shutil.rmtree(Path(root) / "job1")
    _regroup(rank, world_size, int(port[0]), store)
    after = RecordingHooks()
    c2 = TrainContext(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"),
                      job_id=1, attempt=2, node="one", checkpoint_root=Path(root) / "job1")  # fmt: skip
    train(c2, spec, after, memory)
    return {"first": first, "after": after}


def test_a_resize_on_one_node_hands_the_shards_on_in_memory(tmp_path: Path) -> None:
    run = run_distributed(stop_and_regroup, 2, str(tmp_path), timeout_s=600)[0]
    resumed = run["after"].resumed
    assert resumed is not None
    assert (resumed.source, resumed.step, resumed.steps_recomputed) == (RestoreSource.PEER, 3, 0)
    assert [m.step for m in run["after"].metrics] == list(range(4, STEPS + 1))


CASES = [(label, [2, 3]) for label in STRATEGIES] + [
    (f"{label}/buddies", [1, 3]) for label in ("fsdp", "pipeline")
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = {}
    for label, lost in CASES:
        root = tmp_path_factory.mktemp("peers")
        results = run_distributed(
            lose_ranks, 4, str(root), label, lost, timeout_s=600, pg_timeout_s=60, may_exit=True
        )
        out[label] = results[0]
    return out


def _restored(hooks: RecordingHooks) -> TimelineMark:
    (mark,) = [
        m for m in hooks.messages if isinstance(m, TimelineMark) and m.phase == Phase.STATE_RESTORED
    ]
    return mark


def _curve_is_uninterrupted(run: dict[str, Any], resumed_at: int) -> None:
    steady = {m.step: m.to_values() for m in run["steady"].metrics}
    first = {m.step: m.to_values() for m in run["first"].metrics}
    after = {m.step: m.to_values() for m in run["after"].metrics}
    assert sorted(first) == list(range(1, LOST_AT + 1))
    assert sorted(after) == list(range(resumed_at + 1, STEPS + 1))
    for step, values in {**first, **after}.items():
        assert values["batch_crc"] == steady[step]["batch_crc"]
        assert values["loss"] == pytest.approx(steady[step]["loss"], rel=RTOL), step
    assert {v["world_size"] for v in after.values()} == {2}


@pytest.mark.parametrize("label", list(STRATEGIES))
def test_a_lost_node_resumes_from_peers_with_no_step_recomputed(
    runs: dict[str, Any], label: str
) -> None:
    run = runs[label]
    assert run["error"] is not None  # rank 0 saw its peers go mid-run
    resumed = run["after"].resumed
    assert resumed is not None
    assert (resumed.source, resumed.step, resumed.path) == (RestoreSource.PEER, LOST_AT, "")
    assert (resumed.saved_world_size, resumed.world_size) == (4, 2)
    assert resumed.steps_recomputed == 0
    mark = _restored(run["after"])
    assert (mark.source, mark.steps_recomputed) == (RestoreSource.PEER, 0)
    _curve_is_uninterrupted(run, LOST_AT)


@pytest.mark.parametrize("label", ["fsdp/buddies", "pipeline/buddies"])
def test_a_rank_lost_with_its_buddy_falls_back_to_the_checkpoint(
    runs: dict[str, Any], label: str
) -> None:
    run = runs[label]
    resumed = run["after"].resumed
    assert resumed is not None
    assert (resumed.source, resumed.step) == (RestoreSource.CHECKPOINT, EVERY)
    assert resumed.steps_recomputed == LOST_AT - EVERY
    mark = _restored(run["after"])
    assert (mark.source, mark.steps_recomputed) == (RestoreSource.CHECKPOINT, LOST_AT - EVERY)
    _curve_is_uninterrupted(run, EVERY)
