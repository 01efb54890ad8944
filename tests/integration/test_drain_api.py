"""Drain and undrain over REST, on SQLite and PostgreSQL: stored (a restart keeps them),
shown in /v1/cluster, and every bad request a clear 4xx naming what is wrong (who may call
them: tests/integration/test_auth.py's matrix)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fastapi.testclient import TestClient

from elastrain.api.main import create_app
from elastrain.service import cluster
from elastrain.service.db import session_scope
from elastrain.service.settings import Settings

NODE_A = "a1" * 28
NODE_B = "b2" * 28
TWIN_1 = "cccccc" + "1" * 50
TWIN_2 = "cccccc" + "2" * 50


def publish(client: TestClient, **drained: Any) -> None:
    """What the scheduler writes every pass: four nodes (one dead), some drained by Ray."""

    def node(node_id: str, *, alive: bool = True) -> cluster.NodeView:
        ray = drained.get(node_id)
        return cluster.NodeView(
            node_id=node_id, address="10.0.0.1", alive=alive, cpus_total=2, cpus_free=2,
            gpus_total=0, gpus_free=0, drain=ray,
        )  # fmt: skip

    view = cluster.ClusterView(
        connected=True,
        nodes=[node(NODE_A), node(NODE_B), node(TWIN_1), node(TWIN_2), node("d" * 56, alive=False)],
    )
    with session_scope(client.app.state.session_factory) as s:  # type: ignore[attr-defined]
        cluster.publish(s, view)


def nodes_of(client: TestClient) -> dict[str, dict[str, Any]]:
    view = client.get("/v1/cluster").json()
    return {n["node_id"]: n for n in view["nodes"]}


def test_drain_shows_in_the_cluster_and_undrain_gives_it_back(client: TestClient) -> None:
    publish(client)
    before = time.time()
    made = client.post(
        f"/v1/cluster/nodes/{NODE_A}/drain", json={"deadline_s": 90, "reason": "kernel upgrade"}
    )
    assert made.status_code == 200, made.text
    body = made.json()
    assert (body["node_id"], body["reason"], body["source"]) == (NODE_A, "kernel upgrade", "admin")
    drain = nodes_of(client)[NODE_A]["drain"]
    assert drain["reason"] == "kernel upgrade" and drain["source"] == "admin"
    assert before + 89 < drain["deadline"] < time.time() + 91
    assert nodes_of(client)[NODE_B]["drain"] is None
    # Again: the new reason and deadline replace the old ones (no deadline: none).
    assert (
        client.post(f"/v1/cluster/nodes/{NODE_A}/drain", json={"reason": "now"}).status_code == 200
    )
    assert nodes_of(client)[NODE_A]["drain"]["deadline"] is None
    # A unique prefix names a node, as `elastrain cluster` shows them; no body is fine.
    assert client.post(f"/v1/cluster/nodes/{NODE_B[:12]}/drain").json()["node_id"] == NODE_B
    assert client.post(f"/v1/cluster/nodes/{NODE_A[:8]}/undrain").status_code == 200
    assert client.delete(f"/v1/cluster/nodes/{NODE_B}/drain").status_code == 200
    assert all(n["drain"] is None for n in nodes_of(client).values())
    again = client.post(f"/v1/cluster/nodes/{NODE_A}/undrain")
    assert again.status_code == 404 and "not drained" in again.json()["detail"]


def test_drains_survive_a_restart(settings: Settings) -> None:
    with TestClient(create_app(settings)) as client:
        publish(client)
        assert client.post(f"/v1/cluster/nodes/{NODE_A}/drain", json={"deadline_s": 60}).is_success
    with TestClient(create_app(settings)) as client:
        publish(client)  # the next scheduler's snapshot knows nothing of the drain
        assert nodes_of(client)[NODE_A]["drain"]["source"] == "admin"


@pytest.mark.parametrize(
    ("node", "body", "status", "says"),
    [
        ("f" * 56, {}, 404, "not an alive node"),
        ("d" * 56, {}, 404, "not an alive node"),  # dead: nothing to drain
        ("cccccc", {}, 422, "matches 2 nodes"),
        ("not-hex", {}, 422, "node_id"),
        ("a1a1", {}, 422, "node_id"),  # too short to name a node
        (NODE_A, {"deadline_s": 0}, 422, "deadline_s"),
        (NODE_A, {"deadline_s": -5}, 422, "deadline_s"),
        (NODE_A, {"deadline_s": 10**9}, 422, "deadline_s"),
        (NODE_A, {"deadline_s": "soon"}, 422, "deadline_s"),
        (NODE_A, {"reason": "x" * 501}, 422, "reason"),
        (NODE_A, {"reason": "\x1b[31mred"}, 422, "reason"),
        (NODE_A, {"grace": 5}, 422, "grace"),
    ],
)
def test_bad_drains_are_refused_clearly(
    client: TestClient, node: str, body: dict[str, Any], status: int, says: str
) -> None:
    publish(client)
    answer = client.post(f"/v1/cluster/nodes/{node}/drain", json=body)
    assert answer.status_code == status, answer.text
    assert says in answer.text
    assert all(n["drain"] is None for n in nodes_of(client).values())


def test_a_node_ray_drains_is_shown_and_not_undrained_here(client: TestClient) -> None:
    ray = cluster.DrainView(reason="spot notice", deadline=time.time() + 30, source="preemption")
    publish(client, **{NODE_B: ray})
    assert nodes_of(client)[NODE_B]["drain"]["source"] == "preemption"
    refused = client.post(f"/v1/cluster/nodes/{NODE_B}/undrain")
    assert refused.status_code == 409 and "drained by preemption" in refused.text
