"""A tenant's scripts run as the OS identity the operator mapped it to (issue 45, item 3):
the map, row by row; the shim that drops to it, for real (as root: CI's and this machine's
workers are); a worker that cannot change user refuses rather than run the script as
itself."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from elastrain.contracts.os_identity import RunAs, parse_tenant_users
from elastrain.service.settings import Settings
from elastrain.workers import command
from elastrain.workers.workloads import WorkloadError
from tests.unit.test_command import assignment

NOBODY = RunAs(65534, 65534)


@pytest.mark.parametrize(
    ("entries", "found"),
    [
        ([], {}),
        (["team-a=2001:2002", "b=2003"], {"team-a": RunAs(2001, 2002), "b": RunAs(2003, 2003)}),
        ([" c = 65534 "], {"c": NOBODY}),
    ],
)
def test_the_operators_map(entries: list[str], found: dict[str, RunAs]) -> None:
    assert parse_tenant_users(entries) == found


@pytest.mark.parametrize("bad", ["a", "=5", "a=0", "a=5:0", "a=x", "a=-1", "a=4294967295"])
def test_a_bad_entry_is_named(bad: str) -> None:
    with pytest.raises(ValueError, match="ELASTRAIN_TENANT_USERS"):
        parse_tenant_users([bad])
    with pytest.raises(ValueError, match="ELASTRAIN_TENANT_USERS"):
        Settings(tenant_users=bad)  # type: ignore[arg-type]


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping to another user needs root")
def test_the_shim_becomes_the_tenants_user_with_no_groups(tmp_path: Path) -> None:
    secret = tmp_path / "other-tenant.txt"
    secret.write_text("b's")
    secret.chmod(0o600)
    done = subprocess.run(
        [sys.executable, "-S", str(command._SHIM), str(os.getpid()), str(NOBODY),
         "sh", "-c", f"id -u; id -g; id -G; cat {secret} || echo refused"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert done.stdout.split() == ["65534", "65534", "65534", "refused"], done
    # And without one: the worker's own user, as before.
    same = subprocess.run(
        [sys.executable, "-S", str(command._SHIM), str(os.getpid()), "-", "id", "-u"],
        capture_output=True, text=True, timeout=30, check=False,
    )  # fmt: skip
    assert same.stdout.strip() == str(os.geteuid())


def test_a_worker_that_cannot_change_user_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    a = assignment(["sh", "-c", "true"])
    assert command.script_identity(a) is None
    mapped = type(a)(**{**{f: getattr(a, f) for f in a.__dataclass_fields__}, "run_as": "2001"})
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(command, "_can_setuid", lambda: False)
    with pytest.raises(WorkloadError, match="cannot change user"):
        command.script_identity(mapped)


def test_a_tenant_the_map_leaves_out_submits_no_script(tmp_path: Path) -> None:
    from fastapi.testclient import TestClient

    from elastrain.api.main import create_app
    from tests.factories import spec_dict

    settings = Settings(
        database_url=f"sqlite:///{tmp_path / 'db.sqlite'}",
        storage_path=tmp_path / "storage",
        tenant_users=["team-a=2001"],  # not "default", this client's tenant
    )
    with TestClient(create_app(settings)) as client:
        script = {"name": "s", "workload": {"command": ["sh", "-c", "true"]}}
        refused = client.post("/v1/jobs", json=script)
        assert refused.status_code == 422, refused.text
        assert refused.json()["message"].startswith("workload.command: tenant 'default'")
        assert client.post("/v1/jobs", json=spec_dict()).status_code == 201  # built-ins run
