"""What the forwarder hands a tracker, and what every tracker implements.

A tracker sees plain data read from the database after it was committed: the run's
params (the job spec, flattened), metric points in step order, and state changes in the
order they happened. It never sees a session, so nothing it does (or fails to do) can
touch the job's rows.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Protocol

from elastrain.service.states import JobState


class TrackerError(Exception):
    """The tracker refused or could not be reached; the forwarder retries later."""


@dataclass(frozen=True, slots=True)
class RunInfo:
    """Who the run is for: made once per job and tracker."""

    job_id: int
    job_name: str
    owner: str
    params: dict[str, str]

    @property
    def run_name(self) -> str:
        return f"{self.job_name}-{self.job_id}"

    @property
    def tags(self) -> dict[str, str]:
        return {"elastrain.job_id": str(self.job_id), "elastrain.owner": self.owner}


@dataclass(frozen=True, slots=True)
class Point:
    """One step's numeric metrics (`loss`, `lr`, `step_time_s`, custom ones)."""

    step: int
    at: datetime
    values: dict[str, float]


@dataclass(frozen=True, slots=True)
class Change:
    """One state transition of the job (an `events` row of kind transition)."""

    event_id: int
    at: datetime
    from_state: str | None
    to_state: str
    reason: str
    step: int | None
    world_size: int | None


class Tracker(Protocol):
    """One job's run in one tracker. `open` first, then any number of `log_*` calls, then
    `finish` (the job ended) or `close` (this process lets go; the run stays open in the
    tracker and a later `open` with its id goes on with it)."""

    name: str

    def open(self, run: RunInfo, run_id: str | None) -> str:
        """Start the run (logging its params) when `run_id` is None, else resume it;
        returns the run's id."""
        ...

    def log_points(self, points: Sequence[Point]) -> None: ...

    def log_changes(self, changes: Sequence[Change]) -> None: ...

    def finish(self, state: JobState, at: datetime | None) -> None: ...

    def close(self) -> None: ...


#: Longer parameter values are cut: MLflow refuses values over 6000 characters.
MAX_PARAM_CHARS = 6000


def flatten_params(spec: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The spec as flat "section.field" -> text pairs, as trackers keep params: nested
    objects become dotted keys, lists and other values their JSON. Unset (null) fields are
    left out: a tracker's params are what the job set or defaulted to."""
    flat: dict[str, str] = {}
    for key, value in spec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            flat.update(flatten_params(value, prefix=f"{name}."))
        elif value is None or value == {}:
            continue
        else:
            text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
            flat[name] = text[:MAX_PARAM_CHARS]
    return flat


def numeric_values(values: dict[str, Any]) -> dict[str, float]:
    """The values of a metric row a tracker can chart: finite numbers (not flags, not the
    nested memory readings, not a diverged loss stored as null)."""
    return {
        k: float(v)
        for k, v in values.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
    }
