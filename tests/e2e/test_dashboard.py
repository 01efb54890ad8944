"""The dashboard in a real headless Chromium against a real API server and real job records.

Jobs are submitted over REST and their runs are decided and written by the real scheduler,
stepped against a fake cluster whose drivers `seed.py` plays; the page must draw exactly
what the API serves.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from elastrain.api.security import DASHBOARD_CSP
from elastrain.service import auth, cluster
from elastrain.service.states import JobState
from tests.e2e import seed
from tests.e2e.conftest import open_dashboard, wait_for_chart
from tests.e2e.server import ServerHandle

pytestmark = pytest.mark.browser


def mark_page(page: Any) -> None:
    """Tag the live document: if it is still there later, the page never reloaded."""
    page.evaluate("() => { window.__noReload = true; }")


def assert_not_reloaded(page: Any) -> None:
    assert page.evaluate("() => window.__noReload === true"), "the page reloaded"


def record_requests_that_change_state(page: Any) -> None:
    """From now on the live document keeps `window.__sent`: "METHOD path" of every request
    it sends other than a GET (the dashboard sends all of them through `fetch`)."""
    page.evaluate(
        "() => { window.__sent = []; const send = window.fetch;"
        " window.fetch = (url, init) => { const method = (init && init.method) || 'GET';"
        " if (method !== 'GET') window.__sent.push(`${method} ${url}`);"
        " return send(url, init); }; }"
    )


def wait_text(page: Any, selector: str, text: str, *, start: bool = False) -> None:
    """Wait until the element's text contains (or starts with) `text`."""
    page.wait_for_function(
        "([sel, text, start]) => { const t = document.querySelector(sel)?.textContent ?? '';"
        " return start ? t.startsWith(text) : t.includes(text); }",
        arg=[selector, text, start],
    )


@pytest.fixture(scope="module", autouse=True)
def stories(server: ServerHandle) -> tuple[seed.Story, seed.Story]:
    """The two elastic stories, seeded before any other job on the server whichever tests
    run: each grows onto a node that joins for it, and a job seeded earlier with room to
    grow (`seed.running_job`: 2 of up to 4 workers) would be given that node instead."""
    finished = seed.elastic_job(server, name="gpt-tiny-finished", stop_at=None)
    return finished, seed.elastic_job(server)


@pytest.fixture
def finished(stories: tuple[seed.Story, seed.Story]) -> seed.Story:
    """The elastic story run to the end: SUCCEEDED, so its goodput no longer moves."""
    return stories[0]


@pytest.fixture
def story(stories: tuple[seed.Story, seed.Story]) -> seed.Story:
    """The elastic story left RUNNING at step 262 (lost a node, grew back)."""
    return stories[1]


def fmt_duration(seconds: float) -> str:
    """util.js `fmtDuration`, for durations of a minute to an hour."""
    s = round(seconds)
    assert 60 <= s < 3600
    return f"{s // 60}m {s % 60:02d}s"


def shown_percent(text: str) -> int:
    match = re.fullmatch(r"(\d+)%", text.strip())
    assert match, text
    return int(match.group(1))


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
    assert "ddp" in row.inner_text()
    # A 2-D job: the list and the job page name the tensor-parallel degree.
    wide = seed.running_job(
        server, name="wide", step=5, strategy={"kind": "fsdp", "tensor_parallel": 2}
    )
    wide_row = page.locator(f"#jobs-table tr[data-job-id='{wide}']")
    wide_row.wait_for()
    assert "fsdp+tp2" in wide_row.inner_text()

    open_dashboard(page, server, f"/jobs/{wide}")
    page.wait_for_function("() => document.body.innerText.includes('fsdp+tp2')")
    open_dashboard(page, server, "/")
    row.wait_for()
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
    # The newest attempt's rank-0 log; elastrain.workers.loop logs every 10th step.
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

    # A segment per phase after the first mark, titled, as wide as its seconds.
    segs = recovery.locator(".phase-bar .seg").evaluate_all(
        "els => els.map(e => [e.title, e.getBoundingClientRect().width])"
    )
    phases = details["phases"][1:]  # the first mark is where the clock starts
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


#: The goodput buckets in the bar's order (api/static/js/goodput.js) and their API fields.
GOODPUT_BUCKETS = {
    "training": "training_s",
    "recomputed": "recomputed_s",
    "recovering": "recovering_s",
    "resizing": "resizing_s",
    "checkpoint_stall": "checkpoint_stall_s",
    "starting": "starting_s",
    "queued": "queued_s",
    "other": "other_s",
}


