"""Goodput: where a job's wall-clock time went, and the share that made kept progress.

Pure. The inputs are kept on the job row as things happen (`elastrain.service.jobs.set_job_state`
adds each state's seconds; `elastrain.service.reports.record_metrics` adds step seconds), so a job's
goodput costs no query. Buckets:

| bucket | what |
| --- | --- |
| queued | PENDING: waiting for admission |
| starting | STARTING: from admission to the first step (processes, group, restore) |
| training | steps whose results the job still has (`step_time_s` of every kept step) |
| recomputed | steps computed, then lost to a failure and computed again after a restore |
| recovering / resizing | RECOVERING / RESIZING, less any training done meanwhile |
| checkpoint_stall | training blocked by checkpoint saves (staging, a previous save) |
| other | the rest: reporting and data loading between steps, work lost unreported |

Training happens outside RUNNING too (the first steps of a relaunch before the scheduler
sees them, the old attempt training on to its checkpoint while RESIZING): it counts as
training, and the state it happened in gives up that time. `goodput` = training / wall.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from datetime import datetime, timezone
from typing import Any

from elastrain.service.states import JobState


@dataclass(frozen=True, slots=True)
class Goodput:
    wall_s: float
    queued_s: float
    starting_s: float
    training_s: float
    recomputed_s: float
    recovering_s: float
    resizing_s: float
    checkpoint_stall_s: float
    other_s: float

    @property
    def ratio(self) -> float | None:
        """Kept training over wall time (None before any time has passed)."""
        return self.training_s / self.wall_s if self.wall_s > 0 else None

    def to_dict(self) -> dict[str, float | None]:
        # The fields by name, not `dataclasses.asdict`: that deep-copies each float, and
        # every job the API shows (a submit, each job of a list page) goes through here.
        out: dict[str, float | None] = {k: round(getattr(self, k), 3) for k in _FIELDS}
        out["goodput"] = None if self.ratio is None else round(self.ratio, 4)
        return out


_FIELDS = tuple(f.name for f in fields(Goodput))


def split(
    *,
    created_at: datetime,
    end: datetime,
    state: JobState,
    state_since: datetime | None,
    seconds_in: Mapping[str, float],
    compute_s: float,
    kept_s: float,
    stall_s: float,
) -> Goodput:
    """The job's time from submission to `end` (its finish, or now), by bucket."""
    seconds = {k: max(0.0, float(v)) for k, v in seconds_in.items()}
    if not state.is_terminal:  # the current state's open interval
        opened = (end - (state_since or created_at)).total_seconds()
        seconds[state.value] = seconds.get(state.value, 0.0) + max(0.0, opened)
    wall = max(0.0, (end - created_at).total_seconds())
    # Step seconds are measured on the workers' clocks: never let them claim more than
    # the wall time (skew, or a step that straddles the end of a short window).
    training = min(wall, max(0.0, kept_s))
    recomputed = min(wall - training, max(0.0, compute_s - kept_s))
    stall = min(wall - training - recomputed, max(0.0, stall_s))
    busy = training + recomputed + stall
    overlap = max(0.0, busy - seconds.get(JobState.RUNNING.value, 0.0))
    non_training: dict[str, float] = {}
    for name in (JobState.RESIZING, JobState.RECOVERING, JobState.STARTING):
        spent = seconds.get(name.value, 0.0)
        taken = min(spent, overlap)
        overlap -= taken
        non_training[name.value] = spent - taken
    queued = seconds.get(JobState.PENDING.value, 0.0)
    accounted = queued + sum(non_training.values()) + busy
    return Goodput(
        wall_s=wall,
        queued_s=queued,
        starting_s=non_training[JobState.STARTING.value],
        training_s=training,
        recomputed_s=recomputed,
        recovering_s=non_training[JobState.RECOVERING.value],
        resizing_s=non_training[JobState.RESIZING.value],
        checkpoint_stall_s=stall,
        other_s=max(0.0, wall - accounted),
    )


def of_job(job: Any, *, now: datetime) -> Goodput:
    """`split` of a job as stored: an ORM row, a Core row or `JobOut`, which all carry the
    columns (SQLite hands back naive UTC datetimes; they are made aware here)."""
    return split(
        created_at=_utc(job.created_at),
        end=_utc(job.finished_at) if job.finished_at else now,
        state=JobState(job.state),
        state_since=_utc(job.state_since) if job.state_since else None,
        seconds_in=job.seconds_in or {},
        compute_s=job.compute_s or 0.0,
        kept_s=job.kept_s or 0.0,
        stall_s=job.stall_s or 0.0,
    )


def _utc(moment: datetime) -> datetime:
    return moment if moment.tzinfo is not None else moment.replace(tzinfo=timezone.utc)


def step_seconds(values: Mapping[str, object]) -> tuple[float, float]:
    """(step seconds, checkpoint stall seconds before it) of a reported metric point."""
    return _number(values.get("step_time_s")), _number(values.get("checkpoint_stall_s"))


def _number(value: object) -> float:
    return float(value) if isinstance(value, int | float) and value == value else 0.0
