"""Two schedulers against one real PostgreSQL never launch the same job twice."""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from elastrain.contracts.spec import JobSpec
from elastrain.service import jobs, lease
from elastrain.service.db import make_engine, make_session_factory, migrate, session_scope
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from tests.fake_launcher import FakeLauncher

N_JOBS = 60


def _submit_many(factory) -> None:  # type: ignore[no-untyped-def]
    spec = JobSpec.model_validate(
        {
            "name": "j",
            "workload": {"name": "synthetic"},
            "scaling": {"min_workers": 1, "max_workers": 1},
        }
    )
    with session_scope(factory) as s:
        for _ in range(N_JOBS):
            jobs.create_job(s, spec=spec)


def _race(schedulers: list[Scheduler], passes: int) -> None:
    barrier = threading.Barrier(len(schedulers))
    errors: list[BaseException] = []

    def run(sched: Scheduler) -> None:
        try:
            for _ in range(passes):
                barrier.wait()
                sched.run_pass()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s,)) for s in schedulers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


@pytest.mark.parametrize("with_lease", [True, False], ids=["lease", "no-lease-row-locks-only"])
def test_two_schedulers_never_launch_a_job_twice(
    pg_database: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, with_lease: bool
) -> None:
    engine = make_engine(pg_database)
    migrate(engine)
    factory = make_session_factory(engine)
    _submit_many(factory)
    if not with_lease:
        # Both act at once, as two holders would if a lease expired mid-pass: admission's
        # row lock and state re-check alone must still prevent a double launch.
        monkeypatch.setattr(lease, "try_acquire", lambda *a, **k: True)
        # Widen the window between reading a job and committing its launch, so the
        # schedulers really do collide on the same rows.
        start_attempt = jobs.start_attempt

        def slow_start_attempt(*args, **kwargs):  # type: ignore[no-untyped-def]
            time.sleep(0.02)
            return start_attempt(*args, **kwargs)

        monkeypatch.setattr(jobs, "start_attempt", slow_start_attempt)
    settings = Settings(database_url=pg_database, storage_path=tmp_path)
    launcher = FakeLauncher({f"n{i}": 8 for i in range(10)})  # room for all 60
    schedulers = [
        Scheduler(session_factory=factory, launcher=launcher, settings=settings, holder=f"s{i}")
        for i in range(2)
    ]
    _race(schedulers, passes=5)
    launched = Counter(r.job_id for r in launcher.launch_calls)
    assert len(launched) == N_JOBS
    assert max(launched.values()) == 1
    with session_scope(factory) as s:
        states = {j.state.value for j in jobs.list_jobs(s, limit=500).items}
        assert states == {"STARTING"}
    engine.dispose()
