"""`POST /v1/plan` and `elastrain plan`: the memory plan of a spec, without submitting it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session, sessionmaker

from elastrain.service import cluster
from elastrain.service.db import session_scope
from tests.factories import spec_dict

GIB = 2**30
BIG = {"n_layer": 24, "n_embd": 2048, "n_head": 16, "seq_len": 1024}


def big_spec(**scaling: Any) -> dict[str, Any]:
    return spec_dict(
        workload={"name": "gpt", "params": BIG},
        scaling={"min_workers": 1, "max_workers": 8, **scaling},
        training={"global_batch_size": 32, "micro_batch_size": 4,
                  "activation_checkpointing": "full"},
    )  # fmt: skip


def test_a_plan_per_world_size(client: TestClient) -> None:
    made = client.post("/v1/plan", json={"spec": big_spec(), "device_memory_bytes": 16 * GIB})
    assert made.status_code == 200, made.text
    body = made.json()
    assert [p["world_size"] for p in body["plans"]] == list(range(1, 9))
    assert body["params"] > 1_000_000_000 and body["memory_source"] == "device_memory_bytes"
    choices = {p["world_size"]: p["choice"] for p in body["plans"]}
    # 16 bytes a parameter do not fit one 16 GiB worker; sharded over enough of them, they do.
    assert choices[1] is None and choices[8] == "fsdp"
    eight = body["plans"][-1]
    assert [r["strategy"] for r in eight["rows"]][:6] == [
        "ddp", "fsdp", "pipeline", "tp2", "fsdp+tp2", "pipeline+tp2",
    ]  # fmt: skip
    assert "ddp needs" in eight["why"]


@pytest.mark.parametrize(
    ("body", "field", "words"),
    [
        ({"spec": spec_dict(workload={"entrypoint": "m:f"})}, "spec.workload", "built-in"),
        (
            {"spec": spec_dict(scaling={"use_gpu": True, "gpus_per_worker": 1})},
            "device_memory_bytes",
            "required for GPU jobs",
        ),
        ({"spec": spec_dict(), "device_memory_bytes": 0}, "device_memory_bytes", "greater"),
        ({"spec": {"name": "x"}}, "spec.workload", "Field required"),
    ],
)
def test_plans_it_cannot_make_are_422(
    client: TestClient, body: dict, field: str, words: str
) -> None:  # type: ignore[type-arg]
    response = client.post("/v1/plan", json=body)
    assert response.status_code == 422, response.text
    assert field in response.json()["message"] and words in response.json()["message"]


def test_cpu_workers_are_planned_against_their_share_of_the_nodes(
    client: TestClient, app_sessions: sessionmaker[Session]
) -> None:
    no_view = client.post("/v1/plan", json={"spec": spec_dict()})
    assert no_view.status_code == 422  # no scheduler has said what the nodes hold
    nodes = [
        cluster.NodeView(node_id="a", address="10.0.0.1", alive=True, cpus_total=8, cpus_free=8,
                         gpus_total=0, gpus_free=0, memory_bytes=32 * GIB),
        cluster.NodeView(node_id="b", address="10.0.0.2", alive=True, cpus_total=4, cpus_free=4,
                         gpus_total=0, gpus_free=0, memory_bytes=8 * GIB),
    ]  # fmt: skip
    with session_scope(app_sessions) as s:
        cluster.publish(s, cluster.ClusterView(connected=True, nodes=nodes))
    made = client.post("/v1/plan", json={"spec": spec_dict(scaling={"cpus_per_worker": 2})})
    assert made.status_code == 200, made.text
    # The poorer node: 2 of its 4 CPUs, so half of its 8 GiB.
    assert made.json()["device_memory_bytes"] == 4 * GIB
    assert made.json()["plans"][0]["choice"] == "ddp"


def test_the_cli_prints_the_plan(tmp_path: Path, client: TestClient) -> None:
    from typer.testing import CliRunner

    from elastrain.api import cli

    spec_file = tmp_path / "big.yaml"
    spec_file.write_text(yaml.safe_dump(big_spec()))

    class InProcess(cli.Api):
        def __init__(self, url: str, token: str | None) -> None:
            super().__init__(url, token)
            self.http = client

    original = cli.Api
    cli.Api = InProcess  # type: ignore[misc]
    try:
        out = CliRunner().invoke(
            cli.app, ["plan", str(spec_file), "--device-memory", "16GiB", "--world-size", "8"]
        )
        bad = CliRunner().invoke(cli.app, ["plan", str(spec_file), "--device-memory", "lots"])
    finally:
        cli.Api = original  # type: ignore[misc]
    assert out.exit_code == 0, out.output
    assert "world size 8:" in out.stdout and "STRATEGY" in out.stdout
    assert "choice: fsdp:" in out.stdout and "14.40 GiB usable of 16.00 GiB" in out.stdout
    assert bad.exit_code == 2 and "not a size" in bad.output


def test_auto_is_refused_where_no_plan_can_be_made_or_nothing_fits(
    client: TestClient, settings: Any
) -> None:
    from elastrain.api.main import create_app

    custom = spec_dict(workload={"entrypoint": "m:f"}, strategy={"kind": "auto"})
    response = client.post("/v1/jobs", json=custom)
    assert response.status_code == 422
    assert "strategy.kind: 'auto' plans from the model's size" in response.json()["message"]
    accepted = client.post("/v1/jobs", json=big_spec() | {"strategy": {"kind": "auto"}})
    assert accepted.status_code == 201  # no memory figure yet: planned at every launch
    assert accepted.json()["strategy"] == "auto"

    small = settings.model_copy(update={"worker_memory_bytes": 2 * GIB})
    with TestClient(create_app(small, start_scheduler=False)) as tight:
        refused = tight.post("/v1/jobs", json=big_spec() | {"strategy": {"kind": "auto"}})
    assert refused.status_code == 422
    message = refused.json()["message"]
    assert message.startswith(
        "strategy.kind: auto: nothing fits 1.80 GiB per worker at world size 8"
    )
