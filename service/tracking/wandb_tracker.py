"""Weights & Biases: one run per job, kept open in the control plane between forwarding
passes (a W&B run is a live object; `close` finishes it here and a later `open` resumes it
by id). Offline runs are written under the control plane's `WANDB_DIR` for `wandb sync`."""

from __future__ import annotations

import netrc
import os
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import wandb

from elastrain.contracts.spec import WandbMode, WandbTracking
from elastrain.service.states import JobState
from elastrain.service.tracking.base import Change, Point, RunInfo, TrackerError


def _has_api_key() -> bool:
    """Whether online mode can log in without asking: a prompt on the control plane's
    terminal would hang the forwarder."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1]
        return netrc.netrc().authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbTracker:
    name = "wandb"

    def __init__(self, config: WandbTracking) -> None:
        self.config = config
        self.run: Any = None  # a wandb Run

    def open(self, run: RunInfo, run_id: str | None) -> str:
        if self.config.mode == WandbMode.online and not _has_api_key():
            raise TrackerError(
                "wandb: online mode needs WANDB_API_KEY (or `wandb login`) in the control "
                "plane's environment"
            )
        new_id = run_id or f"elastrain-{run.job_id}-{uuid.uuid4().hex[:8]}"
        try:
            self.run = wandb.init(
                project=self.config.project,
                entity=self.config.entity,
                mode=self.config.mode.value,
                id=new_id,
                name=run.run_name,
                config=run.params if run_id is None else None,
                tags=[f"job-{run.job_id}"],
                resume="allow",
                # Read at every init: wandb reads its environment once per process.
                dir=os.environ.get("WANDB_DIR"),
                # One process forwards many jobs: each init is a run of its own, and the
                # service's console, code and machine stats are none of the run's business.
                reinit="create_new",
                settings=wandb.Settings(
                    silent=True,
                    console="off",
                    save_code=False,
                    disable_git=True,
                    x_disable_stats=True,
                    x_disable_meta=True,
                ),
            )
        except Exception as exc:  # wandb raises its own and plain errors alike
            raise TrackerError(f"wandb: {exc}") from exc
        self.run.summary["elastrain/owner"] = run.owner
        return new_id

    def log_points(self, points: Sequence[Point]) -> None:
        for p in points:
            self._live().log(dict(p.values), step=p.step)

    def log_changes(self, changes: Sequence[Change]) -> None:
        # The run's summary says where the job is; W&B's history is keyed by step and
        # only moves forward, so transitions are not history rows.
        for change in changes:
            summary = self._live().summary
            summary["elastrain/state"] = change.to_state
            summary["elastrain/state_reason"] = change.reason
            if change.world_size is not None:
                summary["elastrain/world_size"] = change.world_size

    def finish(self, state: JobState, at: datetime | None) -> None:
        run = self._live()
        run.summary["elastrain/state"] = state.value
        run.finish(exit_code=0 if state == JobState.SUCCEEDED else 1)
        self.run = None

    def close(self) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish()

    def _live(self) -> Any:
        if self.run is None:
            raise TrackerError("wandb: the run was not opened")
        return self.run
