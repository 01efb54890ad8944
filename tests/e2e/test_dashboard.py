"""The dashboard in a real headless Chromium against a real API server and real job records.

Jobs are submitted over REST and their runs are decided and written by the real scheduler,
stepped against a fake cluster whose drivers `seed.py` plays; the page must draw exactly
what the API serves.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest

from service import cluster
from service.states import JobState
from tests.e2e import seed
from tests.e2e.conftest import open_dashboard, wait_for_chart
from tests.e2e.server import ServerHandle

pytestmark = pytest.mark.browser


def mark_page(page: Any) -> None:
    """Tag the live document: if it is still there later, the page never reloaded."""
    page.evaluate("() => { window.__noReload = true; }")


def assert_not_reloaded(page: Any) -> None:
    assert page.evaluate("() => window.__noReload === true"), "the page reloaded"


def wait_text(page: Any, selector: str, text: str, *, start: bool = False) -> None:
    """Wait until the element's text contains (or starts with) `text`."""
    page.wait_for_function(
        "([sel, text, start]) => { const t = document.querySelector(sel)?.textContent ?? '';"
        " return start ? t.startsWith(text) : t.includes(text); }",
        arg=[selector, text, start],
    )


@pytest.fixture(scope="module")
def story(server: ServerHandle) -> seed.Story:
    return seed.elastic_job(server)


def test_list_shows_jobs_and_filters(page: Any, server: ServerHandle, story: seed.Story) -> None:
    other = seed.running_job(server, name="infra-smoke", step=40, labels={"team": "infra"})
    open_dashboard(page, server, "/")
    row = page.locator(f"#jobs-table tr[data-job-id='{story.job_id}']")
    row.wait_for()
    assert row.locator(".badge").inner_text() == "RUNNING"
    assert row.locator("td.name").inner_text() == "gpt-tiny-elastic"
    assert "262 / 300" in row.locator(".progress-cell").inner_text()
    assert re.search(r"ETA \d", row.locator(".progress-cell").inner_text())
    assert row.locator("td.loss").inner_text() == f"{story.last_loss:.4g}"
    assert "4 / 2..4" in row.inner_text()
    assert "size:tiny" in row.locator("td.labels").inner_text()

    page.fill("#f-label", "team:infra")
    page.wait_for_function(
        "(id) => { const r = [...document.querySelectorAll('#jobs-table tr[data-job-id]')];"
        " return r.length === 1 && r[0].dataset.jobId === String(id); }",
        arg=other,
    )
    assert "label=team%3Ainfra" in page.url or "label=team:infra" in page.url
    page.fill("#f-label", "")
    page.select_option("#f-state", "CANCELLED")
    page.wait_for_selector("#jobs-table tr.empty")
    assert "No jobs match" in page.inner_text("#jobs-table")


def test_list_updates_itself(page: Any, server: ServerHandle) -> None:
    # No restart allowed: the worker error below fails the job at once.
    job_id = seed.running_job(
        server, name="live-update", step=10, max_steps=100, failure={"max_restarts": 0}
    )
    open_dashboard(page, server, "/")
    row = page.locator(f"#jobs-table tr[data-job-id='{job_id}']")
    row.wait_for()
    assert "10 / 100" in row.inner_text()
    mark_page(page)
    seed.train(server, job_id, 50)
    page.wait_for_function(
        "(id) => document.querySelector(`#jobs-table tr[data-job-id='${id}'] .step`)"
        ".textContent.startsWith('50 /')",
        arg=job_id,
        timeout=10_000,
    )
    assert seed.fail(server, job_id, "rank 1: CUDA OOM") == JobState.FAILED
    page.wait_for_function(
        "(id) => document.querySelector(`#jobs-table tr[data-job-id='${id}'] .badge`)"
        ".textContent === 'FAILED'",
        arg=job_id,
        timeout=10_000,
    )
    assert_not_reloaded(page)


