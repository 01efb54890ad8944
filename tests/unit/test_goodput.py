"""Goodput: the split of a job's wall time, row by row (`elastrain.service.goodput.split`)."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone
from typing import Any

import pytest

from elastrain.service.goodput import split, step_seconds
from elastrain.service.states import JobState

T0 = datetime(2026, 1, 1, tzinfo=timezone.utc)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def run(**kw: Any) -> dict[str, float | None]:
    base: dict[str, Any] = {
        "created_at": T0, "end": at(100), "state": JobState.SUCCEEDED, "state_since": at(100),
        "seconds_in": {}, "compute_s": 0.0, "kept_s": 0.0, "stall_s": 0.0,
    }  # fmt: skip
    base.update(kw)
    return split(**base).to_dict()


@pytest.mark.parametrize(
    ("kw", "expected"),
    [
        # Queued 10 s, started in 5, trained 80 s of kept steps plus 5 s between steps.
        (
            {"seconds_in": {"PENDING": 10, "STARTING": 5, "RUNNING": 85}, "compute_s": 80,
             "kept_s": 80},
            {"queued_s": 10, "starting_s": 5, "training_s": 80, "other_s": 5, "goodput": 0.8},
        ),
        # A node lost: 10 s of steps recomputed, 15 s recovering, 2 s of checkpoint stalls.
        (
            {"seconds_in": {"PENDING": 0, "STARTING": 3, "RUNNING": 82, "RECOVERING": 15},
             "compute_s": 80, "kept_s": 70, "stall_s": 2},
            {"training_s": 70, "recomputed_s": 10, "recovering_s": 15,
             "checkpoint_stall_s": 2, "other_s": 0, "goodput": 0.7},
        ),
        # Training while RESIZING (the old attempt runs on to its checkpoint) is training.
        (
            {"seconds_in": {"STARTING": 5, "RUNNING": 60, "RESIZING": 35}, "compute_s": 80,
             "kept_s": 80},
            {"training_s": 80, "resizing_s": 15, "starting_s": 5, "other_s": 0},
        ),
        # A running job: the current state's open interval counts up to now.
        (
            {"state": JobState.RUNNING, "state_since": at(40), "end": at(100),
             "seconds_in": {"PENDING": 20, "STARTING": 20}, "compute_s": 50, "kept_s": 50},
            {"wall_s": 100, "queued_s": 20, "training_s": 50, "other_s": 10, "goodput": 0.5},
        ),
        # Still queued: no goodput yet, all of it queued.
        (
            {"state": JobState.PENDING, "state_since": T0, "end": at(30)},
            {"wall_s": 30, "queued_s": 30, "goodput": 0.0},
        ),
        ({"end": T0}, {"wall_s": 0, "goodput": None}),
        # Workers' clocks never claim more than the wall time.
        (
            {"end": at(10), "seconds_in": {"RUNNING": 10}, "compute_s": 30, "kept_s": 12,
             "stall_s": 5},
            {"training_s": 10, "recomputed_s": 0, "checkpoint_stall_s": 0, "goodput": 1.0},
        ),
    ],
)  # fmt: skip
def test_split(kw: dict[str, Any], expected: dict[str, float | None]) -> None:
    got = run(**kw)
    assert {k: got[k] for k in expected} == expected
    if got["wall_s"]:
        parts = [v for k, v in got.items() if k not in ("wall_s", "goodput")]
        assert sum(p for p in parts if p is not None) == pytest.approx(got["wall_s"])


def test_step_seconds_ignores_what_is_not_a_number() -> None:
    assert step_seconds({"step_time_s": 0.5, "checkpoint_stall_s": 0.25}) == (0.5, 0.25)
    assert step_seconds({"step_time_s": "x", "checkpoint_stall_s": float("nan")}) == (0.0, 0.0)
    assert step_seconds({}) == (0.0, 0.0)


def test_reports_keep_the_sums_and_a_recomputed_step_stops_counting_as_kept(
    session_factory: Any,
) -> None:
    from elastrain.contracts.spec import JobSpec
    from elastrain.service import jobs, reports
    from elastrain.service.db import session_scope
    from tests.factories import spec_dict

    def points(steps: range, stall_at: int = -1) -> list[dict[str, Any]]:
        return [
            {"step": s, "loss": 1.0, "step_time_s": 1.0,
             "checkpoint_stall_s": 0.5 if s == stall_at else 0.0}
            for s in steps
        ]  # fmt: skip

    with session_scope(session_factory) as s:
        job = jobs.create_job(s, spec=JobSpec.model_validate(spec_dict()))
        jobs.start_attempt(s, job, world_size=2, driver_name="d1")
        reports.record_metrics(s, job, attempt=1, points=points(range(1, 4), stall_at=3))
        jobs.start_attempt(s, job, world_size=1, driver_name="d2")  # lost after step 3
        reports.record_metrics(s, job, attempt=2, points=points(range(2, 5)))  # from step 1
        assert (job.compute_s, job.kept_s, job.stall_s) == (6.0, 4.0, 0.5)
        assert job.step == 4
