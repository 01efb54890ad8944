"""Where an attempt's state comes from: the survivors' memory when they hold the job's
newest state (`elastrain.workers.memory`), else the latest good checkpoint (resharded),
else a fresh start. Every rank calls `restore` (loads are collective).
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch.distributed as dist

from elastrain.checkpoints.catalog import list_committed
from elastrain.contracts.messages import (
    EventKind,
    RestoreSource,
    Resumed,
    SavedTraining,
    WorkerEvent,
)
from elastrain.workers.api import TrainContext
from elastrain.workers.memory.peer_reader import load_from_peers
from elastrain.workers.memory.replica import ReplicaMemory
from elastrain.workers.memory.rules import Offer, choose_source
from elastrain.workers.reports import Reports
from elastrain.workers.rng import reseed, set_rng_states
from elastrain.workers.strategies import Strategy

if TYPE_CHECKING:
    from elastrain.checkpoints.dcp import ShardedCheckpointer

log = logging.getLogger("elastrain.workers.resume")


def restore(
    checkpointer: ShardedCheckpointer,
    strategy: Strategy,
    ctx: TrainContext,
    reports: Reports,
    seed: int,
    memory: ReplicaMemory,
    group: dist.ProcessGroup | None = None,
) -> Resumed | None:
    """What was restored into `strategy` (None: a fresh start): from the survivors'
    memory when at least as new as the newest checkpoint (`rules.choose_source`), else
    `resume`. `group`: a gloo group of every rank."""
    newest = None
    if ctx.rank == 0 and (committed := list_committed(ctx.checkpoint_root)):
        newest = committed[0].step
    offers: list[tuple[Offer, int | None]] = [(Offer(), None)] * ctx.world_size
    dist.all_gather_object(offers, (memory.offer(ctx.job_id), newest), group=group)
    plan = choose_source([o for o, _ in offers], offers[0][1])
    if not plan.from_peers:
        if plan.missing and ctx.rank == 0:
            log.warning("peer memory lacks the shards of ranks %s of its newest copy (each "
                        "lost with its buddy): resuming from storage", list(plan.missing))  # fmt: skip
        memory.forget()  # superseded (or nothing): do not keep two states alive
        return resume(checkpointer, strategy, ctx, reports, seed, reached=plan.reached)
    started = time.perf_counter()
    handed = load_from_peers(plan, memory, strategy, group)
    reseed(seed, plan.step, ctx.rank)  # a new group: per-rank streams restart from (seed, step)
    restored = Resumed(
        step=plan.step,
        path="",
        saved_world_size=handed.saved_world_size,
        world_size=ctx.world_size,
        saved_attempt=handed.saved_attempt,
        metrics=handed.metrics,
        source=RestoreSource.PEER,
        steps_recomputed=plan.steps_recomputed,
    )
    if ctx.rank == 0:
        log.info("resumed at step %d from peer memory (%s, served by ranks %s; %.1f MB in "
                 "%.2fs on rank 0; %s step(s) recomputed)", plan.step, plan.source.value,
                 sorted(set(plan.holder.values())), handed.bytes_moved / 1e6,
                 time.perf_counter() - started, plan.steps_recomputed)  # fmt: skip
    reports.send(restored)
    return restored


def resume(
    checkpointer: ShardedCheckpointer,
    strategy: Strategy,
    ctx: TrainContext,
    reports: Reports,
    seed: int,
    *,
    reached: int | None = None,
) -> Resumed | None:
    """Load the latest good checkpoint (None: a fresh start), on every rank. `reached`:
    the furthest step the previous attempt got to, if a survivor said."""
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
        steps_recomputed=None if reached is None else max(0, reached - step),
    )
    if ctx.rank == 0:
        log.info("resumed from %s at step %d", outcome.info.path, step)
    reports.send(restored)
    return restored


def describe_restore(restored: Resumed | None) -> str:
    if restored is None:
        return "fresh start"
    where = "peer memory at step" if restored.source == RestoreSource.PEER else "checkpoint step"
    where = f"{where} {restored.step}"
    if restored.steps_recomputed is not None:
        where += f", {restored.steps_recomputed} step(s) recomputed"
    return where
