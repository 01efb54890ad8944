"""A user's own code, shipped with the job: a working directory that is not installed
anywhere is submitted with the CLI, trains on a multi-node Ray cluster, survives the loss
of a node, and every attempt runs exactly the uploaded package. Its prints, warnings,
native output and tracebacks are in the job's logs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import yaml
from ray.cluster_utils import Cluster
from typer.testing import CliRunner

from elastrain.api import cli
from tests.e2e.server import serve_argv, start_server
from tests.integration.ray_service import wait_for, wait_terminal

pytestmark = [pytest.mark.ray, pytest.mark.chaos]

MODEL = '''\
"""A user's regression model: nothing of it is installed on the cluster."""
import os
import time
import warnings

import torch
from torch import nn

from elastrain.workers.api import Workload
from wd_regressor.data import make_data


def build(hidden: int = 32, slow_s: float = 0.0, fail: bool = False) -> Workload:
    print(f"wd_regressor: building hidden={hidden}")
    warnings.warn("wd_regressor: a user's warning")
    os.write(2, b"wd_regressor: below Python \\x1b]0;title\\x07\\n")  # as a native library would
    if fail:
        raise ValueError("wd_regressor: no such data")
    x, y = make_data()

    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        # slow_s keeps the run long enough to lose a node in the middle of it.
        time.sleep(slow_s)
        return nn.functional.mse_loss(out, target)

    model = nn.Sequential(nn.Linear(8, hidden), nn.Tanh(), nn.Linear(hidden, 1))
    return Workload(model=model, dataset=list(zip(x, y)), loss_fn=loss)
'''
DATA = """\
import torch


def make_data(n: int = 512):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(n, 8, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()
"""
MAX_STEPS = 400


def _project(root: Path) -> Path:
    (root / "wd_regressor").mkdir(parents=True)
    (root / "wd_regressor" / "__init__.py").write_text("")
    (root / "wd_regressor" / "model.py").write_text(MODEL)
    (root / "wd_regressor" / "data.py").write_text(DATA)
    (root / "runs").mkdir()
    (root / "runs" / "old.ckpt").write_bytes(b"\0" * 10_000)
    (root / ".elastrainignore").write_text("runs/\n")
    return root


def test_an_uninstalled_working_dir_trains_loses_a_node_and_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert importlib.util.find_spec("wd_regressor") is None  # really not installed
    project = _project(tmp_path / "project")
    spec_file = tmp_path / "job.yaml"
    spec_file.write_text(
        yaml.safe_dump(
            {
                "name": "own-code",
                "workload": {
                    "entrypoint": "wd_regressor.model:build",
                    "params": {"hidden": 32, "slow_s": 0.03},
                },
                "scaling": {"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
                "training": {
                    "global_batch_size": 32,
                    "micro_batch_size": 8,
                    "max_steps": MAX_STEPS,
                    "learning_rate": 0.01,
                },
                "checkpoint": {"every_steps": 20, "async_save": False},
                "failure": {"max_restarts": 2},
            }
        )
    )
    cache = tmp_path / "package-cache"
    monkeypatch.setenv("ELASTRAIN_PACKAGE_CACHE", str(cache))  # the raylets' workers inherit it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    nodes = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    env = {"ELASTRAIN_RAY_ADDRESS": cluster.address, "ELASTRAIN_RAY_NAMESPACE": "elastrain-wd"}
    server = start_server(tmp_path, argv=serve_argv, env=env, startup_timeout=120)
    try:
        submitted = CliRunner().invoke(
            cli.app, ["--url", server.url, "submit", str(spec_file), "--working-dir", str(project)]
        )
        assert submitted.exit_code == 0, submitted.output
        job_id = int(submitted.stdout.split()[0])
        digest = submitted.stderr.split()[1]
        with server.http() as http:
            files = http.get(f"/v1/packages/{digest}").json()["files"]
            assert "runs/old.ckpt" not in {f["path"] for f in files}
            wait_for(
                http,
                job_id,
                lambda j: j["state"] == "RUNNING" and j["world_size"] == 2 and j["step"] >= 25,
                what="step 25 at world size 2",
                timeout=300,
            )
            placement = next(
                e["details"]["ranks"]
                for e in http.get(f"/v1/jobs/{job_id}/events").json()
                if e["kind"] == "placement"
            )
            victim = next(n for n in nodes if n.node_id == placement["1"])
            cluster.remove_node(victim)
            final = wait_terminal(http, job_id, timeout=400)
            assert final["state"] == "SUCCEEDED", final
            assert final["attempt"] >= 2 and final["world_size"] == 1
            assert final["restarts"] == 0  # a lost node is not the job's fault
            events = http.get(f"/v1/jobs/{job_id}/events").json()
            steps = [m["step"] for m in http.get(f"/v1/jobs/{job_id}/metrics").json()]
        assert steps == list(range(1, MAX_STEPS + 1))
        assert any(e["kind"] == "node_lost" for e in events)
        # Every attempt says which package its workers verified and imported: the same one.
        runs = {e["attempt"]: e["details"]["digest"] for e in events if e["kind"] == "package"}
        assert sorted(runs) == list(range(1, final["attempt"] + 1)), events
        assert set(runs.values()) == {digest}
        assert (cache / digest.removeprefix("sha256:") / "files" / "wd_regressor").is_dir()

        status = CliRunner().invoke(cli.app, ["--url", server.url, "status", str(job_id)])
        assert f"package:          {digest}" in status.stdout
        assert "wd_regressor.model:build" in status.stdout

        # What the factory printed, warned and wrote below Python, on every rank, escaped.
        for attempt in (1, final["attempt"]):
            shown = _logs(server.url, job_id, attempt)
            for rank in (0, 1) if attempt == 1 else (0,):
                assert f"[rank {rank}] INFO output: wd_regressor: building hidden=32" in shown
            assert "UserWarning: wd_regressor: a user's warning" in shown
            assert "wd_regressor: below Python \\x1b]0;title\\x07" in shown, shown
        # A factory that prints and raises: its print and its traceback are in the logs.
        failing = spec_file.parent / "failing.yaml"
        raw = yaml.safe_load(spec_file.read_text())
        raw["workload"]["params"] = {"fail": True}
        raw["scaling"] = {"min_workers": 1, "max_workers": 1, "cpus_per_worker": 1}
        failing.write_text(yaml.safe_dump(raw))
        again = CliRunner().invoke(
            cli.app, ["--url", server.url, "submit", str(failing), "--working-dir", str(project)]
        )
        assert again.exit_code == 0, again.output
        with server.http() as http:
            failed = wait_terminal(http, int(again.stdout.split()[0]), timeout=120)
        assert failed["state"] == "FAILED", failed
        shown = _logs(server.url, failed["id"], 1)
        assert "output: wd_regressor: building hidden=32" in shown
        assert "ValueError: wd_regressor: no such data" in shown and "Traceback" in shown
    finally:
        server.stop()
        cluster.shutdown()


def _logs(url: str, job_id: int, attempt: int) -> str:
    shown = CliRunner().invoke(
        cli.app, ["--url", url, "logs", str(job_id), "--attempt", str(attempt)]
    )
    assert shown.exit_code == 0, shown.output
    return shown.stdout
