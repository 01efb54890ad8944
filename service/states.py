"""The job state machine: states, terminal flags and the allowed transitions.

The only writer of a job's state is `elastrain.service.jobs.set_job_state`, which checks a
transition against `ALLOWED` before it writes anything.
"""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    PENDING = "PENDING"  # queued, waiting for gang admission
    STARTING = "STARTING"  # admitted; the driver is launching the worker group
    RUNNING = "RUNNING"  # training steps are being taken
    RECOVERING = "RECOVERING"  # lost workers/nodes; restoring from the latest checkpoint
    RESIZING = "RESIZING"  # checkpointing to relaunch at another world size (grow back)
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL

    @property
    def is_active(self) -> bool:
        """A driver may be running for the job (it holds cluster resources)."""
        return self in ACTIVE


TERMINAL = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
ACTIVE = frozenset({JobState.STARTING, JobState.RUNNING, JobState.RECOVERING, JobState.RESIZING})

_S = JobState
#: Exactly the moves `elastrain.service.decisions.decide` makes (tests/unit/test_decisions.py checks
#: both ways), so this table reads as the lifecycle.
ALLOWED: dict[JobState, frozenset[JobState]] = {
    # PENDING -> FAILED: only a job the scheduler cannot decide about (decisions.give_up).
    _S.PENDING: frozenset({_S.STARTING, _S.CANCELLED, _S.FAILED}),
    _S.STARTING: frozenset({_S.RUNNING, _S.RECOVERING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    _S.RUNNING: frozenset({_S.RECOVERING, _S.RESIZING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    # RECOVERING -> SUCCEEDED: the relaunched attempt found a checkpoint at max_steps and
    # had nothing left to do. A relaunch stays RECOVERING until its first step.
    _S.RECOVERING: frozenset({_S.RUNNING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    # RESIZING -> SUCCEEDED: the stop arrived at the very last step.
    _S.RESIZING: frozenset({_S.RUNNING, _S.RECOVERING, _S.SUCCEEDED, _S.FAILED, _S.CANCELLED}),
    _S.SUCCEEDED: frozenset(),
    _S.FAILED: frozenset(),
    _S.CANCELLED: frozenset(),
}


class IllegalTransition(Exception):
    def __init__(self, job_id: int, from_state: JobState, to_state: JobState) -> None:
        super().__init__(f"job {job_id}: illegal transition {from_state.value} -> {to_state.value}")
        self.job_id = job_id
        self.from_state = from_state
        self.to_state = to_state


def can_transition(from_state: JobState, to_state: JobState) -> bool:
    return to_state in ALLOWED[from_state]
