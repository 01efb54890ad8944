"""A hostile tenant against the control plane (issue 26), on SQLite and PostgreSQL.

Each test is something a tenant (or a row written around the API) tried, and what must hold:
one poisoned job costs only itself; every path a job names stays in its tenant's own area
and no error tells another tenant's secrets. The worker environment, with real Ray, is in
`test_hostile_tenant_ray.py`.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from contracts.spec import JobSpec
from service import decisions, jobs
from service.db import session_scope
from service.models import Job
from service.scheduler import Scheduler
from service.settings import Settings
from service.states import JobState
from tests.fake_launcher import FakeLauncher


def _spec(name: str, **scaling: Any) -> JobSpec:
    return JobSpec.model_validate(
        {
            "name": name,
            "workload": {"name": "synthetic"},
            "scaling": {"min_workers": 1, "max_workers": 2, **scaling},
        }
    )


def _submit(factory: sessionmaker[Session], spec: JobSpec, owner: str = "good") -> int:
    with session_scope(factory) as s:
        return jobs.create_job(s, spec=spec, owner=owner).id


def _poison(factory: sessionmaker[Session], job_id: int, raw_spec: dict[str, Any]) -> None:
    """Write the job's spec straight into the database, as no API request can."""
    with session_scope(factory) as s:
        s.execute(update(Job).where(Job.id == job_id).values(spec=raw_spec))


def _states(factory: sessionmaker[Session]) -> dict[int, tuple[JobState, str | None]]:
    with session_scope(factory) as s:
        return {j.id: (j.state, j.state_reason) for j in s.query(Job).all()}


def test_poisoned_rows_cost_only_their_own_jobs(
    session_factory: sessionmaker[Session],
    settings: Settings,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    launcher = FakeLauncher({"n0": 8})
    scheduler = Scheduler(session_factory=session_factory, launcher=launcher, settings=settings)
    running = _submit(session_factory, _spec("running"), owner="evil")
    scheduler.run_pass()
    assert _states(session_factory)[running][0] == JobState.STARTING

    # Rows no API request can write: a share of a CPU that overflows the capacity
    # arithmetic, a GPU sliver, a spec that is not one, and a running job's spec broken.
    tiny = _submit(session_factory, _spec("tiny"), owner="evil")
    good = _spec("tiny").model_dump(mode="json")
    _poison(session_factory, tiny, {**good, "scaling": {**good["scaling"],
                                                       "cpus_per_worker": 5e-324}})  # fmt: skip
    sliver = _submit(session_factory, _spec("sliver"), owner="evil")
    _poison(session_factory, sliver, {**good, "scaling": {**good["scaling"], "use_gpu": True,
                                                         "gpus_per_worker": 1e-9}})  # fmt: skip
    garbage = _submit(session_factory, _spec("garbage"), owner="evil")
    _poison(session_factory, garbage, {"name": ["not", "a", "spec"]})
    _poison(session_factory, running, {**good, "strategy": {"kind": "warp-drive"}})
    # And a job whose admission arithmetic raises (a bug no bound foresaw).
    arith = _submit(session_factory, _spec("arith"), owner="evil")
    target = decisions.target_world_size

    def raising_for_arith(spec: JobSpec, *args: Any, **kwargs: Any) -> int:
        if spec.name == "arith":
            raise OverflowError("cannot convert float infinity to integer")
        return target(spec, *args, **kwargs)

    monkeypatch.setattr(decisions, "target_world_size", raising_for_arith)
    # Other tenants' jobs, queued behind all of them.
    others = [_submit(session_factory, _spec(f"ok{i}"), owner="good") for i in range(3)]

    with caplog.at_level(logging.ERROR, logger="elastrain.scheduler"):
        scheduler.run_pass()

    states = _states(session_factory)
    for job_id in others:
        assert states[job_id][0] == JobState.STARTING, states[job_id]
    assert {r.job_id for r in launcher.launches} >= set(others)
    for job_id, field in [
        (tiny, "scaling.cpus_per_worker"),
        (sliver, "scaling.gpus_per_worker"),
        (garbage, "workload"),
        (running, "strategy.kind"),
        (arith, "OverflowError"),
    ]:
        state, reason = states[job_id]
        assert state == JobState.FAILED, (job_id, states[job_id])
        assert reason is not None and field in reason, reason
        assert any(f"job {job_id}:" in r.getMessage() for r in caplog.records), job_id
    # The running job's attempt was ended and its workers released.
    assert any(key.job_id == running for key, _ in launcher.releases)
    # The next pass is an ordinary one.
    scheduler.run_pass()
    assert _states(session_factory) == states
