"""What a worker process (which outlives attempts) keeps of a job's training state: when
a peer dies, the survivors stop at a step boundary and keep their live model and
optimizer (`strategy`: a ddp rank's is a whole replica) and snapshots of shards (`copies`:
own and wards', so the survivors of a node loss hold every shard of a sharded job).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from elastrain.contracts.group import HeldState
from elastrain.contracts.messages import StepMetrics
from elastrain.workers.memory.rules import NOTHING, Offer
from elastrain.workers.memory.snapshots import Snapshot
from elastrain.workers.strategies import Strategy


@dataclass
class ReplicaMemory:
    job_id: int | None = None
    step: int = NOTHING
    """Optimizer steps applied to the held state."""
    world_size: int = 0
    attempt: int = 0
    rank: int = 0
    strategy: Strategy | None = None
    recent: Iterable[StepMetrics] = field(default_factory=tuple)
    """The newest metric points (handed on like those saved with a checkpoint)."""
    copies: list[Snapshot] = field(default_factory=list)
    """Snapshot generations held, oldest first."""

    def hold(
        self,
        *,
        job_id: int,
        strategy: Strategy,
        step: int,
        world_size: int,
        attempt: int,
        recent: Iterable[StepMetrics],
        rank: int = 0,
    ) -> None:
        if self.job_id != job_id:
            self.copies = []
        self.job_id, self.strategy, self.step = job_id, strategy, step
        self.world_size, self.attempt, self.recent = world_size, attempt, recent
        self.rank = rank

    def forget(self) -> None:
        self.job_id, self.strategy, self.step, self.recent = None, None, NOTHING, ()
        self.copies = []

    def offer(self, job_id: int) -> Offer:
        """What this process can give a new group of `job_id`."""
        if self.job_id != job_id:
            return Offer()
        full = self.strategy is not None and self.strategy.full_replica
        live = self.step if self.strategy is not None else NOTHING
        copies = tuple((c.generation, frozenset(c.blobs)) for c in self.copies)
        return Offer(live_step=live, full_replica=full, copies=copies)

    def describe(self) -> HeldState | None:
        if self.job_id is None or self.strategy is None:
            return None
        return HeldState(
            job_id=self.job_id,
            step=self.step,
            world_size=self.world_size,
            full_replica=self.strategy.full_replica,
        )
