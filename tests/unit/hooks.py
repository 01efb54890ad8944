"""A test double for the loop's `elastrain.workers.api.TrainHooks`: it keeps what the loop
sends and plays back a script of controls, in-process."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from elastrain.contracts.messages import (
    CheckpointCommitted,
    Control,
    Resumed,
    StepMetrics,
    WorkerEvent,
    WorkerMessage,
)


@dataclass
class RecordingHooks:
    """Hooks that record what the loop sends and answer `poll_control` from `controls`
    (then Control.NONE)."""

    messages: list[WorkerMessage] = field(default_factory=list)
    controls: list[Control] = field(default_factory=list)

    def send(self, message: WorkerMessage) -> None:
        self.messages.append(message)

    def poll_control(self) -> Control:
        return self.controls.pop(0) if self.controls else Control.NONE

    def undelivered(self) -> Sequence[StepMetrics]:
        return ()  # handed over at once, in-process

    @property
    def metrics(self) -> list[StepMetrics]:
        return [m for m in self.messages if isinstance(m, StepMetrics)]

    @property
    def commits(self) -> list[CheckpointCommitted]:
        return [m for m in self.messages if isinstance(m, CheckpointCommitted)]

    @property
    def events(self) -> list[WorkerEvent]:
        return [m for m in self.messages if isinstance(m, WorkerEvent)]

    @property
    def resumed(self) -> Resumed | None:
        return next((m for m in self.messages if isinstance(m, Resumed)), None)
