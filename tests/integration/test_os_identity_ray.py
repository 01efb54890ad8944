"""A tenant's script runs as its OS identity, on a real `elastrain serve` over a real local
Ray whose workers are root (as this machine's and CI's are): the operator maps tenant
`default` to uid 65534 (`ELASTRAIN_TENANT_USERS`). The script is that user, in no group
of the workers', owns its job's files folder (0700), cannot read a file another tenant's
job keeps 0600, and has no Ray or elastrain variable but its own in its environment.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from elastrain.contracts.storage import JobStorage
from tests.e2e.server import serve_argv, start_server
from tests.integration.ray_service import wait_terminal

pytestmark = [
    pytest.mark.ray,
    pytest.mark.timeout(300),
    pytest.mark.skipif(os.geteuid() != 0, reason="changing user needs root (CI runs as root)"),
]

SCRIPT = (
    "id -u > me; id -G >> me; env > env; stat -c %u:%a . >> me; "
    "cat {secret} > stolen 2>/dev/null || echo refused >> me"
)


def test_a_tenants_script_runs_as_its_os_identity(tmp_path: Path) -> None:
    server = start_server(
        tmp_path / "srv",
        env={
            "ELASTRAIN_RAY_NUM_CPUS": "2",
            "ELASTRAIN_WARM_WORKERS_PER_NODE": "1",
            "ELASTRAIN_TENANT_USERS": "default=65534:65534",
        },
        argv=serve_argv,
        startup_timeout=120,
    )
    storage = tmp_path / "srv" / "storage"
    try:
        # The operator lets tenants' users reach their own folders (made 0700 by serve).
        for folder in (tmp_path, tmp_path / "srv", storage):
            folder.chmod(0o711)
        secret = JobStorage.of(storage, 99).files / "weights.bin"  # another tenant's job
        secret.parent.mkdir(parents=True)
        secret.write_text("not yours")
        secret.chmod(0o600)
        with server.http() as client:
            made = client.post(
                "/v1/jobs",
                json={
                    "name": "as-its-user",
                    "workload": {"command": ["sh", "-c", SCRIPT.format(secret=secret)]},
                    "scaling": {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 0.5},
                    "failure": {"max_restarts": 0},
                },
            )
            assert made.status_code == 201, made.text
            job = wait_terminal(client, made.json()["id"], timeout=180)
            assert job["state"] == "SUCCEEDED", job
        files = JobStorage.of(storage, made.json()["id"]).files
        me = (files / "me").read_text().split()
        assert me == ["65534", "65534", "65534:700", "refused"], me
        assert not (files / "stolen").read_text()
        env = dict(
            line.split("=", 1) for line in (files / "env").read_text().splitlines() if "=" in line
        )
        assert not [k for k in env if k.startswith(("RAY_", "RAYLET"))], env
        own = {"ELASTRAIN_JOB_DIR", "ELASTRAIN_REPORT_FD"}  # its folder, rank 0's report pipe
        assert {k for k in env if k.startswith("ELASTRAIN_")} == own, env
    finally:
        server.stop()
