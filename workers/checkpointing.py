"""The loop's side of sharded checkpoints (`elastrain.checkpoints.dcp`): the checkpointer of an
attempt, what a save writes beside the model and optimizer state (the manifest's layout,
data position and extras, each rank's RNG streams), and what it reads back."""

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
    from elastrain.checkpoints.dcp.held_copy import HeldCopy

log = logging.getLogger("elastrain.workers.checkpointing")

#: An async save of a state in host memory writes the live tensors, with no staging copy,
#: unless the previous save took more than this many steps to write its tensors. The
#: update that needs them back comes after the next step's forward and backward, most of
#: a step; a write a little longer leaves a few tensors for that update to copy.
IN_PLACE_MAX_WRITE_STEPS = 1.0


def writes_in_place(
    *, async_save: bool, on_host: bool, tensor_write_s: float | None, step_s: float
) -> bool:
    """Whether an async save is written from the live state (`ShardedCheckpointer.save`'s
    `in_place`): the next update waits for the write, or, where it is not over, for a copy
    of the tensors not yet written. Only for a state in host memory (a device's state is
    copied to the host to be written anyway). An attempt's first save (no write timed
    yet) goes in place too: at worst its update copies what is left, less than a staging
    copy. Where the previous save's tensors (`tensor_write_s`) took longer than a step
    to write, the save stages instead (a slow disk): the staging copy then runs beside
    the forward and backward, where a spare core hides it, rather than hold the update."""
    if not (async_save and on_host) or step_s <= 0:
        return False
    return tensor_write_s is None or tensor_write_s <= IN_PLACE_MAX_WRITE_STEPS * step_s


def make_checkpointer(ctx: TrainContext, spec: JobSpec) -> ShardedCheckpointer:
    from elastrain.checkpoints.dcp import ShardedCheckpointer

    with group_forming():  # the checkpointer's own gloo group: released with the attempt's
        return ShardedCheckpointer(
            ctx.checkpoint_root,
            rank=ctx.rank,
            world_size=ctx.world_size,
            async_save=spec.checkpoint.async_save,
            # Every step waits for the staging copy before its update (`Strategy.step`).
            async_staging=spec.checkpoint.async_save,
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
    copy: HeldCopy | None = None,
    last: bool = False,
    in_place: bool = False,
) -> float:
    """Save a checkpoint of step `done`; returns the seconds training was blocked.
    `copy`: this rank's items copied at `done` (peer memory's), written instead of the
    live state's. `last`: the attempt's last step; written at once, with no staging copy
    (the attempt waits for its commit before it ends). `in_place`: written from the live
    state in the background, the next update waiting for it (`writes_in_place`)."""
    training = spec.training
    layout = strategy.layout
    blocked = checkpointer.save(
        step=done,
        attempt=ctx.attempt,
        # Only a save that writes the live tensors needs the buffers' copies.
        state=strategy.state_dict_for_checkpoint(
            copy_buffers=in_place and copy is None and not last
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
        copy=copy,
        replicated=strategy.full_replica,  # DDP: a rank stages what it writes alone
        sync=last,
        in_place=in_place,
    )
    if ctx.rank == 0:
        log.info("checkpoint at step %d (%s): blocked %.3fs", done, reason, blocked)
    return float(blocked)


@contextlib.contextmanager
def settles_staging(checkpointer: ShardedCheckpointer) -> Iterator[None]:
    """Leaving by an exception, first let an async save's staging copy finish: this
    process's state may live on for the next attempt (ReplicaMemory), which must not
    change it under the copy."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the failure being raised says more
            checkpointer.wait_staged()
        raise
