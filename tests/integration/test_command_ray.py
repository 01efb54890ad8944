"""Command jobs on a real multi-node Ray cluster: an unmodified torchrun script
(examples/torchrun/train.py: DDP over gloo, its own checkpoint, nothing of elastrain)
loses a node, restarts at the smaller world size, resumes from its own checkpoint and
finishes, then grows back when a node returns; a script's `report` points reach the metrics; a failing script fails the job
with its stderr's last line, without restarting forever."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from elastrain.api.workdir import pack
from tests.integration.cluster_service import Nodes, multi_node_service
from tests.integration.ray_service import submit, wait_for, wait_terminal

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torchrun"
STEPS = 100

REPORTING = """
import json
import os
import torch
import torch.distributed as dist
from elastrain.workers.user_api import report

dist.init_process_group("gloo")
names = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
         "MASTER_PORT", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_RUN_ID", "ELASTRAIN_JOB_DIR")
print("env", json.dumps({n: os.environ[n] for n in names}), flush=True)
for step in range(1, 6):
    t = torch.tensor(dist.get_rank() * 1.0 + step)
    dist.all_reduce(t)
    report(step, loss=float(t), tokens=step * 10)
dist.destroy_process_group()
"""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[TestClient, Nodes]]:
    tmp = tmp_path_factory.mktemp("command")
    # grow_warm_wait_s=0: the script's 100 steps could end at 2 before a new node's warm
    # process is up under load; this test is about the script's resume and resize.
    with multi_node_service(
        tmp, worker_nodes=3, restart_backoff_s=0.2, grow_interval_s=2, grow_warm_wait_s=0
    ) as (
        client,
        nodes,
    ):
        client.app.state.tmp = tmp  # type: ignore[attr-defined]
        yield client, nodes


def upload_dir(client: TestClient, root: Path) -> str:
    packed = pack(root)
    try:
        response = client.post("/v1/packages", content=packed.archive.read_bytes(),
                               headers={"Content-Type": "application/zip"})  # fmt: skip
        assert response.status_code in (200, 201), response.text
        return str(response.json()["digest"])
    finally:
        packed.archive.unlink(missing_ok=True)


def command_job(name: str, command: list[str], *, package: str | None = None,
                workers: tuple[int, int] = (1, 3), restarts: int = 3) -> dict[str, Any]:  # fmt: skip
    workload: dict[str, Any] = {"command": command}
    if package is not None:
        workload["package"] = package
    return {
        "name": name,
        "workload": workload,
        "scaling": {"min_workers": workers[0], "max_workers": workers[1], "cpus_per_worker": 1},
        "failure": {"max_restarts": restarts},
    }


def logs(client: TestClient, job_id: int, attempt: int) -> str:
    """The attempt's logs, every rank's, without the `[attempt-001-rank-0] ` tags."""
    response = client.get(f"/v1/jobs/{job_id}/logs", params={"attempt": attempt})
    assert response.status_code == 200, response.text
    return re.sub(r"(?m)^\[attempt-\d+-rank-\d+\] ", "", str(response.json()["text"]))


def test_report_points_reach_the_metrics_and_the_env_is_torchruns(
    cluster: tuple[TestClient, Nodes], tmp_path: Path
) -> None:
    client, _ = cluster
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "rep.py").write_text(REPORTING)
    digest = upload_dir(client, tmp_path / "pkg")
    job_id = submit(client, command_job("rep", ["python", "rep.py"], package=digest,
                                        workers=(2, 2)))  # fmt: skip
    final = wait_terminal(client, job_id, timeout=300)
    assert final["state"] == "SUCCEEDED", final
    points = client.get(f"/v1/jobs/{job_id}/metrics").json()
    # rank 0 reports the all-reduced sum: (0 + step) + (1 + step)
    assert [(p["step"], p["loss"], p["tokens"]) for p in points] == [
        (s, 2.0 * s + 1, s * 10) for s in range(1, 6)
    ]
    text = logs(client, job_id, 1)
    envs = [
        json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("env ")
    ]
    assert sorted(e["RANK"] for e in envs) == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["TORCHELASTIC_RESTART_COUNT"] for e in envs} == {"0"}
    assert {(e["LOCAL_RANK"], e["LOCAL_WORLD_SIZE"]) for e in envs} == {("0", "1")}  # a node each
    assert sorted(e["GROUP_RANK"] for e in envs) == ["0", "1"]
    assert len({e["MASTER_ADDR"] + ":" + e["MASTER_PORT"] for e in envs}) == 1
    assert {e["ELASTRAIN_JOB_DIR"] for e in envs} == {
        str(client.app.state.tmp / "storage" / "jobs" / str(job_id) / "files")  # type: ignore[attr-defined]
    }


def test_a_failing_script_fails_the_job_with_its_stderr(cluster: tuple[TestClient, Nodes]) -> None:
    client, _ = cluster
    script = "import sys; print('oops: bad --lr', file=sys.stderr); sys.exit(3)"
    job_id = submit(client, command_job("bad", ["python", "-c", script], workers=(1, 1)))
    final = wait_terminal(client, job_id, timeout=300)
    assert final["state"] == "FAILED", final
    assert "exit code 3: oops: bad --lr" in final["state_reason"], final
    assert final["attempt"] <= 3  # the same error again and again: given up, not looping


def test_an_unmodified_torchrun_script_loses_a_node_resumes_and_grows_back(
    cluster: tuple[TestClient, Nodes],
) -> None:
    client, nodes = cluster
    digest = upload_dir(client, EXAMPLE)
    command = ["python", "train.py", "--steps", str(STEPS), "--save-every", "5",
               "--step-time", "0.25"]  # fmt: skip
    job_id = submit(client, command_job("byo", command, package=digest))
    ckpt = client.app.state.tmp / "storage" / "jobs" / str(job_id) / "files" / "ckpt.pt"  # type: ignore[attr-defined]

    def saved_step() -> int:
        try:
            return int(torch.load(ckpt, weights_only=True)["step"])
        except (OSError, RuntimeError, EOFError):
            return 0

    running = wait_for(client, job_id, lambda j: j["state"] == "RUNNING" and saved_step() >= 10,
                       what="a checkpoint at step 10", timeout=300)  # fmt: skip
    assert running["world_size"] == 3
    placement = next(
        e["details"]["ranks"]
        for e in client.get(f"/v1/jobs/{job_id}/events").json()
        if e["kind"] == "placement"
    )
    nodes.remove(nodes.node_of(placement["2"]))
    # RUNNING from the moment its scripts started; wait until they train at 2 (the node
    # that comes back would otherwise stop them before they resumed).
    shrunk = wait_for(
        client,
        job_id,
        lambda j: j["attempt"] == 2 and "world_size 2" in logs(client, job_id, 2),
        what="training at 2",
        timeout=300,
    )
    assert shrunk["world_size"] == 2
    nodes.add(1)  # capacity for 3 again: every rank is stopped and started at 3
    final = wait_terminal(client, job_id, timeout=400)
    assert final["state"] == "SUCCEEDED", final
    assert final["restarts"] == 0  # neither a lost node nor a resize is the job's fault
    assert final["world_size"] == 3 and final["attempt"] == 3
    assert saved_step() == STEPS

    first, second, third = (logs(client, job_id, a) for a in (1, 2, 3))
    assert "world_size 3" in first
    resumed = re.search(r"resumed from step (\d+) at world size 2 \(restart 1\)", second)
    assert resumed is not None, second
    assert int(resumed.group(1)) >= 10
    grown = re.search(r"resumed from step (\d+) at world size 3 \(restart 2\)", third)
    assert grown is not None, third
    # Each attempt trains on from the checkpoint it found, to the end or until stopped.
    steps = [int(s) for s in re.findall(r"^step (\d+) loss", third, re.M)]
    assert steps == list(range(int(grown.group(1)) + 1, STEPS + 1))
    assert int(grown.group(1)) > int(resumed.group(1))
    story = [e for e in client.get(f"/v1/jobs/{job_id}/events").json()]
    assert any(e["kind"] == "node_lost" for e in story)
    assert any("growing 2 -> 3" in (e["reason"] or "") for e in story)
