"""What the loop tells the service, and what it keeps of it for the next attempt.

Rank 0 speaks for the group (`TrainHooks`); the other ranks' reports go nowhere. Every
rank keeps the newest metric points: they are saved with each checkpoint and held with
the state in memory, so whichever rank survives a loss hands them on, and the attempt that
resumes sends them again (the reports that died with an attempt, sent after the
scheduler's last poll, are filled in). Rank 0 also saves every point its hooks do not
know to have reached the service (`TrainHooks.undelivered`): a node cut off from the
service trains on until its attempt is fenced, and its points come back the same way.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable

from elastrain.contracts.messages import (
    CheckpointCommitted,
    Control,
    Phase,
    StepMetrics,
    TimelineMark,
    WorkerMessage,
)
from elastrain.workers.api import TrainHooks

log = logging.getLogger("elastrain.workers.reports")

#: Metric points saved with each checkpoint: the newest this many steps (more than the
#: scheduler ever lags behind, which is a second or two of steps).
METRICS_KEPT_WITH_CHECKPOINT = 256


class Reports:
    def __init__(self, hooks: TrainHooks, *, rank: int) -> None:
        self.hooks = hooks
        self.speaks = rank == 0
        self.recent: deque[StepMetrics] = deque(maxlen=METRICS_KEPT_WITH_CHECKPOINT)
        """The newest points, kept on every rank (continued across resumes)."""
        self._first_step_marked = False

    def carry_on(self, points: Iterable[StepMetrics]) -> None:
        """The points an earlier attempt handed on with the state (kept, not sent again
        here: the restore's own message carries them)."""
        self.recent.extend(points)

    def poll_control(self) -> Control:
        """Rank 0's: what the service asks of the group now (NONE on the other ranks)."""
        return self.hooks.poll_control() if self.speaks else Control.NONE

    def send(self, message: WorkerMessage) -> None:
        if self.speaks:
            self.hooks.send(message)

    def step(self, point: StepMetrics) -> None:
        """One optimizer step's point: kept on every rank, sent by rank 0; the attempt's
        first also marks the timeline."""
        self.recent.append(point)
        self.send(point)
        if not self._first_step_marked:
            self._first_step_marked = True
            self.send(TimelineMark(phase=Phase.FIRST_STEP, at=point.wall_time))

    def commits(self, commits: Iterable[CheckpointCommitted]) -> None:
        for commit in commits:
            if self.speaks:
                log.info("checkpoint committed: %s", commit.path)
            self.send(commit)

    def kept_with_checkpoint(self) -> list[StepMetrics]:
        """The points a checkpoint carries: the newest ones, and every one not known to
        have reached the service; one per step, in step order."""
        undelivered = self.hooks.undelivered() if self.speaks else ()
        kept = {p.step: p for p in (*undelivered, *self.recent)}
        return sorted(kept.values(), key=lambda p: p.step)
