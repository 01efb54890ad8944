"""Hostile clients of the HTTP server (issue 26, item 6): a real uvicorn with the guarded
protocol `elastrain serve` uses, on a real socket. Large and slow headers are refused and
their connections closed; idle connections do not lock others out; bodies are not headers.

The limits are small here (8 KiB of headers, 0.5 s to send them, 20 connections) so the
tests are quick; bench/server_abuse_bench.py measures the defaults under abuse.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from elastrain.api.cli.server import guarded_http
from elastrain.api.http_guard import ConnectionLimits, GuardedHttpProtocol
from elastrain.api.main import create_app
from elastrain.service.settings import Settings

LIMITS = ConnectionLimits(max_header_bytes=8 * 1024, header_timeout_s=0.5, max_connections=20)


class SmallLimits(GuardedHttpProtocol):
    limits = LIMITS


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, int]]:
    root: Path = tmp_path_factory.mktemp("server")
    settings = Settings(database_url=f"sqlite:///{root / 'db.sqlite'}", storage_path=root / "s")
    options = {**guarded_http(settings), "http": SmallLimits}
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=_free_port(), log_level="warning", **options
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield "127.0.0.1", config.port
    srv.should_exit = True
    thread.join(10)


def _read_all(sock: socket.socket, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, TimeoutError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _healthy(server: tuple[str, int]) -> None:
    response = httpx.get(f"http://{server[0]}:{server[1]}/healthz", timeout=5)
    assert response.status_code == 200


def test_a_64_mb_header_gets_431_and_the_connection_closed(server: tuple[str, int]) -> None:
    with socket.create_connection(server) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Big: ")
        sent, chunk = 0, b"a" * 2**20
        started = time.monotonic()
        try:
            while sent < 64 * 2**20:
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server stopped reading: expected once it lingered long enough
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:200]
    assert b"connection: close" in answer.lower()
    assert time.monotonic() - started < 10
    _healthy(server)


def test_a_slow_header_client_is_dropped_after_the_limit(server: tuple[str, int]) -> None:
    with socket.create_connection(server) as sock:
        started = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        dropped_after = None
        for i in range(40):  # a header line every 0.1 s, never the blank line
            try:
                sock.sendall(b"X-Slow-%d: 1\r\n" % i)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.1)
            sock.settimeout(0.001)
            try:
                if sock.recv(1, socket.MSG_PEEK):
                    dropped_after = time.monotonic() - started
                    break
            except (BlockingIOError, TimeoutError):
                pass
        answer = _read_all(sock)
    assert answer.startswith(b"HTTP/1.1 408 "), answer[:200]
    assert dropped_after is not None and 0.4 < dropped_after < 1.5


def test_a_connection_that_sends_nothing_is_closed(server: tuple[str, int]) -> None:
    with socket.create_connection(server) as sock:
        started = time.monotonic()
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 408 ")
        assert 0.4 < time.monotonic() - started < 2.5


def test_idle_connections_at_the_limit_do_not_lock_others_out(server: tuple[str, int]) -> None:
    idle = [socket.create_connection(server) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.05)
        with httpx.Client(base_url=f"http://{server[0]}:{server[1]}", timeout=5) as client:
            for _ in range(5):  # each new connection closes the oldest idle one
                assert client.get("/healthz", headers={"Connection": "close"}).status_code == 200
        evicted = 0
        for sock in idle:
            sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                evicted += sock.recv(64).startswith(b"HTTP/1.1 503 ")
        assert evicted >= 5
    finally:
        for sock in idle:
            sock.close()


def test_bodies_and_keep_alive_requests_are_not_headers(server: tuple[str, int]) -> None:
    with httpx.Client(base_url=f"http://{server[0]}:{server[1]}", timeout=5) as client:
        for _ in range(3):  # one connection, several requests
            assert client.get("/v1/jobs").status_code == 200
        big = {"name": "x", "workload": {"name": "synthetic"}, "labels": {"k": "v" * 60_000}}
        response = client.post("/v1/jobs", json=big)  # 60 KB of body: refused by the API
        assert response.status_code == 422, response.text  # ... for its label, not its size
        assert "labels" in response.text
