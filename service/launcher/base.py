"""The interface between the scheduler and whatever runs worker groups (Ray, or a fake).

Everything crossing it is typed plain data (`contracts.messages`, `service.capacity`), so
the scheduler is tested without Ray.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from contracts.messages import Control, DriverReport
from contracts.spec import JobSpec
from service.capacity import ClusterCapacity


class AttemptKey(NamedTuple):
    job_id: int
    attempt: int


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchRequest:
    job_id: int
    attempt: int
    world_size: int
    spec: JobSpec
    storage_path: str
    driver_name: str
    cause: str = "submitted"
    """Why this attempt starts: "submitted", "node lost", "failed", "resize"."""
    detected_at: float = 0.0
    """When the control plane decided it (wall clock; 0: now): where its timeline starts."""

    @property
    def key(self) -> AttemptKey:
        return AttemptKey(self.job_id, self.attempt)


class Launcher(Protocol):
    def capacity(self) -> ClusterCapacity:
        """The nodes of the cluster, alive or lost, with their resources."""

    def launch(self, request: LaunchRequest) -> None:
        """Start the attempt's driver (which starts its worker group); returns at once."""

    def poll(self, acks: Mapping[AttemptKey, int]) -> dict[AttemptKey, DriverReport]:
        """Each live attempt's report, with the messages after the acknowledged sequence
        number (`acks[key]`: what the scheduler has stored). All drivers are asked at
        once; one that does not answer in time reports its last known status."""

    def send_control(self, key: AttemptKey, control: Control) -> None:
        """Ask the attempt to checkpoint now, or to checkpoint and stop (fire and forget)."""

    def release(self, key: AttemptKey, *, final: bool = False) -> None:
        """Stop the attempt's worker group now, free its resources and forget its driver
        (cancel, node loss, failure, or after it finished). Its processes may keep the
        job's state for the next attempt, unless `final` (the job has ended)."""


def driver_name(job_id: int, attempt: int) -> str:
    return f"elastrain-job{job_id}-a{attempt}"
