"""The dashboard on a job that really trained and really lost a node.

`elastrain serve` (API + scheduler) on a real multi-node Ray cluster; a node is removed
mid-run; the job page must draw the real metric points and tell the story.
Set ELASTRAIN_SCREENSHOT_DIR to keep a screenshot of the page (docs/screenshot-job.png).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from ray.cluster_utils import Cluster

from tests.e2e.conftest import open_dashboard, wait_for_chart
from tests.e2e.server import serve_argv
from tests.integration.ray_service import tiny_gpt_spec, wait_for, wait_terminal

pytestmark = [pytest.mark.browser, pytest.mark.ray, pytest.mark.chaos]

STEPS = 300
EVAL_EVERY = 100


def test_job_that_lost_a_node_in_the_browser(
    page: Any, server_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A CPU's peak is the operator's to give: the raylets' worker processes inherit it.
    monkeypatch.setenv("ELASTRAIN_PEAK_FLOPS", "1e11")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    workers = [cluster.add_node(num_cpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    try:
        srv = server_factory(
            argv=serve_argv,
            env={
                "ELASTRAIN_RAY_ADDRESS": cluster.address,
                "ELASTRAIN_RAY_NAMESPACE": "elastrain-e2e",
                "ELASTRAIN_GROW_INTERVAL_S": "1000",  # stay shrunk: the story ends at 1 worker
            },
            startup_timeout=120,
        )
        # Long enough to still be training when the node goes: a warm 2-rank group of the
        # 32-wide model ran 60 steps in about a second, before the test could remove a node.
        spec = tiny_gpt_spec(
            "lost-a-node",
            scaling={"min_workers": 1, "max_workers": 2, "cpus_per_worker": 1},
            workload={"name": "gpt", "params": {"n_layer": 2, "n_embd": 64, "n_head": 2,
                                                "seq_len": 64, "eval_fraction": 0.05}},
            training={"max_steps": STEPS, "eval_every": EVAL_EVERY, "eval_samples": 64},
            checkpoint={"every_steps": 10},
        )  # fmt: skip
        job_id = srv.submit(spec)["id"]
        with srv.http() as http:
            wait_for(http, job_id, lambda j: j["state"] == "RUNNING" and j["step"] >= 25)
        with srv.http() as http:
            placement = next(
                e for e in http.get(f"/v1/jobs/{job_id}/events").json() if e["kind"] == "placement"
            )
        victim = next(n for n in workers if n.node_id == placement["details"]["ranks"]["1"])
        cluster.remove_node(victim)
        with srv.http() as http:
            job = wait_terminal(http, job_id, timeout=400)
        assert job["state"] == "SUCCEEDED", job
        assert job["attempt"] == 2 and job["world_size"] == 1, "the node went after the end"
        with srv.http() as http:
            metrics = http.get(f"/v1/jobs/{job_id}/metrics").json()
        assert [m["step"] for m in metrics] == list(range(1, STEPS + 1)), [
            (m["step"], m["attempt"]) for m in metrics
        ]

        open_dashboard(page, srv, f"/jobs/{job_id}")
        wait_for_chart(page, len(metrics))
        last_loss = page.evaluate("() => window.__elastrain.charts.loss.plot.data[1].at(-1)")
        assert last_loss == pytest.approx(metrics[-1]["loss"])
        # The held-out loss (every EVAL_EVERY steps, across the node loss) beside the loss.
        held = {m["step"]: m["eval_loss"] for m in metrics if "eval_loss" in m}
        assert sorted(held) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY))
        charted = page.evaluate(
            "() => window.__elastrain.charts.loss.plot.data[2].filter((v) => v != null)"
        )
        assert charted == pytest.approx([held[s] for s in sorted(held)])
        assert "held-out" in page.inner_text("#loss-readout")
        # MFU is charted against its own axis, and read out beside the chart.
        assert 0 < metrics[-1]["mfu"] < 1
        last_mfu = page.evaluate("() => window.__elastrain.charts.throughput.plot.data[2].at(-1)")
        assert last_mfu == pytest.approx(metrics[-1]["mfu"])
        readout = page.locator("#throughput-readout")
        assert "MFU " in readout.inner_text()
        assert readout.get_attribute("title") == "MFU: ELASTRAIN_PEAK_FLOPS"
        # Visible matches only: an event's collapsed JSON details may hold the same words
        # ("recovering_s" matches case-insensitively), and `.first` could pick that one.
        page.get_by_text("RECOVERING", exact=True).locator("visible=true").first.wait_for()
        page.get_by_text("resumed from step").locator("visible=true").first.wait_for()
        assert page.get_by_text("lost").count() > 0
        if os.environ.get("ELASTRAIN_SCREENSHOT_DIR"):
            out = Path(os.environ["ELASTRAIN_SCREENSHOT_DIR"]) / "screenshot-job.png"
            page.screenshot(path=str(out), full_page=True)
    finally:
        cluster.shutdown()