def test_job_page_draws_real_metrics(page: Any, server: ServerHandle, story: seed.Story) -> None:
    with server.http() as client:
        metrics = client.get(f"/v1/jobs/{story.job_id}/metrics").json()
        checkpoints = client.get(f"/v1/jobs/{story.job_id}/checkpoints").json()
    assert [m["step"] for m in metrics] == story.metric_steps
    requests: list[str] = []
    page.on("request", lambda r: requests.append(r.url))
    open_dashboard(page, server, f"/jobs/{story.job_id}")
    wait_for_chart(page, len(metrics))
    plotted = page.evaluate(
        "() => { const d = window.__elastrain.charts.loss.plot.data; return [d[0], d[1]]; }"
    )
    assert plotted[0] == [m["step"] for m in metrics]
    assert plotted[1] == [m["loss"] for m in metrics]
    assert page.locator("#chart-loss canvas").count() == 1
    # The legend (not hovering) and the readout show the newest loss.
    last = metrics[-1]["loss"]
    legend = page.locator("#chart-loss .u-legend .u-series").nth(1).locator(".u-value").inner_text()
    assert float(legend) == pytest.approx(last, rel=1e-4)
    assert float(page.get_attribute("#loss-readout", "data-last")) == last
    tput = page.evaluate("() => window.__elastrain.charts.throughput.plot.data[1]")
    assert tput == [m["samples_per_s"] for m in metrics]

    # World size over time: 4, down to 2 on the node loss, back to 4; markers of each kind.
    world = page.evaluate("() => window.__elastrain.charts.world.data")
    sizes = [v for v in world[1] if v]
    assert 4 in sizes and 2 in sizes and sizes[-1] == 4
    labels = page.evaluate("() => window.__elastrain.charts.world.plot.series.map(s => s.label)")
    for name in ("node lost", "resize", "resume", "checkpoint"):
        i = labels.index(name)
        assert any(v is not None for v in world[i]), f"no {name} marker"
    assert sum(v is not None for v in world[labels.index("checkpoint")]) == len(checkpoints)

    events = page.inner_text("#events-table")
    assert story.lost_node is not None
    lost = story.lost_node[:12]
    assert f"node {lost} lost (ranks [2, 3])" in events  # the scheduler's node_lost event
    assert f"node lost ({lost})" in events  # RUNNING -> RECOVERING
    assert "resumed from step 125 at world size 2" in events
    assert "4 → 2" in events
    rows = page.locator("#checkpoints-table tbody tr")
    assert rows.count() == len(checkpoints)
    assert rows.first.locator("td").first.inner_text() == f"{checkpoints[0]['step']:,}"
    assert "13.0 MiB" in page.inner_text("#checkpoints-table")
    # The newest attempt's rank-0 log; workers.loop logs every 10th step.
    wait_text(page, "#job-log", "step 260 loss")
    assert "resumed from" in page.inner_text("#job-log")
    assert json.loads(page.inner_text("#job-spec"))["name"] == "gpt-tiny-elastic"
    # Offline clusters: nothing is fetched from anywhere but the service itself.
    assert requests and all(u.startswith(server.url) or u.startswith("data:") for u in requests)


