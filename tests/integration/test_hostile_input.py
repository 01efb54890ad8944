"""Hostile input, on SQLite and PostgreSQL: every one is a 4xx in the project's error shape
naming what is wrong, nothing is stored by a request that fails, and the service keeps
answering everyone else afterwards."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.contracts.storage import JobStorage
from elastrain.service.settings import Settings
from tests.factories import spec_dict


def total_jobs(client: TestClient) -> int:
    response = client.get("/v1/jobs")
    assert response.status_code == 200, response.text
    total: int = response.json()["total"]
    return total


def refused(response: Any, status: int, field: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    text = body.get("message") or body["detail"]
    assert field in text, text


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = {"a": value}
    return value


@pytest.mark.parametrize(
    ("params", "why"),
    [
        (nested(17), "nests deeper than 16 levels"),
        ({"blob": "x" * 70_000}, "the limit is 65536"),
        ({"n": 2**64}, "does not fit in 64 bits"),
        ({"s": "a\x00b"}, "contains NUL"),
    ],
)
def test_params_out_of_bounds_are_refused_and_not_stored(
    client: TestClient, params: Any, why: str
) -> None:
    response = client.post("/v1/jobs", json=spec_dict(workload={"name": "gpt", "params": params}))
    refused(response, 422, "workload.params")
    assert why in response.json()["message"]
    assert total_jobs(client) == 0  # and listing still works for everyone


@pytest.mark.parametrize("depth", [200, 5000])
def test_json_nested_past_the_parser_is_a_422(client: TestClient, depth: int) -> None:
    raw = '{"name": "x", "workload": {"name": "gpt", "params": {"a": ' + "[" * depth
    raw += "]" * depth + "}}}"
    response = client.post(
        "/v1/jobs", content=raw.encode(), headers={"Content-Type": "application/json"}
    )
    # pydantic's parser stops at its own depth limit (422); deeper still, FastAPI's JSON
    # fallback gives up with a 400 that names the body. Never a 500, never stored.
    assert response.status_code in (400, 422), response.text
    assert "body" in response.text
    assert total_jobs(client) == 0


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_numbers_are_refused(client: TestClient, literal: str) -> None:
    body = spec_dict(workload={"name": "gpt", "params": {"lr": 1.0}})
    raw = json.dumps(body).replace("1.0", literal)
    response = client.post("/v1/jobs", content=raw, headers={"Content-Type": "application/json"})
    assert response.status_code == 422, response.text
    assert total_jobs(client) == 0


def test_a_chunked_body_past_the_limit_is_413_and_stores_nothing(client: TestClient) -> None:
    # No Content-Length: the size is only known as the body streams in.
    filler = json.dumps(spec_dict(workload={"name": "gpt", "params": {"b": "x" * (20 << 20)}}))

    def chunks() -> Iterator[bytes]:
        data = filler.encode()
        for i in range(0, len(data), 1 << 16):
            yield data[i : i + (1 << 16)]

    response = client.post(
        "/v1/jobs", content=chunks(), headers={"Content-Type": "application/json"}
    )
    refused(response, 413, "request body too large")
    assert total_jobs(client) == 0


def test_a_declared_body_past_the_limit_is_413(client: TestClient) -> None:
    big = spec_dict(workload={"name": "gpt", "params": {"blob": "x" * (2 << 20)}})
    refused(client.post("/v1/jobs", json=big), 413, "request body too large")


@pytest.mark.parametrize(
    ("url", "field"),
    [
        ("/v1/jobs?offset=" + str(2**70), "offset"),
        ("/v1/jobs?offset=" + str(2**31), "offset"),
        ("/v1/jobs?limit=" + str(2**70), "limit"),
        ("/v1/jobs/{id}/metrics?since_step=" + str(2**64), "since_step"),
        ("/v1/jobs/{id}/logs?attempt=" + str(2**64), "attempt"),
        ("/v1/jobs/" + str(2**64), "job_id"),
        ("/v1/jobs/{id}/logs?offset=%C2%B2", "offset"),  # "²": isdigit() but not int()
        ("/v1/jobs/{id}/logs?offset=%D9%A3", "offset"),  # Arabic-Indic three
        ("/v1/jobs/{id}/logs?offset=%E2%80%AE", "offset"),
        ("/v1/jobs?" + "&".join(f"label=k{i}:v" for i in range(100)), "label"),
        ("/v1/jobs?label=nocolon", "label"),
        ("/v1/jobs?state=EXPLODED", "state"),
    ],
)
def test_numbers_cursors_and_filters_out_of_range_are_422(
    client: TestClient, url: str, field: str
) -> None:
    job_id = client.post("/v1/jobs", json=spec_dict()).json()["id"]
    refused(client.get(url.replace("{id}", str(job_id))), 422, field)


def test_a_huge_position_in_a_logs_cursor_is_refused(client: TestClient) -> None:
    import base64

    job_id = client.post("/v1/jobs", json=spec_dict()).json()["id"]
    cursor = base64.urlsafe_b64encode(json.dumps({"a.log": 2**80}).encode()).decode()
    refused(client.get(f"/v1/jobs/{job_id}/logs", params={"offset": cursor}), 422, "offset")


@pytest.mark.parametrize(
    "overrides",
    [
        {"name": "nul\x00name"},
        {"name": "\x1b[2J\x1b[31mred"},
        {"name": "bidi\u202eevil"},
        {"labels": {"team": "a\x1b]0;title\x07"}},
        {"labels": {"team": "line\nbreak"}},
    ],
)
def test_control_characters_in_names_and_labels_are_refused(
    client: TestClient, overrides: dict[str, Any]
) -> None:
    response = client.post("/v1/jobs", json=spec_dict(**overrides))
    refused(response, 422, "control characters")
    assert total_jobs(client) == 0


def test_logs_never_follow_links_out_of_the_jobs_folder(
    client: TestClient, settings: Settings
) -> None:
    job_id = client.post("/v1/jobs", json=spec_dict()).json()["id"]
    logs = JobStorage.of(settings.storage_path, job_id).logs
    logs.mkdir(parents=True)
    secret = settings.storage_path / "secret.txt"
    secret.write_text("the API's database\n")
    (logs / "attempt-001-rank-0.log").write_text("step 1 loss 2.0\n")
    os.symlink(secret, logs / "attempt-001-rank-1.log")  # a link to a file
    (settings.storage_path / "elsewhere").mkdir()
    (settings.storage_path / "elsewhere" / "attempt-001-rank-2.log").write_text("other job\n")
    os.symlink(settings.storage_path / "elsewhere", logs / "linked")  # a link to a folder
    chunk = client.get(f"/v1/jobs/{job_id}/logs").json()
    assert chunk["files"] == ["attempt-001-rank-0.log"]
    assert chunk["text"] == "step 1 loss 2.0\n"
    # Nor when the logs folder itself is a link.
    other = client.post("/v1/jobs", json=spec_dict()).json()["id"]
    other_logs = JobStorage.of(settings.storage_path, other).logs
    other_logs.parent.mkdir(parents=True)
    os.symlink(logs, other_logs)
    assert client.get(f"/v1/jobs/{other}/logs").json()["files"] == []


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example", 400),  # DNS rebinding: a foreign name that resolves to loopback
        ("evil.example:8000", 400),
        ("localhost:8000", 200),
        ("127.0.0.1", 200),
        ("[::1]:8000", 200),
    ],
)
def test_only_configured_hosts_are_answered(settings: Settings, host: str, status: int) -> None:
    local = settings.model_copy(update={"allowed_hosts": ["localhost", "127.0.0.1", "::1"]})
    with TestClient(create_app(local)) as c:
        response = c.get("/v1/jobs", headers={"Host": host})
        assert response.status_code == status, response.text
        if status == 400:
            assert "ELASTRAIN_ALLOWED_HOSTS" in response.json()["detail"]


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"Sec-Fetch-Site": "cross-site"}, 403),
        ({"Sec-Fetch-Site": "same-site"}, 403),
        ({"Origin": "http://evil.example"}, 403),
        ({"Origin": "null"}, 403),
        ({"Sec-Fetch-Site": "same-origin", "Origin": "http://testserver"}, 200),
        ({"Origin": "http://testserver"}, 200),
        ({}, 200),  # not a browser (curl, the CLI)
    ],
)
def test_cross_site_state_changes_are_refused(
    client: TestClient, headers: dict[str, str], status: int
) -> None:
    job_id = client.post("/v1/jobs", json=spec_dict()).json()["id"]
    response = client.post(f"/v1/jobs/{job_id}/cancel", headers=headers)
    assert response.status_code == status, response.text
    state = client.get(f"/v1/jobs/{job_id}").json()["state"]
    assert state == ("PENDING" if status == 403 else "CANCELLED")


def test_security_headers(client: TestClient) -> None:
    page = client.get("/")
    api = client.get("/v1/jobs")
    for response in (page, api):
        assert response.headers["X-Content-Type-Options"] == "nosniff"
        assert response.headers["X-Frame-Options"] == "DENY"
        assert response.headers["Referrer-Policy"] == "no-referrer"
    assert "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert "frame-ancestors 'none'" in page.headers["Content-Security-Policy"]
    assert api.headers["Content-Security-Policy"].startswith("default-src 'none'")


def test_a_job_stored_before_a_bound_existed_stays_readable_and_cancellable(
    client: TestClient, app_sessions: Any, settings: Settings
) -> None:
    """Bounds apply to what comes in, not to what the database already holds: a job
    accepted by an older version (a terminal escape in its name, params nested deeper than
    the limit now allows) is still listed, shown, scheduled and cancellable."""
    from elastrain.service.db import session_scope
    from elastrain.service.scheduler import Scheduler
    from tests.fake_launcher import FakeLauncher

    accepted = client.post("/v1/jobs", json=spec_dict(name="ok")).json()
    with session_scope(app_sessions) as s:
        from sqlalchemy import update

        from elastrain.service.models import Job

        s.execute(
            update(Job)
            .where(Job.id == accepted["id"])
            .values(spec={**accepted["spec"], "name": "old\x1b[31m",
                          "workload": {"name": "gpt", "entrypoint": None, "params": nested(20)}})
        )  # fmt: skip
    assert client.get("/v1/jobs").json()["total"] == 1
    assert client.get(f"/v1/jobs/{accepted['id']}").status_code == 200
    Scheduler(session_factory=app_sessions, launcher=FakeLauncher({}), settings=settings).run_pass()
    cancelled = client.post(f"/v1/jobs/{accepted['id']}/cancel")
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "CANCELLED"
