"""`nodes_to_probe` (a table), and `raylet_gone`: a refused connection or Ray's own
verdict makes a node dead; an answer, silence or an unknown node does not (real sockets on
loopback)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from typing import Any

import pytest

from elastrain.workers.runtime import liveness
from elastrain.workers.runtime.liveness import REPROBE_S, nodes_to_probe, raylet_gone


@pytest.fixture(autouse=True)
def no_known_raylets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test's node "n1" is another socket: nothing remembered from the last one."""
    monkeypatch.setattr(liveness, "_raylets", {})


@pytest.fixture
def listening() -> Iterator[int]:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        yield server.getsockname()[1]


@pytest.fixture
def closed_port() -> int:
    with socket.socket() as s:  # a port that was free a moment ago and nothing listens on
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _nodes(port: int, *, alive: bool = True) -> Any:
    info = {"NodeID": "n1", "Alive": alive, "NodeManagerAddress": "127.0.0.1",
            "NodeManagerPort": port}  # fmt: skip
    return lambda: [info]


def test_a_raylet_that_answers_is_not_gone(listening: int) -> None:
    assert not raylet_gone("n1", _nodes(listening))


def test_a_refused_connection_means_the_raylet_is_gone(closed_port: int) -> None:
    assert raylet_gone("n1", _nodes(closed_port))


def test_rays_verdict_of_dead_is_taken(listening: int) -> None:
    assert raylet_gone("n1", _nodes(listening, alive=False))


def test_no_verdict_without_certainty(closed_port: int) -> None:
    assert not raylet_gone(None, _nodes(closed_port))
    assert not raylet_gone("other", _nodes(closed_port))  # a node Ray does not know

    def unreachable() -> list[dict[str, Any]]:
        raise ConnectionError("GCS down")

    assert not raylet_gone("n1", unreachable)


NOW = 1000.0


@pytest.mark.parametrize(
    ("nodes", "probed", "expected"),
    [
        ([], {}, set()),  # no rank out
        (["n1"], {}, {"n1"}),  # never probed
        (["n1", "n1", "n2"], {}, {"n1", "n2"}),  # one probe per node
        (["n1"], {"n1": NOW - REPROBE_S / 2}, set()),  # probed a moment ago
        (["n1"], {"n1": NOW - REPROBE_S}, {"n1"}),  # probed, and it answered, a while ago
        ([None, ""], {}, set()),  # no node known
    ],
)  # fmt: skip
def test_the_nodes_of_ranks_still_out_are_probed_every_second(
    nodes: list[str | None], probed: dict[str | None, float], expected: set[str]
) -> None:
    assert nodes_to_probe(nodes, probed, NOW) == expected


def test_a_raylet_is_looked_up_once_and_then_probed_directly(closed_port: int) -> None:
    calls: list[None] = []
    known = _nodes(closed_port)

    def nodes() -> list[dict[str, Any]]:
        calls.append(None)
        return known()  # type: ignore[no-any-return]

    assert raylet_gone("n1", nodes) and raylet_gone("n1", nodes)
    assert len(calls) == 1