def test_job_page_shows_starts_and_recoveries(
    page: Any, server: ServerHandle, story: seed.Story
) -> None:
    with server.http() as client:
        events = client.get(f"/v1/jobs/{story.job_id}/events").json()
    timelines = [e for e in events if e["kind"] == "timeline"]
    # The story's three attempts: submitted, relaunched after the node loss, grown back.
    assert [t["details"]["cause"] for t in timelines] == ["submitted", "node lost", "resize"]
    open_dashboard(page, server, f"/jobs/{story.job_id}")
    rows = page.locator("#starts-table tbody tr[data-attempt]")
    page.wait_for_function(
        "() => document.querySelectorAll('#starts-table tbody tr[data-attempt]').length === 3"
    )
    assert [r.get_attribute("data-attempt") for r in rows.all()] == ["3", "2", "1"]  # newest first
    heading = page.locator("#starts-table").evaluate(
        "t => document.getElementById(t.closest('section').getAttribute('aria-labelledby'))"
        ".textContent"
    )
    assert heading == "Starts and recoveries"

    recovery = page.locator("#starts-table tr[data-attempt='2']")
    details = timelines[1]["details"]
    assert recovery.locator("td.cause").inner_text() == "node lost"
    assert recovery.locator("td.total").inner_text() == f"{details['total_s']:.2f} s"
    # Where the state came from: the checkpoint the relaunched group resumed from.
    assert recovery.locator("td.restored").inner_text() == "checkpoint step 125"
    assert page.locator("#starts-table tr[data-attempt='1'] td.restored").inner_text() == (
        "fresh start"
    )
    assert page.locator("#starts-table tr[data-attempt='3'] td.cause").inner_text() == "resize"

    # A segment per phase after detection, titled, as wide as its seconds.
    segs = recovery.locator(".phase-bar .seg").evaluate_all(
        "els => els.map(e => [e.title, e.getBoundingClientRect().width])"
    )
    phases = [p for p in details["phases"] if p["phase"] != "detected"]
    assert [t.split(":")[0] for t, _ in segs] == [p["phase"].replace("_", " ") for p in phases]
    placed = next(p for p in phases if p["phase"] == "placed")
    assert f"placed: {placed['seconds']:.2f} s — {placed['detail']}" in [t for t, _ in segs]
    widths = {t.split(":")[0]: w for t, w in segs}
    seconds = {p["phase"].replace("_", " "): p["seconds"] for p in phases}
    assert widths["processes up"] / widths["group formed"] == pytest.approx(
        seconds["processes up"] / seconds["group formed"], rel=0.05
    )
    assert "state restored: " in recovery.locator(".phase-bar").get_attribute("aria-label")

    # The world-size chart marks each attempt's first step, where its start ended.
    world = page.evaluate("() => window.__elastrain.charts.world.data")
    labels = page.evaluate("() => window.__elastrain.charts.world.plot.series.map(s => s.label)")
    marks = world[labels.index("first step (timeline)")]
    at = [world[0][i] for i, v in enumerate(marks) if v is not None]
    assert at == pytest.approx([t["details"]["phases"][-1]["at"] for t in timelines])
    assert [v for v in marks if v is not None] == [4, 2, 4]
    assert page.locator("#events-table tr[data-kind='first_step']").count() == 3

    # A job that has not started yet says so.
    pending = server.submit(seed.spec("no-starts-yet"))["id"]
    open_dashboard(page, server, f"/jobs/{pending}")
    wait_text(page, "#starts-table tbody", "No starts recorded yet")
    with server.http() as client:
        client.post(f"/v1/jobs/{pending}/cancel").raise_for_status()


def test_job_page_appends_new_points(page: Any, server: ServerHandle) -> None:
    job_id = seed.running_job(server, name="append", step=30, max_steps=100)
    open_dashboard(page, server, f"/jobs/{job_id}")
    page.wait_for_function("() => window.__elastrain.charts.loss?.plot.data[0].length === 30")
    mark_page(page)
    seed.train(server, job_id, 40)
    page.wait_for_function("() => window.__elastrain.charts.loss.plot.data[0].length === 40")
    # Only the new points travelled (since_step), and they were appended in order.
    assert page.evaluate("() => window.__elastrain.perf.metrics.points") == 10
    steps = page.evaluate("() => window.__elastrain.charts.loss.plot.data[0]")
    assert steps == list(range(1, 41))
    assert page.inner_text("#stat-step").startswith("40 /")
    assert_not_reloaded(page)


