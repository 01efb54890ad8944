"""The control plane's own failures while jobs run: PostgreSQL restarted under it, and the
service kill -9'd in the middle of storing a checkpoint commit. Real PostgreSQL, a real
multi-node Ray cluster, the service as a real process.

Neither may lose a job, launch one twice, or store a report twice or not at all.
"""

from __future__ import annotations

import signal
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from ray.cluster_utils import Cluster

from elastrain.checkpoints.catalog import list_committed
from elastrain.contracts.storage import JobStorage
from tests.e2e.server import ServerHandle, serve_argv, start_server
from tests.integration.ray_service import cancel_at_step, tiny_gpt_spec, wait_for, wait_terminal
from tests.pg_server import PrivatePostgres, private_postgres
from tests.waiting import wait_until

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

STEPS = 120
SPEC = tiny_gpt_spec(
    "cp-chaos",
    scaling={"min_workers": 2, "max_workers": 2, "cpus_per_worker": 1},
    training={"max_steps": STEPS, "micro_batch_size": 2},
    checkpoint={"every_steps": 10, "keep_last": 20},
)

#: The PostgreSQL test's job trains until cancelled: it must still be training while the
#: database is down, however far the service's view of it lagged when the stop began (a
#: 120-step job once finished before the stop did, under CI load). Every checkpoint kept.
ENDLESS = {
    **SPEC,
    "name": "cp-chaos-endless",
    "training": {**SPEC["training"], "max_steps": 1_000_000},
    "checkpoint": {**SPEC["checkpoint"], "keep_last": 1_000},
}


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


def _env(cluster: Cluster, namespace: str) -> dict[str, str]:
    return {"ELASTRAIN_RAY_ADDRESS": cluster.address, "ELASTRAIN_RAY_NAMESPACE": namespace}


def _assert_whole_history(http: httpx.Client, job_id: int) -> None:
    job = wait_terminal(http, job_id, timeout=400)
    assert job["state"] == "SUCCEEDED", job
    assert job["attempt"] == 1, "launched twice"
    steps = [m["step"] for m in http.get(f"/v1/jobs/{job_id}/metrics").json()]
    assert steps == list(range(1, STEPS + 1))  # every step stored, none twice
    catalogue = [c["step"] for c in http.get(f"/v1/jobs/{job_id}/checkpoints").json()]
    assert sorted(catalogue) == list(range(10, STEPS + 1, 10))  # every commit, once


def _assert_history_when_cancelled(http: httpx.Client, job_id: int, committed: int) -> None:
    """Trained on past `committed` (a step whose checkpoint committed), then cancelled:
    launched once, every step stored once, every periodic checkpoint in the catalogue once,
    up to `committed` at least."""
    job = cancel_at_step(http, job_id, committed + 20, timeout=300)
    assert (job["state"], job["attempt"]) == ("CANCELLED", 1), job
    steps = [m["step"] for m in http.get(f"/v1/jobs/{job_id}/metrics").json()]
    assert steps == list(range(1, steps[-1] + 1)) and steps[-1] >= committed + 20
    catalogue = sorted(c["step"] for c in http.get(f"/v1/jobs/{job_id}/checkpoints").json())
    assert len(catalogue) == len(set(catalogue)), catalogue
    periodic = [c for c in catalogue if c % 10 == 0]
    assert periodic == list(range(10, periodic[-1] + 1, 10)), catalogue
    assert periodic[-1] >= committed, catalogue


#: What `elastrain serve` logs when a scheduler pass raises (service/scheduler.py).
PASS_FAILED = "scheduler pass failed"


def _newest_commit(checkpoints: Path) -> int:
    return max((c.step for c in list_committed(checkpoints)), default=0)


@pytest.fixture
def own_postgres() -> Iterator[PrivatePostgres]:
    """A PostgreSQL server of this test's own: it is stopped while the other lane of CI
    uses the shared one (`tests/pg_server.py`)."""
    with private_postgres() as server:
        yield server


