"""The job state machine: every transition, on both databases, through `set_job_state`.

Which edges exist is checked against the decisions that take them in test_decisions.py;
here, that `set_job_state` takes the allowed ones (state, event, timestamps, in one
transaction) and refuses the rest without writing anything.
"""

from __future__ import annotations

import itertools

import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.spec import JobSpec
from elastrain.service.db import session_scope
from elastrain.service.jobs import create_job, get_job, list_events, set_job_state
from elastrain.service.models import Event
from elastrain.service.states import ALLOWED, TERMINAL, IllegalTransition, JobState, can_transition
from tests.factories import spec_dict

ALL_PAIRS = list(itertools.product(JobState, JobState))
LIVE = [s for s in JobState if not s.is_terminal]


def _new_job(factory: sessionmaker[Session], state: JobState = JobState.PENDING) -> int:
    with session_scope(factory) as s:
        job = create_job(s, spec=JobSpec.model_validate(spec_dict()))
        if state != JobState.PENDING:
            # Arrange the starting state directly: what is under test is the next move.
            job.state = state
        return job.id


def _event_count(session: Session, job_id: int) -> int:
    return session.scalar(select(func.count()).where(Event.job_id == job_id)) or 0


def test_terminal_states_are_exactly_succeeded_failed_cancelled() -> None:
    assert {s for s in JobState if s.is_terminal} == {
        JobState.SUCCEEDED,
        JobState.FAILED,
        JobState.CANCELLED,
    }
    assert TERMINAL.isdisjoint(s for s in JobState if s.is_active)
    for state in TERMINAL:
        assert ALLOWED[state] == frozenset(), f"{state} must be final"


@pytest.mark.parametrize("state", LIVE, ids=[s.value for s in LIVE])
def test_every_live_state_can_be_cancelled_and_failed(state: JobState) -> None:
    assert can_transition(state, JobState.CANCELLED)
    # A queued job waits, however big, for the cluster to hold it; it fails only when the
    # scheduler cannot decide about it at all (decisions.give_up: a poisoned row).
    assert can_transition(state, JobState.FAILED)


def test_lifecycle_shape() -> None:
    # queued -> gang-admitted -> running <-> degraded -> terminal
    assert can_transition(JobState.PENDING, JobState.STARTING)
    assert not can_transition(JobState.PENDING, JobState.RUNNING)
    assert can_transition(JobState.RUNNING, JobState.RECOVERING)
    assert can_transition(JobState.RECOVERING, JobState.RUNNING)
    assert can_transition(JobState.RUNNING, JobState.RESIZING)
    assert can_transition(JobState.RESIZING, JobState.RUNNING)
    assert can_transition(JobState.RUNNING, JobState.SUCCEEDED)


def test_every_transition_on_the_database(session_factory: sessionmaker[Session]) -> None:
    """Allowed moves write the state and one event; illegal ones raise and write nothing."""
    for src, dst in ALL_PAIRS:
        job_id = _new_job(session_factory, src)
        with session_factory() as s:
            job = get_job(s, job_id)
            before = _event_count(s, job_id)
            if can_transition(src, dst):
                event = set_job_state(s, job, dst, reason="test", world_size=2)
                s.commit()
                assert (event.from_state, event.to_state) == (src.value, dst.value)
                assert get_job(s, job_id).state == dst
                assert _event_count(s, job_id) == before + 1
            else:
                with pytest.raises(IllegalTransition) as info:
                    set_job_state(s, job, dst, reason="test")
                assert (info.value.from_state, info.value.to_state) == (src, dst)
                s.rollback()
                assert get_job(s, job_id).state == src
                assert _event_count(s, job_id) == before


def test_state_and_event_share_one_transaction(session_factory: sessionmaker[Session]) -> None:
    job_id = _new_job(session_factory)
    with session_factory() as s:
        job = get_job(s, job_id)
        set_job_state(s, job, JobState.STARTING, reason="admitted", world_size=2)
        s.flush()  # written, not committed
        s.rollback()
    with session_factory() as s:
        assert get_job(s, job_id).state == JobState.PENDING
        assert [e.to_state for e in list_events(s, job_id)] == ["PENDING"]

    with session_scope(session_factory) as s:
        set_job_state(s, get_job(s, job_id), JobState.STARTING, reason="admitted", world_size=2)
    with session_factory() as s:
        events = list_events(s, job_id)
        assert [(e.from_state, e.to_state) for e in events] == [
            (None, "PENDING"),
            ("PENDING", "STARTING"),
        ]
        assert (events[-1].world_size_before, events[-1].world_size_after) == (None, 2)
        assert events[-1].reason == "admitted"


def test_timestamps_and_world_size_follow_the_transitions(
    session_factory: sessionmaker[Session],
) -> None:
    job_id = _new_job(session_factory)
    for dst, size in [
        (JobState.STARTING, 2),
        (JobState.RUNNING, None),
        (JobState.RECOVERING, 1),
        (JobState.RUNNING, None),
        (JobState.SUCCEEDED, None),
    ]:
        with session_scope(session_factory) as s:
            set_job_state(s, get_job(s, job_id), dst, reason=f"to {dst.value}", world_size=size)
    with session_factory() as s:
        job = get_job(s, job_id)
        assert job.state.is_terminal
        assert job.world_size == 1
        assert job.started_at is not None and job.finished_at is not None
        assert job.started_at <= job.finished_at  # aware datetimes on both databases
        sizes = [(e.world_size_before, e.world_size_after) for e in list_events(s, job_id)[1:]]
        assert sizes == [(None, 2), (2, 2), (2, 1), (1, 1), (1, 1)]
        with pytest.raises(IllegalTransition):
            set_job_state(s, job, JobState.RUNNING, reason="zombie")
