"""A save of a group whose every rank kept its plans: DCP's writes without its exchanges.

DCP's save makes four object collectives: every rank's local plan gathered to the
coordinator, each rank's global plan scattered back, every rank's write results
gathered, and the checkpoint's metadata (every rank's every item) broadcast to all.
Each pickles and unpickles an object per item, in Python holding the GIL: a sync save
of a 598-tensor state, planned and exchanged as DCP does, cost the coordinator 102 ms of
CPU at two ranks and 245 ms at four, against 32 and 25 ms with kept plans and this save
(`bench/checkpoint_bench.py --only plans`). Once every rank's save plans are kept
(`save_plans`), none of it carries news: each rank already holds its final plan, and the
coordinator the metadata and where each rank's items went at the last save.

So when every rank holds the plans of its last save and its state's layout has not
changed (one all-reduce of a flag says so), the save is: each rank writes its shard by
its kept plan, sends the coordinator its file's digest (and where its items went only
where that changed: a pickled item's length may), and the coordinator writes the
metadata; then one small broadcast says whether every rank's write went through. Files
and metadata are the same as DCP's. Otherwise the save is DCP's own, which keeps the
plans for the next one.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import state_dict_saver
from torch.distributed.checkpoint.storage import WriteResult

from elastrain.checkpoints.dcp.save_plans import FinishedSave, KeptPlanSavePlanner
from elastrain.checkpoints.dcp.writer import DigestingWriter

#: Where a rank's items went, when it is what it was at the last save.
_SAME = "same"


def save(
    state: dict[str, Any],
    *,
    writer: DigestingWriter,
    planner: KeptPlanSavePlanner,
    group: dist.ProcessGroup | None,
    alone: bool,
) -> None:
    """Save `state` with `writer`, as `state_dict_saver.save` would, every rank of
    `group` at once (`alone`: a group of one, no collectives at all)."""
    if alone:  # no exchanges to skip
        state_dict_saver.save(state, storage_writer=writer, planner=planner, no_dist=True)
        return
    rank = dist.get_rank(group)
    coordinator = rank == 0
    world = dist.get_world_size(group)
    planner.set_up_planner(state, writer.storage_meta(), is_coordinator=coordinator)
    finished = planner.finished_save()
    ready = finished is not None and (
        not coordinator
        or (
            finished.every_rank is not None
            and len(finished.every_rank) == world
            and planner.kept_metadata is not None
        )
    )
    flag = torch.tensor([int(ready)], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    if not flag.item():
        # Looked up on the module at call time (tests hold the write by patching it).
        state_dict_saver.save(state, storage_writer=writer, planner=planner, process_group=group)
        planner.saved(writer.written, writer.finished)
        return
    assert finished is not None  # every rank is ready, this one too
    _save_by_kept_plans(writer, planner, finished, group, rank, world)


def _save_by_kept_plans(
    writer: DigestingWriter,
    planner: KeptPlanSavePlanner,
    finished: FinishedSave,
    group: dist.ProcessGroup | None,
    rank: int,
    world: int,
) -> None:
    coordinator = rank == 0
    writer.set_up_storage_writer(coordinator, rank=rank, use_collectives=True)
    planner.plan = finished.plan
    report: tuple[str, Any]
    error: BaseException | None = None
    try:
        results = writer.write_data(finished.plan, planner).wait()
        written = writer.written
        digests = results[len(written or ()) :]  # the writer appends them after its items
        report = ("ok", (_SAME if written == finished.written else written, digests))
    except BaseException as e:  # every rank must still reach the collectives below
        error = e
        report = ("failed", f"rank {rank}: {e!r}")
    reports: list[Any] | None = [None] * world if coordinator else None
    dist.gather_object(report, reports, group=group, group_dst=0)
    outcome: list[Any] = [None]
    if reports is not None:
        try:
            outcome[0] = _finish(writer, planner, reports)
        except BaseException as e:  # the others wait in the broadcast: never leave them
            outcome[0] = f"rank 0: {e!r}"
    dist.broadcast_object_list(outcome, group=group, group_src=0)
    if error is not None:
        planner.forget()
        raise error
    if outcome[0] is not None:
        planner.forget()
        raise RuntimeError(f"checkpoint save failed: {outcome[0]}")
    planner.saved(writer.written, writer.finished)


def _finish(
    writer: DigestingWriter, planner: KeptPlanSavePlanner, reports: list[Any]
) -> str | None:
    """The coordinator: the metadata written from every rank's report; None, or what
    failed."""
    failed = [detail for kind, detail in reports if kind != "ok"]
    if failed:
        return "; ".join(failed)
    finished, metadata = planner.finished_save(), planner.kept_metadata
    assert finished is not None and finished.every_rank is not None and metadata is not None
    results: list[list[WriteResult]] = []
    for before, (_, (written, digests)) in zip(finished.every_rank, reports, strict=True):
        results.append([*(before if written == _SAME else written), *digests])
    writer.finish(metadata=metadata, results=results)
    return None