def test_postgresql_restarted_while_a_job_runs(
    cluster: Cluster, own_postgres: PrivatePostgres, tmp_path: Path
) -> None:
    with psycopg.connect(own_postgres.url, autocommit=True) as admin:
        admin.execute("CREATE DATABASE elastrain")
    database_url = own_postgres.url.rpartition("/")[0] + "/elastrain"
    server = start_server(
        tmp_path, database_url=database_url, argv=serve_argv,
        env=_env(cluster, "elastrain-pg-restart"), startup_timeout=120,
    )  # fmt: skip
    try:
        job_id = server.submit(ENDLESS)["id"]
        with server.http() as http:
            wait_for(http, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 5)
            checkpoints = JobStorage.of(server.storage_path, job_id).checkpoints
            passes_failed = server.server_log().count(PASS_FAILED)
            own_postgres.stop()
            try:
                # Down long enough to matter: a scheduler pass has failed on it, and the
                # workers, which never touch the database, committed a checkpoint meanwhile
                # (its report must then be stored once the database is back).
                newest = _newest_commit(checkpoints)
                wait_until(
                    lambda: server.server_log().count(PASS_FAILED) > passes_failed, 60,
                    "a scheduler pass failed on the stopped database",
                    detail=lambda: server.server_log()[-3000:],
                )  # fmt: skip
                wait_until(
                    lambda: _newest_commit(checkpoints) > newest, 120,
                    f"training went on: a checkpoint after step {newest} committed",
                )  # fmt: skip
                down = http.get("/healthz")
                assert down.status_code == 503 and "unavailable" in down.json()["database"]
                assert http.get(f"/v1/jobs/{job_id}").status_code == 503
            finally:
                own_postgres.start()
            # Past the newest commit of the outage: what trained since the database came
            # back is stored too.
            _assert_history_when_cancelled(http, job_id, _newest_commit(checkpoints))
            assert http.get("/healthz").status_code == 200
    finally:
        server.stop()


# Run `elastrain serve`, but die by SIGKILL right after the first checkpoint commit is
# written into the open transaction, before it commits: as if the machine lost power.
_DIE_IN_COMMIT = textwrap.dedent(
    """
    import os, signal, sys
    from elastrain.service import reports

    original = reports.record_checkpoint

    def record_then_die(session, *args, **kwargs):
        row = original(session, *args, **kwargs)
        session.flush()  # the INSERT is on the server, inside the transaction
        os.kill(os.getpid(), signal.SIGKILL)
        return row

    reports.record_checkpoint = record_then_die
    from elastrain.api.cli import app
    sys.argv = ["elastrain", *sys.argv[1:]]
    app()
    """
)


def _dying_argv(port: int) -> list[str]:
    return [sys.executable, "-c", _DIE_IN_COMMIT, "serve", "--host", "127.0.0.1",
            "--port", str(port)]  # fmt: skip


def test_control_plane_kill_9_while_storing_a_checkpoint_commit(
    cluster: Cluster, pg_database: str, tmp_path: Path
) -> None:
    env = _env(cluster, "elastrain-kill-commit")
    server: ServerHandle = start_server(
        tmp_path, database_url=pg_database, argv=_dying_argv, env=env, startup_timeout=120
    )
    try:
        job_id = server.submit(SPEC)["id"]
        assert server.proc.wait(timeout=300) == -signal.SIGKILL  # died in the commit
        with server.session() as s:
            from elastrain.service import reports

            assert reports.list_checkpoints(s, job_id) == []  # nothing half-stored
        server = start_server(
            tmp_path, database_url=pg_database, argv=serve_argv, env=env, startup_timeout=120
        )
        with server.http() as http:
            # The runtime kept the driver's unacknowledged messages: the commit arrives
            # again, and is stored once.
            _assert_whole_history(http, job_id)
    finally:
        server.stop()
