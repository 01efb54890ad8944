"""A hostile tenant against the control plane (issue 26), on SQLite and PostgreSQL.

Each test is something a tenant (or a row written around the API) tried, and what must hold:
one poisoned job costs only itself; every path a job names stays in its tenant's own area
and no error tells another tenant's secrets. The worker environment, with real Ray, is in
`test_hostile_tenant_ray.py`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr
from sqlalchemy import update
from sqlalchemy.orm import Session, sessionmaker

from elastrain.api.main import create_app
from elastrain.contracts.spec import JobSpec
from elastrain.service import admission, jobs
from elastrain.service.db import session_scope
from elastrain.service.models import Job
from elastrain.service.scheduler import Scheduler
from elastrain.service.settings import Settings
from elastrain.service.states import JobState
from tests.factories import spec_dict
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
    target = admission.target_world_size

    def raising_for_arith(spec: JobSpec, *args: Any, **kwargs: Any) -> int:
        if spec.name == "arith":
            raise OverflowError("cannot convert float infinity to integer")
        return target(spec, *args, **kwargs)

    monkeypatch.setattr(admission, "target_world_size", raising_for_arith)
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


# -- paths: every one a job names stays in its tenant's own area -----------------------------

ADMIN = "operator-admin-token-0123456789"


@pytest.fixture
def tenants(settings: Settings) -> Iterator[tuple[TestClient, dict[str, dict[str, str]]]]:
    """The API with auth on and two tenants: their `Authorization` headers by name."""
    secured = settings.model_copy(update={"api_token": SecretStr(ADMIN)})
    with TestClient(create_app(secured, start_scheduler=False)) as client:
        headers = {}
        for tenant in ("alice", "bob"):
            made = client.post(
                "/v1/tokens", json={"tenant": tenant}, headers={"Authorization": f"Bearer {ADMIN}"}
            )
            headers[tenant] = {"Authorization": f"Bearer {made.json()['token']}"}
        yield client, headers


def _gpt(**params: Any) -> dict[str, Any]:
    base = {"seq_len": 16, "token_dtype": "uint16", "vocab_size": 256}
    return spec_dict(name="paths", workload={"name": "gpt", "params": {**base, **params}})


def test_a_tenant_names_only_its_own_and_shared_data(
    tenants: tuple[TestClient, dict[str, dict[str, str]]], settings: Settings
) -> None:
    client, headers = tenants
    storage = settings.storage_path
    tokens = bytes(range(256)) * 8  # 1024 uint16 ids
    for folder in ("data/alice", "data/bob", "shared", "jobs/7/logs", "packages/ab12"):
        (storage / folder).mkdir(parents=True, exist_ok=True)
    (storage / "data/alice/mine.bin").write_bytes(tokens)
    (storage / "data/bob/secret.bin").write_bytes(tokens + b"\0")  # 2049 bytes: odd
    (storage / "shared/corpus.bin").write_bytes(tokens)
    (storage / "jobs/7/logs/attempt-001-rank-0.log").write_bytes(tokens)
    (storage / "packages/ab12/manifest.json").write_bytes(tokens)
    (storage / "data/alice/to-bob.bin").symlink_to(storage / "data/bob/secret.bin")
    (storage / "data/alice/to-jobs").symlink_to(storage / "jobs")

    def submit(**params: Any) -> tuple[int, str]:
        response = client.post("/v1/jobs", json=_gpt(**params), headers=headers["alice"])
        return response.status_code, response.json().get("message", "")

    assert submit(data_path="mine.bin")[0] == 201
    assert submit(data_path="shared/corpus.bin")[0] == 201
    assert submit(data_path=str(storage / "data/alice/mine.bin"))[0] == 201
    refused = {
        path: submit(data_path=path)
        for path in [
            "../bob/secret.bin",
            str(storage / "data/bob/secret.bin"),  # exists, another tenant's
            str(storage / "data/bob/nothing.bin"),  # does not exist, another tenant's
            str(storage / "jobs/7/logs/attempt-001-rank-0.log"),  # a job's folder
            str(storage / "packages/ab12/manifest.json"),  # the package store
            "to-bob.bin",  # a link out of the area
            "to-jobs/7/logs/attempt-001-rank-0.log",
            "/etc/passwd",
            "shared/../data/bob/secret.bin",
        ]
    }
    for path, (status, message) in refused.items():
        assert status == 422, (path, message)
        assert message.startswith("workload.params.data_path:"), message
        # Nothing about the server's paths, nor whether or how big another's file is.
        assert str(storage) not in message.replace(path, ""), message
        assert "2049" not in message and "bytes" not in message, message
        assert "does not exist" not in message, message
    # Bob's existing file and a missing one are refused in the same words.
    same = {
        m.replace(p, "PATH") for p, (_, m) in refused.items() if "data/bob/" in p and p[0] == "/"
    }
    assert len(same) == 1, same
    # In her own area, a missing file is named as missing, without the server's path.
    status, message = submit(data_path="missing.bin")
    assert status == 422 and "does not exist in your data area" in message
    assert str(storage) not in message


def test_the_launch_checks_the_path_again_and_hands_it_over_from_the_root(
    tenants: tuple[TestClient, dict[str, dict[str, str]]], settings: Settings
) -> None:
    """A file that passed at submit and became a link to another tenant's data before the
    launch fails its job; the workers get paths relative to the storage root."""
    client, headers = tenants
    storage = settings.storage_path
    for folder in ("data/alice", "data/bob"):
        (storage / folder).mkdir(parents=True)
    (storage / "data/alice/a.bin").write_bytes(bytes(range(256)) * 8)
    (storage / "data/alice/b.bin").write_bytes(bytes(range(256)) * 8)
    (storage / "data/bob/secret.bin").write_bytes(bytes(range(256)) * 8)
    ok = client.post("/v1/jobs", json=_gpt(data_path="a.bin"), headers=headers["alice"])
    swapped = client.post("/v1/jobs", json=_gpt(data_path="b.bin"), headers=headers["alice"])
    assert ok.status_code == swapped.status_code == 201
    (storage / "data/alice/b.bin").unlink()
    (storage / "data/alice/b.bin").symlink_to(storage / "data/bob/secret.bin")

    launcher = FakeLauncher({"n0": 8})
    factory = client.app.state.session_factory  # type: ignore[attr-defined]
    Scheduler(session_factory=factory, launcher=launcher, settings=settings).run_pass()
    launched = {r.job_id: r.spec.workload.params["data_path"] for r in launcher.launches}
    assert launched == {ok.json()["id"]: "data/alice/a.bin"}
    failed = client.get(f"/v1/jobs/{swapped.json()['id']}", headers=headers["alice"]).json()
    assert failed["state"] == "FAILED"
    assert "outside your data area" in failed["state_reason"], failed
    assert str(storage) not in failed["state_reason"]


# -- the operator's secrets and files --------------------------------------------------------


def test_the_admin_token_may_come_from_a_file(settings: Settings, tmp_path: Path) -> None:
    secret = tmp_path / "run-secrets" / "elastrain_token"
    secret.parent.mkdir()
    secret.write_text(ADMIN + "\n")  # as `docker secret` / Kubernetes mount it
    from_file = Settings(
        database_url=settings.database_url,
        storage_path=settings.storage_path,
        api_token_file=secret,
    )
    with TestClient(create_app(from_file, start_scheduler=False)) as client:
        assert client.get("/v1/jobs").status_code == 401
        me = client.get("/v1/me", headers={"Authorization": f"Bearer {ADMIN}"})
        assert me.status_code == 200 and me.json()["admin"] is True
    with pytest.raises(ValueError, match="not both"):
        Settings(api_token=SecretStr(ADMIN), api_token_file=secret)


def test_the_database_file_and_storage_are_created_private(tmp_path: Path) -> None:
    fresh = Settings(
        database_url=f"sqlite:///{tmp_path / 'home' / 'db' / 'elastrain.db'}",
        storage_path=tmp_path / "home" / "storage",
    )
    with TestClient(create_app(fresh, start_scheduler=False)) as client:
        assert client.get("/healthz").status_code == 200
    for made in ("home", "home/db", "home/storage"):
        assert (tmp_path / made).stat().st_mode & 0o777 == 0o700, made
    assert (tmp_path / "home/db/elastrain.db").stat().st_mode & 0o777 == 0o600


# -- the API's reference pages ------------------------------------------------------------------


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_api_docs_load_only_local_assets_under_the_csp(client: TestClient, page: str) -> None:
    import re

    response = client.get(page)
    assert response.status_code == 200
    csp = response.headers["Content-Security-Policy"]
    assert "script-src 'self'" in csp and "unsafe-eval" not in csp and "http" not in csp
    html = response.text
    assert "http://" not in html and "https://" not in html  # no CDN
    assert "<script>" not in html  # no inline script (the CSP would refuse it)
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', html)
    assert assets
    for asset in assets:
        served = client.get(asset)
        assert served.status_code == 200 and len(served.content) > 100, asset
