"""How an attempt ended, from its ranks' outcomes: pure functions, table-tested
(tests/unit/test_pool.py, tests/unit/test_command.py, tests/unit/test_attempt_phases.py).

Every rank answers its `run` with a `RunOutcome`, or its process died (a `WorkerError` the
driver makes of Ray's error), or it did not let go within the grace after another rank's
failure (`stuck`). One verdict for the attempt: SUCCEEDED, STOPPED (asked to, at a step
boundary) or FAILED with the error that explains it.
"""

from __future__ import annotations

from collections.abc import Sequence

from elastrain.contracts.group import RunOutcome
from elastrain.contracts.messages import DriverStatus, ErrorKind, WorkerError

Outcome = RunOutcome | WorkerError

#: A rank's process died (alone, or with its node).
DIED = frozenset({ErrorKind.PROCESS_DIED, ErrorKind.NODE_DIED})
#: Kinds that follow from another rank's failure rather than explain it.
ECHOES = frozenset({ErrorKind.PEER_LOST, ErrorKind.STUCK})


def verdict(
    outcomes: Sequence[Outcome], *, command: bool
) -> tuple[DriverStatus, WorkerError | None]:
    """The attempt's status and the error that explains a failure (`outcomes` by rank)."""
    errors = [o for o in outcomes if isinstance(o, WorkerError)]
    errors += [o.error for o in outcomes if isinstance(o, RunOutcome) and o.error is not None]
    stopped = any(isinstance(o, RunOutcome) and o.stopped_early for o in outcomes)
    if command and stopped and not any(e.kind in DIED for e in errors):
        # Asked to stop (a resize): a script that exited first broke its peers'
        # collectives, and their exits are echoes of the stop, not failures.
        return DriverStatus.STOPPED, None
    if errors:
        return DriverStatus.FAILED, cause_of(errors)
    if any(isinstance(o, RunOutcome) and o.aborted for o in outcomes):
        return DriverStatus.FAILED, WorkerError(
            type="AttemptAborted", kind=ErrorKind.ABORTED, message="attempt released"
        )
    rank0 = outcomes[0]
    assert isinstance(rank0, RunOutcome)
    return (DriverStatus.STOPPED if rank0.stopped_early else DriverStatus.SUCCEEDED), None


def cause_of(errors: Sequence[WorkerError]) -> WorkerError:
    """The error that explains the failure: a process that died, else an error that is not
    merely a survivor's broken collective (nor a rank stuck behind one), else the first."""
    died = [e for e in errors if e.kind in DIED]
    if died:
        return died[0]
    own = [e for e in errors if e.kind not in ECHOES]
    return (own or list(errors))[0]


def ended_badly(outcome: Outcome) -> bool:
    """Whether the rank's part ended in a way its peers cannot outlive: they are given a
    grace to come back, then given up."""
    return isinstance(outcome, WorkerError) or outcome.error is not None or outcome.aborted


def process_died(
    exc: BaseException, *, rank: int, node_id: str | None, pid: int | None, node_gone: bool
) -> WorkerError:
    """The record of rank `rank`'s process dying (Ray's actor error `exc`); with its node
    when the node's raylet is gone too (`elastrain.workers.runtime.liveness`)."""
    first = (str(exc).splitlines() or [type(exc).__name__])[0]
    return WorkerError(
        type=type(exc).__name__,
        kind=ErrorKind.NODE_DIED if node_gone else ErrorKind.PROCESS_DIED,
        message=f"the process of rank {rank} died: {first[:300]}",
        rank=rank,
        node_id=node_id,
        pid=pid,
    )


def stuck(rank: int) -> WorkerError:
    return WorkerError(
        type="WorkerStuck",
        kind=ErrorKind.STUCK,
        message=f"rank {rank} did not let go in time",
        rank=rank,
    )
