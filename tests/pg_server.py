"""A PostgreSQL server of one test's (or one campaign's) own, to stop and restart.

The shared server at PG_ADMIN_URL serves every other test, and CI runs two lanes of tests
at once: a test that stopped it failed the other lane's database tests meanwhile (34 of
them in one run). So a test that takes the database away runs its own server: `initdb`
into a temporary folder, the binaries of the version serving PG_ADMIN_URL, a port of its
own, loopback only, trust auth, no fsync (its data is thrown away).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

#: PostgreSQL refuses to run as root: as root, its commands run as this user.
PG_USER = "postgres"


def _bindir() -> Path:
    out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=False)
    if out.returncode == 0 and (Path(out.stdout.strip()) / "initdb").exists():
        return Path(out.stdout.strip())
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not versions:
        raise RuntimeError("no PostgreSQL server binaries (initdb) on this machine")
    return versions[-1].parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class PrivatePostgres:
    folder: Path
    port: int
    bindir: Path

    @property
    def url(self) -> str:
        """The admin URL (database `postgres`)."""
        return f"postgresql://{PG_USER}@127.0.0.1:{self.port}/postgres"

    def _ctl(self, *args: str, timeout: float = 60) -> None:
        data = str(self.folder / "data")
        log = str(self.folder / "server.log")
        cmd = [str(self.bindir / "pg_ctl"), "-D", data, "-l", log, "-w", *args]
        subprocess.run(_as_pg_user(cmd), check=True, timeout=timeout, capture_output=True)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.folder} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._ctl("-o", options, "start")

    def stop(self) -> None:
        self._ctl("-m", "fast", "stop")

    def restart(self) -> None:
        self._ctl("-m", "fast", "restart")


def _as_pg_user(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", PG_USER, "--", *cmd] if os.geteuid() == 0 else cmd


@contextmanager
def private_postgres() -> Iterator[PrivatePostgres]:
    """A fresh PostgreSQL server, running; stopped and deleted afterwards."""
    folder = Path(tempfile.mkdtemp(prefix="elastrain-pg-"))
    if os.geteuid() == 0:
        shutil.chown(folder, PG_USER)
    server = PrivatePostgres(folder=folder, port=_free_port(), bindir=_bindir())
    try:
        initdb = [str(server.bindir / "initdb"), "-D", str(folder / "data"), "-U", PG_USER,
                  "-A", "trust", "--no-sync", "-E", "UTF8"]  # fmt: skip
        subprocess.run(_as_pg_user(initdb), check=True, timeout=120, capture_output=True)
        server.start()
        try:
            yield server
        finally:
            gone = [str(server.bindir / "pg_ctl"), "-D", str(folder / "data"), "-m", "immediate",
                    "stop"]  # fmt: skip
            subprocess.run(_as_pg_user(gone), check=False, timeout=60, capture_output=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
