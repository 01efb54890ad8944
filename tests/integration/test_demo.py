"""`make demo` (`elastrain serve --demo`), the README's first command, run as a user runs
it: the installed console script in a fresh process, from a directory that is not this
repository (so nothing resolves through the working directory), its demo job submitted
over REST once the API answers. The scheduler is left out (`--no-scheduler`): what runs
the job is tested everywhere else; this is the path to its submission."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import yaml

from elastrain.contracts.spec import JobSpec
from tests.e2e.server import start_server

REPO = Path(__file__).resolve().parents[2]


def test_serve_demo_submits_the_packaged_demo_job(tmp_path: Path) -> None:
    script = str(Path(sys.executable).parent / "elastrain")
    srv = start_server(
        tmp_path / "service",
        argv=lambda port: [script, "serve", "--demo", "--no-scheduler", "--port", str(port)],
        env={"PYTHONPATH": ""},  # nothing but the installed package
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 60
        while "#/jobs/1" not in srv.server_log():
            assert srv.alive(), "serve --demo exited:\n" + srv.server_log()
            assert time.monotonic() < deadline, "no demo job within 60 s:\n" + srv.server_log()
            time.sleep(0.2)
        job = srv.http().get("/v1/jobs/1").json()
    finally:
        srv.stop()
    packaged = yaml.safe_load((REPO / "api" / "demo" / "gpt-tiny.yaml").read_text())
    assert job["name"] == packaged["name"] == "gpt-tiny"
    assert job["state"] == "PENDING"
    assert JobSpec.model_validate(job["spec"]).workload.name == "gpt"
    assert f"{srv.url}/#/jobs/1" in srv.server_log()
