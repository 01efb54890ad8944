"""What one tenant's jobs can put into shared state is bounded (issue 45, item 5), on the
real API with auth, on SQLite and PostgreSQL: a tenant's queue stops at its limit with a
429 while another tenant submits as usual; a job's logs folder flooded with files and a
huge sparse log answers one `GET .../logs` within its file and byte bounds, quickly."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from elastrain.api.main import create_app
from elastrain.api.routes.jobs import TRUNCATED_AT
from elastrain.contracts.storage import JobStorage
from elastrain.service.db import session_scope
from elastrain.service.models import Metric
from elastrain.service.settings import Settings
from tests.factories import spec_dict

ADMIN = "admin-token-for-the-bounds-tests-0123456789"


@pytest.fixture
def api(settings: Settings) -> Iterator[tuple[TestClient, Settings, dict[str, dict[str, str]]]]:
    bounded = settings.model_copy(
        update={
            "api_token": SecretStr(ADMIN),
            "max_queued_jobs_per_tenant": 3,
            "log_files_per_job": 32,
            "log_bytes_per_response": 64 * 1024,
            "metric_bytes_per_response": 256 * 1024,
        }
    )
    with TestClient(create_app(bounded)) as client:
        admin = {"Authorization": f"Bearer {ADMIN}"}
        headers = {"admin": admin}
        for tenant in ("a", "b"):
            made: dict[str, Any] = client.post(
                "/v1/tokens", json={"tenant": tenant, "name": "t"}, headers=admin
            ).json()
            headers[tenant] = {"Authorization": f"Bearer {made['token']}"}
        yield client, bounded, headers


def test_a_tenants_queue_is_bounded_and_the_other_tenant_submits_as_usual(api) -> None:  # type: ignore[no-untyped-def]
    client, _, headers = api
    for i in range(3):
        made = client.post("/v1/jobs", json=spec_dict(name=f"a{i}"), headers=headers["a"])
        assert made.status_code == 201, made.text
    refused = client.post("/v1/jobs", json=spec_dict(name="a3"), headers=headers["a"])
    assert refused.status_code == 429, refused.text
    assert "ELASTRAIN_MAX_QUEUED_JOBS_PER_TENANT" in refused.json()["detail"]
    assert int(refused.headers["Retry-After"]) > 0
    assert client.get("/v1/jobs", headers=headers["a"]).json()["total"] == 3  # nothing stored
    other = client.post("/v1/jobs", json=spec_dict(name="b0"), headers=headers["b"])
    assert other.status_code == 201, other.text


def test_a_flooded_logs_folder_answers_within_its_bounds(api) -> None:  # type: ignore[no-untyped-def]
    client, settings, headers = api
    job = client.post("/v1/jobs", json=spec_dict(name="noisy"), headers=headers["a"]).json()
    logs = JobStorage.of(settings.storage_path, job["id"]).logs
    logs.mkdir(parents=True)
    # What the job's code wrote: the rank's own log, 5,000 more log files, a 64 GiB sparse one.
    (logs / "attempt-001-rank-0.log").write_text("step 1 loss 2.0\n" * 10)
    for i in range(5000):
        (logs / f"attempt-001-junk-{i:05d}.log").write_text("x\n")
    with open(logs / "attempt-001-huge.log", "wb") as f:
        f.truncate(64 << 30)
    started = time.monotonic()
    answer = client.get(f"/v1/jobs/{job['id']}/logs", headers=headers["a"])
    took = time.monotonic() - started
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert len(body["files"]) == 32 and body["files"][0] == "attempt-001-rank-0.log"
    assert len(body["text"].encode()) <= 68 * 1024  # 64 KiB read, and the rank tags
    assert "ELASTRAIN_LOG_FILES_PER_JOB" in body["text"].splitlines()[0]
    assert "[attempt-001-rank-0] step 1 loss 2.0" in body["text"]
    # JSON writes a NUL of the sparse file as \u0000: at most 6 bytes a byte read.
    assert len(answer.content) < 6 * 68 * 1024 and took < 10, (len(answer.content), took)
    # The next page goes on from where this one stopped, without the note again.
    more = client.get(
        f"/v1/jobs/{job['id']}/logs", params={"offset": body["next_offset"]}, headers=headers["a"]
    ).json()
    assert "ELASTRAIN_LOG_FILES_PER_JOB" not in more["text"]
    os.unlink(logs / "attempt-001-huge.log")


def test_a_jobs_metrics_answer_within_their_byte_bound_and_page_on(api) -> None:  # type: ignore[no-untyped-def]
    client, _, headers = api
    job = client.post("/v1/jobs", json=spec_dict(name="fat"), headers=headers["a"]).json()
    # Rows as a job stored them before the per-point bounds: 10 KiB of made-up names each.
    fat = {f"name-{i:04d}": float(i) for i in range(500)}
    with session_scope(client.app.state.session_factory) as s:
        s.add_all(
            Metric(job_id=job["id"], step=step, attempt=1, values={"loss": 1.0, **fat})
            for step in range(1, 201)
        )
    url = f"/v1/jobs/{job['id']}/metrics"
    first = client.get(url, headers=headers["a"])
    assert first.status_code == 200, first.text
    assert len(first.content) <= 256 * 1024
    rows = first.json()
    assert rows and rows[0]["step"] == 1
    next_step = int(first.headers[TRUNCATED_AT])
    assert next_step == rows[-1]["step"] + 1
    seen = [r["step"] for r in rows]
    while TRUNCATED_AT in first.headers:  # page on with since_step, as the header says
        first = client.get(url, params={"since_step": next_step}, headers=headers["a"])
        assert len(first.content) <= 256 * 1024
        seen += [r["step"] for r in first.json()]
        next_step = int(first.headers.get(TRUNCATED_AT, 0))
    assert seen == list(range(1, 201))
    downsampled = client.get(url, params={"max_points": 100}, headers=headers["a"])
    assert downsampled.status_code == 200 and len(downsampled.content) <= 256 * 1024