def test_job_page_shows_goodput(page: Any, server: ServerHandle, finished: seed.Story) -> None:
    with server.http() as client:
        job = client.get(f"/v1/jobs/{finished.job_id}").json()
    assert job["state"] == "SUCCEEDED"
    g = job["goodput"]
    wall = g["wall_s"]
    # The seeded story spends time in every bucket: queued, a start, training, a node loss
    # (steps 126-137 recomputed, a recovery), a resize, checkpoint saves.
    for key, field in GOODPUT_BUCKETS.items():
        assert g[field] > 0, (key, g)
    assert sum(g[f] for f in GOODPUT_BUCKETS.values()) == pytest.approx(wall, abs=0.01)
    assert 0.5 < g["goodput"] < 1
    assert g["goodput"] == pytest.approx(g["training_s"] / wall, abs=1e-4)

    open_dashboard(page, server, f"/jobs/{finished.job_id}")
    page.wait_for_selector("#goodput-bar .gp-seg")
    heading = page.locator("#goodput-panel").evaluate(
        "p => document.getElementById(p.getAttribute('aria-labelledby')).textContent"
    )
    assert heading == "Goodput"
    # The headline: the API's ratio as a whole percent.
    shown = shown_percent(page.inner_text("#goodput-value"))
    assert abs(shown - 100 * g["goodput"]) <= 0.5

    # One segment per bucket, in order, each as wide (its style: a share of the bar) as
    # its share of the wall time.
    segs = page.locator("#goodput-bar .gp-seg").evaluate_all(
        "els => els.map(e => [e.dataset.bucket, parseFloat(e.style.width),"
        " e.getBoundingClientRect().width])"
    )
    assert [b for b, _, _ in segs] == list(GOODPUT_BUCKETS)
    for bucket, width, _ in segs:
        share = 100 * g[GOODPUT_BUCKETS[bucket]] / wall
        assert width == pytest.approx(share, rel=0.01, abs=0.01), bucket
    assert sum(w for _, w, _ in segs) == pytest.approx(100, abs=0.05)
    # Drawn that wide too (small segments keep a few pixels, so only the big one here).
    bar_px = page.locator("#goodput-bar").evaluate("e => e.clientWidth")
    training_px = next(px for b, _, px in segs if b == "training")
    assert training_px / bar_px == pytest.approx(g["training_s"] / wall, abs=0.01)

    # Colour is not the only cue: the bar states the numbers, the legend has them in text.
    label = page.get_attribute("#goodput-bar", "aria-label")
    assert label.startswith(f"Goodput {shown}% of ")
    assert f"training {fmt_duration(g['training_s'])} ({shown}%)" in label
    assert "recomputed " in label and "checkpoint stalls " in label
    assert page.get_attribute("#goodput-bar", "title") == label
    items = page.locator("#goodput-legend li[data-bucket]")
    assert items.evaluate_all("els => els.map(e => e.dataset.bucket)") == list(GOODPUT_BUCKETS)
    training = page.locator("#goodput-legend li[data-bucket='training']")
    expected = ["training", *fmt_duration(g["training_s"]).split(), f"{shown}%"]
    assert training.inner_text().split() == expected
    recomputed = page.locator("#goodput-legend li[data-bucket='recomputed']").inner_text()
    share = 100 * g["recomputed_s"] / wall
    assert share < 9.95  # shown with a decimal
    assert recomputed.split()[::2] == ["recomputed", f"{share:.1f}%"]

    # The list has it too, as a column.
    open_dashboard(page, server, "/")
    cell = page.locator(f"#jobs-table tr[data-job-id='{finished.job_id}'] td.goodput")
    cell.wait_for()
    assert cell.inner_text() == f"{shown}%"
    assert "spent on training steps the job kept" in (cell.get_attribute("title") or "")


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
    # The header follows at the poll after its job read (read before the metrics: a poll
    # can carry the new points and the old step, as CI saw under load).
    page.wait_for_function(
        "() => document.querySelector('#stat-step').innerText.startsWith('40 /')"
    )
    # The goodput panel follows: the ten new steps' seconds count as training.
    with server.http() as client:
        training = client.get(f"/v1/jobs/{job_id}").json()["goodput"]["training_s"]
    page.wait_for_function(
        "(s) => Number(document.querySelector('#goodput-legend li[data-bucket=training]')"
        "?.dataset.seconds) === s",
        arg=training,
    )
    assert_not_reloaded(page)


