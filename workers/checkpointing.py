"""The loop's side of sharded checkpoints: an attempt's checkpointer, and what a save
writes beside the state (manifest fields, each rank's RNG streams)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from elastrain.contracts.messages import SavedTraining, StepMetrics
from elastrain.contracts.spec import JobSpec
from elastrain.workers.api import TrainContext
from elastrain.workers.comm_release import group_forming
from elastrain.workers.rng import get_rng_states
from elastrain.workers.strategies import Strategy

if TYPE_CHECKING:  # imported when made, so `workers` imports without DCP loaded
    from elastrain.checkpoints.dcp import ShardedCheckpointer

log = logging.getLogger("elastrain.workers.checkpointing")


def make_checkpointer(ctx: TrainContext, spec: JobSpec) -> ShardedCheckpointer:
    from elastrain.checkpoints.dcp import ShardedCheckpointer

    with group_forming():  # the checkpointer's own gloo group: released with the attempt's
        return ShardedCheckpointer(
            ctx.checkpoint_root,
            rank=ctx.rank,
            world_size=ctx.world_size,
            # Every step waits for the staging copy before its update (`Strategy.step`).
            async_save=spec.checkpoint.async_save,
            owner=ctx.database,
            digest=spec.checkpoint.digest.value,
        )


def save_checkpoint(
    checkpointer: ShardedCheckpointer,
    strategy: Strategy,
    ctx: TrainContext,
    spec: JobSpec,
    done: int,
    *,
    reason: str,
    metrics: Iterable[StepMetrics] = (),
    last: bool = False,
) -> float:
    """Save a checkpoint of step `done`; returns the seconds training was blocked.
    `last`: the attempt's last step, written at once (its commit is waited for)."""
    training = spec.training
    layout = strategy.layout
    blocked = checkpointer.save(
        step=done,
        attempt=ctx.attempt,
        # The next forward may change buffers in place under a background staging copy.
        state=strategy.state_dict_for_checkpoint(
            copy_buffers=spec.checkpoint.async_save and not last
        ),
        manifest_fields={
            "strategy": spec.strategy.label,
            "layout": {"dp": layout.dp, "pp": layout.pp, "tp": layout.tp},
            "data_position": {
                "step": done,
                "samples_consumed": done * training.global_batch_size,
            },
            "extra": SavedTraining(
                seed=training.seed,
                global_batch_size=training.global_batch_size,
                micro_batch_size=training.micro_batch_size,
                save_started_at=time.time(),
                metrics=tuple(metrics),
            ).to_extra(),
        },
        rank_extra=get_rng_states(ctx.world_size),
        sync=last,
    )
    if ctx.rank == 0:
        log.info("checkpoint at step %d (%s): blocked %.3fs", done, reason, blocked)
    return float(blocked)


@contextlib.contextmanager
def settles_staging(checkpointer: ShardedCheckpointer) -> Iterator[None]:
    """On an exception, first let a staging copy finish: the state may live on for the
    next attempt (ReplicaMemory), which must not change it under the copy."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the failure being raised says more
            checkpointer.wait_staged()
        raise
