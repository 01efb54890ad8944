"""A job's own code calls the runtime, on a real `elastrain serve` over a real local Ray.

Job B's custom entrypoint (an uploaded package: it runs inside a Ray worker process) looks
the runtime actor up by name and, with job A's attempt key (learnt from A's job id) and a
made-up capability, tries to release A's attempt, reconcile with nothing live (releasing
everything), push a forged failure for A, list the pool, and abort or stop the pool's
processes. Every call is refused, and A, which has no restart left, still succeeds.
Before capabilities the release alone failed A.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastrain.contracts.storage import JobStorage
from tests.e2e.server import serve_argv, start_server
from tests.factories import a_zip
from tests.integration.ray_service import wait_for, wait_terminal

pytestmark = [pytest.mark.ray, pytest.mark.timeout(300)]

TOKEN = "operator-admin-token-runtime-capability-0123"
MADE_UP = "0" * 64

#: Tenant B's factory: every call it can make on A's attempt, each outcome written down.
ATTACKER = """\
import json

import ray

from elastrain.contracts.messages import StepMetrics, WorkerError, WorkerFailed
from elastrain.contracts.runtime import RUNTIME_NAME, AttemptKey, Reconcile


def build(out: str, victim: int, made_up: str):
    namespace = ray.get_runtime_context().namespace
    runtime = ray.get_actor(RUNTIME_NAME, namespace=namespace)
    key = AttemptKey(victim, 1)
    forged = [StepMetrics(step=999_999, loss=0.0, wall_time=0.0),
              WorkerFailed(error=WorkerError(type="Forged", message="forged by tenant B"))]
    calls = {
        "release": lambda: runtime.release.remote(made_up, key, True),
        "release-without-token": lambda: runtime.release.remote(key, True),
        "reconcile-empty": lambda: runtime.reconcile.remote(made_up, Reconcile()),
        "request-stop": lambda: runtime.request.remote(made_up, key, "stop"),
        "push_many": lambda: runtime.push_many.remote(key, made_up, 0, forged),
        "push_many-without-capability": lambda: runtime.push_many.remote(key, 0, forged),
        "workers": lambda: runtime.workers.remote(made_up),
    }
    for entry in ray.util.list_named_actors(all_namespaces=True):
        name = entry["name"]
        if entry["namespace"] != namespace or not name.startswith("elastrain-worker-"):
            continue
        worker = ray.get_actor(name, namespace=namespace)
        calls[f"abort {name}"] = lambda w=worker: w.abort.remote(made_up)
        calls[f"abort-without-token {name}"] = lambda w=worker: w.abort.remote()
        calls[f"stop {name}"] = lambda w=worker: w.control.remote(made_up, key, ["stop"])
        calls[f"forget {name}"] = lambda w=worker: w.forget.remote(made_up)
    seen = {}
    for what, call in calls.items():
        try:
            ray.get(call(), timeout=30)
            seen[what] = "accepted"
        except Exception as exc:
            seen[what] = f"{type(exc).__name__}: {exc}"[-400:]
    with open(out, "w") as f:
        json.dump(seen, f)
    raise ValueError("attacker done")
"""

#: Job A: runs until the test lets it finish (a file in its own folder, its working
#: directory), then succeeds.
WAITER = "import os, time; [time.sleep(0.2) for _ in iter(lambda: os.path.exists('go'), True)]"


def test_a_jobs_code_calling_the_runtime_for_another_attempt_is_refused(tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "srv",
        token=TOKEN,
        env={"ELASTRAIN_RAY_NUM_CPUS": "2", "ELASTRAIN_WARM_WORKERS_PER_NODE": "1"},
        argv=serve_argv,
        startup_timeout=120,
    )
    out = tmp_path / "seen.json"
    try:
        with server.http() as client:
            victim = client.post(
                "/v1/jobs",
                json={
                    "name": "victim",
                    "workload": {"command": ["python", "-c", WAITER]},
                    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
                    "failure": {"max_restarts": 0},  # one release would fail it for good
                },
            )
            assert victim.status_code == 201, victim.text
            a = victim.json()["id"]
            wait_for(client, a, lambda j: j["state"] == "RUNNING", timeout=120)

            upload = client.post(
                "/v1/packages",
                content=a_zip({"attacker.py": ATTACKER}),
                headers={"Content-Type": "application/zip"},
            )
            assert upload.status_code == 201, upload.text
            made = client.post(
                "/v1/jobs",
                json={
                    "name": "attacker",
                    "workload": {
                        "entrypoint": "attacker:build",
                        "package": upload.json()["digest"],
                        "params": {"out": str(out), "victim": a, "made_up": MADE_UP},
                    },
                    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
                    "failure": {"max_restarts": 0},
                },
            )
            assert made.status_code == 201, made.text
            b = wait_terminal(client, made.json()["id"], timeout=180)
            assert "attacker done" in (b["last_error"] or ""), b

            seen: dict[str, str] = json.loads(out.read_text())
            assert any(k.startswith("abort ") for k in seen), seen  # the pool was reached
            accepted = {what for what, outcome in seen.items() if "Refused" not in outcome}
            # The calls in the old shapes (no token) fail too: refused, or not even a call.
            old_shape = {w for w in accepted if "without" in w and "accepted" not in seen[w]}
            assert accepted == old_shape, {w: seen[w] for w in accepted}

            assert client.get(f"/v1/jobs/{a}").json()["state"] == "RUNNING"
            (JobStorage.of(tmp_path / "srv" / "storage", a).files / "go").write_text("")
            job = wait_terminal(client, a, timeout=120)
            assert job["state"] == "SUCCEEDED", job
            steps = [p["step"] for p in client.get(f"/v1/jobs/{a}/metrics").json()]
            assert 999_999 not in steps  # the forged report never reached A's metrics
        log = server.server_log()
    finally:
        server.stop()
    # Refused calls are logged with the key the caller claimed.
    assert "release refused" in log and f"job_id={a}, attempt=1" in log, log[-3000:]
