"""The interface between the scheduler and whatever runs worker groups: the runtime on Ray
(`elastrain.service.runtime_client`) or, in tests, a fake (`tests/fake_launcher.py`).

Everything crossing it is typed plain data (`elastrain.contracts.runtime`, `elastrain.contracts.messages`,
`elastrain.service.capacity`), so the scheduler is tested without Ray.
"""

from __future__ import annotations

from typing import Protocol

from elastrain.contracts.messages import Control, DriverReport
from elastrain.contracts.runtime import (
    AttemptKey,
    ExportOutcome,
    ExportRequest,
    LaunchRequest,
    Reconcile,
)
from elastrain.service.capacity import ClusterCapacity


class Launcher(Protocol):
    def capacity(self) -> ClusterCapacity:
        """The nodes of the cluster, alive or lost, with their resources."""

    def launch(self, request: LaunchRequest) -> None:
        """Start the attempt's driver (which starts its worker group); returns at once."""

    def reconcile(self, want: Reconcile) -> dict[AttemptKey, DriverReport]:
        """Hand over the attempts the database says are live; get each one's report, with
        the messages after its acknowledged sequence number (a LOST report for one the
        runtime does not hold). The runtime lets go of everything else it holds. Called
        once per pass, also when nothing is live."""

    def send_control(self, key: AttemptKey, control: Control) -> None:
        """Ask the attempt to checkpoint now, or to checkpoint and stop (fire and forget)."""

    def release(self, key: AttemptKey, *, final: bool = False) -> None:
        """Stop the attempt's worker group now and free its resources (cancel, node loss,
        failure, or after it finished), so the next launch may use them. Its processes
        may keep the job's state for the next attempt, unless `final` (the job has ended).
        The next `reconcile` does the same when this call fails."""

    def export(self, request: ExportRequest) -> ExportOutcome:
        """Convert a committed checkpoint into a model folder on the cluster
        (`elastrain.workers.export_task`); returns when it is written, refused or failed."""
