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
from tests.factories import a_zip
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
                "/v1/packages",
                content=a_zip({"env_probe.py": PROBE}),
                headers={"Content-Type": "application/zip"},
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


#: Tenant A's code leaves a module, a thread and a patched standard function behind.
LEAVER = """\
import json, os, threading, time
import tenant_a_leftover


def build(out: str):
    tenant_a_leftover.SECRET = "tenant A's data"
    threading.Thread(target=time.sleep, args=(3600,), name="tenant-a-thread", daemon=True).start()
    json.dumps = lambda *a, **k: "patched by tenant A"
    with open(out, "w") as f:
        f.write(str(os.getpid()))
    raise ValueError("leaver done")
"""

#: Tenant B's code looks for what A left.
SEEKER = """\
import json, os, sys, threading


def build(out: str):
    seen = {
        "pid": os.getpid(),
        "modules": sorted(m for m in sys.modules if m.startswith(("tenant_a", "leaver"))),
        "threads": sorted(t.name for t in threading.enumerate()),
        "json_patched": json.dumps({}) == "patched by tenant A",
    }
    with open(os.path.join(out, f"{os.getpid()}.json"), "w") as f:
        json.dump(seen, f)  # json.dump: only json.dumps may have been patched
    raise ValueError("seeker done")
"""


def _package(files: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, text in files.items():
            zf.writestr(name, text)
    return buf.getvalue()


def test_a_tenants_code_never_reaches_the_next_tenants_job(tmp_path: Path) -> None:
    """Tenant A's package job (one worker), then tenant B's (two), on a node whose two
    idle processes B would otherwise take, A's among them: B's ranks run in other
    processes and find nothing of A's."""
    server = start_server(
        tmp_path / "srv",
        token=TOKEN,
        env={"ELASTRAIN_RAY_NUM_CPUS": "1", "ELASTRAIN_WARM_WORKERS_PER_NODE": "1"},
        argv=serve_argv,
        startup_timeout=120,
    )
    outs = {"a": tmp_path / "a.txt", "b": tmp_path / "b"}
    outs["b"].mkdir()
    packages = {
        "a": {"leaver.py": LEAVER, "tenant_a_leftover.py": "SECRET = None\n"},
        "b": {"seeker.py": SEEKER},
    }
    entrypoints = {"a": "leaver:build", "b": "seeker:build"}
    workers = {"a": 1, "b": 2}
    try:
        with server.http() as admin:
            for tenant in ("a", "b"):
                made = admin.post("/v1/tokens", json={"tenant": f"tenant-{tenant}"})
                assert made.status_code == 201, made.text
                headers = {"Authorization": f"Bearer {made.json()['token']}"}
                upload = admin.post(
                    "/v1/packages", content=_package(packages[tenant]),
                    headers={**headers, "Content-Type": "application/zip"},
                )  # fmt: skip
                assert upload.status_code == 201, upload.text
                spec = {
                    "name": f"tenant-{tenant}",
                    "workload": {"entrypoint": entrypoints[tenant],
                                 "package": upload.json()["digest"],
                                 "params": {"out": str(outs[tenant])}},
                    "scaling": {"min_workers": workers[tenant], "max_workers": workers[tenant],
                                "cpus_per_worker": 0.5},
                    "failure": {"max_restarts": 0},
                }  # fmt: skip
                job = admin.post("/v1/jobs", json=spec, headers=headers)
                assert job.status_code == 201, job.text
                ended = wait_terminal(admin, job.json()["id"], timeout=240)
                assert f"{entrypoints[tenant].split(':')[0]} done" in (ended["last_error"] or "")
    finally:
        server.stop()
    a_pid = int(outs["a"].read_text())
    seen = [json.loads(f.read_text()) for f in sorted(outs["b"].glob("*.json"))]
    assert len(seen) == 2, seen
    for rank in seen:
        assert rank["pid"] != a_pid, "tenant B's job ran in the process tenant A's code ran in"
        assert rank["modules"] == [] and "tenant-a-thread" not in rank["threads"], rank
        assert not rank["json_patched"], rank
