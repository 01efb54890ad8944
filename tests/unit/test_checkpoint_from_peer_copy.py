"""A checkpoint of a step peer memory refreshed at is written from the refresh's copy
(`elastrain.checkpoints.dcp.held_copy`): no staging copy of its own, the same file.

- the arena the copy lives in is page-aligned with its large items on block boundaries,
  and each item a view with a storage of its own bytes (what a record holds);
- a save from a copy writes the copy's values however the live state changes after
  save() returns, stages nothing, sends the large items to the disk without a copy, and
  releases the copy when written (also when the save fails, naming a missing item);
- a DDP rank's async save copies the items it writes alone (`own_items`): each item
  staged by exactly one rank, the bytes balanced;
- a refresh never writes into buffers a save still reads, and reuses them afterwards;
- the last save of an attempt is written in the caller, staging nothing;
- the training loop (2 ranks on 2 "nodes", async saves) writes its checkpoints from peer
  memory (FSDP) or from its rank's share (DDP), the last one from the live state, byte
  for byte the files of sync saves of the live state.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver

from elastrain.checkpoints.dcp import ShardedCheckpointer
from elastrain.checkpoints.dcp.checkpointer import CheckpointSaveError
from elastrain.checkpoints.dcp.held_copy import HeldCopy
from elastrain.checkpoints.dcp.in_memory import MemoryWriter, arena_buffer, arena_of
from elastrain.checkpoints.dcp.shard_file import ALIGN_RECORD_MIN_BYTES, BLOCK
from tests.unit.dist_utils import run_distributed

# -- the arena -------------------------------------------------------------------------


def state(value: float = 1.0) -> dict[str, Any]:
    return {
        "big": torch.full((3 * ALIGN_RECORD_MIN_BYTES // 4 + 5,), value),  # float32
        "small": torch.full((7,), value, dtype=torch.float64),
        "big2": torch.full((ALIGN_RECORD_MIN_BYTES // 2,), value, dtype=torch.bfloat16),
        "lr": 0.5 * value,
    }


def copy_of(live: dict[str, Any], step: int) -> HeldCopy:
    """What a refresh keeps: this rank's items, copied, in a page-aligned arena."""
    writer = MemoryWriter(copy=False)
    metadata = state_dict_saver.save(live, storage_writer=writer, no_dist=True)
    arena = arena_of(metadata, 0)
    views = arena.views(arena_buffer(arena.nbytes))
    items = {
        index: views[index].copy_(data) if index in views else data.clone()
        for index, data in writer.blob.items()
    }
    return HeldCopy(items=items, step=step)


def test_the_arena_is_page_aligned_and_each_item_a_storage_of_its_own() -> None:
    writer = MemoryWriter(copy=False)
    arena = arena_of(state_dict_saver.save(state(), storage_writer=writer, no_dist=True), 0)
    buffer = arena_buffer(arena.nbytes)
    assert buffer.data_ptr() % BLOCK == 0 and buffer.numel() == arena.nbytes
    views = arena.views(buffer)
    for index, offset, dtype, shape in arena.tensors:
        view = views[index]
        assert (view.dtype, view.shape) == (dtype, shape)
        assert view.data_ptr() == buffer.data_ptr() + offset  # an alias, not a copy
        # torch.save writes a tensor's whole storage: the item's bytes alone.
        assert view.untyped_storage().nbytes() == view.numel() * view.element_size()
        if view.nbytes >= ALIGN_RECORD_MIN_BYTES:
            assert view.data_ptr() % BLOCK == 0, index.fqn
    big = next(v for i, v in views.items() if i.fqn == "big")
    big.fill_(2.0)
    assert buffer.count_nonzero() == big.numel()  # 2.0 is one nonzero byte of four
    assert arena_buffer(0).numel() == 0


# -- a save from a copy ----------------------------------------------------------------


def load(root: Path) -> dict[str, Any]:
    target = state(0.0)
    reader = ShardedCheckpointer(root, rank=0, world_size=1, async_save=False)
    outcome = reader.load_latest(target)
    assert outcome is not None
    return target


