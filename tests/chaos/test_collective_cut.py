"""tests/chaos/collective_cut.py on a real TCP connection: while cut, bytes sent do not
arrive and both processes live on (a hang, not an error); after, nothing of the cut is
left on `lo` and the connection delivers again."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.chaos.collective_cut import connections_between, cut_between

pytestmark = pytest.mark.chaos

ECHO = """
import socket
server = socket.socket()
server.bind(("127.0.0.1", 0))
server.listen()
print(server.getsockname()[1], flush=True)
conn, _ = server.accept()
while data := conn.recv(100):
    conn.sendall(data)
"""


def _lo_state() -> tuple[str, str]:
    def tc(*argv: str) -> str:
        return subprocess.run(["tc", *argv], capture_output=True, text=True, check=True).stdout

    return tc("qdisc", "show", "dev", "lo"), tc("filter", "show", "dev", "lo", "egress")


def test_a_cut_connection_hangs_and_delivers_again_after() -> None:
    if os.geteuid() != 0:
        pytest.fail("the collective cut needs root (CAP_NET_ADMIN), as CI has")
    before = _lo_state()
    echo = subprocess.Popen([sys.executable, "-c", ECHO], stdout=subprocess.PIPE, text=True)
    try:
        assert echo.stdout is not None
        client = socket.create_connection(("127.0.0.1", int(echo.stdout.readline())))
        client.settimeout(2)
        client.sendall(b"a")
        assert client.recv(10) == b"a"
        assert len(connections_between(os.getpid(), [echo.pid])) == 1
        with cut_between(os.getpid(), [echo.pid]) as cut:
            assert len(cut) == 1
            client.sendall(b"b")
            with pytest.raises(TimeoutError):
                client.recv(10)
            assert echo.poll() is None  # alive: a hang, not an error
        assert _lo_state() == before
        client.settimeout(30)  # TCP's retransmission delivers it now
        assert client.recv(10) == b"b"
        client.close()
    finally:
        echo.kill()
        echo.wait()
