"""The REST contract end to end through FastAPI, on SQLite and PostgreSQL.

The scheduler is off: where a test needs a job to be running, it arranges the state in the
database the way the scheduler would (through `set_job_state`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import Engine, event
from sqlalchemy.orm import Session, sessionmaker

from elastrain.contracts.storage import JobStorage
from elastrain.service.db import session_scope
from elastrain.service.jobs import get_job, set_job_state, start_attempt
from elastrain.service.reports import record_checkpoint, record_metrics
from elastrain.service.settings import Settings
from elastrain.service.states import JobState
from tests.factories import spec_dict

Sessions = sessionmaker[Session]


def submit(client: TestClient, **overrides: Any) -> dict[str, Any]:
    response = client.post("/v1/jobs", json=spec_dict(**overrides))
    assert response.status_code == 201, response.text
    body: dict[str, Any] = response.json()
    return body


def run(sessions: Sessions, job_id: int, *, world_size: int = 2) -> None:
    """Move a PENDING job to RUNNING in attempt 1, as the scheduler would."""
    with session_scope(sessions) as s:
        job = get_job(s, job_id)
        start_attempt(s, job, world_size=world_size, driver_name=f"driver-{job_id}-1")
        set_job_state(s, job, JobState.STARTING, reason="admitted", world_size=world_size)
        set_job_state(s, job, JobState.RUNNING, reason="first step")


def finish(sessions: Sessions, job_id: int, state: JobState) -> None:
    """Run a PENDING job, then end it in `state`, through the allowed transitions."""
    run(sessions, job_id)
    with session_scope(sessions) as s:
        set_job_state(s, get_job(s, job_id), state, reason="done")


def test_health_and_docs(client: TestClient) -> None:
    assert client.get("/healthz").json() == {"status": "ok", "database": "ok", "scheduler": False}
    assert client.get("/docs").status_code == 200
    paths = client.get("/openapi.json").json()["paths"]
    for path in [
        "/v1/jobs",
        "/v1/jobs/{job_id}",
        "/v1/jobs/{job_id}/cancel",
        "/v1/jobs/{job_id}/checkpoint",
        "/v1/jobs/{job_id}/events",
        "/v1/jobs/{job_id}/metrics",
        "/v1/jobs/{job_id}/checkpoints",
        "/v1/jobs/{job_id}/logs",
        "/v1/cluster",
        "/healthz",
    ]:
        assert path in paths


def test_submit_returns_the_job_with_defaults(client: TestClient) -> None:
    response = client.post("/v1/jobs", json={"name": "mini", "workload": {"name": "gpt"}})
    assert response.status_code == 201
    job = response.json()
    assert response.headers["location"] == f"/v1/jobs/{job['id']}"
    assert job["state"] == "PENDING"
    assert job["owner"] == "default"
    assert (job["attempt"], job["restarts"], job["step"], job["world_size"]) == (0, 0, 0, None)
    assert job["spec"]["strategy"]["kind"] == "ddp"
    assert job["spec"]["checkpoint"]["keep_last"] == 3
    assert job["max_steps"] == 200
    assert job["created_at"].endswith("Z") or "+00:00" in job["created_at"]
    # The same job again; only its goodput split has moved on (a live job's wall time grows).
    again = client.get(f"/v1/jobs/{job['id']}").json()
    assert again.pop("goodput")["queued_s"] >= job.pop("goodput")["queued_s"]
    assert again == job


def test_get_round_trips_every_field(client: TestClient) -> None:
    job = submit(client, priority=7, labels={"team": "cv", "tier": "gold"})
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert got["priority"] == 7
    assert got["labels"] == {"team": "cv", "tier": "gold"}
    for key in [
        "id", "name", "owner", "spec", "state", "state_reason", "priority", "attempt",
        "restarts", "world_size", "step", "max_steps", "latest_loss", "labels", "created_at",
        "updated_at", "started_at", "finished_at", "last_error",
    ]:  # fmt: skip
        assert key in got


@contextmanager
def recorded_statements(engine: Engine) -> Iterator[list[str]]:
    """Each statement the engine runs (an executemany once), as its first three words
    upper-cased, and "COMMIT" for each commit."""
    statements: list[str] = []

    def record(_conn: Any, _cursor: Any, sql: str, *_args: Any) -> None:
        statements.append(" ".join(sql.split()[:3]).upper())

    def commit(_conn: Any) -> None:
        statements.append("COMMIT")

    event.listen(engine, "before_cursor_execute", record)
    event.listen(engine, "commit", commit)
    try:
        yield statements
    finally:
        event.remove(engine, "before_cursor_execute", record)
        event.remove(engine, "commit", commit)


def test_submit_and_get_cost_a_fixed_few_statements(client: TestClient) -> None:
    """The hot paths stay cheap whatever the job carries: a submit is one transaction of
    one count (the tenant's queue, bounded) and three INSERTs (the job, all its labels, its
    event), and reads nothing back (its answer is the row it wrote); a get by id is one
    SELECT and commits nothing."""
    engine: Engine = client.app.state.engine  # type: ignore[attr-defined]
    labels = {f"key{i}": f"value{i}" for i in range(20)}
    with recorded_statements(engine) as statements:
        job = submit(client, labels=labels)
        submitted = list(statements)
        statements.clear()
        got = client.get(f"/v1/jobs/{job['id']}").json()
        fetched = list(statements)
    assert submitted[0].startswith("SELECT COUNT(*)"), submitted
    assert submitted[1:] == [
        "INSERT INTO JOBS",
        "INSERT INTO JOB_LABELS",
        "INSERT INTO EVENTS",
        "COMMIT",
    ], submitted
    assert len(fetched) == 1 and fetched[0].startswith("SELECT "), fetched
    assert got == {**job, "goodput": got["goodput"]} and job["labels"] == labels


def test_list_filters_and_paginates_newest_first(
    client: TestClient, app_sessions: Sessions
) -> None:
    ids = [
        submit(client, name=f"j{i}", labels={"team": "nlp" if i % 2 else "cv"})["id"]
        for i in range(7)
    ]
    run(app_sessions, ids[0])
    finish(app_sessions, ids[1], JobState.FAILED)

    everything = client.get("/v1/jobs").json()
    assert everything["total"] == 7
    assert [j["id"] for j in everything["items"]] == ids[::-1]

    page = client.get("/v1/jobs", params={"limit": 3, "offset": 3}).json()
    assert (page["total"], page["limit"], page["offset"]) == (7, 3, 3)
    assert [j["id"] for j in page["items"]] == ids[::-1][3:6]

    running = client.get("/v1/jobs", params={"state": "RUNNING"}).json()
    assert [j["id"] for j in running["items"]] == [ids[0]]
    live = client.get("/v1/jobs", params=[("state", "running"), ("state", "FAILED")]).json()
    assert {j["id"] for j in live["items"]} == {ids[0], ids[1]}

    nlp = client.get("/v1/jobs", params={"label": "team:nlp"}).json()
    assert {j["id"] for j in nlp["items"]} == {ids[i] for i in (1, 3, 5)}
    both = client.get("/v1/jobs", params=[("label", "team:nlp"), ("state", "FAILED")]).json()
    assert [j["id"] for j in both["items"]] == [ids[1]]
    assert (
        client.get("/v1/jobs", params=[("label", "team:nlp"), ("label", "x:y")]).json()["total"]
        == 0
    )


def test_list_rejects_bad_filters(client: TestClient) -> None:
    for params in [
        {"limit": 0},
        {"limit": 501},
        {"offset": -1},
        {"state": "SLEEPING"},
        {"label": "nocolon"},
    ]:
        response = client.get("/v1/jobs", params=params)
        assert response.status_code == 422, params
        assert next(iter(params)) in response.json()["message"]


def test_unknown_ids_are_404(client: TestClient) -> None:
    for method, path in [
        ("GET", "/v1/jobs/424242"),
        ("POST", "/v1/jobs/424242/cancel"),
        ("POST", "/v1/jobs/424242/checkpoint"),
        ("GET", "/v1/jobs/424242/events"),
        ("GET", "/v1/jobs/424242/metrics"),
        ("GET", "/v1/jobs/424242/checkpoints"),
        ("GET", "/v1/jobs/424242/logs"),
    ]:
        response = client.request(method, path)
        assert response.status_code == 404, path
        assert response.json() == {"detail": "job 424242 not found"}
    assert client.get("/v1/jobs/99999999999999999999").status_code == 422  # not an int64
    assert client.get("/v1/jobs/abc").status_code == 422


def test_cancel_pending_job_at_once_and_idempotently(client: TestClient) -> None:
    job = submit(client)
    first = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert first.status_code == 200
    assert first.json()["state"] == "CANCELLED"
    assert first.json()["finished_at"] is not None
    again = client.post(f"/v1/jobs/{job['id']}/cancel")
    assert again.status_code == 200
    assert again.json()["state"] == "CANCELLED"
    events = client.get(f"/v1/jobs/{job['id']}/events").json()
    assert [(e["from_state"], e["to_state"]) for e in events] == [
        (None, "PENDING"),
        ("PENDING", "CANCELLED"),
    ]
    assert events[-1]["reason"] == "cancelled by user"


def test_cancel_running_job_is_a_request_for_the_scheduler(
    client: TestClient, app_sessions: Sessions
) -> None:
    job = submit(client)
    run(app_sessions, job["id"])
    for _ in range(2):  # idempotent
        response = client.post(f"/v1/jobs/{job['id']}/cancel")
        assert response.status_code == 202
        body = response.json()
        assert (body["state"], body["cancel_requested"]) == ("RUNNING", True)
    kinds = [e["kind"] for e in client.get(f"/v1/jobs/{job['id']}/events").json()]
    assert kinds.count("cancel_requested") == 1


def test_cancel_finished_job_is_409_with_a_reason(
    client: TestClient, app_sessions: Sessions
) -> None:
    for state in (JobState.SUCCEEDED, JobState.FAILED):
        job = submit(client)
        finish(app_sessions, job["id"], state)
        response = client.post(f"/v1/jobs/{job['id']}/cancel")
        assert response.status_code == 409
        assert state.value in response.json()["detail"]
        assert "already finished" in response.json()["detail"]


def test_checkpoint_request(client: TestClient, app_sessions: Sessions) -> None:
    job = submit(client)
    pending = client.post(f"/v1/jobs/{job['id']}/checkpoint")
    assert pending.status_code == 409
    assert "PENDING" in pending.json()["detail"]
    run(app_sessions, job["id"])
    response = client.post(f"/v1/jobs/{job['id']}/checkpoint")
    assert response.status_code == 202
    assert response.json()["checkpoint_requested"] is True
    with app_sessions() as s:
        assert get_job(s, job["id"]).checkpoint_requested


def test_events_have_the_full_transition_record(client: TestClient, app_sessions: Sessions) -> None:
    job = submit(client)
    run(app_sessions, job["id"], world_size=2)
    events = client.get(f"/v1/jobs/{job['id']}/events").json()
    assert [e["to_state"] for e in events] == ["PENDING", "STARTING", "RUNNING"]
    starting = events[1]
    assert starting["from_state"] == "PENDING"
    assert (starting["world_size_before"], starting["world_size_after"]) == (None, 2)
    assert starting["attempt"] == 1
    assert starting["reason"] == "admitted"
    assert starting["at"]


def test_metrics_flattened_and_since_step(client: TestClient, app_sessions: Sessions) -> None:
    job = submit(client)
    run(app_sessions, job["id"])
    with session_scope(app_sessions) as s:
        points = [{"step": i, "loss": 4.0 - i / 10, "lr": 3e-4} for i in range(1, 11)]
        record_metrics(s, get_job(s, job["id"]), attempt=1, points=points)
    metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()
    assert [m["step"] for m in metrics] == list(range(1, 11))
    assert metrics[0]["loss"] == 3.9 and metrics[0]["lr"] == 3e-4 and metrics[0]["attempt"] == 1
    since = client.get(f"/v1/jobs/{job['id']}/metrics", params={"since_step": 8}).json()
    assert [m["step"] for m in since] == [8, 9, 10]
    got = client.get(f"/v1/jobs/{job['id']}").json()
    assert (got["step"], got["latest_loss"]) == (10, 3.0)
    assert client.get(f"/v1/jobs/{job['id']}/metrics", params={"since_step": -1}).status_code == 422


def test_a_diverged_step_is_stored_and_served_with_nulls(
    client: TestClient, app_sessions: Sessions
) -> None:
    """JSON has no NaN or Infinity (PostgreSQL refuses them in a JSON column): a diverged
    loss must not fail the transaction that stores the report, or the job's metrics stop."""
    job = submit(client)
    run(app_sessions, job["id"])
    points = [{"step": 1, "loss": 2.5}, {"step": 2, "loss": math.nan, "grad_norm": math.inf},
              {"step": 3, "loss": 2.4, "attempt": 99}]  # fmt: skip
    with session_scope(app_sessions) as s:
        record_metrics(s, get_job(s, job["id"]), attempt=1, points=points)
    metrics = client.get(f"/v1/jobs/{job['id']}/metrics").json()
    assert [(m["step"], m["loss"]) for m in metrics] == [(1, 2.5), (2, None), (3, 2.4)]
    assert metrics[1]["grad_norm"] is None
    assert metrics[2]["attempt"] == 1  # the row's own fields win over a reported value
    shaped = client.get(f"/v1/jobs/{job['id']}/metrics", params={"max_points": 2}).json()
    assert [m["step"] for m in shaped] == [1, 3]