@pytest.mark.parametrize("async_save", [True, False])
def test_a_save_writes_the_copy_whatever_the_live_state_does(
    tmp_path: Path, async_save: bool, gathered: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    live = state(1.0)
    copy = copy_of(live, step=4)
    hold = threading.Event()
    original = state_dict_saver.save

    def held_save(*args: Any, **kwargs: Any) -> Any:
        assert hold.wait(30)
        return original(*args, **kwargs)

    monkeypatch.setattr(state_dict_saver, "save", held_save)
    ckpt = ShardedCheckpointer(
        tmp_path, rank=0, world_size=1, async_save=async_save, async_staging=async_save
    )
    if async_save:
        ckpt.save(step=4, attempt=0, state=live, manifest_fields={}, copy=copy)
        assert copy.in_use  # the write has not run yet
        # Training goes on: the next update changes every live tensor in place.
        for key in ("big", "small", "big2"):
            live[key].add_(1.0)
        live["lr"] = 9.0
        hold.set()
    else:
        for key in ("big", "small", "big2"):
            live[key].add_(1.0)  # the copy is what is written, not the live state
        hold.set()
        ckpt.save(step=4, attempt=0, state=live, manifest_fields={}, copy=copy)
    commits = ckpt.close()
    assert [c.step for c in commits] == [4]
    assert not copy.in_use
    assert ckpt._stager is None  # no staging copy was made
    saved = load(tmp_path)
    for key in ("big", "small", "big2"):
        assert torch.equal(saved[key], state(1.0)[key]), key
    assert saved["lr"] == 0.5
    # The large items went to the disk from the copy's arena, not through a bounce buffer.
    small = live["small"].nbytes
    assert sum(gathered) < small + 3 * BLOCK * 3, gathered


def test_a_copy_missing_an_item_fails_the_save_by_name_and_is_released(tmp_path: Path) -> None:
    live = state()
    copy = copy_of(live, step=2)
    del copy.items[next(i for i in copy.items if i.fqn == "big2")]
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    ckpt.save(step=2, attempt=0, state=live, manifest_fields={}, copy=copy)
    with pytest.raises(CheckpointSaveError, match="big2"):
        ckpt.close()
    assert not copy.in_use
    assert not list(tmp_path.glob("step_*/manifest.json"))  # nothing committed


def test_a_copy_of_another_step_is_refused_and_released(tmp_path: Path) -> None:
    live = state()
    copy = copy_of(live, step=2)
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True)
    with pytest.raises(ValueError, match="step 2 given to the save of step 3"):
        ckpt.save(step=3, attempt=0, state=live, manifest_fields={}, copy=copy)
    assert not copy.in_use
    ckpt.close()


def test_the_last_save_is_written_in_the_caller_with_no_staging(tmp_path: Path) -> None:
    ckpt = ShardedCheckpointer(tmp_path, rank=0, world_size=1, async_save=True,
                               async_staging=True)  # fmt: skip
    ckpt.save(step=2, attempt=0, state=state(1.0), manifest_fields={})
    assert ckpt._stager is not None  # an ordinary async save stages
    ckpt.save(step=3, attempt=0, state=state(2.0), manifest_fields={}, sync=True)
    # Committed when save() returns (the step-2 save first), nothing left in flight.
    assert [c.step for c in ckpt.poll_commits()] == [2, 3]
    assert ckpt._inflight is None and ckpt._staging is None
    assert torch.equal(load(tmp_path)["big"], state(2.0)["big"])
    ckpt.close()


# -- a replicated state (DDP) ----------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_each_rank_of_a_replicated_state_stages_its_share_alone(world_size: int) -> None:
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from elastrain.checkpoints.dcp.own_items import OwnItemsStager, own_items

    live = {f"layer{i}": torch.randn(1000 * (i + 1)) for i in range(8)} | {"lr": 0.1}
    planner = DefaultSavePlanner()
    planner.set_up_planner(live, storage_meta=None, is_coordinator=True)
    shares = [own_items(planner, r, world_size) for r in range(world_size)]
    names = [[item.index.fqn for item in share] for share in shares]
    every = sorted(n for share in names for n in share)
    assert every == sorted([*(f"layer{i}" for i in range(8)), "lr"])  # each item once
    total = sum(t.nbytes for k, t in live.items() if k != "lr")
    staged = []
    for rank in range(world_size):
        stager = OwnItemsStager(rank, world_size, pin=False)
        copy = stager.stage(live, step=3).result()
        assert {i.fqn for i in copy.items} == set(names[rank])
        for index, data in copy.items.items():
            if index.fqn != "lr":
                assert torch.equal(data, live[index.fqn])
        staged.append(sum(t.nbytes for i, t in copy.items.items() if i.fqn != "lr"))
        stager.close()
    # DCP's deduplication balances the bytes: no rank stages much more than its share.
    assert max(staged) <= total / world_size + live["layer7"].nbytes


