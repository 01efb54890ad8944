"""A tenant's code reads its environment, on a real `elastrain serve` over a real local Ray.

The service holds the admin token and the database URL in its environment; a job's workers
must start without them (service/worker_env.py): tenant code that dumps `os.environ` finds
neither, whatever the variables are called.
"""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import pytest

from tests.e2e.server import serve_argv, start_server
from tests.integration.ray_service import wait_terminal

pytestmark = [pytest.mark.ray]

TOKEN = "operator-admin-token-that-must-not-leak-0123"
#: The tenant's factory: writes what its process sees to a file, then refuses to train.
PROBE = """\
import json, os


def build(out: str):
    with open(out, "w") as f:
        json.dump(dict(os.environ), f)
    raise ValueError("probe done")
"""


def _zip() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("env_probe.py", PROBE)
    return buf.getvalue()


def test_tenant_code_sees_no_admin_token_nor_database_url(tmp_path: Path) -> None:
    database = f"sqlite:///{tmp_path / 'srv' / 'elastrain.db'}"
    server = start_server(
        tmp_path / "srv",
        token=TOKEN,
        database_url=database,
        env={
            "ELASTRAIN_RAY_NUM_CPUS": "2",
            "ELASTRAIN_WARM_WORKERS_PER_NODE": "1",
            # A secret under a name of the operator's own choosing: found by its value.
            "MY_DB": database,
        },
        argv=serve_argv,
        startup_timeout=120,
    )
    out = tmp_path / "seen.json"
    try:
        with server.http() as client:
            upload = client.post(
                "/v1/packages", content=_zip(), headers={"Content-Type": "application/zip"}
            )
            assert upload.status_code == 201, upload.text
            spec = {
                "name": "env-probe",
                "workload": {
                    "entrypoint": "env_probe:build",
                    "package": upload.json()["digest"],
                    "params": {"out": str(out)},
                },
                "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
                "failure": {"max_restarts": 0},
            }
            made = client.post("/v1/jobs", json=spec)
            assert made.status_code == 201, made.text
            job = wait_terminal(client, made.json()["id"], timeout=240)
        assert job["state"] == "FAILED" and "probe done" in (job["last_error"] or ""), job
        seen: dict[str, str] = json.loads(out.read_text())
    finally:
        server.stop()
    assert seen, "the probe saw an empty environment"
    leaks = {
        k for k, v in seen.items() if TOKEN in v or database in v or k.startswith("ELASTRAIN_")
    }
    assert not leaks, f"tenant code sees the service's secrets in {sorted(leaks)}"
    assert "PATH" in seen  # an environment, only without the secrets
    # And the service itself warns that this mode is single-user.
    assert "single-host mode is single-user" in server.server_log()
