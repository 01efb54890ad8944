"""What the runtime lets go of when the control plane hands it the live attempts: pure
functions over plain data, table-tested (tests/unit/test_runtime_reconcile.py).

The runtime compares what it holds with what the database says should live, on every
pass, as Kubernetes controllers do; `elastrain.workers.runtime.actor` carries out the answer.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from elastrain.contracts.runtime import AttemptKey, JobRef, Reconcile


@dataclass(frozen=True, kw_only=True, slots=True)
class HeldAttempt:
    """A driver the runtime holds."""

    key: AttemptKey
    name: str
    sent_at: float
    """When the control plane sent its launch (its clock, as `Reconcile.observed_at`)."""


def attempts_to_release(held: Iterable[HeldAttempt], want: Reconcile) -> list[AttemptKey]:
    """The held attempts the control plane no longer wants: absent from its live set
    (unless launched after it read the database), or live under another name (another
    database's attempt with the same number)."""
    doomed = []
    for attempt in held:
        live = want.attempts.get(attempt.key)
        if live is None:
            if attempt.sent_at < want.observed_at:
                doomed.append(attempt.key)
        elif live.name != attempt.name:
            doomed.append(attempt.key)
    return doomed


def jobs_to_forget(held_jobs: Iterable[JobRef], want: Reconcile) -> set[JobRef]:
    """Jobs whose state processes hold although the job is not unfinished any more, or
    of another database (one the control plane no longer uses)."""
    return {
        job for job in held_jobs
        if job.database != want.database or job.job_id not in want.keep_jobs
    }  # fmt: skip


def orphan_groups(
    groups: Iterable[tuple[str, str, str]], owned: set[str], prefix: str
) -> list[tuple[str, str]]:
    """Placement groups (id, name, state) this service made (their name starts with
    `prefix`) that no held attempt owns (by name) and Ray has not removed yet, as (id, name)."""
    return sorted(
        (pg_id, name) for pg_id, name, state in groups
        if name.startswith(prefix) and name not in owned and state != "REMOVED"
    )  # fmt: skip