def test_checkpoints_newest_first(client: TestClient, app_sessions: Sessions) -> None:
    job = submit(client)
    run(app_sessions, job["id"])
    assert client.get(f"/v1/jobs/{job['id']}/checkpoints").json() == []
    with session_scope(app_sessions) as s:
        row = get_job(s, job["id"])
        for step in (20, 40):
            record_checkpoint(
                s,
                row,
                attempt=1,
                step=step,
                world_size=2,
                path=f"/ck/step_{step}",
                size_bytes=step * 1000,
            )
    checkpoints = client.get(f"/v1/jobs/{job['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints] == [40, 20]
    assert checkpoints[0] == {
        "step": 40,
        "attempt": 1,
        "world_size": 2,
        "bytes": 40000,
        "path": "/ck/step_40",
        "committed_at": checkpoints[0]["committed_at"],
    }


def test_logs_follow_with_offset(client: TestClient, settings: Settings) -> None:
    job = submit(client)
    url = f"/v1/jobs/{job['id']}/logs"
    empty = client.get(url).json()
    assert (empty["text"], empty["files"], empty["attempt"]) == ("", [], None)

    logs = JobStorage.of(settings.storage_path, job["id"]).logs
    logs.mkdir(parents=True)
    (logs / "attempt-1.rank-0.log").write_text("old attempt\n")
    log = logs / "attempt-2.rank-0.log"
    log.write_text("step 1\n")
    first = client.get(url).json()
    assert (first["text"], first["attempt"], first["files"]) == (
        "step 1\n",
        2,
        ["attempt-2.rank-0.log"],
    )
    with log.open("a") as fh:
        fh.write("step 2\n")
    second = client.get(url, params={"offset": first["next_offset"]}).json()
    assert second["text"] == "step 2\n"
    third = client.get(url, params={"offset": second["next_offset"]}).json()
    assert third["text"] == "" and third["next_offset"] == second["next_offset"]
    old = client.get(url, params={"attempt": 1}).json()
    assert old["text"] == "old attempt\n"

    # Two ranks: every line says whose it is, and the cursor tracks both files.
    (logs / "attempt-2.rank-1.log").write_text("r1 a\n")
    both = client.get(url, params={"offset": second["next_offset"]}).json()
    assert both["text"] == "[attempt-2.rank-1] r1 a\n"
    with (logs / "attempt-2.rank-1.log").open("a") as fh:
        fh.write("r1 b\n")
    with log.open("a") as fh:
        fh.write("step 3\n")
    more = client.get(url, params={"offset": both["next_offset"]}).json()
    assert more["text"] == "[attempt-2.rank-0] step 3\n[attempt-2.rank-1] r1 b\n"
    assert client.get(url, params={"offset": "garbage!"}).status_code == 422


def test_cluster_snapshot(client: TestClient, app_sessions: sessionmaker[Session]) -> None:
    from elastrain.service import cluster

    with session_scope(app_sessions) as s:
        assert cluster.current(s).connected is False  # no scheduler has written one yet
    view = cluster.ClusterView(
        connected=True,
        nodes=[
            cluster.NodeView(
                node_id="n1", address="10.0.0.1", alive=True, cpus_total=4, cpus_free=2,
                gpus_total=0, gpus_free=0, jobs=[7],
            )
        ],
        updated_at=123.0,
    )  # fmt: skip
    with session_scope(app_sessions) as s:
        cluster.publish(s, view)  # what the scheduler does on every pass
    body = client.get("/v1/cluster").json()
    assert body["connected"] is True
    assert body["nodes"][0]["node_id"] == "n1" and body["nodes"][0]["jobs"] == [7]


def test_stale_cluster_snapshot_is_not_connected(app_sessions: sessionmaker[Session]) -> None:
    """An API replica whose scheduler died serves the last view, marked disconnected."""
    from elastrain.service import cluster

    with session_scope(app_sessions) as s:
        cluster.publish(s, cluster.ClusterView(connected=True, updated_at=1.0))
    with session_scope(app_sessions) as s:
        assert cluster.current(s).connected is True
        assert cluster.current(s, stale_after_s=-1).connected is False


def test_oversized_body_is_413(client: TestClient) -> None:
    big = spec_dict(workload={"name": "gpt", "params": {"blob": "x" * (2 << 20)}})
    assert client.post("/v1/jobs", json=big).status_code == 413
