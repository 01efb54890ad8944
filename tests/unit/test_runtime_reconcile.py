"""What the runtime lets go of when handed the live attempts (`elastrain.workers.runtime.reconcile`),
row by row, and the scheduler's side of it against the fake runtime."""

from __future__ import annotations

import pytest

from elastrain.contracts.runtime import AttemptKey, JobRef, LiveAttempt, Reconcile
from elastrain.workers.runtime.reconcile import (
    HeldAttempt,
    attempts_to_release,
    jobs_to_forget,
    orphan_groups,
)

A1 = AttemptKey(1, 1)
A2 = AttemptKey(2, 3)


def held(key: AttemptKey, name: str = "n", sent_at: float = 10.0) -> HeldAttempt:
    return HeldAttempt(key=key, name=name, sent_at=sent_at)


@pytest.mark.parametrize(
    ("holds", "live", "observed_at", "released"),
    [
        # live under its own name: kept
        ([held(A1)], {A1: LiveAttempt(name="n")}, 20.0, []),
        # not live any more (ended, cancelled, a release call that failed): released
        ([held(A1), held(A2)], {A2: LiveAttempt(name="n")}, 20.0, [A1]),
        # a fresh database knows nothing: everything goes
        ([held(A1), held(A2)], {}, 20.0, [A1, A2]),
        # launched after the database was read (another scheduler's newer launch): kept
        ([held(A1, sent_at=25.0)], {}, 20.0, []),
        # the same key in another database (a restored backup): not this attempt
        ([held(A1, name="old")], {A1: LiveAttempt(name="new")}, 20.0, [A1]),
        # live attempts the runtime does not hold are not its to release
        ([], {A1: LiveAttempt(name="n")}, 20.0, []),
    ],
)
def test_attempts_to_release(
    holds: list[HeldAttempt],
    live: dict[AttemptKey, LiveAttempt],
    observed_at: float,
    released: list[AttemptKey],
) -> None:
    want = Reconcile(attempts=live, observed_at=observed_at)
    assert attempts_to_release(holds, want) == released


@pytest.mark.parametrize(
    ("held_jobs", "keep", "forgotten"),
    [
        ({1, 2}, {1, 2}, set()),  # unfinished (live or between attempts): kept
        ({1, 2}, {2}, {1}),  # job 1 ended: its state goes
        ({1}, set(), {1}),  # a database that never knew job 1
        (set(), {1}, set()),
    ],
)
def test_jobs_to_forget(held_jobs: set[int], keep: set[int], forgotten: set[int]) -> None:
    want = Reconcile(database="db", keep_jobs=frozenset(keep))
    held = {JobRef("db", j) for j in held_jobs}
    assert jobs_to_forget(held, want) == {JobRef("db", j) for j in forgotten}


def test_another_databases_job_is_forgotten_even_under_a_kept_id() -> None:
    """A fresh database's job 1 is not the job 1 whose state the processes hold."""
    want = Reconcile(database="fresh", keep_jobs=frozenset({1}))
    assert jobs_to_forget({JobRef("old", 1), JobRef("fresh", 1)}, want) == {JobRef("old", 1)}


def test_orphan_groups_are_this_namespaces_unowned_live_groups() -> None:
    groups = [
        ("g1", "ns:elastrain-job1-a1-aa", "CREATED"),  # owned by a held attempt
        ("g2", "ns:elastrain-job2-a1-bb", "CREATED"),  # nobody's: removed
        ("g3", "ns:elastrain-job2-a1-bb", "PENDING"),  # a retry of the same, pending
        ("g4", "ns:elastrain-job3-a1-cc", "REMOVED"),  # gone already
        ("g5", "other:elastrain-job2-a1-bb", "CREATED"),  # another service's namespace
        ("g6", "users-own-group", "CREATED"),
    ]
    owned = {"ns:elastrain-job1-a1-aa"}
    assert orphan_groups(groups, owned, prefix="ns:") == [
        ("g2", "ns:elastrain-job2-a1-bb"),
        ("g3", "ns:elastrain-job2-a1-bb"),
    ]