# -- peer memory's buffers -------------------------------------------------------------


class Shard:
    """A strategy as a refresh sees it."""

    full_replica = False

    def __init__(self, step: int) -> None:
        self.step = step

    def state_dict_for_checkpoint(self) -> dict[str, Any]:
        return {"w": torch.full((ALIGN_RECORD_MIN_BYTES,), self.step, dtype=torch.uint8)}


@pytest.fixture
def group_of_one() -> Any:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield
    dist.destroy_process_group()


def test_a_refresh_never_writes_into_a_copy_being_saved(group_of_one: None) -> None:
    from elastrain.workers.api import TrainContext
    from elastrain.workers.memory.snapshots import PeerRefresher, Snapshot
    from tests.unit.test_peer_memory import spec_for

    ctx = TrainContext(rank=0, world_size=1, local_rank=0, job_id=1, attempt=1,
                       device=torch.device("cpu"), checkpoint_root=Path("/nonexistent"))  # fmt: skip
    peers = PeerRefresher.join(ctx, spec_for({"kind": "fsdp"}))
    copies: list[Snapshot] = []

    def own(snapshot: Snapshot) -> torch.Tensor:
        return snapshot.arenas[0]

    buffers: set[int] = set()
    lent: list[tuple[HeldCopy, int]] = []
    for step in range(1, 9):
        snapshot = peers.refresh(copies, Shard(step), step)
        buffers.add(own(snapshot).data_ptr())
        assert all(c.items[next(iter(c.items))][0] == s for c, s in lent if c.in_use)
        if step in (2, 5):
            lent.append((snapshot.lend(0), step))  # a save of step 2 (5) begins
        if step in (4, 7):
            lent[-1][0].release()  # ... and ends two refreshes later
    # Two generations, and a third buffer only while a save read one of them.
    assert len(buffers) == 3
    assert all(not c.in_use for c, _ in lent)


# -- the training loop -----------------------------------------------------------------