def test_submit_shows_api_errors_verbatim(page: Any, server: ServerHandle) -> None:
    bad = seed.spec("bad-scaling", scaling={"min_workers": 3, "max_workers": 2})
    with server.http() as client:
        res = client.post("/v1/jobs", json=bad)
    assert res.status_code == 422
    expected = res.json()["detail"]

    open_dashboard(page, server, "/submit")
    yaml_text = (
        "name: bad-scaling\nworkload:\n  name: gpt\nscaling:\n  min_workers: 3\n  max_workers: 2\n"
    )
    page.fill("#spec-input", yaml_text)
    page.click("#submit-btn")
    page.wait_for_selector("#submit-errors .error-item")
    shown = page.locator("#submit-errors .msg").all_inner_texts()
    assert shown == [d["msg"] for d in expected]
    assert page.locator("#submit-errors .loc").first.inner_text() == ".".join(
        map(str, expected[0]["loc"])
    )
    # The error points at the line to fix.
    assert page.locator("#submit-errors button", has_text="line").count() >= 1

    # An unknown field, in JSON this time.
    page.fill(
        "#spec-input", json.dumps({"name": "x", "workload": {"name": "gpt"}, "colour": "red"})
    )
    page.click("#submit-btn")
    wait_text(page, "#submit-errors .msg", "colour: unknown field", start=True)
    # A YAML syntax error never reaches the API.
    page.fill("#spec-input", "name: [unclosed\n")
    page.click("#submit-btn")
    wait_text(page, "#submit-errors .msg", "YAML:", start=True)

    # A valid spec goes through and lands on the new job's page.
    page.fill(
        "#spec-input", "name: from-the-browser\nworkload: {name: synthetic}\nlabels: {via: ui}\n"
    )
    page.click("#submit-btn")
    page.wait_for_url(re.compile(r"#/jobs/\d+$"))
    job_id = int(page.url.rsplit("/", 1)[1])
    wait_text(page, "#job-title", "from-the-browser")
    with server.http() as client:
        job = client.get(f"/v1/jobs/{job_id}").json()
    assert job["name"] == "from-the-browser" and job["labels"] == {"via": "ui"}
    assert page.inner_text("#job-state") == "PENDING"


def test_cancel_asks_then_changes_state_live(page: Any, server: ServerHandle) -> None:
    pending = server.submit(seed.spec("to-cancel"))["id"]
    open_dashboard(page, server, f"/jobs/{pending}")
    wait_text(page, "#job-state", "PENDING")
    mark_page(page)

    # Dismissing the confirmation cancels nothing.
    page.once("dialog", lambda d: d.dismiss())
    page.click("#cancel-btn")
    time.sleep(0.5)
    with server.http() as client:
        assert client.get(f"/v1/jobs/{pending}").json()["state"] == "PENDING"

    dialogs: list[str] = []

    def accept(dialog: Any) -> None:
        dialogs.append(dialog.message)
        dialog.accept()

    page.once("dialog", accept)
    page.click("#cancel-btn")
    wait_text(page, "#job-state", "CANCELLED")
    assert "to-cancel" in dialogs[0]
    assert page.locator("#cancel-btn").is_disabled()
    assert "cancelled by user" in page.inner_text("#events-table")
    assert_not_reloaded(page)


def test_cancel_running_job(page: Any, server: ServerHandle) -> None:
    job_id = seed.running_job(server, name="running-cancel", step=20)
    open_dashboard(page, server, f"/jobs/{job_id}")
    wait_text(page, "#job-state", "RUNNING")
    mark_page(page)
    page.once("dialog", lambda d: d.accept())
    page.click("#cancel-btn")
    # A running job is stopped by the scheduler: first the request shows...
    wait_text(page, "#job-reason", "cancel requested")
    assert "cancel requested" in page.inner_text("#events-table")
    # ...then the scheduler's pass stops the driver; the change arrives without a reload.
    seed.scheduler_pass(server)
    wait_text(page, "#job-state", "CANCELLED")
    assert_not_reloaded(page)


