"""A real elastrain API server in a subprocess, for browser and chaos tests and bench scripts.

    srv = start_server(tmp_path)                     # uvicorn elastrain.api.main:create_app --factory
    srv = start_server(tmp_path, token="s3cret")     # every /v1 request needs the token
    srv = start_server(tmp_path, argv=serve_argv,   # `elastrain serve`: with the scheduler
                       env={"ELASTRAIN_RAY_ADDRESS": address})
    job = srv.submit({"name": "x", "workload": {"name": "synthetic"}})
    with srv.session() as s: ...                     # elastrain.service.jobs on the same database
    srv.stop()

The server is configured only through `ELASTRAIN_*` environment variables (a fresh SQLite
file and storage folder under `workdir` unless `database_url` is given), exactly as a user
would run it, so what the browser sees is the real service.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def uvicorn_argv(port: int) -> list[str]:
    """The API alone (no scheduler): `uvicorn elastrain.api.main:create_app --factory`."""
    return [
        sys.executable, "-m", "uvicorn", "elastrain.api.main:create_app", "--factory",
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip


def serve_argv(port: int) -> list[str]:
    """`elastrain serve`: the API and the scheduler (Ray from ELASTRAIN_RAY_ADDRESS, or local)."""
    return [
        sys.executable,
        "-m",
        "elastrain.api.cli",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]


@dataclass
class ServerHandle:
    url: str
    database_url: str
    storage_path: Path
    token: str | None
    proc: subprocess.Popen[bytes]
    log_path: Path
    _engine: Engine | None = field(default=None, repr=False)
    _factory: sessionmaker[Session] | None = field(default=None, repr=False)

    # --- talking to it -------------------------------------------------------------
    def http(self, *, timeout: float = 30, **kwargs: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=timeout, **kwargs)

    def submit(self, spec: Mapping[str, Any]) -> dict[str, Any]:
        """POST /v1/jobs; returns the job (raises on anything but 201)."""
        with self.http() as client:
            res = client.post("/v1/jobs", json=dict(spec))
        if res.status_code != 201:
            raise AssertionError(f"submit failed: {res.status_code} {res.text}")
        job: dict[str, Any] = res.json()
        return job

    def wait_for_state(
        self, job_id: int, states: set[str], *, timeout: float = 300, poll_s: float = 0.5
    ) -> dict[str, Any]:
        """Poll GET /v1/jobs/{id} until its state is one of `states`; returns the job."""
        deadline = time.monotonic() + timeout
        with self.http() as client:
            while True:
                job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}").raise_for_status().json()
                if job["state"] in states:
                    return job
                if time.monotonic() > deadline:
                    raise TimeoutError(f"job {job_id} still {job['state']} after {timeout}s")
                time.sleep(poll_s)

    # --- the same database, through service.* --------------------------------------
    @property
    def session_factory(self) -> sessionmaker[Session]:
        if self._factory is None:
            from elastrain.service.db import make_engine, make_session_factory

            self._engine = make_engine(self.database_url)
            self._factory = make_session_factory(self._engine)
        return self._factory

    @contextmanager
    def session(self) -> Iterator[Session]:
        """A transaction on the server's database (commit on success)."""
        from elastrain.service.db import session_scope

        with session_scope(self.session_factory) as session:
            yield session

    def logs_dir(self, job_id: int) -> Path:
        """Where the API reads a job's worker logs (`GET /v1/jobs/{id}/logs`)."""
        return self.storage_path / "jobs" / str(job_id) / "logs"

    def server_log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    # --- lifecycle -----------------------------------------------------------------
    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 10) -> None:
        if self._engine is not None:
            self._engine.dispose()
            self._engine = None
            self._factory = None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout)


def start_server(
    workdir: Path,
    *,
    token: str | None = None,
    database_url: str | None = None,
    env: Mapping[str, str] | None = None,
    argv: Callable[[int], Sequence[str]] = uvicorn_argv,
    startup_timeout: float = 60,
    cwd: Path = REPO_ROOT,
) -> ServerHandle:
    """Start the service on a free port and wait until `/healthz` answers 200. `cwd`: where
    it runs (a folder outside the repository shows what resolves only from there)."""
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "storage"
    db_url = database_url or f"sqlite:///{workdir / 'elastrain.db'}"
    port = free_port()
    child_env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTRAIN_")}
    child_env.update(
        ELASTRAIN_DATABASE_URL=db_url,
        ELASTRAIN_STORAGE_PATH=str(storage),
        ELASTRAIN_HOST="127.0.0.1",
        ELASTRAIN_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    if token:
        child_env["ELASTRAIN_API_TOKEN"] = token
    child_env.update(env or {})
    log_path = workdir / f"server-{port}.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            list(argv(port)), cwd=cwd, env=child_env, stdout=log, stderr=subprocess.STDOUT
        )
    handle = ServerHandle(
        url=f"http://127.0.0.1:{port}",
        database_url=db_url,
        storage_path=storage,
        token=token,
        proc=proc,
        log_path=log_path,
    )
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{handle.server_log()}")
        try:
            if httpx.get(f"{handle.url}/healthz", timeout=2).status_code == 200:
                return handle
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            handle.stop()
            raise RuntimeError(f"server not ready after {startup_timeout}s:\n{handle.server_log()}")
        time.sleep(0.1)