def loop_saves(rank: int, world_size: int, root: str, label: str) -> dict[str, Any]:
    """The same job twice in the same processes: without peer memory, sync saves of the
    live state; then with async saves, written in place once a write is timed, and on two
    "nodes" with peer memory every step (one node, "/one-node": no peer memory; "/slow":
    every save in place on a disk so slow that each update takes tensors back)."""
    from elastrain.checkpoints.dcp import save_plans, writer
    from elastrain.workers import loop
    from elastrain.workers.api import NullHooks, TrainContext
    from tests.unit.test_peer_memory import STRATEGIES, spec_for

    strategy, _, where = label.partition("/")
    slow = where.endswith("slow")
    staged: list[int] = []
    from_copy: list[int] = []
    in_place: list[int] = []
    saves: list[int] = []
    taken_back: list[int] = []

    def after_the_first_save(*, async_save: bool, on_host: bool, **timing: Any) -> bool:
        # Whatever a write takes on this machine (`writes_in_place` has its own tests),
        # and whether or not the first one is over by the next save.
        return async_save and on_host and (slow or bool(saves))

    loop.writes_in_place = after_the_first_save  # type: ignore[assignment]
    stage, write_from = ShardedCheckpointer._stage, save_plans.KeptPlanSavePlanner.write_from
    save, wait_staged = ShardedCheckpointer.save, ShardedCheckpointer.wait_staged
    record_parts = writer.record_parts

    def slow_record_parts(*args: Any, **kwargs: Any) -> Any:
        time.sleep(0.02)  # each tensor: the update comes long before the last
        return record_parts(*args, **kwargs)

    def noting_wait_staged(self: ShardedCheckpointer) -> float:
        waited = wait_staged(self)
        if self.last_taken_back_bytes:
            taken_back.append(self.last_taken_back_bytes)
        return waited

    def recording_save(self: ShardedCheckpointer, **kwargs: Any) -> float:
        saves.append(kwargs["step"])
        if kwargs["in_place"] and kwargs["copy"] is None and not kwargs["sync"]:
            in_place.append(kwargs["step"])
        return save(self, **kwargs)

    def counting_stage(self: ShardedCheckpointer, state: Any) -> Any:
        staged.append(1)
        return stage(self, state)

    def counting_write_from(self: Any, copy: HeldCopy | None) -> None:
        if copy is not None:
            from_copy.append(copy.step)
        write_from(self, copy)

    ShardedCheckpointer._stage = counting_stage  # type: ignore[method-assign]
    ShardedCheckpointer.save = recording_save  # type: ignore[method-assign]
    ShardedCheckpointer.wait_staged = noting_wait_staged  # type: ignore[method-assign]
    save_plans.KeptPlanSavePlanner.write_from = counting_write_from  # type: ignore[method-assign]
    base = spec_for(STRATEGIES[strategy])
    out: dict[str, Any] = {}
    for run, memory_every, async_save, nodes in (
        ("live", 0, False, "aa"),
        ("copy", 1, True, "aa" if where.startswith("one-node") else "ab"),
    ):
        writer.record_parts = slow_record_parts if slow and run == "copy" else record_parts
        spec = base.model_copy(update={"checkpoint": base.checkpoint.model_copy(update={
            "memory_every": memory_every, "async_save": async_save, "every_steps": 2})})  # fmt: skip
        ctx = TrainContext(rank=rank, world_size=world_size, local_rank=rank,
                           device=torch.device("cpu"), job_id=1, attempt=1, node=nodes[rank],
                           checkpoint_root=Path(root) / run)  # fmt: skip
        staged.clear()
        from_copy.clear()
        in_place.clear()
        saves.clear()
        taken_back.clear()
        hooks = NullHooks()
        loop.train(ctx, spec, hooks)
        out[run] = {
            "losses": [m.loss for m in hooks.metrics],
            "staged": len(staged),
            "from_copy": list(from_copy),
            "in_place": list(in_place),
            "taken_back": list(taken_back),
        }
    return out


#: Saves at steps 2, 4, 6 and 7 (the last): (written from a copy, staged by DCP's stager,
#: written in place).
EXPECTED = {
    # Each save of a step peer memory refreshed at is written from its copy.
    "fsdp": ([2, 4, 6], 0, []),
    # No peer memory (every rank holds the whole state): the first save copies the items
    # its rank writes alone; once a write is timed, the next are written in place.
    "ddp": ([2], 0, [4, 6]),
    # No buddy on one node, no peer memory: the first save staged, then in place.
    "fsdp/one-node": ([], 1, [4, 6]),
    # Every save in place, each update taking back the tensors not yet written.
    "fsdp/one-node/slow": ([], 0, [2, 4, 6]),
}


@pytest.mark.parametrize("label", list(EXPECTED))
def test_the_loop_writes_checkpoints_from_copies_byte_for_byte(tmp_path: Path, label: str) -> None:
    """Every async save of the loop, from a copy, staged or in place, and the last step's
    (7, written at once from the live state, staging nothing), writes the files of a sync
    save of the live state at that step."""
    out = run_distributed(loop_saves, 2, str(tmp_path), label, timeout_s=300)
    for rank in (0, 1):
        live, copy = out[rank]["live"], out[rank]["copy"]
        assert live["losses"] == copy["losses"]
        assert live["from_copy"] == live["in_place"] == []
        assert (copy["from_copy"], copy["staged"], copy["in_place"]) == EXPECTED[label], copy
        # Only a slow write leaves tensors for the update to copy (a fast one may too).
        assert live["taken_back"] == [] and (copy["taken_back"] or not label.endswith("slow"))
    for step in (2, 4, 6, 7):
        folders = {run: tmp_path / run / f"step_{step:09d}-a1" for run in ("live", "copy")}
        for rank in (0, 1):
            name = f"__{rank}_0.distcp"
            assert (folders["live"] / name).read_bytes() == (folders["copy"] / name).read_bytes(), (
                step,
                name,
            )