def test_a_prepare_job_shows_files_rows_bytes_tokens_and_its_eta(
    page: Any, server: ServerHandle
) -> None:
    """A prepare job's steps are progress points: the page shows what it has read and
    when it will be done, from the job's last point, not a step count."""

    def point(step: int, fraction: float, eta_s: float) -> dict[str, Any]:
        return {
            "step": step, "loss": None, "tokens_per_s": 250_000.0, "samples_per_s": 900.0,
            "rows": 1000 * step, "bytes": int(12 * 2**20 * fraction), "tokens": 250_000 * step,
            "files_done": step, "files": 4, "progress": fraction, "eta_s": eta_s,
        }  # fmt: skip

    job_id = seed.prepare_job(server, [point(1, 0.25, 150.0), point(2, 0.5, 95.0)])
    open_dashboard(page, server, f"/jobs/{job_id}")
    wait_text(page, "#stat-files", "files 2 / 4")
    assert page.inner_text("#stat-rows") == "2,000 rows"
    assert page.inner_text("#stat-bytes").strip() == "· 6.0 MiB"
    assert page.inner_text("#stat-tokens") == "500,000"
    assert page.inner_text("#stat-prepare-eta").strip() == f"ETA {fmt_duration(95)}"
    assert page.get_attribute(".stat .progress", "aria-valuenow") == "50"
    assert page.query_selector("#stat-step") is None  # no step count of a training job
    wait_text(page, "#throughput-readout", "250.0k tokens/s")


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
    # A built-in workload's params are checked at submit: each bad key named, with why.
    page.fill("#spec-input", "name: x\nworkload:\n  name: gpt\n  params: {n_layer: 0, bogus: 1}\n")
    page.click("#submit-btn")
    wait_text(page, "#submit-errors .msg", "workload.params.n_layer: Input should be greater")
    wait_text(page, "#submit-errors .msg", "workload.params.bogus: unknown parameter of 'gpt'")
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

    record_requests_that_change_state(page)
    dialogs: list[str] = []

    def answer(accept: bool) -> Callable[[Any], None]:
        def handle(dialog: Any) -> None:
            dialogs.append(dialog.message)
            if accept:
                dialog.accept()
            else:
                dialog.dismiss()

        return handle

    # Dismissing the confirmation cancels nothing. The click handler would send the cancel
    # in the same turn of the page's event loop as the question (job.js `cancel`), so
    # once the page runs the next script, anything it was going to send has been sent.
    page.once("dialog", answer(accept=False))
    page.click("#cancel-btn")
    assert page.evaluate("() => window.__sent") == []
    assert len(dialogs) == 1 and page.locator("#cancel-btn").is_enabled()
    with server.http() as client:
        assert client.get(f"/v1/jobs/{pending}").json()["state"] == "PENDING"

    page.once("dialog", answer(accept=True))
    page.click("#cancel-btn")
    wait_text(page, "#job-state", "CANCELLED")
    assert page.evaluate("() => window.__sent") == [f"POST /v1/jobs/{pending}/cancel"]
    assert "to-cancel" in dialogs[1]
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


#: The operator's token (`ELASTRAIN_API_TOKEN`: an admin of the "default" tenant).
OPERATOR_TOKEN = "s3cret-t0ken-of-the-operator"


def test_token_is_asked_once_and_kept(page: Any, server_factory: Any) -> None:
    srv = server_factory(token=OPERATOR_TOKEN)
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
    page.fill("#token-input", OPERATOR_TOKEN)
    page.click("#token-ok")
    page.locator("#jobs-table tr[data-job-id]").first.wait_for()
    assert "private-job" in page.inner_text("#jobs-table")
    assert page.evaluate("() => sessionStorage.getItem('elastrain.token')") == OPERATOR_TOKEN
    # Kept for the session: other views and a reload do not ask again.
    page.reload()
    page.locator("#jobs-table tr[data-job-id]").first.wait_for()
    page.goto(f"{srv.url}/#/cluster")
    page.wait_for_selector("#cluster-note:not(:empty)")
    assert not page.evaluate("() => document.querySelector('#token-dialog').open")
    assert page.is_visible("#signout")


def test_top_bar_says_who_you_are(page: Any, server: ServerHandle, server_factory: Any) -> None:
    # Without authentication: nothing to sign in as, said quietly.
    open_dashboard(page, server, "/")
    whoami = page.locator("#whoami")
    whoami.wait_for()
    assert whoami.inner_text() == "no auth"
    assert "muted" in (whoami.get_attribute("class") or "")
    assert page.is_hidden("#signout")

    srv = server_factory(token=OPERATOR_TOKEN)
    with srv.session() as s:
        row, token = auth.create_token(s, tenant="vision", name="e2e")
        token_id = row.id
    with srv.http() as client:
        me = client.get("/v1/me", headers={"Authorization": f"Bearer {token}"}).json()
    assert me == {"tenant": "vision", "admin": False, "auth": True}
    open_dashboard(page, srv, "/")
    page.locator("#token-dialog").wait_for(state="visible")
    assert page.is_hidden("#whoami")  # nobody yet
    page.fill("#token-input", token)
    page.click("#token-ok")
    wait_text(page, "#whoami", "vision")
    assert page.inner_text("#whoami .whoami-tenant") == "vision"
    assert page.locator("#whoami .whoami-admin").count() == 0
    mark_page(page)

    # The token is revoked: the next poll is refused, the token dropped and asked again;
    # the top bar follows the new one (an admin's) without a reload.
    with srv.http() as client:
        client.delete(f"/v1/tokens/{token_id}").raise_for_status()
    page.wait_for_function(
        "() => document.querySelector('#token-dialog').open"
        " && !document.querySelector('#token-error').hidden"
    )
    assert page.is_hidden("#whoami")
    page.fill("#token-input", OPERATOR_TOKEN)
    page.click("#token-ok")
    wait_text(page, "#whoami", "admin")
    assert page.inner_text("#whoami .whoami-tenant") == "default"
    assert "admin" in (page.get_attribute("#whoami", "title") or "")
    assert_not_reloaded(page)


