"""Take the dashboard screenshots in docs/ from a real server with seeded job records.

    python bench/screenshots.py [--out docs] [--theme light|dark]

Starts the API (uvicorn, fresh SQLite in a temp dir), seeds a varied job list (submitted
over REST, run by the real scheduler on a fake cluster: see tests/e2e/seed.py), and drives
Debian's Chromium with Playwright: docs/screenshot-list.png (the job list) and
docs/screenshot-job.png (a job that lost a node and grew back).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from playwright.sync_api import sync_playwright  # noqa: E402

from tests.e2e import seed  # noqa: E402
from tests.e2e.conftest import launch_chromium  # noqa: E402
from tests.e2e.server import start_server  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "docs")
    parser.add_argument("--theme", choices=["light", "dark"], default="light")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix="elastrain-shots-") as tmp:
        srv = start_server(Path(tmp))
        try:
            story = seed.showcase(srv)
            with sync_playwright() as pw:
                browser = launch_chromium(pw)
                context = browser.new_context(
                    viewport={"width": 1440, "height": 900},
                    device_scale_factor=1,
                    color_scheme=args.theme,
                )
                page = context.new_page()
                page.goto(f"{srv.url}/#/")
                page.locator("#jobs-table tr[data-job-id]").first.wait_for()
                time.sleep(2.5)  # a second poll, so the ETAs come from live rates
                page.screenshot(path=str(args.out / "screenshot-list.png"))

                page.goto(f"{srv.url}/#/jobs/{story.job_id}")
                page.wait_for_function(
                    "(n) => window.__elastrain.charts.loss?.plot.data[0].length === n",
                    arg=len(story.metric_steps),
                )
                page.wait_for_function(
                    "() => document.querySelectorAll('#events-table tbody tr').length > 1"
                )
                time.sleep(1)
                page.screenshot(path=str(args.out / "screenshot-job.png"), full_page=True)
                browser.close()
        finally:
            srv.stop()
    for name in ("screenshot-list.png", "screenshot-job.png"):
        print(args.out / name)


if __name__ == "__main__":
    main()
