"""`elastrain serve --api-workers N`: several API processes on one port beside one
scheduler, on a fresh database of either kind: every submit lands once, whichever process
takes it, and every process sees all of them."""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from tests.e2e.server import start_server


def _children(pid: int) -> list[int]:
    """Processes whose parent is `pid` (uvicorn's workers under its supervisor)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def test_several_api_processes_serve_one_database(tmp_path: Path, db_url: str) -> None:
    def argv(port: int) -> list[str]:
        return [sys.executable, "-m", "elastrain.api.cli", "serve", "--no-scheduler", "--api-workers", "3",
                "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip

    srv = start_server(tmp_path, argv=argv, database_url=db_url, startup_timeout=120)
    try:
        assert len(_children(srv.proc.pid)) >= 3
        spec = {"name": "w", "workload": {"name": "synthetic"}}

        def submit(i: int) -> int:
            with httpx.Client(base_url=srv.url, timeout=30) as http:
                response = http.post("/v1/jobs", json={**spec, "name": f"w{i}"})
                assert response.status_code == 201, response.text
                return int(response.json()["id"])

        with ThreadPoolExecutor(max_workers=8) as pool:
            ids = list(pool.map(submit, range(40)))
        assert len(set(ids)) == 40
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            listed = http.get("/v1/jobs", params={"limit": 100}).json()
        assert listed["total"] == 40
        assert {j["id"] for j in listed["items"]} == set(ids)
    finally:
        srv.stop()
    assert "Traceback" not in srv.server_log(), srv.server_log()