#: Run in every document before its own scripts: keeps the page's CSP violation reports.
CSP_LISTENER = """
window.__csp = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.__csp.push(`${e.violatedDirective}: ${e.blockedURI || "inline"} (${e.sourceFile}:${e.lineNumber})`);
});
"""


def test_no_console_errors_or_csp_violations(
    page: Any, server: ServerHandle, story: seed.Story
) -> None:
    """Every view, exercised a little, under the dashboard's strict CSP: nothing refused,
    nothing logged as an error."""
    page.add_init_script(CSP_LISTENER)
    console: list[str] = []
    page.on(
        "console",
        lambda m: (
            console.append(f"{m.type}: {m.text}")
            if m.type == "error" or "Content Security Policy" in m.text
            else None
        ),
    )
    response = page.goto(f"{server.url}/#/")
    assert response is not None and response.headers["content-security-policy"] == DASHBOARD_CSP
    page.wait_for_function("() => window.__elastrain && window.__elastrain.route === '/'")
    page.locator(f"#jobs-table tr[data-job-id='{story.job_id}']").wait_for()
    page.wait_for_selector("#whoami:not([hidden])")

    page.click(f"#jobs-table tr[data-job-id='{story.job_id}'] td.name a")
    wait_for_chart(page, len(story.metric_steps))
    page.wait_for_selector("#goodput-bar .gp-seg")
    page.wait_for_selector("#events-table tbody tr[data-event-id]")
    wait_text(page, "#job-log", "step 260 loss")
    for _ in range(2):  # both themes: the charts are rebuilt in the other's colours
        page.click("#theme")
    page.locator("#events-table details summary").first.click()

    page.click("nav a[data-nav='cluster']")
    page.wait_for_selector("#cluster-note:not(:empty)")

    page.click("nav a[data-nav='submit']")
    page.fill("#spec-input", "name: [unclosed\n")  # parsed by js-yaml, never sent
    page.click("#submit-btn")
    wait_text(page, "#submit-errors .msg", "YAML:", start=True)
    page.get_by_role("button", name="Load example").click()

    page.click("nav a[data-nav='list']")
    page.locator("#jobs-table tr[data-job-id]").first.wait_for()

    # A violation is reported a little later (its event is queued), and Chromium's console
    # says so too. So cause one on purpose, an inline script added by hand, and wait for
    # both: reports and console messages come in order, so any the views caused are in by
    # then, before this one.
    with page.expect_console_message(lambda m: "Content Security Policy" in m.text):
        page.evaluate(
            "() => { const s = document.createElement('script');"
            " s.textContent = 'window.__inlineRan = true'; document.head.append(s); }"
        )
    page.wait_for_function("() => window.__csp.length > 0")
    assert page.evaluate("() => window.__inlineRan") is None  # refused
    violations = page.evaluate("() => window.__csp")
    assert len(violations) == 1 and violations[0].startswith("script-src"), violations
    assert [c for c in console if "Content Security Policy" not in c] == []


NODES = [
    {"node_id": "head0000a1b2c3", "address": "10.0.0.1", "alive": True, "cpus_total": 8,
     "cpus_free": 2, "gpus_total": 1, "gpus_free": 1, "jobs": [1]},
    {"node_id": "work0000d4e5f6", "address": "10.0.0.2", "alive": True, "cpus_total": 8,
     "cpus_free": 6, "gpus_total": 0, "gpus_free": 0, "jobs": [1], "warming": True},
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
    # Just joined, its worker processes still starting: said on the node and in the summary.
    assert "1 warming" in summary
    joined = page.locator("#cluster-nodes .node", has_text="10.0.0.2")
    assert joined.locator(".badge").inner_text() == "WARMING"
    assert page.get_attribute("#ray-dashboard", "href") == "http://127.0.0.1:8265"
    head = page.locator("#cluster-nodes .node", has_text="10.0.0.1")
    assert "6 / 8 used" in head.inner_text()
    head.locator("a.chip", has_text="#1").click()
    page.wait_for_url(re.compile(r"#/jobs/1$"))
