"""Where an attempt's state comes from: a surviving rank's memory when one holds a full
replica at least as new as the newest checkpoint (no step lost), else the latest good
checkpoint (whatever world size or split wrote it, resharded), else a fresh start.

Every rank calls `restore` (both ways load collectively); rank 0 reports what happened.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

import torch.distributed as dist

from contracts.messages import (
    EventKind,
    RestoreSource,
    Resumed,
    SavedTraining,
    StepMetrics,
    WorkerEvent,
)
from workers.api import TrainContext
from workers.memory import NOTHING, ReplicaMemory, share_from_peer
from workers.reports import Reports
from workers.rng import reseed, set_rng_states
from workers.strategies import Strategy

if TYPE_CHECKING:
    from checkpoints.dcp import ShardedCheckpointer

log = logging.getLogger("elastrain.workers.resume")


def restore(
    checkpointer: ShardedCheckpointer,
    strategy: Strategy,
    ctx: TrainContext,
    reports: Reports,
    seed: int,
    memory: ReplicaMemory,
) -> Resumed | None:
    """What was restored into `strategy` (None: a fresh start). From a peer's memory when
    some rank holds a full replica of the job at least as new as the newest checkpoint,
    else `resume`."""
    newest = newest_checkpoint_step(ctx.checkpoint_root) if ctx.rank == 0 else None
    # Every rank's (step of the replica it holds, rank 0's newest checkpoint step).
    offers: list[tuple[int, int | None]] = [(NOTHING, None)] * ctx.world_size
    dist.all_gather_object(offers, (memory.step_for(ctx.job_id), newest))
    held = [step for step, _ in offers]
    newest = offers[0][1]
    best = max(held)
    if best == NOTHING or best == 0 or (newest is not None and newest > best):
        memory.forget()  # superseded (or nothing): do not keep two models alive
        return resume(checkpointer, strategy, ctx, reports, seed)
    donor = held.index(best)
    meta = share_from_peer(memory, strategy, donor)
    reseed(seed, best, ctx.rank)  # a new group: per-rank streams restart from (seed, step)
    restored = Resumed(
        step=best,
        path="",
        saved_world_size=int(meta["world_size"]),
        world_size=ctx.world_size,
        saved_attempt=int(meta["attempt"]),
        metrics=tuple(StepMetrics.from_point(p) for p in meta["metrics"]),
        source=RestoreSource.PEER,
    )
    if ctx.rank == 0:
        log.info("resumed at step %d from the memory of rank %d", best, donor)
    reports.send(restored)
    return restored


def resume(
    checkpointer: ShardedCheckpointer,
    strategy: Strategy,
    ctx: TrainContext,
    reports: Reports,
    seed: int,
) -> Resumed | None:
    """Load the latest good checkpoint into the strategy; what was restored, or None for a
    fresh start. Every rank must call it (DCP loads collectively)."""
    state = strategy.state_dict_for_checkpoint()
    outcome = checkpointer.load_latest(state)
    for path, reason in outcome.skipped if outcome is not None else ():
        if ctx.rank == 0:
            log.warning("skipped checkpoint %s: %s", path, reason)
        reports.send(
            WorkerEvent(
                event=EventKind.CHECKPOINT_FALLBACK, reason=reason, details={"path": str(path)}
            )
        )
    if outcome is None:
        reseed(seed, 0, ctx.rank)
        return None
    strategy.load_checkpoint_state(state)
    step: int = outcome.info.step
    extra = outcome.rank_extra
    if extra is not None and extra.get("world_size") == ctx.world_size:
        set_rng_states(extra)  # same world size: continue this rank's exact RNG streams
    else:
        reseed(seed, step, ctx.rank)  # resharded: per-rank streams have no successor
    restored = Resumed(
        step=step,
        path=str(outcome.info.path),
        saved_world_size=outcome.info.world_size,
        world_size=ctx.world_size,
        saved_attempt=outcome.info.attempt,
        metrics=SavedTraining.from_extra(outcome.info.manifest.extra).metrics,
    )
    if ctx.rank == 0:
        log.info("resumed from %s at step %d", outcome.info.path, step)
    reports.send(restored)
    return restored


def newest_checkpoint_step(root: Path) -> int | None:
    from checkpoints import list_committed

    committed = list_committed(root) if root.exists() else []
    return committed[0].step if committed else None


def describe_restore(restored: Resumed | None) -> str:
    if restored is None:
        return "fresh start"
    if restored.source == RestoreSource.PEER:
        return f"peer memory at step {restored.step}"
    return f"checkpoint step {restored.step}"