def test_checkpoint_now(page: Any, server: ServerHandle) -> None:
    job_id = seed.running_job(server, name="ckpt-now", step=5)
    open_dashboard(page, server, f"/jobs/{job_id}")
    button = page.locator("#checkpoint-btn")
    page.wait_for_function("() => !document.querySelector('#checkpoint-btn').disabled")
    button.click()
    wait_text(page, "#job-reason", "checkpoint requested")
    assert button.is_disabled()
    assert "checkpoint requested by user" in page.inner_text("#events-table")
    with server.http() as client:
        assert client.get(f"/v1/jobs/{job_id}").json()["checkpoint_requested"] is True


def test_token_is_asked_once_and_kept(page: Any, server_factory: Any) -> None:
    srv = server_factory(token="s3cret-t0ken")
    srv.submit(seed.spec("private-job"))
    open_dashboard(page, srv, "/")
    dialog = page.locator("#token-dialog")
    dialog.wait_for(state="visible")
    page.fill("#token-input", "wrong")
    page.click("#token-ok")
    # Refused: asked again, saying why.
    page.wait_for_function(
        "() => document.querySelector('#token-dialog').open"
        " && !document.querySelector('#token-error').hidden"
    )
    page.fill("#token-input", "s3cret-t0ken")
    page.click("#token-ok")
    page.locator("#jobs-table tr[data-job-id]").first.wait_for()
    assert "private-job" in page.inner_text("#jobs-table")
    assert page.evaluate("() => sessionStorage.getItem('elastrain.token')") == "s3cret-t0ken"
    # Kept for the session: other views and a reload do not ask again.
    page.reload()
    page.locator("#jobs-table tr[data-job-id]").first.wait_for()
    page.goto(f"{srv.url}/#/cluster")
    page.wait_for_selector("#cluster-note:not(:empty)")
    assert not page.evaluate("() => document.querySelector('#token-dialog').open")
    assert page.is_visible("#signout")


NODES = [
    {"node_id": "head0000a1b2c3", "address": "10.0.0.1", "alive": True, "cpus_total": 8,
     "cpus_free": 2, "gpus_total": 1, "gpus_free": 1, "jobs": [1]},
    {"node_id": "work0000d4e5f6", "address": "10.0.0.2", "alive": True, "cpus_total": 8,
     "cpus_free": 6, "gpus_total": 0, "gpus_free": 0, "jobs": [1]},
    {"node_id": "work0000deadbe", "address": "10.0.0.3", "alive": False, "cpus_total": 8,
     "cpus_free": 0, "gpus_total": 0, "gpus_free": 0, "jobs": []},
]  # fmt: skip


def _publish_cluster(srv: ServerHandle) -> None:
    """Write a cluster snapshot into the server's database, as the scheduler does on every
    pass. The API serves it as connected while it is younger than 15 s."""
    view = cluster.ClusterView(
        connected=True,
        nodes=[cluster.NodeView(**n) for n in NODES],
        dashboard_url="127.0.0.1:8265",
        updated_at=time.time(),
    )
    with srv.session() as s:
        cluster.publish(s, view)


def test_cluster_panel(page: Any, server_factory: Any) -> None:
    srv = server_factory()
    _publish_cluster(srv)
    assert httpx.get(f"{srv.url}/v1/cluster").json()["connected"] is True
    open_dashboard(page, srv, "/cluster")
    page.wait_for_selector("#cluster-nodes .node")
    assert page.locator("#cluster-nodes .node.alive").count() == 2
    lost = page.locator("#cluster-nodes .node.lost")
    assert lost.count() == 1 and "LOST" in lost.inner_text() and "10.0.0.3" in lost.inner_text()
    summary = page.inner_text("#cluster-summary")
    assert "8 / 16" in summary  # CPUs used of the alive nodes
    assert "1 lost" in summary
    assert page.get_attribute("#ray-dashboard", "href") == "http://127.0.0.1:8265"
    head = page.locator("#cluster-nodes .node", has_text="10.0.0.1")
    assert "6 / 8 used" in head.inner_text()
    head.locator("a.chip", has_text="#1").click()
    page.wait_for_url(re.compile(r"#/jobs/1$"))
