"""`make demo` (`elastrain serve --demo`), the README's first command, run as a user runs
it: the installed console script in a fresh process, from a directory that is not this
repository (so nothing resolves through the working directory), its demo job submitted
over REST once the API answers. The scheduler is left out (`--no-scheduler`): what runs
the job is tested everywhere else; this is the path to its submission."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from elastrain.contracts.spec import JobSpec

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def test_serve_demo_submits_the_packaged_demo_job(tmp_path: Path) -> None:
    port = _free_port()
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("ELASTRAIN_") and key != "PYTHONPATH"
    }
    env |= {
        "ELASTRAIN_DATABASE_URL": f"sqlite:///{tmp_path / 'db.sqlite'}",
        "ELASTRAIN_STORAGE_PATH": str(tmp_path / "storage"),
    }
    script = Path(sys.executable).parent / "elastrain"
    server = subprocess.Popen(
        [str(script), "serve", "--demo", "--no-scheduler", "--port", str(port)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    output: list[str] = []
    try:
        deadline = time.monotonic() + 120
        assert server.stdout is not None
        while not any("demo job 1 " in line for line in output):
            assert time.monotonic() < deadline, "no demo job within 120 s:\n" + "".join(output)
            line = server.stdout.readline()
            assert line or server.poll() is None, "serve --demo exited:\n" + "".join(output)
            output.append(line)
        job = httpx.get(f"http://127.0.0.1:{port}/v1/jobs/1", timeout=10).json()
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    packaged = yaml.safe_load((REPO / "api" / "demo" / "gpt-tiny.yaml").read_text())
    assert job["name"] == packaged["name"] == "gpt-tiny"
    assert job["state"] == "PENDING"
    assert JobSpec.model_validate(job["spec"]).workload.name == "gpt"
    assert f"http://127.0.0.1:{port}/#/jobs/1" in "".join(output)
