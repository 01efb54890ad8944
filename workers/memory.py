"""What a worker process keeps of a job's training state between attempts.

Worker processes outlive attempts (`workers.process`). When a peer dies mid-run, the
survivors stop at a step boundary (the loop agrees on every step before any rank updates
its weights) and keep their model and optimizer here. The next attempt's group then takes
the state from a survivor's memory rather than from the last checkpoint on disk, so no
step is lost. Only strategies whose every rank holds a full replica (ddp) can do that; the
others (fsdp shards, pipeline stages) report no usable state and load a checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from contracts.group import HeldState
from contracts.messages import StepMetrics
from workers.strategies import Strategy

#: Returned by `step_for` when this process holds nothing usable for the job.
NOTHING = -1


@dataclass
class ReplicaMemory:
    job_id: int | None = None
    step: int = NOTHING
    """Optimizer steps applied to the held state (the loop advances it after each one)."""
    world_size: int = 0
    attempt: int = 0
    strategy: Strategy | None = None
    recent: Iterable[StepMetrics] = field(default_factory=tuple)
    """The newest metric points (handed on like those saved with a checkpoint)."""

    def hold(
        self,
        *,
        job_id: int,
        strategy: Strategy,
        step: int,
        world_size: int,
        attempt: int,
        recent: Iterable[StepMetrics],
    ) -> None:
        self.job_id, self.strategy, self.step = job_id, strategy, step
        self.world_size, self.attempt, self.recent = world_size, attempt, recent

    def forget(self) -> None:
        self.job_id, self.strategy, self.step, self.recent = None, None, NOTHING, ()

    def step_for(self, job_id: int) -> int:
        """The step of a full replica of `job_id`'s state held here, or NOTHING."""
        if self.job_id != job_id or self.strategy is None or not self.strategy.full_replica:
            return NOTHING
        return self.step

    def describe(self) -> HeldState | None:
        if self.job_id is None or self.strategy is None:
            return None
        return HeldState(
            job_id=self.job_id,
            step=self.step,
            world_size=self.world_size,
            full_replica=self.strategy.full_replica,
        )

    def full_state(self) -> dict[str, Any]:
        """The held model and optimizer as full (unsharded) state dicts, plus what the
        receiving ranks need to say where they resumed from. Local: no collective."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        assert self.strategy is not None
        model_sd, optim_sd = get_state_dict(
            self.strategy.model,
            self.strategy.optimizer,
            options=StateDictOptions(full_state_dict=True),
        )
        return {
            "model": model_sd,
            "optim": optim_sd,
            "step": self.step,
            "world_size": self.world_size,
            "attempt": self.attempt,
            "metrics": [m.to_point() for m in self.recent],
        }


def share_from_peer(memory: ReplicaMemory, strategy: Strategy, donor: int) -> dict[str, Any]:
    """Every rank calls it: rank `donor` broadcasts its held state, every rank loads it into
    `strategy` (already set up for the new group). Returns the state's metadata.

    One pickled broadcast: right for the models this service trains on CPU; a bucketed
    tensor broadcast would be the next step for multi-GB models.
    """
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    box: list[Any] = [memory.full_state() if dist.get_rank() == donor else None]
    dist.broadcast_object_list(box, src=donor)
    state: dict[str, Any] = box[0]
    set_state_dict(
        strategy.model,
        strategy.optimizer,
        model_state_dict=state.pop("model"),
        optim_state_dict=state.pop("optim"),
        options=StateDictOptions(full_state_dict=True),
    )
    return state
