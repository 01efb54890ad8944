"""Fixtures for end-to-end tests: a real server in a subprocess and a real headless Chromium.

- `server`: one API server (uvicorn, no scheduler) on a fresh SQLite file for the session.
- `server_factory(token=..., env=..., argv=...)`: more servers (each its own database),
  stopped after the test; `argv` runs something else, e.g. `elastrain serve` with the
  scheduler for tests that train for real.
- `browser`: Debian's /usr/bin/chromium driven by Playwright (no `playwright install`).
  Without either the browser tests FAIL, saying how to install them; leave them out on
  purpose with `-m 'not browser'`.
- `page`: a fresh browser context and page; uncaught page errors fail the test.
- `open_dashboard(page, srv, route)`: load the dashboard at a hash route;
  `wait_for_chart(page, n_points)`: until the job page's loss chart holds n points.

A test of a job that really trained:

    srv = server_factory(argv=serve_argv, env={"ELASTRAIN_RAY_ADDRESS": cluster.address})
    job = srv.submit(seed.spec("real", workload={"name": "synthetic"}, training={"max_steps": 40}))
    srv.wait_for_state(job["id"], {"SUCCEEDED"})
    metrics = srv.http().get(f"/v1/jobs/{job['id']}/metrics").json()
    open_dashboard(page, srv, f"/jobs/{job['id']}")
    wait_for_chart(page, len(metrics))

The helpers behind them live in `tests/e2e/server.py` (start_server, ServerHandle) and
`tests/e2e/seed.py` (job histories produced by the real scheduler on a fake cluster).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.server import ServerHandle, start_server

CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


def chromium_path() -> str | None:
    path = os.environ.get("ELASTRAIN_CHROMIUM", "/usr/bin/chromium")
    return path if Path(path).exists() else shutil.which("chromium")


def launch_chromium(playwright: Any) -> Any:
    path = chromium_path()
    if path is None:
        raise RuntimeError("no Chromium: apt-get install chromium chromium-driver")
    return playwright.chromium.launch(executable_path=path, args=CHROMIUM_ARGS, headless=True)


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    srv = start_server(tmp_path_factory.mktemp("server"))
    yield srv
    srv.stop()


@pytest.fixture
def server_factory(tmp_path: Path) -> Iterator[Callable[..., ServerHandle]]:
    started: list[ServerHandle] = []

    def make(**kwargs: Any) -> ServerHandle:
        srv = start_server(tmp_path / f"server-{len(started)}", **kwargs)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.stop()


#: Where a browser test without a browser fails (never skips: a skip would let CI pass
#: with the dashboard untested).
NO_BROWSER_HELP = (
    "install Chromium with `make test-deps` (.ci/setup-system chromium) and Playwright with "
    "pip install -e '.[test]'; to leave the browser tests out on purpose, deselect them: "
    "pytest -m 'not browser' (as `make test-fast` does)"
)


@pytest.fixture(scope="session")
def browser() -> Iterator[Any]:
    if chromium_path() is None:
        pytest.fail(f"Chromium is not installed: {NO_BROWSER_HELP}", pytrace=False)
    try:
        from playwright import sync_api
    except ImportError as exc:
        pytest.fail(f"Playwright cannot be imported ({exc}): {NO_BROWSER_HELP}", pytrace=False)
    with sync_api.sync_playwright() as pw:
        chromium = launch_chromium(pw)
        yield chromium
        chromium.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    context.set_default_timeout(15_000)
    pg = context.new_page()
    errors: list[str] = []
    pg.on("pageerror", lambda exc: errors.append(str(exc)))
    yield pg
    context.close()
    assert not errors, f"uncaught errors in the page: {errors}"


def open_dashboard(page: Any, srv: ServerHandle, route: str = "/") -> None:
    """Load the dashboard at `#<route>` and wait until its script has run."""
    page.goto(f"{srv.url}/#{route}")
    page.wait_for_function("() => window.__elastrain && window.__elastrain.route !== undefined")


def wait_for_chart(page: Any, n_points: int, chart: str = "loss") -> None:
    """Until the job page's `chart` (loss | throughput) holds exactly `n_points` steps."""
    page.wait_for_function(
        "([name, n]) => window.__elastrain.charts[name]?.plot.data[0].length === n",
        arg=[chart, n_points],
    )
